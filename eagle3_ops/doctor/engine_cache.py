"""What the installed SGLang's own code says, derived once and kept: the doctor's rule table
(:func:`.sglang_code.sglang_table`: every registered class's capture rule, run on a stand-in; its EAGLE-3
heads) and SGLang's reading of each config it has parsed (``HfModelConfigParser`` and
``get_context_length``). Importing SGLang's model registry costs ~15 s of CPU and its config parser ~5 s;
a config check of a pair seen before reads these files instead, in well under a second.

Both are kept under ``$XDG_CACHE_HOME/eagle3_ops/engine/`` (default ``~/.cache``), in files named by
:func:`installed_key`: the installed SGLang's version, the size and modification time of every
``sglang/srt`` source file (a local edit of SGLang derives everything again) and the doctor's own
deriving code. Nothing here imports SGLang; a file that cannot be read or written is ignored (the doctor
then runs SGLang's code, as without a cache), never trusted half-written (files.replace_atomically).
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
from pathlib import Path
from typing import Optional

from .. import qualify_cache
from ..files import replace_atomically

MAX_CONFIGS = 256  # parsed configs kept per installed SGLang (the oldest go first)
_DERIVERS = ("sglang_code.py", "source_reader.py", "source_scan.py", "configs.py", "engine_cache.py")


def enabled() -> bool:
    """``EAGLE3_OPS_DOCTOR_KEEP`` (default on): off, SGLang's code runs every time and nothing is kept."""
    import logging

    from .. import settings

    try:
        return bool(settings.get("EAGLE3_OPS_DOCTOR_KEEP"))
    except settings.SettingError as e:  # a bad value: the safe side, SGLang's code every time
        settings.report_once(e, logging.getLogger("eagle3_ops"))
        return False


def folder() -> Path:
    """Where the kept files live: ``engine/`` next to the qualification cache (``$XDG_CACHE_HOME/eagle3_ops``)."""
    return qualify_cache.path().parent / "engine"


@functools.lru_cache(maxsize=None)
def installed_key() -> Optional[str]:
    """``sglang-VERSION-DIGEST`` of the installed SGLang, or None when none is installed (found without importing
    it: its distribution's version and its source files' sizes and modification times)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        v = version("sglang")
        spec = importlib.util.find_spec("sglang")
    except (PackageNotFoundError, ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    h = hashlib.sha256(v.encode())
    root = Path(list(spec.submodule_search_locations)[0])
    for d, dirs, files in sorted(os.walk(root / "srt")):
        dirs.sort()
        for f in sorted(files):
            if f.endswith(".py"):
                st = os.stat(os.path.join(d, f))
                h.update(f"{os.path.relpath(os.path.join(d, f), root)}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    here = Path(__file__).resolve().parent
    for name in _DERIVERS:
        h.update((here / name).read_bytes())
    return f"sglang-{v}-{h.hexdigest()[:16]}"


def _path(kind: str) -> Optional[Path]:
    if not enabled():
        return None
    key = installed_key()
    return None if key is None else folder() / f"{key}.{kind}.json"


def _read(kind: str) -> Optional[dict]:
    p = _path(kind)
    try:
        data = json.loads(p.read_text()) if p is not None and p.is_file() else None
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("key") == installed_key() else None


def _write(kind: str, data: dict) -> None:
    p = _path(kind)
    if p is None:
        return
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(dict(data, key=installed_key()), sort_keys=True)
        replace_atomically(p, lambda tmp: Path(tmp).write_text(text))
    except (OSError, TypeError, ValueError):  # a read-only home, a full disk: the next run derives it again
        pass


# ---- the rule table --------------------------------------------------------------------------------------
def table() -> Optional[dict]:
    """The table derived from the installed SGLang by an earlier run, or None."""
    return _kept_table(str(_path("table"))) if enabled() else None


@functools.lru_cache(maxsize=4)
def _kept_table(_where: str) -> Optional[dict]:  # read once per process and place (the same run asks often)
    data = _read("table")
    return data.get("table") if data is not None and isinstance(data.get("table"), dict) else None


def keep_table() -> None:
    """Derive the table from the installed SGLang (its registry is imported already when this is called after a
    live run: ~2 s more) and keep it for the next runs."""
    if not enabled() or installed_key() is None or table() is not None:
        return
    from . import sglang_code

    _write("table", {"table": json.loads(json.dumps(sglang_code.sglang_table()))})
    _kept_table.cache_clear()


def table_path() -> Optional[Path]:
    """The file that keeps the rule table for the installed SGLang, or None (keeping off, or no SGLang installed); it
    may not exist yet."""
    return _path("table")


# ---- SGLang's reading of a config ------------------------------------------------------------------------
def _config_key(cfg: dict) -> str:
    return hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode()).hexdigest()[:32]


def parsed(cfg: dict) -> Optional[dict]:
    """What SGLang's parser made of ``cfg`` in an earlier run: {"obj", "text" (dicts; text None = obj), "reader",
    "context_length"} or {"error": "TypeName: message"}; None when not seen."""
    data = _read("configs")
    entry = (data or {}).get("configs", {}).get(_config_key(cfg))
    return entry if isinstance(entry, dict) else None


def remember(cfg: dict, entry: dict) -> None:
    """Keeps ``entry`` (what SGLang's parser made of ``cfg``, or its error) for the next runs, newest last, at most
    :data:`MAX_CONFIGS`; a file that cannot be written is ignored."""
    data = _read("configs") or {}
    configs = dict(data.get("configs") or {})
    configs.pop(_config_key(cfg), None)
    configs[_config_key(cfg)] = entry  # newest last; the oldest go first past MAX_CONFIGS
    while len(configs) > MAX_CONFIGS:
        configs.pop(next(iter(configs)))
    _write("configs", {"configs": configs})


# what the doctor reads of a config object by name (getattr): kept as the object answers, aliases included
READ_BY_NAME = ("model_type", "num_hidden_layers", "hidden_size", "vocab_size", "tie_word_embeddings",
                "max_position_embeddings", "rope_scaling", "architectures", "draft_vocab_size")


def attributes(obj) -> dict:
    """A config object's attributes as getattr answers them: ``to_dict()`` (which writes the class's model_type
    over the instance's), then the instance's model_type, every ``attribute_map`` alias and :data:`READ_BY_NAME`."""
    out = obj.to_dict() if hasattr(obj, "to_dict") else dict(vars(obj))
    names = list(READ_BY_NAME) + list(getattr(obj, "attribute_map", None) or {})
    for name in names:
        try:
            out[name] = getattr(obj, name)
        except AttributeError:
            out.pop(name, None)  # the object has none: neither has the kept one
    return json.loads(json.dumps(out, default=str))


class KeptConfig:
    """A config SGLang parsed in an earlier run, rebuilt from its ``to_dict()``: its attributes, as the doctor
    reads them (getattr; a missing one is AttributeError, as on SGLang's config object)."""

    def __init__(self, values: dict, class_name: str):
        self.__dict__.update(values)
        self._class_name = class_name

    def to_dict(self) -> dict:
        """The kept attributes as a dict (as the config object's ``to_dict()`` gave them)."""
        return {k: v for k, v in self.__dict__.items() if k != "_class_name"}

    def __repr__(self) -> str:
        return f"<{self._class_name} kept from SGLang's parse>"
