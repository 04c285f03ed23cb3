"""Shared test utilities: fresh random data, poisoned outputs with canaries, error metrics."""
from __future__ import annotations

import torch

from eagle3_ops import dispatch

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Elementwise relative tolerance for a value rounded once into the dtype (half an ulp is 2^-9 for
# bf16, 2^-12 for fp16; we allow one ulp).
ROUNDING_TOL = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2e-6}
# Matmul outputs: max |err| / max |want| (fp32 accumulation order differs between backends).
MATMUL_TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 2e-5}
# draft_fc argument variants, the keyword flags of the tests' problem builders (make_problem /
# make_fc_problem / problem): bias, rows (a gather), chunk (chunk_norm_weight), inorm (input_norm_weight).
VARIANTS = {
    "plain": dict(),
    "bias": dict(bias=True),
    "rows": dict(rows=True),
    "chunk_norm": dict(chunk=True),
    "input_norm": dict(inorm=True),
    "all": dict(bias=True, rows=True, chunk=True, inorm=True),
}


def cpu_device() -> torch.device:
    return torch.device("cpu")


def randn(*shape, dtype, gen, device="cpu", scale=1.0):
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(device=device, dtype=dtype)


def backends_for(op: str, device=torch.device("cpu")) -> list:
    """Backends that can run ``op`` on ``device`` in this environment (reference always)."""
    out = []
    for b in dispatch.BACKENDS:
        if dispatch.implementation(b, op, device) is not None:
            out.append(b)
    return out


def poisoned_buffer(rows: int, width: int, dtype, device="cpu", pad_rows: int = 3, pad_cols: int = 5, gen=None):
    """A [rows, width] view inside a larger random base (row stride > width, extra rows after it).

    Returns (base, view). Every element of base is random garbage (with NaNs) so any stray write
    shows up; callers snapshot ``base`` and check everything outside the written region is unchanged.
    """
    gen = gen or torch.Generator().manual_seed(99)
    base = torch.randn(rows + pad_rows, width + pad_cols, generator=gen).mul_(1000).to(device=device, dtype=dtype)
    base[::7, ::3] = float("nan")
    return base, base[:rows, :width]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN == NaN)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))


def assert_only_region_written(before: torch.Tensor, after: torch.Tensor, rows: slice, cols: slice) -> None:
    """Everything outside after[rows, cols] is bitwise what it was (the canaries)."""
    mask = torch.ones(before.shape, dtype=torch.bool)
    mask[rows, cols] = False
    b, a = before[mask], after[mask]
    assert same_bits(b, a), "a write landed outside the output region (canary changed)"


def assert_rounded_close(got: torch.Tensor, want64: torch.Tensor, dtype) -> None:
    """got (dtype) equals the float64 truth up to one rounding, elementwise."""
    assert not torch.isnan(got).any(), "output has NaN (unwritten/poisoned element)"
    err = (got.double() - want64).abs()
    bound = ROUNDING_TOL[dtype] * want64.abs()
    bad = err > bound + torch.finfo(dtype).tiny
    assert not bad.any(), f"max rel err {(err / want64.abs().clamp_min(1e-30)).max().item():.3g} > {ROUNDING_TOL[dtype]}"


def matmul_rel_err(got: torch.Tensor, want64: torch.Tensor) -> float:
    if want64.numel() == 0:
        return 0.0
    return ((got.double() - want64).abs().max() / want64.abs().max().clamp_min(1e-30)).item()
