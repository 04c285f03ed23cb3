"""One-time check of an accelerated backend against the reference on a small random problem.

It protects users on GPUs we have never run on (e.g. a new sm_120 board): the first time a backend
serves an op on a device for a dtype, it runs a small problem in that dtype with odd sizes (vector tail, row gather,
both norms, bias) and compares with the reference. Outputs are poisoned with NaN first and the
canary columns/rows around every write must come back unchanged.
"""
from __future__ import annotations

from typing import Callable, Tuple

import torch

from . import reference

ATOL_RTOL = 2e-2  # bf16 output: one rounding (2^-8) plus fp32 summation-order differences; generous for
                  # fp16/fp32 too: this check catches broken kernels, the test suite measures accuracy


def _close(a: torch.Tensor, b: torch.Tensor) -> Tuple[bool, str]:
    a, b = a.float(), b.float()
    if a.shape != b.shape:
        return False, f"shape {tuple(a.shape)} != {tuple(b.shape)}"
    if torch.isnan(a).any() != torch.isnan(b).any() or not torch.equal(torch.isnan(a), torch.isnan(b)):
        return False, "NaN pattern differs (unwritten output or canary overwritten)"
    finite = ~torch.isnan(b)
    err = ((a - b).abs()[finite] / (b.abs()[finite] + 1.0)).max().item() if finite.any() else 0.0
    return err <= ATOL_RTOL, f"max rel err {err:.3g}"


PAD = 8  # canary rows/columns around every output view; the view starts at row PAD // 2


def _poisoned(rows: int, cols: int, device, dtype):
    """(base, view): a NaN-filled base with canary rows above/below and columns right of a
    [rows, cols] view. Comparing whole bases checks the canaries as well as the written region."""
    base = torch.full((rows + PAD, cols + PAD), float("nan"), device=device, dtype=dtype)
    return base, _view(base, rows, cols)


def _view(base: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return base[PAD // 2:PAD // 2 + rows, :cols]


def _capture_problem(device, dtype, gen, with_norm: bool):
    T, H, K, slot = 37, 1000 + 24, 3, 1  # H a multiple of 8 (vector path) but not of the block width
    h = torch.randn(T, H, generator=gen).to(device, dtype)
    r = torch.randn(T, H, generator=gen).to(device, dtype)
    base, buf = _poisoned(T + 3, K * H, device, dtype)
    w = (torch.rand(H, generator=gen) + 0.5).to(device, dtype) if with_norm else None
    return h, r, base, buf, slot, w


def _guarded(check):
    """A crashing kernel fails verification; it must not take the process down."""
    def run(fn: Callable, device: torch.device, dtype: torch.dtype = torch.bfloat16, backend: str = "") -> Tuple[bool, str]:
        try:
            return check(fn, device, dtype, backend)
        except Exception as e:
            return False, f"{type(e).__name__}: {e}"
    run.__name__ = run.__qualname__ = check.__name__
    return run


@_guarded
def selfcheck_capture(fn, device, dtype, backend):
    gen = torch.Generator().manual_seed(1234)
    h, r, base, buf, slot, _ = _capture_problem(device, dtype, gen, with_norm=False)
    ref_base = base.clone()
    fn(h, r, buf, slot)
    reference.capture(h, r, _view(ref_base, *buf.shape), slot)
    return _close(base, ref_base)


@_guarded
def selfcheck_fused_add_rmsnorm_capture(fn, device, dtype, backend):
    gen = torch.Generator().manual_seed(1234)
    h, r, base, buf, slot, w = _capture_problem(device, dtype, gen, with_norm=True)
    h2, r2, ref_base = h.clone(), r.clone(), base.clone()
    fn(h, r, w, 1e-6, buf, slot)
    reference.fused_add_rmsnorm_capture(h2, r2, w, 1e-6, _view(ref_base, *buf.shape), slot)
    detail = ""
    for got, want in ((h, h2), (r, r2), (base, ref_base)):
        ok, detail = _close(got, want)
        if not ok:
            return ok, detail
    return True, detail


@_guarded
def selfcheck_draft_fc(fn, device, dtype, backend):
    from .dispatch import function

    gen = torch.Generator().manual_seed(1234)
    R, K, H, N = 19, 3, 136, 200
    x = torch.randn(R, K * H, generator=gen).to(device, dtype)
    w = (torch.randn(N, K * H, generator=gen) / (K * H) ** 0.5).to(device, dtype)
    b = torch.randn(N, generator=gen).to(device, dtype)
    rows = torch.tensor([18, 0, 5, 5, 11, 2, 17], device=device, dtype=torch.int32)
    cn = (torch.rand(K, H, generator=gen) + 0.5).to(device, dtype)
    inw = (torch.rand(K * H, generator=gen) + 0.5).to(device, dtype)
    detail = ""
    # unfolded with everything, plain, and the folded-norm variant (weight prepared with the gains)
    folded_inw = None if dtype == torch.float16 else inw  # fp16 folds with a chunk norm only (validation)
    for args, folded in (((b, rows, cn, inw), False), ((None, None, None, None), False),
                         ((b, rows, cn, folded_inw), True)):
        M = R if args[1] is None else args[1].numel()
        base, out = _poisoned(M, N, device, dtype)
        want = base.clone()
        weight = reference.fold_norm_weights_ref(w, args[2], args[3]) if folded else w
        need = function(backend, "draft_fc_workspace_bytes")(x, weight, *args, folded) if backend else 0
        ws = torch.empty(need, dtype=torch.uint8, device=device) if need else None
        fn(x, weight, *args, 1e-6, out, ws, folded)
        _view(want, M, N).copy_(reference.draft_fc_ref(x, weight, *args, 1e-6, norm_folded=folded).to(dtype))
        ok, detail = _close(base, want)
        if not ok:
            return ok, detail
    return True, detail
