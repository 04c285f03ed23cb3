"""The same SGLang integration with the ops served by the Triton kernels (the Triton interpreter
on CPU): target EXTEND + TARGET_VERIFY and the draft's fc step, plugin vs stock.

Triton decides at decoration time (when eagle3_ops.triton is imported) whether a kernel is
interpreted: tests/conftest.py sets TRITON_INTERPRET=1 before that on hosts without CUDA. Setting the
variable later changes nothing, so on a GPU host (kernels compiled for the GPU, CPU tensors here)
this test is skipped; there the Triton kernels are tested on the GPU (tests/*gpu*.py). On a CPU
host it must run: if the kernels are not interpreted there, it fails instead of skipping."""
import pytest
import torch

LAYER_IDS = [0, 1, 2]
PROMPTS = [[5, 17, 3, 99, 42], [7, 1, 64, 23, 88, 120, 11]]
DRAFTS = [[9, 31, 2], [54, 6, 101]]


def _kernels_interpreted() -> bool:
    """Whether every Triton kernel of the ops (capture and draft fc modules) is an interpreted one."""
    from triton.runtime.jit import JITFunction

    from eagle3_ops.triton import _interpreter_shim as shim
    from eagle3_ops.triton import capture, draft_fc

    kernels = [v for mod in (capture, draft_fc) for v in vars(mod).values()
               if isinstance(v, JITFunction) or shim.interpreted(v)]
    return bool(kernels) and all(shim.interpreted(k) for k in kernels)


pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() and not _kernels_interpreted(),
    reason="GPU host: the Triton kernels were compiled for the GPU at import, so they cannot run on "
           "these CPU tensors (the GPU tests cover them there)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_plugin_on_triton_kernels_matches_stock(sglang_cpu, fused_norm_qualified, monkeypatch, dtype):
    h = sglang_cpu
    assert _kernels_interpreted(), "CPU host: tests/conftest.py must make the Triton kernels interpreted"
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # what dispatch reads (for the CPU device) at call time
    monkeypatch.setenv("EAGLE3_OPS_BACKEND", "triton")
    from eagle3_ops import backends

    assert set(backends(torch.device("cpu")).values()) == {"triton"}
    from sglang.srt.speculative.eagle_info import EagleDraftExtendInput

    tol = h.tolerances(dtype)
    cfg = h.FAMILIES["llama"].make_config()
    hf = h.hf_model("llama", cfg, dtype)
    stock, plugin = h.sglang_from_hf("llama", cfg, dtype, hf), h.sglang_from_hf("llama", cfg, dtype, hf)
    stock.set_eagle3_layers_to_capture(LAYER_IDS)
    h.configure_capture(plugin, LAYER_IDS)
    dcfg = h.eagle3_draft_config(cfg, layer_ids=LAYER_IDS, fc_norm=True, norm_before_fc=True)
    s_draft, p_draft = h.eagle3_draft(dcfg, dtype), h.eagle3_draft(dcfg, dtype)
    h.configure_capture(p_draft, None, eagle=False)

    outs = {}
    for name, target, draft in (("stock", stock, s_draft), ("plugin", plugin, p_draft)):
        kv = h.KVCache(cfg, dtype)
        reqs = [h.Req(kv.new_req()) for _ in PROMPTS]
        ext = h.run(target, h.extend_batch(kv, reqs, PROMPTS), kv)
        aux = ext.hidden_states.clone()
        ver = h.run(target, h.extend_batch(kv, reqs, DRAFTS, mode="TARGET_VERIFY"), kv)
        dkv = h.KVCache(dcfg, dtype)
        spec = EagleDraftExtendInput(hidden_states=aux, num_tokens_per_req=1, num_tokens_for_logprob_per_req=1)
        dext = h.run(draft, h.extend_batch(dkv, [h.Req(dkv.new_req()) for _ in PROMPTS],
                                           [p[1:] + [0] for p in PROMPTS], capture="LAST", spec_info=spec), dkv)
        outs[name] = [aux, ext.next_token_logits, ver.hidden_states.clone(), ver.next_token_logits,
                      dext.next_token_logits, dext.hidden_states]
    # the target's outputs are bitwise stock's: the Triton capture kernel copies, and the fused
    # add+RMSNorm serves only where qualification found it bitwise SGLang's norm (else SGLang's norm
    # runs); the draft's within the dtype's tolerance
    for name, s, p in zip(("aux", "extend logits", "verify aux", "verify logits"), outs["stock"], outs["plugin"]):
        assert torch.equal(p, s), name
    for s, p in zip(outs["stock"][4:], outs["plugin"][4:]):
        torch.testing.assert_close(p, s, **tol)
    from eagle3_ops.sglang.capture_hooks import capture_state
    from eagle3_ops.sglang.draft_fc_hooks import draft_fc_state

    state = capture_state(plugin)
    K = len(LAYER_IDS)
    assert state.stats["buffer_forwards"] == 2
    assert state.stats["fused_captures"] + state.stats["copied_captures"] == 2 * K
    # both forwards (12 and 6 rows) are in the 16-row bucket: the EXTEND learns, the VERIFY fuses iff
    # Triton's fused norm qualified there; where it did not, the plan says why (not bitwise stock)
    choice = state.norm_plan.choice_for(12)
    assert choice.rows == 16 and choice.backend in (None, "triton")
    assert state.stats["fused_captures"] == (K if choice.backend == "triton" else 0)
    if choice.backend is None:
        assert any(r.rows == 16 and "not bitwise equal to stock" in r.reason for r in state.norm_plan.rejected)
    assert draft_fc_state(p_draft).stats["fused_calls"] == 1
