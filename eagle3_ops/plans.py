"""Which ``draft_fc`` path serves which M: THE crossover table of both accelerated backends.

Paths:

* ``skinny`` — swap-AB split-K over the weight (decode / verify, small M; the weight read is the
  floor). Triton: ``triton/draft_fc.py``; CUDA: ``csrc/draft_fc.cu``.
* ``tiled`` — a tiled GEMM with the gather and norms in its prologue (Triton only).
* ``cublas`` — cuBLAS on the prepared input ``norm(x[rows])`` (both backends; large M).

The table is decided here, in Python, and passed to the kernels (the CUDA op takes the path as an
argument): one place to update after measuring. Until a device has measured the crossover points
(``pytest benchmarks/bench_draft_fc.py`` prints every path for every M), the entries are DESIGN
ESTIMATES (docs/kernels.md §10), NOT measurements.

:func:`forced_path` (a context manager, per thread) makes every ``draft_fc`` call in its scope take
one path wherever the kernel's launch contract allows it (tests and benchmarks use it to measure
and check each path).
"""
from __future__ import annotations

import contextlib
import functools
import threading
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

PATHS = ("skinny", "tiled", "cublas")


@dataclass(frozen=True)
class Crossover:
    """skinny for M <= skinny_max_m, tiled for skinny_max_m < M <= tiled_max_m, cuBLAS above."""

    device: str
    skinny_max_m: int
    tiled_max_m: int
    basis: str

    def path(self, M: int) -> str:
        """The path this table gives a call with ``M`` output rows: ``skinny``, ``tiled`` or ``cublas``."""
        if M <= self.skinny_max_m:
            return "skinny"
        if M <= self.tiled_max_m:
            return "tiled"
        return "cublas"


# (backend, arch key) -> Crossover. The CUDA backend has no tiled kernel: its tiled_max_m equals
# skinny_max_m. Arch keys: "sm_90", "sm_120", "default" (any other GPU), "interpreter" (CPU, Triton
# interpreter: tests only).
CROSSOVER = {
    ("triton", "sm_90"): Crossover(
        device="H200 (sm_90, 132 SMs, ~4.3 TB/s copy, ~790 TFLOP/s bf16)",
        skinny_max_m=128, tiled_max_m=128,
        basis="design estimate, not measured: the weight read is the floor up to M ~ 790e12/4.3e12 ~ 180 "
              "(72 us at H=7168); skinny stops at 128 to leave margin for the split-K partial traffic "
              "(S*M*N*4 B). Above it cuBLAS's wgmma GEMM is assumed to beat a Triton tile, so tiled is off."),
    ("triton", "sm_120"): Crossover(
        device="RTX PRO 6000 / RTX 5090 (sm_120, 1.79 TB/s, ~500 / ~210 TFLOP/s bf16)",
        skinny_max_m=128, tiled_max_m=512,
        basis="design estimate, not measured: memory-bound up to M ~ 280 (PRO 6000) / ~117 (5090); "
              "cuBLAS on sm_120 runs sm80 tiles plus a separate split-K reduce, so a fused tiled kernel "
              "is assumed to win up to M = 512 by skipping the prepared-input pass."),
    ("triton", "default"): Crossover(
        device="any other GPU", skinny_max_m=64, tiled_max_m=64,
        basis="conservative guess, not measured: short skinny range, cuBLAS above"),
    ("triton", "interpreter"): Crossover(
        device="CPU, Triton interpreter (tests only; no speed meaning)", skinny_max_m=16, tiled_max_m=1 << 30,
        basis="chosen so that the CPU tests run both Triton kernels"),
    ("cuda", "sm_90"): Crossover(
        device="H200 (sm_90, 132 SMs, ~4.3 TB/s, ~790 TFLOP/s bf16)", skinny_max_m=128, tiled_max_m=128,
        basis="design estimate, not measured: weight-read floor up to M ~ 130-150 with mma.sync; "
              "128 = 2 token tiles"),
    ("cuda", "sm_120"): Crossover(
        device="RTX PRO 6000 / RTX 5090 (sm_120, 1.79 TB/s)", skinny_max_m=128, tiled_max_m=128,
        basis="design estimate, not measured: memory-bound up to M ~ 280 (PRO 6000) / ~117 (5090)"),
    ("cuda", "default"): Crossover(
        device="any other GPU", skinny_max_m=64, tiled_max_m=64,
        basis="a guess, not measured: short skinny range, cuBLAS above"),
}


class _Forced(threading.local):
    path: Optional[str] = None  # read by a thread that never entered forced_path (no AttributeError per call)


_forced = _Forced()


@functools.lru_cache(maxsize=None)
def capability(device_index: int) -> tuple:
    """(major, minor) of a GPU, asked once per device (every draft_fc call plans with it)."""
    return tuple(torch.cuda.get_device_capability(device_index))


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def arch_key(device: torch.device) -> str:
    """The :data:`CROSSOVER` arch key of ``device``: ``sm_90`` or ``sm_120`` by major version (9.x, 12.x), ``default``
    for any other GPU, ``interpreter`` for a non-CUDA device."""
    if device.type != "cuda":
        return "interpreter"
    major, _ = capability(_index(device))
    return f"sm_{major}0" if major in (9, 12) else "default"


def crossover_for(backend: str, device: torch.device) -> Crossover:
    """The crossover table of ``backend`` on ``device``: its arch's entry, else the backend's ``default`` one."""
    key = arch_key(device)
    return CROSSOVER.get((backend, key)) or CROSSOVER[(backend, "default")]


def forced() -> Optional[str]:
    """The path :func:`forced_path` forces in this thread, or None (the table decides)."""
    return _forced.path


@contextlib.contextmanager
def forced_path(path: Optional[str]) -> Iterator[None]:
    """Within this scope (this thread), ``draft_fc`` takes ``path`` where its launch contract
    allows (None: the table decides)."""
    if path is not None and path not in PATHS:
        raise ValueError(f"path must be one of {', '.join(PATHS)} or None, got {path!r}")
    previous = forced()
    _forced.path = path
    try:
        yield
    finally:
        _forced.path = previous


def choose(backend: str, device: torch.device, M: int) -> str:
    """The path ``backend`` takes for M output rows on ``device`` (the forced one if any)."""
    path = forced()
    if path is not None:
        return path
    return crossover_for(backend, device).path(M)


__all__ = ["CROSSOVER", "Crossover", "PATHS", "arch_key", "capability", "choose", "crossover_for", "forced",
           "forced_path"]
