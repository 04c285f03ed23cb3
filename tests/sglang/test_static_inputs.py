"""SGLang's static copies of the aux states made same-storage (eagle3_ops/sglang/static_inputs.py).

The target-prefill BCG buffer is exercised with SGLang's own ``_alloc_full_buffer`` /
``_copy_output_to_buffer`` (hooked by the plugin in this session) on real outputs. The two draft
runners need a GPU to construct, so their hooks run on stand-ins with the attributes SGLang's
runners have, and the copy statements they rely on are checked in SGLang's source."""
import inspect
import logging
import types

import pytest
import torch

LAYER_IDS = [0, 1, 2]
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8]]


class _Writes(torch.utils._python_dispatch.TorchDispatchMode):
    """Bytes each aten.copy_ really moves (torch skips a copy onto the same view)."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default:
            dst, src = args[0], args[1]
            same = (dst.data_ptr() == src.data_ptr() and dst.shape == src.shape and dst.stride() == src.stride()
                    and dst.dtype == src.dtype)
            if not same:
                self.bytes += dst.numel() * dst.element_size()
        return func(*args, **(kwargs or {}))


@pytest.fixture
def target(sglang_cpu, monkeypatch):
    """One installed target, as in an SGLang worker process (the hooks refuse to choose between
    several capture buffers; other tests' models may still be alive in this process)."""
    import weakref

    from eagle3_ops.sglang import capture_hooks

    monkeypatch.setattr(capture_hooks, "_installed", weakref.WeakSet())
    h = sglang_cpu
    dtype = torch.float32
    cfg = h.FAMILIES["llama"].make_config()
    model = h.sglang_model("llama", cfg, dtype, seed=5)
    h.configure_capture(model, LAYER_IDS)
    from eagle3_ops.sglang import static_inputs
    from eagle3_ops.sglang.capture_hooks import capture_state

    static_inputs.reset_logs()
    assert len(capture_hooks.installed_states()) == 1
    return h, cfg, dtype, model, capture_state(model)


def test_bcg_output_slot_is_the_capture_buffer(target, caplog):
    h, cfg, dtype, model, state = target
    from sglang.srt.model_executor.runner_backend.breakable_cuda_graph_backend import BreakableCudaGraphBackend

    bcg = BreakableCudaGraphBackend.__new__(BreakableCudaGraphBackend)
    out = h.inner_forward(model, cfg, dtype, PROMPTS)
    T, KH = out[1].shape
    with caplog.at_level(logging.INFO, logger="eagle3_ops"):
        buffer = bcg._alloc_full_buffer(out, 16)  # the largest bucket: 16 rows
    assert buffer[1].data_ptr() == state.buffer.buffer.data_ptr() and buffer[1].shape == (16, KH)
    assert buffer[0].data_ptr() != out[0].data_ptr()  # the hidden states keep SGLang's own buffer
    expected = out[1].clone()
    with _Writes() as writes:
        bcg._copy_output_to_buffer(out, buffer, T)
    assert writes.bytes == T * cfg.hidden_size * 4  # only the [T, H] hidden states were copied
    assert torch.equal(buffer[1][:T], expected)
    assert sum("copy of [T, %d] per prefill is gone" % KH in r.getMessage() for r in caplog.records) == 1


def test_bcg_buffer_larger_than_the_capture_buffer_is_sglangs(sglang_cpu, monkeypatch):
    import weakref

    from eagle3_ops.sglang import capture_hooks

    monkeypatch.setattr(capture_hooks, "_installed", weakref.WeakSet())
    h = sglang_cpu
    monkeypatch.setenv("EAGLE3_OPS_SGLANG_MAX_TOKENS", "12")
    cfg = h.FAMILIES["llama"].make_config()
    model = h.sglang_model("llama", cfg, torch.float32, seed=5)
    h.configure_capture(model, LAYER_IDS)
    from eagle3_ops.sglang.capture_hooks import capture_state
    from sglang.srt.model_executor.runner_backend.breakable_cuda_graph_backend import BreakableCudaGraphBackend

    out = h.inner_forward(model, cfg, torch.float32, PROMPTS)
    assert out[1].data_ptr() == capture_state(model).buffer.buffer.data_ptr()
    buffer = BreakableCudaGraphBackend.__new__(BreakableCudaGraphBackend)._alloc_full_buffer(out, 16)
    assert buffer[1].data_ptr() != out[1].data_ptr()  # 16 rows do not fit the 12-row buffer


class _PrefillRunner:
    """Stand-in with the attributes of SGLang's PrefillCudaGraphRunner the hooks read."""

    def __init__(self, static, is_draft=True):
        self.static_draft_hidden_states = static
        self.model_runner = types.SimpleNamespace(is_draft_worker=is_draft)


class _ExtendRunner:
    """Stand-in with the attributes of SGLang's EAGLEDraftExtendCudaGraphRunner the hooks read."""

    def __init__(self, static):
        self.buffers = types.SimpleNamespace(hidden_states=static)


def _squash(src: str) -> str:
    return " ".join(src.split())


def test_sglang_copies_the_hooks_rely_on():
    from sglang.srt.model_executor.runner.prefill_cuda_graph_runner import PrefillCudaGraphRunner
    from sglang.srt.speculative.eagle_draft_extend_cuda_graph_runner import EAGLEDraftExtendCudaGraphRunner

    load = _squash(inspect.getsource(PrefillCudaGraphRunner.load_batch))
    assert "self.static_draft_hidden_states[:num_tokens].copy_( forward_batch.spec_info.hidden_states )" in load
    execute = _squash(inspect.getsource(EAGLEDraftExtendCudaGraphRunner.execute))
    assert "buffers.hidden_states[:num_tokens].copy_( forward_batch.spec_info.hidden_states )" in execute
    # both static inputs exist before the runner captures its graphs (the hooks run BEFORE capture)
    prefill_init = _squash(inspect.getsource(PrefillCudaGraphRunner.__init__))
    assert prefill_init.index("self.static_draft_hidden_states = torch.zeros(") < prefill_init.index(
        "self.capture()")
    init = _squash(inspect.getsource(EAGLEDraftExtendCudaGraphRunner.__init__))
    assert init.index("hidden_states = ( torch.zeros( (self.max_num_token, _hidden_size),") < init.index(
        "self.buffers.share_buffers(") < init.index("self.capture()")


@pytest.mark.parametrize("runner_kind", ["draft-prefill", "draft-extend"])
def test_draft_static_input_is_the_capture_buffer(target, runner_kind):
    h, cfg, dtype, model, state = target
    from eagle3_ops.sglang import static_inputs

    KH = len(LAYER_IDS) * cfg.hidden_size
    rows = 64
    if runner_kind == "draft-prefill":
        runner = _PrefillRunner(torch.zeros(rows, KH))
        static_inputs.before_draft_prefill_capture(runner)
        static = runner.static_draft_hidden_states
        refresh = static_inputs.before_draft_prefill_load_batch
    else:
        runner = _ExtendRunner(torch.zeros(rows, KH))
        static_inputs.before_draft_extend_capture(runner)
        static = runner.buffers.hidden_states
        refresh = static_inputs.before_draft_extend_execute
    assert static.data_ptr() == state.buffer.buffer.data_ptr() and static.shape == (rows, KH)
    # rows no forward wrote yet are zeros, as in SGLang's own static buffers (graph padding reads them)
    assert torch.count_nonzero(static) == 0

    # one step: the target's output, then SGLang's refresh copy (the statement checked above)
    out = h.inner_forward(model, cfg, dtype, PROMPTS)
    T = out[1].shape[0]
    fb = types.SimpleNamespace(spec_info=types.SimpleNamespace(hidden_states=out[1]))
    refresh(runner, fb)
    assert fb.spec_info.hidden_states is out[1]
    expected = out[1].clone()
    with _Writes() as writes:
        static[:T].copy_(fb.spec_info.hidden_states)
    assert writes.bytes == 0 and torch.equal(static[:T], expected)

    # a source that is not the target's view (a stock forward's tensor) is copied in, as stock does
    fresh = torch.randn(T, KH)
    fb.spec_info.hidden_states = fresh
    refresh(runner, fb)
    with _Writes() as writes:
        static[:T].copy_(fb.spec_info.hidden_states)
    assert writes.bytes == T * KH * 4 and torch.equal(static[:T], fresh)


def test_overlapping_source_is_cloned_first(target, caplog):
    h, cfg, dtype, model, state = target
    from eagle3_ops.sglang import static_inputs

    KH = len(LAYER_IDS) * cfg.hidden_size
    runner = _ExtendRunner(torch.zeros(32, KH))
    static_inputs.before_draft_extend_capture(runner)
    static = runner.buffers.hidden_states
    shifted = state.buffer.buffer[2:6]
    want = shifted.clone()
    fb = types.SimpleNamespace(spec_info=types.SimpleNamespace(hidden_states=shifted))
    with caplog.at_level(logging.WARNING, logger="eagle3_ops"):
        static_inputs.before_draft_extend_execute(runner, fb)
    assert fb.spec_info.hidden_states is not shifted
    static[:4].copy_(fb.spec_info.hidden_states)  # would raise "refer to a single memory location" uncloned
    assert torch.equal(static[:4], want)
    assert sum("at another offset" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("case", ["too-many-rows", "other-width", "target-runner"])
def test_static_inputs_left_alone(target, case):
    h, cfg, dtype, model, state = target
    from eagle3_ops.sglang import static_inputs

    KH = len(LAYER_IDS) * cfg.hidden_size
    if case == "too-many-rows":
        runner = _PrefillRunner(torch.zeros(state.max_tokens + 1, KH))
    elif case == "other-width":
        runner = _PrefillRunner(torch.zeros(8, KH + 1))
    else:
        runner = _PrefillRunner(torch.zeros(8, KH), is_draft=False)
    before = runner.static_draft_hidden_states
    static_inputs.before_draft_prefill_capture(runner)
    assert runner.static_draft_hidden_states is before and not static_inputs.is_aliased(runner)
