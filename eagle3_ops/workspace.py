"""Scratch memory of the ops: caller-owned, or the face's grow-only buffer per (device, stream).

``draft_fc`` needs temporary memory on some paths (split-K partials, per-row norm scales, a
prepared GEMM input, unit-stride copies of strided 1-D arguments). Its backends take ONE uint8
workspace tensor and carve their regions from it (:class:`Carver`); the size a call needs is a
pure function of its shapes and the path (``draft_fc_workspace_bytes`` of the backend). Who owns it:

* the caller, passing ``workspace=`` (the SGLang plugin allocates its own with the capture buffer,
  outside any CUDA-graph memory pool, sized for its largest M);
* otherwise the Python face, with :func:`scratch`: one grow-only buffer per (device, stream), so
  two streams (or two threads on their own streams) never share scratch. Calls on ONE stream are
  ordered by that stream; two threads issuing on the same stream at once would race on the
  buffer as they would on any shared output, which is the caller's business.

Growth policy (:func:`scratch`): the first call for a (device, stream) allocates; later calls that
need the same or fewer bytes get the same buffer; a call that needs more replaces it with one at
least 1.25x larger. After one warm-up call with the largest problem nothing is allocated.
**Growth while the stream captures a CUDA graph is allowed**: the new buffer comes from the
graph's private pool, and every buffer handed out during a capture (and one replaced during a
capture) is never freed afterwards: it moves to a retired list that lives as long as the process
(or until :func:`clear`), so a replay never writes into memory the allocator gave to someone else.
A buffer no capture has seen is freed on growth; ``record_stream`` keeps the allocator from reusing
it before the kernels already queued on its stream are done. On the CPU (the Triton interpreter)
kernels run synchronously in the calling thread, so there the key is (device, thread).
"""
from __future__ import annotations

import threading
from typing import Dict, List, Optional, Tuple

import torch

GRANULE = 512  # bytes; sizes are rounded up to this (the CUDA caching allocator's own unit)
GROWTH = 1.25  # a growing buffer gets at least this factor more bytes
ALIGN = 256    # bytes; every carved region starts on this boundary (16-byte vector loads need 16)


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of ``ALIGN`` (256): the bytes one carved region occupies."""
    return -(-int(nbytes) // ALIGN) * ALIGN


class Carver:
    """Hands out consecutive, ``ALIGN``-aligned regions of one uint8 workspace."""

    def __init__(self, workspace: Optional[torch.Tensor]):
        self.workspace = workspace
        self.offset = 0

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The next region of ``numel`` elements of ``dtype``, a view into the workspace starting on an ``ALIGN``
        boundary; raises ValueError when the workspace is missing or too small."""
        nbytes = aligned(numel * dtype.itemsize)
        ws = self.workspace
        if ws is None or self.offset + nbytes > ws.numel():
            have = 0 if ws is None else ws.numel()
            raise ValueError(f"workspace too small: needs at least {self.offset + nbytes} bytes, has {have}")
        region = ws[self.offset:self.offset + numel * dtype.itemsize].view(dtype)
        self.offset += nbytes
        return region


class _Entry:
    __slots__ = ("buf", "captured")

    def __init__(self, buf: torch.Tensor):
        self.buf = buf  # uint8 [capacity]
        self.captured = False  # handed out while a CUDA graph was being captured


_entries: Dict[Tuple[torch.device, int], _Entry] = {}
_retired: List[torch.Tensor] = []
_lock = threading.Lock()
allocations = 0  # buffers allocated so far (tests read it)


def _stream_key(device: torch.device) -> Tuple[torch.device, int]:
    if device.type == "cuda":
        return device, int(torch.cuda.current_stream(device).stream_id)
    # CPU (the Triton interpreter, tests): kernels run synchronously in the calling thread, so each
    # thread is its own "stream"
    return device, threading.get_ident()


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def scratch(device: torch.device, nbytes: int) -> torch.Tensor:
    """A uint8 tensor of at least ``nbytes`` (uninitialized): the scratch of the current stream
    of ``device``. Valid until the next ``scratch`` call on that stream: the caller's kernels
    must be queued before it."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = _stream_key(device)
    capturing = _capturing(device)
    entry = _entries.get(key)
    if entry is None or entry.buf.numel() < nbytes:
        entry = _grow(key, max(int(nbytes), 1), capturing)
    if capturing:
        entry.captured = True
    return entry.buf


def _grow(key, nbytes: int, capturing: bool) -> _Entry:
    global allocations
    device = key[0]
    with _lock:
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


def buffer(device: torch.device) -> Optional[torch.Tensor]:
    """The current scratch of ``device`` for the calling stream (CPU: thread), or None (tests)."""
    entry = _entries.get(_stream_key(torch.device(device)))
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


__all__ = ["ALIGN", "Carver", "GRANULE", "GROWTH", "aligned", "buffer", "clear", "retired", "scratch"]
