"""SGLang plugin: hooks only (no kernel code). Routes SGLang 0.5.23's EAGLE-3 aux hidden-state
capture and the EAGLE-3 draft's fc block through the eagle3 ops.

Loaded by SGLang from the ``sglang.srt.plugins`` entry point (``eagle3_ops.sglang.plugin:register``);
``EAGLE3_OPS_SGLANG=0`` turns it off. Importing this package does not import SGLang.
"""
from .plugin import install, is_registered, register
from .version import SUPPORTED_SGLANG_VERSIONS, check_sglang_version, plugin_enabled

__all__ = ["SUPPORTED_SGLANG_VERSIONS", "check_sglang_version", "install", "is_registered",
           "plugin_enabled", "register"]
