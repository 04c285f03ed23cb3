"""The plugin qualifies its sites when it installs them (EAGLE3_OPS_QUALIFY=on here; the default,
auto, qualifies on CUDA devices only): the install log shows the choice per site and row bucket,
forwards follow it, and a site where nothing beats stock runs SGLang's own code."""
import logging

import pytest
import torch

LAYER_IDS = [0, 1, 2]
PROMPTS = [[5, 17, 3, 99, 42], [7, 1, 64, 23, 88, 120, 11]]


class _Timer:
    """Stock (the closures named ``run``) takes ``stock``; every candidate takes ``cand``, a
    candidate on the folded weight ``folded`` when given (its closure's last default is True)."""

    def __init__(self, stock, cand, folded=None):
        self.stock, self.cand, self.folded = stock, cand, folded

    def __call__(self, device, reps=10):
        return self

    def time(self, fn):
        fn()
        if fn.__name__ == "run":
            return self.stock
        if self.folded is not None and (fn.__defaults__ or (None,))[-1] is True:
            return self.folded
        return self.cand


@pytest.fixture
def qualifying(monkeypatch, tmp_path):
    from eagle3_ops import qualify

    monkeypatch.setenv("EAGLE3_OPS_QUALIFY", "on")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("EAGLE3_OPS_SGLANG_MAX_TOKENS", "64")
    from eagle3_ops.sglang import serving

    # the draft's largest M (SGLang's chunked_prefill_size in a server; 16384 without server args,
    # which the Triton interpreter would take minutes over)
    monkeypatch.setattr(serving, "default_max_tokens", lambda: 64)

    def use(stock, cand, folded=None):
        timer = _Timer(stock, cand, folded)
        monkeypatch.setattr(qualify, "Timer", lambda device, reps=10: timer.time)
    return use


def _draft_and_aux(h, dtype):
    cfg = h.FAMILIES["llama"].make_config()
    target = h.sglang_model("llama", cfg, dtype, seed=2)
    target.set_eagle3_layers_to_capture(LAYER_IDS)
    kv = h.KVCache(cfg, dtype)
    aux = h.run(target, h.extend_batch(kv, [h.Req(kv.new_req()) for _ in PROMPTS], PROMPTS), kv).hidden_states
    dcfg = h.eagle3_draft_config(cfg, layer_ids=LAYER_IDS, fc_norm=True)
    return cfg, dcfg, aux.clone()


@pytest.mark.parametrize("winner", ["candidate", "stock", "folded"])
def test_draft_fc_follows_its_qualification(sglang_cpu, qualifying, caplog, winner, monkeypatch):
    h = sglang_cpu
    dtype = torch.bfloat16
    qualifying(100.0, 10.0 if winner != "stock" else 99.0, 5.0 if winner == "folded" else None)
    cfg, dcfg, aux = _draft_and_aux(h, dtype)
    from test_draft_fc import _draft_steps

    stock_draft = h.eagle3_draft(dcfg, dtype)
    s_ext, _, s_fc = _draft_steps(h, stock_draft, dcfg, dtype, aux)
    draft = h.eagle3_draft(dcfg, dtype)
    with caplog.at_level(logging.INFO, logger="eagle3_ops"):
        h.configure_capture(draft, None, eagle=False)
    from eagle3_ops.sglang.draft_fc_hooks import draft_fc_state

    state = draft_fc_state(draft)
    assert state.plan is not None and [c.rows for c in state.plan.choices] == [1, 4, 16, 64]
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("eagle3_ops: draft")
             and " fc " in r.getMessage() and ("|" in r.getMessage() or "qualification on" in r.getMessage())]
    assert len(lines) == 1 + 1 + 4  # title, header, one line per bucket
    p_ext, _, p_fc = _draft_steps(h, draft, dcfg, dtype, aux)
    if winner == "stock":
        assert all(c.backend is None for c in state.plan.choices)
        assert all("| stock " in ln for ln in lines[2:])
        assert state.stats == {"fused_calls": 0, "stock_calls": 2}
        assert torch.equal(p_fc, s_fc) and torch.equal(p_ext.next_token_logits, s_ext.next_token_logits)
    else:
        assert all(c.backend is not None for c in state.plan.choices)
        assert all(c.folded == (winner == "folded") for c in state.plan.choices)
        assert state.stats == {"fused_calls": 1, "stock_calls": 1}
        torch.testing.assert_close(p_fc, s_fc, **h.tolerances(dtype))
    if winner != "folded":
        assert state.folded_weight is None  # no second copy of the weight unless a folded candidate serves
        return
    import eagle3_ops

    fc = draft.model.fc
    want = eagle3_ops.fold_norm_weights(fc.weight, state.chunk_norm_weight)
    assert torch.equal(state.folded_weight, want) and state.folded_weight.data_ptr() != fc.weight.data_ptr()
    assert any("folded norm weights prepared for row buckets [1, 4, 16, 64]" in r.getMessage() for r in caplog.records)
    # a weight update (SGLang copies into the parameters in place) re-folds: never a stale copy
    new_w = torch.randn_like(fc.weight, dtype=torch.float32)
    draft.load_weights([("fc.weight", new_w)])
    assert torch.equal(fc.weight, new_w.to(dtype))
    assert torch.equal(state.folded_weight, eagle3_ops.fold_norm_weights(fc.weight, state.chunk_norm_weight))
    # SGLang's direct updates write the parameters without load_weights: the plugin's AFTER hook on
    # every WeightUpdater update (plugin.WEIGHT_UPDATE_TARGETS) folds again, in place
    from eagle3_ops.sglang import plugin

    address = state.folded_weight.data_ptr()
    with torch.no_grad():
        fc.weight.mul_(-0.5)
    assert plugin._after_weight_update(("ok", "done")) == ("ok", "done")
    assert state.folded_weight.data_ptr() == address  # captured graphs keep reading the same memory
    assert torch.equal(state.folded_weight, eagle3_ops.fold_norm_weights(fc.weight, state.chunk_norm_weight))
    # and through SGLang's own WeightUpdater (load_format="direct" writes the parameters directly)
    import types

    from sglang.srt.model_executor.model_runner_components import weight_updater as wu

    monkeypatch.setattr(wu, "get_model", lambda: types.SimpleNamespace(weight_cache_mode="off"))
    monkeypatch.setattr(wu, "get_parallel", lambda: types.SimpleNamespace(tp_rank=0))
    updater = wu.WeightUpdater(tp_rank=0, device="cpu", gpu_id=0, model_config=None, custom_weight_loaders={},
                               get_model=lambda: draft, update_model_fields=lambda **k: None,
                               recapture_cuda_graph=lambda: None, get_model_runner=lambda: None)
    assert getattr(wu.WeightUpdater.update_weights_from_tensor, "__wrapped__", None) is not None  # hooked
    newer = torch.randn(fc.weight.shape, dtype=torch.float32).to(dtype)
    assert updater.update_weights_from_tensor([("model.fc.weight", newer)], load_format="direct") == (True, "Success")
    assert torch.equal(fc.weight, newer) and state.folded_weight.data_ptr() == address
    assert torch.equal(state.folded_weight, eagle3_ops.fold_norm_weights(fc.weight, state.chunk_norm_weight))
    # an update whose weights cannot be folded is reported as failed, never as "Success"
    before = state.folded_weight.clone()
    huge = newer.clone()
    huge[0, 0] = torch.finfo(dtype).max
    gains = [n.weight.detach().clone() for n in draft.model.fc_norm]
    gains[0][0] = 4.0
    ok, message = updater.update_weights_from_tensor([("model.fc.weight", huge), ("model.fc_norm.0.weight", gains[0])],
                                                     load_format="direct")
    assert not ok and "could not be folded" in message and "not finite" in message
    assert torch.equal(state.folded_weight, before)  # refused: the copy is left as it was (and logged)


def test_target_norm_stays_sglangs_where_nothing_wins(sglang_cpu, qualifying, caplog):
    h = sglang_cpu
    dtype = torch.float32
    qualifying(100.0, 99.0)
    cfg = h.FAMILIES["llama"].make_config()
    model = h.sglang_model("llama", cfg, dtype, seed=2)
    with caplog.at_level(logging.INFO, logger="eagle3_ops"):
        h.configure_capture(model, LAYER_IDS)
    from eagle3_ops.sglang.capture_hooks import capture_state

    state = capture_state(model)
    assert state.norm_plan is not None and all(c.backend is None for c in state.norm_plan.choices)
    assert any("fused norm" in r.getMessage() and "| stock " in r.getMessage() for r in caplog.records)
    kv = h.KVCache(cfg, dtype)
    out = h.run(model, h.extend_batch(kv, [h.Req(kv.new_req()) for _ in PROMPTS], PROMPTS), kv)
    # the buffer still holds the captures (copies: SGLang ran its own norm), bitwise stock's
    assert out.hidden_states.data_ptr() == state.buffer.buffer.data_ptr()
    assert state.stats["fused_captures"] == 0 and state.stats["copied_captures"] == 3
    stock = h.sglang_model("llama", cfg, dtype, seed=2)
    stock.set_eagle3_layers_to_capture(LAYER_IDS)
    kv2 = h.KVCache(cfg, dtype)
    s_out = h.run(stock, h.extend_batch(kv2, [h.Req(kv2.new_req()) for _ in PROMPTS], PROMPTS), kv2)
    assert torch.equal(out.hidden_states, s_out.hidden_states)
