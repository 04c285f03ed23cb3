"""eagle3_ops: EAGLE-3 draft-input ops (aux hidden-state capture + fused draft fc).

Ops (namespace ``torch.ops.eagle3``; each op's schema is one row of ``eagle3_ops/registry.py``, registered
with torch.library by ``eagle3_ops/ops.py``): ``capture``,
``fused_add_rmsnorm_capture``, ``draft_fc`` (and its out= form ``draft_fc_out``). Backends:
``cuda`` (compiled ``eagle3_ops._C``, ops ``torch.ops.eagle3_cuda``), ``triton``, ``reference``.
The map of the package: docs/design.md §2.
"""
from __future__ import annotations

from . import plans
from .buffer import AuxCaptureBuffer
from .dispatch import backends
from .ops import (capture, draft_fc, draft_fc_out, draft_fc_workspace_bytes, fold_norm_weights,
                  fused_add_rmsnorm_capture)

__version__ = "0.1.0"
__all__ = ["AuxCaptureBuffer", "backends", "build_info", "capture", "draft_fc", "draft_fc_out",
           "draft_fc_workspace_bytes", "fold_norm_weights", "fused_add_rmsnorm_capture", "plans"]


def build_info() -> dict:
    """What this install can run: compiled CUDA archs (empty without the extension), Triton, torch."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    from . import cuda_backend

    ext = cuda_backend.cuda_extension()
    return {
        "version": __version__,
        "torch": __import__("torch").__version__,
        "cuda_extension": ext is not None,
        "compiled_archs": list(cuda_backend.compiled_archs()),
        "triton": triton_version,
    }
