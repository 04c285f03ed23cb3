"""The one timer: what qualification, the draft fc sharding decision, the demo and the benchmarks time with.

On a GPU, each timed repetition is: (1) the L2 evicted by a READ of a buffer larger than it
(:class:`L2Flush`; a read leaves clean lines the timed call drops for free, where a write-based flush
would charge it the write-back of a dirty L2), (2) a spin kernel (``torch.cuda._sleep``) that keeps the
GPU busy while the host enqueues the call, so the time is the kernels' (as in the CUDA-graph replays
that serve most calls), not Python's launch overhead — or, with ``host_overhead=True``, a synchronize
instead, so that launch overhead is inside the window (an eager prefill's view), (3) CUDA events
around the call. On the CPU: ``time.perf_counter`` around the call (a CPU time says nothing about a
GPU kernel; :func:`device_label` names the device with every number).

``Timer(..., tolerant=True)`` is for timing collectives: the call runs exactly ``warmup + reps`` times
whatever happens to the timing around it (an event that fails to record drops that sample only), so
every rank of a process group issues the same number of collectives.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, List, Optional

import torch

# ~200 us at ~2 GHz: longer than the host needs to enqueue one timed call (three capture calls through the
# Python face, or a stock sequence of several torch ops), so no host gap enters the device time.
SPIN_CYCLES = 400_000


class L2Flush:
    """Evicts the GPU L2 by READING a buffer of ``max(min_bytes, l2_multiple x L2 size)`` into a
    one-element sum (enqueued on the current stream). No-op on the CPU."""

    def __init__(self, device: torch.device, min_bytes: int = 1 << 20, l2_multiple: int = 2):
        self.device = torch.device(device)
        self.buffer = self.sink = None
        self.l2_bytes = self.nbytes = 0
        if self.device.type == "cuda":
            self.l2_bytes = int(getattr(torch.cuda.get_device_properties(self.device), "L2_cache_size", 0) or 0)
            self.nbytes = max(min_bytes, l2_multiple * self.l2_bytes)
            # written once here (random, never zeros); the first read below writes those lines back
            self.buffer = torch.rand(self.nbytes // 4, dtype=torch.float32, device=self.device)
            self.sink = torch.zeros((), dtype=torch.float32, device=self.device)
            self()
            torch.cuda.synchronize(self.device)

    def __call__(self) -> None:
        if self.buffer is not None:
            torch.sum(self.buffer, dim=0, out=self.sink)


def _spin() -> None:
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is not None:
        sleep(SPIN_CYCLES)


class Timer:
    """Median microseconds of one call of ``fn`` (``timer(fn)``), or every sample (:meth:`samples`).

    ``flush``: an :class:`L2Flush` (shared between timers), True (one of the default size, made here),
    or None/False (no flush: a call that streams far more than L2, or a collective). ``spin``: hide the
    host's launch overhead (see the module doc); ``host_overhead``: count it instead. ``warmup``
    untimed calls come first (compiles, first-use checks)."""

    def __init__(self, device: torch.device, reps: int = 10, warmup: int = 1, flush=True, spin: bool = True,
                 host_overhead: bool = False, tolerant: bool = False):
        self.device = torch.device(device)
        self.reps, self.warmup = reps, warmup
        self.spin, self.host_overhead, self.tolerant = spin and not host_overhead, host_overhead, tolerant
        cuda = self.device.type == "cuda"
        self.flush: Optional[Callable[[], None]] = (L2Flush(self.device) if flush is True and cuda else
                                                    flush if callable(flush) and cuda else None)

    def __call__(self, fn: Callable[[], object]) -> float:
        return statistics.median(self.samples(fn))

    def samples(self, fn: Callable[[], object], reps: Optional[int] = None) -> List[float]:
        """Microseconds of each of ``reps`` timed calls (after the warm-up calls). Tolerant: fewer
        samples where timing failed (never fewer calls)."""
        reps = self.reps if reps is None else reps
        for _ in range(self.warmup):
            fn()
        if self.device.type != "cuda":
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e6)
            return times
        return self._cuda_samples(fn, reps)

    def _cuda_samples(self, fn: Callable[[], object], reps: int) -> List[float]:
        pairs = []
        for _ in range(reps):
            pair = self._guarded(self._start)
            fn()
            if pair is not None and self._guarded(pair[1].record, True) is not None:
                pairs.append(pair)
        times = []
        for start, end in pairs:
            us = self._guarded(lambda start=start, end=end: (end.synchronize(), start.elapsed_time(end) * 1e3)[1])
            if us is not None:
                times.append(us)
        return times

    def _start(self):
        if self.flush is not None:
            self.flush()
        if self.host_overhead:
            torch.cuda.synchronize(self.device)
        elif self.spin:
            _spin()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        return start, end

    def _guarded(self, step: Callable, result=None):
        """``step()`` (its value, or ``result`` when given); tolerant: None where it raised."""
        if not self.tolerant:
            value = step()
            return value if result is None else result
        try:
            value = step()
            return value if result is None else result
        except Exception:
            return None


def median_ms(fn: Callable[[], object], device: torch.device, warmup: int = 3, iters: int = 20) -> float:
    """Median milliseconds of one ``fn()``: :class:`Timer` (L2 flushed, launch overhead hidden on a GPU)."""
    return Timer(device, reps=iters, warmup=warmup)(fn) / 1e3


def device_label(device: torch.device) -> str:
    """What the timings on ``device`` were measured on and with: the GPU's name and CUDA events, or the CPU with
    perf_counter (printed next to every number so a CPU time is not read as a GPU one)."""
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (CUDA events)"
    return "CPU (perf_counter; says nothing about GPU kernels)"
