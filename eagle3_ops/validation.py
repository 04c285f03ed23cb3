"""Argument checks shared by every backend, run before anything is written: the op contract.

Messages name the argument and give the expected vs actual value. Shape/dtype/device checks work
on fake tensors too (they run in the fake impls, so torch.compile reports them at trace time);
value checks on ``rows`` run only on host tensors (a device-side check would sync the stream).

Beyond shapes and dtypes the contract rejects, identically for every backend:

* a written tensor that overlaps another argument (``out`` inside ``x``; ``input is residual``; an
  input inside the capture buffer's slot) or itself (an expanded, zero-stride output): backends
  would give different answers (or race) on such memory;
* a written tensor that requires grad (the ops are forward-only and mutate their outputs);
* ``slot`` that is not a Python int in int64 range, ``eps`` that is not finite and > 0.

Overlap is decided on the bytes two views cover: storages in separate memory or disjoint byte
ranges never overlap (two storages over one buffer, as ``torch.frombuffer`` makes, are compared by
address); two 2-D row-major views of one matrix (same row stride) overlap iff their row and column
ranges both intersect (so two slots of one capture buffer do not); anything else sharing bytes is
treated as overlapping.
"""
from __future__ import annotations

from typing import Optional

import math

import torch

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ROW_INDEX_DTYPES = (torch.int32, torch.int64)


class Eagle3ArgumentError(ValueError):
    """An invalid argument to an eagle3 op (raised before any output is touched)."""


def _fail(op: str, msg: str) -> None:
    raise Eagle3ArgumentError(f"eagle3::{op}: {msg}")


def _check_dtype(op: str, name: str, t: torch.Tensor, expected: torch.dtype) -> None:
    if t.dtype != expected:
        _fail(op, f"{name} has dtype {t.dtype}, expected {expected} (same dtype as the other tensors)")


def _check_resolved(op: str, name: str, t: torch.Tensor) -> None:
    """No lazy negation or conjugation bit (e.g. ``.imag`` of a conjugated complex tensor): the
    kernels read the memory as it is, which holds the values before the pending negation."""
    if t.is_neg() or t.is_conj():
        _fail(op, f"{name} carries a pending {'negation' if t.is_neg() else 'conjugation'} (a lazy view: "
                  f"the memory holds other values than the tensor); pass {name}.resolve_neg() / .resolve_conj()")


def _check_supported_dtype(op: str, name: str, t: torch.Tensor) -> None:
    if t.dtype not in SUPPORTED_DTYPES:
        _fail(op, f"{name} has dtype {t.dtype}, expected one of bfloat16, float16, float32")
    _check_resolved(op, name, t)


def _check_device(op: str, name: str, t: torch.Tensor, expected: torch.device) -> None:
    if t.device != expected:
        _fail(op, f"{name} is on {t.device}, expected {expected} (all tensors on one device)")
    _check_resolved(op, name, t)


def _check_ndim(op: str, name: str, t: torch.Tensor, ndim: int, layout: str) -> None:
    if t.dim() != ndim:
        _fail(op, f"{name} must be {ndim}-D {layout}, got shape {tuple(t.shape)}")


def _check_last_dim_contiguous(op: str, name: str, t: torch.Tensor) -> None:
    if t.numel() > 0 and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        _fail(op, f"{name} must have a contiguous last dim (stride 1), got strides {tuple(t.stride())}")


def check_int(op: str, name: str, value) -> int:
    """A Python int (not bool) in int64 range: the schema's ``int``, checked before torch sees it."""
    if isinstance(value, bool) or not isinstance(value, int):
        _fail(op, f"{name} must be an int, got {type(value).__name__} {value!r}")
    if not -(1 << 63) <= value < (1 << 63):
        _fail(op, f"{name}={value} is outside the int64 range")
    return value


def check_eps(op: str, eps) -> float:
    """``eps`` as a float; raises Eagle3ArgumentError naming ``op`` unless it is a finite number > 0 (a bool is
    refused)."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(float(eps)) or eps <= 0:
        _fail(op, f"eps must be a finite float > 0, got {eps!r}")
    return float(eps)


def _byte_range(t: torch.Tensor):
    lo = t.storage_offset()
    hi = lo + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()) if size > 0) + 1
    return lo * t.element_size(), hi * t.element_size()


def _matrix_box(t: torch.Tensor, row_stride: int):
    """(rows, cols) covered by a 2-D row-major view of a matrix with ``row_stride`` elements per row,
    or None if the view is not one (then overlap is decided conservatively)."""
    if t.dim() != 2 or (t.shape[1] > 1 and t.stride(1) != 1) or (t.shape[0] > 1 and t.stride(0) != row_stride):
        return None
    r0, c0 = divmod(t.storage_offset(), row_stride)
    if c0 + t.shape[1] > row_stride:
        return None
    return (r0, r0 + t.shape[0]), (c0, c0 + t.shape[1])


def is_fake(t: torch.Tensor) -> bool:
    """Whether t is a FakeTensor (or wraps one: a functional tensor of a fake). A plain tensor that
    is no functional wrapper never is: the usual case, decided in ~0.2 us instead of ~3 us."""
    if type(t) is torch.Tensor and not torch._is_functional_tensor(t):
        return False
    from torch._subclasses.fake_tensor import is_fake

    return bool(is_fake(t))


def _storage_span(t: torch.Tensor):
    """(address, bytes) of t's storage for a plain CPU/CUDA tensor (None otherwise: meta, fake,
    functional, no storage)."""
    if type(t) is not torch.Tensor or t.is_meta or torch._is_functional_tensor(t):
        return None
    try:
        st = t.untyped_storage()
        return st.data_ptr(), st.nbytes()
    except (RuntimeError, NotImplementedError):
        return None


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two views may share an element (see the module docstring)."""
    sa, sb = _storage_span(a), _storage_span(b)
    if sa is not None and sb is not None and sa[0] != sb[0]:
        if sa[0] + sa[1] <= sb[0] or sb[0] + sb[1] <= sa[0]:  # the usual case: separate memory, ~1 us
            return False
        # two storages over shared memory (torch.frombuffer / from_blob of one buffer): by addresses
        if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
            return False
        (alo, ahi), (blo, bhi) = _byte_range(a), _byte_range(b)
        a0, b0 = a.data_ptr(), b.data_ptr()  # the first byte of each view: its storage's + alo / blo
        return a0 < b0 + (bhi - blo) and b0 < a0 + (ahi - alo)
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device or a.device.type == "meta":
        return False
    if is_fake(a) or is_fake(b):  # tracing (torch.compile, fake impls): decided by the real call
        return False
    try:
        if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
            return False
    except (RuntimeError, NotImplementedError):  # fake / functional tensors: no storage to compare
        return False
    (alo, ahi), (blo, bhi) = _byte_range(a), _byte_range(b)
    if ahi <= blo or bhi <= alo:
        return False
    if a.dtype == b.dtype and a.dim() == 2 and b.dim() == 2:
        stride = a.stride(0) if a.shape[0] > 1 else (b.stride(0) if b.shape[0] > 1 else None)
        if stride:
            box_a, box_b = _matrix_box(a, stride), _matrix_box(b, stride)
            if box_a is not None and box_b is not None:
                (ar, ac), (br, bc) = box_a, box_b
                return ar[0] < br[1] and br[0] < ar[1] and ac[0] < bc[1] and bc[0] < ac[1]
    return True


def check_writes(op: str, written: dict, read: dict) -> None:
    """Every written tensor: no internal overlap, no requires_grad, no overlap with any other argument.
    O(number of arguments^2) storage comparisons, each O(1) (no element is read)."""
    writes = [(n, t) for n, t in written.items() if t is not None]
    for name, t in writes:
        if t.requires_grad:
            _fail(op, f"{name} requires grad: eagle3 ops write it in place and are forward-only "
                      f"(pass a tensor that does not require grad, e.g. under torch.no_grad())")
        if t.numel() > 1 and not t.is_meta and not is_fake(t) and torch._debug_has_internal_overlap(t) == 1:
            _fail(op, f"{name} has overlapping elements (an expanded or zero-stride view, strides "
                      f"{tuple(t.stride())}); it must not write one memory location twice")
    others = writes + [(n, t) for n, t in read.items() if t is not None]
    for name, w in writes:
        for other, t in others:
            if other == name:
                continue
            if t is w:
                _fail(op, f"{name} and {other} are the same tensor; they must be distinct memory")
            if overlaps(w, t):
                _fail(op, f"{name} overlaps {other} in memory; a written tensor must not share memory with "
                          f"another argument")


def check_no_grad_inputs(op: str, tensors: dict) -> None:
    """The ops are forward-only: a differentiable input that requires grad (with grad mode on) is
    an error on every backend, eager and under torch.compile, instead of a silently missing grad."""
    if not torch.is_grad_enabled():
        return
    for name, t in tensors.items():
        if t is not None and t.requires_grad:
            _fail(op, f"{name} requires grad, but eagle3 ops are forward-only (no backward is defined); "
                      f"call them under torch.no_grad() or pass a detached tensor")


def _check_capture_buffer(op: str, buffer: torch.Tensor, T: int, H: int, slot: int) -> None:
    _check_ndim(op, "buffer", buffer, 2, "[rows, K*hidden]")
    _check_last_dim_contiguous(op, "buffer", buffer)
    R, W = buffer.shape
    if H == 0 or W % H != 0 or W == 0:
        _fail(op, f"buffer width {W} is not a positive multiple of hidden size {H}")
    K = W // H
    if not 0 <= slot < K:
        _fail(op, f"slot {slot} out of range: buffer holds K={K} captures of width {H}, expected 0 <= slot < {K}")
    if R < T:
        _fail(op, f"buffer has {R} rows, expected at least T={T} (the number of tokens)")


def check_capture(hidden: torch.Tensor, residual: Optional[torch.Tensor], buffer: torch.Tensor,
                  slot: int) -> None:
    """The contract of ``capture`` (also its fake): hidden [T, H] of a supported dtype, residual None or like hidden, a
    [rows, K*H] buffer of the same dtype and device with room for T rows at ``slot``, and a slot that overlaps no input.
    Raises Eagle3ArgumentError."""
    op = "capture"
    _check_ndim(op, "hidden", hidden, 2, "[T, hidden]")
    _check_supported_dtype(op, "hidden", hidden)
    _check_last_dim_contiguous(op, "hidden", hidden)
    T, H = hidden.shape
    if residual is not None:
        _check_ndim(op, "residual", residual, 2, "[T, hidden]")
        _check_dtype(op, "residual", residual, hidden.dtype)
        _check_device(op, "residual", residual, hidden.device)
        if tuple(residual.shape) != (T, H):
            _fail(op, f"residual has shape {tuple(residual.shape)}, expected {(T, H)} (same as hidden)")
        _check_last_dim_contiguous(op, "residual", residual)
    _check_dtype(op, "buffer", buffer, hidden.dtype)
    _check_device(op, "buffer", buffer, hidden.device)
    _check_capture_buffer(op, buffer, T, H, slot)
    if T > 0:
        check_writes(op, {"buffer": buffer[:T, slot * H:(slot + 1) * H]}, {"hidden": hidden, "residual": residual})


def check_fused_add_rmsnorm_capture(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                    eps: float, buffer: torch.Tensor, slot: int) -> None:
    """The contract of ``fused_add_rmsnorm_capture`` (also its fake): input and residual [T, H], weight [H], all one
    dtype and device, eps > 0, a buffer with room at ``slot``, and input, residual and the slot distinct memory that
    overlaps nothing else. Raises Eagle3ArgumentError."""
    op = "fused_add_rmsnorm_capture"
    _check_ndim(op, "input", input, 2, "[T, hidden]")
    _check_supported_dtype(op, "input", input)
    _check_last_dim_contiguous(op, "input", input)
    T, H = input.shape
    for name, t in (("residual", residual), ("buffer", buffer), ("weight", weight)):
        _check_dtype(op, name, t, input.dtype)
        _check_device(op, name, t, input.device)
    _check_ndim(op, "residual", residual, 2, "[T, hidden]")
    if tuple(residual.shape) != (T, H):
        _fail(op, f"residual has shape {tuple(residual.shape)}, expected {(T, H)} (same as input)")
    _check_last_dim_contiguous(op, "residual", residual)
    if tuple(weight.shape) != (H,):
        _fail(op, f"weight has shape {tuple(weight.shape)}, expected ({H},) (the hidden size)")
    _check_last_dim_contiguous(op, "weight", weight)
    check_eps(op, eps)
    _check_capture_buffer(op, buffer, T, H, slot)
    if input is residual:
        _fail(op, "input and residual are the same tensor; they must be distinct memory")
    if T > 0:
        check_writes(op, {"input": input, "residual": residual, "buffer": buffer[:T, slot * H:(slot + 1) * H]},
                     {"weight": weight})


# fp16 folded weights with an input norm: the tiled and cuBLAS paths round x * (RMS scales) to the
# dtype before the product; without g the chunk scale carries ~1/input_norm_weight, which can exceed
# fp16's range where the unfolded norm(x) cannot. bf16 (fp32's range) and fp16 without input norm
# (the chunk-normalized x has RMS 1) are safe.
FOLDED_FP16_INPUT_NORM = ("{op}: norm_folded with float16 and input_norm_weight is refused: the scaled input of the "
                          "tiled/cuBLAS paths could overflow float16 without the norm weights; fold in bfloat16 or "
                          "serve float16 unfolded")


def draft_fc_output_shape(op: str, x: torch.Tensor, weight: torch.Tensor, rows: Optional[torch.Tensor]) -> tuple:
    """(M, N) of draft_fc's output, from the ranks alone (with check_draft_fc's messages): what a face needs to
    allocate ``out`` before the out= op checks everything else."""
    _check_ndim(op, "x", x, 2, "[rows, K*hidden]")
    _check_ndim(op, "weight", weight, 2, "[N, K*hidden] (nn.Linear layout)")
    if rows is not None:
        _check_ndim(op, "rows", rows, 1, "[M] row indices")
    return (x.shape[0] if rows is None else rows.shape[0]), weight.shape[0]


def check_draft_fc(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                   rows: Optional[torch.Tensor], chunk_norm_weight: Optional[torch.Tensor],
                   input_norm_weight: Optional[torch.Tensor], eps: float,
                   out: Optional[torch.Tensor] = None, op: str = "draft_fc",
                   workspace: Optional[torch.Tensor] = None, norm_folded: bool = False) -> int:
    """Checks draft_fc arguments; returns M, the number of output rows."""
    _check_ndim(op, "x", x, 2, "[rows, K*hidden]")
    _check_supported_dtype(op, "x", x)
    _check_last_dim_contiguous(op, "x", x)
    R, KH = x.shape
    _check_ndim(op, "weight", weight, 2, "[N, K*hidden] (nn.Linear layout)")
    _check_dtype(op, "weight", weight, x.dtype)
    _check_device(op, "weight", weight, x.device)
    _check_last_dim_contiguous(op, "weight", weight)
    N = weight.shape[0]
    if weight.shape[1] != KH:
        _fail(op, f"weight has shape {tuple(weight.shape)}, expected [N, {KH}] (in_features = x width {KH})")
    if bias is not None:
        _check_dtype(op, "bias", bias, x.dtype)
        _check_device(op, "bias", bias, x.device)
        if tuple(bias.shape) != (N,):
            _fail(op, f"bias has shape {tuple(bias.shape)}, expected ({N},) (out_features of weight)")
    if chunk_norm_weight is not None:
        _check_dtype(op, "chunk_norm_weight", chunk_norm_weight, x.dtype)
        _check_device(op, "chunk_norm_weight", chunk_norm_weight, x.device)
        if chunk_norm_weight.dim() != 2 or chunk_norm_weight.shape[0] * chunk_norm_weight.shape[1] != KH \
                or chunk_norm_weight.shape[1] == 0:
            _fail(op, f"chunk_norm_weight has shape {tuple(chunk_norm_weight.shape)}, expected [K, hidden] "
                      f"with K*hidden = {KH} (x width)")
        if not chunk_norm_weight.is_contiguous():
            _fail(op, "chunk_norm_weight must be contiguous")
    if input_norm_weight is not None:
        _check_dtype(op, "input_norm_weight", input_norm_weight, x.dtype)
        _check_device(op, "input_norm_weight", input_norm_weight, x.device)
        if tuple(input_norm_weight.shape) != (KH,):
            _fail(op, f"input_norm_weight has shape {tuple(input_norm_weight.shape)}, expected ({KH},) (x width)")
        _check_last_dim_contiguous(op, "input_norm_weight", input_norm_weight)
    for name, t in (("input_norm_weight", input_norm_weight), ("chunk_norm_weight", chunk_norm_weight)):
        if t is not None and KH == 0:
            _fail(op, f"{name} given but x has width 0: there is nothing to normalize")
    check_eps(op, eps)
    if norm_folded and chunk_norm_weight is None and input_norm_weight is None:
        _fail(op, "norm_folded=True but neither chunk_norm_weight nor input_norm_weight is given: a folded weight "
                  "needs the norm weights it was folded with (for the RMS scales)")
    if norm_folded and x.dtype == torch.float16 and input_norm_weight is not None:
        raise Eagle3ArgumentError(FOLDED_FP16_INPUT_NORM.format(op=f"eagle3::{op}"))
    if rows is None:
        M = R
    else:
        if rows.dtype not in ROW_INDEX_DTYPES:
            _fail(op, f"rows has dtype {rows.dtype}, expected torch.int32 or torch.int64")
        _check_device(op, "rows", rows, x.device)
        _check_ndim(op, "rows", rows, 1, "[M] row indices")
        M = rows.shape[0]
    if out is not None:
        _check_dtype(op, "out", out, x.dtype)
        _check_device(op, "out", out, x.device)
        _check_ndim(op, "out", out, 2, "[M, N]")
        if tuple(out.shape) != (M, N):
            _fail(op, f"out has shape {tuple(out.shape)}, expected {(M, N)}")
        _check_last_dim_contiguous(op, "out", out)
    reads = {"x": x, "weight": weight, "bias": bias, "rows": rows, "chunk_norm_weight": chunk_norm_weight,
             "input_norm_weight": input_norm_weight}
    if workspace is not None:
        if workspace.dtype != torch.uint8 or workspace.dim() != 1 or not workspace.is_contiguous():
            _fail(op, f"workspace must be a contiguous 1-D uint8 tensor, got {workspace.dtype} with shape "
                      f"{tuple(workspace.shape)}")
        _check_device(op, "workspace", workspace, x.device)
        if workspace.device.type != "meta" and not is_fake(workspace) and workspace.numel() \
                and workspace.data_ptr() % 16:
            _fail(op, f"workspace must start on a 16-byte boundary (the kernels' vector loads), got address "
                      f"{workspace.data_ptr():#x}")
    check_writes(op, {"out": out, "workspace": workspace}, reads)
    return M


def check_host_rows_in_range(x: torch.Tensor, rows: Optional[torch.Tensor], op: str = "draft_fc") -> None:
    """Raise on out-of-range host-side row indices (device indices give NaN rows instead: no sync)."""
    if rows is None or rows.device.type != "cpu" or rows.numel() == 0:
        return
    R = x.shape[0]
    lo, hi = (int(v) for v in torch.aminmax(rows))  # one pass over the indices
    if lo < 0 or hi >= R:
        _fail(op, f"rows out of range: indices span [{lo}, {hi}], expected within [0, {R}) (x has {R} rows)")
