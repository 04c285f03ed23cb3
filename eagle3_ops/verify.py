"""One-time check of an accelerated backend against the reference on a small random problem.

It protects users on GPUs we have never run on (e.g. a new sm_120 board): the first time a backend
serves an op on a device, it runs a small bf16 problem with odd sizes (vector tail, row gather,
both norms, bias) and compares with the reference. Outputs are poisoned with NaN first and the
canary columns/rows around every write must come back unchanged.
"""
from __future__ import annotations

from typing import Callable, Tuple

import torch

from . import reference

DTYPE = torch.bfloat16
ATOL_RTOL = 2e-2  # bf16 output: one rounding (2^-8) plus fp32 summation-order differences


def _close(a: torch.Tensor, b: torch.Tensor) -> Tuple[bool, str]:
    a, b = a.float(), b.float()
    if a.shape != b.shape:
        return False, f"shape {tuple(a.shape)} != {tuple(b.shape)}"
    if torch.isnan(a).any() != torch.isnan(b).any() or not torch.equal(torch.isnan(a), torch.isnan(b)):
        return False, "NaN pattern differs (unwritten output or canary overwritten)"
    finite = ~torch.isnan(b)
    err = ((a - b).abs()[finite] / (b.abs()[finite] + 1.0)).max().item() if finite.any() else 0.0
    return err <= ATOL_RTOL, f"max rel err {err:.3g}"


def _capture_problem(device, gen, with_norm: bool):
    T, H, K, slot = 37, 1000 + 24, 3, 1  # H a multiple of 8 (vector path) but not of the block width
    h = torch.randn(T, H, generator=gen).to(device, DTYPE)
    r = torch.randn(T, H, generator=gen).to(device, DTYPE)
    buf = torch.full((T + 3, K * H + 8), float("nan"), device=device, dtype=DTYPE)[:, : K * H]
    w = (torch.rand(H, generator=gen) + 0.5).to(device, DTYPE) if with_norm else None
    return h, r, buf, slot, w


def verify_backend(op: str, fn: Callable, device: torch.device) -> Tuple[bool, str]:
    gen = torch.Generator().manual_seed(1234)
    try:
        if op == "capture":
            h, r, buf, slot, _ = _capture_problem(device, gen, with_norm=False)
            ref = buf.clone()
            fn(h, r, buf, slot)
            reference.capture_ref(h, r, ref, slot)
            return _close(buf, ref)
        if op == "fused_add_rmsnorm_capture":
            h, r, buf, slot, w = _capture_problem(device, gen, with_norm=True)
            h2, r2, ref = h.clone(), r.clone(), buf.clone()
            fn(h, r, w, 1e-6, buf, slot)
            reference.fused_add_rmsnorm_capture_ref(h2, r2, w, 1e-6, ref, slot)
            for got, want in ((h, h2), (r, r2), (buf, ref)):
                ok, detail = _close(got, want)
                if not ok:
                    return ok, detail
            return True, detail
        if op == "draft_fc":
            R, K, H, N = 19, 3, 136, 200
            x = torch.randn(R, K * H, generator=gen).to(device, DTYPE)
            w = (torch.randn(N, K * H, generator=gen) / (K * H) ** 0.5).to(device, DTYPE)
            b = torch.randn(N, generator=gen).to(device, DTYPE)
            rows = torch.tensor([18, 0, 5, 5, 11, 2, 17], device=device, dtype=torch.int32)
            cn = (torch.rand(K, H, generator=gen) + 0.5).to(device, DTYPE)
            inw = (torch.rand(K * H, generator=gen) + 0.5).to(device, DTYPE)
            for args in ((b, rows, cn, inw), (None, None, None, None)):
                M = R if args[1] is None else args[1].numel()
                out = torch.full((M, N), float("nan"), device=device, dtype=DTYPE)
                fn(x, w, *args, 1e-6, out)
                want = reference.draft_fc_ref(x, w, *args, 1e-6).to(DTYPE)
                ok, detail = _close(out, want)
                if not ok:
                    return ok, detail
            return True, detail
        raise ValueError(f"no verification problem for op {op!r}")
    except Exception as e:  # a crashing kernel fails verification; it must not take the process down
        return False, f"{type(e).__name__}: {e}"
