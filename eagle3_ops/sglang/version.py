"""Which SGLang this plugin knows, and the on/off switch.

The hooks reach into SGLang internals (the aux-hidden-state accumulators, the layer-boundary norm
call, the llama_eagle3 draft forward), so they are pinned to the SGLang releases whose code was
read and tested. Any other version gets one warning and SGLang is left exactly as it is.
"""
from __future__ import annotations

import os
from typing import Optional, Tuple

SUPPORTED_SGLANG_VERSIONS = ("0.5.23",)

ENV_SWITCH = "EAGLE3_OPS_SGLANG"            # "0" / "false" / "off" / "no": the plugin does nothing
ENV_MAX_TOKENS = "EAGLE3_OPS_SGLANG_MAX_TOKENS"  # rows of the persistent capture buffer (optional)

_OFF_VALUES = {"0", "false", "off", "no", "disable", "disabled"}


def plugin_enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in _OFF_VALUES


def installed_sglang_version() -> Optional[str]:
    """The installed SGLang distribution's version, read from its metadata (no sglang import)."""
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:  # pragma: no cover - Python < 3.8
        return None
    try:
        return version("sglang")
    except PackageNotFoundError:
        return None


def check_sglang_version(found: Optional[str] = None) -> Tuple[bool, str]:
    """(supported, reason). ``found`` overrides the installed version (for tests)."""
    found = installed_sglang_version() if found is None else found
    if found is None:
        return False, "SGLang is not installed"
    base = found.split("+", 1)[0]
    if base not in SUPPORTED_SGLANG_VERSIONS:
        return False, (f"SGLang {found} is not a supported version "
                       f"(supported: {', '.join(SUPPORTED_SGLANG_VERSIONS)})")
    return True, f"SGLang {found}"
