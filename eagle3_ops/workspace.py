"""Grow-only scratch memory for the Python (Triton) backends, one buffer per (device, kind).

DESIGN.md §4: the ``_out`` ops do not allocate (CUDA-graph friendly). Kernels that need temporary
memory (split-K partials, per-row norm scales, a prepared GEMM input, unit-stride copies of strided
1-D arguments) take it from here: the first call for a (device, kind) allocates, later calls that
need the same or fewer bytes get a view of the same buffer, a call that needs more replaces it
with a larger one (at least 1.25x the old size, so a slowly rising M grows it a few times, not on
every call). After one warm-up call with the largest problem, calls allocate nothing.
The compiled CUDA backend keeps the same policy in C++ (csrc/draft_fc.cu).

Rules that follow from sharing one buffer per device and kind:

* Calls that use the same kind must be stream-ordered: all draft_fc calls on one stream (as SGLang
  runs them), or streams synchronized with each other. Two draft_fc calls running concurrently on
  two streams of one device would share the scratch and race.
* **Growth while the current stream captures a CUDA graph is allowed** (it is legal): the new
  buffer then comes from the graph's private memory pool. Every buffer handed out while a capture
  was running (and a buffer replaced during a capture) is never freed afterwards: the graph keeps
  its address, so on a later growth it moves to a retired list that lives as long as the process
  (or until :func:`clear`). A replay can therefore never write into memory the allocator has
  handed to someone else. Warm up eagerly with the largest M before capturing (SGLang does) and
  nothing is allocated in the graph pool and nothing is retired.
* A buffer that no capture has seen is freed on growth; ``record_stream`` on the current stream
  keeps the allocator from reusing it before the kernels already queued on that stream are done.

Thread safety: lookups are plain dict reads (atomic under the GIL); growth takes a lock.
"""
from __future__ import annotations

import threading
from typing import Dict, List, Optional, Tuple

import torch

GRANULE = 512  # bytes; sizes are rounded up to this (the CUDA caching allocator's own unit)
GROWTH = 1.25  # a growing buffer gets at least this factor more bytes


class _Entry:
    __slots__ = ("buf", "captured")

    def __init__(self, buf: torch.Tensor):
        self.buf = buf  # uint8 [capacity]
        self.captured = False  # handed out while a CUDA graph was being captured


_entries: Dict[Tuple[torch.device, str], _Entry] = {}
_retired: List[torch.Tensor] = []
_lock = threading.Lock()
allocations = 0  # buffers allocated so far (tests read it)


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def get(device: torch.device, kind: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D ``dtype`` tensor of ``numel`` elements (uninitialized) at the start of the scratch
    buffer of (``device``, ``kind``). Valid until the next ``get`` of the same kind on the same
    device: the caller's kernels must be queued before that."""
    nbytes = numel * dtype.itemsize
    capturing = _capturing(device)
    entry = _entries.get((device, kind))
    if entry is None or entry.buf.numel() < nbytes:
        entry = _grow(device, kind, nbytes, capturing)
    if capturing:
        entry.captured = True
    return entry.buf[:nbytes].view(dtype)


def _grow(device: torch.device, kind: str, nbytes: int, capturing: bool) -> _Entry:
    global allocations
    with _lock:
        key = (device, kind)
        old = _entries.get(key)
        if old is not None and old.buf.numel() >= nbytes:  # another thread grew it meanwhile
            return old
        size = nbytes if old is None else max(nbytes, int(old.buf.numel() * GROWTH))
        size = max(GRANULE, -(-size // GRANULE) * GRANULE)
        entry = _Entry(torch.empty(size, dtype=torch.uint8, device=device))
        allocations += 1
        if old is not None:
            if old.captured or capturing:
                _retired.append(old.buf)  # a captured graph may replay into it: keep it forever
            elif device.type == "cuda":
                old.buf.record_stream(torch.cuda.current_stream(device))
        _entries[key] = entry
        return entry


def buffer(device: torch.device, kind: str) -> Optional[torch.Tensor]:
    """The current uint8 buffer of (device, kind), or None (introspection for tests)."""
    entry = _entries.get((torch.device(device), kind))
    return entry.buf if entry is not None else None


def retired() -> List[torch.Tensor]:
    """Buffers replaced after a CUDA graph captured them (kept alive; see the module doc)."""
    return list(_retired)


def clear() -> None:
    """Drop every buffer, retired ones included. Only safe when no CUDA graph captured with them
    will be replayed again (tests; or after the application destroyed its graphs)."""
    with _lock:
        _entries.clear()
        _retired.clear()


__all__ = ["GRANULE", "GROWTH", "buffer", "clear", "get", "retired"]
