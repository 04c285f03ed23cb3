"""SGLang 0.5.23's own model code, run on the CPU (no server, no GPU): process groups, KV pools, batches.

What it takes (established on CPU-only machines):
* no ``SGLANG_USE_CPU_ENGINE`` (that pulls the CUDA-built sgl_kernel);
* world-size-1 (or 2) process groups on gloo: ``init_distributed_environment(backend="gloo")``, the
  topology SGLang's ``initialize_model_parallel`` reads, a free TCP port; NCCL kept out with
  ``SGLANG_NCCL_SO_PATH=/nonexistent`` (else the group coordinator tries to build a NCCL communicator
  on cpu);
* ``sglang.srt.layers.rotary_embedding.base._is_cpu = True`` before building models (its
  constructor otherwise imports vllm);
* ``TorchNativeAttnBackend`` over a ``ReqToTokenPool`` + ``MHATokenToKVPool`` (or
  ``MLATokenToKVPool``), called inside ``forward_context(ForwardContext(attn_backend=...))`` after
  ``init_forward_metadata``; ``ForwardBatch`` built by hand (EXTEND, TARGET_VERIFY with the prefix
  already in the KV cache, DECODE, DRAFT_EXTEND_V2); only chain verification (topk=1) is faithful
  under torch_native.

Used by the replay (``doctor.sglang_draft``: the draft's own SGLang class scores wirings) and, through
``eagle3_ops.demos.sglang_cpu_harness``, by the demo and the tests. Never imported by the plugin.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import List, Optional

import torch

DEVICE = "cpu"


def cpu_environment() -> None:
    """Before SGLang's distributed code runs: no NCCL, no CPU engine (see the module docstring)."""
    os.environ.setdefault("SGLANG_NCCL_SO_PATH", "/nonexistent")
    os.environ.pop("SGLANG_USE_CPU_ENGINE", None)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS's pick), for a process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_initialized = False


def init_distributed(tp_size: int = 1, rank: int = 0, port: Optional[int] = None) -> None:
    """gloo groups for this process (world size ``tp_size``; all ranks must use the same port)."""
    global _initialized
    if _initialized:
        return
    cpu_environment()
    from sglang.srt.distributed import parallel_state
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    if parallel_state.model_parallel_is_initialized():  # this process's groups exist already: use them
        _initialized = True
        return

    port = free_port() if port is None else port
    init_distributed_environment(world_size=tp_size, rank=rank, local_rank=rank, backend="gloo",
                                 distributed_init_method=f"tcp://127.0.0.1:{port}")
    # the topology initialize_model_parallel reads (what sglang.test.test_utils.publish_build_topology does; that
    # module is not imported: it reads CUDA_VISIBLE_DEVICES[0] at import, which an empty value breaks)
    reset_context()
    publish(ServerArgs(model_path="dummy", tp_size=tp_size, ep_size=1, pp_size=1), role="test",
            ranks=SpawnRanks(world_rank=rank))
    if parallel_state._WORLD is not None:
        get_parallel().override_permanently(world_group=parallel_state._WORLD)
    initialize_model_parallel(backend="gloo")
    import sglang.srt.layers.rotary_embedding.base as rope_base

    rope_base._is_cpu = True
    _initialized = True


def construct(cls, config, dtype: torch.dtype):
    """``cls(config)`` with ``dtype`` as the default dtype (SGLang creates parameters in it).

    SGLang's scaled RoPE classes (``DeepseekScalingRotaryEmbedding``: the YaRN ``rope_scaling`` of every published
    Kimi-K2.5 / DeepSeek-V3 config) ask ``get_device()`` for an accelerator at construction and raise without one
    (``RuntimeError: No accelerator ... is available``); here their device is the CPU, as every other module's."""
    import sys

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    patched = [(m, m.get_device) for name, m in list(sys.modules.items())
               if name.startswith("sglang.srt.layers.rotary_embedding") and callable(getattr(m, "get_device", None))]
    for m, _ in patched:
        m.get_device = lambda *a, **k: DEVICE
    try:
        return cls(config)
    finally:
        for m, original in patched:
            m.get_device = original
        torch.set_default_dtype(previous)


# ---- KV cache + attention backend -----------------------------------------------------------------
class KVCache:
    """Pools and a TorchNativeAttnBackend for one model; hands out KV slots sequentially."""

    def __init__(self, config, dtype: torch.dtype, tp_size: int = 1, size: int = 2048, max_reqs: int = 16,
                 max_context: int = 256, num_layers: Optional[int] = None):
        from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

        self.device = DEVICE
        self.req_to_token_pool = ReqToTokenPool(size=max_reqs, max_context_len=max_context, device=DEVICE,
                                                enable_memory_saver=False)
        layers = num_layers or config.num_hidden_layers
        if getattr(config, "kv_lora_rank", None):
            from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

            self.token_to_kv_pool = MLATokenToKVPool(
                size=size, page_size=1, dtype=dtype, kv_lora_rank=config.kv_lora_rank,
                qk_rope_head_dim=config.qk_rope_head_dim, layer_num=layers, device=DEVICE,
                enable_memory_saver=False)
        else:
            from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

            head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
            self.token_to_kv_pool = MHATokenToKVPool(
                size=size, page_size=1, dtype=dtype, head_num=max(config.num_key_value_heads // tp_size, 1),
                head_dim=head_dim, layer_num=layers, device=DEVICE, enable_memory_saver=False)
        self.backend = TorchNativeAttnBackend(self)
        if getattr(config, "kv_lora_rank", None):
            # DeepSeek MLA: torch_native only implements the absorbed (MQA over the latent cache)
            # form; SGLang's default choice for a fresh prefill is the MHA form, which needs a
            # flash backend. Name the backend so deepseek_v2 picks MLA for every batch.
            self.backend.prefill_attention_backend_str = _mla_only_backend_name()
            self.backend.decode_attention_backend_str = _mla_only_backend_name()
        self.next_loc = 1  # slot 0 is the pool's padding slot
        self.next_req = 0

    def alloc(self, n: int) -> torch.Tensor:
        """The next ``n`` KV slots, int64 [n]: handed out in order, never reused (slot 0 is padding)."""
        locs = torch.arange(self.next_loc, self.next_loc + n, dtype=torch.int64)
        self.next_loc += n
        return locs

    def new_req(self) -> int:
        """The next request-pool index (0, 1, 2, ...)."""
        self.next_req += 1
        return self.next_req - 1


def _mla_only_backend_name() -> str:
    from sglang.srt.models.deepseek_common.attention_backend_handler import AttentionBackendRegistry
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import AttnForwardMethod

    name = "eagle3_ops_test_torch_native_mla"
    AttentionBackendRegistry.register(name, lambda attn, forward_batch: AttnForwardMethod.MLA)
    return name


@dataclass
class Req:
    """One request: its slot in req_to_token and the tokens whose KV is in the cache."""
    pool_index: int
    tokens: List[int] = field(default_factory=list)


def fill_req_to_token(kv: KVCache, req: Req, start: int, locs: torch.Tensor) -> None:
    """Point ``req``'s token positions ``start..start+len(locs)`` at KV slots ``locs`` (SGLang's req_to_token
    table, as its scheduler fills it)."""
    kv.req_to_token_pool.req_to_token[req.pool_index, start:start + locs.numel()] = locs.to(torch.int32)


def extend_batch(kv: KVCache, reqs: List[Req], new_tokens: List[List[int]], *, mode: str = "EXTEND",
                 capture: str = "FULL", spec_info=None):
    """An EXTEND (or TARGET_VERIFY) batch appending ``new_tokens[i]`` to ``reqs[i]`` (the prefix is
    what is already in the KV cache). Updates the requests."""
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode

    prefix = [len(r.tokens) for r in reqs]
    ext = [len(t) for t in new_tokens]
    total = [p + e for p, e in zip(prefix, ext)]
    locs = kv.alloc(sum(ext))
    pt = 0
    for r, p, e in zip(reqs, prefix, ext):
        fill_req_to_token(kv, r, p, locs[pt:pt + e])
        pt += e
    ids = torch.tensor([t for ts in new_tokens for t in ts], dtype=torch.int64)
    positions = torch.cat([torch.arange(p, p + e) for p, e in zip(prefix, ext)])
    start_loc = torch.tensor([0] + list(torch.cumsum(torch.tensor(ext), 0)[:-1].tolist()), dtype=torch.int64)
    fb = ForwardBatch(
        forward_mode=getattr(ForwardMode, mode), batch_size=len(reqs), input_ids=ids,
        req_pool_indices=torch.tensor([r.pool_index for r in reqs], dtype=torch.int64),
        seq_lens=torch.tensor(total, dtype=torch.int64), out_cache_loc=locs, seq_lens_sum=sum(total),
        seq_lens_cpu=torch.tensor(total, dtype=torch.int64), positions=positions,
        extend_num_tokens=sum(ext), extend_seq_lens=torch.tensor(ext, dtype=torch.int64),
        extend_prefix_lens=torch.tensor(prefix, dtype=torch.int64), extend_start_loc=start_loc,
        extend_prefix_lens_cpu=prefix, extend_seq_lens_cpu=ext, extend_logprob_start_lens_cpu=list(ext),
        capture_hidden_mode=getattr(CaptureHiddenMode, capture), spec_info=spec_info)
    for r, ts in zip(reqs, new_tokens):
        r.tokens.extend(ts)
    return fb


def decode_batch(kv: KVCache, reqs: List[Req], next_tokens: List[int], *, capture: str = "LAST",
                 spec_info=None):
    """A DECODE batch: one token per request."""
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode

    prefix = [len(r.tokens) for r in reqs]
    locs = kv.alloc(len(reqs))
    for i, r in enumerate(reqs):
        fill_req_to_token(kv, r, prefix[i], locs[i:i + 1])
        r.tokens.append(next_tokens[i])
    total = [p + 1 for p in prefix]
    fb = ForwardBatch(
        forward_mode=ForwardMode.DECODE, batch_size=len(reqs),
        input_ids=torch.tensor(next_tokens, dtype=torch.int64),
        req_pool_indices=torch.tensor([r.pool_index for r in reqs], dtype=torch.int64),
        seq_lens=torch.tensor(total, dtype=torch.int64), out_cache_loc=locs, seq_lens_sum=sum(total),
        seq_lens_cpu=torch.tensor(total, dtype=torch.int64), positions=torch.tensor(prefix, dtype=torch.int64),
        capture_hidden_mode=getattr(CaptureHiddenMode, capture), spec_info=spec_info)
    return fb


def run(model, fb, kv: KVCache, input_embeds: Optional[torch.Tensor] = None):
    """One SGLang forward of ``model`` on ``fb`` (returns its LogitsProcessorOutput); ``input_embeds``: passed on
    (an EAGLE-3 head whose embedding SGLang replaces with the target's), else the model embeds ``fb.input_ids``."""
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    kv.backend.init_forward_metadata(fb)
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=kv.backend)):
        if input_embeds is None:
            return model(fb.input_ids, fb.positions, fb)
        return model(fb.input_ids, fb.positions, fb, input_embeds=input_embeds)
