"""How each engine turns a draft's layer ids into captured hidden states.

Vocabulary used everywhere in the doctor: **boundary i** = Hugging Face
``output_hidden_states[i]`` = the residual stream *entering* decoder layer ``i`` (layers count
from 0) = the output of layer ``i-1``. Boundary 0 is the token embeddings; boundary ``L`` is the
output of the last layer (engines capture it before the final norm; Hugging Face's
``output_hidden_states[L]`` is after the final norm).

Where the rules come from: nothing here knows a model family. ``rules.target_rules`` resolves the
target's class the way the engine does and reads what that class's code does (SGLang: the installed,
pinned package runs its own ``set_eagle3_layers_to_capture`` on a stand-in; otherwise, and for vLLM and
TensorRT-LLM, the pinned tables in ``tables/`` generated from the engines' code). This module turns
those rules and the draft's ids into slots: which boundary each slot gets, in which order, and why a
slot stays empty.

Engine-wide facts used below (each read from the engine's code): captures come out in layer order and a
repeated boundary is captured once (SGLang tests ``i in layers_to_capture`` in its layer loop; vLLM keeps
``tuple(sorted(set(layers)))``, ``interfaces.EagleModelMixin``; TensorRT-LLM ``sorted(list(...))`` in
``Eagle3OneModelSpecMetadata.__post_init__``, id -1 first), except where a class records its captures itself
(vLLM's Transformers backend: one recorder per id, in the order the ids are written, ``capture_order`` in
its table row); only the last pipeline stage's captures reach
the draft (SGLang; vLLM's V2 runner relays earlier stages' captures for decoders with
``supports_aux_hidden_states_over_pp``); TensorRT-LLM never reads the draft config's ids
(``EagleDecodingConfig.eagle3_layers_to_capture``), default ``(1, L//2 - 1, L - 4)`` captured after each
layer = boundaries ``(2, L//2, L-3)``, -1 = the final state after the last norm. TensorRT-LLM was read
from its GitHub sources at the commit in ``TRTLLM_SOURCE`` (its 1.2.1 wheel cannot be downloaded here).
"""
from __future__ import annotations

import dataclasses
from typing import List, Optional, Tuple

from .configs import DraftInfo, TargetInfo
from .rules import ENGINE_NAMES, TargetRules, target_rules

ENGINES = ("sglang", "vllm", "trtllm")

# Where each engine takes the draft's ids from (for messages).
IDS_LOCATION = {
    "sglang": "eagle_config.eagle_aux_hidden_state_layer_ids in the draft's config.json",
    "vllm": "the top-level eagle_aux_hidden_state_layer_ids in the draft's config.json",
    "trtllm": "eagle3_layers_to_capture in TensorRT-LLM's speculative_config (Eagle3DecodingConfig)",
}


# The TensorRT-LLM code the engine-wide rules were read from (GitHub; the 1.2.1 wheel cannot be downloaded here and
# the store holds no commit known to be v1.2.1, whose submodule pin is 2fdb9e66302b15db9a9b5e71d3ac45d5921ea45d).
TRTLLM_SOURCE = ("NVIDIA/TensorRT-LLM tensorrt_llm/_torch/speculative/eagle3.py at commit "
                 "001e67005b4f64b69b0045456870be48ab7b2cf0")


def POST_NORM(num_layers: int) -> int:  # noqa: N802 - a numbering constant that depends on L
    """The doctor's number for TensorRT-LLM's id -1: the final hidden state *after* the model's last norm
    (``SpecDecOneEngineForCausalLM`` captures the output of ``self.model``), one past boundary L."""
    return num_layers + 1


def default_boundaries(num_layers: int) -> List[int]:
    """Every engine's default (SGLang [2, L//2, L-3]; vLLM the same; TRT-LLM (1, L//2-1, L-4) + 1)."""
    return [2, num_layers // 2, num_layers - 3]


def pp_stage_ranges(num_layers: int, pp: int, partition: Optional[List[int]] = None) -> List[Tuple[int, int]]:
    """[start, end) layers of each pipeline stage (SGLang ``get_pp_indices``; ``partition`` =
    SGLANG_PP_LAYER_PARTITION)."""
    if partition is not None:
        starts = [sum(partition[:r]) for r in range(pp)]
        return [(s, s + n) for s, n in zip(starts, partition)]
    base, rem = divmod(num_layers, pp)
    out = []
    for r in range(pp):
        if r >= pp - rem:
            start = r * (base + 1) - (pp - rem)
            out.append((start, start + base + 1))
        else:
            out.append((r * base, r * base + base))
    return out


def short_boundary(i: int, num_layers: int) -> str:
    """Short form: 'the embeddings' / 'the output of layer i-1'."""
    if i == 0:
        return "the embeddings"
    if i == POST_NORM(num_layers):
        return "the final state after the last norm"
    if 0 < i <= num_layers:
        return f"the output of layer {i - 1}"
    return f"boundary {i} (does not exist)"


def describe_boundary(i: int, num_layers: int) -> str:
    """The physical hidden state that boundary ``i`` is, in words."""
    L = num_layers
    if i == 0:
        return "token embeddings (input of layer 0)"
    if 0 < i < L:
        return f"residual stream entering layer {i} = output of layer {i - 1}"
    if i == L:
        return f"output of the last layer (layer {L - 1}), before the final norm"
    if i == POST_NORM(L):
        return f"output of the last layer (layer {L - 1}) after the final norm (TensorRT-LLM id -1)"
    return f"nothing: boundary {i} does not exist (this model has boundaries 0..{L})"


@dataclasses.dataclass
class SlotCapture:
    """One fc slot as the engine fills it: its position, the id written for it, the boundary the engine captures, and
    whether (and why not) it is filled at all."""
    slot: int                      # position in the engine's concatenation (fc columns slot*H..)
    config_id: Optional[int]       # the id as written (None = engine default)
    boundary: int                  # the boundary the engine captures for it
    captured: bool                 # False: the engine never fills this slot
    why_not: str = ""


@dataclasses.dataclass
class EngineWiring:
    """What one engine feeds the draft for one target and draft config: the ids it reads and where from, the boundary of
    each slot in its concatenation order, and what it reorders, merges, cannot capture or raises."""
    engine: str
    rules: TargetRules
    ids: Optional[List[int]]       # the ids the engine uses (None = its default)
    ids_source: str                # human text: where they came from
    ignored_ids: Optional[Tuple[str, List[int]]]  # ids present in the config that this engine does not read
    rule: str                      # short rule, e.g. "id + 1"
    slots: List[SlotCapture]       # in the engine's concatenation order (only distinct captures)
    config_order: List[int]        # boundaries in the order the ids are written (before any reordering)
    duplicates: List[int]          # boundaries listed more than once
    reordered: bool                # the engine's slot order differs from the order ids are written
    pp_last_stage: Optional[Tuple[int, int]]
    capture_point: str             # after-allreduce | unknown
    capture_point_evidence: str
    error: Optional[str] = None    # what the engine raises when it configures these ids (start-up)
    unknown: Optional[str] = None  # the rules cannot say what the engine does with these ids (why)

    @property
    def name(self) -> str:
        """The engine's display name (``ENGINE_NAMES``)."""
        return ENGINE_NAMES[self.engine]

    @property
    def family(self) -> str:
        """The id rule's name (for the JSON report)."""
        return self.rules.rule_key or "unknown"

    @property
    def captured_boundaries(self) -> List[int]:
        """The boundaries the engine really fills, in slot order."""
        return [s.boundary for s in self.slots if s.captured]


VLLM_RUNNERS = ("v2", "v1")


def _vllm_reads(runner: str) -> List[str]:
    """The draft-config keys vLLM's ``runner`` reads the ids from, in order (from its table)."""
    from . import tables

    t = tables.load("vllm") or {}
    return list(((t.get("ids") or {}).get(runner) or {}).get("reads") or ["eagle_aux_hidden_state_layer_ids"])


def _lookup(cfg: dict, key: str):
    v = cfg
    for part in key.split("."):
        v = v.get(part) if isinstance(v, dict) else None
    return v if isinstance(v, list) and v and all(isinstance(x, int) and not isinstance(x, bool) for x in v) else None


def _engine_ids(engine: str, draft: DraftInfo, vllm_runner: str = "v2", trtllm_layers: Optional[List[int]] = None
                ) -> Tuple[Optional[List[int]], str, Optional[Tuple[str, List[int]]]]:
    """(ids the engine uses or None for its default, where they come from, ids it ignores)."""
    nested_loc = "eagle_config.eagle_aux_hidden_state_layer_ids"
    top_loc = "top-level eagle_aux_hidden_state_layer_ids"
    if engine == "sglang":  # spec_aux_hidden_state.py: eagle_config only
        if draft.nested_ids is not None:
            return draft.nested_ids, nested_loc, None
        return None, "SGLang's default (the draft config has no eagle_config.eagle_aux_hidden_state_layer_ids)", \
            ((top_loc, draft.top_ids) if draft.top_ids is not None else None)
    if engine == "vllm":
        # the keys the runner's function reads, in order (V2: eagle3_utils.get_eagle3_aux_layers_from_config;
        # V1: gpu_model_runner._get_eagle3_aux_layers_from_config), as the table recorded them from the wheel
        reads = [k for k in _vllm_reads(vllm_runner) if "eagle" in k and ("layer_ids" in k)]
        for k in reads:
            ids = draft.top_ids if k == "eagle_aux_hidden_state_layer_ids" else \
                draft.nested_ids if k == "eagle_config.eagle_aux_hidden_state_layer_ids" else _lookup(draft.config, k)
            if ids is not None:
                where = top_loc if k == "eagle_aux_hidden_state_layer_ids" else \
                    f"{k} (vLLM's {vllm_runner.upper()} runner reads it, as given)"
                return list(ids), where, None
        read_txt = " or ".join(reads)
        present = (nested_loc, draft.nested_ids) if draft.nested_ids is not None and nested_loc not in reads else None
        return None, (f"vLLM's default (the draft config has no {read_txt}, the only place"
                      f"{'s' if len(reads) > 1 else ''} the {vllm_runner.upper()} runner reads)"), present
    # trtllm (llm_args.EagleDecodingConfig.eagle3_layers_to_capture): only what the user passes; it never reads
    # the draft's config.json ids
    if trtllm_layers is not None:
        return list(trtllm_layers), "eagle3_layers_to_capture (--trtllm-layers)", None
    present = (nested_loc, draft.nested_ids) if draft.nested_ids is not None else \
        ((top_loc, draft.top_ids) if draft.top_ids is not None else None)
    return None, ("TensorRT-LLM's default (no eagle3_layers_to_capture given with --trtllm-layers; TensorRT-LLM "
                  "never reads the draft config's ids)"), present


def map_ids(rules: TargetRules, ids: Optional[List[int]], num_layers: int) -> Tuple[List[int], str]:
    """Boundaries (in the order ids are written) that the engine derives from ``ids``, and the rule text."""
    m = rules.map_ids(ids, num_layers)
    return m.config_order, m.rule


def uncapturable_reason(rules: TargetRules, b: int, num_layers: int) -> str:
    """Why the engine never fills a slot for boundary ``b`` ("" when it does)."""
    L = num_layers
    eng = rules.name
    if rules.engine == "trtllm" and b == POST_NORM(L):
        return ""
    if b < 0 or b > L:
        if rules.engine == "vllm":
            return (f"boundary {b} does not exist (boundaries are 0..{L}); vLLM's layer loop never matches it and "
                    f"skips it silently")
        if rules.engine == "sglang" and rules.rule_key == "id+1-if-first-is-1":
            return (f"boundary {b} does not exist (boundaries are 0..{L}): SGLang's {rules.arch} uses ids as given "
                    f"when the first id is not 1 ({rules.evidence.get('ids_method', '')}), and no layer has index {b}")
        return f"boundary {b} does not exist (boundaries are 0..{L})"
    if not rules.capturable(b, L):
        holder = rules.evidence.get("holder_class", "").rsplit(".", 1)[-1] or rules.arch
        return (f"{eng} captures at the entry of each layer ({holder}'s layer loop), so boundary {L} (the output of "
                f"the last layer) is never captured")
    if rules.raises_at_zero and b == 0:
        return rules.raises_at_zero
    return ""


def resolve_wiring(engine: str, target: TargetInfo, draft: DraftInfo, *, pp: int = 1,
                   pp_partition: Optional[List[int]] = None, vllm_runner: str = "v2",
                   trtllm_layers: Optional[List[int]] = None, engine_code: str = "auto",
                   rules: Optional[TargetRules] = None) -> EngineWiring:
    """The :class:`EngineWiring` of ``engine`` for this target and draft: the ids it reads, the boundary each maps to by
    the target's rules, deduplicated and put in the engine's slot order, with each slot marked uncapturable where the
    engine (or, under PP, the last stage) never fills it."""
    rules = rules or target_rules(engine, target, engine_code)
    L = target.num_layers
    ids, source, ignored = _engine_ids(engine, draft, vllm_runner, trtllm_layers)
    mapped = rules.map_ids(ids, L)
    config_order, rule = mapped.config_order, mapped.rule

    stage = None
    first_cap = 0
    # vLLM 0.33.0's V2 runner relays earlier stages' captures (pp_utils.relay_aux_hidden_states) for decoders with
    # supports_aux_hidden_states_over_pp; other models raise, and V1 relays nothing.
    relayed = engine == "vllm" and vllm_runner == "v2" and rules.pp_relay
    if pp > 1 and not relayed:
        stage = pp_stage_ranges(L, pp, pp_partition)[-1]
        first_cap = stage[0]

    # Concatenation order: layer order; TRT-LLM sorts ids (id -1, the post-norm state, first); vLLM's Transformers
    # backend keeps the ids' written order (rules.capture_order). A repeated boundary is captured once.
    seen, duplicates, order = set(), [], []
    for pos, b in enumerate(config_order):
        if b in seen:
            duplicates.append(b)
            continue
        seen.add(b)
        order.append((pos, b))
    if engine == "trtllm" and ids is not None:
        order.sort(key=lambda pb: ids[pb[0]])  # a Set[int], sorted: id -1 (post-norm) comes first
    elif rules.capture_order != "written":
        order.sort(key=lambda pb: pb[1])
    reordered = [p for p, _ in order] != sorted(p for p, _ in order)

    slots = []
    for k, (pos, b) in enumerate(order):
        cid = ids[pos] if ids is not None else None
        why = uncapturable_reason(rules, b, L)
        if not why and b < first_cap:
            why = (f"only the last pipeline stage captures, and it runs layers {stage[0]}..{stage[1] - 1}: "
                   f"boundary {b} is computed on an earlier stage")
        slots.append(SlotCapture(k, cid, b, not why, why))

    cp, cp_ev = capture_point(rules)
    return EngineWiring(engine=engine, rules=rules, ids=ids, ids_source=source,
                        ignored_ids=ignored, rule=rule if ids is not None else "engine default",
                        slots=slots, config_order=config_order, duplicates=duplicates, reordered=reordered,
                        pp_last_stage=stage, capture_point=cp, capture_point_evidence=cp_ev, error=mapped.error,
                        unknown=mapped.unknown)


def capture_point(rules: TargetRules) -> Tuple[str, str]:
    """Where the engine takes the capture relative to the tensor-parallel all-reduce."""
    if rules.engine == "sglang" and rules.entry == "layer-boundary":
        return ("after-allreduce",
                f"SGLang {rules.version}'s {rules.evidence.get('holder_class', '').rsplit('.', 1)[-1] or rules.arch} "
                f"passes its capture to the layer boundary ({rules.entry_code}), which completes the deferred "
                f"all-reduce before it captures (layer_boundary/stage.py: stream.complete before capture; the fused "
                f"all-reduce+add+norm path captures the gathered residual)")
    if rules.engine == "vllm" and rules.supported and rules.capture_known:
        return ("after-allreduce",
                f"vLLM captures hidden_states + residual between layers ({rules.evidence.get('decoder')}), after "
                f"each layer's row-parallel all-reduce")
    if rules.engine == "trtllm":
        return ("after-allreduce" if rules.supported else "unknown",
                f"TensorRT-LLM's Eagle3 spec metadata stores hidden_states + residual where a model's decoder layer "
                f"calls maybe_capture_hidden_states ({TRTLLM_SOURCE}); whether this model's layers call it after "
                f"their all-reduce is " + ("in its table" if rules.supported else
                                           "not verified (no per-class TensorRT-LLM table: its 1.2.1 sources are "
                                           "not available here)"))
    what = f"captures {rules.entry} ({rules.entry_code})" if rules.entry else "has no capture code the doctor located"
    return ("unknown", f"{rules.name}'s {rules.arch or 'class'} {what}: the doctor cannot tell from its code whether "
                       f"that is before or after the tensor-parallel all-reduce")


def ids_for_boundaries(rules: TargetRules, boundaries: List[int], num_layers: int) -> Optional[List[int]]:
    """Ids to write so that the engine captures exactly ``boundaries`` in this order (None if impossible)."""
    if not boundaries:
        return None
    for ids in ([b - 1 for b in boundaries], list(boundaries)):
        m = rules.map_ids(ids, num_layers)
        if m.error or m.config_order != list(boundaries):
            continue
        if rules.engine == "trtllm":
            order = sorted(range(len(ids)), key=lambda p: ids[p])
        elif rules.capture_order == "written":
            order = list(range(len(ids)))
        else:
            order = sorted(range(len(ids)), key=lambda p: m.config_order[p])
        if order != list(range(len(ids))) or len(set(m.config_order)) != len(m.config_order):
            continue  # the engine would reorder or merge them
        if not any(uncapturable_reason(rules, b, num_layers) for b in m.config_order):
            return ids
    return None


def rule_text(rules: TargetRules) -> str:
    """The id -> boundary rule of the engine for this target, in words."""
    return rules.rule_text
