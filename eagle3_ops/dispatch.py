"""Which backend serves each op on a device: ``cuda`` → ``triton`` → ``reference``.

* ``cuda``: the compiled extension ``eagle3_ops._C`` is importable, has a kernel for the op, and was
  compiled for this GPU's arch (``sm_90a`` cubins run only on sm_90, ``sm_120a`` only on sm_120).
* ``triton``: Triton is importable and the device is a GPU, or the device is the CPU and
  ``TRITON_INTERPRET=1`` (the Triton interpreter; that is how CI runs the Triton kernels).
* ``reference``: plain PyTorch (``eagle3_ops/reference.py``), any device.

``EAGLE3_OPS_BACKEND=cuda|triton|reference`` forces one backend; if it cannot serve an op on the
device, the op raises instead of quietly using another. Each accelerated backend is checked once per
(op, device) against the reference on a small random problem before first use (``verify.py``); a
backend that fails is disabled for the process with an error log, and the next one serves.
``EAGLE3_OPS_VERIFY=0`` skips that check.
"""
from __future__ import annotations

import functools
import importlib
import logging
import os
import threading
from pathlib import Path
from typing import Callable, Dict, Optional

import torch

log = logging.getLogger("eagle3_ops")

BACKENDS = ("cuda", "triton", "reference")
# Public op name -> name of the backend function that implements it (all write into caller memory).
OPS = {
    "capture": "capture",
    "fused_add_rmsnorm_capture": "fused_add_rmsnorm_capture",
    "draft_fc": "draft_fc_out",
}
# Triton modules, one per kernel family, each exporting the functions named in OPS.
TRITON_MODULES = ("eagle3_ops.triton.capture", "eagle3_ops.triton.draft_fc")


class BackendUnavailableError(RuntimeError):
    """The forced backend cannot serve this op on this device."""


def forced_backend() -> Optional[str]:
    """The backend EAGLE3_OPS_BACKEND forces, or None (auto). A bad value raises
    ``settings.SettingError`` (a ValueError) naming the variable and the accepted values."""
    from . import settings

    return settings.get("EAGLE3_OPS_BACKEND")


def verification_enabled() -> bool:
    from . import settings

    return bool(settings.get_or_default("EAGLE3_OPS_VERIFY", log))


@functools.lru_cache(maxsize=None)
def cuda_extension():
    """The compiled extension module, or None when the package was built without nvcc."""
    try:
        return importlib.import_module("eagle3_ops._C")
    except ImportError as e:
        built = list(Path(__file__).parent.glob("_C*.so")) + list(Path(__file__).parent.glob("_C*.pyd"))
        if built:  # built but not loadable (e.g. compiled against another torch): say so
            log.warning("eagle3_ops: the CUDA extension %s exists but does not import (%s); the triton/reference "
                        "backends serve. Rebuild with `pip install --no-build-isolation -e .`.", built[0].name, e)
        else:
            log.debug("eagle3_ops._C not built: %s", e)
        return None


@functools.lru_cache(maxsize=None)
def compiled_archs() -> tuple:
    ext = cuda_extension()
    if ext is None:
        return ()
    return tuple(a for a in str(ext.compiled_archs).split(",") if a)


def _device_arch(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


@functools.lru_cache(maxsize=None)
def _triton_module_functions() -> Dict[str, Callable]:
    fns: Dict[str, Callable] = {}
    try:
        import triton  # noqa: F401
    except ImportError:
        return fns
    for mod_name in TRITON_MODULES:
        try:
            mod = importlib.import_module(mod_name)
        except ModuleNotFoundError as e:
            if e.name == mod_name:  # this kernel family is not written yet
                continue
            raise
        for fn_name in OPS.values():
            if hasattr(mod, fn_name):
                fns[fn_name] = getattr(mod, fn_name)
    return fns


def _reference_functions() -> Dict[str, Callable]:
    from . import reference

    return {
        "capture": reference.capture_ref,
        "fused_add_rmsnorm_capture": reference.fused_add_rmsnorm_capture_ref,
        "draft_fc_out": reference.draft_fc_out_ref,
    }


def triton_interpreter() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def implementation(backend: str, op: str, device: torch.device) -> Optional[Callable]:
    """The function of ``backend`` that serves ``op`` on ``device``, or None if it cannot."""
    fn_name = OPS[op]
    if backend == "reference":
        return _reference_functions()[fn_name]
    if backend == "triton":
        if device.type == "cuda" or (device.type == "cpu" and triton_interpreter()):
            return _triton_module_functions().get(fn_name)
        return None
    if backend == "cuda":
        ext = cuda_extension()
        if device.type != "cuda" or ext is None or not hasattr(ext, fn_name):
            return None
        arch = _device_arch(device)
        if not any(a.rstrip("a") == arch for a in compiled_archs()):
            return None
        return getattr(ext, fn_name)
    raise ValueError(f"unknown backend {backend!r}")


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
    from .verify import verify_backend

    with _lock:
        if key not in _verified:
            ok, detail = verify_backend(op, fn, device, dtype)
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
    """(backend name, function) serving ``op`` on ``device`` for inputs of ``dtype``."""
    forced = forced_backend()
    if forced is not None:
        fn = implementation(forced, op, device)
        if fn is None:
            raise BackendUnavailableError(
                f"eagle3::{op}: EAGLE3_OPS_BACKEND={forced} cannot serve device {device} "
                f"(compiled archs: {','.join(compiled_archs()) or 'none'}; TRITON_INTERPRET="
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
    return {op: select(op, device, dtype)[0] for op in OPS}


def reset_verification() -> None:
    """Forget verification results (tests)."""
    with _lock:
        _verified.clear()
        _used_unverified_in_graph.clear()
