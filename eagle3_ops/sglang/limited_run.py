"""Run a Python module as ``python -m MODULE ARG ...`` would, in this process, after setting its limits: niceness
(+19 by default), an address-space limit (``RLIMIT_AS``), a CPU-time limit (``RLIMIT_CPU``), and death with its
parent (``PR_SET_PDEATHSIG``: SIGKILL when the process that started it ends). The live wiring check starts its
background replay with it (wiring_replay_process.limited)::

    python -m eagle3_ops.sglang.limited_run --address-space BYTES --cpu-seconds S -- MODULE [ARG ...]

The child sets its own limits rather than the server using ``subprocess.Popen(preexec_fn=...)``: that would fork()
the whole threaded scheduler process instead of spawning, and is unsafe with threads. A limit the system refuses
(or a niceness it does not allow) is left as it is. The module's exit status is this process's.

Only the standard library is imported before the limits are set. The live check runs this file by its path
(:data:`PATH`), not with ``-m``, so that not even the eagle3_ops package (torch) loads before them: Python's
``-m`` would import the package first. Keep this module free of eagle3_ops imports.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import resource
import runpy
import signal
import sys
from typing import List, Optional

PATH = os.path.abspath(__file__)  # run as ``python PATH ...`` (see above)
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def set_limits(address_space: Optional[int], cpu_seconds: Optional[int], nice: int = 19) -> None:
    """This process's limits (None: that one left as it is); whatever the system refuses is left as it is."""
    try:
        os.nice(nice)
    except OSError:
        pass
    for name, value in (("RLIMIT_AS", address_space), ("RLIMIT_CPU", cpu_seconds)):
        if value is None:
            continue
        try:
            resource.setrlimit(getattr(resource, name), (value, value))
        except (ValueError, OSError):
            pass
    try:  # the child ends with its parent (the server)
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except Exception:  # noqa: BLE001 - not Linux, or no prctl: the time limits still end it
        pass


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m eagle3_ops.sglang.limited_run",
        usage="%(prog)s [--address-space BYTES] [--cpu-seconds S] [--nice N] -- MODULE [ARG ...]",
        description="Run python -m MODULE ARG ... in this process at a lower priority, under an address-space and "
                    "a CPU-time limit, killed when its parent ends (the live wiring check's replay child).")
    p.add_argument("--address-space", type=int, metavar="BYTES", help="RLIMIT_AS, soft and hard (default: unchanged)")
    p.add_argument("--cpu-seconds", type=int, metavar="S", help="RLIMIT_CPU, soft and hard (default: unchanged)")
    p.add_argument("--nice", type=int, default=19, metavar="N", help="niceness increment (default: 19)")
    return p


def main(argv: Optional[List[str]] = None) -> None:
    """``limited_run.py [limits] -- MODULE ARGS...``: set the limits, then run MODULE as ``python -m`` would."""
    argv = list(sys.argv[1:] if argv is None else argv)
    own, command = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = _parser()
    args = parser.parse_args(own)
    if not command:
        parser.error("name the module to run after --")
    set_limits(args.address_space, args.cpu_seconds, args.nice)
    if sys.path and os.path.abspath(sys.path[0] or os.curdir) == os.path.dirname(PATH):
        sys.path[0] = ""  # run by its path: import from the current folder, as python -c / -m do, not from ours
    sys.argv = list(command)
    runpy.run_module(command[0], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
