"""The eagle3 ops: one torch.library schema each (the public contract, DESIGN.md §4), the fake
impl beside it, and one real impl per device key that validates and hands off to the backend that
``dispatch.select`` picks (cuda → triton → reference).

Model code calls the thin Python functions at the bottom, never ``torch.ops.eagle3`` directly.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

from . import dispatch, validation

LIB = torch.library.Library("eagle3", "DEF")

SCHEMAS = {
    "capture": "capture(Tensor hidden, Tensor? residual, Tensor(a!) buffer, int slot) -> ()",
    "fused_add_rmsnorm_capture": ("fused_add_rmsnorm_capture(Tensor(a!) input, Tensor(b!) residual, "
                                  "Tensor weight, float eps, Tensor(c!) buffer, int slot) -> ()"),
    "draft_fc": ("draft_fc(Tensor x, Tensor weight, Tensor? bias, Tensor? rows, Tensor? chunk_norm_weight, "
                 "Tensor? input_norm_weight, float eps) -> Tensor"),
    "draft_fc_out": ("draft_fc_out(Tensor x, Tensor weight, Tensor? bias, Tensor? rows, "
                     "Tensor? chunk_norm_weight, Tensor? input_norm_weight, float eps, Tensor(a!) out) -> ()"),
}
for _schema in SCHEMAS.values():
    LIB.define(_schema)

DEVICE_KEYS = ("CPU", "CUDA")


def _debug() -> bool:
    from . import settings

    return bool(settings.get_or_default("EAGLE3_OPS_DEBUG", logging.getLogger("eagle3_ops")))


# ---- capture -------------------------------------------------------------------------------------
def _capture_impl(hidden, residual, buffer, slot):
    validation.check_capture(hidden, residual, buffer, slot)
    if hidden.shape[0] == 0:
        return
    _, fn = dispatch.select("capture", hidden.device, hidden.dtype)
    fn(hidden, residual, buffer, slot)


@torch.library.register_fake("eagle3::capture")
def _capture_fake(hidden, residual, buffer, slot):
    validation.check_capture(hidden, residual, buffer, slot)


# ---- fused_add_rmsnorm_capture -------------------------------------------------------------------
def _fused_impl(input, residual, weight, eps, buffer, slot):
    validation.check_fused_add_rmsnorm_capture(input, residual, weight, eps, buffer, slot)
    if input.shape[0] == 0:
        return
    _, fn = dispatch.select("fused_add_rmsnorm_capture", input.device, input.dtype)
    fn(input, residual, weight, eps, buffer, slot)


@torch.library.register_fake("eagle3::fused_add_rmsnorm_capture")
def _fused_fake(input, residual, weight, eps, buffer, slot):
    validation.check_fused_add_rmsnorm_capture(input, residual, weight, eps, buffer, slot)


# ---- draft_fc / draft_fc_out ---------------------------------------------------------------------
def _run_draft_fc(x, weight, bias, rows, chunk_norm_weight, input_norm_weight, eps, out, op):
    """After validation: range-check host rows, run the selected backend, debug-check device rows."""
    validation.check_host_rows_in_range(x, rows, op=op)
    if out.numel() == 0:
        return
    _, fn = dispatch.select("draft_fc", x.device, x.dtype)
    fn(x, weight, bias, rows, chunk_norm_weight, input_norm_weight, eps, out)
    if _debug() and rows is not None and rows.device.type != "cpu":
        # Device-side indices give NaN rows when out of range; debug mode makes that an error:
        # an async device assert inside CUDA-graph capture (no sync allowed), else a host check.
        bad = (rows < 0) | (rows >= x.shape[0])
        if torch.cuda.is_current_stream_capturing():
            torch._assert_async(~bad.any(), f"eagle3::{op}: rows out of range (EAGLE3_OPS_DEBUG=1)")
        elif bool(bad.any()):
            raise IndexError(f"eagle3::{op}: rows out of range at positions "
                             f"{bad.nonzero().flatten().tolist()[:16]} (x has {x.shape[0]} rows)")


def _draft_fc_out_impl(x, weight, bias, rows, chunk_norm_weight, input_norm_weight, eps, out):
    validation.check_draft_fc(x, weight, bias, rows, chunk_norm_weight, input_norm_weight, eps, out, op="draft_fc_out")
    _run_draft_fc(x, weight, bias, rows, chunk_norm_weight, input_norm_weight, eps, out, "draft_fc_out")


def _draft_fc_impl(x, weight, bias, rows, chunk_norm_weight, input_norm_weight, eps):
    M = validation.check_draft_fc(x, weight, bias, rows, chunk_norm_weight, input_norm_weight, eps)
    out = torch.empty((M, weight.shape[0]), dtype=x.dtype, device=x.device)
    _run_draft_fc(x, weight, bias, rows, chunk_norm_weight, input_norm_weight, eps, out, "draft_fc")
    return out


@torch.library.register_fake("eagle3::draft_fc")
def _draft_fc_fake(x, weight, bias, rows, chunk_norm_weight, input_norm_weight, eps):
    M = validation.check_draft_fc(x, weight, bias, rows, chunk_norm_weight, input_norm_weight, eps)
    return x.new_empty((M, weight.shape[0]))


@torch.library.register_fake("eagle3::draft_fc_out")
def _draft_fc_out_fake(x, weight, bias, rows, chunk_norm_weight, input_norm_weight, eps, out):
    validation.check_draft_fc(x, weight, bias, rows, chunk_norm_weight, input_norm_weight, eps, out, op="draft_fc_out")


for _key in DEVICE_KEYS:
    LIB.impl("capture", _capture_impl, _key)
    LIB.impl("fused_add_rmsnorm_capture", _fused_impl, _key)
    LIB.impl("draft_fc", _draft_fc_impl, _key)
    LIB.impl("draft_fc_out", _draft_fc_out_impl, _key)


# ---- the Python face -----------------------------------------------------------------------------
def capture(hidden: torch.Tensor, residual: Optional[torch.Tensor], buffer: torch.Tensor, slot: int) -> None:
    """``buffer[:T, slot*H:(slot+1)*H] = hidden + residual`` (or ``hidden``); nothing else changes."""
    torch.ops.eagle3.capture.default(hidden, residual, buffer, slot)


def fused_add_rmsnorm_capture(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                              buffer: torch.Tensor, slot: int) -> None:
    """SGLang ``fused_add_rmsnorm(input, residual, weight, eps)`` that also writes the new residual
    into ``buffer`` slot ``slot``."""
    torch.ops.eagle3.fused_add_rmsnorm_capture.default(input, residual, weight, eps, buffer, slot)


def draft_fc(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
             rows: Optional[torch.Tensor] = None, chunk_norm_weight: Optional[torch.Tensor] = None,
             input_norm_weight: Optional[torch.Tensor] = None, eps: float = 1e-6) -> torch.Tensor:
    """``linear(norm(x[rows]), weight, bias)`` → new [M, N] tensor."""
    return torch.ops.eagle3.draft_fc.default(x, weight, bias, rows, chunk_norm_weight, input_norm_weight, eps)


def draft_fc_out(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                 rows: Optional[torch.Tensor], chunk_norm_weight: Optional[torch.Tensor],
                 input_norm_weight: Optional[torch.Tensor], eps: float, out: torch.Tensor) -> None:
    """``draft_fc`` into a preallocated ``out`` [M, N] (no allocation: CUDA-graph friendly)."""
    torch.ops.eagle3.draft_fc_out.default(x, weight, bias, rows, chunk_norm_weight, input_norm_weight, eps, out)
