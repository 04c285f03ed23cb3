"""Triton twins of the capture kernels (csrc/capture.cu, csrc/fused_add_rmsnorm_capture.cu).

``capture``: ``buffer[:T, slot*H:(slot+1)*H] = hidden + residual`` (or ``hidden``), fp32 add, one
rounding. Bytes: reads T*H (2*T*H with residual), writes T*H elements; floor = bytes / copy
bandwidth. Grid: (T, cdiv(H, BLOCK)): one program per (row, BLOCK-column chunk), masked tail.

``fused_add_rmsnorm_capture``: SGLang's ``fused_add_rmsnorm`` plus one extra store of the new
residual into the buffer slot. Bytes: reads 2*T*H (+H weight, L2-resident), writes 3*T*H elements.
Grid: (T,): one program per row. Rows up to ``MAX_ROW_BLOCK`` elements are held whole in
registers (one read of input and residual); wider rows take a two-pass loop (the second pass
re-reads the row, mostly from L2).

Numerics (same as SGLang ``RMSNorm.forward_native`` with a residual, and FlashInfer's
``fused_add_rmsnorm``): ``s = float(input) + float(residual)``; ``residual <- round(s)`` and the
buffer slot gets the same rounded value; the norm reads the *unrounded* fp32 ``s``:
``input <- round(s * rsqrt(sum(s*s) / H + eps) * float(weight))``.

Arguments are already validated (eagle3_ops.validation); T > 0. Both functions write only into
caller memory, launch on the current stream and never synchronize (CUDA-graph safe once the
kernels are compiled). Under ``TRITON_INTERPRET=1`` they run on CPU tensors (how CI tests them),
one launch at a time across threads (``draft_fc.interpreter_serialized``: the interpreter is not
thread-safe); ``_interpreter_shim.cast`` then rounds bf16 outputs to nearest even as the GPU does
(the interpreter truncates). Row index x row stride is computed in int64 (T * stride may exceed
2^31).
"""
from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from ._interpreter_shim import cast, interpreter_bf16
from .draft_fc import interpreter_serialized

# Widest row held whole by one fused program (elements); wider rows use the two-pass kernel.
MAX_ROW_BLOCK = 16384
# Column chunk of the two-pass fused kernel and the widest chunk of one capture program.
CHUNK_BLOCK = 4096
CAPTURE_BLOCK = 2048


@triton.jit
def _capture_kernel(hidden_ptr, hidden_stride, residual_ptr, residual_stride, out_ptr, out_stride, H,
                    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, INTERPRETER_BF16: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    v = tl.load(hidden_ptr + row * hidden_stride + cols, mask=mask).to(tl.float32)
    if HAS_RESIDUAL:
        v += tl.load(residual_ptr + row * residual_stride + cols, mask=mask).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, cast(v, out_ptr.dtype.element_ty, INTERPRETER_BF16),
             mask=mask)


@triton.jit
def _fused_row_kernel(input_ptr, input_stride, residual_ptr, residual_stride, weight_ptr, out_ptr, out_stride,
                      H, eps, BLOCK: tl.constexpr, INTERPRETER_BF16: tl.constexpr):
    """The whole row in registers: one read of input and residual."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(input_ptr + row * input_stride + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(residual_ptr + row * residual_stride + cols, mask=mask, other=0.0).to(tl.float32)
    s = x + r  # unrounded fp32 sum: the norm reads this, not the stored residual
    s_rounded = cast(s, residual_ptr.dtype.element_ty, INTERPRETER_BF16)
    tl.store(residual_ptr + row * residual_stride + cols, s_rounded, mask=mask)
    tl.store(out_ptr + row * out_stride + cols, s_rounded, mask=mask)
    rstd = tl.math.rsqrt(tl.sum(s * s, axis=0) / H + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = cast(s * rstd * w, input_ptr.dtype.element_ty, INTERPRETER_BF16)
    tl.store(input_ptr + row * input_stride + cols, y, mask=mask)


@triton.jit
def _fused_two_pass_kernel(input_ptr, input_stride, residual_ptr, residual_stride, weight_ptr, out_ptr, out_stride,
                           H, eps, BLOCK: tl.constexpr, INTERPRETER_BF16: tl.constexpr):
    """Rows wider than one program holds: pass 1 sums squares, pass 2 re-reads, recomputes the
    (bitwise identical) sum and writes. Nothing is written before pass 2, so the old residual is
    still there to re-read."""
    row = tl.program_id(0).to(tl.int64)
    in_row = input_ptr + row * input_stride
    res_row = residual_ptr + row * residual_stride
    out_row = out_ptr + row * out_stride
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, H, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < H
        s = tl.load(in_row + cols, mask=mask, other=0.0).to(tl.float32) + \
            tl.load(res_row + cols, mask=mask, other=0.0).to(tl.float32)
        acc += s * s
    rstd = tl.math.rsqrt(tl.sum(acc, axis=0) / H + eps)
    for start in range(0, H, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < H
        s = tl.load(in_row + cols, mask=mask, other=0.0).to(tl.float32) + \
            tl.load(res_row + cols, mask=mask, other=0.0).to(tl.float32)
        s_rounded = cast(s, residual_ptr.dtype.element_ty, INTERPRETER_BF16)
        tl.store(res_row + cols, s_rounded, mask=mask)
        tl.store(out_row + cols, s_rounded, mask=mask)
        w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        y = cast(s * rstd * w, input_ptr.dtype.element_ty, INTERPRETER_BF16)
        tl.store(in_row + cols, y, mask=mask)


def _num_warps(block: int) -> int:
    return 4 if block <= 1024 else (8 if block <= 4096 else 16)


def _on_device(t: torch.Tensor):
    """Triton launches on the current CUDA device; make it the tensors' one."""
    if t.device.type == "cuda" and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


def _slot_view(buffer: torch.Tensor, T: int, H: int, slot: int) -> torch.Tensor:
    return buffer[:T, slot * H:(slot + 1) * H]


def capture(hidden: torch.Tensor, residual, buffer: torch.Tensor, slot: int) -> None:
    """Backend ``capture``: one Triton launch writing ``hidden + residual`` (or ``hidden``) [T, H] into ``buffer[:T,
    slot*H:(slot+1)*H]``; validated arguments, T > 0."""
    T, H = hidden.shape
    out = _slot_view(buffer, T, H, slot)
    block = min(triton.next_power_of_2(H), CAPTURE_BLOCK)
    grid = (T, triton.cdiv(H, block))
    has_residual = residual is not None
    res = residual if has_residual else hidden  # never read when HAS_RESIDUAL is False
    with _on_device(hidden), interpreter_serialized(_capture_kernel):
        _capture_kernel[grid](hidden, hidden.stride(0), res, res.stride(0), out, out.stride(0), H,
                              HAS_RESIDUAL=has_residual, BLOCK=block, num_warps=_num_warps(block),
                              INTERPRETER_BF16=interpreter_bf16(_capture_kernel, hidden.dtype))


def fused_add_rmsnorm_capture(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                              buffer: torch.Tensor, slot: int) -> None:
    """Backend ``fused_add_rmsnorm_capture``: residual and buffer slot get ``round(input + residual)``, input gets its
    RMSNorm times ``weight`` (see the module doc); one program per row, a two-pass kernel for rows wider than
    ``MAX_ROW_BLOCK``."""
    T, H = input.shape
    out = _slot_view(buffer, T, H, slot)
    args = (input, input.stride(0), residual, residual.stride(0), weight, out, out.stride(0), H, float(eps))
    block = triton.next_power_of_2(H)
    if block <= MAX_ROW_BLOCK:
        kernel, block = _fused_row_kernel, block
    else:
        kernel, block = _fused_two_pass_kernel, min(CHUNK_BLOCK, MAX_ROW_BLOCK)
    with _on_device(input), interpreter_serialized(kernel):
        kernel[(T,)](*args, BLOCK=block, num_warps=_num_warps(block),
                     INTERPRETER_BF16=interpreter_bf16(kernel, input.dtype))
