"""The doctor's checks: configs + weight headers -> a slot table and findings.

Every finding has a severity (``error`` | ``warning`` | ``info``), a stable code and a message
that says what to change. The codes, with what each means, why it matters and the fix, are one table:
:mod:`.codes` (docs/doctor.md renders it).
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional

from .configs import (CONVENTION_TEXT, DoctorInputError, DraftInfo, TargetInfo, accelerate_available,
                      TensorInfo, convention_to_index, load_tensors)
from .engines import (ENGINE_NAMES, IDS_LOCATION, EngineWiring, default_boundaries, describe_boundary,
                      ids_for_boundaries, map_ids, resolve_wiring, short_boundary)
from . import codes, tables
from .source_reader import layer_fit
from .rules import TargetRules, draft_class, target_rules

SEVERITIES = ("error", "warning", "info")


@dataclasses.dataclass
class Finding:
    severity: str
    code: str
    message: str

    def to_json(self) -> dict:
        return {"severity": self.severity, "code": self.code, "message": self.message}


@dataclasses.dataclass
class Reading:
    """One plausible account of how the draft's ids were turned into hidden states during training."""
    key: str                 # stable: sglang-capture | output-of-layer | entering-layer | default | given
    label: str               # who trains this way, in words
    boundaries: List[int]    # in fc slot order
    plausible: bool = True   # False: the trainer could not have captured these (the reading is ruled out)
    why_not: str = ""


@dataclasses.dataclass
class Training:
    """What the draft was trained on, as far as its config (or the user) can say: one reading per way the
    ids may have been read by the trainer. Where the readings disagree, only replay can tell."""
    ids: Optional[List[int]]
    source: str
    readings: List[Reading]
    assumed_default: bool = False    # the config records no ids: the default is an assumption

    @property
    def plausible(self) -> List[Reading]:
        return [r for r in self.readings if r.plausible]

    @property
    def agreed(self) -> Optional[List[int]]:
        """The boundaries when *every* reading (ruled out ones too) gives the same ones, else None: a
        reading that is ruled out still says the config may not describe the training (a hand edit)."""
        first = self.readings[0].boundaries if self.readings else None
        if first is None or any(r.boundaries != first for r in self.readings):
            return None
        return list(first)

    @property
    def boundaries(self) -> List[int]:
        """The agreed boundaries, else the first plausible reading's (candidates for replay)."""
        if self.agreed is not None:
            return self.agreed
        return list((self.plausible or self.readings)[0].boundaries)


@dataclasses.dataclass
class Options:
    engine: str = "sglang"
    tp: int = 1
    pp: int = 1
    pp_partition: Optional[List[int]] = None
    trained_convention: str = "auto"   # auto | layer-output | layer-input
    trained_ids: Optional[List[int]] = None
    capture_point: str = "auto"        # auto | after-allreduce | before-allreduce
    vllm_runner: str = "v2"            # v2 (vLLM 0.33.0's default) | v1 (VLLM_USE_V2_MODEL_RUNNER=0, P-EAGLE)
    trtllm_layers: Optional[List[int]] = None  # eagle3_layers_to_capture passed to TensorRT-LLM (None: default)
    engine_code: str = "auto"          # auto | installed | table: where SGLang's rules come from
    server_running: bool = False       # the live check: the server started (what it refuses at start-up passed)
    served_context_length: Optional[int] = None  # its --context-length (None: the target's own length)


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
    rules: Optional[TargetRules] = None

    @property
    def ok(self) -> bool:
        return not any(f.severity == "error" for f in self.findings)

    def add(self, severity: str, code: str, message: str) -> None:
        codes.check(severity, code)  # every code is in the table, with its severity
        self.findings.append(Finding(severity, code, message))

    def conclusion(self) -> str:
        """What the findings establish, naming what was checked, and for a config-only check how to verify it
        (a config edited since training agrees with itself: only the draft fed recorded states can tell)."""
        errors = sum(f.severity == "error" for f in self.findings)
        warns = sum(f.severity == "warning" for f in self.findings)
        if errors:
            return "fix the errors above (exit status 1)."
        verdict = (self.replay or {}).get("verdict") or {}
        if verdict:
            told = {"OK": "the replay finds no wiring the draft predicts the target better with",
                    "BEST": "the replay names the wiring the draft predicts the target best with"}.get(
                verdict.get("word"), f"the replay's verdict is {verdict.get('word')}")
            return (f"no error; {told} ({self.replay.get('tokens')} positions)"
                    + ("; read the warnings above." if warns else "."))
        checked = ("the configs agree with each other: what " + ENGINE_NAMES[self.options.engine]
                   + " feeds each slot is what the draft config says it was trained on" if self.slots else
                   "no error in the configs")
        return (("no error, but read the warnings above; " if warns else "") + checked
                + ". A config edited since training agrees with itself too; to verify, record the target's states "
                  "and replay the draft on them (or serve with the eagle3_ops plugin, whose live wiring check does "
                  "both):\n" + "\n".join("  " + c for c in verify_commands(self)))

    def to_json(self) -> dict:
        out = {
            "conclusion": self.conclusion(),
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
                       "class": self.rules.class_name if self.rules else None,
                       "architecture": self.rules.arch if self.rules else None,
                       "supported": self.rules.supported if self.rules else None,
                       "rules_from": self.rules.source if self.rules else None,
                       "rule": self.wiring.rule if self.wiring else None,
                       "ids": self.wiring.ids if self.wiring else None,
                       "ids_source": self.wiring.ids_source if self.wiring else None},
            "training": dataclasses.asdict(self.training) if self.training else None,
        }
        if self.replay is not None:
            out["replay"] = self.replay
        return out


# ------------------------------------------------------------------------------------ training
SGLANG_TRAINER = ("trained through SGLang's set_eagle3_layers_to_capture with the ids as written (SpecForge 0.2.0: "
                  "its only backend, offline and online; rule of SGLang {version}'s {arch}: {rule})")
OUTPUT_OF_LAYER = ("id k = the output of layer k, -1 = the embeddings (Hugging Face output_hidden_states[k + 1]: "
                   "SpecForge's HF backend before its SGLang-only cutover, the EAGLE-3 reference training code)")
ENTERING_LAYER = "id k = the residual stream entering layer k, 0 = the embeddings (vLLM's capture point)"
SPECULATORS = ("speculators 0.9.0 (hidden states from vLLM's extract_hidden_states: id k = the residual stream "
               "entering layer k, 0 = the embeddings)")


def training_readings(dialect: str, ids: List[int], target: TargetInfo, engine_code: str = "auto") -> List[Reading]:
    """Every plausible reading of ``ids`` for a draft config of ``dialect`` (merged where they agree)."""
    from .engines import uncapturable_reason

    L = target.num_layers
    out: List[Reading] = []
    if dialect == "specforge":
        sg = target_rules("sglang", target, engine_code)
        label = SGLANG_TRAINER.format(version=sg.version, arch=sg.arch or "class", rule=sg.rule_text)
        if not sg.supported:
            out.append(Reading("sglang-capture", label, [i + 1 for i in ids], False,
                               f"SGLang {sg.version} cannot capture for this target ({sg.refusal}): the draft was "
                               f"trained with another SGLang, whose rule the doctor cannot read"))
        else:
            m = sg.map_ids(ids, L)
            b = m.config_order
            bad = [x for x in b if uncapturable_reason(sg, x, L)]
            why = (f"SGLang {sg.version} raises for these ids ({m.error})" if m.error else
                   f"SGLang never captures boundary {bad[0]}" if bad else
                   ("SGLang captures a repeated boundary once" if len(set(b)) != len(b) else ""))
            out.append(Reading("sglang-capture", label, b, not why, why))
        out.append(_bounded(Reading("output-of-layer", OUTPUT_OF_LAYER, [i + 1 for i in ids]), L))
    elif dialect == "speculators":
        out.append(_bounded(Reading("entering-layer", SPECULATORS, list(ids)), L))
    else:  # top-level ids of an unknown trainer
        out.append(_bounded(Reading("entering-layer", ENTERING_LAYER, list(ids)), L))
        out.append(_bounded(Reading("output-of-layer", OUTPUT_OF_LAYER, [i + 1 for i in ids]), L))
    merged: List[Reading] = []
    for r in out:
        twin = next((m for m in merged if m.boundaries == r.boundaries), None)
        if twin is None:
            merged.append(r)
        else:
            twin.label += "; or " + r.label
            twin.plausible = twin.plausible or r.plausible
    return merged


def _bounded(r: Reading, L: int) -> Reading:
    bad = [b for b in r.boundaries if not 0 <= b <= L]
    if bad:
        r.plausible, r.why_not = False, f"boundary {bad[0]} does not exist (boundaries are 0..{L})"
    return r


def resolve_training(draft: DraftInfo, target: TargetInfo, opts: Options) -> Training:
    L = target.num_layers
    if opts.trained_ids is not None:
        ids = list(opts.trained_ids)
        if opts.trained_convention != "auto":
            conv = opts.trained_convention
            r = _bounded(Reading("given", f"--trained-ids read as: {CONVENTION_TEXT[conv]}",
                                 [convention_to_index(conv, i) for i in ids]), L)
            return Training(ids, f"--trained-ids {ids} (--trained-convention {conv})", [r])
        return Training(ids, f"--trained-ids {ids}, read as the draft config's dialect ({draft.dialect})",
                        training_readings(draft.dialect, ids, target, opts.engine_code))
    ids = draft.training_ids
    if ids is None:
        d = default_boundaries(L)
        return Training(None, "no layer ids in the draft config", [Reading(
            "default", f"the default every trainer and engine uses without ids: boundaries {d} = (2, L//2, L-3) "
                       f"(SpecForge's default ids [1, L//2-1, L-4] through SGLang; speculators' and vLLM's "
                       f"(2, L//2, L-3)); assumed, since the config records nothing", d)], assumed_default=True)
    where = "eagle_config.eagle_aux_hidden_state_layer_ids" if draft.dialect == "specforge" else \
        "eagle_aux_hidden_state_layer_ids"
    if opts.trained_convention != "auto":
        conv = opts.trained_convention
        r = _bounded(Reading("given", f"read as: {CONVENTION_TEXT[conv]} (--trained-convention)",
                             [convention_to_index(conv, i) for i in ids]), L)
        return Training(list(ids), f"{where} = {ids}", [r])
    return Training(list(ids), f"{where} = {ids} ({draft.dialect} config)",
                    training_readings(draft.dialect, ids, target, opts.engine_code))


# -------------------------------------------------------------------------------------- checks
# What only the draft's weight headers show: said when the doctor runs on configs alone (no weight files yet).
NEEDS_WEIGHTS = ("the fc's input width against the slots the engine feeds (E_FC_WIDTH, E_EMBEDDING_CAPTURE)",
                 "the draft class against its decoder-layer tensors (E_DRAFT_CLASS names the head that loads them)",
                 "whether the checkpoint holds a trained lm_head (E_NO_LM_HEAD, E_LM_HEAD_REPLACED, "
                 "E_TIED_DRAFT_VOCAB)",
                 "the vocabulary maps d2t / t2d against the target's vocabulary (E_VOCAB_MAP)",
                 "--replay")


def run_checks(target: TargetInfo, draft: DraftInfo, weights: Optional[Dict[str, TensorInfo]],
               opts: Options) -> Report:
    """Every check the configs and the draft's weight headers allow; ``weights`` None: a draft folder with its
    configs only (checked before a download of the weights), the checks of :data:`NEEDS_WEIGHTS` named, not run."""
    L = target.num_layers
    H = target.hidden_size
    rep = Report(target, draft, opts, None, None, [], [])
    eng = ENGINE_NAMES[opts.engine]

    # ---- weights that everything else needs
    if weights is None:
        fc_in = fc_slots = None
    else:
        fc = weights.get("fc.weight")
        if fc is None:
            raise DoctorInputError(f"draft: no fc weight (fc.weight or model.fc.weight) in {draft.path}: "
                                   f"not an EAGLE-3 draft checkpoint, or an incomplete one")
        if len(fc.shape) != 2:
            raise DoctorInputError(f"draft: fc.weight must be 2-D, found shape {list(fc.shape)}")
        fc_out, fc_in = fc.shape
        fc_slots = fc_in // H if fc_in % H == 0 else None
    rep.fc_slots = fc_slots

    rep.add("info", "I_CONFIG", f"Draft config: {draft.describe()}. Target: {target.describe()}"
            + (f", read by {target.lib.reader}" if target.lib is not None and target.lib.obj is not None else "")
            + ".")
    if weights is None:
        rep.add("warning", "W_NO_WEIGHTS",
                f"No weight files in {draft.path}: the configs alone were checked. Not checked without the weights: "
                + "; ".join(NEEDS_WEIGHTS) + ". Download the weights (or pass the folder that has them) to run "
                                             "these.")
    if target.lib is not None and target.lib.assumed:
        rep.add("warning", "W_CONFIG_ASSUMED",
                f"The target config was read by the doctor's own parsing ({target.lib.reader}): it assumes "
                f"num_hidden_layers / hidden_size / vocab_size mean what they mean for Llama, with no defaults or "
                f"aliases applied. Check them against the model's own config class.")

    rules = target_rules(opts.engine, target, opts.engine_code)
    rep.rules = rules
    rep.add("info", "I_ENGINE_CODE",
            f"{eng} rules from {rules.source}: architectures {target.architectures or '[]'} -> "
            f"{rules.class_name or rules.arch or 'no class'}.")
    _check_draft_class(rep, draft, opts, weights)
    _check_tied(rep, target, draft, weights, opts)
    _check_untied_head(rep, target, draft, weights, opts)
    _check_context(rep, target, draft, opts)

    if not draft.use_aux_hidden_state:
        rep.add("info", "I_NO_AUX", "eagle_config.use_aux_hidden_state is false: engines feed this draft the "
                                    "target's last hidden state only; no layer wiring to check.")
        _check_vocab(rep, target, draft, weights)
        return rep

    if rules.supported is False:
        # The engine refuses the model: no slot table and no layer verdict, only the refusal.
        rep.add("error", "E_TARGET_UNSUPPORTED",
                f"{eng} {rules.version} will refuse to start EAGLE-3 with this target: {rules.refusal}. No wiring "
                f"can fix that; serve the draft with an engine that captures for {_target_class_name(rules, target)}"
                + _supported_elsewhere(target, opts.engine)
                + ".")
        _check_vocab(rep, target, draft, weights)
        return rep
    if rules.supported is None:
        rep.add("warning", "W_TARGET_SUPPORT_UNVERIFIED",
                f"The doctor cannot tell whether {eng} serves EAGLE-3 for this target: "
                f"{rules.refusal or 'the ' + eng + ' table has no entry for its class'}. The slot table below assumes "
                f"it does and that {eng}'s engine-wide rules apply.")

    wiring = resolve_wiring(opts.engine, target, draft, pp=opts.pp, pp_partition=opts.pp_partition,
                            vllm_runner=opts.vllm_runner, trtllm_layers=opts.trtllm_layers, rules=rules)
    training = resolve_training(draft, target, opts)
    rep.wiring, rep.training = wiring, training

    if wiring.unknown:
        rep.add("warning", "W_RULE_UNKNOWN",
                f"The doctor cannot say which hidden states {eng} feeds this draft: {wiring.unknown}. No slot verdict "
                f"is given." + (" Run it where the pinned engine is installed (--engine-code installed)."
                                if opts.engine == "sglang" else ""))
        rep.wiring = None
        _check_vocab(rep, target, draft, weights)
        return rep
    if wiring.error:
        rep.add("error", "E_ENGINE_RAISES",
                f"{eng} raises when it configures these ids for {rules.arch}: {wiring.error}. The server does not "
                f"start; no slot is fed. Write ids {eng} accepts for a {L}-layer target.")
        _check_vocab(rep, target, draft, weights)
        return rep
    if rules.engine == "sglang" and rules.rule_key is None:
        rep.add("warning", "W_RULE_UNKNOWN",
                f"SGLang's id rule for {rules.arch} could not be named from its code"
                + (" (the doctor ran it on the real config for this report)" if rules._live else
                   "; the table cannot map these ids") + ".")
    if not rules.capture_known:
        rep.add("warning", "W_CAPTURE_UNVERIFIED",
                f"The doctor did not locate {eng}'s capture code for {rules.arch} "
                f"({rules.evidence.get('decoder_how') or 'no capture site found'}); which boundaries it can capture "
                f"is assumed from {eng}'s engine-wide behaviour.")
    if rules.entry == "hidden-only" or rules.final_value == "hidden-only":
        holder = rules.evidence.get("holder_class", "").rsplit(".", 1)[-1]
        rep.add("warning", "W_CAPTURE_VALUE",
                f"{eng} {rules.version}'s {holder} captures hidden_states without the residual "
                f"({rules.entry_code or rules.final_code}; its layer loop carries the residual separately: "
                f"`hidden_states, residual = layer(...)`): each slot holds the previous layer's last branch output "
                f"(the post-feedforward-norm MLP output), not the residual stream Hugging Face's "
                f"output_hidden_states holds. A draft trained through SGLang (SpecForge) saw the same values; one "
                f"trained on Hugging Face hidden states was not. Check with --replay on states dumped from SGLang.")
    _check_embed_scale(rep, rules, opts)
    if wiring.ids is None:
        rep.add("info", "I_ENGINE_DEFAULT",
                f"{eng} uses its default boundaries {wiring.config_order} = "
                f"{', '.join(short_boundary(b, L) for b in wiring.config_order)}, since "
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
            for r in training.readings:
                r.boundaries = [b for p, b in enumerate(r.boundaries) if p != emb_pos[0]]
            training = Training(rest, training.source + f", without the embedding id {emb_id}", training.readings,
                                training.assumed_default)
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
    if fc_slots is None and fc_in is not None:
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
            fix = _suggest_last_layer_fix(wiring.rules, L)
            rep.add("error", "E_LAST_LAYER_NOT_CAPTURED",
                    f"Slot {s.slot}: {idtxt} makes {eng} capture boundary {L} = {describe_boundary(L, L)}. "
                    f"{s.why_not}: this slot stays empty, the draft gets {len(wiring.captured_boundaries)} of "
                    f"{len(wiring.slots)} slots and serving fails or reads garbage. {fix}")
        elif wiring.pp_last_stage is not None and 0 <= s.boundary < wiring.pp_last_stage[0]:
            vllm_note = ""
            if opts.engine == "vllm":
                vllm_note = (" (vLLM 0.33.0: the V2 runner relays earlier stages' captures only for llama/qwen2 and "
                             "raises for other models; the V1 runner relays none)")
            rep.add("error", "E_PP_NOT_CAPTURED",
                    f"Slot {s.slot}: {idtxt} -> boundary {s.boundary} ({describe_boundary(s.boundary, L)}). With "
                    f"--pp {opts.pp}, {s.why_not}, so it is never captured{vllm_note}. "
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
        same = all(wiring.captured_boundaries == r.boundaries for r in training.plausible)
        if same and training.plausible:
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
    vllm_k = _vllm_declared_k(draft, opts) if opts.engine == "vllm" else None
    if vllm_k is not None and fc_slots is not None and vllm_k[0] != fc_slots and not explained_k:
        k, read, head, reads = vllm_k
        where = ("transformer_layer_config (vLLM builds the draft's config from it and copies only the ids, "
                 "at the top level)" if draft.dialect == "speculators" else "the draft's config.json")
        rep.add("error", "E_FC_WIDTH",
                f"vLLM 0.33.0's {head} sizes the fc from {', else '.join(map(str, reads))} (its __init__, in that "
                f"order): here {read}: {k} slots = {k * H} inputs, but the checkpoint's fc.weight takes {fc_in} = "
                f"{fc_slots} x {H}: loading fails with a shape mismatch ({fc_in} vs {k * H}). Add "
                f"\"num_aux_hidden_states\": {fc_slots} to {where}.")

    # ---- the wiring itself: engine slot k vs trained slot k, under every reading of the ids
    _compare_slots(rep, wiring, training, opts, L)
    if opts.engine == "vllm":
        _check_other_vllm_runner(rep, target, draft, wiring, opts)

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


def _vllm_declared_k(draft: DraftInfo, opts: Options):
    """(slots, what decided it, head class, what it reads) for vLLM's EAGLE-3 head: the keys its __init__ reads to
    size the fc, in order (the engine table's ``fc_slots_from``, read from vLLM's source), on the config vLLM builds
    for the draft (for a speculators draft: transformer_layer_config plus the top-level ids, as
    speculators/algos.update_eagle3 does); None where the table has no rule for the head."""
    dc = draft_class("vllm", draft, opts.engine_code)
    reads = (dc.head or {}).get("fc_slots_from")
    if not reads:
        return None
    if draft.dialect == "speculators":
        cfg = dict(draft.layer_config or {})
        if draft.config.get("eagle_aux_hidden_state_layer_ids"):
            cfg["eagle_aux_hidden_state_layer_ids"] = draft.config["eagle_aux_hidden_state_layer_ids"]
    else:
        cfg = draft.config if isinstance(draft.config, dict) else {}
    head = dc.head["class"].rsplit(".", 1)[-1]
    for key in reads:
        if isinstance(key, int):
            return key, "none of them is set (its default)", head, reads
        holder = cfg.get("eagle_config") or {} if key.startswith("eagle_config.") else cfg
        value = holder.get(key.split(".", 1)[-1]) if isinstance(holder, dict) else None
        if isinstance(value, list) and value:
            return len(value), f"{key} = {value}", head, reads
        if isinstance(value, int) and not isinstance(value, bool):
            return value, f"{key} = {value}", head, reads
    return None


def _sglang_declared_k(draft: DraftInfo) -> Optional[int]:
    if draft.num_aux_declared is not None:
        return draft.num_aux_declared
    if draft.nested_ids:
        return len(draft.nested_ids)
    return 3


def _suggest_last_layer_fix(rules: TargetRules, L: int) -> str:
    prev = ids_for_boundaries(rules, [L - 1], L)
    hint = f"The closest capturable state is boundary {L - 1} ({describe_boundary(L - 1, L)})"
    if prev is not None:
        hint += f", id {prev[0]} for {rules.name}"
    return hint + (", but a draft trained on the last layer's output must be retrained (or served by an engine "
                   "that captures it, e.g. TensorRT-LLM) to get its accuracy back.")


def verify_commands(rep: "Report") -> List[str]:
    """The two commands, ready to paste, that settle what a config cannot show: record the target's states at
    every layer boundary (capture-states, its built-in prompts), then replay the draft on them."""
    import shlex

    o = rep.options
    engine = f" --engine {o.engine}" if o.engine != "sglang" else ""
    flags = " --trust-remote-code" if _needs_remote_code(rep.target) else ""
    # --device-map needs accelerate (capture-states refuses it without): offered only where it would run
    flags += " --device-map auto" if accelerate_available() else ""
    t, d = shlex.quote(str(rep.target.path)), shlex.quote(str(rep.draft.path))
    return [f"python -m eagle3_ops capture-states --model {t} --out states.safetensors{flags}",
            f"python -m eagle3_ops doctor --draft {d} --target {t}{engine} --replay states.safetensors"]


def replay_command(rep: "Report") -> str:
    """:func:`verify_commands` in a sentence, for a finding's text."""
    record, replay = verify_commands(rep)
    spread = accelerate_available()
    return (f"record states with the target: in SGLang with the eagle3_ops plugin, serve with "
            f"EAGLE3_OPS_DUMP_STATES=states.safetensors and send a few prompts (its live wiring check does this and "
            f"the replay by itself on the first prompts); or `{record}` (its built-in prompts; --prompts FILE for "
            f"your own)"
            f"{'' if spread else ' (a model larger than one device: pip install accelerate and add --device-map auto)'}"
            f"; then `{replay}`")


def _needs_remote_code(target) -> bool:
    """Whether transformers needs the checkpoint's own code for this target: its config maps to remote code
    (``auto_map``) and transformers does not know its ``model_type`` (stock Llama, Qwen, DeepSeek-V3: never)."""
    cfg = getattr(target, "config", None) or {}
    if not isinstance(cfg, dict) or not cfg.get("auto_map"):
        return False
    try:
        from transformers import CONFIG_MAPPING

        return str(cfg.get("model_type")) not in CONFIG_MAPPING
    except Exception:  # noqa: BLE001 - cannot tell: say it
        return True


def _fix_candidates(rules: TargetRules, boundaries: List[int], L: int,
                    like: Optional[List[int]] = None) -> List[List[int]]:
    """Id lists that make the engine capture exactly ``boundaries`` in this order, found through the engine's own
    id rule (``map_ids``: SGLang's set_eagle3_layers_to_capture where it is installed) over every list whose ids
    lie within one of the boundaries, closest to ``like`` (the ids the config holds) first: the same form (each
    id maps to its boundary with the same offset as the config's ids do, e.g. SGLang's deepseek rule takes
    [2, 30, 58] as they are and [1, 29, 57] plus one), then the fewest changed ids."""
    import itertools

    from .engines import POST_NORM

    target = list(boundaries)
    pool = [[(-1 if b == POST_NORM(L) else b - 1) for b in target], list(target)]
    if len(target) <= 4:  # 3^K lists, each one run of the engine's rule
        pool += [[b + d for b, d in zip(target, ds)] for ds in itertools.product((0, -1, 1), repeat=len(target))]
    out: List[List[int]] = []
    for ids in pool:
        if ids in out:
            continue
        m = rules.map_ids(ids, L)
        if m.error is None and m.unknown is None and m.config_order == target:
            out.append(ids)
    if like is None or len(like) != len(target):
        return out
    m = rules.map_ids(list(like), L)
    form = [b - i for i, b in zip(like, m.config_order)] if m.error is None and len(m.config_order) == len(like) \
        else None

    def distance(ids):
        same_form = form is not None and [b - i for i, b in zip(ids, target)] == form
        return (not same_form, sum(i != j for i, j in zip(ids, like)))

    return sorted(out, key=distance)  # stable: the pool's order among equals


def verified_fix(rep: "Report", boundaries: List[int], check_readings: bool = True) -> Optional[List[int]]:
    """Ids that make the engine feed ``boundaries`` and that the doctor itself passes: the engine captures
    every slot, in order, the fc width fits, and (``check_readings``: evidence from the config alone) every
    plausible reading of the new ids gives the same boundaries, else the re-run would warn that the config
    cannot tell. With replay as the evidence the readings need not agree: the replay showed what the draft
    was trained on, and the fix is whatever makes the engine feed it. Among such ids, the one closest to the
    config's own (:func:`_fix_candidates`). None when no such ids exist (:func:`why_no_fix` says why)."""
    from .engines import resolve_wiring

    o, t, d = rep.options, rep.target, rep.draft
    for ids in _fix_candidates(rep.wiring.rules, boundaries, t.num_layers, like=rep.wiring.ids):
        if o.engine == "sglang":
            nd, layers = dataclasses.replace(d, nested_ids=ids), o.trtllm_layers
        elif o.engine == "vllm":
            nd, layers = dataclasses.replace(d, top_ids=ids), o.trtllm_layers
        else:
            nd, layers = d, ids
        w = resolve_wiring(o.engine, t, nd, pp=o.pp, pp_partition=o.pp_partition, vllm_runner=o.vllm_runner,
                           trtllm_layers=layers, rules=rep.wiring.rules)
        if w.duplicates or w.reordered or not all(s.captured for s in w.slots) or \
                w.captured_boundaries != list(boundaries) or \
                (rep.fc_slots is not None and len(w.slots) != rep.fc_slots):
            continue
        if check_readings and o.trained_ids is None and o.engine != "trtllm":
            nt = resolve_training(nd, t, o)
            if any(r.boundaries != list(boundaries) for r in nt.plausible):
                continue
        return ids
    return None


def why_no_fix(rep: "Report", boundaries: List[int]) -> str:
    """Why no id list makes the engine feed ``boundaries`` (when :func:`verified_fix` found none), in words."""
    from .engines import uncapturable_reason

    eng, L = rep.wiring.name, rep.target.num_layers
    for b in boundaries:
        why = uncapturable_reason(rep.wiring.rules, b, L)
        if why:
            return f"{eng} never captures {short_boundary(b, L)} (boundary {b}): {why}"
    stage = rep.wiring.pp_last_stage
    early = [b for b in boundaries if stage is not None and b < stage[0]]
    if early:
        return (f"with --pp {rep.options.pp} only the last pipeline stage captures, and it runs layers "
                f"{stage[0]}..{stage[1] - 1}: boundary {early[0]} is computed on an earlier stage")
    if len(set(boundaries)) != len(boundaries):
        return f"{eng} captures a repeated boundary once, so it cannot feed {boundaries}"
    if list(boundaries) != sorted(boundaries) and rep.options.engine != "trtllm" and \
            rep.wiring.rules.capture_order != "written":
        return f"{eng} concatenates its captures in layer order, so it cannot feed {boundaries} in this order"
    return (f"no id list within one of these boundaries makes {eng}'s id rule ('{rep.wiring.rules.rule_text}') "
            f"capture exactly {boundaries} in this order")


def _readings_text(rep: "Report", training: Training, L: int) -> str:
    """Each reading: its boundaries and the ids to set under it for this engine."""
    parts = []
    for n, r in enumerate(training.readings):
        tag = chr(ord("A") + n)
        if not r.plausible:
            parts.append(f"({tag}) {r.label}: boundaries {r.boundaries}, ruled out ({r.why_not})")
            continue
        fed = rep.wiring.captured_boundaries == r.boundaries and all(s.captured for s in rep.wiring.slots)
        if fed:
            todo = "what it feeds now: keep the ids"
        else:
            ids = verified_fix(rep, r.boundaries, check_readings=False)
            todo = (f"set {IDS_LOCATION[rep.options.engine]} to {ids}" if ids is not None else
                    why_no_fix(rep, r.boundaries))
        parts.append(f"({tag}) {r.label}: trained on {r.boundaries} = "
                     f"{', '.join(short_boundary(b, L) for b in r.boundaries)}; {todo}")
    return "; ".join(parts)


def _compare_slots(rep: Report, wiring: EngineWiring, training: Training, opts: Options, L: int) -> None:
    eng = wiring.name
    engine_b = [s.boundary for s in wiring.slots]
    plausible = training.plausible
    agreed = training.agreed
    n = max([len(engine_b)] + [len(r.boundaries) for r in training.readings])
    for k in range(n):
        s = wiring.slots[k] if k < len(wiring.slots) else None
        per = {r.key: (r.boundaries[k] if k < len(r.boundaries) else None) for r in plausible}
        tb = agreed[k] if agreed is not None and k < len(agreed) else None
        if tb is None and len(set(per.values())) == 1:
            tb = next(iter(per.values()))
        rep.slots.append({
            "slot": k,
            "config_id": s.config_id if s else None,
            "capture_index": s.boundary if s else None,
            "rule": wiring.rule,
            "engine_reads": (describe_boundary(s.boundary, L) if s.captured else "nothing: never captured")
            if s else "nothing: no capture for this slot",
            "captured": bool(s and s.captured),
            "not_captured_reason": s.why_not if s and not s.captured else None,
            "trained_index": tb,
            "trained_by_reading": per,
            "draft_trained_on": describe_boundary(tb, L) if tb is not None else
            ("no such slot in training" if not any(v is not None for v in per.values()) else
             "depends on the reading: " + ", ".join(f"{key} {v}" for key, v in per.items())),
            "match": bool(s and s.captured and per and all(v == s.boundary for v in per.values())),
        })

    if wiring.reordered:
        if opts.engine == "trtllm":
            why = (f"TensorRT-LLM keeps eagle3_layers_to_capture as a set and concatenates it in ascending id order "
                   f"(id -1 first), so with ids {wiring.ids} slot k is not the k-th id")
        else:
            why = (f"the ids {wiring.ids} are not in layer order and {eng} concatenates captures in layer order, so "
                   f"slot k is not the k-th id")
        rep.add("warning", "W_SLOT_ORDER",
                f"{why[0].upper() + why[1:]}. If the draft was trained with the ids' order, its slots are permuted; "
                f"check with --replay.")
    if any(len(r.boundaries) != len(engine_b) for r in training.readings) or not all(s.captured for s in
                                                                                     wiring.slots):
        if not plausible or (agreed is None and len(training.readings) > 1):
            rep.add("info", "I_TRAINING_READINGS", "What the draft may have been trained on: "
                    + _readings_text(rep, training, L) + f". To settle it, {replay_command(rep)}.")
        return
    if not plausible:
        rep.add("error", "E_WIRING_MISMATCH",
                f"No reading of the draft config's ids {training.ids} is something a trainer could have captured: "
                + _readings_text(rep, training, L) + f". The config was likely edited after training: restore the "
                f"ids the checkpoint was published with, or {replay_command(rep)}.")
        return
    matching = [r for r in plausible if r.boundaries == engine_b]
    if len(matching) == len(plausible):
        if training.assumed_default:
            rep.add("warning", "W_NO_TRAINING_IDS",
                    f"The draft config records no layer ids, so the doctor assumes it was trained on the common "
                    f"default boundaries {engine_b}, which is what {eng} feeds. That is an assumption: drafts trained "
                    f"on other layers are published without ids too (a vLLM user reported 1.2% acceptance with the "
                    f"defaults on such a Llama-3.3-70B draft). To check, {replay_command(rep)}.")
        elif len(training.readings) > 1:
            rep.add("info", "I_WIRING_MATCHES",
                    f"{eng} feeds {engine_b}, which is what the draft was trained on under every plausible reading of "
                    f"its ids: " + _readings_text(rep, training, L) + ".")
        return

    details_for = (lambda tb: "; ".join(f"slot {k} gets {short_boundary(s.boundary, L)} but was trained on "
                                        f"{short_boundary(b, L)}" for k, (s, b) in enumerate(zip(wiring.slots, tb))
                                        if s.boundary != b))
    ignored = ""
    if wiring.ignored_ids is not None:
        loc, ids = wiring.ignored_ids
        ignored = f" ({eng} does not read {loc} = {ids}, so it falls back to its default boundaries.)"

    if matching:  # some readings agree with the engine, some do not: the config cannot decide
        keep = " and ".join(chr(ord("A") + training.readings.index(r)) for r in matching)
        rep.add("warning", "W_TRAINING_AMBIGUOUS",
                f"The draft config cannot tell which hidden states the draft was trained on, and the readings "
                f"disagree about this deployment: {eng} feeds {engine_b} "
                f"({', '.join(short_boundary(b, L) for b in engine_b)}). " + _readings_text(rep, training, L)
                + f". Under reading {keep} the deployment is right as configured; do not change the ids on the "
                f"doctor's word. To settle it, {replay_command(rep)}.")
        return

    # no plausible reading matches: an error; a fix only from evidence (every reading agrees)
    if agreed is not None:
        fix_ids = verified_fix(rep, agreed)
        if fix_ids is not None:
            fix_rule = map_ids(wiring.rules, fix_ids, L)[1]
            fix = f"Set {IDS_LOCATION[opts.engine]} to {fix_ids} ({eng}: boundary = {fix_rule})."
            if opts.engine == "sglang" and wiring.rules.rule_key == "id+1-if-first-is-1":
                fix = (f"Set {IDS_LOCATION[opts.engine]} to {fix_ids} (SGLang's deepseek rule adds 1 only when the "
                       f"first id is 1).")
        else:
            fix = (f"No ids make {eng} feed exactly {agreed} (in this order) in a configuration the doctor can "
                   f"confirm; serve with an engine that can, or retrain the draft on boundaries {eng} captures.")
        details = details_for(agreed)
    else:
        fix = ("The readings disagree on what the draft was trained on, and none is what the engine feeds: "
               + _readings_text(rep, training, L) + f". To find out which, {replay_command(rep)}.")
        details = " | ".join(f"reading {chr(ord('A') + training.readings.index(r))}: {details_for(r.boundaries)}"
                             for r in plausible)
    emb = [k for k, s in enumerate(wiring.slots) if s.boundary == 0 and all(r.boundaries[k] != 0 for r in plausible)]
    deltas = {s.boundary - b for r in plausible for s, b in zip(wiring.slots, r.boundaries) if s.boundary != b}
    if emb:
        rep.add("error", "E_EMBEDDING_CAPTURE",
                f"Slot {emb[0]} receives the token embeddings, but the draft was not trained on them there "
                f"({details}).{ignored} {fix}")
    elif agreed is not None and len(deltas) == 1 and deltas <= {1, -1} and \
            all(s.boundary != b for s, b in zip(wiring.slots, agreed)):
        d = deltas.pop()
        rep.add("error", "E_CONVENTION_MISMATCH",
                f"Every slot is one layer {'later' if d > 0 else 'earlier'} than the draft was trained on under "
                f"every reading of its ids: {eng} reads them by '{wiring.rule}'.{ignored} {details}. {fix}")
    else:
        rep.add("error", "E_WIRING_MISMATCH",
                f"{eng} feeds the draft other hidden states than it was trained on: {details}.{ignored} {fix}")


def _check_other_vllm_runner(rep: Report, target: TargetInfo, draft: DraftInfo, wiring: EngineWiring,
                             opts: Options) -> None:
    """vLLM 0.33.0 reads ids differently per model runner; say what the other one feeds when it differs."""
    from .engines import resolve_wiring

    other = "v1" if opts.vllm_runner == "v2" else "v2"
    w = resolve_wiring("vllm", target, draft, pp=opts.pp, pp_partition=opts.pp_partition, vllm_runner=other,
                       rules=wiring.rules)
    if w.captured_boundaries == wiring.captured_boundaries:
        return
    how = {"v1": "the V1 runner (VLLM_USE_V2_MODEL_RUNNER=0, and what vLLM falls back to for P-EAGLE parallel "
                 "drafting): gpu_model_runner._get_eagle3_aux_layers_from_config reads the top-level ids, then "
                 "eagle_config's, as given",
           "v2": "the V2 runner (vLLM 0.33.0's default): eagle3_utils.get_eagle3_aux_layers_from_config reads the "
                 "top-level ids only"}[other]
    ok = [r for r in (rep.training.plausible if rep.training else []) if r.boundaries == w.captured_boundaries]
    rep.add("warning", "W_VLLM_RUNNER",
            f"This report is for vLLM's {opts.vllm_runner.upper()} runner (--vllm-runner). Under {how}, vLLM feeds "
            f"{w.captured_boundaries} instead ({w.ids_source}), which "
            + ("is what the draft was trained on under some reading" if ok else
               "matches no reading of what the draft was trained on")
            + f". Write the top-level eagle_aux_hidden_state_layer_ids so both runners agree; rerun with "
              f"--vllm-runner {other} to see that case in full.")


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
                f"--tp {opts.tp}: {wiring.capture_point_evidence}. Checked: the stock capture path of {eng} for "
                f"{wiring.rules.arch}. Not checked: patched engines or custom capture hooks; if you use one, rerun "
                f"with --capture-point before-allreduce|after-allreduce.")
    else:
        rep.add("warning", "W_TP_CAPTURE_UNVERIFIED",
                f"--tp {opts.tp}: {wiring.capture_point_evidence}. If captures are taken before the all-reduce, each "
                f"rank feeds its draft a partial sum. Verify, then rerun with --capture-point.")


def _target_class_name(rules: TargetRules, target: TargetInfo) -> str:
    """The target's own class name: the engine's class for it, or, where the engine falls back to its generic
    Transformers backend (SGLang's and vLLM's TransformersForCausalLM), the architecture the config names."""
    cls = rules.class_name.rsplit(".", 1)[-1]
    if (not cls or cls == "TransformersForCausalLM") and target.architectures:
        return target.architectures[0]
    return cls or "this class"


def _supported_elsewhere(target: TargetInfo, engine: str) -> str:
    """What the other engines' code says about this target (tables only: no engine is imported for this)."""
    parts = []
    for other in ("sglang", "vllm"):
        if other == engine:
            continue
        r = target_rules(other, target, "table")
        if r.supported:
            via = (" through its Transformers backend (" + r.class_name + ")" if
                   r.class_name.rsplit(".", 1)[-1] == "TransformersForCausalLM" else f" ({r.class_name})")
            parts.append(f"{r.name} {r.version} serves it{via}")
        elif r.supported is False:
            parts.append(f"{r.name} {r.version} refuses it too")
    return f" ({'; '.join(parts)})" if parts else ""


def _layer_tensors(weights: Dict[str, TensorInfo]) -> List[str]:
    """The checkpoint's decoder-layer tensors, relative to their layer (``layers.N.`` of the canonical names)."""
    import re

    return sorted({m.group(1) for n in weights if (m := re.match(r"layers\.\d+\.(.+)$", n))})


def _head_names(rows: Dict[str, dict]) -> Dict[str, List[str]]:
    """Head class -> the names an engine registers it under, its own class name first (the one to advise)."""
    out: Dict[str, List[str]] = {}
    for name, row in sorted(rows.items()):
        out.setdefault(row.get("class") or name, []).append(name)
    for cls, names in out.items():
        names.sort(key=lambda n: (n != cls.rsplit(".", 1)[-1], n))
    return out


def _layer_fits(rows: Dict[str, dict], tensors: List[str]) -> Optional[Dict[str, dict]]:
    """Per head class (named by its advised name): how the layer tensors fit it (:func:`.source_reader.layer_fit`, from
    the tensors the head's own load_weights loads, as the engine table records them). None when no row records it."""
    out = {}
    for cls, names in _head_names(rows).items():
        fit = layer_fit(rows[names[0]].get("layer"), tensors)
        if fit is not None:
            out[names[0]] = dict(fit, names=names)
    return out or None


def _short(names: List[str], n: int = 8) -> str:
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


def _other_engines_for_layer(engine: str, tensors: List[str]) -> str:
    """What the other engines' pinned tables say about a head for this layer (sentence, or "")."""
    out = []
    for other in ("sglang", "vllm"):
        if other == engine:
            continue
        t = tables.load(other)
        eng = ENGINE_NAMES[other]
        if not t or not t.get("draft_heads"):
            continue
        ver = t.get("version", tables.PINNED[other])
        fits = _layer_fits(t["draft_heads"], tensors)
        if fits is None:
            out.append(f"{eng} {ver}'s table does not record which tensors its heads load, so the doctor cannot say "
                       f"whether {eng} serves this draft")
            continue
        good = [n for n, f in fits.items() if f["fits"]]
        if good:
            out.append(f"{eng} {ver} serves it: its head {' or '.join(good)} loads every tensor of this layer "
                       f"(architectures {good[0]} there)")
        else:
            none = sorted(set.intersection(*(set(f["unloaded"]) for f in fits.values())))
            out.append(f"{eng} {ver} has no EAGLE-3 head for it either (none of {', '.join(fits)} loads "
                       + (f"layers.N.{{{_short(none, 6)}}}" if none else "every tensor of this layer") + ")")
    return "; ".join(out)


def _check_draft_class(rep: Report, draft: DraftInfo, opts: Options,
                       weights: Optional[Dict[str, TensorInfo]] = None) -> None:
    """The draft's ``architectures`` must resolve to one of the engine's EAGLE-3 heads; the head to name is the one
    whose load_weights loads the checkpoint's decoder-layer tensors (the engine tables record, per head, what its
    own code loads), never a guess."""
    eng = ENGINE_NAMES[opts.engine]
    dc = draft_class(opts.engine, draft, opts.engine_code)
    archs = draft.architectures or []
    if not dc.known:
        rep.add("info", "I_DRAFT_CLASS", f"Draft class not checked for {eng}: {dc.message}.")
        return
    if dc.head is not None:
        if weights is not None:  # without them: the class is one of the heads, whether it loads the layer is unseen
            _check_named_head_fits(rep, dc, archs, eng, weights)
        return
    if dc.message:
        how = dc.message
    elif opts.engine == "sglang":
        how = (f"SGLang resolves the draft's architectures {archs} to {dc.arch} (ModelRegistry, as for any model), "
               f"which is not one of its EAGLE-3 heads ({', '.join(dc.heads)}: the classes that read the target's "
               f"captures through an fc sized by num_aux_hidden_states): it would load the checkpoint as a plain "
               f"{dc.arch}, and the draft's fc is never applied")
    else:
        how = (f"vLLM renames the draft's architectures {archs} to {dc.arch} (EAGLEConfig, method eagle3) and has no "
               f"EAGLE-3 head by that name ({', '.join(dc.heads)})")
    ver = dc.version
    tensors = _layer_tensors(weights or {})
    fits = _layer_fits(dc.rows, tensors) if tensors else None
    heads = ", ".join(_head_names(dc.rows)[c][0] for c in _head_names(dc.rows)) or "none"
    if fits is None:  # nothing to match: name the heads, not one of them
        why = ("its decoder-layer tensors are in the weights, not here" if weights is None else
               "the checkpoint holds no decoder-layer tensors (layers.N.*) to match them against" if not tensors else
               f"the {eng} table does not record which tensors its heads load")
        rep.add("error", "E_DRAFT_CLASS",
                f"{how}. Set \"architectures\" in the draft's config.json to the {eng} EAGLE-3 head whose layer "
                f"matches the checkpoint's ({heads}); the doctor cannot name it: {why}.")
        return
    good = [n for n, f in fits.items() if f["fits"]]
    if good:
        f = fits[good[0]]
        why_not = []  # why each other head does not fit: tensors it leaves unloaded, else parameters left unfed
        for o, fo in fits.items():
            if o in good:
                continue
            why_not.append(f"{o} does not load {_short(fo['unloaded'], 3)}" if fo["unloaded"] else
                           f"{o} builds {_short(fo['missing'], 3)}, which no tensor of the checkpoint feeds")
        rep.add("error", "E_DRAFT_CLASS",
                f"{how}. Set \"architectures\" in the draft's config.json to {' or '.join(good)}: "
                + ("it is" if len(good) == 1 else "they are")
                + f" the {eng} {ver} EAGLE-3 head{'s' if len(good) > 1 else ''} whose load_weights loads every "
                  f"tensor of this draft's decoder layer (layers.N.{{{_short(tensors, 12)}}}) and feeds every "
                  f"parameter its layer always builds"
                + (f" ({'; '.join(why_not)})" if why_not else "")
                + (f"; {eng} also registers that class as {', '.join(f['names'][1:])}" if len(f["names"]) > 1
                   else "")
                + ".")
        return
    # no head of this engine loads this layer: say which tensors show it and who serves it instead
    none = sorted(set.intersection(*(set(f["unloaded"]) for f in fits.values())))
    moe = " (a mixture-of-experts MLP)" if any(".experts." in f".{n}" or n.startswith("mlp.router.")
                                                for n in none) else ""
    closest = min(fits, key=lambda n: (len(fits[n]["unloaded"]), len(fits[n]["missing"])))
    c = fits[closest]
    if none:
        detail = f"none of them ({', '.join(fits)}) loads layers.N.{{{_short(none, 8)}}}{moe}"
    elif c["unloaded"]:
        detail = (f"none of them ({', '.join(fits)}) loads every tensor of it (the closest, {closest}, leaves "
                  f"layers.N.{{{_short(c['unloaded'], 6)}}} unloaded)")
    else:
        detail = f"{closest} loads every tensor of it, but not all it needs"
    if c["missing"]:
        params = dc.rows[closest]["layer"]["params"]
        need = [f"{p} (from {' or '.join(params[p]['from'])})" for p in c["missing"]]
        who = f"the closest, {closest}," if none else closest
        detail += f"; {who} builds {_short(need, 4)}, which no tensor of the checkpoint feeds"
    others = _other_engines_for_layer(opts.engine, tensors)
    rep.add("error", "E_DRAFT_CLASS",
            f"{how}. {eng} {ver} serves no EAGLE-3 head with this draft's decoder layer: {detail}. "
            + (f"{others}. " if others else "")
            + f"Renaming \"architectures\" cannot make {eng} load this layer: serve the draft with an engine that has "
              f"a head for it, or export/retrain it with a layer one of {eng}'s heads loads.")


def _check_named_head_fits(rep: Report, dc, archs: List[str], eng: str, weights: Dict[str, TensorInfo]) -> None:
    """The draft names one of the engine's heads: its layer must be that head's. A head's load_weights skips a
    tensor it does not know (SGLang's logs a line) and leaves the parameter it builds unset, so a checkpoint of
    another layer loads 'fine' and drafts garbage."""
    tensors = _layer_tensors(weights)
    fits = _layer_fits(dc.rows, tensors) if tensors else None
    named = next((n for n, f in (fits or {}).items() if dc.arch in f["names"]), None)
    if named is None or fits[named]["fits"]:
        return
    f = fits[named]
    wrong = (f"its load_weights does not load layers.N.{{{_short(f['unloaded'], 6)}}}" if f["unloaded"] else
             f"it builds {_short(f['missing'], 4)}, which no tensor of the checkpoint feeds")
    good = [n for n, fo in fits.items() if fo["fits"]]
    fix = (f"Set \"architectures\" in the draft's config.json to {' or '.join(good)}, whose load_weights loads every "
           f"tensor of this layer." if good else
           f"No {eng} {dc.version} EAGLE-3 head loads this layer; serve the draft with an engine that has a head for "
           f"it.")
    rep.add("error", "E_DRAFT_CLASS",
            f"The draft's architectures {archs} name {eng}'s EAGLE-3 head {dc.arch}, but the checkpoint's decoder "
            f"layer (layers.N.{{{_short(tensors, 8)}}}) is not that head's: {wrong}. {eng} would load the draft with "
            f"those parameters unset and serve garbage proposals. {fix}")


def _check_tied(rep: Report, target: TargetInfo, draft: DraftInfo, weights: Dict[str, TensorInfo],
                opts: Options) -> None:
    """tie_word_embeddings on a draft: what each engine does with its lm_head."""
    if not draft.tie_word_embeddings or weights is None:  # what the engine does turns on lm_head.weight's presence
        return
    eng = ENGINE_NAMES[opts.engine]
    V = target.vocab_size
    lm = weights.get("lm_head.weight")
    dv = lm.shape[0] if lm is not None and len(lm.shape) == 2 else (draft.draft_vocab_size or draft.vocab_size)
    smaller = V is not None and dv is not None and dv < V
    src = f" ({draft.tie_source})" if draft.tie_source and draft.tie_source != "config.json" else ""
    has_lm = "present" if lm is not None else "absent"
    dc = draft_class(opts.engine, draft, opts.engine_code)
    head = dc.head or {}
    if opts.engine == "sglang" and head.get("tied_lm_head"):
        cls = head["class"].rsplit(".", 1)[-1]
        what = (f"SGLang's {cls} ties its lm_head to its embedding (`if self.config.tie_word_embeddings: "
                f"{head['tied_lm_head']}`) and {head.get('set_embed') or 'set_embed'} replaces that embedding with the "
                f"target's: the checkpoint's lm_head.weight is never loaded")
        if smaller:
            fix = ("Set tie_word_embeddings to false in the draft's config.json: SGLang then builds a "
                   f"{dv}-row lm_head and loads the trained lm_head.weight." if lm is not None else
                   "The checkpoint has no lm_head.weight to load untied: re-export the draft with its trained lm_head "
                   "(or retrain untied), then set tie_word_embeddings to false.")
            rep.add("error", "E_TIED_DRAFT_VOCAB",
                    f"The draft sets tie_word_embeddings{src} and predicts {dv} draft tokens, fewer than the target's "
                    f"{V}. {what}; the draft scores target tokens 0..{dv - 1} with the target's embedding rows and d2t "
                    f"maps those scores to other tokens: its proposals are garbage (no error, acceptance near zero). "
                    f"{fix} (vLLM 0.33.0 ignores tie_word_embeddings and loads lm_head.weight, {has_lm} here.)")
        else:
            rep.add("info", "I_TIED_DRAFT",
                    f"The draft sets tie_word_embeddings{src}: {what}; the draft's lm_head is the target's embedding "
                    f"matrix ({V} rows, the same vocabulary). Right only if the draft was trained tied to the target's "
                    f"embedding.")
    elif opts.engine == "vllm" and head:
        if head.get("reads_tie_word_embeddings"):
            rep.add("warning", "W_TIED_DRAFT", f"vLLM's {head['class']} reads tie_word_embeddings; the doctor has not "
                                               f"verified what it does with it.")
        elif lm is not None:
            rep.add("info", "I_TIED_DRAFT",
                    f"The draft sets tie_word_embeddings{src}; vLLM's {head['class']} ignores it (its lm_head has "
                    f"draft_vocab_size rows) and loads the checkpoint's lm_head.weight ({dv} rows).")
        elif smaller and (tables.load("vllm") or {}).get("shares_target_lm_head_without_own"):
            rep.add("error", "E_TIED_DRAFT_VOCAB",
                    f"The draft sets tie_word_embeddings{src} and has no lm_head.weight; vLLM's {head['class']} "
                    f"ignores the flag and, finding no lm_head in the checkpoint, shares the target's lm_head ({V} "
                    f"rows; spec_decode/eagle/utils.load_eagle_model, has_own_lm_head) while its logits cover {dv} "
                    f"draft tokens mapped by d2t: garbage proposals. Export the draft with its trained lm_head.")
    elif opts.engine == "trtllm":
        rep.add("warning", "W_TIED_DRAFT",
                f"The draft sets tie_word_embeddings{src} (draft vocabulary {dv}, target {V}); the doctor has not "
                f"read how TensorRT-LLM's EAGLE-3 draft treats a tied lm_head. SGLang drops the trained lm_head of a "
                f"tied draft; check that {eng} loads lm_head.weight ({has_lm} in the checkpoint).")


def _check_untied_head(rep: Report, target: TargetInfo, draft: DraftInfo,
                       weights: Optional[Dict[str, TensorInfo]], opts: Options) -> None:
    """An untied draft's lm_head as the engine builds it: SGLang's heads build their own (``draft_vocab_size``
    rows, allocated uninitialised) unless draft_vocab_size is None, when the worker gives them the target's head;
    their load_weights loads the tensors present and nothing notices one missing. vLLM shares the target's head
    when the checkpoint has none. Rules from the engine table (``untied_lm_head``, vLLM's
    ``shares_target_lm_head_without_own``)."""
    if draft.tie_word_embeddings:
        return  # _check_tied
    V = target.vocab_size
    raw = draft.config if isinstance(draft.config, dict) else {}
    d2t = weights is not None and "d2t" in weights
    lm = None if weights is None else weights.get("lm_head.weight")
    dv = draft.draft_vocab_size
    if opts.engine == "sglang":
        dc = draft_class("sglang", draft, opts.engine_code)
        rule = (dc.head or {}).get("untied_lm_head")
        if not rule or rule.get("shares_when") != "draft_vocab_size is None":
            return
        cls = dc.head["class"].rsplit(".", 1)[-1]
        rows = lm.shape[0] if lm is not None and len(lm.shape) == 2 else None
        keep = ("re-export the draft with its trained lm_head.weight" +
                ("" if d2t else "; or, if it was trained with the target's own lm_head (all "
                               f"{V} tokens, no d2t), set \"draft_vocab_size\": null so that SGLang shares it"))
        if "draft_vocab_size" not in raw and rule.get("reads_draft_vocab_size") == "attribute":
            rep.add("error", "E_DRAFT_VOCAB_SIZE_MISSING",
                    f"The draft's config.json has no draft_vocab_size and is untied: SGLang's {cls} reads "
                    f"config.draft_vocab_size to size its lm_head, so the server fails at start-up (AttributeError). "
                    + (f"Set \"draft_vocab_size\": {rows} (the rows of the checkpoint's lm_head.weight)." if rows else
                       "Set it to the number of tokens the draft predicts (the rows of its lm_head.weight)"
                       + (", or null to share the target's lm_head (only for a draft trained with it)." if not d2t
                          else ".")))
            return
        if weights is None:
            return
        if dv is None:  # load_lm_head_from_target: the worker replaces the head with the target's
            if lm is not None and (rows != V or d2t):
                rep.add("error", "E_LM_HEAD_REPLACED",
                        f"The draft's draft_vocab_size is null and it is untied: SGLang's {cls} then sets "
                        f"load_lm_head_from_target and {rule.get('worker') or 'its EAGLE-3 worker'} gives it the "
                        f"target's lm_head ({V} rows) in place of the checkpoint's trained lm_head.weight ({rows} "
                        f"rows{', mapped by d2t' if d2t else ''}): its proposals are scored by the wrong head (no "
                        f"error, acceptance near zero). Set \"draft_vocab_size\": {rows}.")
            return
        if lm is None:
            rep.add("error", "E_NO_LM_HEAD",
                    f"The checkpoint has no lm_head.weight, the draft is untied and sets draft_vocab_size {dv}: "
                    f"SGLang's {cls} builds its own {dv}-row lm_head (ParallelLMHead, allocated uninitialised), shares "
                    f"the target's only when draft_vocab_size is None ({rule.get('worker') or 'its worker'}: "
                    f"set_embed, not set_embed_and_head), and its load_weights loads the tensors present without "
                    f"noticing one missing: the head stays uninitialised memory, and the server starts and accepts "
                    f"next to nothing. Fix: {keep}.")
    elif opts.engine == "vllm" and weights is not None and lm is None:
        if not (tables.load("vllm") or {}).get("shares_target_lm_head_without_own"):
            return
        smaller = dv is not None and V is not None and dv < V
        if smaller or d2t:
            rep.add("error", "E_NO_LM_HEAD",
                    f"The checkpoint has no lm_head.weight: vLLM 0.33.0 then shares the target's lm_head ({V} rows; "
                    f"spec_decode/eagle/utils.load_eagle_model, has_own_lm_head) while the draft's logits cover "
                    f"{dv or 'its'} draft tokens mapped by d2t: garbage proposals. Re-export the draft with its "
                    f"trained lm_head.weight.")


def _context_lengths(target: TargetInfo, draft: DraftInfo, opts: Options):
    """(target's, draft's context length, whether SGLang's own get_context_length derived them): that function on
    SGLang's reading of each config (the installed pinned SGLang; the target's is read with its config,
    LibraryConfig.context_length), else each config's max_position_embeddings (the table cannot run that function:
    its rope_scaling factor is not applied); None where a config has no length."""
    from .rules import sglang_source

    t_raw = (target.text_config or {}).get("max_position_embeddings")
    d_raw = (draft.layer_config or {}).get("max_position_embeddings")
    if not isinstance(t_raw, int) or not isinstance(d_raw, int):
        return None
    if opts.engine == "sglang" and sglang_source(opts.engine_code)[0] in ("live", "kept"):
        try:
            from .configs import sglang_read

            t_len = target.lib.context_length if target.lib is not None else None
            d_len = sglang_read(dict(draft.layer_config))[3] if t_len is not None else None
            if t_len is not None and d_len is not None:
                return t_len, d_len, True
        except Exception:  # noqa: BLE001 - the raw lengths, said as such
            pass
    return t_raw, d_raw, False


def _sglang_version() -> str:
    from .sglang_code import installed_version

    return installed_version() or tables.PINNED["sglang"]


def _check_context(rep: Report, target: TargetInfo, draft: DraftInfo, opts: Options) -> None:
    """A draft trained on a shorter context than the target serves: SGLang 0.5.23 refuses to start (the draft's
    ModelConfig gets the target's context_len, eagle_worker_v2; model_config._derive_context_length raises unless
    SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1, which raises the draft's max_position_embeddings); vLLM 0.33.0 raises
    the draft's max_position_embeddings to the target's with an INFO line (speculative.py,
    _maybe_override_draft_max_position_embeddings) for default/linear/llama3 RoPE."""
    lengths = _context_lengths(target, draft, opts)
    if lengths is None:
        return
    t_len, d_len, exact = lengths
    how = ("SGLang's get_context_length (rope_scaling factor applied)" if exact else
           "max_position_embeddings of each config (no rope_scaling factor applied)")
    if opts.served_context_length is not None:
        t_len, how = opts.served_context_length, how + "; the target's: the server's --context-length"
    if t_len <= d_len:
        return
    past = (f"past {d_len} tokens the draft runs on positions it never saw in training, and its acceptance "
            f"falls (below no speculation in a vLLM user's report)")
    if opts.server_running:  # it started, so SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN is set
        rep.add("warning", "W_DRAFT_CONTEXT_SHORT",
                f"The server serves {t_len} tokens of context, the draft's context length is {d_len} ({how}): "
                f"SGLang started it with SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN, raising the draft's "
                f"max_position_embeddings, but {past}. Serve with --context-length {d_len} (or less), or use a "
                f"draft trained on the target's length.")
    elif opts.engine == "sglang":
        rep.add("warning", "W_DRAFT_CONTEXT_SHORT",  # a warning: SGLang says it at start-up, the cost is speed
                f"The draft's context length is {d_len}, the target's {t_len} ({how}). "
                f"SGLang {_sglang_version() + ' ' if exact else ''}"
                f"gives the draft the target's context length and "
                + ("refuses to start" if exact else "then refuses to start if this holds with the factor applied")
                + f" (ValueError: Target model's context_length ({t_len}) is greater than the derived context_length "
                  f"({d_len}) ... set the env var SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1); with that variable "
                  f"it raises the draft's max_position_embeddings to {t_len} and starts, but {past}. Serve with "
                  f"--context-length {d_len} (or less), or use a draft trained on the target's length; set the "
                  f"variable only for prompts and outputs that stay within {d_len} tokens.")
    elif opts.engine == "vllm":
        rep.add("warning", "W_DRAFT_CONTEXT_SHORT",
                f"The draft's context length is {d_len}, the target's {t_len} ({how}). vLLM 0.33.0 starts anyway: "
                f"for default/linear/llama3 RoPE it raises the draft's max_position_embeddings to the target's "
                f"with an INFO line (config/speculative.py, _maybe_override_draft_max_position_embeddings); for "
                f"other RoPE types the V2 runner lowers the target's max_model_len to {d_len} "
                f"(_limit_max_model_len_to_draft). Either way {past}. Serve with --max-model-len {d_len} (or "
                f"less), or use a draft trained on the target's length.")


def _check_embed_scale(rep: Report, rules: TargetRules, opts: Options) -> None:
    if not rules.scaled_embedding:
        return
    dc = draft_class(opts.engine, rep.draft, opts.engine_code)
    if dc.head is not None and dc.head.get("scaled_embedding"):
        return
    holder = rules.evidence.get("holder_class", "").rsplit(".", 1)[-1] or rules.arch
    rep.add("warning", "W_EMBED_SCALE",
            f"The target scales its token embeddings ({holder}: `{rules.scaled_embedding}`), and its boundary-0 "
            f"capture is the scaled embedding; {rules.name}'s draft head {dc.arch or 'class'} embeds the draft's "
            f"tokens "
            f"with the target's embedding weights (set_embed) and applies no scale, so its embedding input is "
            f"1/sqrt(hidden_size) of the target's. Right only if the draft was trained with the same unscaled "
            f"embeddings; a draft trained on scaled embeddings reads inputs sqrt(hidden_size) times too small.")


def _check_vocab(rep: Report, target: TargetInfo, draft: DraftInfo,
                 weights: Optional[Dict[str, TensorInfo]]) -> None:
    V = target.vocab_size
    other_tokenizer = (f"the draft's vocab_size is {draft.vocab_size} but the target's is {V} (the draft shares the "
                       f"target's embedding and token ids; a different tokenizer cannot work)"
                       if V is not None and draft.vocab_size is not None and draft.vocab_size != V else None)
    if weights is None:  # the configs' own vocabulary: the maps and the head are in the weights
        if other_tokenizer:
            rep.add("error", "E_VOCAB_MAP", f"Draft vocabulary does not match the target: {other_tokenizer}. Pair the "
                                            f"draft with the target it was trained for.")
        return
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
    if other_tokenizer:
        problems.append(other_tokenizer)
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
