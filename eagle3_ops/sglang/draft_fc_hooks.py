"""Draft side: SGLang's llama_eagle3 fc block as one ``eagle3::draft_fc`` call.

Stock ``sglang.srt.models.llama_eagle3.LlamaModel.forward`` does, on the first draft step (when the
input is the target's ``[T, K*H]`` aux states):

    if input_norm:  h = input_norm(h)                   # RMSNorm over the K*H row, rounded
    if fc_norm:     h = cat([norm_k(chunk_k(h))])        # RMSNorm per H slot, rounded, cat
    h = fc(h)                                            # replicated nn.Linear K*H -> H_draft

With this module installed the draft's forward computes ``draft_fc(h, fc.weight, fc.bias,
chunk_norm_weight, input_norm_weight, eps)`` (norms folded, fp32 throughout, one rounding), puts the
result where the draft reads its input (``forward_batch.spec_info.hidden_states``) for the duration
of the call, and runs SGLang's own forward, which then sees an H-wide input and skips its fc block.
Later draft steps (H-wide input) run stock. The forward is wrapped on llama_eagle3's LlamaModel
class, keyed on the instance's state (routing.py), so SGLang's compile trampolines still reach it;
under ``torch.compile`` tracing it steps aside. The weights are the draft's own parameters: ``fc.weight``
is passed as is, and the K ``fc_norm`` weights are re-pointed once to rows of one ``[K, H]`` tensor
so the op reads them without a copy (no second copy of any weight).
"""
from __future__ import annotations

import logging
import sys
from typing import Optional

import torch

from .. import ops
from .capture_hooks import _warn_once, serving_backends
from .routing import forward_owner, routing_problem, wrap_class_forward

log = logging.getLogger("eagle3_ops.sglang")

_STATE_ATTR = "_eagle3_ops_draft_fc"
DRAFT_MODULE = "sglang.srt.models.llama_eagle3"


class DraftFcState:
    def __init__(self, inner, fc: torch.nn.Linear, input_norm, fc_norm, eps: float):
        self.inner = inner
        self.fc = fc
        self.input_norm = input_norm
        self.fc_norm = fc_norm
        self.eps = eps
        self.enabled = True
        self.stats = {"fused_calls": 0, "stock_calls": 0}
        self.routing_warned = False
        self.chunk_norm_weight: Optional[torch.Tensor] = None
        if fc_norm is not None:
            self._share_chunk_norm_storage()

    def _share_chunk_norm_storage(self) -> None:
        """Re-point the K fc_norm weights to rows of one [K, H] tensor (same values, one storage)."""
        weights = [norm.weight for norm in self.fc_norm]
        stacked = torch.stack([w.data for w in weights])
        for k, w in enumerate(weights):
            w.data = stacked[k]
        self.chunk_norm_weight = stacked

    def chunk_weight(self) -> Optional[torch.Tensor]:
        if self.fc_norm is None:
            return None
        stacked = self.chunk_norm_weight
        H = stacked.shape[1]
        if all(norm.weight.data_ptr() == stacked.data_ptr() + k * H * stacked.element_size()
               for k, norm in enumerate(self.fc_norm)):
            return stacked
        # The weights were replaced since (a reload that assigned new tensors): share again. This
        # never happens inside a CUDA-graph capture, where weights are fixed.
        self._share_chunk_norm_storage()
        return self.chunk_norm_weight


def _plain_rmsnorm(norm) -> Optional[str]:
    from sglang.srt.layers import layernorm

    if type(norm) is not layernorm.RMSNorm:
        return f"{type(norm).__name__} is not a plain RMSNorm"
    if norm.cast_x_before_out_mul or norm.variance_size_override is not None or not norm.has_weight:
        return "RMSNorm variant (cast_x_before_out_mul / variance override / no weight)"
    if norm.override_orig_dtype is not None:
        return "RMSNorm with override_orig_dtype"
    return None


def is_eagle3_draft(model) -> bool:
    """Whether ``model`` belongs to SGLang's EAGLE-3 draft family (``*_eagle3`` model modules,
    ``...Eagle3...`` classes). Other models with an inner ``.fc`` (EAGLE/EAGLE-2 drafts, targets)
    are not this module's business and are passed over without a word."""
    inner = getattr(model, "model", None)
    for obj in (model, inner):
        if obj is None:
            continue
        cls = type(obj)
        if cls.__module__.rsplit(".", 1)[-1].endswith("eagle3") or "eagle3" in cls.__name__.lower():
            return True
    return False


def _supported_draft(inner):
    """The class whose forward the plugin wraps, if ``inner`` runs llama_eagle3's LlamaModel.forward."""
    module = sys.modules.get(DRAFT_MODULE)
    cls = getattr(module, "LlamaModel", None) if module is not None else None
    return forward_owner(inner, cls) if cls is not None else None


def _run_draft_forward(state: DraftFcState, original, inner, args, kwargs):
    """One forward of a patched draft (``original``: llama_eagle3 LlamaModel's stock forward)."""
    forward_batch = kwargs["forward_batch"] if "forward_batch" in kwargs else (args[2] if len(args) > 2 else None)
    fc = state.fc
    spec = getattr(forward_batch, "spec_info", None)
    h = getattr(spec, "hidden_states", None)
    if (not state.enabled or not isinstance(h, torch.Tensor) or h.dim() != 2
            or h.shape[-1] != fc.in_features or h.shape[-1] == inner.config.hidden_size
            or h.dtype != fc.weight.dtype or h.device != fc.weight.device
            or (h.shape[-1] > 1 and h.stride(-1) != 1)):
        state.stats["stock_calls"] += 1
        return original(inner, *args, **kwargs)
    input_norm_weight = state.input_norm.weight if state.input_norm is not None else None
    x = ops.draft_fc(h, fc.weight, fc.bias, None, state.chunk_weight(), input_norm_weight, state.eps)
    state.stats["fused_calls"] += 1
    spec.hidden_states = x
    try:
        return original(inner, *args, **kwargs)
    finally:
        spec.hidden_states = h


def install_draft_fc(model) -> Optional[DraftFcState]:
    """Run ``model``'s (an SGLang EAGLE-3 draft) fc block as one eagle3::draft_fc call. Returns the
    state, or None when the draft is left stock (with one warning if it is an EAGLE-3 draft).
    Nothing is changed on the model until every check passed."""
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "fc") or not is_eagle3_draft(model):
        return None
    existing = inner.__dict__.get(_STATE_ATTR)
    if existing is not None:
        return existing
    name = type(model).__name__
    owner = _supported_draft(inner)
    if owner is None:
        _warn_once(f"draft:{name}", "eagle3_ops: draft %s (%s) is not supported; its fc runs stock",
                   name, type(inner).__module__)
        return None
    fc = inner.fc
    if type(fc) is not torch.nn.Linear:
        _warn_once(f"draftfc:{name}", "eagle3_ops: draft %s fc is %s, not nn.Linear; its fc runs stock",
                   name, type(fc).__name__)
        return None
    input_norm = getattr(inner, "input_norm", None)
    fc_norm = getattr(inner, "fc_norm", None)
    norms = ([input_norm] if input_norm is not None else []) + (list(fc_norm) if fc_norm is not None else [])
    for norm in norms:
        why = _plain_rmsnorm(norm)
        if why is None and norm.weight.dtype != fc.weight.dtype:
            why = f"norm weight is {norm.weight.dtype}, fc weight is {fc.weight.dtype}"
        if why is not None:
            _warn_once(f"draftnorm:{name}", "eagle3_ops: draft %s: %s; its fc runs stock", name, why)
            return None
    eps_values = {float(n.variance_epsilon) for n in norms}
    if len(eps_values) > 1:
        _warn_once(f"drafteps:{name}", "eagle3_ops: draft %s norms use different eps %s; its fc runs stock",
                   name, sorted(eps_values))
        return None
    if fc_norm is not None and len(fc_norm) * fc_norm[0].weight.shape[0] != fc.in_features:
        _warn_once(f"draftshape:{name}", "eagle3_ops: draft %s fc_norm does not tile fc input; stock", name)
        return None
    backend = serving_backends(("draft_fc",), fc.weight.device, fc.weight.dtype, f"draft {name} fc")
    if backend is None:
        return None
    eps = eps_values.pop() if eps_values else 1e-6
    state = DraftFcState(inner, fc, input_norm, fc_norm, eps)
    # class level, so that SGLang's compile trampolines (which call type(module).forward) reach it
    wrap_class_forward(owner, _STATE_ATTR, _run_draft_forward)
    inner.__dict__[_STATE_ATTR] = state
    log.info("eagle3_ops: patched %s fc block (input_norm=%s, fc_norm=%s, fc %d->%d, bias=%s) -> one "
             "eagle3::draft_fc call, same weight storage; backend draft_fc=%s", name,
             "yes" if input_norm is not None else "no", "yes" if fc_norm is not None else "no",
             fc.in_features, fc.out_features, "yes" if fc.bias is not None else "no", backend["draft_fc"])
    return state


def check_routing(model) -> Optional[str]:
    """After SGLang's CUDA-graph / compile setup: None if a patched draft still routes its forward
    through the plugin, else what replaced it (warned once per model)."""
    inner = getattr(model, "model", None)
    state = getattr(inner, "__dict__", {}).get(_STATE_ATTR) if inner is not None else None
    if state is None:
        return None
    problem = routing_problem(inner, _STATE_ATTR)
    if problem is not None and not state.routing_warned:
        state.routing_warned = True
        log.warning("eagle3_ops: draft %s: after SGLang's CUDA-graph/compile setup its forward no longer goes "
                    "through the plugin: %s. Forwards that bypass it run SGLang's stock fc.",
                    type(model).__name__, problem)
    return problem


def draft_fc_state(model) -> Optional[DraftFcState]:
    inner = getattr(model, "model", model)
    return getattr(inner, "__dict__", {}).get(_STATE_ATTR)
