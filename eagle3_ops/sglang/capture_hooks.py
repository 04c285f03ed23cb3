"""Target side: EAGLE-3 aux hidden states go into ONE persistent ``[max_tokens, K*H]`` buffer.

Stock SGLang 0.5.23 collects the K captures of a forward in an ``AuxHiddenStateList`` (Llama,
Qwen2/3 and Qwen MoE, gpt-oss, GLM-4.5/4.6; one ``clone`` per capture, then ``torch.cat`` in
``pack_aux_hidden_states``) or, for DeepSeek-V2/V3 and Kimi, an ``AuxHiddenStatePacker`` (a fresh
``[T, K*H]`` tensor per forward, or per CUDA-graph batch size). With this module installed on a model:

* the model owns one :class:`eagle3_ops.AuxCaptureBuffer` allocated once, when SGLang configures
  the capture (``configure_aux_hidden_state_capture``, which runs before CUDA-graph capture), so
  it lives outside every CUDA-graph memory pool and every graph batch size and every eager forward
  write into the same storage;
* each capture is written by ``eagle3_ops.capture`` into its slot; where the captured value is the
  residual produced by SGLang's add+RMSNorm at the layer boundary (the layer's input norm called as
  ``norm(hidden, residual)``), that norm call itself becomes ``eagle3_ops.fused_add_rmsnorm_capture``
  and the capture is free;
* the model returns the packed ``buffer[:T]`` view, so ``pack_aux_hidden_states`` (which returns a
  tensor unchanged) and the logits processor pass the view on: no clone, no cat.

Why reusing one buffer is safe: the rows a target forward writes are read by the draft's first
(fc) step, which SGLang's EAGLE worker runs right after that target forward (``_draft_extend_for_
prefill`` / ``_draft_extend_for_decode``) on the same stream, before it launches the next target
forward; the next forward's writes are therefore ordered after the draft's reads. The one other
reader is SGLang's ``return_hidden_states`` readback, which runs on a copy stream that the next
forward does not wait for: where the server lets requests return hidden states, or in capture-only
mode (``--enable-return-aux-hidden-states``), the target is left stock (:func:`hidden_states_readback`).

The buffer counts against SGLang's memory budget (``--mem-fraction-static``): the plugin installs
the capture BEFORE ``ModelRunner.alloc_memory_pool``, where SGLang sizes the KV cache
(:func:`install_before_kv_sizing`, making SGLang's own ``set_eagle3_layers_to_capture`` call with the
ids it passes later), and logs its size as INFO. Where that hook is not reached (a script calling
``configure_aux_hidden_state_capture`` itself), the buffer is allocated at configuration and a
WARNING says it is outside the budget. ``EAGLE3_OPS_SGLANG_MAX_TOKENS`` caps its rows. A forward the
buffer cannot hold (more rows than ``max_tokens``, an unexpected dtype/width) runs SGLang's stock
capture and still returns ONE packed tensor (SGLang's ``pack_aux_hidden_states`` of its list), so
every CUDA-graph bucket returns the same structure; one log line per reason.

The model's ``forward`` is wrapped on its class (routing.py), keyed on the instance's state, so
SGLang's compile trampolines, which call the class's forward, still reach it; after SGLang's
CUDA-graph/compile setup :func:`check_routing` warns if the instance no longer routes through it.
Under ``torch.compile`` tracing the hooks step aside, and SGLang's code runs as is.
"""
from __future__ import annotations

import logging
import sys
import threading
import weakref
from typing import Any, Dict, List, Optional

import torch

from .. import ops
from ..buffer import AuxCaptureBuffer
from .routing import forward_owner, routing_problem, wrap_class_forward

log = logging.getLogger("eagle3_ops.sglang")

# Inner model classes whose forward() this module knows (SGLang 0.5.23), by defining module.
# "list": captures go through AuxHiddenStateList.capture; "packer": through AuxHiddenStatePacker.
SUPPORTED_TARGET_MODELS = (
    ("sglang.srt.models.llama", "LlamaModel", "list"),
    ("sglang.srt.models.qwen2", "Qwen2Model", "list"),
    ("sglang.srt.models.qwen3", "Qwen3Model", "list"),
    ("sglang.srt.models.qwen2_moe", "Qwen2MoeModel", "list"),      # also Qwen3MoeModel
    ("sglang.srt.models.deepseek_v2", "DeepseekV2Model", "packer"),  # DeepSeek V2/V3, Kimi K2/K2.5
    # gpt-oss and GLM-4.5/4.6: layer captures through attn_boundary.prepare(capture=...) like llama
    # (gpt-oss can also capture boundary L at the final norm: END_BOUNDARY_CAPTURE); GLM's TBO
    # branch (CUDA only) captures nothing past first_k_dense_replace in stock SGLang either
    ("sglang.srt.models.gpt_oss", "GptOssModel", "list"),
    ("sglang.srt.models.glm4_moe", "Glm4MoeModel", "list"),
)

# Inner model classes that can also capture boundary L (the last layer's output, before the final
# norm) through ``residual_batch.final_norm(..., capture=...)`` when ``end_layer`` is in
# ``layers_to_capture``; for them that boundary is a buffer slot too (a copy: no add to fuse there).
END_BOUNDARY_CAPTURE = (("sglang.srt.models.gpt_oss", "GptOssModel"),)

_STATE_ATTR = "_eagle3_ops_capture"
_installed: "weakref.WeakSet[TargetCaptureState]" = weakref.WeakSet()
_tls = threading.local()
_warned: set = set()


def _warn_once(key: str, msg: str, *args) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(msg, *args)


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


class TargetCaptureState:
    """What one target model owns: the persistent buffer and the layer -> slot map."""

    def __init__(self, model_name: str, layer_ids: List[int], hidden_size: int, dtype: torch.dtype,
                 device: torch.device, max_tokens: int):
        self.model_name = model_name
        self.layer_ids = list(layer_ids)                  # captured layers, in capture order
        self.slot_of_layer = {lid: k for k, lid in enumerate(self.layer_ids)}
        self.num_captures = len(self.layer_ids)
        self.hidden_size = hidden_size
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("eagle3_ops: the capture buffer must be allocated outside CUDA-graph capture")
        self.buffer = AuxCaptureBuffer(max_tokens, hidden_size, self.num_captures, dtype, device)
        self.enabled = True
        self.fused_sites: List[str] = []
        self.fused_norms: Dict[int, Any] = {}          # layer -> the norm module whose forward is wrapped
        self.stats = {"buffer_forwards": 0, "stock_forwards": 0, "fused_captures": 0, "copied_captures": 0}
        self.routing_warned = False
        self.norm_plan = None  # qualify.Plan of the fused norm per row bucket (None: not qualified)

    @property
    def max_tokens(self) -> int:
        return self.buffer.max_tokens

    def fits(self, t: torch.Tensor) -> Optional[str]:
        """None if ``t`` ([T, H] activations) can go into the buffer, else why not."""
        buf = self.buffer.buffer
        if t.dim() != 2 or t.shape[1] != self.hidden_size:
            return f"capture shape {tuple(t.shape)} is not [T, {self.hidden_size}]"
        if t.dtype != buf.dtype or t.device != buf.device:
            return f"capture is {t.dtype} on {t.device}, buffer is {buf.dtype} on {buf.device}"
        if t.shape[0] > self.max_tokens:
            return (f"forward has {t.shape[0]} tokens, more than the buffer's {self.max_tokens} rows "
                    f"(raise {_max_tokens_env()})")
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            return "capture has a non-contiguous last dim"
        return None


def _max_tokens_env() -> str:
    from .version import ENV_MAX_TOKENS

    return ENV_MAX_TOKENS


class ForwardCapture:
    """The captures of one target forward: which accumulator it took over, T, fused slots."""

    def __init__(self, state: TargetCaptureState):
        self.state = state
        self.owner: Any = None          # the AuxHiddenStateList / AuxHiddenStatePacker taken over
        self.mode: Optional[str] = None  # None until the first capture; then "buffer" or "stock"
        self.num_tokens: Optional[int] = None
        self.count = 0                  # captures recorded so far (= the next slot)
        self.fused: Dict[int, torch.Tensor] = {}  # slot -> residual the fused norm wrote

    def claim(self, accumulator) -> bool:
        if self.owner is None:
            self.owner = accumulator
            return True
        return self.owner is accumulator

    def decide(self, value: torch.Tensor) -> str:
        if self.mode is None:
            why = self.state.fits(value)
            if why is None:
                self.mode, self.num_tokens = "buffer", value.shape[0]
            else:
                self.mode = "stock"
                _warn_once(f"stock:{self.state.model_name}:{why.split(' ')[0]}",
                           "eagle3_ops: %s: stock capture path for this forward: %s", self.state.model_name, why)
        return self.mode

    def write(self, value: torch.Tensor) -> Optional[torch.Tensor]:
        """Put ``value`` into the next slot; the slot view, or None to fall back to stock."""
        k = self.count
        if (self.mode != "buffer" or k >= self.state.num_captures or value.dim() != 2
                or value.shape[0] != self.num_tokens or self.state.fits(value) is not None):
            self.mode = "stock"
            return None
        if self.fused.get(k) is value:
            # fused_add_rmsnorm_capture already wrote exactly this residual into slot k
            self.state.stats["fused_captures"] += 1
        else:
            ops.capture(value, None, self.state.buffer.buffer, k)
            self.state.stats["copied_captures"] += 1
        self.count += 1
        return self.state.buffer.slot(k, self.num_tokens)

    def packed(self) -> torch.Tensor:
        """``buffer[:T]``: the K slots of this forward's T tokens, contiguous."""
        return self.state.buffer.view(self.num_tokens)


# ---- hooks on SGLang's accumulators (class level, registered through HookRegistry) ----------------
def list_capture_hook(original, self, hidden, *args, **kwargs):
    """AROUND ``AuxHiddenStateList.capture``: write the slot instead of cloning."""
    cap = active_capture()
    if cap is None or not cap.claim(self) or cap.decide(hidden) != "buffer":
        return original(self, hidden, *args, **kwargs)
    view = cap.write(hidden)
    if view is None:
        return original(self, hidden, *args, **kwargs)
    list.append(self, view)
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


# ---- the model forward (class-level wrapper, see routing.py) and the norm wrappers ----------------
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
    if cap.mode == "buffer":
        state.stats["buffer_forwards"] += 1
    elif cap.mode == "stock":
        state.stats["stock_forwards"] += 1
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], list):
        if cap.mode == "buffer" and out[1] is cap.owner and cap.count == state.num_captures:
            # the list holds slot views; hand over the packed view instead of cat-ing them
            out = (out[0], cap.packed())
        else:
            # A forward that did not fit the buffer still returns ONE tensor, the one SGLang's
            # pack_aux_hidden_states would make of its list: SGLang's breakable prefill graphs
            # allocate their output buffer from the largest bucket's output and refuse a list in
            # one bucket and a tensor in another (_copy_output_to_buffer: "Unsupported BCG output
            # buffer pair").
            from sglang.srt.layers.aux_hidden_states import pack_aux_hidden_states

            out = (out[0], pack_aux_hidden_states(out[1]))
    return out


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


def _norm_forward_wrapper(norm, state: TargetCaptureState, slot: int):
    original = norm.forward
    buf = state.buffer.buffer
    from sglang.srt.batch_invariant_ops import is_batch_invariant_mode_enabled

    def forward(x, residual=None, post_residual_addition=None, *args, **kwargs):
        cap = active_capture()
        if (cap is None or cap.state is not state or cap.mode == "stock" or cap.count != slot
                or slot in cap.fused or residual is None or post_residual_addition is not None
                or args or kwargs or _compiling()):
            return original(x, residual, post_residual_addition, *args, **kwargs)
        # read per call: a weight reload may replace the Parameter (SGLang's own forward reads
        # self.weight / self.variance_epsilon per call too)
        weight = norm.weight
        if (not isinstance(x, torch.Tensor) or not isinstance(residual, torch.Tensor)
                or not isinstance(weight, torch.Tensor)
                or x.dim() != 2 or x.shape != residual.shape or x.shape[0] == 0
                or x.dtype != residual.dtype or not x.is_contiguous() or not residual.is_contiguous()
                or state.fits(residual) is not None or weight.dtype != x.dtype
                or weight.shape != (x.shape[1],) or weight.device != x.device
                or is_batch_invariant_mode_enabled()):
            return original(x, residual, post_residual_addition, *args, **kwargs)
        choice = state.norm_plan.choice_for(x.shape[0]) if state.norm_plan is not None else None
        if choice is not None and choice.backend is None:
            # qualification: SGLang's own norm is faster for this many rows; the capture is a copy
            return original(x, residual, post_residual_addition, *args, **kwargs)
        from .. import dispatch

        with dispatch.using(choice.backend if choice is not None else None):
            ops.fused_add_rmsnorm_capture(x, residual, weight, float(norm.variance_epsilon), buf, slot)
        cap.fused[slot] = residual
        return x, residual

    forward.__wrapped__ = original
    forward._eagle3_ops = True
    return forward


# ---- installation ----------------------------------------------------------------------------------
def resolve_causal_lm(model):
    """The module that owns ``.model.layers_to_capture`` (Kimi-K2.5 wraps it as language_model)."""
    for candidate in (model, getattr(model, "language_model", None)):
        inner = getattr(candidate, "model", None) if candidate is not None else None
        if inner is not None and hasattr(inner, "layers_to_capture"):
            return candidate
    return None


def supported_target(inner):
    """(kind, class whose forward the plugin wraps) if ``inner`` runs a forward this module knows
    (SGLang 0.5.23's, or that one already wrapped by the plugin), else None."""
    for module_name, class_name, kind in SUPPORTED_TARGET_MODELS:
        module = sys.modules.get(module_name)
        cls = getattr(module, class_name, None) if module is not None else None
        owner = forward_owner(inner, cls) if cls is not None else None
        if owner is not None:
            return kind, owner
    return None


def serving_backends(ops_needed, device: torch.device, dtype: torch.dtype, site: str) -> Optional[Dict[str, str]]:
    """{op: backend} for the ops a site needs, or None (one warning) when they cannot be served:
    the one policy of both sides for a forced ``EAGLE3_OPS_BACKEND`` that cannot serve this device
    (or an invalid value). The site is then left stock, untouched: the op raising later inside a
    forward would stop SGLang, and quietly using another backend is what forcing one rules out."""
    from .. import dispatch

    try:
        return {op: dispatch.select(op, device, dtype)[0] for op in ops_needed}
    except (dispatch.BackendUnavailableError, ValueError) as e:
        _warn_once(f"backend:{site}:{e}", "eagle3_ops: %s left stock: %s", site, e)
        return None


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


def _default_max_tokens() -> int:
    """Rows of the buffer when EAGLE3_OPS_SGLANG_MAX_TOKENS is unset: SGLang's chunked_prefill_size
    (else max_prefill_tokens, else 16384), at least the largest decode CUDA-graph batch times the
    draft tokens per request."""
    candidates = []
    try:
        from sglang.srt.runtime_context import get_server_args

        sa = get_server_args()
        chunk = getattr(sa, "chunked_prefill_size", None)
        if chunk is not None and chunk > 0:
            candidates.append(int(chunk))
        else:
            candidates.append(int(getattr(sa, "max_prefill_tokens", None) or 16384))
        bs = getattr(sa, "cuda_graph_max_bs_decode", None) or getattr(sa, "cuda_graph_max_bs", None)
        draft_tokens = getattr(sa, "speculative_num_draft_tokens", None) or 1
        if bs:
            candidates.append(int(bs) * int(draft_tokens))
    except Exception:  # no server args published (scripts, the CPU harness)
        pass
    return max(candidates) if candidates else 16384


def _activation_dtype(inner, norms) -> torch.dtype:
    """The residual stream's dtype: the embedding output's (the model dtype), else the norms'."""
    embed = getattr(getattr(inner, "embed_tokens", None), "weight", None)
    for w in [embed] + [getattr(n, "weight", None) for n in norms]:
        if isinstance(w, torch.Tensor) and w.dtype in (torch.bfloat16, torch.float16, torch.float32):
            return w.dtype
    return torch.get_default_dtype()


def _buffer_layers(inner, owner: type) -> List[int]:
    """The capture indices this rank records, in capture order (= slot order): the layer inputs
    of layers start..end-1 it captures, then boundary L (``end_layer``) for the classes that capture
    it at the final norm."""
    start = getattr(inner, "start_layer", 0)
    end = getattr(inner, "end_layer", len(inner.layers))
    ends_too = any(sys.modules.get(m) is not None and getattr(sys.modules[m], c, None) is owner
                   for m, c in END_BOUNDARY_CAPTURE)
    upper = end + 1 if ends_too else end
    return sorted(i for i in set(inner.layers_to_capture) if start <= i < upper)


def _attention_input_norm(layer):
    boundary = getattr(layer, "attn_boundary", None)
    norm = getattr(boundary, "norm", None) if boundary is not None else None
    return norm if norm is not None else getattr(layer, "input_layernorm", None)


def install_target_capture(model, max_tokens: Optional[int] = None,
                           before_kv_sizing: bool = False) -> Optional[TargetCaptureState]:
    """Route ``model``'s EAGLE-3 captures into one persistent buffer (after SGLang configured which
    layers to capture). Returns the state, or None when the model is left stock (one warning).
    Nothing is changed on the model until every check passed. ``before_kv_sizing``: called from
    :func:`install_before_kv_sizing` (the buffer then counts against SGLang's memory budget)."""
    lm = resolve_causal_lm(model)
    name = type(model).__name__
    if lm is None:
        _warn_once(f"family:{name}", "eagle3_ops: %s has no layers_to_capture; EAGLE-3 capture left stock", name)
        return None
    inner = lm.model
    existing = inner.__dict__.get(_STATE_ATTR)
    if existing is not None:
        _check_configured_layers(existing, inner)
        return existing
    if not getattr(lm, "capture_aux_hidden_states", False):
        return None  # not capturing on this rank (e.g. a non-last pipeline stage)
    found = supported_target(inner)
    if found is None:
        _warn_once(f"family:{type(inner).__name__}",
                   "eagle3_ops: model family %s (%s) is not supported by this plugin; its EAGLE-3 "
                   "capture is left stock", name, type(inner).__name__)
        return None
    kind, owner = found
    readback = hidden_states_readback()
    if readback is not None:
        _warn_once(f"readback:{name}", "eagle3_ops: %s EAGLE-3 capture left stock: %s", name, readback)
        return None
    layer_ids = _buffer_layers(inner, owner)
    if not layer_ids:
        return None
    end = getattr(inner, "end_layer", len(inner.layers))
    norms = {i: _attention_input_norm(inner.layers[i]) for i in layer_ids if i < end}
    dtype = _activation_dtype(inner, [n for n in norms.values() if n is not None])
    hidden_size = int(lm.config.hidden_size) if hasattr(lm, "config") else int(inner.config.hidden_size)
    device = next((p.device for p in inner.parameters()), torch.device("cpu"))
    backend = serving_backends(("capture", "fused_add_rmsnorm_capture"), device, dtype, f"{name} EAGLE-3 capture")
    if backend is None:
        return None
    if max_tokens is None:
        from .. import settings
        from .version import ENV_MAX_TOKENS

        try:
            max_tokens = settings.get(ENV_MAX_TOKENS)
        except settings.SettingError as e:
            settings.report_once(e, log)
            return None
        if max_tokens is None:
            max_tokens = _default_max_tokens()

    # Decide every site first, then install (no half-patched model on error).
    fusable = {}
    for i in layer_ids:
        if i == 0 or i >= end:
            continue  # the embedding output / boundary L at the final norm: no add here, the slot is a copy
        norm = norms[i]
        why = _norm_fusable_statically(norm, dtype) if norm is not None else "no input norm"
        if why is None:
            fusable[i] = norm
        else:
            _warn_once(f"nofuse:{name}:{why}", "eagle3_ops: %s: layer %d input norm not fused (%s); "
                       "its capture is a copy", name, i, why)
    state = TargetCaptureState(name, layer_ids, hidden_size, dtype, device, int(max_tokens))
    norm_wrappers = {i: (norm, _norm_forward_wrapper(norm, state, state.slot_of_layer[i]))
                     for i, norm in fusable.items()}
    # class level, so that SGLang's compile trampolines (which call type(module).forward) reach it
    wrap_class_forward(owner, _STATE_ATTR, _run_forward)
    for i, (norm, wrapper) in norm_wrappers.items():
        norm.forward = wrapper
        state.fused_sites.append(f"model.layers.{i}.input_layernorm")
        state.fused_norms[i] = norm
    inner.__dict__[_STATE_ATTR] = state
    _installed.add(state)
    if norm_wrappers:
        _qualify_norm(state, name, dtype, device)

    mib = state.buffer.buffer.numel() * state.buffer.buffer.element_size() / 2**20
    log.info("eagle3_ops: patched %s capture (%s.%s, %s path): layers %s -> one persistent [%d, %dx%d] %s "
             "buffer on %s (%.1f MiB), pack_aux_hidden_states gets its view (no clone/cat); backend capture=%s",
             name, type(inner).__module__.rsplit(".", 1)[-1], type(inner).__name__, kind, layer_ids,
             state.max_tokens, state.num_captures, hidden_size, str(dtype).replace("torch.", ""), device,
             mib, backend["capture"])
    for i in sorted(norm_wrappers):
        log.info("eagle3_ops: patched %s model.layers.%d.input_layernorm: add+RMSNorm writes capture slot %d "
                 "(eagle3::fused_add_rmsnorm_capture); backend fused_add_rmsnorm_capture=%s",
                 name, i, state.slot_of_layer[i], backend["fused_add_rmsnorm_capture"])
    from .version import ENV_MAX_TOKENS

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


def _qualify_norm(state: TargetCaptureState, name: str, dtype: torch.dtype, device: torch.device) -> None:
    """Qualification (eagle3_ops/qualify.py) of the fused add+RMSNorm capture at this model's H: per
    row bucket the fastest correct backend, or SGLang's own norm (then a slot copy) where none
    beats it. Runs eagerly at install (before graph capture); logged as one table."""
    from .. import qualify

    if not qualify.enabled(device):
        return
    shape = qualify.Shape("fused_add_rmsnorm_capture", state.hidden_size, state.num_captures, 0,
                          str(dtype).replace("torch.", ""))
    plan = qualify.qualify(shape, device, qualify.buckets_up_to(state.max_tokens))
    state.norm_plan = plan
    for line in plan.table().splitlines():
        log.info("eagle3_ops: %s fused norm %s", name, line)


def _check_configured_layers(state: TargetCaptureState, inner) -> None:
    """SGLang configured the capture after the plugin installed it before KV sizing (with the same
    call and arguments): the layers must be the ones the buffer was laid out for."""
    found = supported_target(inner)
    now = _buffer_layers(inner, found[1]) if found is not None else None
    if now != state.layer_ids and state.enabled:
        state.enabled = False
        log.error("eagle3_ops: %s: SGLang configured capture layers %s, but the capture buffer was laid out for %s; "
                  "this model uses SGLang's stock capture", state.model_name, now, state.layer_ids)


def _fc_sharding_note(state: TargetCaptureState) -> str:
    """What the draft fc sharding gave back in this process (it runs before the KV sizing, see
    plugin.py), next to what the buffer costs."""
    from .draft_fc_hooks import sharded_bytes_released

    freed = sharded_bytes_released()
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
    lm = resolve_causal_lm(model)
    if lm is None or supported_target(lm.model) is None:
        return None  # stays stock; the configuration-time install warns
    model.set_eagle3_layers_to_capture(aux.eagle_aux_hidden_state_layer_ids)
    return install_target_capture(model, before_kv_sizing=True)


def check_routing(model) -> Optional[str]:
    """After SGLang's CUDA-graph / compile setup: None if ``model`` (when patched) still routes its
    forward and fused norms through the plugin, else what changed (warned once per model)."""
    lm = resolve_causal_lm(model)
    inner = lm.model if lm is not None else None
    state = inner.__dict__.get(_STATE_ATTR) if inner is not None else None
    if state is None:
        return None
    problem = routing_problem(inner, _STATE_ATTR)
    if problem is None:
        lost = [i for i, norm in sorted(state.fused_norms.items())
                if not getattr(norm.__dict__.get("forward"), "_eagle3_ops", False)]
        if lost:
            problem = (f"the forward of the fused input norm of layer(s) {lost} was replaced (those "
                       f"captures are now copies)")
    if problem is not None and not state.routing_warned:
        state.routing_warned = True
        log.warning("eagle3_ops: %s: after SGLang's CUDA-graph/compile setup the model no longer goes through "
                    "the plugin everywhere: %s. Forwards that bypass it run SGLang's stock capture path.",
                    state.model_name, problem)
    return problem


def capture_state(model) -> Optional[TargetCaptureState]:
    """The installed state of a target model (or of its inner model), or None if it runs stock."""
    lm = resolve_causal_lm(model)
    inner = lm.model if lm is not None else model
    return getattr(inner, "__dict__", {}).get(_STATE_ATTR)
