"""The draft fc's scratch is the plugin's own, sized for the path qualification chose per row bucket
(allocated once at install, outside any CUDA-graph pool, before SGLang sizes its KV cache), and a
forward never grows a scratch buffer: one that would need more than the plugin's workspace runs
SGLang's stock fc. Here the Triton kernels (interpreted on the CPU), with a qualification under which
the cuBLAS path, which needs an [M, K*H] prepared input, wins every bucket."""
import logging

import torch

LAYER_IDS = [0, 1, 2]


def test_workspace_is_sized_for_the_chosen_path_and_never_grown_in_a_forward(sglang_cpu, monkeypatch, tmp_path,
                                                                              caplog):
    h = sglang_cpu
    from eagle3_ops import qualify, workspace
    from eagle3_ops.sglang import serving
    from eagle3_ops.sglang.draft_fc_hooks import draft_fc_state
    from test_draft_fc import _draft_steps

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("EAGLE3_OPS_BACKEND", "triton")
    monkeypatch.setenv("EAGLE3_OPS_QUALIFY", "on")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(serving, "default_max_tokens", lambda: 16)  # buckets 1, 4, 16

    def timer(device, reps=10):
        def time(fn):
            fn()
            if fn.__name__ == "run":
                return 100.0
            backend, path, *_, folded = fn.__defaults__
            return 5.0 if (path, folded) == ("cublas", False) else 50.0
        return time

    monkeypatch.setattr(qualify, "Timer", timer)
    cfg = h.FAMILIES["llama"].make_config()
    dcfg = h.eagle3_draft_config(cfg, layer_ids=LAYER_IDS, fc_norm=True)
    stock, draft = h.eagle3_draft(dcfg, torch.float32), h.eagle3_draft(dcfg, torch.float32)
    aux = torch.randn(12, len(LAYER_IDS) * cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    h.configure_capture(draft, None, eagle=False)
    state = draft_fc_state(draft)
    assert [(c.rows, c.backend, c.path, c.folded) for c in state.plan.choices] == \
        [(m, "triton", "cublas", False) for m in (1, 4, 16)]
    # what the cuBLAS path needs at its largest M (the prepared [M, K*H] input), no more: computed here
    # with the op's own sizing under that path
    from eagle3_ops.triton import draft_fc as triton_fc

    KH = len(LAYER_IDS) * cfg.hidden_size
    want = max(triton_fc.draft_fc_plan(torch.empty((m, KH), device="meta"), draft.model.fc.weight, None, None,
                                       state.chunk_weight(), None, False, "cublas").nbytes for m in range(1, 17))
    assert want >= 16 * KH * 4
    assert state.workspace is not None and state.workspace.numel() == want
    allocations = workspace.allocations
    _, _, s_fc = _draft_steps(h, stock, dcfg, torch.float32, aux)
    _, _, p_fc = _draft_steps(h, draft, dcfg, torch.float32, aux)
    assert state.stats["fused_calls"] == 1 and workspace.allocations == allocations  # no scratch grown
    torch.testing.assert_close(p_fc, s_fc, **h.tolerances(torch.float32))

    state.workspace = state.workspace[:256]  # as if it had been sized for another path: too small now
    with caplog.at_level(logging.WARNING, logger="eagle3_ops.sglang"):
        _, _, p_fc = _draft_steps(h, draft, dcfg, torch.float32, aux)
    assert state.stats["fused_calls"] == 1 and state.stats["stock_calls"] == 3  # this extend ran stock
    assert workspace.allocations == allocations
    assert torch.equal(p_fc, s_fc)
    warned = [r.getMessage() for r in caplog.records if "SGLang's stock fc serves them" in r.getMessage()]
    assert len(warned) == 1 and "12 rows need" in warned[0]
