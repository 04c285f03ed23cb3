"""The doctor's checks: configs + weight headers -> a slot table and findings.

Every finding has a severity (``error`` | ``warning`` | ``info``), a stable code and a message
that says what to change. Codes:

errors
  E_EMBEDDING_CAPTURE        a slot gets the token embeddings but the draft was trained on a layer output
                             (or the config lists an embedding capture the fc weight has no columns for)
  E_CONVENTION_MISMATCH      every mismatched slot is off by the same one layer: the ids were written in
                             one convention ("output of layer k") and the engine reads them in the other
  E_WIRING_MISMATCH          a slot gets another boundary than the draft was trained on (other cases)
  E_LAST_LAYER_NOT_CAPTURED  an id names the output of the last layer, which the engine never captures
  E_ID_OUT_OF_RANGE          an id names a boundary the model does not have
  E_PP_NOT_CAPTURED          with pipeline parallelism, a boundary lives on a stage that does not capture
  E_DUPLICATE_CAPTURE        two slots name the same boundary; the engine captures it once
  E_TP_PARTIAL_SUM           captures are taken before the tensor-parallel all-reduce (per-rank partial sums)
  E_FC_WIDTH                 fc input width != (number of captured slots) x (target hidden size)
  E_TARGET_HIDDEN            the draft's target_hidden_size differs from the target's hidden_size
  E_VOCAB_MAP                d2t / t2d / lm_head / embedding do not match the target vocabulary
  E_REPLAY_BETTER_WIRING     (--replay) another wiring predicts the target's next token clearly better
warnings
  W_SLOT_ORDER, W_IDS_IGNORED, W_TP_CAPTURE_UNVERIFIED, W_PP_UNVERIFIED, W_UNKNOWN_MODEL_FAMILY,
  W_NORM_BEFORE_RESIDUAL, W_REPLAY_LOW_ACCURACY, W_REPLAY_FEW_TOKENS
info
  I_CONFIG, I_ENGINE_DEFAULT, I_TP_CAPTURE_OK, I_REPLAY_CONFIGURED_BEST, I_NO_AUX
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional

from .configs import (CONVENTION_TEXT, LAYER_INPUT, LAYER_OUTPUT, DoctorInputError, DraftInfo, TargetInfo,
                      TensorInfo, convention_to_index, load_tensors)
from .engines import (DEEPSEEK, ENGINE_NAMES, IDS_LOCATION, UNKNOWN, EngineWiring,
                      default_boundaries, describe_boundary, ids_for_boundaries, map_ids, resolve_wiring,
                      short_boundary)

SEVERITIES = ("error", "warning", "info")


@dataclasses.dataclass
class Finding:
    severity: str
    code: str
    message: str

    def to_json(self) -> dict:
        return {"severity": self.severity, "code": self.code, "message": self.message}


@dataclasses.dataclass
class Training:
    """What the draft was trained on, as far as its config (or the user) says."""
    boundaries: List[int]            # in fc slot order
    ids: Optional[List[int]]
    convention: Optional[str]
    source: str


@dataclasses.dataclass
class Options:
    engine: str = "sglang"
    tp: int = 1
    pp: int = 1
    pp_partition: Optional[List[int]] = None
    trained_convention: str = "auto"   # auto | layer-output | layer-input
    trained_ids: Optional[List[int]] = None
    capture_point: str = "auto"        # auto | after-allreduce | before-allreduce


@dataclasses.dataclass
class Report:
    target: TargetInfo
    draft: DraftInfo
    options: Options
    wiring: Optional[EngineWiring]
    training: Optional[Training]
    slots: List[dict]
    findings: List[Finding]
    fc_slots: Optional[int] = None
    replay: Optional[dict] = None

    @property
    def ok(self) -> bool:
        return not any(f.severity == "error" for f in self.findings)

    def add(self, severity: str, code: str, message: str) -> None:
        self.findings.append(Finding(severity, code, message))

    def to_json(self) -> dict:
        out = {
            "slots": self.slots,
            "findings": [f.to_json() for f in self.findings],
            "ok": self.ok,
            "target": {"path": str(self.target.path), "model_type": self.target.text_model_type or
                       self.target.model_type, "num_layers": self.target.num_layers,
                       "hidden_size": self.target.hidden_size, "vocab_size": self.target.vocab_size},
            "draft": {"path": str(self.draft.path), "dialect": self.draft.dialect,
                      "fc_slots": self.fc_slots},
            "engine": {"name": self.options.engine, "tp": self.options.tp, "pp": self.options.pp,
                       "family": self.wiring.family if self.wiring else None,
                       "rule": self.wiring.rule if self.wiring else None,
                       "ids": self.wiring.ids if self.wiring else None,
                       "ids_source": self.wiring.ids_source if self.wiring else None},
            "training": dataclasses.asdict(self.training) if self.training else None,
        }
        if self.replay is not None:
            out["replay"] = self.replay
        return out


# ------------------------------------------------------------------------------------ training
def resolve_training(draft: DraftInfo, target: TargetInfo, opts: Options) -> Training:
    L = target.num_layers
    conv = None if opts.trained_convention == "auto" else opts.trained_convention
    if opts.trained_ids is not None:
        conv = conv or draft.dialect_convention or LAYER_OUTPUT
        return Training([convention_to_index(conv, i) for i in opts.trained_ids], list(opts.trained_ids), conv,
                        f"--trained-ids {opts.trained_ids}, read as: {CONVENTION_TEXT[conv]}")
    ids = draft.training_ids
    if ids is None:
        return Training(default_boundaries(L), None, None,
                        f"no layer ids in the draft config: EAGLE-3 drafts without ids are trained on the default "
                        f"boundaries {default_boundaries(L)} (2, L//2, L-3)")
    conv = conv or draft.dialect_convention
    where = "eagle_config.eagle_aux_hidden_state_layer_ids" if draft.dialect == "specforge" else \
        "eagle_aux_hidden_state_layer_ids"
    how = "from --trained-convention" if opts.trained_convention != "auto" else f"{draft.dialect} config"
    return Training([convention_to_index(conv, i) for i in ids], list(ids), conv,
                    f"{where} = {ids}, read as: {CONVENTION_TEXT[conv]} ({how})")


# -------------------------------------------------------------------------------------- checks
def run_checks(target: TargetInfo, draft: DraftInfo, weights: Dict[str, TensorInfo], opts: Options) -> Report:
    L = target.num_layers
    H = target.hidden_size
    rep = Report(target, draft, opts, None, None, [], [])
    eng = ENGINE_NAMES[opts.engine]

    # ---- weights that everything else needs
    fc = weights.get("fc.weight")
    if fc is None:
        raise DoctorInputError(f"draft: no fc weight (fc.weight or model.fc.weight) in {draft.path}: "
                               f"not an EAGLE-3 draft checkpoint, or an incomplete one")
    if len(fc.shape) != 2:
        raise DoctorInputError(f"draft: fc.weight must be 2-D, found shape {list(fc.shape)}")
    fc_out, fc_in = fc.shape
    fc_slots = fc_in // H if fc_in % H == 0 else None
    rep.fc_slots = fc_slots

    rep.add("info", "I_CONFIG", f"Draft config: {draft.describe()}. Target: {target.describe()}.")

    if not draft.use_aux_hidden_state:
        rep.add("info", "I_NO_AUX", "eagle_config.use_aux_hidden_state is false: engines feed this draft the "
                                    "target's last hidden state only; no layer wiring to check.")
        _check_vocab(rep, target, draft, weights)
        return rep

    wiring = resolve_wiring(opts.engine, target, draft, pp=opts.pp, pp_partition=opts.pp_partition)
    training = resolve_training(draft, target, opts)
    rep.wiring, rep.training = wiring, training

    if wiring.family == UNKNOWN and opts.engine == "sglang":
        rep.add("warning", "W_UNKNOWN_MODEL_FAMILY",
                f"The doctor does not know SGLang's id rule for this target ({wiring.family_evidence}); it assumes "
                f"the common rule 'boundary = id + 1'. Check set_eagle3_layers_to_capture in the target's SGLang "
                f"model file.")
    if wiring.ids is None:
        rep.add("info", "I_ENGINE_DEFAULT",
                f"{eng} uses its default boundaries {default_boundaries(L)} = "
                f"{', '.join(short_boundary(b, L) for b in default_boundaries(L))}, since "
                f"{wiring.ids_source.split('(', 1)[1].rstrip(')')}.")

    # ---- the config's own consistency with the fc weight (K)
    t_ids = training.ids
    explained_k = False
    if fc_slots is not None and t_ids is not None and len(t_ids) != fc_slots:
        emb_pos = [p for p, b in enumerate(training.boundaries) if b == 0]
        if len(t_ids) == fc_slots + 1 and len(emb_pos) == 1:
            emb_id = t_ids[emb_pos[0]]
            rest = [i for p, i in enumerate(t_ids) if p != emb_pos[0]]
            rep.add("error", "E_EMBEDDING_CAPTURE",
                    f"The draft config lists {len(t_ids)} ids {t_ids}, including {emb_id} = the token embeddings, "
                    f"but the draft's fc weight takes {fc_in} = {fc_slots} x {H} inputs: it was trained on "
                    f"{fc_slots} layer outputs, without an embedding capture. Remove {emb_id} "
                    f"(ids {rest}); an embedding slot shifts every other slot and the draft reads garbage.")
            training = Training([b for p, b in enumerate(training.boundaries) if p != emb_pos[0]], rest,
                                training.convention, training.source + f", without the embedding id {emb_id}")
            rep.training = training
        else:
            rep.add("error", "E_FC_WIDTH",
                    f"The draft config lists {len(t_ids)} ids {t_ids} but the fc weight takes {fc_in} = "
                    f"{fc_slots} x {H} inputs ({fc_slots} slots). Config and weights disagree; use the ids the "
                    f"checkpoint was trained with.")
        explained_k = True

    # ---- target hidden size
    if draft.target_hidden_size is not None and draft.target_hidden_size != H:
        rep.add("error", "E_TARGET_HIDDEN",
                f"The draft's target_hidden_size is {draft.target_hidden_size} but the target's hidden_size is {H}: "
                f"this draft was trained for another target model.")
    if fc_slots is None:
        rep.add("error", "E_FC_WIDTH",
                f"The draft's fc weight takes {fc_in} inputs, which is not a multiple of the target's hidden size "
                f"{H}: the draft was trained for a target with another hidden size "
                f"({'target_hidden_size ' + str(draft.target_hidden_size) if draft.target_hidden_size else 'unknown'})"
                f". Pair it with its own target.")
        explained_k = True

    # ---- per-slot capture problems
    for s in wiring.slots:
        if s.captured:
            continue
        idtxt = f"id {s.config_id}" if s.config_id is not None else "the default"
        if s.boundary == L:
            fix = _suggest_last_layer_fix(opts.engine, wiring.family, L)
            rep.add("error", "E_LAST_LAYER_NOT_CAPTURED",
                    f"Slot {s.slot}: {idtxt} makes {eng} capture boundary {L} = {describe_boundary(L, L)}. "
                    f"{s.why_not}: this slot stays empty, the draft gets {len(wiring.captured_boundaries)} of "
                    f"{len(wiring.slots)} slots and serving fails or reads garbage. {fix}")
        elif wiring.pp_last_stage is not None and 0 <= s.boundary < wiring.pp_last_stage[0]:
            sev = "error" if opts.engine == "sglang" else "warning"
            code = "E_PP_NOT_CAPTURED" if sev == "error" else "W_PP_UNVERIFIED"
            rep.add(sev, code,
                    f"Slot {s.slot}: {idtxt} -> boundary {s.boundary} ({describe_boundary(s.boundary, L)}). With "
                    f"--pp {opts.pp}, {s.why_not}, so it is never captured"
                    f"{'' if sev == 'error' else ' (vLLM versions checked; newer ones may forward captures)'}. "
                    f"Serve with a smaller --pp"
                    + (f", or set SGLANG_PP_LAYER_PARTITION so that the last stage starts at layer "
                       f"{min(b.boundary for b in wiring.slots if b.boundary >= 0)} or earlier."
                       if opts.engine == "sglang" else "."))
        else:
            rep.add("error", "E_ID_OUT_OF_RANGE",
                    f"Slot {s.slot}: {idtxt} -> boundary {s.boundary}: {s.why_not}. {eng} maps ids to boundaries "
                    f"by '{wiring.rule}'; write ids that land on the boundaries the draft was trained on.")
    if opts.pp > 1 and opts.engine == "trtllm":
        rep.add("warning", "W_PP_UNVERIFIED",
                f"--pp {opts.pp}: the doctor has not verified how TensorRT-LLM forwards EAGLE-3 captures across "
                f"pipeline stages; check that every rank captures its boundaries.")
    if wiring.duplicates:
        rep.add("error", "E_DUPLICATE_CAPTURE",
                f"Boundaries {sorted(set(wiring.duplicates))} are named by more than one id ({wiring.ids}); "
                f"{eng} captures each boundary once, so the draft gets {len(wiring.slots)} slots instead of "
                f"{len(wiring.config_order)}.")

    if wiring.duplicates or not all(s.captured for s in wiring.slots):
        explained_k = True  # the slot count the fc sees is off because of the errors above

    # ---- ids this engine does not read
    if wiring.ignored_ids is not None:
        loc, ids = wiring.ignored_ids
        same = wiring.captured_boundaries == training.boundaries
        if same:
            rep.add("warning", "W_IDS_IGNORED",
                    f"{eng} does not read {loc} = {ids}; it uses its default boundaries "
                    f"{default_boundaries(L)}, which happen to be the ones the draft was trained on. Write the ids "
                    f"where {eng} reads them ({IDS_LOCATION[opts.engine]}) so a later retrain cannot break silently.")

    # ---- slot count vs fc
    engine_k = len(wiring.captured_boundaries)
    if fc_slots is not None and engine_k != fc_slots and not explained_k:
        rep.add("error", "E_FC_WIDTH",
                f"{eng} will feed {engine_k} captured slots ({engine_k} x {H} = {engine_k * H} values per token) but "
                f"the draft's fc weight takes {fc_in} = {fc_slots} x {H}. The draft needs exactly {fc_slots} "
                f"captures.")
    declared_k = _sglang_declared_k(draft) if opts.engine == "sglang" else None
    if declared_k is not None and fc_slots is not None and declared_k != fc_slots and not explained_k:
        rep.add("error", "E_FC_WIDTH",
                f"SGLang sizes the draft's fc from the config ({declared_k} slots: num_aux_hidden_states, else the "
                f"number of eagle_config ids, else 3) but the checkpoint's fc.weight takes {fc_slots} slots: loading "
                f"fails with a shape mismatch. Make the config describe {fc_slots} slots.")

    # ---- the wiring itself: engine slot k vs trained slot k
    _compare_slots(rep, wiring, training, opts, L)

    # ---- draft math the engine does not support
    if opts.engine == "sglang" and draft.norm_before_residual:
        rep.add("warning", "W_NORM_BEFORE_RESIDUAL",
                "The draft sets norm_before_residual (vLLM/speculators: the first layer's residual is the normed "
                "fc output). SGLang 0.5.23's llama_eagle3 always keeps the un-normed fc output as residual, so the "
                "draft runs with different math than it was trained with. Serve it with vLLM or retrain.")

    # ---- tensor parallel capture point
    _check_tp(rep, wiring, opts)

    # ---- vocab maps
    _check_vocab(rep, target, draft, weights)
    return rep


def _sglang_declared_k(draft: DraftInfo) -> Optional[int]:
    if draft.num_aux_declared is not None:
        return draft.num_aux_declared
    if draft.nested_ids:
        return len(draft.nested_ids)
    return 3


def _suggest_last_layer_fix(engine: str, family: str, L: int) -> str:
    prev = ids_for_boundaries(engine, family, [L - 1], L)
    hint = f"The closest capturable state is boundary {L - 1} ({describe_boundary(L - 1, L)})"
    if prev is not None:
        hint += f", id {prev[0]} for {ENGINE_NAMES[engine]}"
    return hint + (", but a draft trained on the last layer's output must be retrained (or served by an engine "
                   "that captures it, e.g. TensorRT-LLM) to get its accuracy back.")


def _compare_slots(rep: Report, wiring: EngineWiring, training: Training, opts: Options, L: int) -> None:
    eng = wiring.name
    engine_b = [s.boundary for s in wiring.slots]
    trained_b = training.boundaries
    n = max(len(engine_b), len(trained_b))
    mismatched = []
    for k in range(n):
        s = wiring.slots[k] if k < len(wiring.slots) else None
        tb = trained_b[k] if k < len(trained_b) else None
        row = {
            "slot": k,
            "config_id": s.config_id if s else None,
            "capture_index": s.boundary if s else None,
            "rule": wiring.rule,
            "engine_reads": (describe_boundary(s.boundary, L) if s.captured else "nothing: never captured")
            if s else "nothing: no capture for this slot",
            "captured": bool(s and s.captured),
            "not_captured_reason": s.why_not if s and not s.captured else None,
            "trained_index": tb,
            "draft_trained_on": describe_boundary(tb, L) if tb is not None else "no such slot in training",
            "match": bool(s and s.captured and tb is not None and s.boundary == tb),
        }
        rep.slots.append(row)
        if s is not None and tb is not None and s.captured and s.boundary != tb:
            mismatched.append((k, s, tb))

    if wiring.reordered:
        if opts.engine == "trtllm" and wiring.ids == sorted(wiring.ids):
            why = (f"TensorRT-LLM sorts the ids and moves -1 (the embeddings) to the last slot, so with ids "
                   f"{wiring.ids} slot k is not the k-th id")
        else:
            why = (f"the ids {wiring.ids} are not in layer order and {eng} concatenates captures in layer order"
                   f"{' (embeddings last)' if opts.engine == 'trtllm' else ''}, so slot k is not the k-th id")
        rep.add("warning", "W_SLOT_ORDER",
                f"{why[0].upper() + why[1:]}. If the draft was trained with the ids' order, its slots are permuted; "
                f"check with --replay.")
    if not mismatched or len(engine_b) != len(trained_b):
        return

    fix_ids = ids_for_boundaries(opts.engine, wiring.family, trained_b, L)
    if fix_ids is not None:
        fix_rule = map_ids(opts.engine, wiring.family, fix_ids, L)[1]
        fix = f"Set {IDS_LOCATION[opts.engine]} to {fix_ids} ({eng}: boundary = {fix_rule})."
        if opts.engine == "sglang" and wiring.family == DEEPSEEK:
            fix = (f"Set {IDS_LOCATION[opts.engine]} to {fix_ids} (SGLang's deepseek rule adds 1 only when the "
                   f"first id is 1).")
    else:
        fix = (f"{eng} cannot capture exactly {trained_b} in this order; serve with an engine that can, or "
               f"retrain the draft on boundaries {eng} captures.")
    ignored = ""
    if wiring.ignored_ids is not None:
        loc, ids = wiring.ignored_ids
        ignored = f" ({eng} does not read {loc} = {ids}, so it falls back to its default boundaries.)"

    details = "; ".join(f"slot {k} gets {short_boundary(s.boundary, L)} but was trained on "
                        f"{short_boundary(tb, L)}" for k, s, tb in mismatched)
    emb = [(k, s, tb) for k, s, tb in mismatched if s.boundary == 0]
    deltas = {s.boundary - tb for _, s, tb in mismatched}
    if emb:
        rep.add("error", "E_EMBEDDING_CAPTURE",
                f"Slot {emb[0][0]} receives the token embeddings, but the draft was trained on "
                f"{short_boundary(emb[0][2], L)} there ({details}).{ignored} {fix}")
    elif len(mismatched) == len(trained_b) and len(deltas) == 1 and deltas <= {1, -1}:
        d = deltas.pop()
        if training.convention == LAYER_OUTPUT and d == -1:
            why = (f"the ids are written as 'output of layer k' ({training.source.split(', read as')[0]}) "
                   f"but {eng} reads them as 'residual stream entering layer k' ({wiring.rule})")
        elif training.convention == LAYER_INPUT and d == 1:
            why = (f"the ids are written as 'residual stream entering layer k' but {eng} reads them as "
                   f"'output of layer k' ({wiring.rule})")
        else:
            why = f"every slot is one layer {'later' if d > 0 else 'earlier'} than the draft was trained on"
        rep.add("error", "E_CONVENTION_MISMATCH",
                f"Every slot is off by one layer ({'later' if d > 0 else 'earlier'}): {why}.{ignored} {details}. "
                f"{fix}")
    else:
        rep.add("error", "E_WIRING_MISMATCH",
                f"{len(mismatched)} of {len(trained_b)} slots get other hidden states than the draft was trained on: "
                f"{details}.{ignored} {fix}")


def _check_tp(rep: Report, wiring: EngineWiring, opts: Options) -> None:
    if opts.tp <= 1:
        return
    eng = wiring.name
    if opts.capture_point == "before-allreduce":
        rep.add("error", "E_TP_PARTIAL_SUM",
                f"--capture-point before-allreduce with --tp {opts.tp}: each rank captures its own partial sum of "
                f"the layer output (1/{opts.tp} of the attention/MLP contribution plus the residual), not the "
                f"hidden state the draft was trained on; acceptance drops with no error. Move the capture after "
                f"the tensor-parallel all-reduce (SGLang: capture at the layer boundary after stream.complete, as "
                f"set_eagle3_layers_to_capture does; eagle3_ops: fused_add_rmsnorm_capture stores the reduced "
                f"residual).")
    elif opts.capture_point == "after-allreduce":
        rep.add("info", "I_TP_CAPTURE_OK",
                f"--tp {opts.tp}: captures declared to be taken after the all-reduce (--capture-point). The doctor "
                f"cannot see custom hooks; this relies on that declaration.")
    elif wiring.capture_point == "after-allreduce":
        rep.add("info", "I_TP_CAPTURE_OK",
                f"--tp {opts.tp}: {wiring.capture_point_evidence}. Checked: the stock capture path of {eng} for this "
                f"model family. Not checked: patched engines or custom capture hooks; if you use one, rerun with "
                f"--capture-point before-allreduce|after-allreduce.")
    else:
        rep.add("warning", "W_TP_CAPTURE_UNVERIFIED",
                f"--tp {opts.tp}: {wiring.capture_point_evidence}. If captures are taken before the all-reduce, each "
                f"rank feeds its draft a partial sum. Verify, then rerun with --capture-point.")


def _check_vocab(rep: Report, target: TargetInfo, draft: DraftInfo, weights: Dict[str, TensorInfo]) -> None:
    V = target.vocab_size
    lm = weights.get("lm_head.weight")
    d2t_i = weights.get("d2t")
    emb = weights.get("embed_tokens.weight")
    problems = []
    draft_vocab = lm.shape[0] if lm is not None and len(lm.shape) == 2 else draft.draft_vocab_size
    if draft.draft_vocab_size is not None and lm is not None and lm.shape[0] != draft.draft_vocab_size:
        problems.append(f"lm_head.weight has {lm.shape[0]} rows but draft_vocab_size is {draft.draft_vocab_size}")
    if V is None:
        if problems:
            rep.add("error", "E_VOCAB_MAP", "; ".join(problems) + ".")
        return
    if draft.vocab_size is not None and draft.vocab_size != V:
        problems.append(f"the draft's vocab_size is {draft.vocab_size} but the target's is {V} (the draft shares the "
                        f"target's embedding and token ids; a different tokenizer cannot work)")
    if emb is not None and emb.shape[0] != V:
        problems.append(f"embed_tokens.weight has {emb.shape[0]} rows but the target vocab has {V}")
    if d2t_i is None:
        if draft_vocab is not None and draft_vocab != V:
            problems.append(f"the draft predicts {draft_vocab} tokens (lm_head rows) but has no d2t map to the "
                            f"target's {V} tokens: its draft ids would be read as target ids")
    else:
        tens = load_tensors(rep_weights_subset(weights, ["d2t", "t2d"]), ["d2t", "t2d"])
        d2t = tens.get("d2t")
        if d2t is None or d2t.dim() != 1 or d2t.is_floating_point():
            problems.append(f"d2t must be a 1-D integer tensor, found {d2t_i.dtype} {list(d2t_i.shape)}")
        else:
            if draft_vocab is not None and d2t.numel() != draft_vocab:
                problems.append(f"d2t has {d2t.numel()} entries but the draft predicts {draft_vocab} tokens")
            import torch

            tgt_ids = d2t.long() + torch.arange(d2t.numel())
            bad = ((tgt_ids < 0) | (tgt_ids >= V)).sum().item()
            if bad:
                problems.append(f"{bad} d2t entries map to target ids outside 0..{V - 1} (max "
                                f"{int(tgt_ids.max())}): d2t was built for a larger vocabulary")
            elif tgt_ids.unique().numel() != tgt_ids.numel():
                problems.append("d2t maps several draft ids to the same target id")
            t2d = tens.get("t2d")
            if t2d is not None:
                if t2d.dim() != 1 or t2d.numel() != V:
                    problems.append(f"t2d has shape {list(t2d.shape)} but the target vocab has {V} tokens")
                elif not bad:
                    mask = t2d.bool()
                    if int(mask.sum()) != d2t.numel() or not bool(mask[tgt_ids].all()):
                        problems.append("t2d and d2t disagree on which target tokens the draft vocabulary holds")
    if problems:
        rep.add("error", "E_VOCAB_MAP",
                "Draft vocabulary does not match the target: " + "; ".join(problems) +
                ". Rebuild the maps from this target's tokenizer (SpecForge: the vocab-mapping step) or pair the "
                "draft with the target it was trained for.")


def rep_weights_subset(weights: Dict[str, TensorInfo], names) -> Dict[str, TensorInfo]:
    return {n: weights[n] for n in names if n in weights}
