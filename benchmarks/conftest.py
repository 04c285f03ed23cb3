"""Shared fixtures of every ``benchmarks/bench_*.py`` (pytest-benchmark).

Run ``pytest benchmarks`` (this conftest collects ``bench_*.py``; benchmark functions are named
``test_*``). On a GPU every number is a GPU time; on the CPU only the smallest shapes run, as a smoke
test of the benchmark code, and every row they record says ``"smoke": true`` — a CPU time says
nothing about a GPU kernel and is never a result.

How GPU time is measured. Every call is timed three ways, each the median over ``GPU_REPS``
repetitions, each repetition preceded by an L2 flush:

* ``*_us`` (eager, device time): (1) L2 flush, (2) a spin kernel (``torch.cuda._sleep``, ~200 µs)
  keeps the GPU busy while the host enqueues, (3) CUDA events around the call. The host is ahead of
  the GPU, so host launch/Python overhead is hidden: the time is what the GPU spends on the call's
  kernels, gaps between them included.
* ``*_graph_us`` (CUDA-graph replay): the call is run twice on a side stream (warm-up: compiles,
  first-use checks, per-stream scratch), captured once in a ``torch.cuda.CUDAGraph`` on that
  stream, and ``graph.replay()`` is timed exactly as above (flush, spin, events). This is what
  SGLang's decode graphs see. A call that cannot be captured records ``graph_error``.
* ``*_host_us`` (eager, host overhead visible): L2 flush, ``synchronize``, then events around the
  call: the GPU is idle when the call starts, so host launch and Python overhead count (what an
  eager prefill sees).

L2 flush (``L2Flush``): before every timed repetition the GPU READS a buffer of
max(256 MiB, 4 x L2) (``torch.sum`` into a one-element output), after the previous repetition's
writes. Why a read and not a write (the old ``buffer.zero_()``): a write-based flush leaves the L2
full of dirty lines, and the timed kernel's own misses must write them back to DRAM to make room —
up to one L2 of extra DRAM writes (~60 MB ≈ 14 µs on an H200) charged to the kernel being timed,
against floors of 20-70 µs. A read leaves clean lines that are dropped for free, and it also
evicts (writes back) the dirty lines of the previous repetition's outputs during the flush, outside
the timed window. The reduction itself writes only a few KB (its output and partials). Operands
therefore come from DRAM (cold weights, as in serving, where the target model's traffic evicts the
draft's weight between steps).

Floors, measured in the same run (``meta``):
* ``read_bw`` — READ-only stream bandwidth: the best of ``torch.sum`` over a 1 GiB fp32 buffer and
  (on a GPU with Triton) a streaming-read Triton kernel over the same buffer; GB/s = bytes read /
  time. The draft fc only reads its weight, so its floor is ``max(bytes / read_bw, FLOPs / gemm
  rate)`` (``bw="read"``).
* ``copy_bw`` — device-to-device ``copy_`` of 1 GiB, GB/s = (bytes read + bytes written) / time. The
  capture ops read and write, so their floor is ``bytes / copy_bw`` (``bw="copy"``).

Fixtures (all documented at their definitions):
  ``bench_device``   torch.device the benchmarks run on (current CUDA device, else CPU)
  ``smoke``          True on the CPU: run only the smallest shapes; rows are marked smoke
  ``copy_bandwidth`` session: device-to-device copy bandwidth measured in this run (Bandwidth)
  ``read_bandwidth`` session: read-only stream bandwidth measured in this run (Bandwidth)
  ``l2_flush``       callable that evicts the GPU L2 by a read (no-op on the CPU)
  ``gpu_time_us``    callable(fn, reps=None, flush=True) -> median µs of one eager call (device time)
  ``bench_timer``    session: times a callable eager / graph / host (``Timings``), caches stock timings
  ``bench_results``  session: collector of JSON rows, written to ``$EAGLE3_BENCH_JSON`` after each row
  ``bench_record``   one call that times stock and ours, adds the row, and feeds pytest-benchmark

JSON written to ``$EAGLE3_BENCH_JSON`` (when set): ``{"meta": {...}, "rows": [row, ...]}``.
meta: device, smoke, torch/triton/CUDA versions, SM count, L2 size, the flush, ``read_bw_GBps`` and
``copy_bw_GBps`` (with their bytes and methods), ``gemm_TFLOPs`` (set by bench_draft_fc),
``backends`` (``eagle3_ops.backends()`` unforced), ``build`` (``eagle3_ops.build_info()``),
``stock_kernels`` (which of sgl_kernel / flashinfer import here), timing method, date.
Each row:
  ``bench, shape, dtype, smoke`` — what was measured;
  ``op, backend`` — the eagle3_ops op and the backend that served it (``eagle3_ops.backends()[op]``
  while the row's backend was forced); draft_fc rows add ``path_table`` (``plans.choose``),
  ``path`` (what the backend's plan really launches, after its launch-contract fallbacks),
  ``splits``, and ``forced_path`` where one was forced;
  ``ours, ours_us, ours_graph_us, ours_host_us`` and ``stock, stock_impl, stock_note, stock_us,
  stock_graph_us, stock_host_us`` — the two sides (``stock_impl`` names what the stock side really
  ran: e.g. ``sgl_kernel.fused_add_rmsnorm`` or ``torch eager``), ``graph_error`` when a side could
  not be captured;
  ``bytes`` (what the op must move at least: reads + writes of its contract, not of any
  implementation), ``flops``, ``bw`` (``read`` or ``copy``), ``bw_GBps`` (the measured one),
  ``floor_us`` and ``floor_bound`` (``bytes`` or ``flops``), ``%floor`` / ``%floor_graph``
  (= floor_us / time, 100 = at the floor), ``GB/s`` (= bytes / ours_us), ``%bw``, ``stock_GB/s``,
  ``speedup`` (= stock_us / ours_us) and ``speedup_graph`` (graph replays), ...extra.
``benchmarks/device_check.sh`` prints the table from this file (``benchmarks/device_report.py``).
pytest-benchmark's own columns time one *synchronized* call on the host (launch + sync overhead
included); they are kept for its tooling (``--benchmark-json`` etc.), the JSON rows are the results.
"""
from __future__ import annotations

import datetime
import fnmatch
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional

import pytest
import torch

from eagle3_ops import timing

# the op tests' kit (tests/op_testing.py: targets, problems that run themselves) serves the benchmarks too
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

# Without a GPU the Triton kernels can only run interpreted; set before eagle3_ops.triton imports.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

SMOKE = not torch.cuda.is_available()
GPU_REPS = 30
CPU_REPS = 3
STREAM_BYTES_GPU = 1 << 30   # read and copy bandwidth: 1 GiB, far larger than any L2
STREAM_BYTES_CPU = 64 << 20
FLUSH_MIN_BYTES = 256 << 20  # the L2 flush reads max(this, 4 x L2)


def pytest_collect_file(file_path, parent):
    """Collect ``bench_*.py`` as test modules (unless python_files already does, or the file was
    named on the command line: pytest collects those itself)."""
    if file_path.suffix == ".py" and file_path.name.startswith("bench_") and not parent.session.isinitpath(file_path):
        if not any(fnmatch.fnmatch(file_path.name, pat) for pat in parent.config.getini("python_files")):
            return pytest.Module.from_parent(parent, path=file_path)
    return None


# ---- device, smoke -------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def bench_device() -> torch.device:
    """The current CUDA device, or the CPU when there is none."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@pytest.fixture(scope="session")
def smoke() -> bool:
    """True without a GPU: benchmark files run only their smallest shapes (code smoke test)."""
    return SMOKE


def device_label(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "CPU (smoke test only: says nothing about GPU kernels)"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---- L2 flush ------------------------------------------------------------------------------------
class L2Flush(timing.L2Flush):
    """The one timer's flush (``eagle3_ops.timing.L2Flush``), sized for the benchmarks: a read of
    max(256 MiB, 4 x L2) (see the module doc for why a read, not a write). No-op on the CPU."""

    method = "read: torch.sum of a max(256 MiB, 4 x L2) fp32 buffer into one element"

    def __init__(self, device: torch.device):
        super().__init__(device, min_bytes=FLUSH_MIN_BYTES, l2_multiple=4)


@pytest.fixture(scope="session")
def l2_flush(bench_device) -> L2Flush:
    """Callable: ``l2_flush()`` evicts the GPU L2 by a read (enqueued on the current stream)."""
    return L2Flush(bench_device)


# ---- timing --------------------------------------------------------------------------------------
def time_us(fn: Callable[[], object], device: torch.device, flush: Optional[Callable[[], None]] = None,
            reps: Optional[int] = None, warmup: int = 3, host_overhead: bool = False) -> float:
    """Median time of one ``fn()`` in microseconds: the one timer (``eagle3_ops.timing.Timer``, see the
    module doc for the GPU method). ``host_overhead``: synchronize instead of spinning before each
    call, so that the host's launch overhead is inside the timed window."""
    reps = reps or (GPU_REPS if device.type == "cuda" else CPU_REPS)
    return timing.Timer(device, reps=reps, warmup=warmup, flush=flush, host_overhead=host_overhead)(fn)


def graph_time_us(fn: Callable[[], object], device: torch.device, flush: Optional[Callable[[], None]] = None,
                  reps: Optional[int] = None, stream=None) -> float:
    """Median time of one CUDA-graph replay of ``fn`` (GPU only): warm-up on a side stream, one
    capture on that stream, then replays timed like :func:`time_us` (flush, spin, events). The
    graph (and its private memory pool) is released before returning. Raises what capture raises.
    ``stream``: the side stream (one per session is best: the ops' per-stream scratch is then
    shared by every capture instead of one grow-only buffer per pooled stream)."""
    assert device.type == "cuda", "graph timing needs a CUDA device"
    stream = stream if stream is not None else torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):  # compiles, first-use checks and this stream's scratch happen here, eagerly
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, stream=stream):
            fn()
        torch.cuda.synchronize(device)
        return time_us(graph.replay, device, flush, reps, warmup=2)
    finally:
        del graph
        torch.cuda.synchronize(device)


@dataclass
class Timings:
    """One callable timed three ways (µs; None where not measured) — see the module doc."""
    eager_us: float
    graph_us: Optional[float] = None
    host_us: Optional[float] = None
    graph_error: Optional[str] = None


class BenchTimer:
    """Times callables eager / graph replay / with host overhead; caches stock timings by key
    (stock does not depend on our backend: measured once per (bench, shape), reused for every row)."""

    def __init__(self, device: torch.device, flush: L2Flush):
        self.device = device
        self.flush = flush
        self.cache: Dict[object, Timings] = {}
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # every graph capture

    def eager_us(self, fn, reps=None, flush=True) -> float:
        return time_us(fn, self.device, self.flush if flush else None, reps)

    def measure(self, fn: Callable[[], object], graph: bool = True) -> Timings:
        t = Timings(eager_us=time_us(fn, self.device, self.flush))
        if self.device.type != "cuda":
            return t  # no graphs and no separate host timing on the CPU: a smoke row
        t.host_us = time_us(fn, self.device, self.flush, warmup=1, host_overhead=True)
        if graph:
            try:
                t.graph_us = graph_time_us(fn, self.device, self.flush, stream=self.stream)
            except Exception as e:  # recorded in the row: a call that cannot be captured is a finding
                t.graph_error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
                torch.cuda.synchronize(self.device)
        return t

    def measure_cached(self, key, fn: Callable[[], object], graph: bool = True) -> Timings:
        if key is None or key not in self.cache:
            t = self.measure(fn, graph)
            if key is None:
                return t
            self.cache[key] = t
        return self.cache[key]


@pytest.fixture(scope="session")
def bench_timer(bench_device, l2_flush) -> BenchTimer:
    """Session :class:`BenchTimer` (``measure(fn) -> Timings``, ``measure_cached(key, fn)``)."""
    return BenchTimer(bench_device, l2_flush)


@pytest.fixture(scope="session")
def gpu_time_us(bench_timer):
    """Callable ``gpu_time_us(fn, reps=None, flush=True) -> float``: median µs of one eager ``fn()``
    (CUDA events, L2 flushed by a read, host overhead hidden; perf_counter on the CPU)."""
    return bench_timer.eager_us


# ---- bandwidths ----------------------------------------------------------------------------------
@dataclass
class Bandwidth:
    """A stream bandwidth measured in this run. ``kind`` = "read" (bytes read / time) or "copy"
    ((bytes read + bytes written) / time); ``methods``: GB/s of each kernel tried (the best counts)."""
    kind: str
    GBps: float
    nbytes: int
    median_us: float
    method: str
    methods: Dict[str, float] = field(default_factory=dict)

    def floor_us(self, bytes_moved: int) -> float:
        """The time ``bytes_moved`` takes at this bandwidth."""
        return bytes_moved / (self.GBps * 1e3)


def measure_copy_bandwidth(device: torch.device) -> Bandwidth:
    nbytes = STREAM_BYTES_GPU if device.type == "cuda" else STREAM_BYTES_CPU
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    # Far larger than L2, so no flush is needed: it streams from and to DRAM. The lambda runs inside time_us,
    # before the `del` below (a closure, not default args, so the del frees the buffers).
    us = time_us(lambda: dst.copy_(src), device, flush=None, reps=20 if device.type == "cuda" else 5)  # noqa: F821
    del src, dst
    if device.type == "cuda":
        torch.cuda.empty_cache()
    gbps = 2 * nbytes / (us * 1e3)
    method = f"copy_ of {nbytes >> 20} MiB (read + write bytes)"
    return Bandwidth("copy", gbps, nbytes, us, method, {method: round(gbps, 1)})


_read_kernel = None
if not SMOKE:
    try:
        import triton
        import triton.language as tl

        @triton.jit
        def _read_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
            """Streaming read: each program sums BLOCK * ITERS consecutive fp32 into one partial."""
            pid = tl.program_id(0)
            base = pid.to(tl.int64) * (BLOCK * ITERS)
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for i in tl.static_range(ITERS):
                offs = base + i * BLOCK + tl.arange(0, BLOCK)
                acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0)
            tl.store(out_ptr + pid, tl.sum(acc, axis=0))
    except Exception:  # no Triton: torch.sum alone measures the read bandwidth
        _read_kernel = None


def measure_read_bandwidth(device: torch.device) -> Bandwidth:
    """Read-only stream bandwidth: the best of the read kernels below over one 1 GiB fp32 buffer."""
    nbytes = STREAM_BYTES_GPU if device.type == "cuda" else STREAM_BYTES_CPU
    n = nbytes // 4
    src = torch.rand(n, dtype=torch.float32, device=device)
    sink = torch.zeros((), dtype=torch.float32, device=device)
    reps = 20 if device.type == "cuda" else 5
    # The lambdas close over src (no default args) so that the `del src` below frees the buffer; they all run before it.
    candidates = {f"torch.sum of {nbytes >> 20} MiB fp32": lambda: torch.sum(src, dim=0, out=sink)}  # noqa: F821
    if device.type == "cuda" and _read_kernel is not None:
        BLOCK, ITERS = 2048, 8
        grid = (-(-n // (BLOCK * ITERS)),)
        partials = torch.empty(grid[0], dtype=torch.float32, device=device)
        candidates[f"triton streaming read of {nbytes >> 20} MiB fp32"] = (
            lambda: _read_kernel[grid](src, partials, n, BLOCK=BLOCK, ITERS=ITERS, num_warps=8))  # noqa: F821
    methods, best = {}, None
    for name, fn in candidates.items():
        try:
            us = time_us(fn, device, flush=None, reps=reps)
        except Exception as e:  # a read kernel that fails here is reported, the others still count
            methods[name] = f"failed: {type(e).__name__}: {e}"[:200]
            continue
        gbps = nbytes / (us * 1e3)
        methods[name] = round(gbps, 1)
        if best is None or gbps > best[1]:
            best = (name, gbps, us)
    del src
    if device.type == "cuda":
        torch.cuda.empty_cache()
    assert best is not None, f"no read kernel ran: {methods}"
    return Bandwidth("read", best[1], nbytes, best[2], best[0] + " (bytes read)", methods)


@pytest.fixture(scope="session")
def copy_bandwidth(bench_device) -> Bandwidth:
    """Copy bandwidth of this device measured once per run: a 1 GiB device-to-device ``copy_``
    (64 MiB on the CPU), median of 20 CUDA-event timings; GB/s = 2 x size / time."""
    return measure_copy_bandwidth(bench_device)


@pytest.fixture(scope="session")
def read_bandwidth(bench_device) -> Bandwidth:
    """Read-only bandwidth of this device measured once per run over 1 GiB (64 MiB on the CPU):
    best of torch.sum and a Triton streaming read; GB/s = size / time."""
    return measure_read_bandwidth(bench_device)


# ---- what ran ------------------------------------------------------------------------------------
def op_backend(op: Optional[str], device: torch.device, dtype: torch.dtype = torch.bfloat16) -> Optional[str]:
    """The backend serving ``op`` right now (``eagle3_ops.backends()``: the forced one while
    EAGLE3_OPS_BACKEND is set), or an ``error: ...`` string."""
    if op is None:
        return None
    try:
        import eagle3_ops

        return eagle3_ops.backends(device, dtype)[op]
    except Exception as e:
        return f"error: {type(e).__name__}: {e}"[:200]


def stock_kernels(device: torch.device) -> dict:
    """Which SGLang-side kernel packages import here (the stock baselines use them when they do and
    they pass a probe: each row's ``stock_impl`` says what ran). On the CPU they are only looked up
    (importing them is slow and their kernels cannot run there)."""
    out = {}
    for name in ("sgl_kernel", "flashinfer"):
        if device.type != "cuda":
            import importlib.util

            out[name] = "installed (not used: CPU)" if importlib.util.find_spec(name) else "not installed"
            continue
        try:
            mod = __import__(name)
            out[name] = getattr(mod, "__version__", "importable")
        except Exception as e:
            out[name] = f"not importable ({type(e).__name__})"
    return out


# ---- results -------------------------------------------------------------------------------------
def _round(v, nd=3):
    return None if v is None else round(v, nd)


class BenchResults:
    """Rows of one benchmark run; written as JSON to ``$EAGLE3_BENCH_JSON`` after every row."""

    def __init__(self, device: torch.device, copy_bw: Bandwidth, read_bw: Bandwidth, flush: L2Flush):
        self.device = device
        self.copy_bw = copy_bw
        self.read_bw = read_bw
        self.flush = flush
        self.rows = []
        self.meta_extra = {}
        self._meta = self._static_meta()

    def bandwidth(self, kind: str) -> Bandwidth:
        if kind not in ("read", "copy"):
            raise ValueError(f"bw must be 'read' or 'copy', got {kind!r}")
        return self.read_bw if kind == "read" else self.copy_bw

    def add(self, bench: str, shape: str, bytes_moved: int, ours: str, ours_t: Timings,
            stock: Optional[str] = None, stock_t: Optional[Timings] = None, dtype: Optional[str] = None, *,
            bw: str = "copy", flops: int = 0, tflops: Optional[float] = None, save: bool = True, **extra) -> dict:
        """One row (see the module doc). ``bw``: which measured bandwidth sets the byte floor;
        ``flops`` / ``tflops``: the op's FLOPs and the measured matrix rate (the FLOP floor);
        ``save``: rewrite the JSON now (else call :meth:`save` after completing the row)."""
        band = self.bandwidth(bw)
        ours_us = ours_t.eager_us
        byte_floor = band.floor_us(bytes_moved)
        flop_floor = flops / (tflops * 1e6) if flops and tflops else 0.0
        floor = max(byte_floor, flop_floor)
        gbps = bytes_moved / (ours_us * 1e3)
        stock_us = None if stock_t is None else stock_t.eager_us
        stock_graph = None if stock_t is None else stock_t.graph_us
        graph_errors = [f"{side}: {t.graph_error}" for side, t in (("ours", ours_t), ("stock", stock_t))
                        if t is not None and t.graph_error]
        row = {
            "bench": bench, "shape": shape, "dtype": dtype,
            "ours": ours, "ours_us": _round(ours_us), "ours_graph_us": _round(ours_t.graph_us),
            "ours_host_us": _round(ours_t.host_us),
            "stock": stock, "stock_us": _round(stock_us), "stock_graph_us": _round(stock_graph),
            "stock_host_us": None if stock_t is None else _round(stock_t.host_us),
            "graph_error": "; ".join(graph_errors) or None,
            "bytes": int(bytes_moved), "flops": int(flops), "bw": bw, "bw_GBps": round(band.GBps, 1),
            "floor_us": round(floor, 3), "floor_bound": "flops" if flop_floor > byte_floor else "bytes",
            "%floor": round(100.0 * floor / ours_us, 1),
            "%floor_graph": None if not ours_t.graph_us else round(100.0 * floor / ours_t.graph_us, 1),
            "GB/s": round(gbps, 1), "%bw": round(100.0 * gbps / band.GBps, 1),
            "stock_GB/s": None if stock_us is None else round(bytes_moved / (stock_us * 1e3), 1),
            "speedup": None if stock_us is None else round(stock_us / ours_us, 2),
            "speedup_graph": (round(stock_graph / ours_t.graph_us, 2)
                              if stock_graph and ours_t.graph_us else None),
            "smoke": self.device.type != "cuda",
        }
        row.update(extra)
        self.rows.append(row)
        if save:
            self.save()
        return row

    def save(self) -> None:
        """Rewrites ``$EAGLE3_BENCH_JSON`` (when set) after every row: a run cut short by a timeout
        keeps what it measured."""
        path = os.environ.get("EAGLE3_BENCH_JSON")
        if path:
            self.write(path)

    def _static_meta(self) -> dict:
        try:
            import triton
            triton_version = triton.__version__
        except ImportError:
            triton_version = None
        try:
            import eagle3_ops

            build = eagle3_ops.build_info()
        except Exception as e:
            build = f"error: {type(e).__name__}: {e}"
        cuda = self.device.type == "cuda"
        props = torch.cuda.get_device_properties(self.device) if cuda else None
        return {
            "device": device_label(self.device),
            "smoke": not cuda,
            "torch": torch.__version__,
            "torch_cuda": torch.version.cuda,
            "triton": triton_version,
            "capability": ".".join(map(str, torch.cuda.get_device_capability(self.device))) if cuda else None,
            "sm_count": props.multi_processor_count if cuda else None,
            "l2_bytes": self.flush.l2_bytes or None,
            "l2_flush": {"method": self.flush.method, "bytes": self.flush.nbytes} if cuda else "none (CPU)",
            "read_bw_GBps": round(self.read_bw.GBps, 1), "read_bytes": self.read_bw.nbytes,
            "read_method": self.read_bw.method, "read_methods": self.read_bw.methods,
            "copy_bw_GBps": round(self.copy_bw.GBps, 1), "copy_bytes": self.copy_bw.nbytes,
            "copy_method": self.copy_bw.method,
            "backends": op_backend_all(self.device),
            "build": build,
            "stock_kernels": stock_kernels(self.device),
            "timing": ("CUDA events, median of %d; L2 flushed by a read before each; eager (spin ahead: host "
                       "overhead hidden), CUDA-graph replay, and eager with host overhead (GPU idle at start)"
                       % GPU_REPS) if cuda else "perf_counter median (CPU smoke test)",
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }

    def meta(self) -> dict:
        return {**self._meta, **self.meta_extra}

    def write(self, path: str) -> None:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump({"meta": self.meta(), "rows": self.rows}, f, indent=1)
        os.replace(tmp, path)  # a reader (or a kill) never sees half a file


def op_backend_all(device: torch.device):
    """``eagle3_ops.backends(device)`` (unforced: what serves each op by default here), or the error."""
    try:
        import eagle3_ops

        return eagle3_ops.backends(device)
    except Exception as e:
        return f"error: {type(e).__name__}: {e}"[:300]


@pytest.fixture(scope="session")
def bench_results(bench_device, copy_bandwidth, read_bandwidth, l2_flush):
    """Session collector: ``bench_results.add(bench, shape, bytes_moved, ours, ours_timings, stock,
    stock_timings, dtype, bw=..., flops=..., tflops=..., **extra)``; JSON (re)written to
    ``$EAGLE3_BENCH_JSON`` after each row. ``meta_extra`` adds keys to meta."""
    results = BenchResults(bench_device, copy_bandwidth, read_bandwidth, l2_flush)
    yield results
    path = os.environ.get("EAGLE3_BENCH_JSON")
    if path and results.rows:
        results.write(path)


@pytest.fixture
def bench_record(benchmark, bench_results, bench_timer, bench_device):
    """``bench_record(bench, shape, bytes_moved, ours_name, ours_fn, *, op=None, stock_name=None,
    stock_fn=None, stock_key=None, stock_impl=None, stock_note=None, dtype=None, bw="copy", flops=0,
    tflops=None, post=None, **extra) -> row``: times ``ours_fn`` and ``stock_fn`` (stock cached under
    ``stock_key``) eager, as a graph replay and with host overhead; records the backend serving
    ``op``; adds the JSON row (plus ``post(row)``'s keys); puts the numbers into pytest-benchmark's
    extra_info; and lets pytest-benchmark time a few synchronized calls of ``ours_fn``."""
    def record(bench, shape, bytes_moved, ours_name, ours_fn, *, op=None, stock_name=None, stock_fn=None,
               stock_key=None, stock_impl=None, stock_note=None, dtype=None, bw="copy", flops=0, tflops=None,
               post=None, **extra):
        stock_t = bench_timer.measure_cached(stock_key, stock_fn) if stock_fn is not None else None
        ours_t = bench_timer.measure(ours_fn)
        row = bench_results.add(bench, shape, bytes_moved, ours_name, ours_t, stock_name, stock_t, dtype,
                                bw=bw, flops=flops, tflops=tflops, save=False, op=op,
                                backend=op_backend(op, bench_device), stock_impl=stock_impl, stock_note=stock_note,
                                **extra)
        if post is not None:
            row.update(post(row))
        bench_results.save()
        benchmark.extra_info.update(row)

        def synced():
            ours_fn()
            _sync(bench_device)

        benchmark.pedantic(synced, rounds=5 if bench_device.type == "cuda" else 1, iterations=1, warmup_rounds=1)
        return row
    return record


try:  # pytest-benchmark is a test dependency; without it, a stand-in keeps the benchmarks running
    import pytest_benchmark  # noqa: F401
except ImportError:
    class _BenchmarkStandIn:
        """Minimal ``benchmark`` fixture: runs the function; the JSON rows carry the results."""

        def __init__(self):
            self.extra_info = {}

        def __call__(self, fn, *args, **kwargs):
            return fn(*args, **kwargs)

        def pedantic(self, fn, args=(), kwargs=None, rounds=1, iterations=1, warmup_rounds=0, setup=None):
            result = None
            for _ in range(warmup_rounds + rounds * iterations):
                result = fn(*args, **(kwargs or {}))
            return result

    @pytest.fixture
    def benchmark():
        return _BenchmarkStandIn()
