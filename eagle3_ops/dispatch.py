"""Which backend serves each op on a device: ``cuda`` → ``triton`` → ``reference``.

* ``cuda``: the compiled extension ``eagle3_ops._C`` is importable, has a kernel for the op, and was
  compiled for this GPU's arch (``sm_90a`` cubins run only on sm_90, ``sm_120a`` only on sm_120).
* ``triton``: Triton is importable and the device is a GPU, or the device is the CPU and
  ``TRITON_INTERPRET=1`` (the Triton interpreter; that is how CI runs the Triton kernels).
* ``reference``: plain PyTorch (``eagle3_ops/reference.py``), any device.

``EAGLE3_OPS_BACKEND=cuda|triton|reference`` forces one backend; if it cannot serve an op on the
device, the op raises instead of quietly using another. Each accelerated backend is checked once per
(op, device) against the float64 truth on a small random problem before first use (``verify.py``); a
backend that fails is disabled for the process with an error log, and the next one serves.
``EAGLE3_OPS_VERIFY=0`` skips that check.

The choice is resolved once per (op, device, dtype, backend scope, raw values of the variables it
depends on) and cached (:func:`select`): a call then costs one dictionary lookup plus reading those
variables' raw values (:func:`raw_env`, a lookup each), so a changed variable (a test's
``monkeypatch.setenv``) still takes effect on the next call; every value is parsed once
(``settings`` caches the parse). Only final answers are cached: a backend that passed its
verification, the reference, or one whose verification is off.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import os
import threading
from typing import Callable, Dict, Optional

import torch

from .registry import BACKEND_OPS, BACKENDS, OPS

log = logging.getLogger("eagle3_ops")


class BackendUnavailableError(RuntimeError):
    """The forced backend cannot serve this op on this device."""


_ENV_DATA = getattr(os.environ, "_data", None)  # POSIX: the raw bytes -> bytes mapping under os.environ
_ENV_KEYS: Dict[str, object] = {}


def raw_env(name: str):
    """The raw value of environment variable ``name`` (None when unset), for cache keys and "is it
    set at all" tests: os.environ's own mapping read without decoding (~0.05 us instead of ~0.5 us)
    where the platform has one (POSIX), else ``os.environ.get``. Parse values with ``settings``."""
    if _ENV_DATA is None:
        return os.environ.get(name)
    key = _ENV_KEYS.get(name)
    if key is None:
        key = _ENV_KEYS[name] = os.environ.encodekey(name)
    return _ENV_DATA.get(key)


# select()'s raw reads of its three variables, without raw_env's call (select runs on every op call)
_ENV_GET = _ENV_DATA.get if _ENV_DATA is not None else os.environ.get
_KEY_BACKEND, _KEY_VERIFY, _KEY_INTERPRET = (os.environ.encodekey(n) if _ENV_DATA is not None else n
                                             for n in ("EAGLE3_OPS_BACKEND", "EAGLE3_OPS_VERIFY", "TRITON_INTERPRET"))


def forced_backend() -> Optional[str]:
    """The backend EAGLE3_OPS_BACKEND forces, or None (auto). A bad value raises
    ``settings.SettingError`` (a ValueError) naming the variable and the accepted values."""
    from . import settings

    return settings.get("EAGLE3_OPS_BACKEND")


def verification_enabled() -> bool:
    from . import settings

    return bool(settings.get_or_default("EAGLE3_OPS_VERIFY", log))


def resolve(backend: str) -> Dict[str, Callable]:
    """{name: function} of ``backend`` for every op it implements (``registry.BACKEND_OPS``) and each
    ``<op>_workspace_bytes`` the registry names. Raises ImportError naming what is missing; the caller
    decides whether the backend's own dependency (triton) being absent just means the backend is
    unavailable."""
    fns, missing = {}, []
    for op in BACKEND_OPS:
        module = importlib.import_module(OPS[op].backends[backend])
        for name in [op] + ([f"{op}_workspace_bytes"] if OPS[op].workspace_bytes else []):
            fn = getattr(module, name, None)
            if fn is None:
                missing.append(f"{module.__name__}.{name}")
            else:
                fns[name] = fn
    if missing:
        raise ImportError(f"eagle3_ops backend {backend!r} does not implement {', '.join(missing)} "
                          f"(eagle3_ops/registry.py names them)")
    return fns


@functools.lru_cache(maxsize=None)
def _backend_functions(backend: str) -> Optional[Dict[str, Callable]]:
    """Every function of ``backend`` (:func:`resolve`), or None when the backend's own dependency is
    not installed (Triton). A backend module that exists but lacks a function is an ImportError."""
    if backend == "triton":
        try:
            import triton  # noqa: F401
        except ImportError:
            return None
    return resolve(backend)


# (backend, name) -> function: what function() found (one dict lookup a call; the face's draft_fc
# workspace query runs through it on every call).
_functions: Dict[tuple, Callable] = {}


def function(backend: str, name: str) -> Callable:
    """The function ``name`` (an op, or ``<op>_workspace_bytes``) of ``backend``."""
    fn = _functions.get((backend, name))
    if fn is None:
        fns = _backend_functions(backend)
        if fns is None:
            raise BackendUnavailableError(f"backend {backend} is not installed")
        fn = _functions[(backend, name)] = fns[name]
    return fn


def _compiled_archs() -> tuple:
    from .cuda_backend import compiled_archs

    return compiled_archs()


def triton_interpreter() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def implementation(backend: str, op: str, device: torch.device) -> Optional[Callable]:
    """The function of ``backend`` that serves ``op`` on ``device``, or None if it cannot."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}")
    if backend == "triton" and not (device.type == "cuda" or (device.type == "cpu" and triton_interpreter())):
        return None
    if backend == "cuda":
        if device.type != "cuda":
            return None
        from . import cuda_backend

        if not cuda_backend.serves(device):
            return None
    fns = _backend_functions(backend)
    return None if fns is None else fns[op]


# (op, backend, device str, dtype) -> True (verified) / False (failed, disabled for the process)
_verified: Dict[tuple, bool] = {}
# Keys first used inside CUDA-graph capture, before any eager call could verify them.
_used_unverified_in_graph: set = set()
_lock = threading.Lock()


def _passes_verification(op: str, backend: str, device: torch.device, fn: Callable,
                         dtype: torch.dtype = torch.bfloat16) -> bool:
    if backend == "reference" or not verification_enabled():
        return True
    key = (op, backend, str(device), dtype)
    state = _verified.get(key)
    if state is not None:
        return state
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        # A check allocates and syncs, which graph capture forbids; SGLang runs eager warm-up
        # batches before capturing, so this only happens when a graph is the very first use.
        # The first eager call verifies it; if it fails then, that call raises (see below).
        if key not in _used_unverified_in_graph:
            _used_unverified_in_graph.add(key)
            log.warning("eagle3_ops: %s/%s (%s) first used inside CUDA-graph capture on %s: not verified yet",
                        op, backend, dtype, device)
        return True
    with _lock:
        if key not in _verified:
            ok, detail = OPS[op].selfcheck(fn, device, dtype, _backend_functions(backend))
            _verified[key] = ok
            if ok:
                log.info("eagle3_ops: %s backend %s verified on %s for %s (%s)", op, backend, device, dtype, detail)
            else:
                name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
                log.error("eagle3_ops: %s backend %s FAILED verification on %s (%s) for %s: %s. It is disabled "
                          "for this process; the next backend serves this op.", op, backend, device, name, dtype,
                          detail)
                if key in _used_unverified_in_graph:
                    # Graphs captured earlier replay this backend: switching eager calls to another
                    # backend would make graph and eager results differ silently.
                    raise BackendUnavailableError(
                        f"eagle3::{op}: backend {backend} failed verification on {device} ({detail}) after CUDA "
                        f"graphs were captured with it. Run one eager call before capturing graphs, or set "
                        f"EAGLE3_OPS_BACKEND to a backend that passes.")
    return _verified[key]


def candidate_backends(device: torch.device) -> tuple:
    """Automatic order of preference. On the CPU only the reference runs unless forced: the Triton
    interpreter is a test vehicle, not a fast path."""
    return BACKENDS if device.type == "cuda" else ("reference",)


class _Scope(threading.local):
    # The class attribute is what a thread that never entered ``using`` reads: no AttributeError
    # raised and caught on every ``select`` (that alone cost ~1 us a call).
    backend: Optional[str] = None


_scoped = _Scope()


@contextlib.contextmanager
def using(backend: Optional[str]):
    """Within this scope (this thread), every op is served by ``backend`` (None: the usual choice),
    as with EAGLE3_OPS_BACKEND: an op it cannot serve raises. Qualification and the SGLang plugin
    use it to run the backend chosen for a call."""
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r} (one of {', '.join(BACKENDS)})")
    previous = _scoped.backend
    _scoped.backend = backend
    try:
        yield
    finally:
        _scoped.backend = previous


# (op, device, dtype, scoped backend, raw EAGLE3_OPS_BACKEND, raw EAGLE3_OPS_VERIFY, raw TRITON_INTERPRET)
# -> (backend, function): final answers of _select only (see the module doc).
_selected: Dict[tuple, tuple] = {}


def select(op: str, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> tuple:
    """(backend name, function) serving ``op`` on ``device`` for inputs of ``dtype``."""
    scoped = _scoped.backend
    key = (op, device, dtype, scoped, _ENV_GET(_KEY_BACKEND), _ENV_GET(_KEY_VERIFY), _ENV_GET(_KEY_INTERPRET))
    hit = _selected.get(key)
    if hit is not None:
        return hit
    backend, fn = _select(op, device, dtype, scoped)
    final = backend == "reference" or not verification_enabled() or \
        _verified.get((op, backend, str(device), dtype)) is True
    if final and not (device.type == "cuda" and device.index is None):  # index-less: the current device may change
        with _lock:
            _selected[key] = (backend, fn)
    return backend, fn


def _select(op: str, device: torch.device, dtype: torch.dtype, scoped: Optional[str]) -> tuple:
    forced = scoped or forced_backend()
    if forced is not None:
        fn = implementation(forced, op, device)
        if fn is None:
            raise BackendUnavailableError(
                f"eagle3::{op}: EAGLE3_OPS_BACKEND={forced} cannot serve device {device} "
                f"(compiled archs: {','.join(_compiled_archs()) or 'none'}; TRITON_INTERPRET="
                f"{os.environ.get('TRITON_INTERPRET', '0')}). Unset it to choose automatically.")
        if not _passes_verification(op, forced, device, fn, dtype):
            raise BackendUnavailableError(f"eagle3::{op}: forced backend {forced} failed verification on {device}")
        return forced, fn
    for backend in candidate_backends(device):
        fn = implementation(backend, op, device)
        if fn is not None and _passes_verification(op, backend, device, fn, dtype):
            return backend, fn
    raise AssertionError("unreachable: the reference backend serves every op")


def backends(device=None, dtype: torch.dtype = torch.bfloat16) -> Dict[str, str]:
    """Which backend serves each op on ``device`` (default: the current CUDA device, else CPU) for
    inputs of ``dtype`` (verification is per dtype)."""
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return {op: select(op, device, dtype)[0] for op in BACKEND_OPS}


def reset_verification() -> None:
    """Forget verification results (tests)."""
    with _lock:
        _verified.clear()
        _used_unverified_in_graph.clear()
        _selected.clear()
