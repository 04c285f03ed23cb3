"""Pinned engine tables: what each engine's own code says about EAGLE-3, per target class.

Each ``<engine>-<version>.json`` is written by the maintainer tool ``python -m tools.engine_tables`` (a
source checkout's, not shipped) from the engine's code (the installed SGLang, the vLLM wheel) and never
edited by hand; ``tests/doctor/test_engine_tables.py`` checks the SGLang table against the installed SGLang.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
# TensorRT-LLM: the version its engine-wide rules (engines.py) were read for; it has no per-class table
PINNED = {"sglang": "0.5.23", "vllm": "0.33.0", "trtllm": "1.2.1"}
TABLES = ("sglang", "vllm")  # the engines with a generated table (tools/engine_tables.py)


def table_path(engine: str, version: Optional[str] = None) -> Path:
    """The path of ``engine``'s pinned table for ``version`` (default: the pinned version, :data:`PINNED`); the file may
    not exist."""
    return HERE / f"{engine}-{version or PINNED[engine]}.json"


@functools.lru_cache(maxsize=None)
def load(engine: str, version: Optional[str] = None) -> Optional[dict]:
    """The pinned table of ``engine`` (None when this package has none for it)."""
    p = table_path(engine, version)
    if not p.is_file():
        return None
    return json.loads(p.read_text())


def dumps(table: dict) -> str:
    """The committed form (stable key order, one diff line per fact)."""
    return json.dumps(table, indent=1, sort_keys=True) + "\n"
