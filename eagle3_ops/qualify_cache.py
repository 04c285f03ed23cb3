"""The qualification cache: one JSON file, ``$XDG_CACHE_HOME/eagle3_ops/qualify.json`` (default
``~/.cache``), of entries that are validated before use and written safely by many writers.

What it guarantees (what qualify.py and the plugin rely on):

* **read**: an entry is used only if it was made for exactly what is asked (``made_for``: the
  device, versions, shape, buckets, rules version ... compared in full, not only through the key's
  hash) and its value passes the caller's ``parse`` (the schema: types, ranges, consistency).
  Anything else (a file that is not a JSON object, an entry of the wrong type or with missing
  fields, another shape's plan under this key) is ignored with ONE warning line and the caller
  measures again. Nothing in the file can raise into the caller.
* **write**: read-modify-write under an exclusive ``fcntl.flock`` on ``qualify.json.lock`` (other
  processes and other threads: each writer opens the lock file itself), the new file written to a
  temporary file of its own (``mkstemp``) and renamed over the old one, so readers (who take no
  lock) see the old file or the new one, never half of one.
* **unusable location** (a file where the folder should be, no permission, a read-only or full
  disk, a cache path that is a directory or a FIFO): no caching, one warning line; qualification
  itself works as before.

Interface: ``load(made_for, parse) -> value or None`` and ``store(made_for, value) -> bool``;
``made_for`` is a JSON-able dict that names what the value is (``"what"``) and everything it
depends on. This module imports neither torch nor the rest of eagle3_ops (files.py aside).
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import stat
from pathlib import Path
from typing import Any, Callable, Optional, Tuple, TypeVar

from .files import replace_atomically

log = logging.getLogger("eagle3_ops")

FILE_LIMIT = 16 << 20   # bytes; a file of plans is kilobytes: a larger one is not ours and is not read
MAX_ENTRIES = 512       # the oldest entries go first (plans of old versions are never asked for again)

T = TypeVar("T")


class BadEntry(ValueError):
    """A cache entry that must not be used; the message says why."""


def path() -> Path:
    """The cache file: ``$XDG_CACHE_HOME/eagle3_ops/qualify.json`` (``~/.cache`` when unset or empty); read each
    call."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "eagle3_ops" / "qualify.json"


def _canonical(made_for: Any) -> str:
    return json.dumps(made_for, sort_keys=True, separators=(",", ":"), allow_nan=False)


def key(made_for: dict) -> str:
    """The entry key of ``made_for``: the first 24 hex digits of the SHA-256 of its canonical JSON (the entry's
    ``made_for`` is still compared in full on read)."""
    return hashlib.sha256(_canonical(made_for).encode()).hexdigest()[:24]


_noted: set = set()


def _note(message: str) -> None:
    """One warning line per distinct problem per process (two sites reading one broken file: one line)."""
    if message not in _noted:
        _noted.add(message)
        log.warning("eagle3_ops: %s", message)


def _read(p: Path) -> Tuple[str, Optional[dict]]:
    """("missing" | "ok" | "broken" | "unusable", data). broken: a regular file that does not hold
    a JSON object (may be overwritten); unusable: not a regular file, unreadable (never replaced)."""
    try:  # O_NONBLOCK: a FIFO planted at the path must not block the caller
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):  # nothing there (store() says why it cannot write)
        return "missing", None
    except OSError as e:
        _note(f"cannot read the qualification cache {p}: {(e.strerror or str(e)).lower()}; qualifying without it")
        return "unusable", None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            _note(f"the qualification cache {p} is not a regular file; qualifying without a cache")
            return "unusable", None
        if st.st_size > FILE_LIMIT:
            _note(f"the qualification cache {p} holds {st.st_size} bytes, more than a cache of plans can "
                  f"({FILE_LIMIT}); ignored and replaced")
            return "broken", None
        with os.fdopen(os.dup(fd), "rb") as f:
            raw = f.read(FILE_LIMIT + 1)
    except OSError as e:
        _note(f"cannot read the qualification cache {p}: {(e.strerror or str(e)).lower()}; qualifying without it")
        return "unusable", None
    finally:
        os.close(fd)
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as e:  # not UTF-8, not JSON, nested beyond the parser's depth
        _note(f"the qualification cache {p} is not valid JSON ({type(e).__name__}); ignored and replaced")
        return "broken", None
    if not isinstance(data, dict):
        _note(f"the qualification cache {p} holds a JSON {type(data).__name__}, not an object; ignored and replaced")
        return "broken", None
    return "ok", data


def load(made_for: dict, parse: Callable[[Any], T]) -> Optional[T]:
    """The value cached for ``made_for``, as ``parse(value)`` returns it, or None (nothing cached,
    or an entry that fails validation: one warning line). ``parse`` raises on a bad value (BadEntry
    with the reason; any other exception counts as a bad entry too)."""
    p = path()
    status, data = _read(p)
    if status != "ok":
        return None
    k = key(made_for)
    entry = data.get(k)
    if entry is None:
        return None
    try:
        if not isinstance(entry, dict) or set(entry) != {"made_for", "value"}:
            raise BadEntry("not an object with exactly 'made_for' and 'value'")
        try:
            same = _canonical(entry["made_for"]) == _canonical(made_for)
        except (TypeError, ValueError):  # NaN/inf or a non-JSON value
            same = False
        if not same:
            raise BadEntry("made for something else (another shape, device, version or rules)")
        return parse(entry["value"])
    except Exception as e:  # never a crash, never another shape's plan
        reason = str(e) if isinstance(e, BadEntry) else f"{type(e).__name__}: {e}"
        _note(f"the qualification cache {p}: entry {k} ({made_for.get('what', '?')}) ignored: {reason}; "
              f"measuring again")
        return None


def store(made_for: dict, value: Any) -> bool:
    """Cache ``value`` (JSON-able) for ``made_for``. Returns whether it was written (False: one
    warning line; the caller goes on uncached)."""
    p = path()
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        lock = os.open(p.with_name(p.name + ".lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:
        _note(f"cannot use the qualification cache folder {p.parent}: {(e.strerror or str(e)).lower()}; "
              f"qualification runs uncached")
        return False
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # held until the lock fd is closed
        status, data = _read(p)
        if status == "unusable":
            return False
        data = data or {}
        k = key(made_for)
        data.pop(k, None)  # re-inserted last: the newest entry
        data[k] = {"made_for": json.loads(_canonical(made_for)), "value": value}
        for old in list(data)[:max(len(data) - MAX_ENTRIES, 0)]:
            del data[old]
        text = json.dumps(data, indent=1, allow_nan=False)

        def write(tmp: str) -> None:
            with open(tmp, "w") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())

        replace_atomically(p, write)
        return True
    except (OSError, ValueError, TypeError) as e:  # a full or read-only disk, no locks (NFS), a value not JSON-able
        _note(f"could not write the qualification cache {p}: {(getattr(e, 'strerror', None) or str(e))}; "
              f"qualification runs uncached")
        return False
    finally:
        os.close(lock)
