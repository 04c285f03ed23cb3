"""When the plugin patches a model and when it leaves it stock: a forced backend that cannot serve
(both sides, one policy, nothing patched), SGLang's hidden-states readback (server config decides),
the buffer-size warning, weights read per call, and which models count as EAGLE-3 drafts."""
import types

import pytest
import torch

LAYER_IDS = [0, 1, 2]
PROMPTS = [[5, 17, 3, 99, 42], [7, 1, 64, 23]]


def _extend(h, model, cfg, dtype, prompts=PROMPTS):
    kv = h.KVCache(cfg, dtype)
    return h.run(model, h.extend_batch(kv, [h.Req(kv.new_req()) for _ in prompts], prompts), kv)


def _draft_extend(h, draft, dcfg, dtype, aux):
    from sglang.srt.speculative.eagle_info import EagleDraftExtendInput

    kv = h.KVCache(dcfg, dtype)
    spec = EagleDraftExtendInput(hidden_states=aux, num_tokens_per_req=1, num_tokens_for_logprob_per_req=1)
    return h.run(draft, h.extend_batch(kv, [h.Req(kv.new_req()) for _ in PROMPTS], PROMPTS, capture="LAST",
                                       spec_info=spec), kv)


def _records(caplog, level):
    return [r.getMessage() for r in caplog.records if r.name.startswith("eagle3_ops") and r.levelname == level]


# ---- a forced backend that cannot serve -----------------------------------------------------------
def test_forced_backend_that_cannot_serve_leaves_both_sides_untouched(sglang_cpu, monkeypatch, caplog):
    """EAGLE3_OPS_BACKEND=cuda on a CPU model: dispatch cannot serve it. Target and draft get the
    same treatment: one WARNING each naming the forced backend, nothing patched (no state, no
    wrapper, fc_norm weights not re-pointed), no 'could not patch' error, stock outputs."""
    h = sglang_cpu
    dtype = torch.float32
    cfg = h.FAMILIES["llama"].make_config()
    target, stock = h.sglang_model("llama", cfg, dtype, seed=7), h.sglang_model("llama", cfg, dtype, seed=7)
    stock.set_eagle3_layers_to_capture(LAYER_IDS)
    dcfg = h.eagle3_draft_config(cfg, layer_ids=LAYER_IDS, fc_norm=True)
    draft, s_draft = h.eagle3_draft(dcfg, dtype), h.eagle3_draft(dcfg, dtype)
    norm_ptrs = [n.weight.data_ptr() for n in draft.model.fc_norm]
    from eagle3_ops import dispatch
    from eagle3_ops.sglang.capture_hooks import capture_state
    from eagle3_ops.sglang.draft_fc_hooks import draft_fc_state

    monkeypatch.setenv("EAGLE3_OPS_BACKEND", "cuda")
    with pytest.raises(dispatch.BackendUnavailableError):  # the premise: cuda cannot serve the CPU
        dispatch.backends(torch.device("cpu"))
    with caplog.at_level("INFO", logger="eagle3_ops"):
        h.configure_capture(target, LAYER_IDS)
        h.configure_capture(draft, None, eagle=False)
    monkeypatch.delenv("EAGLE3_OPS_BACKEND")

    assert capture_state(target) is None and draft_fc_state(draft) is None
    assert "forward" not in vars(target.model) and "forward" not in vars(draft.model)
    assert all("forward" not in vars(layer.input_layernorm) for layer in target.model.layers)
    assert [n.weight.data_ptr() for n in draft.model.fc_norm] == norm_ptrs
    warnings = _records(caplog, "WARNING")
    assert len(warnings) == 2, warnings
    assert all("left stock" in w and "EAGLE3_OPS_BACKEND=cuda" in w for w in warnings)
    assert "capture" in warnings[0] and "draft" in warnings[1]
    assert _records(caplog, "ERROR") == [] and not any("patched" in m for m in _records(caplog, "INFO"))

    out, ref = _extend(h, target, cfg, dtype), _extend(h, stock, cfg, dtype)
    assert torch.equal(out.hidden_states, ref.hidden_states)
    d_out, d_ref = _draft_extend(h, draft, dcfg, dtype, ref.hidden_states), _draft_extend(
        h, s_draft, dcfg, dtype, ref.hidden_states)
    assert torch.equal(d_out.next_token_logits, d_ref.next_token_logits)


# ---- SGLang's hidden-states readback ---------------------------------------------------------------
def _fake_server(monkeypatch, **features):
    """Publish an 'exec' config namespace the way a running SGLang server has one."""
    from sglang.srt import runtime_context
    from sglang.srt.model_executor import forward_batch_info

    base = dict(return_hidden_states_mode=None, enable_return_hidden_states=False,
                enable_return_aux_hidden_states=False, aux_hidden_state_capture=None)
    base.update(features)
    bag = types.SimpleNamespace(features=types.SimpleNamespace(**base))
    ctx = types.SimpleNamespace(is_config_namespace_published=lambda name: name == "exec")
    monkeypatch.setattr(runtime_context, "get_context", lambda: ctx)
    monkeypatch.setattr(runtime_context, "get_exec", lambda: bag)
    monkeypatch.setattr(forward_batch_info, "get_exec", lambda: bag)  # get_server_return_hidden_states_mode


@pytest.mark.parametrize("features,stock_reason", [
    (None, None),                                                   # no server in this process
    ({}, None),                                                     # EAGLE-3 server, no hidden-states return
    ({"return_hidden_states_mode": "last"}, "requests may return hidden states"),
    ({"return_hidden_states_mode": "full"}, "requests may return hidden states"),
    ({"enable_return_hidden_states": True}, "requests may return hidden states"),
    ({"enable_return_aux_hidden_states": True, "aux_hidden_state_capture": "eagle3",
      "return_hidden_states_mode": "full"}, "capture-only mode"),
], ids=["no-server", "server-default", "mode-last", "mode-full", "enable-return-hidden-states",
        "capture-only"])
def test_hidden_states_readback_decision(sglang_cpu, monkeypatch, features, stock_reason):
    from eagle3_ops.sglang.capture_hooks import hidden_states_readback

    if features is not None:
        _fake_server(monkeypatch, **features)
    reason = hidden_states_readback()
    if stock_reason is None:
        assert reason is None
    else:
        assert reason is not None and stock_reason in reason


@pytest.mark.parametrize("features", [{"return_hidden_states_mode": "full"},
                                      {"enable_return_aux_hidden_states": True, "aux_hidden_state_capture": "eagle3"}],
                         ids=["return-hidden-states", "capture-only"])
def test_readback_possible_keeps_the_target_stock(sglang_cpu, monkeypatch, caplog, features):
    """The readback runs on a copy stream the next forward does not wait for: with a persistent
    buffer the next target forward could overwrite rows still being copied. The target keeps
    SGLang's capture (fresh tensors) for every forward, with one warning."""
    h = sglang_cpu
    dtype = torch.float32
    cfg = h.FAMILIES["llama"].make_config()
    model = h.sglang_model("llama", cfg, dtype, seed=8)
    with monkeypatch.context() as m, caplog.at_level("WARNING", logger="eagle3_ops.sglang"):
        _fake_server(m, **features)
        h.configure_capture(model, LAYER_IDS)
    from eagle3_ops.sglang.capture_hooks import capture_state

    assert capture_state(model) is None and "forward" not in vars(model.model)
    warnings = _records(caplog, "WARNING")
    assert len(warnings) == 1 and "left stock" in warnings[0]
    first, second = _extend(h, model, cfg, dtype), _extend(h, model, cfg, dtype, [[1, 2, 3]])
    assert first.hidden_states.data_ptr() != second.hidden_states.data_ptr()  # fresh per forward


# ---- the buffer's size is announced ----------------------------------------------------------------
def test_buffer_size_is_a_warning_with_the_cap(sglang_cpu, caplog):
    h = sglang_cpu
    cfg = h.FAMILIES["llama"].make_config()
    model = h.sglang_model("llama", cfg, torch.float32, seed=9)
    with caplog.at_level("WARNING", logger="eagle3_ops.sglang"):
        h.configure_capture(model, LAYER_IDS)
    from eagle3_ops.sglang.capture_hooks import capture_state
    from eagle3_ops.sglang.version import ENV_MAX_TOKENS

    state = capture_state(model)
    warnings = _records(caplog, "WARNING")
    assert len(warnings) == 1, warnings
    mib = state.max_tokens * len(LAYER_IDS) * cfg.hidden_size * 4 / 2**20  # 16384 rows (no server args)
    assert f"{mib:.1f} MiB" in warnings[0] and f"{ENV_MAX_TOKENS}=" in warnings[0]
    assert "--mem-fraction-static" in warnings[0]


# ---- weights are read per call ---------------------------------------------------------------------
def test_fused_norm_reads_the_current_weight(sglang_cpu, fused_norm_qualified):
    """A reload that replaces a norm's Parameter (and eps) after the plugin installed is honoured:
    the plugin's outputs stay bitwise equal to stock SGLang with the same new weights."""
    h = sglang_cpu
    dtype = torch.float32
    cfg = h.FAMILIES["llama"].make_config()
    stock, model = h.sglang_model("llama", cfg, dtype, seed=10), h.sglang_model("llama", cfg, dtype, seed=10)
    stock.set_eagle3_layers_to_capture(LAYER_IDS)
    h.configure_capture(model, LAYER_IDS)
    from eagle3_ops.sglang.capture_hooks import capture_state

    state = capture_state(model)
    _extend(h, model, cfg, dtype)  # learns which norms' residuals SGLang captures (layers 1, 2, 3)
    assert state.fused_sites == [f"model.layers.{i}.input_layernorm" for i in (1, 2, 3)]
    new = 1.0 + torch.randn(cfg.hidden_size, generator=torch.Generator().manual_seed(11))
    for m in (stock, model):
        for i in (1, 3):
            norm = m.model.layers[i].input_layernorm
            norm.weight = torch.nn.Parameter(new.clone(), requires_grad=False)
            norm.variance_epsilon = 1e-3
    out, ref = _extend(h, model, cfg, dtype), _extend(h, stock, cfg, dtype)
    assert state.stats["fused_captures"] == len(LAYER_IDS)
    assert torch.equal(out.hidden_states, ref.hidden_states)
    assert torch.equal(out.next_token_logits, ref.next_token_logits)


# ---- which models are EAGLE-3 drafts ---------------------------------------------------------------
def test_models_outside_the_eagle3_draft_family_are_passed_over_silently(sglang_cpu, caplog):
    """An EAGLE/EAGLE-2 draft (llama_eagle: an inner ``.fc`` too) is not an EAGLE-3 draft: no
    warning, nothing patched. An EAGLE-3 draft whose forward the plugin does not know still
    gets its one warning."""
    h = sglang_cpu
    from sglang.srt.models.llama_eagle import LlamaForCausalLMEagle

    from eagle3_ops.sglang.draft_fc_hooks import draft_fc_state

    cfg = h.FAMILIES["llama"].make_config(num_hidden_layers=1)
    eagle2 = LlamaForCausalLMEagle(cfg)
    assert hasattr(eagle2.model, "fc")
    dcfg = h.eagle3_draft_config(h.FAMILIES["llama"].make_config(), layer_ids=LAYER_IDS)
    eagle3 = h.eagle3_draft(dcfg, torch.float32)

    class CustomDraftModel(type(eagle3.model)):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    eagle3.model.__class__ = CustomDraftModel
    with caplog.at_level("WARNING", logger="eagle3_ops.sglang"):
        h.configure_capture(eagle2, None, eagle=False)
        assert _records(caplog, "WARNING") == []
        h.configure_capture(eagle3, None, eagle=False)
    assert draft_fc_state(eagle2) is None and draft_fc_state(eagle3) is None
    warnings = _records(caplog, "WARNING")
    assert len(warnings) == 1 and "LlamaForCausalLMEagle3" in warnings[0] and "runs stock" in warnings[0] \
        and "is not one of SGLang's EAGLE-3 draft heads" in warnings[0]
