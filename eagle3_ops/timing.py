"""Median wall time of a callable: CUDA events on a GPU, perf_counter on the CPU.

The label returned with every number names the device, so a CPU timing is never mistaken for a
GPU kernel's.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def median_ms(fn: Callable[[], object], device: torch.device, warmup: int = 3, iters: int = 20) -> float:
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        times = []
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def device_label(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (CUDA events)"
    return "CPU (perf_counter; says nothing about GPU kernels)"
