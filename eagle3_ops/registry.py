"""Every eagle3 op, declared ONCE: one :class:`Op` row per op in :data:`OPS`.

A row holds everything the rest of the op layer reads about the op: its schema (namespace
``eagle3``), its contract (the ``validation.py`` check, which is also the fake impl torch.compile
traces with), the name of each tensor argument (autograd refuses those that require grad: the ops
are forward-only), the module of each backend that implements it, and the self-check a backend
passes before it first serves (``verify.py``). Nothing here imports the rest of the op layer: the
flow is one way, ``registry`` -> ``dispatch`` (which backend serves) -> ``ops`` (registration with
torch and the Python face).

Adding an op: a row here, its check in ``validation.py`` (the op's one contract: the impl runs it and the
fake is it), its self-check in ``verify.py``, the function in each backend module (``reference.py``,
``triton/``, ``cuda_backend.py`` + ``csrc/``, whose checks guard memory safety only), its impl and face in
``ops.py``, and, where the plugin calls it, a bound call in ``bound.py``. ``tests/ops/test_contract.py``
resolves every row on every backend.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Mapping, Optional, Tuple

from . import validation, verify

BACKENDS = ("cuda", "triton", "reference")


@dataclass(frozen=True)
class Op:
    """One eagle3 op as every layer reads it: schema, contract (also the fake), tensor argument names, the backend
    modules that implement it and the self-check each passes before first use."""
    name: str
    schema: str                                # the public op: torch.ops.eagle3.<name>
    fake: Callable                             # the contract on (fake) tensors; returns the output
    tensor_args: Tuple[Optional[str], ...]     # positional argument -> its name when a tensor, else None
    backends: Mapping[str, str]                # backend -> the module holding its function ``implemented_by``
    selfcheck: Callable                        # verify.selfcheck_*: (fn, device, dtype, functions) -> (ok, detail)
    implemented_by: str = ""                   # the backend function's name (default: the op's own)
    planned: bool = False                      # backends also export <implemented_by>_plan (a call's path, launch
                                               # and workspace bytes: .nbytes) and <implemented_by>_workspace_bytes

    @property
    def function(self) -> str:
        """The name of the backend function that implements the op: ``implemented_by``, else the op's own name."""
        return self.implemented_by or self.name


def _draft_fc_fake(x, weight, bias, rows, chunk_norm_weight, input_norm_weight, eps, norm_folded=False):
    M = validation.check_draft_fc(x, weight, bias, rows, chunk_norm_weight, input_norm_weight, eps,
                                  norm_folded=norm_folded)
    return x.new_empty((M, weight.shape[0]))


def _draft_fc_out_fake(x, weight, bias, rows, chunk_norm_weight, input_norm_weight, eps, out, workspace=None,
                       norm_folded=False):
    validation.check_draft_fc(x, weight, bias, rows, chunk_norm_weight, input_norm_weight, eps, out,
                              op="draft_fc_out", workspace=workspace, norm_folded=norm_folded)


_CAPTURE_MODULES = {"reference": "eagle3_ops.reference", "triton": "eagle3_ops.triton.capture",
                    "cuda": "eagle3_ops.cuda_backend"}
_FC_MODULES = {"reference": "eagle3_ops.reference", "triton": "eagle3_ops.triton.draft_fc",
               "cuda": "eagle3_ops.cuda_backend"}

OPS: Dict[str, Op] = {op.name: op for op in (
    Op("capture",
       "capture(Tensor hidden, Tensor? residual, Tensor(a!) buffer, int slot) -> ()",
       validation.check_capture, ("hidden", "residual", "buffer", None), _CAPTURE_MODULES,
       verify.selfcheck_capture),
    Op("fused_add_rmsnorm_capture",
       "fused_add_rmsnorm_capture(Tensor(a!) input, Tensor(b!) residual, Tensor weight, float eps, "
       "Tensor(c!) buffer, int slot) -> ()",
       validation.check_fused_add_rmsnorm_capture, ("input", "residual", "weight", None, "buffer", None),
       _CAPTURE_MODULES, verify.selfcheck_fused_add_rmsnorm_capture),
    Op("draft_fc",
       "draft_fc(Tensor x, Tensor weight, Tensor? bias, Tensor? rows, Tensor? chunk_norm_weight, "
       "Tensor? input_norm_weight, float eps, bool norm_folded=False) -> Tensor",
       _draft_fc_fake, ("x", "weight", "bias", "rows", "chunk_norm_weight", "input_norm_weight", None, None),
       _FC_MODULES, verify.selfcheck_draft_fc, planned=True),
    # The out= variant: the same backend function, caller-owned output and workspace. The functional op
    # takes no workspace: a mutable optional argument on an op that returns a new tensor breaks inductor.
    Op("draft_fc_out",
       "draft_fc_out(Tensor x, Tensor weight, Tensor? bias, Tensor? rows, Tensor? chunk_norm_weight, "
       "Tensor? input_norm_weight, float eps, Tensor(a!) out, Tensor(b!)? workspace=None, "
       "bool norm_folded=False) -> ()",
       _draft_fc_out_fake, ("x", "weight", "bias", "rows", "chunk_norm_weight", "input_norm_weight", None, "out",
                            "workspace", None),
       _FC_MODULES, verify.selfcheck_draft_fc, implemented_by="draft_fc", planned=True),
)}

# The ops a backend implements under their own name (draft_fc_out is served by draft_fc's function).
BACKEND_OPS: Tuple[str, ...] = tuple(name for name, op in OPS.items() if op.function == name)

