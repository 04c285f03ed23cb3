"""The live check's background replay as a process: the doctor's command on the recording
(:func:`replay_command`), the address space it may use (:func:`memory_limit`), the limits it runs under
(:func:`limited`: nice 19, an address-space and a CPU-time limit, killed if the server dies; set by limited_run.py),
its environment (:func:`child_env`: :data:`THREADS` threads, no GPU, the live check off), and running it within a
wall-clock bound to the doctor's JSON report or why there is none (:func:`run`)."""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

from .._cli import EXIT_FINDINGS, EXIT_OK
from ..doctor.configs import checkpoint_files, snapshot_bytes
from ..doctor.rules import sglang_mode
from ..files import os_error_words
from .limited_run import PATH as LIMITED_RUN
from .wiring_result import ENV_SWITCH

THREADS = 2  # the replay's CPU threads


def replay_command(draft_dir: Path, states: Path, target_dir: Path, tp_size: int,
                   snapshot: Optional[Path] = None, draft_steps: int = 1) -> List[str]:
    """``python -m eagle3_ops doctor --replay`` on ``states`` with the target's config in ``target_dir`` (JSON out);
    ``snapshot``: the draft as read at start-up (``--draft-snapshot``), else the draft as it is on disk;
    ``draft_steps`` > 1: also the served wiring's later draft steps (``--replay-steps``, the server's own
    ``--speculative-num-steps``), which the speculation report compares with what the server accepts."""
    code = "table" if sglang_mode("auto")[0] else "installed"
    return [sys.executable, "-m", "eagle3_ops", "doctor", "--draft", str(draft_dir), "--target",
            str(target_dir), "--replay", str(states), "--json", "--engine-code", code,
            *(["--tp", str(tp_size)] if tp_size > 1 else []),
            *(["--draft-snapshot", str(snapshot)] if snapshot is not None else []),
            *(["--replay-steps", str(draft_steps)] if draft_steps > 1 else [])]


def as_typed(cmd: List[str]) -> List[str]:
    """A replay command as a user types it (``python``, without --json)."""
    return ["python", *[c for c in cmd[1:] if c != "--json"]]


def shell(cmd: List[str]) -> str:
    """``cmd`` as one line a user can paste into a POSIX shell."""
    return " ".join(shlex.quote(c) for c in cmd)


def memory_limit(states: Path, draft_dir: Path, snapshot: Optional[dict] = None) -> int:
    """Address space for the replay process: torch itself, the draft tensors it loads (at most the checkpoint's
    weight files: those of ``snapshot``, as fixed at start-up, else the folder's), the states, and room to
    compute."""
    if snapshot is not None:
        draft_bytes = snapshot_bytes(snapshot)
    else:
        draft_bytes = 0
        try:
            for f in checkpoint_files(draft_dir).files:
                draft_bytes += os.stat(f).st_size
        except Exception:  # noqa: BLE001 - the replay reports an unreadable checkpoint itself
            pass
    return int(8 * 2**30 + 3 * draft_bytes + 3 * states.stat().st_size)


def child_env(threads: int = THREADS) -> Dict[str, str]:
    """The replay child's environment: this one with ``threads`` math threads, no GPU, and the live check off."""
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = str(threads)
    env["CUDA_VISIBLE_DEVICES"] = ""  # the replay runs on the CPU: it never touches the server's GPUs
    env[ENV_SWITCH] = "0"
    return env


def limited(cmd: List[str], address_space: int, cpu_seconds: int) -> List[str]:
    """``cmd`` (``[python, "-m", module, *args]``) run at nice 19 under an address-space and a CPU-time
    limit, killed if the server dies (limited_run.py, started by its path: nothing but the standard library
    loads before the limits)."""
    assert cmd[1] == "-m", cmd
    return [cmd[0], LIMITED_RUN, "--address-space", str(int(address_space)), "--cpu-seconds", str(int(cpu_seconds)),
            "--", *cmd[2:]]


def parse_report(out: bytes) -> Optional[dict]:
    """The doctor's JSON report from its stdout (whatever precedes the first ``{`` skipped), or None."""
    text = out.decode(errors="replace").strip()
    if not text:
        return None
    try:
        data = json.loads(text)
    except ValueError:
        start = text.find("{")
        try:
            data = json.loads(text[start:]) if start >= 0 else None
        except ValueError:
            return None
    return data if isinstance(data, dict) else None


@dataclass
class ReplayRun:
    """How the replay process ended: its report, or why there is none."""
    report: Optional[dict]       # the doctor's JSON report (it exited 0 or 1), else None
    failure: Optional[str]       # where no report: why, in a clause (the offline command where it helps)
    returncode: Optional[int]    # None: it did not start, or was killed at the time bound
    seconds: float


def run(cmd: List[str], *, address_space: int, time_limit_s: float, threads: int, offline: str) -> ReplayRun:
    """Run the replay ``cmd`` (:func:`replay_command`) under :func:`limited` (CPU time: ``time_limit_s`` x
    ``threads`` + 60 s) and :func:`child_env`, killed after ``time_limit_s`` seconds. ``offline``: the command to
    name where it could not finish."""
    t0 = time.monotonic()
    try:
        proc = subprocess.Popen(limited(cmd, address_space, time_limit_s * threads + 60), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env=child_env(threads))
    except OSError as e:  # EAGAIN (a process limit), ENOMEM
        return ReplayRun(None, f"the replay process could not be started: {os_error_words(e)}; check offline: "
                               f"{offline}", None, time.monotonic() - t0)
    try:
        out, err = proc.communicate(timeout=time_limit_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return ReplayRun(None, f"the replay did not finish in {time_limit_s} s (the time bound); check offline: "
                               f"{offline}", None, time.monotonic() - t0)
    seconds = time.monotonic() - t0
    report = parse_report(out)
    if proc.returncode in (EXIT_OK, EXIT_FINDINGS) and report is not None:
        return ReplayRun(report, None, proc.returncode, seconds)
    lines = [ln.strip() for ln in err.decode(errors="replace").strip().splitlines() if ln.strip()]
    return ReplayRun(None, f"the replay stopped (exit {proc.returncode}): {lines[-1] if lines else 'no message'}",
                     proc.returncode, seconds)
