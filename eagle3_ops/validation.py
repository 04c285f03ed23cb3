"""Argument checks shared by every backend, run before anything is written.

Messages name the argument and give the expected vs actual value. Shape/dtype/device checks work
on fake tensors too (they run in the fake impls, so torch.compile reports them at trace time);
value checks on ``rows`` run only on host tensors (a device-side check would sync the stream).
"""
from __future__ import annotations

from typing import Optional

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


def _check_supported_dtype(op: str, name: str, t: torch.Tensor) -> None:
    if t.dtype not in SUPPORTED_DTYPES:
        _fail(op, f"{name} has dtype {t.dtype}, expected one of bfloat16, float16, float32")


def _check_device(op: str, name: str, t: torch.Tensor, expected: torch.device) -> None:
    if t.device != expected:
        _fail(op, f"{name} is on {t.device}, expected {expected} (all tensors on one device)")


def _check_ndim(op: str, name: str, t: torch.Tensor, ndim: int, layout: str) -> None:
    if t.dim() != ndim:
        _fail(op, f"{name} must be {ndim}-D {layout}, got shape {tuple(t.shape)}")


def _check_last_dim_contiguous(op: str, name: str, t: torch.Tensor) -> None:
    if t.numel() > 0 and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        _fail(op, f"{name} must have a contiguous last dim (stride 1), got strides {tuple(t.stride())}")


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


def check_fused_add_rmsnorm_capture(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                    eps: float, buffer: torch.Tensor, slot: int) -> None:
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
    if not eps > 0.0:
        _fail(op, f"eps must be > 0, got {eps}")
    _check_capture_buffer(op, buffer, T, H, slot)


def check_draft_fc(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                   rows: Optional[torch.Tensor], chunk_norm_weight: Optional[torch.Tensor],
                   input_norm_weight: Optional[torch.Tensor], eps: float,
                   out: Optional[torch.Tensor] = None, op: str = "draft_fc") -> int:
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
    if (chunk_norm_weight is not None or input_norm_weight is not None) and not eps > 0.0:
        _fail(op, f"eps must be > 0, got {eps}")
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
    return M


def check_host_rows_in_range(x: torch.Tensor, rows: Optional[torch.Tensor], op: str = "draft_fc") -> None:
    """Raise on out-of-range host-side row indices (device indices give NaN rows instead: no sync)."""
    if rows is None or rows.device.type != "cpu" or rows.numel() == 0:
        return
    R = x.shape[0]
    lo, hi = int(rows.min()), int(rows.max())
    if lo < 0 or hi >= R:
        _fail(op, f"rows out of range: indices span [{lo}, {hi}], expected within [0, {R}) (x has {R} rows)")
