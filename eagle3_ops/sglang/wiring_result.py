"""What every part of the live wiring check (wiring_check.py) shares: its switch (``EAGLE3_OPS_WIRING_CHECK``) and
log label, its one output (the verdict as JSON: :func:`result_path`, written by :func:`write_result`), and how a
failure is said: its cause in a line (:func:`cause_text`) and the advice for this check's own settings
(:func:`advice`, :func:`cache_write_failure`), never another feature's.

It imports no other wiring_* module.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Optional

from .. import qualify_cache, settings
from ..files import os_error_words, replace_atomically
from .dump_states import bug_note, cause, error_kind

log = logging.getLogger("eagle3_ops.sglang")

ENV_SWITCH = "EAGLE3_OPS_WIRING_CHECK"
LABEL = "live wiring check"
RECORD_TOKENS = 1024  # positions recorded at most: host memory = tokens x boundaries x H x dtype bytes


def enabled() -> bool:
    """Whether the live check is on (its setting; a bad value is one line, once, and the check off)."""
    return settings.switch_or_off(ENV_SWITCH, log)


def result_path(model_name: Optional[str] = None) -> Path:
    """Where the verdict is written as JSON: next to the qualification cache, one file per model class."""
    return qualify_cache.path().parent / (f"wiring_check-{model_name}.json" if model_name else "wiring_check.json")


def write_result(result: dict, model_name: Optional[str] = None, say: bool = True) -> Optional[str]:
    """Write the verdict as JSON (:func:`result_path`; atomically: two servers sharing the cache folder never
    leave half a file). Returns None when written, else why not (said in one line unless ``say`` is False)."""
    path = result_path(model_name)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(result, indent=1, default=str) + "\n"
        replace_atomically(path, lambda tmp: Path(tmp).write_text(text))
    except Exception as e:  # never stop SGLang
        why = cache_write_failure(path, e) if isinstance(e, OSError) else f"could not write {path}: {cause_text(e)}"
        if not isinstance(e, OSError):
            log.debug("eagle3_ops: %s: writing %s failed", LABEL, path, exc_info=e)
        if say:
            log.warning("eagle3_ops: %s: %s", LABEL, why)
        return why
    if say:
        log.info("eagle3_ops: %s: result written to %s", LABEL, path)
    return None


def cache_words() -> str:
    """Where the cache folder is, as a user would set it."""
    home = os.environ.get("XDG_CACHE_HOME")
    return f"XDG_CACHE_HOME={home}" if home else "~/.cache: XDG_CACHE_HOME unset"


def advice(kind: str, folder) -> str:
    """What a user of the live check can change when its recording or result does not fit (``kind``: "memory",
    "disk", "fsize", "permission", "other"): room on the cache's disk (``XDG_CACHE_HOME`` moves the cache
    folder), the server's file-size limit, a permission; or the check off (``EAGLE3_OPS_WIRING_CHECK=0``). Never
    another feature's settings."""
    off = f"{ENV_SWITCH}=0 turns the check off"
    cache = f"set XDG_CACHE_HOME to a folder on a disk with room (now {cache_words()})"
    if kind == "memory":
        return f"the live check records at most {RECORD_TOKENS} positions; {off}"
    if kind == "disk":
        return f"free space in {folder}, or {cache}, or {off}"
    if kind == "fsize":
        return f"raise the server's file-size limit (ulimit -f), or {off}"
    if kind == "permission":
        return (f"give the server's user write permission on {folder}, or set XDG_CACHE_HOME to a folder it can "
                f"write (now {cache_words()}), or {off}")
    return f"set XDG_CACHE_HOME to a usable folder (now {cache_words()}), or {off}"


def cache_write_failure(path: Path, e: OSError) -> str:
    """One clause for a file of the live check that could not be written: the path, the OS error's name and
    words, and the advice that fits it."""
    folder = Path(e.filename).parent if e.filename else Path(path).parent
    return f"could not write {path}: {os_error_words(e)}; {advice(error_kind(e), folder)}"


def cause_text(e: BaseException) -> str:
    """An exception as the cause in a line: an OS error by its errno's name and path, memory as memory, and
    anything else as what it is, a bug of eagle3_ops (its traceback at DEBUG level)."""
    return cause(e) + bug_note(e)
