"""What every ``python -m eagle3_ops`` command shares: its exit statuses, and how a closed pipe, an
interrupt and a resource failure end it (quietly or with one line; never a traceback).

Exit statuses (docs/cli.md, *Command line*):

==== ==========================================================================================
0    done
1    ``doctor``: at least one error finding
2    bad usage (unknown flag, bad value: argparse's usage and the error) or unreadable input
3    a resource failure: out of memory (host or device), or a file could not be written (disk
     full, quota, file too large, I/O error); one line saying which
130  interrupted (Ctrl-C)
141  stdout was closed by its reader (``| head``): the command stops, quietly (128 + SIGPIPE,
     what the shell reports for a program that SIGPIPE ended)
==== ==========================================================================================
"""
from __future__ import annotations

import errno
import os
import sys
from typing import Callable, List, Optional

EXIT_OK = 0
EXIT_FINDINGS = 1
EXIT_USAGE = 2
EXIT_RESOURCE = 3
EXIT_INTERRUPTED = 130
EXIT_CLOSED_PIPE = 141

_DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO)


def quote_error(e: BaseException, limit: int = 300, whole: bool = False) -> str:
    """``e``'s first line (``whole``: all its lines, joined), for quoting inside a sentence: whole when it fits in
    ``limit`` characters, else cut at its last sentence end, or else its last word, within them, and marked (never
    mid-word)."""
    text = " ".join(str(e).split()) if whole else (str(e).strip().splitlines() or [""])[0].strip()
    first = text or type(e).__name__
    if len(first) <= limit:
        return first
    head = first[:limit]
    end = head.rfind(". ")
    if end >= limit // 3:
        return head[:end + 1] + " [...]"
    return head[:head.rfind(" ")].rstrip(" ,;:") + " [...]" if " " in head else head + " [...]"


def resource_failure(e: BaseException) -> Optional[str]:
    """One line naming the resource that ran out, if ``e`` is a resource failure, else None."""
    first = quote_error(e)
    if isinstance(e, MemoryError):
        return f"out of host memory ({first})"
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(e, getattr(torch, "OutOfMemoryError", ())):
        return f"out of device memory: {first}"
    if isinstance(e, RuntimeError) and ("can't allocate memory" in first or "out of memory" in first.lower()):
        return f"out of memory: {first}"
    if isinstance(e, OSError) and e.errno in _DISK_ERRNOS:
        where = f" {e.filename}" if e.filename else ""
        return f"could not write{where}: {e.strerror or first}"
    return None


def _stdout_to_devnull() -> None:
    """After the reader of stdout went away: what is still buffered (and the interpreter's flush
    at exit) goes to /dev/null instead of raising again."""
    try:
        fd = os.open(os.devnull, os.O_WRONLY)
        os.dup2(fd, sys.stdout.fileno())
        os.close(fd)
    except (OSError, ValueError):  # stdout is not a file (tests' StringIO)
        pass


def say(message: str) -> None:
    """``message`` on stderr (a closed stderr is not an error of its own)."""
    try:
        print(message, file=sys.stderr)
    except (BrokenPipeError, ValueError):
        pass


def run(command: Callable[[List[str]], int], argv: List[str]) -> int:
    """``command(argv)``'s exit status, with stdout flushed inside (a closed pipe is seen here, not
    at interpreter exit); see the module docstring for the rest."""
    try:
        try:
            status = command(argv)
        except SystemExit as e:  # argparse: --help (0), a usage error (2; it printed the usage)
            if isinstance(e.code, str):
                say(e.code)
            status = e.code if isinstance(e.code, int) else (0 if e.code is None else EXIT_USAGE)
        sys.stdout.flush()
        return status
    except BrokenPipeError:
        _stdout_to_devnull()
        return EXIT_CLOSED_PIPE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except Exception as e:
        why = resource_failure(e)
        if why is None:
            raise
        say(f"error: {why}")
        return EXIT_RESOURCE
