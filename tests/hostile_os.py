"""Real OS conditions for the hostile-input tests: a folder the process cannot list (also as root), a
file-size limit, a full disk at the call where eagle3_ops writes, and the log checks every such test makes.

- :func:`permission_bits_apply`: root reads anything, whatever the permission bits say, because of its
  capabilities CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH. As root, this drops those two from the *effective*
  set of the calling thread only (capset(2); they stay permitted and are restored on exit), so the kernel
  checks the bits for this thread as for any user: a real EACCES, not a stand-in. Another user: the bits
  already apply. Where neither is possible the test is skipped, never passed without its condition.
- :func:`file_size_limit`: RLIMIT_FSIZE (``ulimit -f``) on this process, soft limit only, restored on exit;
  Python ignores SIGXFSZ, so a write past it fails with EFBIG, as in a server started under that limit.
- :func:`disk_full_at_save`: the STATES writers write through ``safetensors.torch.save_file``; a disk that
  fills up makes it raise what safetensors raises then (``SafetensorError("... (os error 28)")``, seen on a
  full tmpfs), after writing part of the file.
"""
from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import resource

import pytest

_CAP_VERSION_3 = 0x20080522
_DAC = (1 << 1) | (1 << 2)  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH


class _Header(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _Data(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


@contextlib.contextmanager
def permission_bits_apply():
    """Inside: permission bits stop this thread's reads and listings, also as root (see the module doc)."""
    if os.geteuid() != 0:
        yield "not root: the permission bits apply"
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        header, data = _Header(_CAP_VERSION_3, 0), (_Data * 2)()
        if libc.capget(ctypes.byref(header), data) != 0:
            raise OSError(ctypes.get_errno(), "capget")
    except (OSError, AttributeError) as e:
        pytest.skip(f"root, and its capabilities cannot be read to drop CAP_DAC_OVERRIDE ({e})")
    saved = data[0].effective
    data[0].effective &= ~_DAC
    if libc.capset(ctypes.byref(header), data) != 0:
        pytest.skip(f"root, and CAP_DAC_OVERRIDE cannot be dropped (capset: errno {ctypes.get_errno()})")
    try:
        yield "root without CAP_DAC_OVERRIDE/CAP_DAC_READ_SEARCH on this thread"
    finally:
        data[0].effective = saved
        assert libc.capset(ctypes.byref(header), data) == 0, "could not restore the capabilities"


@contextlib.contextmanager
def file_size_limit(nbytes: int):
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(nbytes), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def disk_full_at_save(monkeypatch, written: list = None):
    """safetensors' writer, on a disk that fills up: part of the file, then its own error (errno 28)."""
    import safetensors.torch
    from safetensors import SafetensorError

    def full_disk(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"\0" * 4096)
        if written is not None:
            written.append(filename)
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)


def lines(caplog, needle: str = "", level: int = logging.INFO):
    return [r.getMessage() for r in caplog.records if needle in r.getMessage() and r.levelno >= level]


def assert_no_traceback(caplog) -> None:
    """No record at INFO or above carries a traceback (a real bug's goes to DEBUG only)."""
    shown = [r for r in caplog.records if r.levelno >= logging.INFO and (r.exc_info or r.stack_info)]
    assert not shown, [r.getMessage() for r in shown]
    assert "Traceback" not in "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.INFO)
