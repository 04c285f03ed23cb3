"""Every ``EAGLE3_OPS_*`` environment variable, parsed strictly, in one place.

A value is parsed once (per raw string) by :func:`get`; a bad one raises :class:`SettingError`,
whose message names the variable, the value given, the values accepted and what happens instead.
The callers decide what "instead" is, always the stock behaviour of what the variable affects:

=================================  ==========================  =========================================
variable                           accepted                    a bad value means
=================================  ==========================  =========================================
``EAGLE3_OPS_SGLANG``              on/off words (default on)   the SGLang plugin stays off
``EAGLE3_OPS_SGLANG_MAX_TOKENS``   1 .. 1048576 (tokens)       no capture buffer: targets capture stock
``EAGLE3_OPS_SGLANG_SHARD_FC``     on/off words (default on)   the draft fc stays replicated
``EAGLE3_OPS_QUALIFY``             auto|on|off (default auto)  auto: qualify the plugin's sites on CUDA
``EAGLE3_OPS_BACKEND``             auto|cuda|triton|reference  the sites that need an op stay stock
``EAGLE3_OPS_VERIFY``              on/off words (default on)   backends are verified (the safe side)
``EAGLE3_OPS_DEBUG``               on/off words (default off)  debug checks stay off
=================================  ==========================  =========================================

``EAGLE3_OPS_DUMP_*`` (the states dump) are parsed by ``doctor.states.DumpSettings``; build-time
variables (``EAGLE3_OPS_SKIP_CUDA``, ``EAGLE3_OPS_LIST_SOURCES_ONLY``) by setup.py / CMake.
:func:`unknown_variables`
names any other ``EAGLE3_OPS_*`` in the environment (a typo would otherwise do nothing, silently).
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional

# The one spelling set of every switch (case-insensitive); anything else is refused with a message.
ON_WORDS = ("1", "true", "on")
OFF_WORDS = ("0", "false", "off")
MAX_TOKENS_LIMIT = 1 << 20   # 1048576 rows: 42 GiB at K=3, H=7168, bf16 (anything above is a typo)


class SettingError(ValueError):
    """A bad ``EAGLE3_OPS_*`` value; the message is complete (variable, value, accepted, effect)."""


@dataclass(frozen=True)
class Setting:
    name: str
    default: Any
    accepted: str           # what the message lists as accepted
    on_error: str           # what happens instead (the stock behaviour of what it affects)
    parse: Callable[[str], Any]


def _switch(raw: str) -> bool:
    word = raw.strip().lower()
    if word in ON_WORDS:
        return True
    if word in OFF_WORDS:
        return False
    raise ValueError


def _max_tokens(raw: str) -> int:
    text = raw.strip()
    if not text.isdigit():  # no sign, no exponent, no decimal point, no spaces inside
        raise ValueError
    value = int(text)
    if not 1 <= value <= MAX_TOKENS_LIMIT:
        raise ValueError
    return value


def _qualify(raw: str) -> str:
    word = raw.strip().lower()
    if word in ("auto", "on", "off"):
        return word
    raise ValueError


def _backend(raw: str) -> Optional[str]:
    name = raw.strip().lower()
    if name in ("", "auto"):
        return None
    if name not in ("cuda", "triton", "reference"):
        raise ValueError
    return name


_SWITCH_WORDS = "/".join(ON_WORDS) + " or " + "/".join(OFF_WORDS)

SETTINGS: Dict[str, Setting] = {s.name: s for s in (
    Setting("EAGLE3_OPS_SGLANG", True, _SWITCH_WORDS,
            "the eagle3_ops SGLang plugin stays off (SGLang runs stock)", _switch),
    Setting("EAGLE3_OPS_SGLANG_MAX_TOKENS", None,
            f"a whole number of tokens from 1 to {MAX_TOKENS_LIMIT} (unset: SGLang's chunked_prefill_size, "
            f"at least the largest CUDA-graph batch); to turn the plugin off use EAGLE3_OPS_SGLANG=0",
            "no capture buffer is installed: EAGLE-3 targets keep SGLang's stock capture", _max_tokens),
    Setting("EAGLE3_OPS_SGLANG_SHARD_FC", True, _SWITCH_WORDS,
            "the draft fc is not sharded (every TP rank keeps the whole replicated fc, as stock SGLang)", _switch),
    Setting("EAGLE3_OPS_QUALIFY", "auto", "auto (qualify on CUDA devices), on (also on the CPU) or off",
            "qualification stays on its default (auto): the plugin qualifies its sites on CUDA devices", _qualify),
    Setting("EAGLE3_OPS_BACKEND", None, "auto, cuda, triton or reference (unset = auto)",
            "every site that needs an eagle3 op stays stock", _backend),
    Setting("EAGLE3_OPS_VERIFY", True, _SWITCH_WORDS,
            "accelerated backends are verified against the reference before first use (the default)", _switch),
    Setting("EAGLE3_OPS_DEBUG", False, _SWITCH_WORDS, "debug checks stay off", _switch),
)}

# Read elsewhere (see the module docstring): known, so not reported as unknown.
OTHER_KNOWN = ("EAGLE3_OPS_DUMP_STATES", "EAGLE3_OPS_DUMP_TOKENS", "EAGLE3_OPS_DUMP_BOUNDARIES",
               "EAGLE3_OPS_SKIP_CUDA", "EAGLE3_OPS_LIST_SOURCES_ONLY")


@functools.lru_cache(maxsize=None)
def _parse(name: str, raw: str) -> Any:
    setting = SETTINGS[name]
    try:
        return setting.parse(raw)
    except ValueError:
        raise SettingError(f"{name}={raw!r} is not valid: expected {setting.accepted}; "
                           f"{setting.on_error}") from None


def get(name: str, env: Optional[Mapping[str, str]] = None) -> Any:
    """The parsed value of ``name`` (its default when unset or empty); raises SettingError."""
    if name not in SETTINGS:
        raise KeyError(f"{name} is not an eagle3_ops runtime setting (known: {', '.join(SETTINGS)})")
    raw = (os.environ if env is None else env).get(name)
    if raw is None or raw.strip() == "":
        return SETTINGS[name].default
    return _parse(name, raw)


_reported: set = set()


def report_once(error, logger) -> None:
    """Log ``error`` (a SettingError or a message) once per process, at ERROR level: the one
    message a bad value gets, however many sites read it."""
    message = f"eagle3_ops: {error}"
    if message not in _reported:
        _reported.add(message)
        logger.error("%s", message)


def report_problems(logger, env: Optional[Mapping[str, str]] = None) -> List[str]:
    """Report every bad or unknown ``EAGLE3_OPS_*`` variable once (at plugin registration, so a
    typo is seen at startup, not at first use). Returns the messages."""
    found = problems(env)
    for message in found:
        report_once(message, logger)
    return found


def get_or_default(name: str, logger, env: Optional[Mapping[str, str]] = None) -> Any:
    """:func:`get`, but a bad value is reported once and the setting's default is used (for the
    settings whose default is the safe, stock side: EAGLE3_OPS_VERIFY, EAGLE3_OPS_DEBUG)."""
    try:
        return get(name, env)
    except SettingError as e:
        report_once(e, logger)
        return SETTINGS[name].default


def problems(env: Optional[Mapping[str, str]] = None) -> List[str]:
    """One message per bad runtime setting and per unknown ``EAGLE3_OPS_*`` variable."""
    out = []
    for name in SETTINGS:
        try:
            get(name, env)
        except SettingError as e:
            out.append(str(e))
    for name in unknown_variables(env):
        out.append(f"{name} is not a variable eagle3_ops reads (a typo?); it has no effect. Known: "
                   f"{', '.join(list(SETTINGS) + list(OTHER_KNOWN))}")
    return out


def unknown_variables(env: Optional[Mapping[str, str]] = None) -> List[str]:
    env = os.environ if env is None else env
    return sorted(k for k in env if k.startswith("EAGLE3_OPS_") and k not in SETTINGS and k not in OTHER_KNOWN)
