"""The plugin's forward wrappers survive SGLang's graph/compile setup.

With the ``tc_piecewise`` prefill backend, SGLang's ``install_torch_compiled`` sets the inner
model's ``forward`` instance attribute to a trampoline that calls ``module.__class__.forward`` (or a
``torch.compile`` of it). The plugin wraps the class forward, keyed on the instance's state, so the
trampoline still reaches it; after SGLang's graph setup (AFTER hooks on ``ModelRunner.
init_cuda_graphs`` / ``init_prefill_cuda_graph``) it warns once if an instance no longer routes
through it."""
import types

import torch

LAYER_IDS = [0, 1, 2]
PROMPTS = [[5, 17, 3, 99, 42], [7, 1, 64, 23]]


def _install_torch_compiled(module):
    """SGLang's own function, as the tc_piecewise backend calls it (an eager backend: nothing is
    compiled unless a forward runs inside enable_tc_piecewise_cuda_graph)."""
    from sglang.srt.compilation.compile import install_torch_compiled

    install_torch_compiled(module, backend_factory=lambda gm, example_inputs: gm.forward)


def _extend(h, model, cfg, dtype):
    kv = h.KVCache(cfg, dtype)
    return h.run(model, h.extend_batch(kv, [h.Req(kv.new_req()) for _ in PROMPTS], PROMPTS), kv)


def _graph_setup_done(model):
    """What SGLang runs after ModelRunner.init_cuda_graphs: the plugin's AFTER hook."""
    from eagle3_ops.sglang import plugin

    plugin._after_graph_setup(None, types.SimpleNamespace(model=model))


def _warnings(caplog, text):
    return [r for r in caplog.records if r.levelname == "WARNING" and text in r.getMessage()]


def test_target_capture_survives_install_torch_compiled(sglang_cpu, fused_norm_qualified, caplog):
    h = sglang_cpu
    dtype = torch.float32
    cfg = h.FAMILIES["llama"].make_config()
    stock = h.sglang_model("llama", cfg, dtype, seed=4)
    stock.set_eagle3_layers_to_capture(LAYER_IDS)
    model = h.sglang_model("llama", cfg, dtype, seed=4)
    h.configure_capture(model, LAYER_IDS)
    from eagle3_ops.sglang.capture_hooks import capture_state

    state = capture_state(model)
    assert "forward" not in vars(model.model)  # the wrapper is on the class, not the instance
    _install_torch_compiled(model.model)
    trampoline = vars(model.model)["forward"]
    assert isinstance(trampoline, types.MethodType) and trampoline.__func__.__name__ == "trampoline"

    _extend(h, model, cfg, dtype)  # learns which norms produce the captured residuals
    out = _extend(h, model, cfg, dtype)
    assert state.stats["buffer_forwards"] == 2 and state.stats["fused_captures"] == len(LAYER_IDS)
    assert out.hidden_states.data_ptr() == state.buffer.buffer.data_ptr()
    ref = _extend(h, stock, cfg, dtype)
    assert torch.equal(out.hidden_states, ref.hidden_states)
    assert torch.equal(out.next_token_logits, ref.next_token_logits)

    with caplog.at_level("WARNING", logger="eagle3_ops.sglang"):
        _graph_setup_done(model)
    assert _warnings(caplog, "no longer") == []


def test_warns_once_when_the_instance_no_longer_routes_through_the_plugin(sglang_cpu, caplog):
    """What install_torch_compiled did to an instance-level wrapper (before this fix): a trampoline
    calling the class's STOCK forward. The forward then runs stock, and the check says so once."""
    h = sglang_cpu
    dtype = torch.float32
    cfg = h.FAMILIES["llama"].make_config()
    model = h.sglang_model("llama", cfg, dtype, seed=5)
    h.configure_capture(model, LAYER_IDS)
    from eagle3_ops.sglang.capture_hooks import capture_state

    state = capture_state(model)
    stock_forward = type(model.model).forward.__wrapped__  # SGLang's LlamaModel.forward

    def trampoline(self, *args, **kwargs):
        return stock_forward(self, *args, **kwargs)

    model.model.forward = types.MethodType(trampoline, model.model)
    with caplog.at_level("WARNING", logger="eagle3_ops.sglang"):
        _graph_setup_done(model)
        _graph_setup_done(model)  # init_prefill_cuda_graph after init_cuda_graphs: still one warning
    found = _warnings(caplog, "no longer goes through the plugin")
    assert len(found) == 1 and "trampoline" in found[0].getMessage()
    out = _extend(h, model, cfg, dtype)
    assert state.stats["buffer_forwards"] == 0  # indeed bypassed: stock capture
    assert out.hidden_states.data_ptr() != state.buffer.buffer.data_ptr()


def test_warns_when_a_fused_norm_is_replaced(sglang_cpu, fused_norm_qualified, caplog):
    h = sglang_cpu
    cfg = h.FAMILIES["llama"].make_config()
    model = h.sglang_model("llama", cfg, torch.float32, seed=6)
    h.configure_capture(model, LAYER_IDS)
    norm = model.model.layers[2].input_layernorm
    assert getattr(vars(norm).get("forward"), "_eagle3_ops", False)  # a candidate: wrapped on the instance
    norm.forward = norm.forward.__wrapped__
    with caplog.at_level("WARNING", logger="eagle3_ops.sglang"):
        _graph_setup_done(model)
    found = _warnings(caplog, "no longer goes through the plugin")
    assert len(found) == 1 and "'model.layers.2.input_layernorm'" in found[0].getMessage()


def test_draft_fc_survives_install_torch_compiled(sglang_cpu, caplog):
    h = sglang_cpu
    dtype = torch.float32
    cfg = h.FAMILIES["llama"].make_config()
    dcfg = h.eagle3_draft_config(cfg, layer_ids=LAYER_IDS, fc_norm=True)
    draft = h.eagle3_draft(dcfg, dtype)
    h.configure_capture(draft, None, eagle=False)
    from eagle3_ops.sglang.draft_fc_hooks import draft_fc_state
    from sglang.srt.speculative.eagle_info import EagleDraftExtendInput

    state = draft_fc_state(draft)
    _install_torch_compiled(draft.model)
    aux = torch.randn(sum(map(len, PROMPTS)), len(LAYER_IDS) * cfg.hidden_size)
    kv = h.KVCache(dcfg, dtype)
    spec = EagleDraftExtendInput(hidden_states=aux, num_tokens_per_req=1, num_tokens_for_logprob_per_req=1)
    h.run(draft, h.extend_batch(kv, [h.Req(kv.new_req()) for _ in PROMPTS], PROMPTS, capture="LAST",
                                spec_info=spec), kv)
    assert state.stats["fused_calls"] == 1
    with caplog.at_level("WARNING", logger="eagle3_ops.sglang"):
        _graph_setup_done(draft)
    assert _warnings(caplog, "no longer") == []

    stock_forward = type(draft.model).forward.__wrapped__
    draft.model.forward = types.MethodType(lambda self, *a, **k: stock_forward(self, *a, **k), draft.model)
    with caplog.at_level("WARNING", logger="eagle3_ops.sglang"):
        _graph_setup_done(draft)
    assert len(_warnings(caplog, "no longer goes through the plugin")) == 1


def test_class_wrapper_steps_aside_under_sglang_compile():
    """The compiled side of the trampoline (inside tc_piecewise capture/replay): Dynamo traces the
    class wrapper with fullgraph=True; it must trace (no graph break) and run the original forward.
    Each wrapped class gets its own code object (install_torch_compiled evicts Dynamo's cache per
    code object)."""
    from eagle3_ops.sglang.routing import wrap_class_forward
    from sglang.srt.model_executor.runner_backend_utils.tc_piecewise_cuda_graph.context_manager import (
        enable_tc_piecewise_cuda_graph)

    calls = []

    class Toy(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2

    class Other(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x - 1

    def run(state, original, self, args, kwargs):
        calls.append(state)
        return original(self, *args, **kwargs) + 100

    w1 = wrap_class_forward(Toy, "_toy_state", run)
    assert wrap_class_forward(Toy, "_toy_state", run) is w1  # idempotent
    w2 = wrap_class_forward(Other, "_toy_state", run)
    assert w1.__code__ is not w2.__code__

    plain, patched = Toy(), Toy()
    patched.__dict__["_toy_state"] = "s"
    x = torch.ones(3)
    assert torch.equal(plain(x), x * 2) and torch.equal(patched(x), x * 2 + 100) and calls == ["s"]
    _install_torch_compiled(patched)
    assert torch.equal(patched(x), x * 2 + 100) and calls == ["s", "s"]  # eager side of the trampoline
    with torch._dynamo.config.patch(disable=False), enable_tc_piecewise_cuda_graph():
        out = patched(x)
    assert torch.equal(out, x * 2) and calls == ["s", "s"]  # compiled: SGLang's own forward
