"""What the op tests (``tests/ops``) and the benchmarks (``benchmarks/``) share beyond the product's
own problem kit (``eagle3_ops/problems.py``: builders, float64 truths, tolerances, canaries, which
this module re-exports): the (backend, device) targets and their pytest parameters, the problems'
``run`` methods through the public face, the backends called directly, allocation counting and
graph replay. Test code only: nothing in ``eagle3_ops`` imports it. pytest is imported only by
:func:`params` (so the module imports without it).

* **Targets.** A :class:`Target` is a (backend, device) pair: ``reference`` and ``triton`` on the
  CPU (Triton under ``TRITON_INTERPRET=1``, the interpreter), and ``cuda``, ``triton`` and
  ``reference`` on a CUDA device. :func:`params` turns targets and their cases into pytest
  parameters; the CUDA ones carry the ``gpu`` mark (skipped without a GPU, run by
  ``benchmarks/device_check.sh``), and every test that has them has CPU targets on the same code.
* **Problems.** :func:`capture_problem` and :func:`fc_problem` are the product's
  (``problems.py``), returned as the subclasses here that can run themselves.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch

from eagle3_ops import problems
from eagle3_ops.problems import (DTYPES, EPS, MATMUL_TOL, NORM_TOL, ROUNDING_TOL, canaried_out, generator,  # noqa: F401
                                 poisoned, positive, randn, rel_err, run_canaried, same_bits, strided)

# draft_fc argument variants: the keyword flags of fc_problem.
VARIANTS = {
    "plain": dict(),
    "bias": dict(bias=True),
    "rows": dict(rows=True),
    "chunk_norm": dict(chunk=True),
    "input_norm": dict(inorm=True),
    "all": dict(bias=True, rows=True, chunk=True, inorm=True),
}


def assert_close(got: torch.Tensor, want: torch.Tensor, tol: float, normwise: bool = False, what: str = "output"):
    err = rel_err(got, want, normwise)
    kind = "max |err| / max |truth|" if normwise else "max elementwise relative error"
    assert err <= tol, f"{what}: {kind} {err:.3g} > {tol:.3g} (inf: NaN where the truth is finite, i.e. unwritten)"


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
        from eagle3_ops.triton import _interpreter_shim as shim
        from eagle3_ops.triton import capture as triton_capture

        if not shim.interpreted(triton_capture._capture_kernel):
            return ("Triton on CPU tensors needs the interpreter (TRITON_INTERPRET=1, set by tests/conftest.py "
                    "without a GPU)")
    if target.backend == "cuda" and target.device == "cuda":
        from eagle3_ops import cuda_backend

        archs = cuda_backend.compiled_archs()
        major, minor = torch.cuda.get_device_capability()
        if archs and not any(a.rstrip("a") == f"sm_{major}{minor}" for a in archs):
            return f"the CUDA extension is not built for sm_{major}{minor} (built: {','.join(archs)})"
    return None


# ---- problems that run themselves ------------------------------------------------------------------
@dataclass
class CaptureProblem(problems.CaptureProblem):
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
        run_canaried(lambda: self.run(fn), self.writes(), poison=[self.slot_view])


@dataclass
class FcProblem(problems.FcProblem):
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
        return dataclasses.replace(self, bias=spread(self.bias), rows=spread(self.rows), input_norm_weight=inw)


def _as(cls, p):
    return cls(**{f.name: getattr(p, f.name) for f in dataclasses.fields(p)})


def capture_problem(*args, **kwargs) -> CaptureProblem:
    """:func:`eagle3_ops.problems.capture_problem`, able to run itself."""
    return _as(CaptureProblem, problems.capture_problem(*args, **kwargs))


def fc_problem(*args, **kwargs) -> FcProblem:
    """:func:`eagle3_ops.problems.fc_problem`, able to run itself."""
    return _as(FcProblem, problems.fc_problem(*args, **kwargs))


# ---- backends directly ---------------------------------------------------------------------------------
def backend_function(backend: str, op: str) -> Callable:
    """The function of ``backend`` that implements ``op`` (the op's own name; ``draft_fc`` writes
    into ``out`` and takes a workspace) or ``<op>_workspace_bytes``."""
    from eagle3_ops import dispatch

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
    from eagle3_ops import workspace

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
