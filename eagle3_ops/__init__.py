"""eagle3_ops: EAGLE-3 draft-input ops (aux hidden-state capture + fused draft fc).

Ops (namespace ``torch.ops.eagle3``): ``capture``, ``fused_add_rmsnorm_capture``, ``draft_fc``,
``draft_fc_out``. Backends: ``cuda`` (compiled ``eagle3_ops._C``), ``triton``, ``reference``.
"""
from __future__ import annotations

from .buffer import AuxCaptureBuffer
from .dispatch import backends
from .ops import capture, draft_fc, draft_fc_out, fused_add_rmsnorm_capture

__version__ = "0.1.0"
__all__ = ["AuxCaptureBuffer", "backends", "build_info", "capture", "draft_fc", "draft_fc_out",
           "fused_add_rmsnorm_capture"]


def build_info() -> dict:
    """What this install can run: compiled CUDA archs (empty without the extension), Triton, torch."""
    from . import dispatch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    ext = dispatch.cuda_extension()
    return {
        "version": __version__,
        "torch": __import__("torch").__version__,
        "cuda_extension": ext is not None,
        "compiled_archs": list(dispatch.compiled_archs()),
        "triton": triton_version,
    }
