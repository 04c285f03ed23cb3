"""The eagle3 ops registered with torch, and the Python face model code calls.

Each op is declared once, in ``registry.py`` (schema, contract/fake, tensor arguments, backend
modules, self-check); this module defines the ops from those rows, registers the real impl of each
(one function per op below, ``@_implements``), the fakes and the forward-only autograd kernels, and
holds the Python functions at the bottom.

Every backend function has the signature of the op (draft_fc: into ``out``, with a ``workspace``, and
the ``planned`` call of its ``draft_fc_plan``), receives validated arguments and a non-empty output, and
allocates nothing (docs/design.md §4, §7.2).

One contract, one way through: each face calls ``torch.ops.eagle3.<op>``; the dispatcher runs the
forward-only Autograd guard, then the impl, which checks the contract (``validation.py``, the same
function the op's fake is) and runs the backend ``dispatch.select`` names. Under torch.compile, fake
tensors or any mode the same op is traced. The SGLang plugin's hot calls do not come through here:
they run calls planned once at install (:mod:`eagle3_ops.bound`).
"""
from __future__ import annotations

import logging
from typing import Callable, Dict, Optional

import torch

from . import dispatch, validation
from . import workspace as _workspace
from .registry import OPS

LIB = torch.library.Library("eagle3", "DEF")
DEVICE_KEYS = ("CPU", "CUDA")
log = logging.getLogger("eagle3_ops")
_impls: Dict[str, Callable] = {}  # op name -> its real impl (CPU and CUDA keys)


def _forward_only(name: str):
    """Autograd-key kernel: refuse inputs that require grad (the same error on every backend and
    under torch.compile), else run the op below autograd."""
    overload = getattr(torch.ops.eagle3, name).default

    def kernel(*args, **kwargs):
        validation.check_no_grad_inputs(name, _tensor_args(name, args))
        with torch._C._AutoDispatchBelowAutograd():
            return overload(*args, **kwargs)

    return kernel


def _tensor_args(name: str, args) -> dict:
    return {n: a for n, a in zip(OPS[name].tensor_args, args) if n is not None and isinstance(a, torch.Tensor)}


for _op in OPS.values():
    LIB.define(_op.schema)
    torch.library.register_fake(f"eagle3::{_op.name}")(_op.fake)
    LIB.impl(_op.name, _forward_only(_op.name), "Autograd")


def _implements(name: str):
    """Registers the decorated function as the real impl (CPU and CUDA) of op ``name``."""
    def register(impl: Callable) -> Callable:
        for key in DEVICE_KEYS:
            LIB.impl(name, impl, key)
        _impls[name] = impl
        return impl
    return register


def _debug() -> bool:
    from . import settings

    return bool(settings.get_or_default("EAGLE3_OPS_DEBUG", log))


# ---- the real impls ------------------------------------------------------------------------------
# Each checks the op's contract (the same check is the op's fake, registry.py), then runs the backend
# dispatch.select names for the device and dtype.
@_implements("capture")
def _capture_impl(hidden, residual, buffer, slot):
    validation.check_capture(hidden, residual, buffer, slot)
    if hidden.shape[0] == 0:
        return
    dispatch.select("capture", hidden.device, hidden.dtype)[1](hidden, residual, buffer, slot)


@_implements("fused_add_rmsnorm_capture")
def _fused_impl(input, residual, weight, eps, buffer, slot):
    validation.check_fused_add_rmsnorm_capture(input, residual, weight, eps, buffer, slot)
    if input.shape[0] == 0:
        return
    dispatch.select("fused_add_rmsnorm_capture", input.device, input.dtype)[1](
        input, residual, weight, eps, buffer, slot)


def _run_draft_fc(x, weight, bias, rows, chunk_norm_weight, input_norm_weight, eps, out, workspace, op,
                  norm_folded=False):
    """After validation: range-check host rows, skip an empty output, plan the call once on the selected
    backend (path, launch, workspace bytes), check or take the workspace, run it, debug-check device rows."""
    validation.check_host_rows_in_range(x, rows, op=op)
    if out.numel() == 0:
        return
    backend, fn = dispatch.select("draft_fc", x.device, x.dtype)
    args = (x, weight, bias, rows, chunk_norm_weight, input_norm_weight)
    planned = dispatch.function(backend, "draft_fc_plan")(*args, norm_folded)
    need = planned.nbytes
    if workspace is None:
        workspace = _workspace.scratch(x.device, need) if need else None
    elif workspace.numel() < need:
        raise validation.Eagle3ArgumentError(
            f"eagle3::{op}: workspace has {workspace.numel()} bytes, this call needs {need} "
            f"(eagle3_ops.draft_fc_workspace_bytes gives the size)")
    fn(*args, eps, out, workspace, norm_folded, planned=planned)
    if rows is not None and not rows.is_cpu and _debug():
        # Device-side indices give NaN rows when out of range; debug mode makes that an error:
        # an async device assert inside CUDA-graph capture (no sync allowed), else a host check.
        bad = (rows < 0) | (rows >= x.shape[0])
        if torch.cuda.is_current_stream_capturing():
            torch._assert_async(~bad.any(), f"eagle3::{op}: rows out of range (EAGLE3_OPS_DEBUG=1)")
        elif bool(bad.any()):
            raise IndexError(f"eagle3::{op}: rows out of range at positions "
                             f"{bad.nonzero().flatten().tolist()[:16]} (x has {x.shape[0]} rows)")


@_implements("draft_fc")
def _draft_fc_impl(x, weight, bias, rows, chunk_norm_weight, input_norm_weight, eps, norm_folded=False):
    M = validation.check_draft_fc(x, weight, bias, rows, chunk_norm_weight, input_norm_weight, eps,
                                  norm_folded=norm_folded)
    out = torch.empty((M, weight.shape[0]), dtype=x.dtype, device=x.device)
    _run_draft_fc(x, weight, bias, rows, chunk_norm_weight, input_norm_weight, eps, out, None, "draft_fc", norm_folded)
    return out


@_implements("draft_fc_out")
def _draft_fc_out_impl(x, weight, bias, rows, chunk_norm_weight, input_norm_weight, eps, out, workspace=None,
                       norm_folded=False):
    validation.check_draft_fc(x, weight, bias, rows, chunk_norm_weight, input_norm_weight, eps, out,
                              op="draft_fc_out", workspace=workspace, norm_folded=norm_folded)
    _run_draft_fc(x, weight, bias, rows, chunk_norm_weight, input_norm_weight, eps, out, workspace, "draft_fc_out",
                  norm_folded)


assert set(_impls) == set(OPS), f"ops.py implements {sorted(_impls)}, registry.py declares {sorted(OPS)}"


# ---- the Python face -----------------------------------------------------------------------------
# One way through: every face calls its torch.ops.eagle3 op (the dispatcher runs the Autograd guard, then the
# impl above: the contract, the backend). The faces only normalise the Python scalars the schema types.
# The plugin's hot calls do not come here: they run the call planned at install (eagle3_ops.bound).
def capture(hidden: torch.Tensor, residual: Optional[torch.Tensor], buffer: torch.Tensor, slot: int) -> None:
    """``buffer[:T, slot*H:(slot+1)*H] = hidden + residual`` (or ``hidden``); nothing else changes."""
    validation.check_int("capture", "slot", slot)
    torch.ops.eagle3.capture.default(hidden, residual, buffer, slot)


def fused_add_rmsnorm_capture(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                              buffer: torch.Tensor, slot: int) -> None:
    """SGLang ``fused_add_rmsnorm(input, residual, weight, eps)`` that also writes the new residual
    into ``buffer`` slot ``slot``."""
    validation.check_int("fused_add_rmsnorm_capture", "slot", slot)
    validation.check_eps("fused_add_rmsnorm_capture", eps)
    torch.ops.eagle3.fused_add_rmsnorm_capture.default(input, residual, weight, float(eps), buffer, slot)


def draft_fc(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
             rows: Optional[torch.Tensor] = None, chunk_norm_weight: Optional[torch.Tensor] = None,
             input_norm_weight: Optional[torch.Tensor] = None, eps: float = 1e-6,
             workspace: Optional[torch.Tensor] = None, *, norm_folded: bool = False) -> torch.Tensor:
    """``linear(norm(x[rows]), weight, bias)`` → new [M, N] tensor. ``workspace``: caller-owned
    scratch (uint8, at least :func:`draft_fc_workspace_bytes`); default: the face's per-stream one.
    ``norm_folded``: ``weight`` is :func:`fold_norm_weights` of the fc weight with these norm
    weights (the kernels then apply only the RMS scales: the plain hot loop)."""
    validation.check_eps("draft_fc", eps)
    norm_folded = bool(norm_folded)
    if workspace is None:
        return torch.ops.eagle3.draft_fc.default(x, weight, bias, rows, chunk_norm_weight, input_norm_weight,
                                                 float(eps), norm_folded)
    # With a workspace: the out= op (the functional op takes none, see registry.py) into a new output, whose
    # shape needs only the row count; the op checks everything else, once.
    out = torch.empty(validation.draft_fc_output_shape("draft_fc", x, weight, rows), dtype=x.dtype, device=x.device)
    torch.ops.eagle3.draft_fc_out.default(x, weight, bias, rows, chunk_norm_weight, input_norm_weight, float(eps),
                                          out, workspace, norm_folded)
    return out


def draft_fc_out(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                 rows: Optional[torch.Tensor], chunk_norm_weight: Optional[torch.Tensor],
                 input_norm_weight: Optional[torch.Tensor], eps: float, out: torch.Tensor,
                 workspace: Optional[torch.Tensor] = None, *, norm_folded: bool = False) -> None:
    """``draft_fc`` into a preallocated ``out`` [M, N] (no allocation: CUDA-graph friendly)."""
    validation.check_eps("draft_fc_out", eps)
    torch.ops.eagle3.draft_fc_out.default(x, weight, bias, rows, chunk_norm_weight, input_norm_weight, float(eps),
                                          out, workspace, bool(norm_folded))


def draft_fc_workspace_bytes(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                             rows: Optional[torch.Tensor] = None, chunk_norm_weight: Optional[torch.Tensor] = None,
                             input_norm_weight: Optional[torch.Tensor] = None, *, norm_folded: bool = False) -> int:
    """Bytes of workspace ``draft_fc`` needs for these arguments on the backend that serves them
    on ``weight``'s device. Only shapes, strides and dtypes are read: ``x`` and ``rows`` may be meta
    tensors (to size a workspace for a larger M than any real tensor at hand)."""
    backend, _ = dispatch.select("draft_fc", weight.device, weight.dtype)
    return int(dispatch.function(backend, "draft_fc_plan")(x, weight, bias, rows, chunk_norm_weight,
                                                           input_norm_weight, bool(norm_folded)).nbytes)


def fold_norm_weights(weight: torch.Tensor, chunk_norm_weight: Optional[torch.Tensor] = None,
                      input_norm_weight: Optional[torch.Tensor] = None,
                      out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The fc weight with the pre-fc norm gains folded in, ``weight[n, k] * g[k]`` with
    ``g = input_norm_weight * chunk_norm_weight.flatten()`` (g then the product in fp32, one rounding into
    weight's dtype), for ``draft_fc(..., norm_folded=True)``: prepared ONCE (weights are fixed while
    serving), it turns the norm variant's hot loop into the plain one. Written into ``out`` when
    given (same shape and dtype as weight; may be weight itself), else a new tensor: the caller
    owns the memory. Raises ValueError naming the argument when the shapes do not fit, when there
    is no norm weight, when a folded value is not finite where the weight is (fp16 overflow; ``out``
    is then left untouched), or for fp16 with ``input_norm_weight`` (see validation)."""
    from .reference import fold_gains

    op = "fold_norm_weights"
    if weight.dim() != 2:
        raise validation.Eagle3ArgumentError(
            f"eagle3_ops.{op}: weight has shape {tuple(weight.shape)}, expected [N, K*H]")
    if chunk_norm_weight is None and input_norm_weight is None:
        raise validation.Eagle3ArgumentError(f"eagle3_ops.{op}: neither chunk_norm_weight nor input_norm_weight given: "
                                             f"nothing to fold")
    KH = weight.shape[1]
    for name, t in (("chunk_norm_weight", chunk_norm_weight), ("input_norm_weight", input_norm_weight)):
        if t is not None and (t.numel() != KH or t.device != weight.device):
            raise validation.Eagle3ArgumentError(
                f"eagle3_ops.{op}: {name} has {t.numel()} elements on {t.device}, expected {KH} (weight's in_features) "
                f"on {weight.device}")
    if out is not None and (out.shape != weight.shape or out.dtype != weight.dtype or out.device != weight.device):
        raise validation.Eagle3ArgumentError(
            f"eagle3_ops.{op}: out is {out.dtype} {tuple(out.shape)} on {out.device}, expected weight's "
            f"{weight.dtype} {tuple(weight.shape)} on {weight.device}")
    if weight.dtype == torch.float16 and input_norm_weight is not None:
        raise validation.Eagle3ArgumentError(validation.FOLDED_FP16_INPUT_NORM.format(op=f"eagle3_ops.{op}"))
    g = fold_gains(chunk_norm_weight, input_norm_weight)
    folded = out if out is not None else torch.empty_like(weight, memory_format=torch.contiguous_format)
    step = max(1, (64 << 20) // max(1, 4 * KH))  # fp32 temporaries of at most ~64 MB at a time
    blocks = range(0, weight.shape[0], step)
    with torch.no_grad():
        for n0 in blocks:  # check everything first: a refused fold leaves ``out`` untouched
            block = weight[n0:n0 + step].float() * g
            bad = ~torch.isfinite(block.to(weight.dtype)) & torch.isfinite(weight[n0:n0 + step])
            if bool(bad.any()):
                n, k = (int(i) for i in bad.nonzero()[0])
                raise validation.Eagle3ArgumentError(
                    f"eagle3_ops.{op}: weight[{n0 + n}, {k}] * g[{k}] = {float(block[n, k]):.4g} is not finite in "
                    f"{weight.dtype}; this weight cannot be folded (serve it with norm_folded=False)")
        for n0 in blocks:
            folded[n0:n0 + step].copy_((weight[n0:n0 + step].float() * g).to(weight.dtype))
    return folded
