"""One-time check of an accelerated backend against the float64 truth on a small random problem.

It protects users on GPUs we have never run on (e.g. a new sm_120 board): the first time a backend
serves an op on a device for a dtype, ``dispatch`` runs the op's self-check (its row in
``registry.py`` names it): a small problem in that dtype with odd sizes (vector tail, row gather,
both norms, bias), built, canaried and judged with the same kit and tolerances as the tests and
qualification (``problems.py``). Outputs are poisoned with NaN first and every element around them
must come back bitwise unchanged.

A self-check is ``(fn, device, dtype, functions) -> (ok, detail)``: ``fn`` the backend's function for
the op, ``functions`` all of that backend's functions (draft_fc sizes its workspace with
``draft_fc_workspace_bytes``). Nothing here imports dispatch: the caller passes what it resolved.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Tuple

import torch

from . import problems, reference

CAPTURE_SHAPE = dict(T=37, H=1000 + 24, K=3)  # H a multiple of 8 (vector path) but not of the block width
FC_SHAPE = dict(M=7, H=136, K=3, N=200)
FC_ROWS = (18, 0, 5, 5, 11, 2, 17)  # both ends of x's 19 rows, a repeat, out of order


def _guarded(check):
    """A crashing kernel (or a canary that changed: AssertionError) fails the check; it must not
    take the process down."""
    def run(fn: Callable, device: torch.device, dtype: torch.dtype = torch.bfloat16,
            functions: Dict[str, Callable] = None) -> Tuple[bool, str]:
        try:
            return check(fn, device, dtype, functions or {})
        except Exception as e:
            return False, f"{type(e).__name__}: {e}"
    run.__name__ = run.__qualname__ = check.__name__
    run.__doc__ = check.__doc__
    return run


def _within(checks) -> Tuple[bool, str]:
    """checks: (what, error, tolerance) -> (all within, a detail naming the worst)."""
    worst = max(checks, key=lambda c: c[1] / c[2])
    ok = all(err <= tol for _, err, tol in checks)
    return ok, f"max rel err {worst[1]:.3g} ({worst[0]}; tolerance {worst[2]:.3g})"


def _capture_problem(device, dtype, fused: bool) -> problems.CaptureProblem:
    return problems.capture_problem(**CAPTURE_SHAPE, dtype=dtype, device=device, key=("selfcheck",), slot=1,
                                    fused=fused, hidden_pad=3, extra_rows=3)


@_guarded
def selfcheck_capture(fn, device, dtype, functions):
    """buffer slot == hidden + residual (one rounding), nothing else written."""
    p = _capture_problem(device, dtype, fused=False)
    problems.run_canaried(lambda: fn(p.hidden, p.residual, p.buffer, p.slot), p.writes(), poison=[p.slot_view])
    return _within([("slot", problems.rel_err(p.slot_view, p.sum64()), problems.ROUNDING_TOL[dtype])])


@_guarded
def selfcheck_fused_add_rmsnorm_capture(fn, device, dtype, functions):
    """input <- rmsnorm(input + residual) * weight, residual and slot <- input + residual."""
    p = _capture_problem(device, dtype, fused=True)
    sum64, normed64 = p.sum64(), p.normed64()
    problems.run_canaried(lambda: fn(p.hidden, p.residual, p.weight, p.eps, p.buffer, p.slot), p.writes(),
                          poison=[p.slot_view])
    return _within([("normed input", problems.rel_err(p.hidden, normed64), problems.NORM_TOL[dtype]),
                    ("residual", problems.rel_err(p.residual, sum64), problems.ROUNDING_TOL[dtype]),
                    ("slot", problems.rel_err(p.slot_view, sum64), problems.ROUNDING_TOL[dtype])])


@_guarded
def selfcheck_draft_fc(fn, device, dtype, functions):
    """Unfolded with everything (bias, row gather, both norms), plain, and the folded-norm variant
    (weight prepared with the gains; fp16 folds a chunk norm only: validation), each against float64."""
    full = problems.fc_problem(**FC_SHAPE, dtype=dtype, device=device, key=("selfcheck",), bias=True, rows=True,
                               chunk=True, inorm=True, extra_rows=12)
    full = dataclasses.replace(full, rows=torch.tensor(FC_ROWS, dtype=torch.int32, device=device))
    plain = problems.FcProblem(full.x[:FC_SHAPE["M"]], full.weight)
    folded_inw = None if dtype == torch.float16 else full.input_norm_weight
    folded = dataclasses.replace(full, input_norm_weight=folded_inw)
    workspace_bytes = functions.get("draft_fc_workspace_bytes")
    results = []
    for what, p, norm_folded in (("all arguments", full, False), ("plain", plain, False),
                                 ("folded norms", folded, True)):
        weight = reference.fold_norm_weights_ref(p.weight, p.chunk_norm_weight, p.input_norm_weight) \
            if norm_folded else p.weight
        args = (p.x, weight) + p.args[2:]
        need = int(workspace_bytes(*args, norm_folded)) if workspace_bytes is not None else 0
        ws = torch.empty(need, dtype=torch.uint8, device=device) if need else None
        out = p.out()
        problems.run_canaried(lambda args=args, p=p, out=out, ws=ws, norm_folded=norm_folded:
                              fn(*args, p.eps, out, ws, norm_folded), [out], poison=[out])
        truth = reference.draft_fc_ref(*args, p.eps, norm_folded=norm_folded, acc_dtype=torch.float64)
        results.append((what, problems.rel_err(out, truth, normwise=True), problems.MATMUL_TOL[dtype]))
    return _within(results)
