"""What the op tests (``tests/ops``) and the benchmarks (``benchmarks/``) share: one problem
builder per op, one canary runner, one error metric, and the (backend, device) targets.

Nothing here is used by the ops themselves; pytest is imported only by :func:`params` (so the
module imports without it).

* **Targets.** A :class:`Target` is a (backend, device) pair: ``reference`` and ``triton`` on the
  CPU (Triton under ``TRITON_INTERPRET=1``, the interpreter), and ``cuda``, ``triton`` and
  ``reference`` on a CUDA device. :func:`params` turns targets and their cases into pytest
  parameters; the CUDA ones carry the ``gpu`` mark (skipped without a GPU, run by
  ``benchmarks/device_check.sh``), and every test that has them has CPU targets on the same code.
* **Problems.** :func:`capture_problem` (also the fused op's, with ``fused=True``) and
  :func:`fc_problem` make fresh random data (never zeros) in the layouts the tests need: row-padded
  and offset views, poisoned buffers (random garbage times 1000 with NaNs) around every output.
  ``truth()`` is the float64 answer.
* **Canaries.** :func:`run_canaried` poisons the outputs with NaN, runs the op, and checks that
  every element of the outputs' base tensors outside the outputs is bitwise unchanged.
* **Error metric.** :func:`rel_err`: relative error against the float64 truth, elementwise
  (a value rounded once: within :data:`ROUNDING_TOL` / :data:`NORM_TOL`) or normwise (matrix
  products, where fp32 accumulation order differs between backends: :data:`MATMUL_TOL`). NaN where
  the truth is finite (an unwritten, poisoned element) is an infinite error.
"""
from __future__ import annotations

import functools
import zlib
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence

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
# draft_fc argument variants: the keyword flags of fc_problem.
VARIANTS = {
    "plain": dict(),
    "bias": dict(bias=True),
    "rows": dict(rows=True),
    "chunk_norm": dict(chunk=True),
    "input_norm": dict(inorm=True),
    "all": dict(bias=True, rows=True, chunk=True, inorm=True),
}
EPS = 1e-6


# ---- targets ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Target:
    """One (backend, device) pair an op test runs on."""

    backend: str
    device: str  # "cpu" or "cuda"

    @property
    def gpu(self) -> bool:
        return self.device == "cuda"

    @property
    def interpreted(self) -> bool:
        """Triton kernels run by the Triton interpreter (on CPU tensors)."""
        return self.backend == "triton" and self.device == "cpu"

    @property
    def id(self) -> str:
        return f"{self.backend}-{self.device}"

    def __str__(self) -> str:
        return self.id

    def torch_device(self) -> torch.device:
        if self.device == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


REFERENCE_CPU = Target("reference", "cpu")
TRITON_CPU = Target("triton", "cpu")
CUDA = Target("cuda", "cuda")
TRITON_CUDA = Target("triton", "cuda")
REFERENCE_CUDA = Target("reference", "cuda")
CPU_TARGETS = (REFERENCE_CPU, TRITON_CPU)
GPU_TARGETS = (CUDA, TRITON_CUDA, REFERENCE_CUDA)
TARGETS = CPU_TARGETS + GPU_TARGETS
TRITON_TARGETS = (TRITON_CPU, TRITON_CUDA)
# The draft_fc paths each backend can be forced onto (plans.forced_path); None = the table decides.
FC_PATHS = {"reference": (None,), "triton": ("skinny", "tiled", "cublas"), "cuda": ("skinny", "cublas")}


def _case_id(case) -> str:
    return "-".join(str(v).replace("torch.", "") if isinstance(v, torch.dtype) else str(v) for v in case)


def params(targets: Iterable[Target] = TARGETS, cases=None) -> list:
    """pytest parameters ``(target, *case)``, one per target and case. ``cases``: None (the
    parameters are the targets alone), a list of tuples, or a callable ``target -> list of tuples``
    (per-target shapes: the interpreter is slow, a GPU takes model-sized ones). GPU targets get the
    ``gpu`` mark."""
    import pytest

    out = []
    for target in targets:
        marks = (pytest.mark.gpu,) if target.gpu else ()
        if cases is None:
            out.append(pytest.param(target, marks=marks, id=target.id))
            continue
        for case in (cases(target) if callable(cases) else cases):
            case = tuple(case) if isinstance(case, (tuple, list)) else (case,)
            out.append(pytest.param(target, *case, marks=marks, id=f"{target.id}-{_case_id(case)}"))
    return out


def unusable_reason(target: Target) -> Optional[str]:
    """Why ``target`` cannot run in this process (a reason to skip), or None. Only what a
    machine legitimately lacks: the interpreter where a GPU compiles Triton instead, an extension
    built for other GPU archs. A forced backend that should serve and cannot is a failure of the
    test, not a skip."""
    if target.device == "cuda" and not torch.cuda.is_available():
        return "needs a CUDA device"
    if target.interpreted:
        from .triton import _interpreter_shim as shim
        from .triton import capture as triton_capture

        if not shim.interpreted(triton_capture._capture_kernel):
            return "Triton on CPU tensors needs the interpreter (TRITON_INTERPRET=1, set by tests/conftest.py without a GPU)"
    if target.backend == "cuda" and target.device == "cuda":
        from . import cuda_backend

        archs = cuda_backend.compiled_archs()
        major, minor = torch.cuda.get_device_capability()
        if archs and not any(a.rstrip("a") == f"sm_{major}{minor}" for a in archs):
            return f"the CUDA extension is not built for sm_{major}{minor} (built: {','.join(archs)})"
    return None


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


def assert_close(got: torch.Tensor, want: torch.Tensor, tol: float, normwise: bool = False, what: str = "output"):
    err = rel_err(got, want, normwise)
    kind = "max |err| / max |truth|" if normwise else "max elementwise relative error"
    assert err <= tol, f"{what}: {kind} {err:.3g} > {tol:.3g} (inf: NaN where the truth is finite, i.e. unwritten)"


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
    hidden: torch.Tensor  # the fused op's ``input``
    residual: Optional[torch.Tensor]
    buffer: torch.Tensor  # [T + extra rows, K*H] view of a poisoned base
    slot: int
    weight: Optional[torch.Tensor] = None  # fused only
    eps: float = EPS

    @property
    def T(self) -> int:
        return self.hidden.shape[0]

    @property
    def H(self) -> int:
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

        return CaptureProblem(cl(self.hidden), cl(self.residual), cl(self.buffer), self.slot, self.weight, self.eps)

    def run(self, fn=None) -> None:
        """Runs the op (the public face by default, or ``fn`` with the op's arguments)."""
        import eagle3_ops

        if self.weight is None:
            (fn or eagle3_ops.capture)(self.hidden, self.residual, self.buffer, self.slot)
        else:
            (fn or eagle3_ops.fused_add_rmsnorm_capture)(self.hidden, self.residual, self.weight, self.eps,
                                                        self.buffer, self.slot)

    def run_canaried(self, fn=None) -> None:
        """:meth:`run` with canaries around every write (slot poisoned first; the fused op also
        writes hidden and residual, whose padding columns are canaries)."""
        writes = [self.slot_view] + ([self.hidden, self.residual] if self.weight is not None else [])
        run_canaried(lambda: self.run(fn), writes, poison=[self.slot_view])


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
    x: torch.Tensor
    weight: torch.Tensor
    bias: Optional[torch.Tensor] = None
    rows: Optional[torch.Tensor] = None
    chunk_norm_weight: Optional[torch.Tensor] = None
    input_norm_weight: Optional[torch.Tensor] = None
    eps: float = EPS

    @property
    def M(self) -> int:
        return self.x.shape[0] if self.rows is None else self.rows.shape[0]

    @property
    def N(self) -> int:
        return self.weight.shape[0]

    @property
    def dtype(self) -> torch.dtype:
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

    def run_out(self, out: torch.Tensor, backend: Optional[str] = None, **kw) -> torch.Tensor:
        """``draft_fc_out`` into ``out`` with canaries (out poisoned first); returns out. With
        ``backend``: that backend's function directly (:func:`run_backend_draft_fc`)."""
        import eagle3_ops

        if backend is None:
            fn = lambda: eagle3_ops.draft_fc_out(*self.args, self.eps, out, **kw)  # noqa: E731
        else:
            fn = lambda: run_backend_draft_fc(backend, self, out)  # noqa: E731
        run_canaried(fn, [out], poison=[out])
        return out

    def strided_1d(self, input_norm_weight: bool = False) -> "FcProblem":
        """The same problem with bias and rows (and with ``input_norm_weight``, that one too: only
        the backends called directly see it, validation refuses it) as stride-2 views (validation
        accepts any stride for bias and rows; the kernels must not assume stride 1)."""
        def spread(t):
            if t is None:
                return None
            wide = torch.stack([t, t.flip(0)], dim=1).reshape(-1)
            return wide[::2]
        inw = spread(self.input_norm_weight) if input_norm_weight else self.input_norm_weight
        return FcProblem(self.x, self.weight, spread(self.bias), spread(self.rows), self.chunk_norm_weight, inw,
                         self.eps)


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


# ---- backends directly ---------------------------------------------------------------------------------
def backend_function(backend: str, op: str) -> Callable:
    """The function of ``backend`` that implements ``op`` (the op's own name; ``draft_fc`` writes
    into ``out`` and takes a workspace) or ``<op>_workspace_bytes``."""
    from . import dispatch

    return dispatch.function(backend, op)


def run_backend_draft_fc(backend: str, p: FcProblem, out: torch.Tensor) -> None:
    """``backend``'s draft_fc on ``p`` into ``out``, bypassing the face (no validation: e.g. host
    row indices out of range reach the kernels), with a workspace of exactly the size the backend
    asks for (the kernels' Carver raises if they need more)."""
    need = int(backend_function(backend, "draft_fc_workspace_bytes")(*p.args))
    ws = torch.empty(need, dtype=torch.uint8, device=p.x.device) if need else None
    backend_function(backend, "draft_fc")(*p.args, p.eps, out, ws)


# ---- allocation counting and graph replay -------------------------------------------------------------
def allocation_count(device: torch.device) -> int:
    """Allocations so far: the CUDA caching allocator's count on a GPU (cache hits included); on the
    CPU, where torch does not count, the face's scratch allocations (``workspace.allocations``)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.memory_stats(device).get("allocation.all.allocated", 0)
    from . import workspace

    return workspace.allocations


class Replay:
    """``fn`` recorded once and replayed: a CUDA graph on a GPU (after an eager warm-up on a side
    stream, as torch's graph docs do; captured on ``stream`` if given), on the CPU a plain call (the
    CPU twin of a graph test checks the same sequence of calls and results)."""

    def __init__(self, fn: Callable[[], object], device: torch.device, stream=None, warmup: bool = True):
        self.fn = fn
        self.device = torch.device(device)
        self.graph = None
        self.allocations_during_capture = 0
        if self.device.type != "cuda":
            return
        if warmup:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn()
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=stream):
            before = torch.cuda.memory_stats().get("allocation.all.allocated", 0)
            fn()
            self.allocations_during_capture = torch.cuda.memory_stats().get("allocation.all.allocated", 0) - before

    def replay(self) -> None:
        if self.graph is None:
            self.fn()
        else:
            self.graph.replay()
            torch.cuda.synchronize()


__all__ = ["CPU_TARGETS", "CaptureProblem", "DTYPES", "EPS", "FC_PATHS", "FcProblem", "GPU_TARGETS", "MATMUL_TOL",
           "NORM_TOL", "ROUNDING_TOL", "Replay", "TARGETS", "TRITON_TARGETS", "Target", "VARIANTS",
           "allocation_count", "assert_close", "backend_function", "canaried_out", "capture_problem",
           "fc_problem", "generator", "params", "poisoned", "positive", "randn", "rel_err", "run_backend_draft_fc",
           "run_canaried", "same_bits", "strided", "unusable_reason"]
