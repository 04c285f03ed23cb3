"""Target side: EAGLE-3 aux hidden states go into ONE persistent ``[max_tokens, K*H]`` buffer, for
every target family SGLang 0.5.23 serves EAGLE-3 for, through SGLang's own capture mechanism.

How SGLang captures (read from 0.5.23's model files; ~30 of them define ``set_eagle3_layers_to_capture``):
``set_eagle3_layers_to_capture`` writes a ``layers_to_capture`` list on the module whose forward runs
the decoder loop (the "capture owner": ``LlamaModel``, ``DeepseekV2Model``, a VL wrapper's language
model ...). That forward collects the captures of one forward in an accumulator and returns
``(hidden_states, aux)``:

* an ``AuxHiddenStateList`` (``capture`` clones each value; the logits processor ``torch.cat``s them),
* an ``AuxHiddenStatePacker`` (a fresh ``[T, K*H]`` tensor; ``append`` copies each value into its slot),
* or a plain ``list`` (Gemma-3, LongCat: values appended as they are, cat later); an
  ``AuxHiddenStateList`` may also get a value by plain ``append`` after its captures (Gemma-4's
  boundary L, appended after the loop).

This module hooks exactly that shared mechanism, not a list of model classes:

* :func:`find_capture_owner` finds, in the loaded model, the module holding SGLang's configured
  ``layers_to_capture`` (and the module above it SGLang flagged ``capture_aux_hidden_states``);
* that module's class ``forward`` is wrapped (routing.py; keyed on the instance's state), so during
  its forward a thread-local :class:`ForwardCapture` is active;
* AROUND ``AuxHiddenStateList.capture`` / ``AuxHiddenStatePacker.append`` (plugin.py) write each
  capture into its slot of the persistent buffer (``eagle3_ops.capture``: one copy) instead of a
  clone; a plain list is copied into the slots when the forward returns; either way the forward
  returns the packed ``buffer[:T]`` view (no clone, no cat downstream);
* a forward the buffer cannot take (more rows than ``max_tokens``, another width or dtype, another
  number of captures than configured) runs SGLang's own capture and still returns ONE packed tensor
  (``pack_aux_hidden_states``), so every CUDA-graph bucket returns the same structure.

**The fused norm, only where it is provably free and bitwise stock.** Where the value SGLang
captures is, at run time, the very residual tensor that an RMSNorm call ``norm(x, residual)``
returned (checked by identity, observed in an earlier forward of this model, never assumed per
family), that norm call can become ``eagle3::fused_add_rmsnorm_capture``, which also writes the
capture slot, and the capture costs nothing. That replaces one of SGLang's kernels in the target's
forward, so it happens only for the row buckets where qualification (eagle3_ops.qualify), at this
model's H and dtype on this device, found the op's normed output, new residual and capture BITWISE
equal to what the site's own norm (SGLang's kernel: ``sgl_kernel``/FlashInfer on CUDA, its native
path on the CPU) computes, and every TP rank serves the same decision (lockstep.py). Elsewhere SGLang's
norm runs and the capture is a copy. Not qualified (``EAGLE3_OPS_QUALIFY=off``, or the CPU under the
default ``auto``) means not fused. So the target's served tokens are exactly stock's.

Why reusing one buffer is safe: the rows a target forward writes are read by the draft's first
(fc) step, which SGLang's EAGLE worker runs right after that target forward on the same stream,
before it launches the next target forward. The one other reader is SGLang's ``return_hidden_states``
readback on a copy stream the next forward does not wait for: where the server lets requests return
hidden states, or in capture-only mode, the target is left stock (:func:`hidden_states_readback`).

The buffer counts against ``--mem-fraction-static``: the plugin installs the capture BEFORE
``ModelRunner.alloc_memory_pool`` (:func:`install_before_kv_sizing`, making SGLang's own
``set_eagle3_layers_to_capture`` call with the ids it passes later). Its rows default to what SGLang
itself can put through one forward (``serving.default_max_tokens``); ``EAGLE3_OPS_SGLANG_MAX_TOKENS``
caps them. A model whose structure the mechanism does not recognise stays stock with one log line
naming the class and the reason.
"""
from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch

from .. import bound, qualify, settings
from ..buffer import AuxCaptureBuffer
from . import fc_sharding, groups, lockstep, serving
from .routing import routing_problem, wrap_class_forward
from .serving import info_once, serving_backends, warn_once
from .version import ENV_MAX_TOKENS

log = logging.getLogger("eagle3_ops.sglang")

_STATE_ATTR = "_eagle3_ops_capture"
_installed: "weakref.WeakSet[TargetCaptureState]" = weakref.WeakSet()
_tls = threading.local()


def _compiling() -> bool:
    try:
        return bool(torch.compiler.is_compiling())
    except Exception:  # pragma: no cover - very old torch
        return False


def installed_states() -> List["TargetCaptureState"]:
    """The capture states installed in this process (static_inputs.py aliases SGLang's static
    buffers to their buffers)."""
    return list(_installed)


def active_capture() -> Optional["ForwardCapture"]:
    """The capture of the target forward running on this thread, if any."""
    return getattr(_tls, "capture", None)


# ---- discovery --------------------------------------------------------------------------------------
@dataclass
class CaptureOwner:
    """Where SGLang keeps a model's EAGLE-3 capture configuration."""
    lm: Any                 # the module SGLang flagged capture_aux_hidden_states (at or above inner)
    inner: Any              # the module holding layers_to_capture; its forward runs the decoder loop
    path: str               # inner's dotted name in the model ("" = the model itself)


def find_capture_owner(model) -> Tuple[Optional[CaptureOwner], str]:
    """(owner, "") or (None, why not): the module whose ``layers_to_capture`` SGLang configured, found
    in the loaded model (any family, any wrapper depth), and the closest module at or above it with
    ``capture_aux_hidden_states`` set (None when this rank does not capture, e.g. an earlier pipeline
    stage, where ``set_eagle3_layers_to_capture`` returns early)."""
    modules = dict(model.named_modules()) if isinstance(model, torch.nn.Module) else {"": model}
    found = [(name, m) for name, m in modules.items()
             if isinstance(m.__dict__.get("layers_to_capture"), (list, tuple)) and len(m.__dict__["layers_to_capture"])]
    if not found:
        return None, "no module holds a non-empty layers_to_capture (SGLang did not configure EAGLE-3 capture here)"
    if len(found) > 1:
        return None, ("several modules hold layers_to_capture (" + ", ".join(n or "<model>" for n, _ in found)
                      + "): the plugin cannot tell which forward captures")
    path, inner = found[0]
    chain = [path]
    while chain[-1]:
        chain.append(chain[-1].rsplit(".", 1)[0] if "." in chain[-1] else "")
    for name in chain:  # inner, its parent, ..., the model
        m = modules.get(name)
        if m is not None and getattr(m, "capture_aux_hidden_states", False) is True:
            return CaptureOwner(m, inner, path), ""
    return None, "no module at or above it has capture_aux_hidden_states set (this rank does not capture)"


def resolve_causal_lm(model):
    """The module that owns the capture flag (kept for callers that need ``lm``); None if none."""
    owner, _ = find_capture_owner(model)
    return owner.lm if owner is not None else None


def _layers(inner) -> Optional[torch.nn.ModuleList]:
    layers = getattr(inner, "layers", None)
    return layers if isinstance(layers, torch.nn.ModuleList) else None


def _layer_range(inner) -> Tuple[int, int]:
    """[start, end) of the decoder layers this rank runs (pipeline stages run a slice)."""
    layers = _layers(inner)
    n = len(layers) if layers is not None else 0
    start = getattr(inner, "start_layer", 0)
    end = getattr(inner, "end_layer", n)
    return int(start if isinstance(start, int) else 0), int(end if isinstance(end, int) else n)


def configured_captures(inner) -> List[int]:
    """SGLang's configured ``layers_to_capture`` as its layer loop takes them, one entry per capture SGLang
    counts. Families whose forward reads per-layer flags (``set_eagle3_layers_to_capture`` sets
    ``self.layers[i]._is_layer_to_capture``: qwen2/3-MoE, Qwen3-Next, ...) capture the layer an entry flags,
    so a negative entry is the layer Python's indexing wraps it to."""
    ids = [int(i) for i in inner.__dict__.get("layers_to_capture", []) if isinstance(i, int)]
    layers = _layers(inner)
    if layers is not None and any(getattr(layer, "_is_layer_to_capture", False) for layer in layers):
        n = len(layers)
        ids = [i % n if -n <= i < 0 else i for i in ids]
    return ids


def configured_boundaries(inner) -> List[int]:
    """The capture indices this rank may record, in capture order (= slot order): SGLang's configured
    captures (:func:`configured_captures`), de-duplicated and sorted (every family captures in layer
    order), within this rank's layers ``start..end`` (``end`` included: some families capture the last
    layer's output at the final norm; one that cannot captures fewer, and such forwards run stock)."""
    start, end = _layer_range(inner)
    return [i for i in sorted(set(configured_captures(inner))) if start <= i <= end]


def unslotted_ids(inner) -> List[int]:
    """Captures SGLang counts (:func:`configured_captures`) that :func:`configured_boundaries` gives no slot of
    their own: outside this rank's layers (an id SGLang never captures, e.g. -1 on a family that takes ids as
    boundaries) or repeated (SGLang captures a boundary once but counts it twice)."""
    slots = set(configured_boundaries(inner))
    seen, out = set(), []
    for i in configured_captures(inner):
        if i not in slots or i in seen:
            out.append(i)
        seen.add(i)
    return out


def _hidden_size(owner: CaptureOwner) -> Optional[int]:
    for obj in (owner.inner, owner.lm):
        cfg = getattr(obj, "config", None)
        for c in (cfg, getattr(cfg, "text_config", None)):
            h = getattr(c, "hidden_size", None)
            if isinstance(h, int) and h > 0:
                return h
    embed = getattr(getattr(owner.inner, "embed_tokens", None), "weight", None)
    return int(embed.shape[-1]) if isinstance(embed, torch.Tensor) and embed.dim() == 2 else None


def _activation_dtype(inner) -> torch.dtype:
    """The residual stream's dtype: the embedding output's (the model dtype), else the first float
    parameter's."""
    embed = getattr(getattr(inner, "embed_tokens", None), "weight", None)
    candidates = [embed] + [p for p in inner.parameters()]
    for w in candidates:
        if isinstance(w, torch.Tensor) and w.dtype in (torch.bfloat16, torch.float16, torch.float32):
            return w.dtype
    return torch.get_default_dtype()


# ---- state ------------------------------------------------------------------------------------------
class TargetCaptureState:
    """What one target model owns: the persistent buffer, the slot order, the fusable norms."""

    def __init__(self, model_name: str, owner: CaptureOwner, layer_ids: List[int], hidden_size: int,
                 dtype: torch.dtype, device: torch.device, max_tokens: int):
        self.model_name = model_name
        self.owner_class = f"{type(owner.inner).__module__}.{type(owner.inner).__qualname__}"
        self.layer_ids = list(layer_ids)                  # captured boundaries, in slot order
        self.slot_of_layer = {lid: k for k, lid in enumerate(self.layer_ids)}
        self.num_captures = len(self.layer_ids)
        self.hidden_size = hidden_size
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("eagle3_ops: the capture buffer must be allocated outside CUDA-graph capture")
        self.buffer = AuxCaptureBuffer(max_tokens, hidden_size, self.num_captures, dtype, device)
        self.enabled = True
        # norm module -> its dotted name, for the RMSNorms whose calls may produce a captured residual
        self.candidate_norms: Dict[Any, str] = {}
        # norm module -> slot, learned by identity: the residual it returned IS the value captured there
        self.norm_slots: Dict[Any, int] = {}
        self.stats = {"buffer_forwards": 0, "stock_forwards": 0, "fused_captures": 0, "copied_captures": 0}
        self.routing_warned = False
        self.norm_plan = None  # qualify.Plan of the fused norm per row bucket (None: never fused)
        # the bound calls (eagle3_ops.bound), made at install: the capture copy, and the fused norm of every
        # backend the norm plan serves (backend -> function)
        self.copy = None
        self.fused: Dict[str, Any] = {}

    @property
    def max_tokens(self) -> int:
        """Rows of the capture buffer: the most tokens one forward can capture into it."""
        return self.buffer.max_tokens

    @property
    def fused_sites(self) -> List[str]:
        """The norms learned to produce a captured residual (where the fused op may serve)."""
        return [self.candidate_norms[n] for n, _ in sorted(self.norm_slots.items(), key=lambda kv: kv[1])]

    def fits(self, t: torch.Tensor) -> Optional[str]:
        """None if ``t`` ([T, H] activations) can go into the buffer, else why not."""
        buf = self.buffer.buffer
        if not isinstance(t, torch.Tensor):
            return f"capture is a {type(t).__name__}, not a tensor"
        if t.dim() != 2 or t.shape[1] != self.hidden_size:
            return f"capture shape {tuple(t.shape)} is not [T, {self.hidden_size}]"
        if t.dtype != buf.dtype or t.device != buf.device:
            return f"capture is {t.dtype} on {t.device}, buffer is {buf.dtype} on {buf.device}"
        if t.shape[0] > self.max_tokens:
            return (f"forward has {t.shape[0]} tokens, more than the buffer's {self.max_tokens} rows "
                    f"(raise {ENV_MAX_TOKENS})")
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            return "capture has a non-contiguous last dim"
        return None

    def fuses(self, rows: int):
        """The bound fused norm qualification chose for ``rows`` rows, or None (stock norm)."""
        if self.norm_plan is None:
            return None
        backend = self.norm_plan.choice_for(rows).backend
        return self.fused[backend] if backend is not None else None

    def learn(self, value: torch.Tensor, slot: int, recent: List[Tuple[Any, torch.Tensor]]) -> None:
        """``value`` was captured into ``slot``: a norm whose returned residual IS ``value`` produces it."""
        for norm, residual in recent:
            if residual is value:
                if self.norm_slots.get(norm) != slot:
                    for other in [n for n, k in self.norm_slots.items() if k == slot]:
                        del self.norm_slots[other]
                    self.norm_slots[norm] = slot
                return


class ForwardCapture:
    """The captures of one target forward: which accumulator it took over, T, fused slots."""

    def __init__(self, state: TargetCaptureState):
        self.state = state
        self.owner: Any = None          # the AuxHiddenStateList / AuxHiddenStatePacker taken over
        self.mode: Optional[str] = None  # None until the first capture; then "buffer" or "stock"
        self.num_tokens: Optional[int] = None
        self.count = 0                  # captures recorded so far (= the next slot)
        self.fused: Dict[int, torch.Tensor] = {}  # slot -> residual the fused norm wrote
        self.recent: List[Tuple[Any, torch.Tensor]] = []  # (norm, residual it returned) since the last capture
        self.views: List[torch.Tensor] = []  # the slot views list_capture_hook put in the owner list

    def claim(self, accumulator) -> bool:
        """Whether ``accumulator`` (an SGLang AuxHiddenStateList / AuxHiddenStatePacker) is this forward's: the first
        one to ask takes the forward over; any other gets False and runs stock."""
        if self.owner is None:
            self.owner = accumulator
            return True
        return self.owner is accumulator

    def decide(self, value: torch.Tensor) -> str:
        """This forward's mode, decided at its first capture ``value`` [T, H]: ``buffer`` when it fits the capture
        buffer (T is then fixed), else ``stock`` with one warning naming why."""
        if self.mode is None:
            why = self.state.fits(value)
            if why is None:
                self.mode, self.num_tokens = "buffer", value.shape[0]
            else:
                self.mode = "stock"
                warn_once(f"stock:{self.state.model_name}:{why.split(' ')[0]}",
                           "eagle3_ops: %s: stock capture path for this forward: %s", self.state.model_name, why)
        return self.mode

    def write(self, value: torch.Tensor) -> Optional[torch.Tensor]:
        """Put ``value`` into the next slot; the slot view, or None to fall back to stock."""
        k = self.count
        if (self.mode != "buffer" or k >= self.state.num_captures or not isinstance(value, torch.Tensor)
                or value.dim() != 2 or value.shape[0] != self.num_tokens or self.state.fits(value) is not None):
            self.mode = "stock"
            return None
        if self.fused.get(k) is value:
            # fused_add_rmsnorm_capture already wrote exactly this residual into slot k
            self.state.stats["fused_captures"] += 1
        else:
            self.state.copy(value, None, self.state.buffer.buffer, k)  # the checks above are its contract
            self.state.stats["copied_captures"] += 1
            self.state.learn(value, k, self.recent)
        self.recent.clear()
        self.count += 1
        return self.state.buffer.slot(k, self.num_tokens)

    def packed(self) -> torch.Tensor:
        """``buffer[:T]``: the K slots of this forward's T tokens, contiguous."""
        return self.state.buffer.view(self.num_tokens)


# ---- the fusable norms (candidates, at install) -----------------------------------------------------------------
def _norm_fusable_statically(norm, dtype: torch.dtype) -> Optional[str]:
    """None if SGLang would run this RMSNorm's ``norm(x, residual)`` as a plain fused add+RMSNorm
    (the math of eagle3::fused_add_rmsnorm_capture), else the reason it would not."""
    from sglang.srt.layers import layernorm

    if type(norm) is not layernorm.RMSNorm:
        return f"{type(norm).__name__} is not a plain RMSNorm"
    if not getattr(norm, "has_weight", True) or not isinstance(getattr(norm, "weight", None), torch.Tensor):
        return "RMSNorm without weight"
    if norm.cast_x_before_out_mul or norm.fp32_residual or norm.override_orig_dtype is not None:
        return "RMSNorm with cast_x_before_out_mul / fp32_residual / override_orig_dtype"
    if norm.variance_size_override is not None:
        return "RMSNorm with a variance size override"
    if norm.weight.dtype != dtype:
        return f"RMSNorm weight is {norm.weight.dtype}, activations are {dtype}"
    if getattr(layernorm, "_use_aiter", False):
        return "aiter (ROCm) norm kernels"
    fp8_scale = getattr(layernorm, "_fp8_static_input_scale", None)
    if fp8_scale is None:
        return "cannot tell whether the norm fuses an FP8 input quant"
    if fp8_scale(getattr(norm, "_quant_linear", None)) is not None:
        return "the norm fuses the next projection's static FP8 input quant"
    return None


def _candidate_norms(owner: CaptureOwner, layer_ids: List[int], hidden_size: int) -> Dict[Any, str]:
    """The RMSNorms of width H in the captured layers (and the owner's final norm when the last
    layer's output is configured): the calls whose returned residual may be what SGLang captures.
    Which of them really is gets learned by identity at run time (TargetCaptureState.learn)."""
    from sglang.srt.layers import layernorm

    layers = _layers(owner.inner)
    start, end = _layer_range(owner.inner)
    out: Dict[Any, str] = {}
    roots = [(f"layers.{i}", layers[i]) for i in layer_ids if layers is not None and start < i < end]
    if end in layer_ids and isinstance(getattr(owner.inner, "norm", None), torch.nn.Module):
        roots.append(("norm", owner.inner.norm))
    for prefix, root in roots:
        for name, m in root.named_modules():
            if isinstance(m, layernorm.RMSNorm) and getattr(m, "hidden_size", None) == hidden_size and m not in out:
                out[m] = f"{owner.path + '.' if owner.path else ''}{prefix}{'.' + name if name else ''}"
    return out


# ---- installation ----------------------------------------------------------------------------------
def hidden_states_readback() -> Optional[str]:
    """Why SGLang may copy a target's ``logits_output.hidden_states`` (the aux states) to the host,
    or None when it never does.

    That readback (``return_hidden_states``; scheduler ``_copy_result_to_cpu``) runs on SGLang's
    copy stream, which the next forward does not wait for: a persistent buffer that the next target
    forward rewrites would race with it (stock SGLang's eager prefill hands over a fresh tensor, kept
    alive by ``record_stream``). The choice cannot be made per forward: the ForwardBatch does not
    say whether a request asked (its ``capture_hidden_mode`` is the max with the server's mode and
    the EAGLE target's FULL), and CUDA-graph replays never reach Python. So it is made once, from
    the server config: if requests may return hidden states, or in capture-only mode
    (``--enable-return-aux-hidden-states``, where the readback is the only consumer), the target
    keeps SGLang's capture path for every forward."""
    try:
        from sglang.srt import runtime_context
    except ImportError:  # pragma: no cover - sglang always present where this runs
        return None
    if not runtime_context.get_context().is_config_namespace_published("exec"):
        return None  # no SGLang server in this process (scripts, the CPU harness): no scheduler readback
    features = runtime_context.get_exec().features
    if getattr(features, "enable_return_aux_hidden_states", False) or \
            getattr(features, "aux_hidden_state_capture", None) is not None:
        return ("capture-only mode (--enable-return-aux-hidden-states): the aux states go back to the "
                "client through the hidden-states readback")
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, get_server_return_hidden_states_mode

    mode = get_server_return_hidden_states_mode()
    if mode != CaptureHiddenMode.NULL:
        return (f"requests may return hidden states (server return-hidden-states mode "
                f"{getattr(mode, 'name', mode)}), read back on a copy stream the next forward does not wait for")
    return None


def _prepare_target(owner, name: str, layer_ids, hidden_size: int, max_tokens: Optional[int]):
    """This rank's local part of :func:`install_target_capture`: the serving backends, the buffer's rows,
    the fused-norm candidates and the state with its buffer (allocated here). (None, None) where this
    rank cannot serve (one log line said why); nothing is installed on the model."""
    inner = owner.inner
    dtype = _activation_dtype(inner)
    device = next((p.device for p in inner.parameters()), torch.device("cpu"))
    backend = serving_backends(("capture", "fused_add_rmsnorm_capture"), device, dtype, f"{name} EAGLE-3 capture")
    if backend is None:
        return None, None
    if max_tokens is None:
        try:
            max_tokens = settings.get(ENV_MAX_TOKENS)
        except settings.SettingError as e:
            settings.report_once(e, log)
            return None, None
        if max_tokens is None:
            max_tokens = serving.default_max_tokens()
    candidates = {}
    for norm, site in _candidate_norms(owner, layer_ids, hidden_size).items():
        why_not = _norm_fusable_statically(norm, dtype)
        if why_not is None:
            candidates[norm] = site
        else:
            info_once(f"nofuse:{name}:{why_not}", "eagle3_ops: %s: %s not a fused-norm candidate (%s); a capture "
                       "it produces is a copy", name, site, why_not)
    state = TargetCaptureState(name, owner, layer_ids, hidden_size, dtype, device, int(max_tokens))
    state.candidate_norms = candidates
    state.copy = bound.capture(backend["capture"], device, dtype)
    return state, backend


def install_target_capture(model, max_tokens: Optional[int] = None,
                           before_kv_sizing: bool = False) -> Optional[TargetCaptureState]:
    """Route ``model``'s EAGLE-3 captures into one persistent buffer (after SGLang configured which
    layers to capture). Returns the state, or None when the model is left stock (one log line saying
    why). Nothing is changed on the model until every check passed. ``before_kv_sizing``: called
    from :func:`install_before_kv_sizing` (the buffer then counts against SGLang's memory budget)."""
    name = type(model).__name__
    owner, why = find_capture_owner(model)
    if owner is None:
        if "does not capture" not in why and "did not configure" not in why:
            warn_once(f"owner:{name}", "eagle3_ops: %s EAGLE-3 capture left stock: %s", name, why)
        return None
    inner = owner.inner
    existing = inner.__dict__.get(_STATE_ATTR)
    if existing is not None:
        _check_configured_layers(existing, inner)
        return existing
    cls = type(inner)
    if "forward" not in cls.__dict__ and not any("forward" in k.__dict__ for k in cls.__mro__[:-1]):
        warn_once(f"owner:{name}", "eagle3_ops: %s EAGLE-3 capture left stock: %s has no forward", name,
                   cls.__qualname__)
        return None
    readback = hidden_states_readback()
    if readback is not None:
        warn_once(f"readback:{name}", "eagle3_ops: %s EAGLE-3 capture left stock: %s", name, readback)
        return None
    layer_ids = configured_boundaries(inner)
    hidden_size = _hidden_size(owner)
    lost = unslotted_ids(inner)
    if lost:
        # SGLang counts every configured id as a capture (its packer expects len(layers_to_capture) of them, the
        # draft's fc is sized for them); a buffer with fewer slots would only hide or change SGLang's own error
        start, end = _layer_range(inner)
        warn_once(f"owner:{name}", "eagle3_ops: %s EAGLE-3 capture left stock: SGLang configured layers_to_capture "
                   "%s (%d captures), but the boundaries of this rank's layers %d..%d give it %d distinct captures "
                   "(%s): %s %s no slot of %s own (outside these layers, or repeated), so SGLang's own capture "
                   "serves and its own error, if any, stands (the live wiring check, unless "
                   "EAGLE3_OPS_WIRING_CHECK=0, or python -m eagle3_ops doctor says what to change)", name,
                   list(inner.__dict__.get("layers_to_capture", [])), len(configured_captures(inner)), start, end,
                   len(layer_ids), layer_ids, lost, "has" if len(lost) == 1 else "have",
                   "its" if len(lost) == 1 else "their")
        return None
    if not layer_ids or hidden_size is None:
        warn_once(f"owner:{name}", "eagle3_ops: %s EAGLE-3 capture left stock: %s", name,
                   "no configured boundary on this rank's layers" if not layer_ids else
                   f"cannot tell the hidden size of {cls.__qualname__}")
        return None
    # Everything above is the same on every TP rank (the model's structure, the server's settings). What
    # follows may fail on one rank alone (a backend's verification on its GPU, the buffer's allocation):
    # each rank does its local work, then all vote before anything collective (the fused norm's
    # qualification below), so a failure anywhere means stock everywhere and no rank is left waiting.
    state, backend = None, None
    try:
        state, backend = _prepare_target(owner, name, layer_ids, hidden_size, max_tokens)
    except Exception:
        log.exception("eagle3_ops: %s EAGLE-3 capture: preparing it failed on this TP rank; SGLang's stock "
                      "capture serves", name)
    if not lockstep.all_ranks_agree(state is not None, groups.tp_group()):
        if state is not None:
            log.warning("eagle3_ops: %s EAGLE-3 capture left stock: its preparation failed on another TP rank "
                        "(every rank keeps SGLang's stock capture)", name)
        return None
    # what the collectives below are shaped by, read from each rank's own environment (nodes may differ)
    dtype, device, candidates = state.buffer.buffer.dtype, state.buffer.buffer.device, state.candidate_norms
    shaped_by = f"rows={state.max_tokens} qualify={qualify.enabled(device)}"
    if not lockstep.same_on_all_ranks(shaped_by, groups.tp_group()):
        log.error("eagle3_ops: %s EAGLE-3 capture left stock on every TP rank: the ranks' settings differ (here %s; "
                  "EAGLE3_OPS_SGLANG_MAX_TOKENS / EAGLE3_OPS_QUALIFY must be the same on every node)", name, shaped_by)
        return None
    # class level, so that SGLang's compile trampolines (which call type(module).forward) reach it
    wrap_class_forward(_forward_class(inner), _STATE_ATTR, _run_forward)
    inner.__dict__[_STATE_ATTR] = state
    _installed.add(state)
    if candidates:
        _qualify_norm(state, name, dtype, device)
        _bind_fused(state, name, dtype, device)
        if state.norm_plan is not None and any(c.backend is not None for c in state.norm_plan.choices):
            for norm in candidates:
                norm.forward = _norm_forward_wrapper(norm, state)

    mib = state.buffer.buffer.numel() * state.buffer.buffer.element_size() / 2**20
    log.info("eagle3_ops: patched %s capture (%s): boundaries %s -> one persistent [%d, %dx%d] %s buffer on %s "
             "(%.1f MiB); pack_aux_hidden_states gets its view (no clone/cat); backend capture=%s; %s", name,
             state.owner_class, layer_ids, state.max_tokens, state.num_captures, hidden_size,
             str(dtype).replace("torch.", ""), device, mib, backend["capture"], _norm_summary(state))
    size = (f"{mib:.1f} MiB on {device} ({state.max_tokens} tokens x {state.num_captures} x {hidden_size} "
            f"{str(dtype).replace('torch.', '')})")
    if before_kv_sizing:
        log.info("eagle3_ops: %s capture buffer: %s, allocated before SGLang sizes its KV cache, so it is inside "
                 "--mem-fraction-static (the KV cache is that much smaller); cap it with %s=N (tokens; a forward "
                 "with more tokens uses SGLang's stock capture)%s", name, size, ENV_MAX_TOKENS,
                 _fc_sharding_note(state))
    else:
        log.warning("eagle3_ops: %s capture buffer: %s, allocated after SGLang sized its KV cache, so outside "
                    "--mem-fraction-static; cap it with %s=N (tokens; a forward with more tokens uses SGLang's "
                    "stock capture)", name, size, ENV_MAX_TOKENS)
    return state


def _forward_class(inner) -> type:
    """The class in ``type(inner).__mro__`` whose ``forward`` instances of ``type(inner)`` run."""
    for klass in type(inner).__mro__:
        if "forward" in klass.__dict__:
            return klass
    raise TypeError(f"{type(inner).__qualname__} has no forward")  # checked by the caller


def _norm_summary(state: TargetCaptureState) -> str:
    if not state.candidate_norms:
        return "every capture is one copy into its slot (no plain RMSNorm produces a captured residual here)"
    plan = state.norm_plan
    fused = [c.rows for c in plan.choices if c.backend is not None] if plan is not None else []
    if not fused:
        why = ("qualification kept SGLang's norm for every row bucket" if plan is not None else
               "not qualified on this device (EAGLE3_OPS_QUALIFY; the default, auto, qualifies on CUDA)")
        return f"SGLang's own norms run and every capture is one copy into its slot ({why})"
    return (f"the fused add+RMSNorm (bitwise SGLang's norm on this device, qualified) may serve row buckets "
            f"{fused} at the norms whose residual SGLang captures (learned by identity at run time); every other "
            f"capture is one copy")


def _qualify_norm(state: TargetCaptureState, name: str, dtype: torch.dtype, device: torch.device) -> None:
    """Qualification of the fused add+RMSNorm capture at this model's H on this device, against the
    site's own norm (SGLang's kernel): per row bucket the fastest candidate whose three outputs are
    bitwise stock's, or SGLang's norm. Every TP rank serves one agreed plan (lockstep.py): each rank
    qualifies locally (a failure is caught), then all vote."""
    if not qualify.enabled(device):
        return
    shape = qualify.Shape("fused_add_rmsnorm_capture", state.hidden_size, state.num_captures, 0,
                          str(dtype).replace("torch.", ""))
    buckets = qualify.buckets_up_to(state.max_tokens)
    site = next(iter(state.candidate_norms))  # any candidate: same class, H, dtype and eps rules
    plan, failed = None, False
    try:
        plan = qualify.qualify(shape, device, buckets, stock_norm=site)
    except Exception:
        log.exception("eagle3_ops: %s fused norm: qualification failed on this rank; SGLang's norm serves", name)
        failed = True
    state.norm_plan = lockstep.agreed_plan(plan, failed, "fused_add_rmsnorm_capture", device, shape, buckets,
                                           groups.tp_group(), f"{name} fused norm")
    for line in state.norm_plan.table().splitlines():
        log.info("eagle3_ops: %s fused norm %s", name, line)


def _bind_fused(state: TargetCaptureState, name: str, dtype: torch.dtype, device: torch.device) -> None:
    """The bound fused norm of every backend the agreed norm plan serves. Qualification verified each already;
    should one fail here on this rank alone, this rank serves SGLang's norm (bitwise what the fused op gives:
    that is what qualification checked), so ranks that differ here still compute the same."""
    plan = state.norm_plan
    if plan is None:
        return
    try:
        state.fused = {c.backend: bound.fused_add_rmsnorm_capture(c.backend, device, dtype)
                       for c in plan.choices if c.backend is not None}
    except Exception:
        log.exception("eagle3_ops: %s fused norm: its qualified backend cannot be bound on this rank; SGLang's "
                      "norm serves here", name)
        state.norm_plan, state.fused = None, {}


def _check_configured_layers(state: TargetCaptureState, inner) -> None:
    """SGLang configured the capture after the plugin installed it before KV sizing (with the same
    call and arguments): the layers must be the ones the buffer was laid out for."""
    now = configured_boundaries(inner)
    if (now != state.layer_ids or unslotted_ids(inner)) and state.enabled:
        state.enabled = False
        log.error("eagle3_ops: %s: SGLang configured capture layers %s (%d captures), but the capture buffer was "
                  "laid out for %s; this model uses SGLang's stock capture", state.model_name,
                  list(inner.__dict__.get("layers_to_capture", [])), len(configured_captures(inner)), state.layer_ids)


def _fc_sharding_note(state: TargetCaptureState) -> str:
    """What the draft fc sharding gave back in this process (it runs before the KV sizing, see
    plugin.py), next to what the buffer costs."""
    freed = fc_sharding.sharded_bytes_released()
    if not freed:
        return ""
    buf = state.buffer.buffer
    cost = buf.numel() * buf.element_size()
    return (f"; the draft fc sharding released {freed / 2**20:.1f} MiB on this rank, "
            f"{'more' if freed >= cost else 'less'} than this buffer")


def install_before_kv_sizing(runner) -> Optional[TargetCaptureState]:
    """BEFORE ``ModelRunner.alloc_memory_pool`` (SGLang sizes the KV cache inside it): for a target
    runner that will capture EAGLE-3 aux states, make SGLang's own configuration call now
    (``set_eagle3_layers_to_capture`` with the ids ``configure_aux_hidden_state_capture`` passes
    it later; it only assigns the layer list) and install the capture, so the buffer is allocated
    before the KV cache is sized and ``--mem-fraction-static`` accounts for it. SGLang's later
    configuration call then finds it installed (and the layers are checked to be the same)."""
    if getattr(runner, "is_draft_worker", False):
        return None
    aux = getattr(runner, "spec_aux_config", None)
    model = getattr(runner, "model", None)
    if aux is None or model is None or not getattr(aux, "eagle_use_aux_hidden_state", False):
        return None
    if not hasattr(model, "set_eagle3_layers_to_capture"):
        return None  # SGLang will raise its own error at configuration
    model.set_eagle3_layers_to_capture(aux.eagle_aux_hidden_state_layer_ids)
    return install_target_capture(model, before_kv_sizing=True)


# ---- forward wrappers: what runs inside each forward once installed ----------------------------------
# hooks on SGLang's accumulators (class level, registered through HookRegistry)
def list_capture_hook(original, self, hidden, *args, **kwargs):
    """AROUND ``AuxHiddenStateList.capture``: write the slot instead of cloning."""
    cap = active_capture()
    if cap is None or not cap.claim(self) or cap.decide(hidden) != "buffer":
        return original(self, hidden, *args, **kwargs)
    view = cap.write(hidden)
    if view is None:
        return original(self, hidden, *args, **kwargs)
    list.append(self, view)
    cap.views.append(view)
    return None


def packer_append_hook(original, self, hidden):
    """AROUND ``AuxHiddenStatePacker.append`` (``capture`` and ``extend`` go through it): the
    packer's output becomes the persistent buffer's rows and each slot is written by the op."""
    cap = active_capture()
    if cap is None:
        return original(self, hidden)
    fresh = getattr(self, "_buffer", None) is None and getattr(self, "_idx", None) == 0
    if cap.owner is not self and not fresh:
        return original(self, hidden)  # a graph runner's own buffer (DFlash) or someone else's
    if (not cap.claim(self) or cap.decide(hidden) != "buffer"
            or getattr(self, "_num_captures", None) != cap.state.num_captures):
        return original(self, hidden)
    if self._buffer is None:
        self._buffer = cap.state.buffer.view(cap.num_tokens)
    if self._buffer.data_ptr() != cap.state.buffer.buffer.data_ptr():
        return original(self, hidden)
    view = self.slot(hidden)  # SGLang's own shape/dtype check and slot bookkeeping
    if cap.write(hidden) is None:
        view.copy_(hidden)  # a value the op cannot take: what SGLang's packer does, same slot
    return None


# the owner's forward (class-level wrapper, see routing.py)
def _run_forward(state: TargetCaptureState, original, inner, args, kwargs):
    """One forward of a patched model (``original`` is its class's stock forward)."""
    current = getattr(_tls, "capture", None)
    if not state.enabled or (current is not None and current.state is state):
        return original(inner, *args, **kwargs)  # off, or a nested call of the same model
    cap = ForwardCapture(state)
    _tls.capture = cap
    try:
        out = original(inner, *args, **kwargs)
    finally:
        _tls.capture = current
    return _finish(cap, out)


def _finish(cap: ForwardCapture, out):
    """The forward's ``(hidden, aux)`` with ``aux`` as ONE tensor: the packed buffer view when every
    configured capture went into it, else what SGLang's own ``pack_aux_hidden_states`` makes."""
    state = cap.state
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], (list, torch.Tensor))):
        return out  # no captures this forward (SGLang returns the hidden states alone), or not ours
    hidden, aux = out
    if isinstance(aux, torch.Tensor):  # the packer: its buffer is ours when it took the buffer path
        _count(state, cap.mode == "buffer" and cap.count == state.num_captures)
        return out
    if cap.owner is None and type(aux) is list and cap.mode is None:
        # a plain list (Gemma-3, LongCat): the values as SGLang appended them, copied into the slots
        if _copy_plain_list(cap, aux):
            _count(state, True)
            return hidden, cap.packed()
    elif cap.mode == "buffer" and aux is cap.owner and len(aux) == state.num_captures:
        if cap.count < len(aux):
            _copy_appended(cap, aux)  # Gemma-4's boundary L: list.append after the loop
        if cap.count == state.num_captures:
            _count(state, True)
            return hidden, cap.packed()  # the list holds slot views; hand over the packed view, no cat
    if cap.mode == "buffer" and cap.count != state.num_captures:
        warn_once(f"count:{state.model_name}:{cap.count}",
                   "eagle3_ops: %s: this forward captured %d of the %d configured boundaries %s (the model cannot "
                   "capture some of them); it runs SGLang's stock capture", state.model_name, cap.count,
                   state.num_captures, state.layer_ids)
    _count(state, False)
    # ONE tensor, the one SGLang's pack_aux_hidden_states would make of the list: SGLang's breakable
    # prefill graphs allocate their output buffer from the largest bucket's output and refuse a list in
    # one bucket and a tensor in another (_copy_output_to_buffer: "Unsupported BCG output buffer pair").
    from sglang.srt.layers.aux_hidden_states import pack_aux_hidden_states

    return hidden, pack_aux_hidden_states(aux)


def _copy_plain_list(cap: ForwardCapture, values: list) -> bool:
    state = cap.state
    if len(values) != state.num_captures or not values:
        return False
    if any(state.fits(v) is not None or v.dim() != 2 or v.shape[0] != values[0].shape[0] for v in values):
        why = next((state.fits(v) for v in values if state.fits(v) is not None), "captures of different rows")
        warn_once(f"stock:{state.model_name}:{str(why).split(' ')[0]}",
                   "eagle3_ops: %s: stock capture path for this forward: %s", state.model_name, why)
        return False
    cap.mode, cap.num_tokens = "buffer", values[0].shape[0]
    for k, v in enumerate(values):
        state.copy(v, None, state.buffer.buffer, k)  # fits() above is its contract
    state.stats["copied_captures"] += len(values)
    cap.count = len(values)
    return True


def _copy_appended(cap: ForwardCapture, aux: list) -> None:
    """The owner list holds this forward's slot views first, then values the model appended itself
    (``list.append``, not ``capture``: Gemma-4 appends boundary L, the last layer's output, after its
    loop): each goes into its slot, in list order, which is what ``torch.cat`` of the list (stock)
    makes. Anything else (a view missing or out of place) leaves ``cap.count`` short: stock."""
    if len(cap.views) != cap.count or any(a is not v for a, v in zip(aux, cap.views)):
        return
    for value in aux[cap.count:]:
        if cap.write(value) is None:
            return


def _count(state: TargetCaptureState, buffered: bool) -> None:
    state.stats["buffer_forwards" if buffered else "stock_forwards"] += 1


def _norm_forward_wrapper(norm, state: TargetCaptureState):
    """The instance ``forward`` of a candidate norm: SGLang's own call, which also records the
    residual it returned (for :meth:`TargetCaptureState.learn`); where that residual was seen captured
    into slot k, the capture slot k is next and qualification chose the fused op for this many rows,
    ``eagle3::fused_add_rmsnorm_capture`` instead (bitwise the same outputs, plus the slot)."""
    original = norm.forward
    buf = state.buffer.buffer
    from sglang.srt.batch_invariant_ops import is_batch_invariant_mode_enabled

    def forward(x, residual=None, post_residual_addition=None, *args, **kwargs):
        cap = active_capture()
        if cap is None or cap.state is not state or residual is None or _compiling():
            return original(x, residual, post_residual_addition, *args, **kwargs)
        slot = state.norm_slots.get(norm)
        fused = state.fuses(x.shape[0]) if slot is not None and isinstance(x, torch.Tensor) and x.dim() == 2 \
            else None
        if (fused is not None and cap.count == slot and slot not in cap.fused and cap.mode != "stock"
                and post_residual_addition is None and not args and not kwargs):
            # read per call: a weight reload may replace the Parameter (SGLang's own forward reads
            # self.weight / self.variance_epsilon per call too)
            weight = norm.weight
            if (isinstance(residual, torch.Tensor) and isinstance(weight, torch.Tensor)
                    and x.shape == residual.shape and x.shape[0] > 0 and x.dtype == residual.dtype
                    and x.is_contiguous() and residual.is_contiguous() and state.fits(residual) is None
                    and weight.dtype == x.dtype and weight.shape == (x.shape[1],) and weight.device == x.device
                    and weight.is_contiguous()
                    and not is_batch_invariant_mode_enabled()):
                fused(x, residual, weight, float(norm.variance_epsilon), buf, slot)  # checked above
                cap.fused[slot] = residual
                return x, residual
        out = original(x, residual, post_residual_addition, *args, **kwargs)
        if isinstance(out, tuple) and len(out) == 2:
            cap.recent.append((norm, out[1]))
        return out

    forward.__wrapped__ = original
    forward._eagle3_ops = True
    return forward


# ---- after SGLang's graph setup, and lookup --------------------------------------------------------
def check_routing(model) -> Optional[str]:
    """After SGLang's CUDA-graph / compile setup: None if ``model`` (when patched) still routes its
    forward and fused norms through the plugin, else what changed (warned once per model)."""
    state = capture_state(model)
    if state is None:
        return None
    inner = next((m for m in (model.modules() if isinstance(model, torch.nn.Module) else [model])
                  if m.__dict__.get(_STATE_ATTR) is state), None)
    problem = routing_problem(inner, _STATE_ATTR) if inner is not None else "the patched module is gone"
    if problem is None and state.norm_plan is not None and any(c.backend for c in state.norm_plan.choices):
        lost = [site for norm, site in state.candidate_norms.items()
                if not getattr(norm.__dict__.get("forward"), "_eagle3_ops", False)]
        if lost:
            problem = (f"the forward of candidate fused norm(s) {lost} was replaced (the captures they produce are "
                       f"now copies)")
    if problem is not None and not state.routing_warned:
        state.routing_warned = True
        log.warning("eagle3_ops: %s: after SGLang's CUDA-graph/compile setup the model no longer goes through "
                    "the plugin everywhere: %s. Forwards that bypass it run SGLang's stock capture path.",
                    state.model_name, problem)
    return problem


def capture_state(model) -> Optional[TargetCaptureState]:
    """The installed state of a target model (or of any module inside it), or None if it runs stock."""
    if not isinstance(model, torch.nn.Module):
        return getattr(model, "__dict__", {}).get(_STATE_ATTR)
    for m in model.modules():
        state = m.__dict__.get(_STATE_ATTR)
        if state is not None:
            return state
    return None
