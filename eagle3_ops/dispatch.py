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

:func:`select` decides on every call of the public ops (the variables are read each time, so a changed
one takes effect on the next call; ``settings`` caches each value's parse; verification results are kept
per (op, backend, device, dtype)). The SGLang plugin decides once, at install: :func:`verified_function`
gives it the function it then calls directly (``eagle3_ops.bound``).
"""
from __future__ import annotations

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


def forced_backend() -> Optional[str]:
    """The backend EAGLE3_OPS_BACKEND forces, or None (auto). A bad value raises
    ``settings.SettingError`` (a ValueError) naming the variable and the accepted values."""
    from . import settings

    return settings.get("EAGLE3_OPS_BACKEND")


def verification_enabled() -> bool:
    """Whether accelerated backends are checked against the reference before first use (``EAGLE3_OPS_VERIFY``, default
    on; a bad value is reported once and counts as on)."""
    from . import settings

    return bool(settings.get_or_default("EAGLE3_OPS_VERIFY", log))


def resolve(backend: str) -> Dict[str, Callable]:
    """{name: function} of ``backend`` for every op it implements (``registry.BACKEND_OPS``) and each
    ``<op>_plan`` / ``<op>_workspace_bytes`` the registry names. Raises ImportError naming what is missing; the caller
    decides whether the backend's own dependency (triton) being absent just means the backend is
    unavailable."""
    fns, missing = {}, []
    for op in BACKEND_OPS:
        module = importlib.import_module(OPS[op].backends[backend])
        for name in [op] + ([f"{op}_plan", f"{op}_workspace_bytes"] if OPS[op].planned else []):
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


def function(backend: str, name: str) -> Callable:
    """The function ``name`` (an op, ``<op>_plan`` or ``<op>_workspace_bytes``) of ``backend``."""
    fns = _backend_functions(backend)
    if fns is None:
        raise BackendUnavailableError(f"backend {backend} is not installed")
    return fns[name]


def _compiled_archs() -> tuple:
    from .cuda_backend import compiled_archs

    return compiled_archs()


def triton_interpreter() -> bool:
    """Whether ``TRITON_INTERPRET=1`` is set: the Triton backend may then serve the CPU (the interpreter; how CI runs
    the Triton kernels)."""
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


def select(op: str, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> tuple:
    """(backend name, function) serving ``op`` on ``device`` for inputs of ``dtype``: the forced backend
    (EAGLE3_OPS_BACKEND), else the first of :func:`candidate_backends` that serves and passes verification."""
    forced = forced_backend()
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


def verified_function(op: str, backend: str, device: torch.device, dtype: torch.dtype) -> Callable:
    """The function of ``backend`` serving ``op`` on ``device`` for ``dtype``, verified (``verify.py``) before
    it is handed out: what a caller that decides once (the plugin's install, qualification) then calls
    directly. Raises BackendUnavailableError when the backend cannot serve the device or fails verification."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r} (one of {', '.join(BACKENDS)})")
    fn = implementation(backend, op, device)
    if fn is None:
        raise BackendUnavailableError(f"eagle3::{op}: backend {backend} cannot serve device {device}")
    if not _passes_verification(op, backend, device, fn, dtype):
        raise BackendUnavailableError(f"eagle3::{op}: backend {backend} failed verification on {device} for {dtype}")
    return fn


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
