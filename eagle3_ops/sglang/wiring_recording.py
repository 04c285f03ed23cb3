"""What the live check records and how: the recorder it puts on the target (:func:`install`: the states dump's
``dump_states.StatesRecorder``, written in the background on TP rank 0), and which forwards it may record without
changing a kernel SGLang runs. A recorded layer completes its deferred all-reduce before its input norm, so where
SGLang would fuse that all-reduce with the add+RMSNorm (FlashInfer's, CuTe DSL's or aiter's fusion at TP > 1; the
largest fused forward by SGLang's own predicates, :func:`largest_fused_forward`), only longer forwards are recorded
(:func:`smallest_forward`); what the recording then waits for, in words (:func:`waits_for`).

SGLang's own modules are imported where they are used (inside the functions): this module is imported by the
plugin's hooks, and importing it must not import SGLang (a script or a test may have none)."""
from __future__ import annotations

import types
from pathlib import Path
from typing import Callable, List, Optional, Tuple

import torch

from ..doctor.states import DumpSettings
from . import dump_states, groups
from .wiring_result import LABEL, RECORD_TOKENS, advice


def install(model, states: Path, boundaries: List[int], *, min_prompt_tokens: int, min_forward: int,
            close_after: int, on_written: Callable[[Optional[str]], None]):
    """The live check's recorder on ``model`` (every TP rank calls this; they agree), writing ``states`` off the
    forward's thread: (the recorder, None), or (None, why this rank cannot record; None where dump_states said it)."""
    refused: List[str] = []
    recorder = dump_states.install_recorder(
        model, DumpSettings(states, RECORD_TOKENS, "auto"), boundaries=boundaries, label=LABEL,
        min_prompt_tokens=min_prompt_tokens, min_forward_tokens=min_forward, close_after=close_after,
        on_written=on_written, advice=advice, on_refused=refused.append)
    if recorder is None:
        return None, (refused[0] if refused else None)
    recorder.background_write = True  # rank 0 writes the file off the forward's thread
    return recorder, None


def waits_for(min_prompt_tokens: int, min_forward: int) -> str:
    """The prompts the recording waits for, in words."""
    waits = (f"the first prompt(s) of at least {min_prompt_tokens} tokens" if not min_forward else
             f"the first prefill of more than {min_forward - 1} tokens (shorter ones may take SGLang's fused "
             f"all-reduce+RMSNorm, which recording would change)")
    if mlp_sync():  # the prefill-graph decision is then a group vote the plugin leaves alone
        waits += (" that SGLang runs eagerly (this server syncs MLP batches across ranks, so prefills replayed "
                  "from a CUDA graph are not seen)")
    return waits


def smallest_forward(model, cfg, raw_cfg: dict) -> Tuple[int, Optional[str]]:
    """(the fewest tokens a recorded forward may have: 0 = any, None) or (0, why no forward can be recorded here
    without changing a layer's kernels). ``cfg``: the target's config as SGLang holds it; ``raw_cfg``: as a dict."""
    text = getattr(cfg, "text_config", None) or raw_cfg.get("text_config") or {}
    hidden = getattr(cfg, "hidden_size", None) or raw_cfg.get("hidden_size") or (
        text.get("hidden_size") if isinstance(text, dict) else getattr(text, "hidden_size", None))
    dtype = getattr(getattr(model, "config", None), "torch_dtype", None)
    fused = largest_fused_forward(hidden, dtype if isinstance(dtype, torch.dtype) else torch.bfloat16)
    if fused is None:
        return 0, ("SGLang may fuse a layer's all-reduce with its add+RMSNorm here for forwards of any size, "
                   "and recording would change that layer's kernels")
    largest = largest_forward()
    if fused and largest is not None and fused >= largest:
        return 0, (f"SGLang may fuse a layer's all-reduce with its add+RMSNorm in every prefill here (up to "
                   f"{fused} tokens; the largest prefill is {largest}), and recording would change that "
                   f"layer's kernels")
    return (fused + 1 if fused else 0), None


def largest_true(pred, limit: int = 1 << 22) -> Optional[int]:
    """The largest n with pred(n) for a predicate true on 1..max and false above; 0 if pred(1) is
    false; None if still true at ``limit`` (no bound)."""
    if not pred(1):
        return 0
    lo, hi = 1, 2
    while pred(hi):
        if hi >= limit:
            return None
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if pred(mid) else (lo, mid)
    return lo


def largest_fused_forward(hidden_size, dtype) -> Optional[int]:
    """The most tokens a forward may have for SGLang to fuse a layer's all-reduce with its add+RMSNorm
    (then recording a layer SGLang does not capture would run it unfused), by SGLang's own predicates:
    FlashInfer's fusion (``flashinfer_ar_fusion_applies``), CuTe DSL's (its workspace bound
    ``_resolve_max_m``) and aiter's (``aiter_ar_fusion_applies``, a byte bound). 0: none can; None:
    cannot tell, or no bound."""
    if groups.tp_rank_size()[1] <= 1:
        return 0
    try:
        from sglang.srt.layers.flashinfer_comm_fusion import uses_cutedsl_ar_fusion
        from sglang.srt.layers.layer_boundary.residual import add_norm
        from sglang.srt.model_executor.forward_batch_info import ForwardMode
        from sglang.srt.runtime_context import get_exec

        sizes = [largest_true(add_norm.flashinfer_ar_fusion_applies)]
        if uses_cutedsl_ar_fusion():
            from sglang.srt.layers.layer_boundary.fusions.cutedsl import _resolve_max_m  # SGLang's own bound

            max_running = getattr(dump_states.server_args(), "max_running_requests", None)
            sizes.append(_resolve_max_m(max_running_requests=max_running))
        if getattr(get_exec().comm, "enable_aiter_allreduce_fusion", False):
            fb = types.SimpleNamespace(forward_mode=ForwardMode.EXTEND)
            sizes.append(largest_true(lambda n: add_norm.aiter_ar_fusion_applies(
                torch.empty((n, int(hidden_size)), dtype=dtype or torch.bfloat16, device="meta"), fb)))
        return None if any(x is None for x in sizes) else max(int(x) for x in sizes)
    except Exception:  # cannot tell: assume no bound
        return None


def largest_forward() -> Optional[int]:
    """The most tokens one prefill forward can have in this server (``--chunked-prefill-size``, else
    ``--max-prefill-tokens``), or None (no server)."""
    sa = dump_states.server_args()
    if sa is None:
        return None
    for name in ("chunked_prefill_size", "max_prefill_tokens"):
        v = getattr(sa, name, None)
        if isinstance(v, int) and v > 0:
            return v
    return None


def mlp_sync() -> bool:
    """SGLang's own ``require_mlp_sync`` (DP attention, or an MoE all-to-all / dense-TP layout): then
    ``global_num_tokens_cpu`` is set and the prefill graph is a group decision."""
    try:
        from sglang.srt.utils.common import require_mlp_sync

        return bool(require_mlp_sync())
    except Exception:
        return False
