"""SGLang's CUDA-graph runners copy the target's aux states ``[T, K*H]`` into static buffers; where
it is safe, those buffers become views of the target's persistent capture buffer, so the copy is
same-storage (``Tensor.copy_`` returns before launching anything when destination and source are
the same view: same storage, offset, sizes, strides and dtype) and drops out of the captured graph.

Three copies, SGLang 0.5.23:

* **Target prefill, breakable CUDA graph (BCG)**: each bucket's output is copied inside the graph
  into one shared output buffer allocated from the largest bucket's output
  (``BreakableCudaGraphBackend._alloc_full_buffer`` / ``_copy_output_to_buffer``). The leaf that is
  the capture buffer's ``[:T]`` view gets the capture buffer's ``[:size]`` view as its buffer (when
  the buffer has that many rows); the hidden-state leaf keeps its own buffer.
* **Draft prefill, BCG** (``PrefillCudaGraphRunner.static_draft_hidden_states``, ``[max_bucket, K*H]``,
  refreshed by ``load_batch`` with ``static[:T].copy_(spec_info.hidden_states)``).
* **Draft extend after verify** (``EAGLEDraftExtendCudaGraphRunner.buffers.hidden_states``,
  ``[max_bs*D, K*H]``, refreshed by ``execute`` with ``buffers.hidden_states[:T].copy_(...)``).

Why it is safe (the argument that makes the persistent buffer itself safe): the rows a target
forward writes are read by the draft's first step, which SGLang runs right after it on the same
stream, before the next target forward writes them again. The static buffers are only ever
written by those copies (the graphs read them), and the copies' sources are the target's output of
that step: the capture buffer's ``[:T]`` view (no-op), or, when the target forward did not use the
buffer (more tokens than it holds, topk>1 compaction's clone), a separate tensor whose rows are
copied into the capture buffer's rows at a moment when nothing else needs them. Rows past T are
padding, stale in stock SGLang too. The one case a copy would fail: a source that is a view of the
capture buffer at another offset (overlapping copy); the hooks before ``load_batch`` / ``execute``
clone such a source first (one warning) instead. The aliasing is decided before the graphs are
captured (hooks BEFORE ``capture``), so the graphs are captured against the final buffers.
"""
from __future__ import annotations

import logging
import weakref
from typing import Optional

import torch

log = logging.getLogger("eagle3_ops.sglang")

BCG_ALLOC_TARGET = ("sglang.srt.model_executor.runner_backend.breakable_cuda_graph_backend."
                    "BreakableCudaGraphBackend._alloc_full_buffer")
DRAFT_PREFILL_CAPTURE_TARGET = ("sglang.srt.model_executor.runner.prefill_cuda_graph_runner."
                                "PrefillCudaGraphRunner.capture")
DRAFT_PREFILL_LOAD_TARGET = ("sglang.srt.model_executor.runner.prefill_cuda_graph_runner."
                             "PrefillCudaGraphRunner.load_batch")
DRAFT_EXTEND_CAPTURE_TARGET = ("sglang.srt.speculative.eagle_draft_extend_cuda_graph_runner."
                               "EAGLEDraftExtendCudaGraphRunner.capture")
DRAFT_EXTEND_EXECUTE_TARGET = ("sglang.srt.speculative.eagle_draft_extend_cuda_graph_runner."
                               "EAGLEDraftExtendCudaGraphRunner.execute")

_aliased_runners: "weakref.WeakSet" = weakref.WeakSet()
_logged: set = set()


def _log_once(key: str, level: int, msg: str, *args) -> None:
    if key not in _logged:
        _logged.add(key)
        log.log(level, msg, *args)


def _state_for(t: torch.Tensor):
    """The enabled target capture state whose buffer ``t`` is a view of, if any."""
    from .capture_hooks import installed_states

    if not isinstance(t, torch.Tensor) or t.dim() != 2:
        return None
    for state in installed_states():
        buf = state.buffer.buffer
        if state.enabled and t.device == buf.device and \
                t.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr():
            return state
    return None


def _is_prefix_view(t: torch.Tensor, state) -> bool:
    buf = state.buffer.buffer
    return (t.data_ptr() == buf.data_ptr() and t.dtype == buf.dtype and t.shape[1] == buf.shape[1]
            and t.stride() == buf.stride() and t.shape[0] <= buf.shape[0])


def capture_view_for(static: torch.Tensor):
    """(state, view) when ``static`` ([rows, K*H]) can be replaced by the ``[:rows]`` view of exactly
    one installed target's capture buffer (same width, dtype, device, at least ``rows`` rows), else
    (None, None)."""
    from .capture_hooks import installed_states

    if not isinstance(static, torch.Tensor) or static.dim() != 2:
        return None, None
    fits = [s for s in installed_states()
            if s.enabled and s.buffer.buffer.shape[1] == static.shape[1] and s.buffer.buffer.dtype == static.dtype
            and s.buffer.buffer.device == static.device and s.max_tokens >= static.shape[0]]
    if len(fits) > 1:
        _log_once("ambiguous", logging.INFO, "eagle3_ops: %d capture buffers would fit a static draft input of "
                  "[%d, %d]; it keeps SGLang's own buffer", len(fits), static.shape[0], static.shape[1])
    if len(fits) != 1:
        return None, None
    return fits[0], fits[0].buffer.view(static.shape[0])


# ---- target prefill BCG: the shared output buffer's aux leaf -----------------------------------------
def bcg_output_slot(output, size) -> Optional[torch.Tensor]:
    """For SGLang's ``BreakableCudaGraphBackend._alloc_full_buffer`` (recursive over the output's
    structure, so every leaf passes through the plugin's AROUND hook): the capture buffer's
    ``[:size]`` view when the leaf ``output`` is the capture buffer's prefix view, else None (SGLang
    allocates the leaf's buffer)."""
    if not torch.is_tensor(output):
        return None
    state = _state_for(output)
    if state is None or not _is_prefix_view(output, state) or size > state.max_tokens:
        return None
    _log_once(f"bcg:{state.model_name}", logging.INFO,
              "eagle3_ops: %s prefill CUDA graphs: the aux states' slot in SGLang's shared output buffer is the "
              "capture buffer itself (%d rows): the in-graph copy of [T, %d] per prefill is gone",
              state.model_name, size, output.shape[1])
    return state.buffer.view(size)


# ---- draft prefill BCG and draft extend: static inputs ---------------------------------------------
def _alias_static(runner, static, assign, what: str) -> None:
    """Point a runner's static input at the capture buffer (``assign(view)``) when one fits."""
    state, view = capture_view_for(static)
    if state is None:
        return
    assign(view)
    _aliased_runners.add(runner)
    _log_once(f"{what}:{state.model_name}", logging.INFO,
              "eagle3_ops: %s CUDA graphs read the %s capture buffer directly (%d rows): the copy of the aux "
              "states into SGLang's static draft input (%s) is gone", what, state.model_name, view.shape[0],
              "per prefill" if what == "draft prefill" else "per decode step")


def before_draft_prefill_capture(*args, **kwargs):
    """BEFORE ``PrefillCudaGraphRunner.capture``: a draft runner's ``static_draft_hidden_states``."""
    runner = kwargs.get("self", args[0] if args else None)
    static = getattr(runner, "static_draft_hidden_states", None)
    if static is not None and getattr(getattr(runner, "model_runner", None), "is_draft_worker", False):
        _alias_static(runner, static, lambda v: setattr(runner, "static_draft_hidden_states", v), "draft prefill")
    return None


def before_draft_extend_capture(*args, **kwargs):
    """BEFORE ``EAGLEDraftExtendCudaGraphRunner.capture``: its ``buffers.hidden_states``."""
    runner = kwargs.get("self", args[0] if args else None)
    buffers = getattr(runner, "buffers", None)
    static = getattr(buffers, "hidden_states", None)
    if static is not None:
        _alias_static(runner, static, lambda v: setattr(buffers, "hidden_states", v), "draft-extend")
    return None


def _guard_source(runner, forward_batch) -> None:
    """Before a copy into an aliased static buffer: a source that is a view of the capture buffer
    but not its prefix (an overlapping copy, which torch refuses) is cloned first."""
    if runner not in _aliased_runners:
        return
    spec = getattr(forward_batch, "spec_info", None)
    src = getattr(spec, "hidden_states", None)
    state = _state_for(src)
    if state is not None and not _is_prefix_view(src, state):
        _log_once(f"overlap:{state.model_name}", logging.WARNING,
                  "eagle3_ops: a draft input is a view of the %s capture buffer at another offset; it is copied "
                  "aside before SGLang refreshes its static input (correct, one extra copy)", state.model_name)
        spec.hidden_states = src.clone()


def before_draft_prefill_load_batch(*args, **kwargs):
    """BEFORE ``PrefillCudaGraphRunner.load_batch``: on an aliased runner, a draft input that views the capture buffer
    at another offset is cloned first (:func:`_guard_source`)."""
    runner = kwargs.get("self", args[0] if args else None)
    forward_batch = kwargs.get("forward_batch", args[1] if len(args) > 1 else None)
    _guard_source(runner, forward_batch)
    return None


def before_draft_extend_execute(*args, **kwargs):
    """BEFORE ``EAGLEDraftExtendCudaGraphRunner.execute``: on an aliased runner, a draft input that views the capture
    buffer at another offset is cloned first (:func:`_guard_source`)."""
    runner = kwargs.get("self", args[0] if args else None)
    forward_batch = kwargs.get("forward_batch", args[1] if len(args) > 1 else None)
    _guard_source(runner, forward_batch)
    return None


def is_aliased(runner) -> bool:
    """Whether ``runner``'s static draft input was made a view of a capture buffer."""
    return runner in _aliased_runners


def reset_logs() -> None:  # tests: each starts with a clean slate
    """Forgets which log lines were written, so each is written once again (tests)."""
    _logged.clear()
