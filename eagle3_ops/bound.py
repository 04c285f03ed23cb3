"""Calls planned once: an op's backend function with its backend, path and launch fixed ahead of time.

The public ops (``ops.py``) decide on every call: they check the contract, select the backend, plan the
launch. A caller that has decided already (the SGLang plugin at install, from qualification's plan;
qualification itself, timing one candidate) holds a bound call instead and calls it with the per-call
tensors only: no thread-local scope, no selection, no contract check on the way (the caller guarantees
the contract for what it binds and checks what varies per call; the CUDA ops still check memory safety).

* :func:`capture` / :func:`fused_add_rmsnorm_capture`: the verified backend function itself (the launch
  has nothing to plan).
* :class:`DraftFc`: ``draft_fc`` on one backend and path; :meth:`DraftFc.plan` plans one call (any layout),
  :meth:`DraftFc.plan_rows` the plugin's calls (a contiguous ``[M, K*H]`` input, no row gather) once per
  row count M; ``__call__`` runs a plan.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional

import torch

from . import dispatch


def capture(backend: str, device: torch.device, dtype: torch.dtype) -> Callable:
    """``fn(hidden, residual, buffer, slot)``: ``backend``'s capture on ``device`` for ``dtype``, verified."""
    return dispatch.verified_function("capture", backend, device, dtype)


def fused_add_rmsnorm_capture(backend: str, device: torch.device, dtype: torch.dtype) -> Callable:
    """``fn(input, residual, weight, eps, buffer, slot)``: ``backend``'s fused add+RMSNorm+capture, verified."""
    return dispatch.verified_function("fused_add_rmsnorm_capture", backend, device, dtype)


def _layout(t):
    """What a plan reads of a fixed tensor: shape, strides, 16-byte alignment (None when absent). A reload that
    hands in another layout gets its own plan instead of one made for the old."""
    return None if t is None else (tuple(t.shape), t.stride(), t.data_ptr() % 16 == 0)


class DraftFc:
    """``draft_fc`` on ``backend`` and ``path`` (None: the backend's crossover table), for inputs of ``dtype``
    on ``device``, its function verified at construction (raises ``dispatch.BackendUnavailableError``)."""

    def __init__(self, backend: str, path: Optional[str], device: torch.device, dtype: torch.dtype):
        self.backend, self.path = backend, path
        self.fn = dispatch.verified_function("draft_fc", backend, device, dtype)
        self._planner = dispatch.function(backend, "draft_fc_plan")
        self._by_rows: Dict[tuple, object] = {}

    def plan(self, x, weight, bias, rows, chunk_norm_weight, input_norm_weight, norm_folded: bool = False):
        """This call's plan (path, launch, ``.nbytes`` of workspace) on this backend and path. Pure: only
        shapes, strides, dtypes and alignment are read (``x`` and ``rows`` may be meta tensors)."""
        return self._planner(x, weight, bias, rows, chunk_norm_weight, input_norm_weight, norm_folded, self.path)

    def plan_rows(self, M: int, weight, bias, chunk_norm_weight, input_norm_weight, norm_folded: bool = False):
        """The plan of a call on a contiguous, 16-byte aligned ``[M, weight.shape[1]]`` input without a row
        gather, made once per (M, the fixed tensors' layout: :func:`_layout`) and kept: what the plugin's forwards
        run (the caller checks that its input is such a tensor)."""
        key = (M, norm_folded) + tuple(_layout(t) for t in (weight, bias, chunk_norm_weight, input_norm_weight))
        planned = self._by_rows.get(key)
        if planned is None:
            x = torch.empty((M, weight.shape[1]), dtype=weight.dtype, device="meta")
            planned = self._by_rows[key] = self.plan(x, weight, bias, None, chunk_norm_weight, input_norm_weight,
                                                     norm_folded)
        return planned

    def __call__(self, planned, x, weight, bias, rows, chunk_norm_weight, input_norm_weight, eps: float, out,
                 workspace: Optional[torch.Tensor], norm_folded: bool = False) -> None:
        """``out = linear(norm(x[rows]), weight, bias)`` as ``planned`` (from :meth:`plan` / :meth:`plan_rows`
        for these arguments' layout), scratch carved from ``workspace`` (at least ``planned.nbytes``)."""
        self.fn(x, weight, bias, rows, chunk_norm_weight, input_norm_weight, eps, out, workspace, norm_folded,
                planned=planned)

    def __repr__(self) -> str:
        return f"bound.DraftFc({self.backend}/{self.path or '-'})"
