"""Shared fixtures of every ``benchmarks/bench_*.py`` (pytest-benchmark).

Run ``pytest benchmarks`` (this conftest collects ``bench_*.py``; benchmark functions are named
``test_*``). On a GPU every number is a GPU time; on the CPU only the smallest shapes run, as a smoke
test of the benchmark code, and every row they record says ``"smoke": true`` — a CPU time says
nothing about a GPU kernel and is never a result.

How GPU time is measured (``gpu_time_us``): per repetition, (1) the L2 is flushed by writing a
buffer several times its size, (2) a spin kernel (``torch.cuda._sleep``) keeps the GPU busy for
~50 µs while the host enqueues, (3) CUDA events are recorded around the call. The median over the
repetitions is reported. Because the host is ahead of the GPU, host launch/Python overhead is hidden
and the time is what the GPU spends on the call's kernels, gaps between them included — what a
CUDA-graph replay sees (eager-mode host overhead is *not* in these numbers). Data come from DRAM, as
in the copy-bandwidth measurement they are compared with.

Fixtures (all documented at their definitions):
  ``bench_device``   torch.device the benchmarks run on (current CUDA device, else CPU)
  ``smoke``          True on the CPU: run only the smallest shapes; rows are marked smoke
  ``copy_bandwidth`` session: device-to-device copy bandwidth measured in this run (CopyBandwidth)
  ``l2_flush``       callable that evicts the GPU L2 (no-op on the CPU)
  ``gpu_time_us``    callable(fn, reps=None, flush=True) -> median microseconds of one call
  ``bench_results``  session: collector of JSON rows, written to ``$EAGLE3_BENCH_JSON`` after each row
  ``bench_record``   one call that times stock and ours, adds the row, and feeds pytest-benchmark

JSON written to ``$EAGLE3_BENCH_JSON`` (when set): ``{"meta": {...}, "rows": [row, ...]}`` with
meta = device, torch/triton versions, copy bandwidth, smoke; and each row =
``{"bench", "shape", "dtype", "stock", "stock_us", "ours", "ours_us", "bytes", "floor_us", "GB/s",
"%copy-bw", "stock_GB/s", "speedup", "smoke", ...extra}`` where ``bytes`` is what the op must move
at least (reads + writes of its contract, not of any implementation), ``GB/s = bytes / ours_us``,
``%copy-bw`` = that over the measured copy bandwidth, ``floor_us = bytes / copy bandwidth`` and
``speedup = stock_us / ours_us``. ``benchmarks/device_check.sh`` prints the table from this file.
pytest-benchmark's own columns time one *synchronized* call on the host (launch + sync overhead
included); they are kept for its tooling (``--benchmark-json`` etc.), the JSON rows are the results.
"""
from __future__ import annotations

import datetime
import fnmatch
import json
import os
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Optional

import pytest
import torch

# Without a GPU the Triton kernels can only run interpreted; set before eagle3_ops.triton imports.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

SMOKE = not torch.cuda.is_available()
GPU_REPS = 30
CPU_REPS = 3
SPIN_CYCLES = 100_000  # ~50 µs at ~2 GHz: longer than the host needs to enqueue one benchmarked call
COPY_BYTES_GPU = 1 << 30
COPY_BYTES_CPU = 64 << 20


def pytest_collect_file(file_path, parent):
    """Collect ``bench_*.py`` as test modules (unless python_files already does)."""
    if file_path.suffix == ".py" and file_path.name.startswith("bench_"):
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


# ---- timing --------------------------------------------------------------------------------------
class L2Flush:
    """Evicts the GPU L2 by zeroing a buffer of max(256 MiB, 4 x L2 size). No-op on the CPU."""

    def __init__(self, device: torch.device):
        self.device = device
        self.buffer = None
        if device.type == "cuda":
            l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 0
            nbytes = max(256 << 20, 4 * l2)
            self.buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def __call__(self) -> None:
        if self.buffer is not None:
            self.buffer.zero_()


@pytest.fixture(scope="session")
def l2_flush(bench_device) -> L2Flush:
    """Callable: ``l2_flush()`` evicts the GPU L2 (enqueued on the current stream)."""
    return L2Flush(bench_device)


def _spin():
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is not None:
        sleep(SPIN_CYCLES)


def time_us(fn: Callable[[], object], device: torch.device, flush: Optional[L2Flush] = None,
            reps: Optional[int] = None, warmup: int = 3) -> float:
    """Median time of one ``fn()`` in microseconds (see the module doc for the GPU method)."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        reps = reps or GPU_REPS
        torch.cuda.synchronize(device)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for start, end in events:
            if flush is not None:
                flush()
            _spin()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
        return statistics.median(s.elapsed_time(e) for s, e in events) * 1e3
    reps = reps or CPU_REPS
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


@pytest.fixture(scope="session")
def gpu_time_us(bench_device, l2_flush):
    """Callable ``gpu_time_us(fn, reps=None, flush=True) -> float``: median µs of one ``fn()``
    (CUDA events, L2 flushed, host overhead hidden; perf_counter on the CPU)."""
    def measure(fn, reps=None, flush=True):
        return time_us(fn, bench_device, l2_flush if flush else None, reps)
    return measure


# ---- copy bandwidth ------------------------------------------------------------------------------
@dataclass
class CopyBandwidth:
    """Device-to-device copy measured in this run: ``GBps`` counts bytes read + written."""
    GBps: float
    nbytes: int
    median_us: float
    device: str

    def floor_us(self, bytes_moved: int) -> float:
        """The time ``bytes_moved`` (reads + writes) takes at copy bandwidth."""
        return bytes_moved / (self.GBps * 1e3)


def measure_copy_bandwidth(device: torch.device) -> CopyBandwidth:
    nbytes = COPY_BYTES_GPU if device.type == "cuda" else COPY_BYTES_CPU
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    # The copy is far larger than L2, so no flush is needed: it streams from and to DRAM.
    us = time_us(lambda: dst.copy_(src), device, flush=None, reps=20 if device.type == "cuda" else 5)
    del src, dst
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return CopyBandwidth(GBps=2 * nbytes / (us * 1e3), nbytes=nbytes, median_us=us, device=device_label(device))


@pytest.fixture(scope="session")
def copy_bandwidth(bench_device) -> CopyBandwidth:
    """Copy bandwidth of this device measured once per run: a 1 GiB device-to-device ``copy_``
    (64 MiB on the CPU), median of 20 CUDA-event timings; GB/s = 2 x size / time."""
    return measure_copy_bandwidth(bench_device)


# ---- results -------------------------------------------------------------------------------------
class BenchResults:
    """Rows of one benchmark run; written as JSON to ``$EAGLE3_BENCH_JSON`` after every row."""

    def __init__(self, device: torch.device, copy_bw: CopyBandwidth):
        self.device = device
        self.copy_bw = copy_bw
        self.rows = []

    def add(self, bench: str, shape: str, bytes_moved: int, ours: str, ours_us: float,
            stock: Optional[str] = None, stock_us: Optional[float] = None, dtype: Optional[str] = None,
            **extra) -> dict:
        gbps = bytes_moved / (ours_us * 1e3)
        row = {
            "bench": bench, "shape": shape, "dtype": dtype,
            "stock": stock, "stock_us": None if stock_us is None else round(stock_us, 3),
            "ours": ours, "ours_us": round(ours_us, 3),
            "bytes": int(bytes_moved), "floor_us": round(self.copy_bw.floor_us(bytes_moved), 3),
            "GB/s": round(gbps, 1), "%copy-bw": round(100.0 * gbps / self.copy_bw.GBps, 1),
            "stock_GB/s": None if stock_us is None else round(bytes_moved / (stock_us * 1e3), 1),
            "speedup": None if stock_us is None else round(stock_us / ours_us, 2),
            "smoke": self.device.type != "cuda",
        }
        row.update(extra)
        self.rows.append(row)
        path = os.environ.get("EAGLE3_BENCH_JSON")
        if path:  # rewritten after every row: a run cut short by a timeout keeps what it measured
            self.write(path)
        return row

    def meta(self) -> dict:
        try:
            import triton
            triton_version = triton.__version__
        except ImportError:
            triton_version = None
        return {
            "device": device_label(self.device),
            "smoke": self.device.type != "cuda",
            "torch": torch.__version__,
            "triton": triton_version,
            "copy_bw_GBps": round(self.copy_bw.GBps, 1),
            "copy_bytes": self.copy_bw.nbytes,
            "timing": "CUDA events, median, L2 flushed, host overhead hidden" if self.device.type == "cuda"
                      else "perf_counter median (CPU smoke test)",
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }

    def write(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump({"meta": self.meta(), "rows": self.rows}, f, indent=1)


@pytest.fixture(scope="session")
def bench_results(bench_device, copy_bandwidth):
    """Session collector: ``bench_results.add(bench=..., shape=..., bytes_moved=..., ours=..., ours_us=...,
    stock=..., stock_us=..., dtype=..., **extra)``; JSON (re)written to ``$EAGLE3_BENCH_JSON`` after each row."""
    results = BenchResults(bench_device, copy_bandwidth)
    yield results
    path = os.environ.get("EAGLE3_BENCH_JSON")
    if path and results.rows:
        results.write(path)


@pytest.fixture
def bench_record(benchmark, bench_results, gpu_time_us, bench_device):
    """``bench_record(bench, shape, bytes_moved, ours_name, ours_fn, stock_name=None, stock_fn=None,
    stock_us=None, dtype=None, **extra) -> row``: times ``ours_fn`` (and ``stock_fn`` unless its time
    is passed in), adds the JSON row, puts the numbers into pytest-benchmark's extra_info, and lets
    pytest-benchmark time a few synchronized calls of ``ours_fn``."""
    def record(bench, shape, bytes_moved, ours_name, ours_fn, stock_name=None, stock_fn=None, stock_us=None,
               dtype=None, **extra):
        if stock_fn is not None and stock_us is None:
            stock_us = gpu_time_us(stock_fn)
        ours_us = gpu_time_us(ours_fn)
        row = bench_results.add(bench, shape, bytes_moved, ours_name, ours_us, stock_name, stock_us, dtype, **extra)
        benchmark.extra_info.update(row)

        def synced():
            ours_fn()
            if bench_device.type == "cuda":
                torch.cuda.synchronize(bench_device)

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
