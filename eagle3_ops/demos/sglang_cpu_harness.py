"""A CPU harness that runs SGLang 0.5.23's own model code (no server, no GPU).

What it takes (established on CPU-only machines):
* no ``SGLANG_USE_CPU_ENGINE`` (that pulls the CUDA-built sgl_kernel);
* world-size-1 (or 2) process groups on gloo: ``init_distributed_environment(backend="gloo")``,
  ``publish_build_topology(...)``, ``initialize_model_parallel(backend="gloo")``, a free TCP port;
  NCCL kept out with ``SGLANG_NCCL_SO_PATH=/nonexistent`` (else the group coordinator tries to
  build a NCCL communicator on cpu);
* ``sglang.srt.layers.rotary_embedding.base._is_cpu = True`` before building models (its
  constructor otherwise imports vllm);
* ``TorchNativeAttnBackend`` over a ``ReqToTokenPool`` + ``MHATokenToKVPool`` (or
  ``MLATokenToKVPool``), called inside ``forward_context(ForwardContext(attn_backend=...))`` after
  ``init_forward_metadata``; ``ForwardBatch`` built by hand (EXTEND, TARGET_VERIFY with the prefix
  already in the KV cache, DECODE); only chain verification (topk=1) is faithful under torch_native;
* dynamo off: SGLang torch.compiles a few helpers (the vocab-parallel embedding at TP>1, MoE top-k)
  and each new shape costs seconds of compile on 2 cores. Worker processes call
  ``disable_dynamo()``; in a shared process scope it with ``torch._dynamo.config.patch(disable=True)``.

Model parameters are created uninitialised: load weights with ``load_weights`` (the tests load a
random Hugging Face model's, so HF ``output_hidden_states`` is the reference) or fill them from a
seed. Used by tests/sglang (the HF references live there) and by ``python -m eagle3_ops demo``.
Test scaffolding, not used by the plugin itself.
"""
from __future__ import annotations

import os

os.environ.setdefault("SGLANG_NCCL_SO_PATH", "/nonexistent")
os.environ.pop("SGLANG_USE_CPU_ENGINE", None)

import socket  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from typing import Dict, List, Optional, Sequence  # noqa: E402

import torch  # noqa: E402

DEVICE = "cpu"


def disable_dynamo() -> None:
    """For worker processes only (it is process-wide): at TP>1 SGLang torch.compiles the
    vocab-parallel embedding, ~18 s of inductor on 2 cores for nothing a test looks at."""
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    import torch._dynamo

    torch._dynamo.config.disable = True


# ---- process groups -------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_initialized = False


def init_distributed(tp_size: int = 1, rank: int = 0, port: Optional[int] = None) -> None:
    """gloo groups for this process (world size ``tp_size``; all ranks must use the same port)."""
    global _initialized
    if _initialized:
        return
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from sglang.test.test_utils import publish_build_topology

    port = free_port() if port is None else port
    init_distributed_environment(world_size=tp_size, rank=rank, local_rank=rank, backend="gloo",
                                 distributed_init_method=f"tcp://127.0.0.1:{port}")
    publish_build_topology(world_rank=rank, tp_size=tp_size, ep_size=1, pp_size=1)
    initialize_model_parallel(backend="gloo")
    import sglang.srt.layers.rotary_embedding.base as rope_base

    rope_base._is_cpu = True
    _initialized = True


def plugin_install() -> bool:
    """Register and apply the eagle3_ops SGLang hooks in this process (what load_plugins does)."""
    from eagle3_ops.sglang import install

    return install()


def configure_capture(model, layer_ids: Optional[Sequence[int]], eagle: bool = True) -> None:
    """SGLang's own configuration call (the one ModelRunner makes before CUDA-graph capture).
    Looked up on the module at call time, so it is the hooked version once the plugin is applied."""
    from sglang.srt.model_executor.model_runner_components import attention_backend_setup as abs_

    abs_.configure_aux_hidden_state_capture(
        model=model, eagle_use_aux_hidden_state=eagle,
        eagle_aux_hidden_state_layer_ids=list(layer_ids) if layer_ids is not None else None,
        dflash_use_aux_hidden_state=False, dflash_target_layer_ids=None, is_dspark=False)


# ---- tiny models ----------------------------------------------------------------------------------
# Shared by the tiny llama/qwen configs (decoder sizes small enough for CPU tests).
_TINY_DECODER = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                     rms_norm_eps=1e-6, tie_word_embeddings=False)


def _llama_cfg(**kw):
    from transformers import LlamaConfig

    return LlamaConfig(**{**_TINY_DECODER, **kw})


def _qwen2_cfg(**kw):
    from transformers import Qwen2Config

    return Qwen2Config(**{**_TINY_DECODER, **kw})


def _qwen3_cfg(**kw):
    from transformers import Qwen3Config

    return Qwen3Config(**{**_TINY_DECODER, "head_dim": 16, **kw})


def _qwen3_moe_cfg(**kw):
    from transformers import Qwen3MoeConfig

    base = dict(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                mlp_only_layers=[], num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False)
    base.update(kw)
    return Qwen3MoeConfig(**base)


def _deepseek_v2_cfg(**kw):
    from transformers import DeepseekV2Config

    base = dict(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
                moe_layer_freq=1, n_group=1, topk_group=1, topk_method="greedy", norm_topk_prob=False,
                routed_scaling_factor=1.0, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8,
                qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
                tie_word_embeddings=False, rope_scaling=None)
    base.update(kw)
    cfg = DeepseekV2Config(**base)
    # fields SGLang's deepseek_v2 reads that the HF V2 config does not define (V2 defaults)
    for name, value in dict(scoring_func="softmax", n_group=1, topk_group=1, topk_method="greedy").items():
        if getattr(cfg, name, None) is None:
            setattr(cfg, name, value)
    cfg.architectures = ["DeepseekV2ForCausalLM"]
    return cfg


def _gpt_oss_cfg(**kw):
    from transformers import GptOssConfig

    # alternating sliding/full attention, attention sinks, biased experts with the clamped SwiGLU,
    # YaRN (gpt-oss's factor 32, original context scaled down to the tiny one). Unquantized weights.
    # The window (32) is longer than the tests' sequences, so HF and SGLang's window conventions agree.
    base = dict(vocab_size=128, hidden_size=64, intermediate_size=48, num_local_experts=4,
                num_experts_per_tok=2, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, sliding_window=32, layer_types=["sliding_attention", "full_attention"] * 2,
                max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
                rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0,
                                     beta_slow=1.0, truncate=False, original_max_position_embeddings=8))
    base.update(kw)
    cfg = GptOssConfig(**base)
    cfg.architectures = ["GptOssForCausalLM"]
    return cfg


def _glm4_moe_cfg(**kw):
    from transformers import Glm4MoeConfig

    # GLM-4.5/4.6 shape: a dense first layer, then sigmoid-scored experts with a correction bias and a
    # shared expert; partial rotary (half the head), q/k/v bias
    base = dict(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=48,
                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
                n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5,
                attention_bias=True, use_qk_norm=False, partial_rotary_factor=0.5,
                max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False)
    base.update(kw)
    cfg = Glm4MoeConfig(**base)
    cfg.architectures = ["Glm4MoeForCausalLM"]
    return cfg


@dataclass(frozen=True)
class Family:
    name: str
    make_config: object
    hf_class: str            # transformers class name
    sglang_module: str
    sglang_class: str


FAMILIES: Dict[str, Family] = {
    "llama": Family("llama", _llama_cfg, "LlamaForCausalLM", "sglang.srt.models.llama", "LlamaForCausalLM"),
    "qwen2": Family("qwen2", _qwen2_cfg, "Qwen2ForCausalLM", "sglang.srt.models.qwen2", "Qwen2ForCausalLM"),
    "qwen3": Family("qwen3", _qwen3_cfg, "Qwen3ForCausalLM", "sglang.srt.models.qwen3", "Qwen3ForCausalLM"),
    "qwen3_moe": Family("qwen3_moe", _qwen3_moe_cfg, "Qwen3MoeForCausalLM", "sglang.srt.models.qwen3_moe",
                        "Qwen3MoeForCausalLM"),
    "deepseek_v2": Family("deepseek_v2", _deepseek_v2_cfg, "DeepseekV2ForCausalLM",
                          "sglang.srt.models.deepseek_v2", "DeepseekV2ForCausalLM"),
    "gpt_oss": Family("gpt_oss", _gpt_oss_cfg, "GptOssForCausalLM", "sglang.srt.models.gpt_oss",
                      "GptOssForCausalLM"),
    "glm4_moe": Family("glm4_moe", _glm4_moe_cfg, "Glm4MoeForCausalLM", "sglang.srt.models.glm4_moe",
                       "Glm4MoeForCausalLM"),
}




def _construct(cls, config, dtype: torch.dtype):
    """``cls(config)`` with ``dtype`` as the default dtype (SGLang creates parameters in it)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        return cls(config)
    finally:
        torch.set_default_dtype(previous)


def sglang_model(family: str, config, dtype: torch.dtype, weights=None, seed: int = 0):
    """The SGLang model class, built with ``dtype`` as default dtype; ``weights`` (name, tensor)
    pairs in checkpoint naming go through its ``load_weights``, else parameters are seeded."""
    import importlib

    cls = getattr(importlib.import_module(FAMILIES[family].sglang_module), FAMILIES[family].sglang_class)
    return build_model(cls, config, dtype, weights, seed)


def build_model(cls, config, dtype: torch.dtype, weights=None, seed: int = 0):
    """SGLang class ``cls`` built with ``dtype`` as default dtype, ``weights`` (checkpoint naming) loaded
    through its ``load_weights`` or parameters seeded, its ``post_load_weights`` run, in eval mode."""
    model = _construct(cls, config, dtype)
    if weights is not None:
        model.load_weights(list(weights))
    else:
        fill_random(model, seed)
    post = getattr(model, "post_load_weights", None)
    if post is not None:
        try:
            post()
        except TypeError:
            pass
    return model.eval()


def eagle3_draft_config(target_config, *, layer_ids, fc_norm=False, norm_before_fc=False,
                        hidden_size: Optional[int] = None, draft_vocab_size: Optional[int] = None):
    from transformers import LlamaConfig

    hidden = hidden_size or target_config.hidden_size
    cfg = LlamaConfig(vocab_size=target_config.vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False)
    cfg.target_hidden_size = target_config.hidden_size
    cfg.draft_vocab_size = draft_vocab_size or target_config.vocab_size
    cfg.eagle_config = {"eagle_aux_hidden_state_layer_ids": list(layer_ids), "norm_before_fc": norm_before_fc,
                        "use_aux_hidden_state": True}
    cfg.fc_norm = fc_norm
    cfg.architectures = ["LlamaForCausalLMEagle3"]
    return cfg


def fill_random(model, seed: int) -> None:
    """Deterministic weights for an SGLang model built with uninitialised parameters: norms near 1,
    matrices ~ N(0, 1/fan_in)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or ".fc_norm." in name or name.endswith("layernorm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / max(p.shape[-1], 1) ** 0.5)


def eagle3_draft(config, dtype: torch.dtype, seed: int = 1):
    from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3

    model = _construct(LlamaForCausalLMEagle3, config, dtype)
    fill_random(model, seed)
    return model.eval()


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
        locs = torch.arange(self.next_loc, self.next_loc + n, dtype=torch.int64)
        self.next_loc += n
        return locs

    def new_req(self) -> int:
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


def _fill_req_to_token(kv: KVCache, req: Req, start: int, locs: torch.Tensor) -> None:
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
        _fill_req_to_token(kv, r, p, locs[pt:pt + e])
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
        _fill_req_to_token(kv, r, prefix[i], locs[i:i + 1])
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


def run(model, fb, kv: KVCache):
    """One SGLang forward of ``model`` on ``fb`` (returns its LogitsProcessorOutput)."""
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    kv.backend.init_forward_metadata(fb)
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=kv.backend)):
        return model(fb.input_ids, fb.positions, fb)




