"""The problems the product itself runs, and the yardsticks it judges them with: the backends'
self-checks (``verify.py``), qualification (``qualify.py``) and the draft fc sharding decision
(``sglang/fc_sharding.py``). The op tests and the benchmarks build on the same kit (``tests/op_testing.py``
adds the test-only parts: targets, pytest parameters, graph replay).

* **Data.** :func:`generator` (seeded from a key, stable across processes), :func:`randn`,
  :func:`positive` (norm weights), :func:`strided` (views with canary padding), :func:`poisoned`
  (garbage x1000 with NaNs around every output).
* **Problems.** :func:`capture_problem` (also the fused op's, ``fused=True``) and :func:`fc_problem`:
  fresh random data (never zeros) in the layouts the kernels must handle; their float64 truths
  (``sum64``/``normed64``, ``truth()``).
* **Canaries.** :func:`run_canaried` poisons the outputs with NaN, runs the op, and checks that every
  element of the outputs' base tensors outside the outputs is bitwise unchanged.
* **Error metric and tolerances.** :func:`rel_err`: relative error against the float64 truth,
  elementwise (a value rounded once: :data:`ROUNDING_TOL` / :data:`NORM_TOL`) or normwise (matrix
  products, where fp32 accumulation order differs between backends: :data:`MATMUL_TOL`). NaN where
  the truth is finite (an unwritten, poisoned element) is an infinite error.
"""
from __future__ import annotations

import dataclasses
import functools
import zlib
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from . import reference

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Elementwise relative error of a value rounded once into the dtype (half an ulp is 2^-9 for bf16,
# 2^-12 for fp16; one ulp is allowed).
ROUNDING_TOL = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2e-6}
# Elementwise relative error of a normalized output: one ulp of the dtype plus the fp32 error of the
# sum of squares (its summation order differs between backends).
NORM_TOL = {dt: torch.finfo(dt).eps + 4e-6 for dt in DTYPES}
# Normwise (max |err| / max |truth|) relative error of matrix products.
MATMUL_TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 2e-5}
EPS = 1e-6


# ---- data ------------------------------------------------------------------------------------------
def generator(device, *key) -> torch.Generator:
    """A generator on ``device`` seeded from ``key`` (stable across processes, unlike hash())."""
    return torch.Generator(device=torch.device(device)).manual_seed(zlib.crc32(repr(key).encode()))


def randn(shape, dtype, device, gen, scale=1.0) -> torch.Tensor:
    """Fresh standard-normal data times ``scale`` in ``dtype`` (drawn in fp32 on ``device``)."""
    return (torch.randn(tuple(shape), generator=gen, device=device, dtype=torch.float32) * scale).to(dtype)


def positive(shape, dtype, device, gen) -> torch.Tensor:
    """Norm weights: uniform in [0.5, 1.5)."""
    return (torch.rand(tuple(shape), generator=gen, device=device, dtype=torch.float32) + 0.5).to(dtype)


def strided(rows, cols, dtype, device, gen, row_pad=0, offset=0, scale=1.0) -> torch.Tensor:
    """A [rows, cols] view with row stride cols + row_pad + offset, ``offset`` elements into its base
    (the base, random too, is ``view._base``: its other elements are canaries)."""
    base = randn((rows, cols + row_pad + offset), dtype, device, gen, scale)
    return base[:, offset:offset + cols]


def poisoned(rows, cols, dtype, device, gen) -> torch.Tensor:
    """Random garbage (x1000) with NaNs: any stray write into it shows up bitwise."""
    base = randn((rows, cols), dtype, device, gen, scale=1000.0)
    base[::7, ::3] = float("nan")
    return base


# ---- the error metric ------------------------------------------------------------------------------
def rel_err(got: torch.Tensor, want: torch.Tensor, normwise: bool = False) -> float:
    """Relative error of ``got`` against the truth ``want`` (float64): the largest
    ``|got - want| / max(|want|, smallest normal of got's dtype)`` over the elements (subnormal
    results are exact only to their spacing), or with ``normwise`` ``max |got - want| / max |want|``.
    NaN where the truth is finite, or a number where it is NaN, counts as infinite; elements where
    both are NaN agree."""
    if got.shape != want.shape:
        raise AssertionError(f"shape {tuple(got.shape)} != {tuple(want.shape)}")
    if want.numel() == 0:
        return 0.0
    g, w = got.double(), want.double()
    nan_g, nan_w = torch.isnan(g), torch.isnan(w)
    if not torch.equal(nan_g, nan_w):
        return float("inf")
    ok = ~nan_w
    if not ok.any():
        return 0.0
    err = (g - w).abs()[ok]
    if normwise:
        return (err.max() / w[ok].abs().max().clamp_min(1e-300)).item()
    # relative to the dtype's normal range: a subnormal result is only as exact as its spacing
    tiny = torch.finfo(got.dtype).tiny if got.dtype.is_floating_point else 1e-300
    return (err / w[ok].abs().clamp_min(tiny)).max().item()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN == NaN with the same payload)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))


# ---- the canary runner -----------------------------------------------------------------------------
def _base(t: torch.Tensor) -> torch.Tensor:
    return t._base if t._base is not None else t


def _covered(base: torch.Tensor, views: Sequence[torch.Tensor]) -> torch.Tensor:
    """Bool mask over ``base`` (contiguous): the elements any of ``views`` covers."""
    mask = torch.zeros(base.numel(), dtype=torch.bool, device=base.device)
    for v in views:
        mask.as_strided(v.shape, v.stride(), v.storage_offset() - base.storage_offset()).fill_(True)
    return mask.view(base.shape)


def run_canaried(fn: Callable[[], object], writes: Sequence[torch.Tensor], poison: Sequence[torch.Tensor] = ()):
    """Fills every tensor in ``poison`` with NaN, runs ``fn()``, and asserts that nothing outside
    ``writes`` changed in their base tensors (bitwise: the canaries). Returns ``fn()``'s result."""
    for t in poison:
        t.fill_(float("nan"))
    bases = []
    for t in writes:
        b = _base(t)
        if not any(b is seen for seen, _ in bases):
            assert b.is_contiguous(), "canary bases must be contiguous"
            bases.append((b, b.clone()))
    result = fn()
    if any(b.device.type == "cuda" for b, _ in bases):
        torch.cuda.synchronize()
    for b, before in bases:
        outside = ~_covered(b, [t for t in writes if _base(t) is b])
        assert same_bits(b[outside], before[outside]), "a write landed outside the outputs (a canary changed)"
    return result


def canaried_out(rows: int, cols: int, dtype, device, gen=None, top=1, bottom=1, right=8) -> torch.Tensor:
    """An [rows, cols] output view inside a poisoned base (canary rows above and below, canary
    columns to its right: row stride cols + right)."""
    gen = gen if gen is not None else generator(device, "canaried_out", rows, cols)
    base = poisoned(rows + top + bottom, cols + right, dtype, device, gen)
    return base[top:top + rows, :cols]


# ---- capture / fused_add_rmsnorm_capture problems ---------------------------------------------------
@dataclass
class CaptureProblem:
    """One capture (or, with ``weight``, fused add+RMSNorm+capture) problem from :func:`capture_problem`: hidden/input
    [T, H], residual, a [T + extra rows, K*H] buffer view into a poisoned base, the slot, norm weight and eps."""
    hidden: torch.Tensor  # the fused op's ``input``
    residual: Optional[torch.Tensor]
    buffer: torch.Tensor  # [T + extra rows, K*H] view of a poisoned base
    slot: int
    weight: Optional[torch.Tensor] = None  # fused only
    eps: float = EPS

    @property
    def T(self) -> int:
        """Tokens: hidden's rows."""
        return self.hidden.shape[0]

    @property
    def H(self) -> int:
        """Hidden size: hidden's columns (one slot's width)."""
        return self.hidden.shape[1]

    @property
    def slot_view(self) -> torch.Tensor:
        """What the op writes in the buffer."""
        return self.buffer[:self.T, self.slot * self.H:(self.slot + 1) * self.H]

    def sum64(self) -> torch.Tensor:
        """hidden + residual (or hidden) in float64: capture's truth, the fused op's new residual."""
        s = self.hidden.double()
        return s + self.residual.double() if self.residual is not None else s

    def normed64(self) -> torch.Tensor:
        """The fused op's output in float64 (norm of the unrounded sum, times the weight)."""
        s = self.sum64()
        return s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.double()

    def clone(self) -> "CaptureProblem":
        """A deep copy (same layouts, same bases) to run another implementation on."""
        bases = {}

        def cl(t):
            if t is None:
                return None
            b = _base(t)
            if id(b) not in bases:
                bases[id(b)] = b.clone()
            nb = bases[id(b)]
            return nb.as_strided(t.shape, t.stride(), t.storage_offset())

        return dataclasses.replace(self, hidden=cl(self.hidden), residual=cl(self.residual), buffer=cl(self.buffer))

    def writes(self) -> list:
        """The views the op writes: the slot (and, fused, hidden and residual): the canaried outputs."""
        return [self.slot_view] + ([self.hidden, self.residual] if self.weight is not None else [])


def capture_problem(T: int, H: int, K: int, dtype, device, *, key=(), slot: Optional[int] = None,
                    residual: bool = True, fused: bool = False, hidden_pad: int = 0,
                    residual_pad: Optional[int] = None, offset: int = 0, buffer_pad: int = 5,
                    buffer_offset: Optional[int] = None, extra_rows: int = 2, residual_scale: float = 1.0,
                    eps: float = EPS) -> CaptureProblem:
    """hidden/input [T, H] (row pad ``hidden_pad``, ``offset`` elements into its base), residual
    likewise (row pad ``residual_pad``, default ``hidden_pad``), and a [T + extra_rows, K*H] buffer
    view (``buffer_offset``, default ``offset``, columns into a poisoned base with ``buffer_pad``
    more columns). ``fused``: also the norm weight. ``slot`` defaults to the middle one."""
    device = torch.device(device)
    gen = generator(device, "capture", T, H, K, str(dtype), residual, fused, hidden_pad, offset, *key)
    slot = K // 2 if slot is None else slot
    residual_pad = hidden_pad if residual_pad is None else residual_pad
    buffer_offset = offset if buffer_offset is None else buffer_offset
    hidden = strided(T, H, dtype, device, gen, row_pad=hidden_pad, offset=offset)
    res = strided(T, H, dtype, device, gen, row_pad=residual_pad, offset=offset, scale=residual_scale) \
        if (residual or fused) else None
    base = poisoned(T + extra_rows, buffer_offset + K * H + buffer_pad, dtype, device, gen)
    buffer = base[:, buffer_offset:buffer_offset + K * H]
    weight = positive((H,), dtype, device, gen) if fused else None
    return CaptureProblem(hidden, res, buffer, slot, weight, eps)


# ---- draft_fc problems -------------------------------------------------------------------------------
@dataclass
class FcProblem:
    """One ``draft_fc`` problem from :func:`fc_problem`: the op's tensor arguments (x [T, K*H], weight [N, K*H],
    optional bias, rows, chunk and input norm weights) and eps."""
    x: torch.Tensor
    weight: torch.Tensor
    bias: Optional[torch.Tensor] = None
    rows: Optional[torch.Tensor] = None
    chunk_norm_weight: Optional[torch.Tensor] = None
    input_norm_weight: Optional[torch.Tensor] = None
    eps: float = EPS

    @property
    def M(self) -> int:
        """Output rows: ``rows``' length when given, else x's rows."""
        return self.x.shape[0] if self.rows is None else self.rows.shape[0]

    @property
    def N(self) -> int:
        """Output columns: weight's rows."""
        return self.weight.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        """x's dtype (the op's dtype)."""
        return self.x.dtype

    @property
    def args(self) -> tuple:
        """(x, weight, bias, rows, chunk_norm_weight, input_norm_weight): the op's leading arguments."""
        return self.x, self.weight, self.bias, self.rows, self.chunk_norm_weight, self.input_norm_weight

    def truth(self, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """float64 answer [M, N] (NaN rows for out-of-range indices); ``rows`` overrides the problem's."""
        r = self.rows if rows is None else rows
        return reference.draft_fc_ref(self.x, self.weight, self.bias, r, self.chunk_norm_weight,
                                      self.input_norm_weight, self.eps, acc_dtype=torch.float64)

    def out(self, gen=None) -> torch.Tensor:
        """A fresh canaried output view [M, N] (see :func:`canaried_out`)."""
        return canaried_out(self.M, self.N, self.dtype, self.x.device, gen)


@functools.lru_cache(maxsize=2)
def _cached_weight(N: int, KH: int, dtype, device_str: str) -> torch.Tensor:
    return randn((N, KH), dtype, device_str, generator(device_str, "weight", N, KH, str(dtype)),
                 scale=max(KH, 1) ** -0.5)


def fc_problem(M: int, H: int, K: int, dtype, device, *, key=(), N: Optional[int] = None, bias=False,
               rows=False, chunk=False, inorm=False, rows_dtype=torch.int64, extra_rows: int = 13,
               x_scale: float = 3.0) -> FcProblem:
    """x [R, K*H] (R = M, or M + extra_rows with a row gather), weight [N, K*H] (N defaults to H;
    entries ~ 1/sqrt(K*H) so outputs are O(x_scale)), and the optional bias [N], rows [M] (indices in
    [0, R), repeats allowed), chunk_norm_weight [K, H], input_norm_weight [K*H]. On a GPU the weight
    is cached per shape (hundreds of MB at model sizes); elsewhere everything is fresh."""
    device = torch.device(device)
    N = H if N is None else N
    gen = generator(device, "fc", M, H, K, N, str(dtype), bias, rows, chunk, inorm, str(rows_dtype), *key)
    R = M + extra_rows if rows else M
    x = randn((R, K * H), dtype, device, gen, scale=x_scale)
    if device.type == "cuda":
        w = _cached_weight(N, K * H, dtype, str(device))
    else:
        w = randn((N, K * H), dtype, device, gen, scale=max(K * H, 1) ** -0.5)
    b = randn((N,), dtype, device, gen) if bias else None
    r = torch.randint(0, max(R, 1), (M,), generator=gen, device=device).to(rows_dtype) if rows else None
    cn = positive((K, H), dtype, device, gen) if chunk else None
    inw = positive((K * H,), dtype, device, gen) if inorm else None
    return FcProblem(x, w, b, r, cn, inw)
