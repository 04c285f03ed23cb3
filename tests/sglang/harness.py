"""Test side of the CPU harness: the SGLang-running part lives in
``eagle3_ops.demos.sglang_cpu_harness`` (shared with the demo); here are the Hugging Face references."""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from eagle3_ops.demos.sglang_cpu_harness import *  # noqa: F401,F403
from eagle3_ops.demos.sglang_cpu_harness import FAMILIES, sglang_model


def hf_model(family: str, config, dtype: torch.dtype, seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    model = getattr(transformers, FAMILIES[family].hf_class)(config).eval()
    with torch.no_grad():
        # visible norm weights (HF inits them to 1, which would hide a mixed-up norm)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.add_(0.1 * torch.randn_like(p))
        # a visible router correction bias (GLM-4.5 inits it to 0, which would hide an ignored one)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b))
    return model.to(dtype)


def checkpoint_weights(hf) -> List[tuple]:
    """HF weights in checkpoint naming: transformers 5 keeps MoE experts fused
    (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I]); checkpoints and SGLang's
    loaders name them per expert (``experts.{e}.gate_proj.weight`` ...). gpt-oss checkpoints keep
    them fused as HF does (``experts.gate_up_proj`` [E, H, 2I] interleaved gate/up, ``_bias``,
    ``down_proj``), which SGLang's GptOssForCausalLM loads as is (unquantized: no mxfp4)."""
    if getattr(hf.config, "model_type", None) == "gpt_oss":
        return list(hf.state_dict().items())
    out = []
    for name, t in hf.state_dict().items():
        if name.endswith("experts.gate_up_proj"):
            prefix = name[: -len("gate_up_proj")]
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                out.append((f"{prefix}{e}.gate_proj.weight", t[e, :inter].contiguous()))
                out.append((f"{prefix}{e}.up_proj.weight", t[e, inter:].contiguous()))
        elif name.endswith("experts.down_proj"):
            prefix = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out.append((f"{prefix}{e}.down_proj.weight", t[e].contiguous()))
        else:
            out.append((name, t))
    return out


def hf_hidden_states(hf, sequences: List[List[int]]):
    """HF ``output_hidden_states`` per sequence (a tuple of [L, H] per index), and last-token logits."""
    outs = []
    with torch.no_grad():
        for seq in sequences:
            o = hf(torch.tensor(seq)[None], output_hidden_states=True)
            outs.append(([h[0] for h in o.hidden_states], o.logits[0]))
    return outs


def hf_refs_with_last(hf, prompts, drafts, boundaries=(1, 2)):
    """HF references (extend rows, verify rows) for capture indices ``boundaries`` + L, where boundary L
    is the last layer's output before the final norm (HF's last hidden state is after it: the norm's
    input, grabbed by a hook)."""
    grabbed = []
    hook = hf.model.norm.register_forward_hook(lambda _m, inp, _out: grabbed.append(inp[0][0]))
    try:
        hf_out = hf_hidden_states(hf, [p + d for p, d in zip(prompts, drafts)])
    finally:
        hook.remove()

    def ref(rows):
        return torch.cat([torch.cat([hs[b][r] for b in boundaries] + [last[r]], dim=-1)
                          for (hs, _), last, r in zip(hf_out, grabbed, rows)])

    return (ref([slice(0, len(p)) for p in prompts]),
            ref([slice(len(p), len(p) + len(d)) for p, d in zip(prompts, drafts)]))


def hf_aux(outs, capture_indices: Sequence[int], rows: List[slice]) -> torch.Tensor:
    """The packed [T, K*H] aux matrix HF gives for the capture indices (rows[i]: which positions of
    sequence i this forward covered)."""
    return torch.cat([torch.cat([hs[i][r] for i in capture_indices], dim=-1)
                      for (hs, _), r in zip(outs, rows)], dim=0)


def tolerances(dtype: torch.dtype) -> dict:
    return {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=6e-2, rtol=5e-2),
            torch.float16: dict(atol=1e-2, rtol=1e-2)}[dtype]


def sglang_from_hf(family: str, config, dtype: torch.dtype, hf):
    return sglang_model(family, config, dtype, weights=checkpoint_weights(hf))


def reference_only(dtype: torch.dtype, device: str = "cpu") -> bool:
    """Whether every eagle3 op is served by the reference backend (the default on CPU)."""
    import eagle3_ops

    return set(eagle3_ops.backends(torch.device(device), dtype).values()) == {"reference"}


def assert_plugin_matches_stock(plugin: torch.Tensor, stock: torch.Tensor, dtype: torch.dtype, msg: str = "",
                                reference: Optional[bool] = None) -> None:
    """Plugin vs stock SGLang. With the reference backend the plugin's ops compute exactly what
    SGLang's own code does, in the same order (fp32 add, one rounding; SGLang's native RMSNorm
    arithmetic), so every captured slot and every logit must be bitwise equal; the bf16 tolerance
    is for comparisons with Hugging Face only. Accelerated backends (other reduction orders) are
    held to the dtype's tolerance. ``reference``: what another process reported (default: ask
    dispatch here)."""
    assert plugin.shape == stock.shape and plugin.dtype == stock.dtype, msg
    if reference_only(dtype) if reference is None else reference:
        if not torch.equal(plugin, stock):
            diff = (plugin.double() - stock.double()).abs()
            raise AssertionError(f"{msg}: plugin != stock bitwise ({int((diff > 0).sum())} elements differ, "
                                 f"max abs diff {diff.max().item():.3g})")
    else:
        torch.testing.assert_close(plugin, stock, **tolerances(dtype), msg=msg)


def two_forwards(model, cfg, dtype, prompts, drafts, kv=None):
    """EXTEND ``prompts``, then TARGET_VERIFY the ``drafts`` chains on top (a fresh KV cache unless
    ``kv`` is given). Returns (extend output, its aux states cloned, their data_ptr, verify output)."""
    from eagle3_ops.demos.sglang_cpu_harness import KVCache, Req, extend_batch, run

    kv = KVCache(cfg, dtype) if kv is None else kv
    reqs = [Req(kv.new_req()) for _ in prompts]
    ext = run(model, extend_batch(kv, reqs, prompts), kv)
    ext_aux, ext_ptr = ext.hidden_states.clone(), ext.hidden_states.data_ptr()
    ver = run(model, extend_batch(kv, reqs, drafts, mode="TARGET_VERIFY"), kv)
    return ext, ext_aux, ext_ptr, ver


def assert_captures_match_hf_and_stock(stock, plugin, hf, capture_ids, prompts, drafts, dtype, hidden_size,
                                       refs=None):
    """``stock`` / ``plugin``: ``two_forwards`` results of the same model without and with the
    plugin. Aux states of both forwards vs Hugging Face at ``capture_ids`` (``refs``: the
    (extend, verify) references when they are not plain ``output_hidden_states``), plugin vs stock
    bitwise (reference backend) for aux states and logits, extend logits vs HF."""
    tol = tolerances(dtype)
    (s_ext, s_ext_aux, _, s_ver), (p_ext, p_ext_aux, _, p_ver) = stock, plugin
    hf_out = hf_hidden_states(hf, [p + d for p, d in zip(prompts, drafts)])
    if refs is None:
        refs = (hf_aux(hf_out, capture_ids, [slice(0, len(p)) for p in prompts]),
                hf_aux(hf_out, capture_ids, [slice(len(p), len(p) + len(d)) for p, d in zip(prompts, drafts)]))
    width = len(capture_ids) * hidden_size
    for name, s, p, ref in (("extend", s_ext_aux, p_ext_aux, refs[0]),
                            ("verify", s_ver.hidden_states, p_ver.hidden_states, refs[1])):
        assert p.shape == s.shape == ref.shape == (ref.shape[0], width), name
        torch.testing.assert_close(s.float(), ref.float(), **tol, msg=f"stock {name} vs HF")
        torch.testing.assert_close(p.float(), ref.float(), **tol, msg=f"plugin {name} vs HF")
        assert_plugin_matches_stock(p, s, dtype, f"plugin {name} vs stock")
    assert_plugin_matches_stock(p_ext.next_token_logits, s_ext.next_token_logits, dtype, "extend logits")
    assert_plugin_matches_stock(p_ver.next_token_logits, s_ver.next_token_logits, dtype, "verify logits")
    ref_last = torch.stack([logits[len(p) - 1] for (_, logits), p in zip(hf_out, prompts)])
    torch.testing.assert_close(p_ext.next_token_logits.float(), ref_last.float(), **tol)
    return hf_out


def inner_forward(model, cfg, dtype, prompts):
    """The inner model's forward on an EXTEND of ``prompts`` (``(hidden, aux)`` for an EAGLE-3
    target): what SGLang's breakable prefill CUDA graph captures (``layer_model.forward``)."""
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    from eagle3_ops.demos.sglang_cpu_harness import KVCache, Req, extend_batch

    kv = KVCache(cfg, dtype)
    fb = extend_batch(kv, [Req(kv.new_req()) for _ in prompts], prompts)
    kv.backend.init_forward_metadata(fb)
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=kv.backend)):
        return model.model(fb.input_ids, fb.positions, fb)



def machine_slowness() -> float:
    """Seconds this machine takes, right now, to start a Python that imports torch: the unit the
    multi-rank timeouts are counted in (tests/machine.py)."""
    from machine import slowness

    return slowness()


def run_forked(jobs, env, workdir, timeout: float):
    """Run ``jobs`` (``{"script", "argv", "env", "out"}``, see forked.py) as children of one process
    that imported SGLang once, under the environment ``env``; each must exit 0. Returns each job's
    output. ``timeout`` (seconds) ends the whole group: a child left waiting in a collective is the
    very bug the multi-rank tests look for."""
    import json
    import os
    import signal
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    jobs_file = os.path.join(str(workdir), "forked_jobs.json")
    with open(jobs_file, "w") as f:
        json.dump(jobs, f)
    proc = subprocess.Popen([sys.executable, os.path.join(here, "forked.py"), jobs_file], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise AssertionError(f"{[j['script'] for j in jobs]}: not finished in {timeout:.0f} s "
                             f"({machine_slowness():.1f} s to start Python here now): a child left "
                             "waiting in a collective?") from None
    text = out.decode(errors="replace")
    assert proc.returncode == 0, f"forked.py failed:\n{text[-4000:]}"  # before any child's file is read
    codes = json.loads(text.strip().splitlines()[-1])
    outputs = []
    for j, code in zip(jobs, codes):
        with open(j["out"], errors="replace") as f:
            outputs.append(f.read())
        assert code == 0, f"{j['script']} {' '.join(j.get('argv', []))} failed (exit {code}):\n{outputs[-1][-4000:]}"
    return outputs


def run_ranks(worker: str, outdir, world_size: int = 2, timeout: Optional[float] = None):
    """Run ``worker`` (a script in this folder: ``worker RANK PORT OUTDIR``) as ``world_size``
    gloo ranks (forked from one process that imported SGLang, :func:`run_forked`); each saves
    ``OUTDIR/rank{r}.pt``. Returns (the loaded results, each rank's log).

    The ranks serve every op with the reference backend (no Triton interpreter there: it would make
    qualification slow; the Triton kernels under SGLang are tested in this process). ``timeout``
    (seconds) guards against a rank left waiting in a collective, the very bug these tests look for;
    it scales with how slow this machine is now (:func:`machine_slowness`), no fixed wall clock."""
    import os

    from eagle3_ops.demos.sglang_cpu_harness import free_port

    if timeout is None:
        timeout = max(900.0, 150.0 * machine_slowness())
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, here, os.environ.get("PYTHONPATH", "")]),
               SGLANG_NCCL_SO_PATH="/nonexistent", TORCHDYNAMO_DISABLE="1")
    for var in [v for v in env if v.startswith("EAGLE3_OPS_")] + ["SGLANG_USE_CPU_ENGINE", "TRITON_INTERPRET"]:
        env.pop(var, None)
    jobs = [{"script": os.path.join(here, worker), "argv": [str(r), str(port), str(outdir)],
             "out": os.path.join(str(outdir), f"rank{r}.log")} for r in range(world_size)]
    logs = run_forked(jobs, env, outdir, timeout)
    return [torch.load(os.path.join(str(outdir), f"rank{r}.pt"), weights_only=False) for r in range(world_size)], logs


def mla_eagle3_draft_config(target_config, *, layer_ids, fc_norm=False, hidden_size: int = 64):
    """A tiny config of SGLang's MLA EAGLE-3 head (``Eagle3DeepseekV2ForCausalLM``, kimi_k25_eagle3.py,
    the Kimi-K2.x draft): DeepSeek-V2 MLA attention (q_lora_rank is required), one layer, the target's
    hidden size and vocabulary, ``fc_norm`` per captured slot."""
    from transformers import DeepseekV2Config

    cfg = DeepseekV2Config(vocab_size=target_config.vocab_size, hidden_size=hidden_size,
                           intermediate_size=2 * hidden_size, num_hidden_layers=1, num_attention_heads=4,
                           num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8,
                           qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
                           tie_word_embeddings=False, rope_scaling=None, hidden_act="silu")
    cfg.target_hidden_size = target_config.hidden_size
    cfg.draft_vocab_size = target_config.vocab_size
    cfg.eagle_config = {"eagle_aux_hidden_state_layer_ids": list(layer_ids), "use_aux_hidden_state": True}
    cfg.fc_norm = fc_norm
    cfg.architectures = ["Eagle3DeepseekV2ForCausalLM"]
    return cfg


def mla_eagle3_draft(config, dtype: torch.dtype, seed: int = 1):
    from sglang.srt.models.kimi_k25_eagle3 import Eagle3DeepseekV2ForCausalLM

    from eagle3_ops.demos.sglang_cpu_harness import construct, fill_random

    model = construct(Eagle3DeepseekV2ForCausalLM, config, dtype)
    fill_random(model, seed)
    model.post_load_weights()
    return model.eval()


def serve_prompts(model, kv_config, prompts, dtype: torch.dtype = torch.float32, per_batch: int = 4,
                  spec_algorithm=None):
    """Prefill ``prompts`` (from position 0) in batches of ``per_batch``, as a server's first requests; the served
    aux states and next-token logits of every batch. ``kv_config``: the config the KV cache is sized from;
    ``spec_algorithm``: what the scheduler's batches of such a server carry (e.g. "EAGLE3")."""
    from eagle3_ops.demos.sglang_cpu_harness import KVCache, Req, extend_batch, run

    kv = KVCache(kv_config, dtype, size=sum(map(len, prompts)) + 8, max_reqs=len(prompts) + 1)
    outs = []
    for s in range(0, len(prompts), per_batch):
        chunk = prompts[s:s + per_batch]
        fb = extend_batch(kv, [Req(kv.new_req()) for _ in chunk], chunk)
        if spec_algorithm is not None:
            from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

            fb.spec_algorithm = SpeculativeAlgorithm[spec_algorithm]
        out = run(model, fb, kv)
        outs.append((out.hidden_states.clone(), out.next_token_logits.clone()))
    return outs


def same_where_clear(got, want, logits, gap=1e-3):
    """The same predicted tokens wherever the top two logits are further apart than float32 rounding can move."""
    top2 = logits.topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > gap * logits.abs().amax(-1).clamp_min(1.0)
    assert clear.float().mean() > 0.9, "too few clear positions to compare"
    assert torch.equal(got[clear], want[clear]), (got != want).float().mean()
