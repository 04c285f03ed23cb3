"""Every ``EAGLE3_OPS_*`` environment variable, parsed strictly, in one place.

A value is parsed once (per raw string) by :func:`get`; a bad one raises :class:`SettingError`,
whose message (one line) names the variable, the value given, the values accepted and what happens
instead. The callers decide what "instead" is, always the stock behaviour of what the variable
affects:

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
``EAGLE3_OPS_DUMP_STATES``         a file path (default off)   the states dump is off
``EAGLE3_OPS_DUMP_TOKENS``         1 .. 1048576 (tokens)       the states dump is off
``EAGLE3_OPS_DUMP_BOUNDARIES``     auto|all (default auto)     the states dump is off
``EAGLE3_OPS_WIRING_CHECK``        on/off words (default on)   the live wiring check stays off
``EAGLE3_OPS_SPEC_REPORT``         on/off words (default on)   the speculation report stays off
``EAGLE3_OPS_DOCTOR_KEEP``         on/off words (default on)   the doctor runs SGLang's code every time
=================================  ==========================  =========================================

Each setting has a ``kind`` (``switch``, ``count``, ``choice``, ``output-file``) that decides its
parser, so every variable of a kind is parsed (and tested) the same way. An ``output-file`` value
is also checked, every time it is read, for what it is used for (:func:`output_file_problem`).
``EAGLE3_OPS_SKIP_CUDA`` (:data:`BUILD_SETTINGS`, a switch) is read by setup.py, which loads this
file by path; ``EAGLE3_OPS_LIST_SOURCES_ONLY`` is a CMake option. :func:`unknown_variables` names any
other ``EAGLE3_OPS_*`` in the environment (a typo would otherwise do nothing, silently).
"""
from __future__ import annotations

import functools
import os
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

# The one spelling set of every switch (case-insensitive); anything else is refused with a message.
ON_WORDS = ("1", "true", "on")
OFF_WORDS = ("0", "false", "off")
MAX_TOKENS_LIMIT = 1 << 20   # 1048576 rows: 42 GiB at K=3, H=7168, bf16 (anything above is a typo)
KINDS = ("switch", "count", "choice", "output-file")


class SettingError(ValueError):
    """A bad ``EAGLE3_OPS_*`` value; the message is complete (variable, value, accepted, effect)."""


@dataclass(frozen=True)
class Setting:
    """One ``EAGLE3_OPS_*`` variable: its default, how its raw value is parsed and checked, and what the error message
    says is accepted and happens instead."""
    name: str
    default: Any
    accepted: str           # what the message lists as accepted
    on_error: str           # what happens instead (the stock behaviour of what it affects)
    parse: Callable[[str], Any]
    kind: str               # one of KINDS
    limits: Tuple[int, int] = (0, 0)     # count: the accepted range, both ends included
    words: Tuple[str, ...] = ()          # choice: the accepted words (case-insensitive)
    check: Optional[Callable[[Any], Optional[str]]] = None  # output-file: what makes a parsed value unusable


def parse_whole_number(raw: str, lo: int, hi: int) -> int:
    """``raw`` as a whole number in [lo, hi]: ASCII digits only (no sign, exponent, decimal point,
    underscore, space inside, superscript or other script's digits); raises ValueError."""
    text = raw.strip()
    if not (text.isascii() and text.isdigit()) or len(text) > len(str(hi)):  # 30 digits: refused unparsed
        raise ValueError
    value = int(text)
    if not lo <= value <= hi:
        raise ValueError
    return value


def _switch(raw: str) -> bool:
    word = raw.strip().lower() if raw.isascii() else ""  # lower() maps some non-ASCII letters to ASCII ones
    if word in ON_WORDS:
        return True
    if word in OFF_WORDS:
        return False
    raise ValueError


_SWITCH_WORDS = "/".join(ON_WORDS) + " or " + "/".join(OFF_WORDS)


def _switch_setting(name: str, default: bool, on_error: str) -> Setting:
    return Setting(name, default, _SWITCH_WORDS, on_error, _switch, "switch")


def _count_setting(name: str, default: Optional[int], lo: int, hi: int, unit: str, note: str,
                   on_error: str) -> Setting:
    return Setting(name, default, f"a whole number of {unit} from {lo} to {hi}{note}", on_error,
                   functools.partial(parse_whole_number, lo=lo, hi=hi), "count", limits=(lo, hi))


def _choice_setting(name: str, default: Any, words: Tuple[str, ...], accepted: str, on_error: str,
                    value: Callable[[str], Any] = lambda w: w) -> Setting:
    def parse(raw: str) -> Any:
        word = raw.strip().lower()
        if not raw.isascii() or word not in words:  # lower() maps some non-ASCII letters (the Kelvin sign) to ASCII
            raise ValueError
        return value(word)

    return Setting(name, default, accepted, on_error, parse, "choice", words=words)


def _file_kind(mode: int) -> str:
    for test, kind in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return kind
    return "not a regular file"


def output_file_problem(path, create_folders: bool = False) -> Optional[str]:
    """Why ``path`` cannot receive a file that eagle3_ops writes, or None. The rule (the states
    dump, ``capture-states --out``): the target is a regular file (replaced, atomically, when the
    file is written) or does not exist yet, in a folder where a file can be created (tried: a
    probe file is created and removed). A symlink is followed: the file it points to is written
    and the link stays. A directory, device, FIFO or socket is refused, never replaced.
    ``create_folders``: missing folders will be created, so the nearest existing one is probed."""
    target = Path(os.path.realpath(path))   # a symlink (or a dangling one): the file it points to
    try:
        mode = os.stat(target).st_mode
    except (FileNotFoundError, NotADirectoryError):  # absent (the folder checks below say why, if it matters)
        mode = None
    except OSError as e:  # a symlink loop, a folder that cannot be searched
        return f"cannot inspect {target}: {(e.strerror or str(e)).lower()}"
    if mode is not None and not stat.S_ISREG(mode):
        hint = f"; give a file path (e.g. {target / 'states.safetensors'})" if stat.S_ISDIR(mode) else ""
        return f"{target} is {_file_kind(mode)}, not a regular file (it is never replaced){hint}"
    folder = target.parent
    while create_folders and not os.path.lexists(folder) and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        return (f"{folder} is not a folder" if os.path.lexists(folder) else f"folder {folder} does not exist")
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".eagle3_ops-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return f"cannot create a file in {folder}: {(e.strerror or str(e)).lower()}"
    return None


def _output_file_setting(name: str, accepted: str, on_error: str) -> Setting:
    return Setting(name, None, accepted, on_error, lambda raw: raw.strip(), "output-file",
                   check=output_file_problem)


_DUMP_OFF = "the states dump is off (nothing is recorded; serving is unaffected)"

SETTINGS: Dict[str, Setting] = {s.name: s for s in (
    _switch_setting("EAGLE3_OPS_SGLANG", True, "the eagle3_ops SGLang plugin stays off (SGLang runs stock)"),
    _count_setting("EAGLE3_OPS_SGLANG_MAX_TOKENS", None, 1, MAX_TOKENS_LIMIT, "tokens",
                   " (unset: SGLang's chunked_prefill_size, at least the largest CUDA-graph batch); to turn the "
                   "plugin off use EAGLE3_OPS_SGLANG=0",
                   "no capture buffer is installed: EAGLE-3 targets keep SGLang's stock capture"),
    _switch_setting("EAGLE3_OPS_SGLANG_SHARD_FC", True,
                    "the draft fc is not sharded (every TP rank keeps the whole replicated fc, as stock SGLang)"),
    _choice_setting("EAGLE3_OPS_QUALIFY", "auto", ("auto", "on", "off"),
                    "auto (qualify on CUDA devices), on (also on the CPU) or off",
                    "qualification stays on its default (auto): the plugin qualifies its sites on CUDA devices"),
    _choice_setting("EAGLE3_OPS_BACKEND", None, ("auto", "cuda", "triton", "reference"),
                    "auto, cuda, triton or reference (unset = auto)", "every site that needs an eagle3 op stays stock",
                    value=lambda w: None if w == "auto" else w),
    _switch_setting("EAGLE3_OPS_VERIFY", True,
                    "accelerated backends are verified against the reference before first use (the default)"),
    _switch_setting("EAGLE3_OPS_DEBUG", False, "debug checks stay off"),
    _output_file_setting("EAGLE3_OPS_DUMP_STATES",
                         "a path for the STATES file: a new file or a regular one (replaced when written; a "
                         "symlink is followed) in an existing folder where files can be created", _DUMP_OFF),
    _count_setting("EAGLE3_OPS_DUMP_TOKENS", 2048, 1, MAX_TOKENS_LIMIT, "prefill tokens", " (default 2048)",
                   _DUMP_OFF),
    _switch_setting("EAGLE3_OPS_WIRING_CHECK", True,
                    "the live wiring check stays off (the draft is served as configured; nothing is checked)"),
    _switch_setting("EAGLE3_OPS_SPEC_REPORT", True,
                    "the speculation report stays off (no acceptance per position, no cycle times)"),
    _switch_setting("EAGLE3_OPS_DOCTOR_KEEP", True,
                    "the doctor runs the installed SGLang's code every time (keeps nothing, reads nothing kept)"),
    _choice_setting("EAGLE3_OPS_DUMP_BOUNDARIES", "auto", ("auto", "all"),
                    "auto (each configured boundary and its neighbours, the embeddings, the last layer's output) "
                    "or all", _DUMP_OFF),
)}

# Read by setup.py at build time (it loads this file by path: the package is not built yet).
BUILD_SETTINGS: Dict[str, Setting] = {s.name: s for s in (
    _switch_setting("EAGLE3_OPS_SKIP_CUDA", False, "the build stops (nothing is built or installed)"),
)}

# A CMake option (-DEAGLE3_OPS_LIST_SOURCES_ONLY=ON, tests/test_build.py), not read from the
# environment: known, so not reported as unknown if exported.
OTHER_KNOWN = ("EAGLE3_OPS_LIST_SOURCES_ONLY",)


@functools.lru_cache(maxsize=None)
def _parse(name: str, raw: str) -> Any:
    setting = SETTINGS.get(name) or BUILD_SETTINGS[name]
    try:
        return setting.parse(raw)
    except ValueError:
        raise SettingError(f"{name}={raw!r} is not valid: expected {setting.accepted}; "
                           f"{setting.on_error}") from None


def get(name: str, env: Optional[Mapping[str, str]] = None) -> Any:
    """The parsed value of ``name`` (its default when unset or empty); raises SettingError."""
    setting = SETTINGS.get(name) or BUILD_SETTINGS.get(name)
    if setting is None:
        raise KeyError(f"{name} is not an eagle3_ops setting "
                       f"(known: {', '.join(list(SETTINGS) + list(BUILD_SETTINGS))})")
    raw = (os.environ if env is None else env).get(name)
    if raw is None or raw.strip() == "":
        return setting.default
    value = _parse(name, raw)
    if setting.check is not None:  # what the filesystem says now: never cached
        problem = setting.check(value)
        if problem is not None:
            raise SettingError(f"{name}={raw!r} is not usable: {problem}; {setting.on_error}")
    return value


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


def switch_or_off(name: str, logger, env: Optional[Mapping[str, str]] = None) -> bool:
    """A switch's value, where a bad value is reported once and the switch is off (for the features that only
    observe, whose off side is SGLang's own behaviour: the live wiring check, the speculation report)."""
    try:
        return bool(get(name, env))
    except SettingError as e:
        report_once(e, logger)
        return False


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
                   f"{', '.join(KNOWN)}")
    return out


KNOWN = tuple(SETTINGS) + tuple(BUILD_SETTINGS) + OTHER_KNOWN


def unknown_variables(env: Optional[Mapping[str, str]] = None) -> List[str]:
    """The ``EAGLE3_OPS_*`` names in ``env`` (default ``os.environ``) that eagle3_ops does not read, sorted: reported at
    start so a typo does not go unnoticed."""
    env = os.environ if env is None else env
    return sorted(k for k in env if k.startswith("EAGLE3_OPS_") and k not in KNOWN)
