"""The live check's folder for one recording (the states, the target's config, the draft snapshot): made fresh
beside the qualification cache, else in the system's temporary folder (saying why), claimed by this process, and
the older recordings of the same model pruned, never one that another server sharing the cache still uses."""
from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import Optional, Tuple

from ..files import os_error_words
from .wiring_result import result_path

KEEP_RECORDINGS = 3  # per model, the newest recordings kept for the offline command
OWNER_FILE = "owner.json"


def make_workdir(model_name: str, busy_s: float) -> Tuple[Path, Optional[str]]:
    """(a fresh folder for the recording, the target's config and the draft snapshot, why it is not in the
    cache folder or None). Beside the qualification cache (the states file stays there for the offline replay);
    the system's temporary folder where the cache folder cannot be used (the note names the OS error). The
    folder records its owner (this process), so another server sharing the cache never prunes it while this one
    runs; ``busy_s``: how long after its last change a folder of a server on another host is left alone (see
    :func:`prune`). Raises OSError where no folder can be made at all."""
    base = result_path().parent / "wiring"
    try:
        base.mkdir(parents=True, exist_ok=True)
        prune(base, model_name, busy_s)
        d = Path(tempfile.mkdtemp(prefix=f"{model_name}-{time.strftime('%Y%m%d-%H%M%S')}-", dir=base))
        note = None
    except OSError as e:
        where = f" ({e.filename})" if e.filename and str(e.filename) != str(base) else ""
        note = (f"the cache folder {base} cannot be used: {os_error_words(e)}{where}; XDG_CACHE_HOME moves it")
        d = Path(tempfile.mkdtemp(prefix="eagle3_ops-wiring-"))
    claim(d)
    return d, note


def claim(d: Path) -> None:
    """Mark ``d`` as this process's (pid, host): :func:`prune` of another server leaves it alone while it runs."""
    try:
        (d / OWNER_FILE).write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
    except OSError:  # a full disk: the recording's own write says so
        pass


def in_use(d: Path) -> bool:
    """Whether ``d``'s owner (:func:`claim`) is a live process on this host."""
    try:
        owner = json.loads((d / OWNER_FILE).read_text())
        pid, host = int(owner["pid"]), str(owner["host"])
    except (OSError, ValueError, KeyError, TypeError):
        return False
    if host != socket.gethostname():
        return False  # another machine sharing the cache: only the age tells
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: alive, another user's
        return True
    return True


def prune(base: Path, model_name: str, busy_s: float) -> None:
    """Keep the newest KEEP_RECORDINGS - 1 earlier recordings of this model (each server start makes one),
    never one whose server still runs on this host (another server sharing the cache folder may be using it)
    nor one touched within the last ``busy_s`` seconds (a server on another host: the live check passes twice
    the replay's time bound). A folder that vanishes meanwhile (another server pruning too) is skipped."""
    recent = time.time() - busy_s
    found = []
    for d in base.glob(f"{model_name}-*"):
        try:
            if d.is_dir() and not d.is_symlink():
                found.append((d.stat().st_mtime, d))
        except OSError:
            continue
    old = [d for _, d in sorted(found, key=lambda x: x[0])]
    for d in old[:max(0, len(old) - (KEEP_RECORDINGS - 1))]:
        try:
            if d.stat().st_mtime < recent and not in_use(d):
                shutil.rmtree(d, ignore_errors=True)
        except OSError:
            continue
