"""Plain-PyTorch reference of every eagle3 op: the documented ground truth.

Each function computes in ``acc_dtype`` (float32 by default, as the kernels do; tests pass
float64 to get the exact answer) and rounds once into the caller's tensors. Arguments are assumed
valid: ``eagle3_ops.validation`` checks them before any backend runs.
"""
from __future__ import annotations

from typing import Optional

import torch


def capture_ref(hidden: torch.Tensor, residual: Optional[torch.Tensor], buffer: torch.Tensor,
                slot: int, acc_dtype: torch.dtype = torch.float32) -> None:
    """buffer[:T, slot*H:(slot+1)*H] = hidden + residual (or hidden), one rounding."""
    T, H = hidden.shape
    if T == 0:
        return
    if residual is None:  # a pure copy (bit-exact, NaN payloads included)
        buffer[:T, slot * H:(slot + 1) * H].copy_(hidden)
        return
    value = hidden.to(acc_dtype) + residual.to(acc_dtype)
    buffer[:T, slot * H:(slot + 1) * H].copy_(value.to(buffer.dtype))


def rms_scale(x: torch.Tensor, eps: float) -> torch.Tensor:
    """rsqrt(mean(x^2) + eps) over the last dim, keepdim (x already in the accumulation dtype)."""
    return torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)


def fused_add_rmsnorm_capture_ref(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                  eps: float, buffer: torch.Tensor, slot: int,
                                  acc_dtype: torch.dtype = torch.float32) -> None:
    """SGLang ``fused_add_rmsnorm`` plus a capture of the new residual.

    Numerics follow SGLang/FlashInfer: ``s = input + residual`` in fp32; ``residual <- s`` rounded
    to its dtype; the norm reads the *unrounded* fp32 ``s``; ``input <- round(s * rsqrt(mean(s^2) +
    eps) * weight)``. The captured value is the stored (rounded) residual, exactly what SGLang's
    capture sees.
    """
    T, H = input.shape
    if T == 0:
        return
    s = input.to(acc_dtype) + residual.to(acc_dtype)
    normed = s * rms_scale(s, eps) * weight.to(acc_dtype)
    residual.copy_(s.to(residual.dtype))
    input.copy_(normed.to(input.dtype))
    buffer[:T, slot * H:(slot + 1) * H].copy_(residual)


def draft_fc_input_ref(x: torch.Tensor, rows: Optional[torch.Tensor],
                       chunk_norm_weight: Optional[torch.Tensor],
                       input_norm_weight: Optional[torch.Tensor], eps: float,
                       acc_dtype: torch.dtype = torch.float32, norm_folded: bool = False) -> torch.Tensor:
    """The normalized fc input ``norm(x[rows])`` in ``acc_dtype`` (never rounded in between).

    Rows outside [0, R) give NaN rows (the device-side contract); host-side callers raise earlier.
    Order when both norms are present: input_norm (whole K*H row), then chunk norm (per H slot),
    as in SGLang's llama_eagle3 draft. ``norm_folded``: only the RMS scales are applied (the norm
    weights live in the folded fc weight, :func:`fold_norm_weights_ref`); input_norm_weight still
    enters the chunk statistic, exactly as without folding.
    """
    R = x.shape[0]
    if rows is None:
        xs = x.to(acc_dtype)
        bad = None
    else:
        rows = rows.long()
        bad = (rows < 0) | (rows >= R)
        xs = x.index_select(0, rows.clamp(0, max(R - 1, 0))).to(acc_dtype) if R > 0 else \
            torch.empty((rows.numel(), x.shape[1]), dtype=acc_dtype, device=x.device)
    if input_norm_weight is not None:
        g_in = input_norm_weight.to(acc_dtype)
        scale = rms_scale(xs, eps)
        if norm_folded:  # the chunk statistic still sees x * s * g_in; the output gets x * s
            xs_stat, xs = xs * scale * g_in, xs * scale
        else:
            xs = xs_stat = xs * scale * g_in
    else:
        xs_stat = xs
    if chunk_norm_weight is not None:
        K, H = chunk_norm_weight.shape
        chunks = xs.view(xs.shape[0], K, H)
        scale = rms_scale(xs_stat.view(xs.shape[0], K, H), eps)
        gain = 1.0 if norm_folded else chunk_norm_weight.to(acc_dtype)
        xs = (chunks * scale * gain).reshape(xs.shape[0], K * H)
    if bad is not None:
        xs = torch.where(bad[:, None], torch.full_like(xs, float("nan")), xs)
    return xs


def draft_fc_ref(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                 rows: Optional[torch.Tensor] = None, chunk_norm_weight: Optional[torch.Tensor] = None,
                 input_norm_weight: Optional[torch.Tensor] = None, eps: float = 1e-6,
                 acc_dtype: torch.dtype = torch.float32, norm_folded: bool = False) -> torch.Tensor:
    """``linear(norm(x[rows]), weight, bias)`` accumulated in ``acc_dtype``, result in acc_dtype.
    ``norm_folded``: ``weight`` is ``fold_norm_weights_ref(W, ...)`` (same result as W unfolded,
    up to the rounding of the folded weight)."""
    xs = draft_fc_input_ref(x, rows, chunk_norm_weight, input_norm_weight, eps, acc_dtype, norm_folded)
    y = xs @ weight.to(acc_dtype).t()
    if bias is not None:
        y = y + bias.to(acc_dtype)
    return y


def fold_gains(chunk_norm_weight: Optional[torch.Tensor], input_norm_weight: Optional[torch.Tensor],
               acc_dtype: torch.dtype = torch.float32) -> Optional[torch.Tensor]:
    """g[k] = input_norm_weight[k] * chunk_norm_weight.flat[k] in ``acc_dtype`` (None without norms)."""
    g = None
    if input_norm_weight is not None:
        g = input_norm_weight.to(acc_dtype)
    if chunk_norm_weight is not None:
        gc = chunk_norm_weight.reshape(-1).to(acc_dtype)
        g = gc if g is None else g * gc
    return g


def fold_norm_weights_ref(weight: torch.Tensor, chunk_norm_weight: Optional[torch.Tensor],
                          input_norm_weight: Optional[torch.Tensor],
                          acc_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``weight[n, k] * g[k]`` (see :func:`fold_gains`), one rounding into weight's dtype."""
    return (weight.to(acc_dtype) * fold_gains(chunk_norm_weight, input_norm_weight, acc_dtype)).to(weight.dtype)


# ---- the backend functions (the contract of eagle3_ops/ops.py: the op's name, into caller memory) ----
def capture(hidden, residual, buffer, slot) -> None:
    """Backend ``capture`` in plain PyTorch: :func:`capture_ref` into ``buffer`` slot ``slot``."""
    capture_ref(hidden, residual, buffer, slot)


def fused_add_rmsnorm_capture(input, residual, weight, eps, buffer, slot) -> None:
    """Backend ``fused_add_rmsnorm_capture`` in plain PyTorch: :func:`fused_add_rmsnorm_capture_ref` (in place on input
    and residual, the new residual into ``buffer`` slot ``slot``)."""
    fused_add_rmsnorm_capture_ref(input, residual, weight, eps, buffer, slot)


class Plan:
    """The reference's plan of a draft_fc call: one path (plain PyTorch), no workspace."""
    path = None
    nbytes = 0


_PLAN = Plan()


def draft_fc_plan(x, weight, bias, rows, chunk_norm_weight, input_norm_weight, norm_folded: bool = False,
                  path=None) -> Plan:
    """The reference's planner: the same :class:`Plan` for every call (no path, no workspace); the arguments are the
    other backends' planner signature."""
    return _PLAN


def draft_fc(x, weight, bias, rows, chunk_norm_weight, input_norm_weight, eps, out, workspace,
             norm_folded: bool = False, planned=None) -> None:
    """Backend ``draft_fc`` in plain PyTorch: :func:`draft_fc_ref` (fp32 accumulation) rounded into ``out`` [M, N];
    ``workspace`` and ``planned`` are ignored."""
    out.copy_(draft_fc_ref(x, weight, bias, rows, chunk_norm_weight, input_norm_weight, eps,
                           norm_folded=norm_folded).to(out.dtype))


def draft_fc_workspace_bytes(x, weight, bias, rows, chunk_norm_weight, input_norm_weight,
                             norm_folded: bool = False) -> int:
    """Always 0: the reference needs no workspace (PyTorch allocates its own temporaries)."""
    return 0  # plain PyTorch allocates its temporaries itself
