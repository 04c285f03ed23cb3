"""How each engine turns a draft's layer ids into captured hidden states.

Vocabulary used everywhere in the doctor: **boundary i** = Hugging Face
``output_hidden_states[i]`` = the residual stream *entering* decoder layer ``i`` (layers count
from 0) = the output of layer ``i-1``. Boundary 0 is the token embeddings; boundary ``L`` is the
output of the last layer (engines capture it before the final norm; Hugging Face's
``output_hidden_states[L]`` is after the final norm).

Rules (read from the engines' source; SGLang pinned at 0.5.23):

SGLang (``srt/model_executor/model_runner_components/spec_aux_hidden_state.py`` reads
``eagle_config.eagle_aux_hidden_state_layer_ids`` only; ``<model>.set_eagle3_layers_to_capture``):
- llama, mistral, qwen2/qwen3 (dense and MoE), glm4_moe, gemma3, minimax_m2, ...: boundary = id + 1.
- deepseek_v2/v3 (and Kimi-K2/K2.5, glm4_moe_lite): boundary = id + 1 only if the *first* id is 1,
  otherwise boundary = id.
- gpt_oss: boundary = id, if the largest id equals L (the ids already name boundaries);
  otherwise boundary = id + 1.
- no ids: boundaries ``[2, L//2, L-3]`` (the default is already in boundary numbering).
- capture happens in the decoder loop ``for i in range(start_layer, end_layer): ... capture if i in
  layers_to_capture`` at the entry of layer ``i``, so boundaries ``0..L-1`` can be captured and
  boundary ``L`` never is (gpt_oss alone also captures ``L``, at the final norm). Captures come out
  in layer order, duplicates once. Only the last pipeline stage captures
  (``set_eagle3_layers_to_capture`` returns early on other ranks), so with ``--pp > 1`` boundaries
  before the last stage's first layer are never captured.
- the captured value is taken after the layer boundary completes the deferred tensor-parallel
  all-reduce (``srt/layers/layer_boundary/stage.py::_prepare_attention``: ``stream.complete``).

vLLM 0.33.0 (read from its wheel): the V2 model runner (the default;
``v1/worker/gpu/spec_decode/eagle/eagle3_utils.get_eagle3_aux_layers_from_config``) reads the
*top-level* ``eagle_aux_hidden_state_layer_ids`` only; the V1 runner (``VLLM_USE_V2_MODEL_RUNNER=0``,
and P-EAGLE parallel drafting; ``gpu_model_runner._get_eagle3_aux_layers_from_config``) falls back to
``eagle_config``'s ids, as given. Boundary = id, captured as ``hidden_states + residual`` at the entry
of layer ``id`` (``0`` = embeddings) or after the last layer (``id == L``); ids are sorted and
de-duplicated (``EagleModelMixin._set_aux_hidden_state_layers``); ids outside 0..L are skipped
silently; deepseek_v2 raises on id 0 (``residual`` is still None). Default ``(2, L//2, L-3)``. With
``--pp > 1`` the V2 runner relays earlier stages' captures for llama/qwen2 only.

TensorRT-LLM (its sources around 1.2.1; ``EagleDecodingConfig.eagle3_layers_to_capture``): it never
reads the draft config's ids; id k is captured *after* layer k (boundary k + 1) by
``maybe_capture_hidden_states``, after the layer's all-reduce; ``-1`` is the final state after the
model's last norm (``POST_NORM``); ids are a set, concatenated in ascending id order (``-1`` first);
default ``(1, L//2 - 1, L - 4)`` = boundaries ``(2, L//2, L-3)``.
"""
from __future__ import annotations

import dataclasses
from typing import List, Optional, Tuple

from .configs import DraftInfo, TargetInfo

ENGINES = ("sglang", "vllm", "trtllm")
ENGINE_NAMES = {"sglang": "SGLang", "vllm": "vLLM", "trtllm": "TensorRT-LLM"}

# model families (SGLang id rules)
PLUS_ONE = "plus-one"
DEEPSEEK = "deepseek"
GPT_OSS = "gpt-oss"
UNKNOWN = "unknown"

_DEEPSEEK_TYPES = {"deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2", "kimi_k25", "glm4_moe_lite",
                   "kimi_vl"}
_GPT_OSS_TYPES = {"gpt_oss"}
_PLUS_ONE_TYPES = {"llama", "llama4_text", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "qwen3_next",
                   "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen2_5_vl", "qwen3_vl",
                   "qwen3_vl_moe", "glm4_moe", "minimax_m2", "minimax_m3", "gemma3", "gemma3_text", "gemma4",
                   "gemma4_text", "bailing_moe", "exaone_moe", "apertus", "longcat_flash", "phi3", "internlm3",
                   "glm5_next"}

ENGINE_RULE = {
    "vllm": "id (0 = embeddings)",
    "trtllm": "id + 1 (captured after layer id; -1 = the final state after the last norm)",
}

FAMILY_RULE = {
    PLUS_ONE: "id + 1",
    DEEPSEEK: "id + 1 if the first id is 1, else id",
    GPT_OSS: "id if the largest id is L, else id + 1",
    UNKNOWN: "id + 1 (assumed)",
}

# Where each engine takes the draft's ids from (for messages).
IDS_LOCATION = {
    "sglang": "eagle_config.eagle_aux_hidden_state_layer_ids in the draft's config.json",
    "vllm": "the top-level eagle_aux_hidden_state_layer_ids in the draft's config.json",
    "trtllm": "eagle3_layers_to_capture in TensorRT-LLM's speculative_config (Eagle3DecodingConfig)",
}


def detect_family(target: TargetInfo) -> Tuple[str, str]:
    """(family, evidence) of the target's model code in SGLang."""
    types = [t for t in (target.text_model_type, target.model_type) if t]
    for t in types:
        if t in _DEEPSEEK_TYPES:
            return DEEPSEEK, f"model_type '{t}'"
        if t in _GPT_OSS_TYPES:
            return GPT_OSS, f"model_type '{t}'"
        if t in _PLUS_ONE_TYPES:
            return PLUS_ONE, f"model_type '{t}'"
    for a in target.architectures:
        if a.startswith(("DeepseekV2", "DeepseekV3", "KimiK2")):
            return DEEPSEEK, f"architecture '{a}'"
        if a.startswith("GptOss"):
            return GPT_OSS, f"architecture '{a}'"
        if a.startswith(("Llama", "Mistral", "Qwen", "Gemma", "Glm4Moe", "MiniMax", "Phi3")):
            return PLUS_ONE, f"architecture '{a}'"
    return UNKNOWN, f"model_type '{types[0] if types else '?'}'"


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
    slot: int                      # position in the engine's concatenation (fc columns slot*H..)
    config_id: Optional[int]       # the id as written (None = engine default)
    boundary: int                  # the boundary the engine captures for it
    captured: bool                 # False: the engine never fills this slot
    why_not: str = ""


@dataclasses.dataclass
class EngineWiring:
    engine: str
    family: str
    family_evidence: str
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

    @property
    def name(self) -> str:
        return ENGINE_NAMES[self.engine]

    @property
    def captured_boundaries(self) -> List[int]:
        return [s.boundary for s in self.slots if s.captured]


VLLM_RUNNERS = ("v2", "v1")
VLLM_PP_RELAY_TYPES = {"llama", "qwen2"}  # vLLM 0.33.0 models with supports_aux_hidden_states_over_pp = True


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
        # V2 runner (default in 0.33.0): eagle3_utils.get_eagle3_aux_layers_from_config reads the top level only;
        # V1 runner: gpu_model_runner._get_eagle3_aux_layers_from_config falls back to eagle_config, as given.
        if draft.top_ids is not None:
            return draft.top_ids, top_loc, None
        if vllm_runner == "v1" and draft.nested_ids is not None:
            return draft.nested_ids, f"{nested_loc} (vLLM's V1 runner falls back to it)", None
        return None, (f"vLLM's default (the draft config has no top-level eagle_aux_hidden_state_layer_ids"
                      f"{'' if vllm_runner == 'v1' else ', the only place the V2 runner reads'})"), \
            ((nested_loc, draft.nested_ids) if draft.nested_ids is not None else None)
    # trtllm (llm_args.EagleDecodingConfig.eagle3_layers_to_capture): only what the user passes; it never reads
    # the draft's config.json ids
    if trtllm_layers is not None:
        return list(trtllm_layers), "eagle3_layers_to_capture (--trtllm-layers)", None
    present = (nested_loc, draft.nested_ids) if draft.nested_ids is not None else \
        ((top_loc, draft.top_ids) if draft.top_ids is not None else None)
    return None, ("TensorRT-LLM's default (no eagle3_layers_to_capture given with --trtllm-layers; TensorRT-LLM "
                  "never reads the draft config's ids)"), present


def map_ids(engine: str, family: str, ids: Optional[List[int]], num_layers: int) -> Tuple[List[int], str]:
    """Boundaries (in the order ids are written) that ``engine`` derives from ``ids``, and the rule text."""
    L = num_layers
    if ids is None:
        return default_boundaries(L), "engine default"
    if engine == "vllm":
        return list(ids), "id"
    if engine == "trtllm":
        return [POST_NORM(L) if i == -1 else i + 1 for i in ids], "id + 1 (-1 = the final state after the last norm)"
    if family == DEEPSEEK:
        if ids and ids[0] == 1:
            return [i + 1 for i in ids], "id + 1 (first id is 1)"
        return list(ids), "id (first id is not 1)"
    if family == GPT_OSS:
        if ids and max(ids) == L:
            return list(ids), f"id (largest id is {L})"
        return [i + 1 for i in ids], "id + 1"
    return [i + 1 for i in ids], "id + 1"


def last_capturable(engine: str, family: str, num_layers: int) -> int:
    """The highest boundary ``engine`` can capture: SGLang captures at each layer's entry (boundary L only
    for gpt_oss, at its final norm); vLLM 0.33.0 also after the last layer (``idx + 1`` / ``end_layer``
    checks); TensorRT-LLM after each layer."""
    if engine == "sglang" and family != GPT_OSS:
        return num_layers - 1
    return num_layers


def uncapturable_reason(engine: str, family: str, b: int, num_layers: int) -> str:
    """Why ``engine`` never fills a slot for boundary ``b`` ("" when it does)."""
    L = num_layers
    if engine == "trtllm" and b == POST_NORM(L):
        return ""
    if b < 0 or b > L:
        if engine == "vllm":
            return (f"boundary {b} does not exist (boundaries are 0..{L}); vLLM's layer loop never matches it and "
                    f"skips it silently")
        if engine == "sglang" and family == DEEPSEEK:
            return (f"boundary {b} does not exist (boundaries are 0..{L}): SGLang's deepseek_v2 uses ids as given "
                    f"when the first id is not 1, and no layer has index {b}")
        return f"boundary {b} does not exist (boundaries are 0..{L})"
    if b > last_capturable(engine, family, L):
        return (f"{ENGINE_NAMES[engine]} captures at the entry of each layer, so boundary {L} (the output of the "
                f"last layer) is never captured")
    if engine == "vllm" and family == DEEPSEEK and b == 0:
        return ("vLLM 0.33.0's DeepseekV2Model.forward captures id 0 as hidden_states + residual while residual is "
                "still None: the forward raises a TypeError")
    return ""


def resolve_wiring(engine: str, target: TargetInfo, draft: DraftInfo, *, pp: int = 1,
                   pp_partition: Optional[List[int]] = None, vllm_runner: str = "v2",
                   trtllm_layers: Optional[List[int]] = None) -> EngineWiring:
    family, evidence = detect_family(target)
    L = target.num_layers
    ids, source, ignored = _engine_ids(engine, draft, vllm_runner, trtllm_layers)
    config_order, rule = map_ids(engine, family, ids, L)

    stage = None
    first_cap = 0
    # vLLM 0.33.0's V2 runner relays earlier stages' captures (pp_utils.relay_aux_hidden_states) for models with
    # supports_aux_hidden_states_over_pp (llama, qwen2, ...); other models raise, and V1 relays nothing.
    relayed = engine == "vllm" and vllm_runner == "v2" and target.text_model_type in VLLM_PP_RELAY_TYPES
    if pp > 1 and not relayed:
        stage = pp_stage_ranges(L, pp, pp_partition)[-1]
        first_cap = stage[0]

    # Concatenation order: layer order; TRT-LLM sorts ids and moves -1 (embeddings) to the end.
    seen, duplicates, order = set(), [], []
    for pos, b in enumerate(config_order):
        if b in seen:
            duplicates.append(b)
            continue
        seen.add(b)
        order.append((pos, b))
    if engine == "trtllm" and ids is not None:
        order.sort(key=lambda pb: ids[pb[0]])  # a Set[int], sorted: id -1 (post-norm) comes first
    else:
        order.sort(key=lambda pb: pb[1])
    reordered = [p for p, _ in order] != sorted(p for p, _ in order)

    slots = []
    for k, (pos, b) in enumerate(order):
        cid = ids[pos] if ids is not None else None
        why = uncapturable_reason(engine, family, b, L)
        if not why and b < first_cap:
            why = (f"only the last pipeline stage captures, and it runs layers {stage[0]}..{stage[1] - 1}: "
                   f"boundary {b} is computed on an earlier stage")
        slots.append(SlotCapture(k, cid, b, not why, why))

    cp, cp_ev = capture_point(engine, family)
    return EngineWiring(engine=engine, family=family, family_evidence=evidence, ids=ids, ids_source=source,
                        ignored_ids=ignored, rule=rule if ids is not None else "engine default",
                        slots=slots, config_order=config_order, duplicates=duplicates, reordered=reordered,
                        pp_last_stage=stage, capture_point=cp, capture_point_evidence=cp_ev)


def capture_point(engine: str, family: str) -> Tuple[str, str]:
    """Where the engine takes the capture relative to the tensor-parallel all-reduce."""
    if engine == "sglang" and family in (PLUS_ONE, DEEPSEEK, GPT_OSS):
        return ("after-allreduce",
                "SGLang 0.5.23 completes the deferred all-reduce at the layer boundary before it captures "
                "(layer_boundary/stage.py: stream.complete before capture; deepseek_v2/qwen MoE capture the "
                "gathered residual after the fused all-reduce+add+norm)")
    if engine == "vllm" and family in (PLUS_ONE, DEEPSEEK, GPT_OSS):
        return ("after-allreduce",
                "vLLM captures hidden_states + residual between layers, after each layer's row-parallel "
                "all-reduce")
    if engine == "trtllm" and family in (PLUS_ONE, DEEPSEEK, GPT_OSS):
        return ("after-allreduce",
                "TensorRT-LLM's maybe_capture_hidden_states stores hidden_states + residual after the layer's "
                "all-reduce (for capture layers the fused all-reduce+norm is switched off and a plain all-reduce "
                "runs; read from its GitHub sources around 1.2.1, not the 1.2.1 wheel)")
    return ("unknown", f"the doctor has no source-verified capture point for {ENGINE_NAMES[engine]} with this "
                       f"model family")


def ids_for_boundaries(engine: str, family: str, boundaries: List[int], num_layers: int) -> Optional[List[int]]:
    """Ids to write so that ``engine`` captures exactly ``boundaries`` in this order (None if impossible)."""
    if not boundaries:
        return None
    for ids in ([b - 1 for b in boundaries], list(boundaries)):
        mapped, _ = map_ids(engine, family, ids, num_layers)
        if mapped != list(boundaries):
            continue
        if engine == "trtllm":
            order = sorted(range(len(ids)), key=lambda p: ids[p])
        else:
            order = sorted(range(len(ids)), key=lambda p: mapped[p])
        if order != list(range(len(ids))) or len(set(mapped)) != len(mapped):
            continue  # the engine would reorder or merge them
        if not any(uncapturable_reason(engine, family, b, num_layers) for b in mapped):
            return ids
    return None


def rule_text(engine: str, family: str) -> str:
    """The id -> boundary rule of ``engine`` for this model family, in words."""
    if engine == "sglang":
        return FAMILY_RULE[family]
    return ENGINE_RULE[engine]
