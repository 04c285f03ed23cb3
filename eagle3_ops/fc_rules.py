"""Rules of ``draft_fc`` that both accelerated backends apply (``triton/draft_fc.py`` and
``cuda_backend.py``), written once. Pure Python on shapes, strides and dtypes: no kernels, nothing
allocated; every function works on real, meta and fake tensors alike.

* **fp16 with norm weights never takes a skinny kernel.** Both skinny kernels multiply x by the norm
  weights ``g = input_norm_weight * chunk_norm_weight`` and round that to the dtype *before* the RMS
  scale (which they apply to the fp32 partials: linearity saves a K-wide pre-pass); in fp16 that
  product can exceed 65504 where ``norm(x)`` cannot. bf16 has the range. Fallbacks: Triton takes its
  tiled kernel (it scales x on the fly), CUDA takes cuBLAS on the prepared input.
* **Strided 1-D arguments are copied to unit stride** into the workspace before any kernel runs
  (validation accepts any stride for ``bias``, ``rows`` and ``input_norm_weight``; the kernels index
  them with stride 1). Contiguous ones, the usual case, are used in place and cost nothing. The
  copies come first in the workspace, in the order bias, rows, input_norm_weight.
* **Folded norm weights** (``norm_folded``, :func:`eagle3_ops.fold_norm_weights`): the weight
  already carries ``g``; kernels apply only the RMS scales (input_norm_weight still feeds the chunk
  statistic) and never multiply x by ``g``, so the fp16 rule above does not apply to the skinny
  kernels. The tiled and cuBLAS paths do round ``x * scales`` to the dtype, and without ``g`` the
  chunk scale carries ~1/input_norm_weight, so fp16 with an input norm is refused when folded
  (``validation.FOLDED_FP16_INPUT_NORM``).
* **The cuBLAS path prepares ``norm(x[rows])``** only when there is a gather or a norm; otherwise x
  goes to cuBLAS as it is (no workspace).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .validation import is_fake
from .workspace import Carver, aligned


def num_rows(x: torch.Tensor, rows: Optional[torch.Tensor]) -> int:
    """M, the number of output rows."""
    return int(rows.shape[0]) if rows is not None else int(x.shape[0])


def chunks(x: torch.Tensor, chunk_norm_weight: Optional[torch.Tensor]) -> Tuple[int, int]:
    """(NC, CH): chunks with their own RMS scale and their width; (1, K*H) without chunk norm."""
    if chunk_norm_weight is None:
        return 1, int(x.shape[1])
    return int(chunk_norm_weight.shape[0]), int(chunk_norm_weight.shape[1])


def has_norm(chunk_norm_weight: Optional[torch.Tensor], input_norm_weight: Optional[torch.Tensor]) -> bool:
    """Whether the call normalises x at all (a chunk norm or an input norm weight is given)."""
    return chunk_norm_weight is not None or input_norm_weight is not None


def prepares_input(rows: Optional[torch.Tensor], chunk_norm_weight: Optional[torch.Tensor],
                   input_norm_weight: Optional[torch.Tensor]) -> bool:
    """Whether the cuBLAS path writes ``norm(x[rows])`` first (else it multiplies x directly)."""
    return rows is not None or has_norm(chunk_norm_weight, input_norm_weight)


def fp16_norm_overflow(dtype: torch.dtype, chunk_norm_weight: Optional[torch.Tensor],
                       input_norm_weight: Optional[torch.Tensor], norm_folded: bool = False) -> bool:
    """True when a skinny kernel could overflow: fp16 with norm weights applied to x (see the
    module doc). With folded norm weights x is never multiplied (the fold itself checks W * g)."""
    return dtype == torch.float16 and has_norm(chunk_norm_weight, input_norm_weight) and not norm_folded


def needs_unit_stride_copy(t: Optional[torch.Tensor]) -> bool:
    """Whether a 1-D argument (``bias``, ``rows``, ``input_norm_weight``; None passes) must be copied to unit stride
    into the workspace before a kernel reads it: it is given and not contiguous."""
    return t is not None and not t.is_contiguous()


def unit_stride_copy_bytes(bias: Optional[torch.Tensor], rows: Optional[torch.Tensor],
                           input_norm_weight: Optional[torch.Tensor]) -> int:
    """Workspace bytes of the unit-stride copies (each region ``workspace.ALIGN``-aligned)."""
    return sum(aligned(t.numel() * t.element_size()) for t in (bias, rows, input_norm_weight)
               if needs_unit_stride_copy(t))


def unit_stride_copies(carver: Carver, bias: Optional[torch.Tensor], rows: Optional[torch.Tensor],
                       input_norm_weight: Optional[torch.Tensor]) -> tuple:
    """(bias, rows, input_norm_weight) with every strided one replaced by a copy carved from the
    workspace (one copy kernel on the current stream; nothing allocated)."""

    def unit(t):
        if not needs_unit_stride_copy(t):
            return t
        dst = carver.take(t.numel(), t.dtype)
        dst.copy_(t)
        return dst

    return unit(bias), unit(rows), unit(input_norm_weight)


def aligned16(t: Optional[torch.Tensor]) -> bool:
    """Whether t's first element is 16-byte aligned (None counts as aligned). For meta and fake
    tensors, which have no address, the offset into their storage decides (allocations start on a
    boundary of at least 256 bytes)."""
    if t is None:
        return True
    if t.is_meta or is_fake(t):  # (not t.device.type: building that string cost ~1 us a call)
        return t.storage_offset() * t.element_size() % 16 == 0
    return t.data_ptr() % 16 == 0


__all__ = ["aligned16", "chunks", "fp16_norm_overflow", "has_norm", "needs_unit_stride_copy", "num_rows",
           "prepares_input", "unit_stride_copies", "unit_stride_copy_bytes"]
