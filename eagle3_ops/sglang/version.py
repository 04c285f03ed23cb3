"""Which SGLang this plugin knows, and the on/off switch.

The hooks reach into SGLang internals (the aux-hidden-state accumulators, the layer-boundary norm
call, the llama_eagle3 draft forward), so they are pinned to the SGLang releases whose code was
read and tested. Any other version gets one warning and SGLang is left exactly as it is.
"""
from __future__ import annotations

from typing import Optional, Tuple

SUPPORTED_SGLANG_VERSIONS = ("0.5.23",)

ENV_SWITCH = "EAGLE3_OPS_SGLANG"            # "0" / "false" / "off" / "no": the plugin does nothing
ENV_MAX_TOKENS = "EAGLE3_OPS_SGLANG_MAX_TOKENS"  # rows of the persistent capture buffer (optional)
ENV_SHARD_FC = "EAGLE3_OPS_SGLANG_SHARD_FC"      # "0": the draft fc stays replicated under TP > 1


def plugin_enabled() -> bool:
    """The switch (eagle3_ops.settings); a bad value is reported once and keeps the plugin off."""
    import logging

    from ..settings import SettingError, get, report_once

    try:
        return bool(get(ENV_SWITCH))
    except SettingError as e:
        report_once(e, logging.getLogger("eagle3_ops.sglang"))
        return False


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
