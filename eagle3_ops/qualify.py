"""Qualification: every candidate path of an op, at the model's own shapes, checked against the
float64 reference and timed against stock on THIS device; the fastest correct candidate serves each
row bucket, and a bucket where no candidate beats stock by :data:`MARGIN` stays stock.

It replaces "verify one small problem, then trust" for the sites the SGLang plugin patches, and is
what ``python -m eagle3_ops qualify`` prints. Candidates:

* ``draft_fc``: every (backend, path) that can serve the device — ``cuda``/``skinny``,
  ``cuda``/``cublas``, ``triton``/``skinny``|``tiled``|``cublas``, ``reference`` (CPU only) — and,
  when the site has pre-fc norms, each of them again on the folded weight
  (``fold_norm_weights``, ``norm_folded=True``: the plain hot loop; ``Choice.folded``), against
  stock = what SGLang's llama_eagle3 runs: its RMSNorms (rounded to the dtype) and ``F.linear``
  (cuBLAS).
* ``fused_add_rmsnorm_capture``: each backend against stock = the site's own norm module's forward
  (SGLang's kernel on this device; the plugin passes it), or, without a site (the CLI),
  ``sgl_kernel``'s ``fused_add_rmsnorm`` where importable, else torch eager in SGLang's native order;
  plus a slot copy. The row says which.

Correctness: the output is NaN-poisoned first; a candidate whose max relative error (normwise for
the matrix product, elementwise for the norm) exceeds the dtype's tolerance, or that raises, is
rejected with that reason and never chosen. The target norm replaces one of SGLang's kernels in the
target's forward, whose tokens are not ours to change: its three outputs (the normed input the
attention reads, the new residual, the capture) must be BITWISE stock's on this device, or it is
rejected. Timing: median of CUDA events over repetitions with the L2 flushed by reading a buffer of twice its size
before each (cold weights, as in serving); on the CPU ``perf_counter`` (a CPU time says nothing about a GPU; there the
mechanism is what is tested).

Results are cached per (device name, driver/torch versions, eagle3_ops version, op, shapes, buckets,
margin, rules version) in ``$XDG_CACHE_HOME/eagle3_ops/qualify.json`` (default ``~/.cache``), each
entry validated before use (qualify_cache.py; :func:`_plan_from_cache`): a broken or foreign entry
is one warning line and a new qualification, never a crash or another shape's plan.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import logging
import math
import time
import typing
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from . import bound, dispatch, plans, problems, qualify_cache
from .timing import Timer

log = logging.getLogger("eagle3_ops")

MARGIN = 1.05          # a candidate must be at least 5% faster than stock to replace it
# Part of the cache key: bump whenever the candidates or the acceptance rules change, so that plans
# cached by an older version are measured again instead of bypassing the new rules.
# 2: folded candidates; the target norm bitwise against stock.
# 3: the target norm bitwise in all three outputs, against the site's own norm module.
# 4: the CUDA skinny kernels v2 (cp.async ring, norm pre-pass, new split planner): plans measured on
#    the v1 kernels must not stand for them.
# 5: candidates timed as the plugin runs them (bound calls planned once, eagle3_ops.bound), not through the
#    public face: plans timed with the face's host path must not stand for them.
RULES_VERSION = 5
DEFAULT_BUCKETS = (1, 4, 16, 64, 128, 512, 2048)   # decode / verify / prefill row counts
TOL = {"draft_fc": problems.MATMUL_TOL, "fused_add_rmsnorm_capture": problems.NORM_TOL}


@dataclass(frozen=True)
class Shape:
    """What a site computes: ``draft_fc`` [M, K*H] x [N, K*H] (with its options), or the target's
    ``fused_add_rmsnorm_capture`` at hidden size H into K slots."""
    op: str
    hidden: int
    captures: int
    out_features: int = 0          # draft_fc N (this rank's rows when the fc is sharded)
    dtype: str = "bfloat16"
    bias: bool = False
    chunk_norm: bool = False
    input_norm: bool = False

    @property
    def torch_dtype(self) -> torch.dtype:
        """``dtype`` (a name such as ``bfloat16``) as a torch dtype."""
        return getattr(torch, self.dtype)


@dataclass
class Choice:
    """What serves one (op, row bucket): the fastest candidate that passed (backend, path, folded, its error and median
    time) or stock (``backend`` None), with the stock time it was compared against."""
    op: str
    rows: int
    backend: Optional[str]         # None: stock
    path: Optional[str]
    max_rel_err: Optional[float]
    median_us: Optional[float]
    stock_us: float
    stock: str                     # what the stock timing ran
    folded: bool = False           # draft_fc on the folded weight (norm_folded=True)


@dataclass
class Rejection:
    """One candidate (op, rows, backend, path, folded) that qualification refused, and why."""
    op: str
    rows: int
    backend: str
    path: Optional[str]
    reason: str
    folded: bool = False


@dataclass
class Plan:
    """The qualification of one :class:`Shape` on one device: a :class:`Choice` per row bucket, the rejected candidates,
    how long it took and whether it came from the cache."""
    device: str
    shape: Shape
    choices: List[Choice] = field(default_factory=list)
    rejected: List[Rejection] = field(default_factory=list)
    seconds: float = 0.0
    cached: bool = False

    def choice_for(self, rows: int) -> Choice:
        """The choice of the smallest bucket holding ``rows`` (the largest bucket above it)."""
        for c in self.choices:
            if rows <= c.rows:
                return c
        return self.choices[-1]

    def to_json(self) -> dict:
        """The plan as a JSON-able dict (shape, choices and rejections as dicts; seconds rounded to ms)."""
        return {"device": self.device, "shape": asdict(self.shape), "seconds": round(self.seconds, 3),
                "cached": self.cached, "choices": [asdict(c) for c in self.choices],
                "rejected": [asdict(r) for r in self.rejected]}

    def table(self) -> str:
        """The plan as text for a person: a header line, one row per bucket (what serves, max rel err, us, stock us,
        what stock ran), then one line per rejection."""
        lines = [f"qualification on {self.device}: {self.shape.op} H={self.shape.hidden} K={self.shape.captures}"
                 + (f" N={self.shape.out_features}" if self.shape.out_features else "")
                 + f" {self.shape.dtype} ({'cached' if self.cached else f'{self.seconds:.1f} s'})",
                 f"{'rows':>6} | {'serves':<16} | {'max rel err':>11} | {'us':>9} | {'stock us':>9} | stock ran"]
        for c in self.choices:
            serves = "stock" if c.backend is None else f"{c.backend}/{c.path or '-'}" + ("+folded" if c.folded else "")
            err = "-" if c.max_rel_err is None else f"{c.max_rel_err:.2e}"
            us = "-" if c.median_us is None else f"{c.median_us:.1f}"
            lines.append(f"{c.rows:>6} | {serves:<16} | {err:>11} | {us:>9} | {c.stock_us:>9.1f} | {c.stock}")
        for r in self.rejected:
            lines.append(f"rejected: {r.op} rows={r.rows} {r.backend}/{r.path or '-'}{'+folded' if r.folded else ''}: "
                         f"{r.reason}")
        return "\n".join(lines)


# ---- candidates ---------------------------------------------------------------------------------------
def candidates(op: str, device: torch.device) -> List[Tuple[str, Optional[str]]]:
    """(backend, path) pairs that can serve ``op`` on ``device`` (only the forced one under
    EAGLE3_OPS_BACKEND: forcing a backend means that backend or stock, never another)."""
    out = []
    forced = dispatch.forced_backend()
    for backend in dispatch.BACKENDS:
        if forced is not None and backend != forced:
            continue
        if backend == "reference" and device.type == "cuda":
            continue  # plain PyTorch on a GPU is never faster than stock's own kernels
        if dispatch.implementation(backend, op, device) is None:
            continue
        if op == "draft_fc" and backend != "reference":
            paths = ("skinny", "cublas") if backend == "cuda" else plans.PATHS
            out.extend((backend, p) for p in paths)
        else:
            out.append((backend, None))
    return out


# ---- problems and stock ---------------------------------------------------------------------------------
def _fc_problem(shape: Shape, rows: int, device, tensors: Optional[dict] = None) -> problems.FcProblem:
    if tensors is not None:  # the site's own weights (no second copy of a model-size weight), random x
        w = tensors["weight"]
        gen = problems.generator(torch.device(device), "qualify-x", rows, w.shape[1])
        x = problems.randn((rows, w.shape[1]), w.dtype, device, gen, scale=3.0)
        return problems.FcProblem(x, w, tensors.get("bias"), None, tensors.get("chunk_norm_weight"),
                                 tensors.get("input_norm_weight"), tensors.get("eps", problems.EPS))
    return problems.fc_problem(rows, shape.hidden, shape.captures, shape.torch_dtype, device, key=("qualify",),
                              N=shape.out_features or shape.hidden, bias=shape.bias, chunk=shape.chunk_norm,
                              inorm=shape.input_norm)


def _fc_stock(p: problems.FcProblem) -> Tuple[Callable[[], torch.Tensor], str]:
    """SGLang llama_eagle3's fc block as it runs stock: RMSNorm(s) rounded to the dtype, F.linear."""
    import torch.nn.functional as F

    from .reference import rms_scale

    def run():
        x = p.x
        if p.input_norm_weight is not None:
            xf = x.float()
            x = (xf * rms_scale(xf, p.eps) * p.input_norm_weight.float()).to(x.dtype)
        if p.chunk_norm_weight is not None:
            K, H = p.chunk_norm_weight.shape
            xf = x.float().view(x.shape[0], K, H)
            x = (xf * rms_scale(xf, p.eps) * p.chunk_norm_weight.float()).to(x.dtype).view(x.shape[0], K * H)
        return F.linear(x, p.weight, p.bias)

    return run, "torch eager norms + F.linear (cuBLAS on a GPU)"


def _fused_stock(p: problems.CaptureProblem, slot_view: torch.Tensor, stock_norm=None):
    """What SGLang runs at a captured layer: its add+RMSNorm, then the capture as a slot copy.

    ``stock_norm``: the site's own norm module (the plugin passes one): its stock ``forward(x, residual)``
    is the truth the fused op must match bit for bit (SGLang's kernel on this device: sgl_kernel /
    FlashInfer on CUDA, its native path on the CPU). Without one (the CLI): ``sgl_kernel``'s
    ``fused_add_rmsnorm`` where importable, else torch eager in SGLang's native order."""
    if stock_norm is not None:
        forward = getattr(stock_norm.forward, "__wrapped__", stock_norm.forward)  # never the plugin's wrapper

        def run():
            x, r = forward(p.hidden, p.residual)
            if x is not p.hidden:  # out-of-place paths (the native one) return new tensors
                p.hidden.copy_(x)
            if r is not p.residual:
                p.residual.copy_(r)
            slot_view.copy_(p.residual)
        return run, f"the site's {type(stock_norm).__name__}.forward (SGLang's norm on this device) + slot copy"
    if p.hidden.device.type == "cuda":
        try:
            from sgl_kernel import fused_add_rmsnorm  # the kernel SGLang runs on CUDA

            def run():
                fused_add_rmsnorm(p.hidden, p.residual, p.weight, p.eps)
                slot_view.copy_(p.residual)
            return run, "sgl_kernel fused_add_rmsnorm + slot copy"
        except ImportError:
            pass
    from .reference import rms_scale

    def run():
        s = p.hidden.float() + p.residual.float()
        p.residual.copy_(s.to(p.residual.dtype))
        p.hidden.copy_((s * rms_scale(s, p.eps) * p.weight.float()).to(p.hidden.dtype))
        slot_view.copy_(p.residual)
    return run, "torch eager add + RMSNorm + slot copy (no sgl_kernel here)"


# ---- one op at one bucket ------------------------------------------------------------------------------
def _qualify_fc(shape: Shape, rows: int, device, timer: Timer, plan: Plan, margin: float, run_candidate=None,
                tensors=None, folded_weight: Optional[torch.Tensor] = None) -> None:
    """A site with pre-fc norms: every candidate also runs on the folded weight, as
    ``norm_folded=True`` (``folded_weight``: the site's, prepared once; without ``tensors`` each
    bucket's random problem is folded here). Truth is the unfolded float64 answer for both."""
    p = _fc_problem(shape, rows, device, tensors)
    if tensors is None:
        folded_weight = _fold(p.weight, p.chunk_norm_weight, p.input_norm_weight)
    truth = p.truth()
    stock_fn, stock_label = _fc_stock(p)
    stock_us = timer(stock_fn)
    best = None
    forms = [False] + ([True] if folded_weight is not None else [])
    for folded in forms:
        args = (p.x, folded_weight, *p.args[2:]) if folded else p.args
        for backend, path in candidates("draft_fc", device):
            out = torch.full((p.M, p.N), float("nan"), dtype=p.dtype, device=device)
            try:
                # the call the plugin would make: bound (backend verified, path fixed), planned once
                run = _bound_fc(backend, path, device, args, folded)

                # its defaults name the candidate (backend, path, ..., folded): what a test's timer reads
                def call(backend=backend, path=path, run=run, out=out, args=args, folded=folded):
                    if run_candidate is None:
                        run(*args, p.eps, out, norm_folded=folded)
                    else:
                        run_candidate(backend, run, *args, p.eps, out, norm_folded=folded)
                call()
                err = problems.rel_err(out, truth, normwise=True)
            except Exception as e:  # a crashing candidate is rejected, never chosen
                plan.rejected.append(Rejection("draft_fc", rows, backend, path, f"{type(e).__name__}: {e}", folded))
                continue
            tol = _tolerance(shape)
            if not err <= tol:
                plan.rejected.append(Rejection("draft_fc", rows, backend, path,
                                               f"max rel err {err:.3g} > tolerance {tol:.1g}", folded))
                continue
            us = timer(call)
            if best is None or us < best[2]:
                best = (backend, path, us, err, folded)
    _record(plan, "draft_fc", rows, best, stock_us, stock_label, margin)


def _bound_fc(backend: str, path: Optional[str], device, args, folded: bool) -> Callable:
    """``run(x, weight, bias, rows, chunk_norm_weight, input_norm_weight, eps, out, norm_folded)``: draft_fc
    bound to ``backend`` and ``path`` (eagle3_ops.bound), planned once for these arguments, with its own
    workspace: per call only the launch runs, as in the plugin's forwards."""
    fc = bound.DraftFc(backend, path, torch.device(device), args[0].dtype)
    planned = fc.plan(*args, folded)
    workspace = torch.empty(planned.nbytes, dtype=torch.uint8, device=device) if planned.nbytes else None

    def run(x, weight, bias, rows, chunk_norm_weight, input_norm_weight, eps, out, norm_folded=False):
        fc(planned, x, weight, bias, rows, chunk_norm_weight, input_norm_weight, eps, out, workspace, norm_folded)

    return run


def _fused_error(q: problems.CaptureProblem, normed64: torch.Tensor, sum64: torch.Tensor) -> float:
    """Max elementwise relative error of the fused op's three outputs (normed input, new residual,
    captured slot) against the float64 truth."""
    return max(problems.rel_err(q.hidden, normed64), problems.rel_err(q.residual, sum64),
               problems.rel_err(q.slot_view, sum64))


def _qualify_fused(shape: Shape, rows: int, device, timer: Timer, plan: Plan, margin: float,
                   run_candidate=None, stock_norm=None) -> None:
    """The target's add+RMSNorm at a captured layer. The fused op replaces one of SGLang's kernels in
    the target's forward, so a candidate must reproduce stock BIT FOR BIT in all three outputs (the
    normed input the attention reads, the new residual the next layer reads, the capture the draft
    reads): the target's tokens are not ours to change. Also within tolerance of float64 (a stock
    that is itself wrong must not make a wrong candidate pass). ``stock_norm``: the site's own norm
    module, whose weight and eps the problem uses."""
    base = problems.capture_problem(rows, shape.hidden, shape.captures, shape.torch_dtype, device, key=("qualify",),
                                   slot=0, fused=True)
    if stock_norm is not None:
        base.weight = stock_norm.weight.detach()
        base.eps = float(stock_norm.variance_epsilon)
    normed64, sum64 = base.normed64(), base.sum64()
    # what stock computes on this device, once, untimed
    want = base.clone()
    _fused_stock(want, want.slot_view, stock_norm)[0]()
    s = base.clone()
    stock_fn, stock_label = _fused_stock(s, s.slot_view, stock_norm)
    stock_us = timer(stock_fn)
    best = None
    tol = _tolerance(shape)
    for backend, _ in candidates("fused_add_rmsnorm_capture", device):
        q = base.clone()
        q.slot_view.fill_(float("nan"))

        def launch(fn, backend, t):
            args = (t.hidden, t.residual, t.weight, t.eps, t.buffer, t.slot)
            fn(*args) if run_candidate is None else run_candidate(backend, fn, *args)

        try:
            fn = bound.fused_add_rmsnorm_capture(backend, torch.device(device), base.hidden.dtype)
            launch(fn, backend, q)
            err = _fused_error(q, normed64, sum64)
        except Exception as e:
            plan.rejected.append(Rejection("fused_add_rmsnorm_capture", rows, backend, None,
                                           f"{type(e).__name__}: {e}"))
            continue
        if not err <= tol:
            plan.rejected.append(Rejection("fused_add_rmsnorm_capture", rows, backend, None,
                                           f"max rel err {err:.3g} > tolerance {tol:.1g}"))
            continue
        differs = [name for name, got, ref in (("normed output", q.hidden, want.hidden),
                                               ("residual", q.residual, want.residual),
                                               ("capture", q.slot_view, want.slot_view))
                   if not problems.same_bits(got, ref)]
        if differs:
            plan.rejected.append(Rejection("fused_add_rmsnorm_capture", rows, backend, None,
                                           f"{', '.join(differs)} not bitwise equal to stock ({stock_label})"))
            continue
        t = base.clone()  # timing mutates input/residual in place: time on a copy

        def timed(fn=fn, backend=backend, t=t):
            launch(fn, backend, t)
        us = timer(timed)
        if best is None or us < best[2]:
            best = (backend, None, us, err)
    _record(plan, "fused_add_rmsnorm_capture", rows, best, stock_us, stock_label, margin)


def _record(plan: Plan, op: str, rows: int, best, stock_us: float, stock_label: str, margin: float) -> None:
    if best is not None and best[2] * margin < stock_us:
        folded = bool(best[4]) if len(best) > 4 else False
        plan.choices.append(Choice(op, rows, best[0], best[1], best[3], best[2], stock_us, stock_label, folded))
    else:
        err, us = (best[3], best[2]) if best is not None else (None, None)
        plan.choices.append(Choice(op, rows, None, None, err, us, stock_us, stock_label))


# ---- the cache (qualify_cache.py: validated reads, locked atomic writes) -------------------------------
def cache_path() -> Path:
    """Where qualification plans are cached (:func:`eagle3_ops.qualify_cache.path`)."""
    return qualify_cache.path()


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


@functools.lru_cache(maxsize=None)
def _kernels_fingerprint() -> str:
    """A digest of the built CUDA extension ("none" without one): a plan qualified with other kernels
    (a rebuild, same version number) is not reused."""
    from . import cuda_backend

    ext = cuda_backend.cuda_extension()
    path = getattr(ext, "__file__", None)
    if not path:
        return "none"
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:16]


def _device_key(device: torch.device) -> str:
    from . import __version__

    driver = torch.version.cuda or "none"
    return (f"{_device_name(device)}|cuda {driver}|torch {torch.__version__}|eagle3_ops {__version__}|"
            f"kernels {_kernels_fingerprint()}|{dispatch.backends(device)}")


def _plan_made_for(device, shape: Shape, buckets: Sequence[int], margin: float, stock: Optional[str] = None) -> dict:
    """Everything a plan depends on; a cached plan is used only where all of it is the same.
    ``stock``: the site's own norm module (class, eps), the stock a fused-norm plan was matched to."""
    return {"what": "qualify.plan", "device": _device_key(device), "shape": asdict(shape),
            "buckets": [int(b) for b in buckets], "margin": margin, "rules_version": RULES_VERSION,
            "stock": stock}


def entry_made_for(what: str, device, parts: dict) -> dict:
    """The ``made_for`` of another kind of decision kept with the plans (the plugin's draft fc
    sharding), for qualify_cache.load / store: the device key, the parts that decide it, the rules
    version."""
    return {"what": what, "device": _device_key(torch.device(device)), "parts": parts, "rules_version": RULES_VERSION}


def _tolerance(shape: Shape) -> float:
    """The max relative error a candidate may have at ``shape`` (normwise for the fc; two ulps
    elementwise for the target norm: a correct kernel is within one, a broken one far off)."""
    dt = shape.torch_dtype
    if shape.op == "draft_fc":
        return TOL["draft_fc"][dt]
    return 2 * max(problems.NORM_TOL[dt], problems.ROUNDING_TOL[dt])


def _matches(value, hint) -> bool:
    """Whether a JSON value has the dataclass field type ``hint`` (float: a finite number; int: not
    a bool; Optional[X]: X or null). Unknown types fail closed."""
    if typing.get_origin(hint) is typing.Union:
        args = typing.get_args(hint)
        return (value is None and type(None) in args) or any(_matches(value, a) for a in args if a is not type(None))
    if hint is bool or hint is str:
        return isinstance(value, hint)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return False


def _typed(obj, cls, where: str):
    """``cls(**obj)`` for a JSON object that has exactly the dataclass's fields, each of its
    declared type (the schema is the dataclass: a field added later is checked too)."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    if not isinstance(obj, dict) or set(obj) != names:
        got = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
        raise qualify_cache.BadEntry(f"{where}: expected an object with the fields {sorted(names)}, got {got}")
    for name in sorted(names):
        if not _matches(obj[name], hints[name]):
            raise qualify_cache.BadEntry(f"{where}.{name} = {str(obj[name])[:40]!r} is not of type {hints[name]}")
    return cls(**obj)


def _plan_from_cache(value, device: torch.device, shape: Shape, buckets: Sequence[int], margin: float) -> Plan:
    """A cached plan for ``shape`` at ``buckets`` on ``device``, checked field by field and against
    the rules a plan made by :func:`qualify` obeys; raises qualify_cache.BadEntry."""
    bad = qualify_cache.BadEntry
    keys = {"device", "shape", "seconds", "cached", "choices", "rejected"}
    if not isinstance(value, dict) or set(value) != keys:
        raise bad(f"not a plan (expected the fields {sorted(keys)})")
    if value["device"] != _device_name(device):
        raise bad(f"a plan for device {str(value['device'])[:60]!r}, not {_device_name(device)!r}")
    if value["shape"] != asdict(shape):
        raise bad(f"a plan for the shape {str(value['shape'])[:200]}, not {asdict(shape)}")
    if not _matches(value["seconds"], float) or value["seconds"] < 0 or not isinstance(value["cached"], bool):
        raise bad("seconds / cached are not a duration and a flag")
    if not isinstance(value["choices"], list) or not isinstance(value["rejected"], list):
        raise bad("choices / rejected are not lists")
    choices = [_typed(c, Choice, f"choices[{i}]") for i, c in enumerate(value["choices"])]
    if [c.rows for c in choices] != list(buckets):
        raise bad(f"choices for the rows {[c.rows for c in choices][:20]}, not the buckets {list(buckets)}")
    serving = set(candidates(shape.op, device))
    tol = _tolerance(shape)
    for i, c in enumerate(choices):
        where = f"choices[{i}] (rows {c.rows})"
        if c.op != shape.op:
            raise bad(f"{where} is for {c.op!r}, not {shape.op!r}")
        if min(x for x in (c.stock_us, c.median_us, c.max_rel_err, 0.0) if x is not None) < 0:
            raise bad(f"{where} has a negative time or error")
        if c.backend is None:
            if c.path is not None or c.folded:
                raise bad(f"{where} is stock with a path or the folded form")
            continue
        if (c.backend, c.path) not in serving:
            raise bad(f"{where}: {c.backend}/{c.path} cannot serve {shape.op} on {device}")
        if c.max_rel_err is None or not c.max_rel_err <= tol:
            raise bad(f"{where}: error {c.max_rel_err} is not within the tolerance {tol:.1g}")
        if c.median_us is None or not c.median_us * margin < c.stock_us:
            raise bad(f"{where} is served but not {margin}x faster than stock")
        if c.folded and not (shape.op == "draft_fc" and (shape.chunk_norm or shape.input_norm)):
            raise bad(f"{where} is folded at a shape without pre-fc norms")
    rejected = [_typed(r, Rejection, f"rejected[{i}]") for i, r in enumerate(value["rejected"])]
    for i, r in enumerate(rejected):
        if r.op != shape.op or r.rows not in buckets or r.backend not in dispatch.BACKENDS:
            raise bad(f"rejected[{i}] is not a rejection of {shape.op} at one of the buckets")
    return Plan(value["device"], shape, choices, rejected, float(value["seconds"]), cached=True)


def _load_plan(device, shape: Shape, buckets: Sequence[int], margin: float,
               stock: Optional[str] = None) -> Optional[Plan]:
    """The cached plan, validated, or None (nothing cached, or an entry not to be used: one line)."""
    return qualify_cache.load(_plan_made_for(device, shape, buckets, margin, stock),
                              lambda value: _plan_from_cache(value, device, shape, buckets, margin))


def _store_plan(device, shape: Shape, buckets: Sequence[int], margin: float, plan: Plan,
                stock: Optional[str] = None) -> bool:
    return qualify_cache.store(_plan_made_for(device, shape, buckets, margin, stock), plan.to_json())


# ---- entry point ----------------------------------------------------------------------------------------
def qualify(shape: Shape, device=None, buckets: Sequence[int] = DEFAULT_BUCKETS, *, reps: int = 10,
            margin: float = MARGIN, use_cache: bool = True, timer: Optional[Timer] = None,
            run_candidate: Optional[Callable] = None, tensors: Optional[dict] = None,
            stock_norm=None) -> Plan:
    """The plan for ``shape`` on ``device`` (default: the current CUDA device, else the CPU).
    ``tensors``: the site's own draft_fc weights (weight, bias, chunk_norm_weight,
    input_norm_weight, eps) instead of random ones. ``stock_norm``: for the fused norm, the site's
    own norm module, the stock every candidate must match bitwise. ``timer`` / ``run_candidate``
    replace the timing and the candidate's call (tests: ``run_candidate(backend, run, *args, **kw)`` is called
    instead of ``run(*args, **kw)``, ``run`` being the bound call the plugin would make)."""
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    buckets = sorted(set(int(b) for b in buckets))
    stock = None if stock_norm is None else \
        f"{type(stock_norm).__module__}.{type(stock_norm).__qualname__} eps={float(stock_norm.variance_epsilon)!r}"
    measured = timer is None and run_candidate is None  # real timings of the real ops: cacheable
    if use_cache and measured:
        cached = _load_plan(device, shape, buckets, margin, stock)
        if cached is not None:
            return cached
    plan = Plan(_device_name(device), shape)
    timer = timer or Timer(device, reps)
    t0 = time.perf_counter()
    with torch.no_grad():
        folded_weight = (_fold(tensors["weight"], tensors.get("chunk_norm_weight"), tensors.get("input_norm_weight"))
                         if tensors is not None else None)
        for rows in buckets:
            if shape.op == "draft_fc":
                _qualify_fc(shape, rows, device, timer, plan, margin, run_candidate, tensors, folded_weight)
            elif shape.op == "fused_add_rmsnorm_capture":
                _qualify_fused(shape, rows, device, timer, plan, margin, run_candidate, stock_norm)
            else:
                raise ValueError(f"qualification knows draft_fc and fused_add_rmsnorm_capture, not {shape.op!r}")
    plan.seconds = time.perf_counter() - t0
    if use_cache and measured:
        _store_plan(device, shape, buckets, margin, plan, stock)
    return plan


def _fold(weight, chunk_norm_weight, input_norm_weight) -> Optional[torch.Tensor]:
    """The weight with its norm weights folded in (the folded candidates' weight), or None without
    norms or when it cannot be folded (an fp16 overflow: those candidates are not run)."""
    if chunk_norm_weight is None and input_norm_weight is None:
        return None
    from . import ops

    try:
        return ops.fold_norm_weights(weight, chunk_norm_weight, input_norm_weight)
    except ValueError as e:
        log.info("eagle3_ops: qualification runs no folded candidate: %s", e)
        return None


def enabled(device: torch.device, logger=log) -> bool:
    """Whether the plugin qualifies its sites on ``device`` (EAGLE3_OPS_QUALIFY)."""
    from . import settings

    mode = settings.get_or_default("EAGLE3_OPS_QUALIFY", logger)
    return mode == "on" or (mode == "auto" and device.type == "cuda")


def buckets_up_to(max_rows: int) -> List[int]:
    """The default buckets that a site can see, plus its largest M."""
    return sorted({b for b in DEFAULT_BUCKETS if b < max_rows} | {int(max_rows)})


def _positive(text: str) -> int:
    """An argparse type: a whole number >= 1 in ASCII digits (settings' strict parser)."""
    from . import settings

    try:
        return settings.parse_whole_number(text, 1, 1 << 31)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number from 1 to {1 << 31}, got {text!r}") from None


def _problem_bytes(shape: Shape, rows: int) -> int:
    """At least the bytes :func:`qualify` allocates for the largest bucket of ``shape`` (a lower
    bound from what the problems hold, not a measurement): for the fc, the weight in its dtype, its
    float32 draw, its float64 copy for the reference and the folded copy, plus x and outputs; for
    the norm, the slots, inputs and their float64 references."""
    item = torch.empty((), dtype=shape.torch_dtype).element_size()
    KH = shape.captures * shape.hidden
    if shape.op == "draft_fc":
        N = shape.out_features or shape.hidden
        return N * KH * (2 * item + 12) + rows * KH * (item + 12) + rows * N * (8 + 2 * item)
    return rows * shape.hidden * (shape.captures * item + 4 * item + 3 * 8)


def _available_bytes(device: torch.device) -> Optional[int]:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None


def main(argv=None) -> int:
    """``python -m eagle3_ops qualify``: the plugin's qualification for a model shape, without SGLang.
    Exit status 0, 2 (bad usage), 3 (the problems do not fit in this device's memory)."""
    import sys

    ap = argparse.ArgumentParser(prog="python -m eagle3_ops qualify",
                                 description="Check and time every candidate path of the draft fc and the target's "
                                             "fused add+RMSNorm capture at a model's shapes on this device.")
    ap.add_argument("--hidden", type=_positive, required=True, help="the target's hidden size H")
    ap.add_argument("--captures", type=_positive, required=True, help="K, the number of captured layers")
    ap.add_argument("--out-features", type=_positive, default=None, help="the draft fc's N (default H)")
    ap.add_argument("--tp", type=_positive, default=1,
                    help="tensor-parallel size: the fc is timed at N/tp rows per rank")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--chunk-norm", action="store_true", help="the draft has fc_norm (per-capture RMSNorm)")
    ap.add_argument("--input-norm", action="store_true", help="the draft has norm_before_fc (input RMSNorm)")
    ap.add_argument("--bias", action="store_true")
    ap.add_argument("--rows", default=",".join(map(str, DEFAULT_BUCKETS)), help="row buckets, comma-separated")
    ap.add_argument("--reps", type=_positive, default=10)
    ap.add_argument("--no-cache", action="store_true")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    args = ap.parse_args(argv)
    try:
        buckets = [_positive(r) for r in args.rows.split(",") if r.strip()]
        if not buckets:
            raise ValueError
    except (ValueError, argparse.ArgumentTypeError):
        print(f"error: --rows={args.rows!r}: expected positive whole numbers separated by commas", file=sys.stderr)
        return 2
    N = args.out_features or args.hidden
    if N % args.tp:
        print(f"error: --out-features {N} does not split evenly over --tp {args.tp}", file=sys.stderr)
        return 2
    shapes = [Shape("draft_fc", args.hidden, args.captures, N // args.tp, args.dtype, args.bias, args.chunk_norm,
                    args.input_norm),
              Shape("fused_add_rmsnorm_capture", args.hidden, args.captures, 0, args.dtype)]
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    need, have = max(_problem_bytes(sh, max(buckets)) for sh in shapes), _available_bytes(device)
    if have is not None and need > have:
        print(f"error: qualifying at --hidden {args.hidden} --captures {args.captures} --out-features {N} "
              f"--rows up to {max(buckets)} ({args.dtype}) needs at least {need / 2**30:.3g} GiB of {device} memory "
              f"for its problems; {have / 2**30:.3g} GiB is available", file=sys.stderr)
        return 3
    plans_ = [qualify(sh, device, buckets=buckets, reps=args.reps, use_cache=not args.no_cache) for sh in shapes]
    if args.json:
        keys = ("op", "rows", "backend", "path", "max_rel_err", "median_us", "stock_us", "folded")
        print(json.dumps({
            "device": plans_[0].device,
            "choices": [{k: getattr(c, k) for k in keys} | {"stock": c.stock} for p in plans_ for c in p.choices],
            "rejected": [{"op": r.op, "rows": r.rows, "backend": r.backend, "path": r.path, "reason": r.reason,
                          "folded": r.folded}
                         for p in plans_ for r in p.rejected],
        }, indent=1))
    else:
        for p in plans_:
            print(p.table())
            print()
        if plans_[0].device == "cpu":
            print("(CPU: perf_counter times of the reference and the Triton interpreter; they say nothing about a GPU)")
    return 0


__all__ = ["Choice", "DEFAULT_BUCKETS", "MARGIN", "Plan", "Rejection", "Shape", "candidates", "qualify"]
