"""The doctor's checks: configs + weight headers -> a slot table and findings.

Three parts:

- The codes. Every finding carries a :class:`.codes.Code`, a constant of the one table in :mod:`.codes`
  (``codes.E_FC_WIDTH``: the code, its severity, what it means, why it matters, the fix; docs/doctor.md renders
  it). Emitters pass the constant and never repeat its severity: ``rep.add(codes.E_FC_WIDTH, message, fix=...)``.
- :class:`Finding`: ``message`` says what is wrong, ``fix`` what to change (a config edit, a flag, a command; ""
  when the finding has none). Its :attr:`Finding.text`, ``message`` then ``fix``, is what the CLI prints and the
  JSON's "message" holds; the JSON's "fix" holds the fix alone. :func:`findings_from_json` reads a JSON report's
  findings back into typed ones.
- The rules. :func:`run_checks` runs :data:`RULES` in order on one :class:`Context` (the inputs and what earlier
  rules resolved: the engine's rules, its wiring, the training); each rule is a small function that checks one
  thing and adds its findings to the report. A rule that returns :data:`STOP` ends the wiring rules (no aux
  states, an engine that refuses the target, a wiring the doctor cannot resolve or the engine raises for); the
  :data:`FINAL_RULES` (the vocabulary maps) run always.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Iterable, List, Optional, Union

from .configs import (CONVENTION_TEXT, DoctorInputError, DraftInfo, TargetInfo, accelerate_available,
                      TensorInfo, convention_to_index, load_tensors)
from .engines import (ENGINE_NAMES, IDS_LOCATION, EngineWiring, default_boundaries, describe_boundary,
                      ids_for_boundaries, map_ids, resolve_wiring, short_boundary)
from . import codes, tables
from .codes import Code
from .source_reader import layer_fit
from .rules import TargetRules, draft_class, target_rules

SEVERITIES = codes.SEVERITIES


@dataclasses.dataclass
class Finding:
    """One finding: its code (a :mod:`.codes` constant; a code's string is looked up in the table), the code's
    severity (checked against the table), what is wrong (``message``) and what to change (``fix``, "" when the
    finding gives no instruction). Emitters call :meth:`Report.add`, which takes the severity from the code."""
    code: Code
    severity: str
    message: str
    fix: str = ""

    def __post_init__(self):
        self.code = codes.check(self.severity, self.code)  # in the table, with its severity

    @property
    def text(self) -> str:
        """The finding in full, as the CLI prints it and the JSON's "message" holds it: the message, then the fix."""
        return self.message + (" " + self.fix if self.fix else "")

    def to_json(self) -> dict:
        """The finding as ``doctor --json`` writes it: severity, code, the full text as "message", and the fix."""
        return {"severity": self.severity, "code": self.code.code, "message": self.text, "fix": self.fix}

    @classmethod
    def from_json(cls, item: dict) -> "Finding":
        """:meth:`to_json` read back (:func:`findings_from_json`)."""
        code = codes.get(item.get("code"))
        severity = item.get("severity", code.severity)
        text, fix = str(item.get("message", "")), str(item.get("fix") or "")
        if not fix:
            return cls(code, severity, text)
        if not text.endswith(" " + fix):
            raise ValueError(f"doctor finding {code}: its fix is not the end of its message ({item!r})")
        return cls(code, severity, text[:-len(fix) - 1], fix)


def findings_from_json(items: Iterable[dict]) -> List[Finding]:
    """A JSON report's findings (``report["findings"]``, as :meth:`Report.to_json` and ``doctor --json`` write
    them) back as typed :class:`Finding` objects, so that readers compare codes with the :mod:`.codes` constants
    rather than strings::

        found = findings_from_json(report["findings"])
        skipped = next((f for f in found if f.code is codes.I_REPLAY_SKIPPED), None)
        why = skipped.text if skipped else "..."

    Each finding's ``text`` is the JSON's "message" (the full text), ``fix`` its "fix" and ``message`` the text
    before the fix (the full text for a report written before the "fix" field existed). A code outside the table,
    at another severity than the table's, or a "fix" that is not the end of the "message" raises ValueError (a
    report from another version of the doctor, or edited)."""
    return [Finding.from_json(item) for item in items]


def find_finding(findings: Iterable[Finding], code: Union[Code, str]) -> Optional[Finding]:
    """The first of ``findings`` with ``code`` (a :mod:`.codes` constant; a code outside the table raises
    ValueError rather than finding nothing), else None."""
    code = codes.get(code)
    return next((f for f in findings if f.code is code), None)


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
        """The readings not ruled out."""
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
    """How the draft is (or will be) served, as the doctor's flags give it: engine, TP/PP layout, the trained ids'
    convention and override, capture point, engine-specific options, and what the live check knows."""
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
    """What the doctor found for one target/draft pair: the parsed inputs and options, the engine's wiring and rules,
    the training readings, one dict per fc slot, the findings and, after ``--replay``, its results."""
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
        """Whether no finding is an error (the doctor's exit status is 0 then, 1 otherwise)."""
        return not any(f.severity == "error" for f in self.findings)

    def add(self, code: Code, message: str, fix: str = "") -> Finding:
        """Add a finding: ``code`` a :mod:`.codes` constant (its severity is the table's), ``message`` what is
        wrong, ``fix`` what to change ("" for none)."""
        if not isinstance(code, Code):
            raise TypeError(f"Report.add takes a codes.Code constant (codes.{code}), not {type(code).__name__} "
                            f"{code!r}; its severity comes from the table")
        finding = Finding(code, code.severity, message, fix)
        self.findings.append(finding)
        return finding

    def has(self, code: Code) -> bool:
        """Whether a finding with ``code`` (a :mod:`.codes` constant) is in the report."""
        return self.find(code) is not None

    def find(self, code: Code) -> Optional[Finding]:
        """The first finding with ``code`` (a :mod:`.codes` constant), else None."""
        return find_finding(self.findings, code)

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
        """The report as ``doctor --json`` prints it: conclusion, slots, findings, ok, the target, draft, engine and
        training summaries, and the replay results when there are any."""
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
    """What the draft was trained on: the ids from ``--trained-ids`` or the draft config (none: the default boundaries,
    assumed), read in the given convention or in every way its dialect's trainers read them."""
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


@dataclasses.dataclass
class Context:
    """What the rules read: the inputs, and what earlier rules resolved (the fc's width, the engine's rules, the
    wiring and the training), with the report they add findings to."""
    rep: Report
    target: TargetInfo
    draft: DraftInfo
    weights: Optional[Dict[str, TensorInfo]]   # None: the draft's configs only (NEEDS_WEIGHTS not checked)
    opts: Options
    fc_in: Optional[int] = None                # fc.weight's input width (None without weights)
    fc_slots: Optional[int] = None             # fc_in // hidden_size (None: no weights, or not a multiple)
    rules: Optional[TargetRules] = None        # the engine's rules for the target (_engine_rules)
    wiring: Optional[EngineWiring] = None      # what the engine feeds each slot (_resolve_wiring)
    training: Optional[Training] = None        # what the draft was trained on (_resolve_wiring, _config_ids_vs_fc)
    explained_k: bool = False                  # an error above explains why the fc sees another slot count

    @property
    def eng(self) -> str:
        """The engine's display name (``ENGINE_NAMES``)."""
        return ENGINE_NAMES[self.opts.engine]

    @property
    def L(self) -> int:
        """L, the target's number of decoder layers."""
        return self.target.num_layers

    @property
    def H(self) -> int:
        """The target's hidden size."""
        return self.target.hidden_size


class _Stop:
    """What a rule returns when no wiring rule after it applies (:data:`FINAL_RULES` still run)."""

    def __repr__(self) -> str:
        return "STOP"


STOP = _Stop()
Rule = Callable[[Context], Optional[_Stop]]  # a rule adds its findings to ctx.rep; STOP ends RULES


def run_checks(target: TargetInfo, draft: DraftInfo, weights: Optional[Dict[str, TensorInfo]],
               opts: Options) -> Report:
    """Every check the configs and the draft's weight headers allow; ``weights`` None: a draft folder with its
    configs only (checked before a download of the weights), the checks of :data:`NEEDS_WEIGHTS` named, not run.
    Runs :data:`RULES` in order until one returns :data:`STOP`, then :data:`FINAL_RULES`."""
    ctx = Context(Report(target, draft, opts, None, None, [], []), target, draft, weights, opts)
    for rule in RULES:
        if rule(ctx) is STOP:
            break
    for rule in FINAL_RULES:
        rule(ctx)
    return ctx.rep


# ---- the weights everything else needs, and what was read
def _fc_weight(ctx: Context) -> None:
    """The draft's fc weight: its input width is the slot count every width check compares; a checkpoint without
    a 2-D fc is not an EAGLE-3 draft (DoctorInputError, before any finding)."""
    if ctx.weights is None:
        return
    fc = ctx.weights.get("fc.weight")
    if fc is None:
        raise DoctorInputError(f"draft: no fc weight (fc.weight or model.fc.weight) in {ctx.draft.path}: "
                               f"not an EAGLE-3 draft checkpoint, or an incomplete one")
    if len(fc.shape) != 2:
        raise DoctorInputError(f"draft: fc.weight must be 2-D, found shape {list(fc.shape)}")
    ctx.fc_in = fc.shape[1]
    ctx.fc_slots = ctx.rep.fc_slots = ctx.fc_in // ctx.H if ctx.fc_in % ctx.H == 0 else None


def _configs_read(ctx: Context) -> None:
    """I_CONFIG: the configs as read, and by which library (what every other finding rests on)."""
    target = ctx.target
    ctx.rep.add(codes.I_CONFIG, f"Draft config: {ctx.draft.describe()}. Target: {target.describe()}"
                + (f", read by {target.lib.reader}" if target.lib is not None and target.lib.obj is not None else "")
                + ".")


def _no_weights(ctx: Context) -> None:
    """W_NO_WEIGHTS: a draft folder without weight files; the checks that need them are named, not run."""
    if ctx.weights is None:
        ctx.rep.add(codes.W_NO_WEIGHTS,
                    f"No weight files in {ctx.draft.path}: the configs alone were checked. Not checked without the "
                    f"weights: " + "; ".join(NEEDS_WEIGHTS) + ".",
                    "Download the weights (or pass the folder that has them) to run these.")


def _config_assumed(ctx: Context) -> None:
    """W_CONFIG_ASSUMED: neither transformers nor SGLang read the target config; its sizes are taken as Llama's."""
    lib = ctx.target.lib
    if lib is not None and lib.assumed:
        ctx.rep.add(codes.W_CONFIG_ASSUMED,
                    f"The target config was read by the doctor's own parsing ({lib.reader}): it assumes "
                    f"num_hidden_layers / hidden_size / vocab_size mean what they mean for Llama, with no defaults "
                    f"or aliases applied.", "Check them against the model's own config class.")


def _engine_rules(ctx: Context) -> None:
    """I_ENGINE_CODE: the engine's rules for the target's class, and where they came from (installed code or the
    pinned table); every engine rule below reads them."""
    ctx.rules = ctx.rep.rules = rules = target_rules(ctx.opts.engine, ctx.target, ctx.opts.engine_code)
    ctx.rep.add(codes.I_ENGINE_CODE,
                f"{ctx.eng} rules from {rules.source}: architectures {ctx.target.architectures or '[]'} -> "
                f"{rules.class_name or rules.arch or 'no class'}.")


# ---- whether there is a wiring to check
def _no_aux(ctx: Context) -> Optional[_Stop]:
    """I_NO_AUX: a draft that reads only the target's last hidden state has no layer wiring: STOP."""
    if ctx.draft.use_aux_hidden_state:
        return None
    ctx.rep.add(codes.I_NO_AUX, "eagle_config.use_aux_hidden_state is false: engines feed this draft the target's "
                                "last hidden state only; no layer wiring to check.")
    return STOP


def _target_unsupported(ctx: Context) -> Optional[_Stop]:
    """E_TARGET_UNSUPPORTED: the engine refuses EAGLE-3 for the target's class, so no wiring can help: STOP (no
    slot table and no layer verdict, only the refusal)."""
    rules = ctx.rules
    if rules.supported is not False:
        return None
    ctx.rep.add(codes.E_TARGET_UNSUPPORTED,
                f"{ctx.eng} {rules.version} will refuse to start EAGLE-3 with this target: {rules.refusal}.",
                f"No wiring can fix that; serve the draft with an engine that captures for "
                f"{_target_class_name(rules, ctx.target)}" + _supported_elsewhere(ctx.target, ctx.opts.engine) + ".")
    return STOP


def _target_support_unverified(ctx: Context) -> None:
    """W_TARGET_SUPPORT_UNVERIFIED: the doctor cannot tell whether the engine serves EAGLE-3 for the class; the
    slot table assumes it does."""
    rules, eng = ctx.rules, ctx.eng
    if rules.supported is None:
        ctx.rep.add(codes.W_TARGET_SUPPORT_UNVERIFIED,
                    f"The doctor cannot tell whether {eng} serves EAGLE-3 for this target: "
                    f"{rules.refusal or 'the ' + eng + ' table has no entry for its class'}. The slot table below "
                    f"assumes it does and that {eng}'s engine-wide rules apply.")


def _resolve_wiring(ctx: Context) -> None:
    """What the engine feeds each slot (its id rule on the draft config's ids) and what the draft was trained on
    (every reading of those ids): the slot rules below compare the two."""
    o = ctx.opts
    ctx.wiring = resolve_wiring(o.engine, ctx.target, ctx.draft, pp=o.pp, pp_partition=o.pp_partition,
                                vllm_runner=o.vllm_runner, trtllm_layers=o.trtllm_layers, rules=ctx.rules)
    ctx.training = resolve_training(ctx.draft, ctx.target, o)
    ctx.rep.wiring, ctx.rep.training = ctx.wiring, ctx.training


def _wiring_unknown(ctx: Context) -> Optional[_Stop]:
    """W_RULE_UNKNOWN: the doctor cannot say which states the engine feeds, so no slot verdict: STOP."""
    if not ctx.wiring.unknown:
        return None
    ctx.rep.add(codes.W_RULE_UNKNOWN,
                f"The doctor cannot say which hidden states {ctx.eng} feeds this draft: {ctx.wiring.unknown}. No slot "
                f"verdict is given.", fix=("Run it where the pinned engine is installed (--engine-code installed)."
                                           if ctx.opts.engine == "sglang" else ""))
    ctx.rep.wiring = None
    return STOP


def _engine_raises(ctx: Context) -> Optional[_Stop]:
    """E_ENGINE_RAISES: the engine's own code raises on these ids; the server does not start: STOP."""
    if not ctx.wiring.error:
        return None
    ctx.rep.add(codes.E_ENGINE_RAISES,
                f"{ctx.eng} raises when it configures these ids for {ctx.rules.arch}: {ctx.wiring.error}. The server "
                f"does not start; no slot is fed.", f"Write ids {ctx.eng} accepts for a {ctx.L}-layer target.")
    return STOP


# ---- how much of the engine's code the doctor saw
def _id_rule_unnamed(ctx: Context) -> None:
    """W_RULE_UNKNOWN: SGLang's id rule for the class could not be named from its code (the table cannot map ids
    for it; the live code may have run it)."""
    rules = ctx.rules
    if rules.engine == "sglang" and rules.rule_key is None:
        ctx.rep.add(codes.W_RULE_UNKNOWN,
                    f"SGLang's id rule for {rules.arch} could not be named from its code"
                    + (" (the doctor ran it on the real config for this report)" if rules._live else
                       "; the table cannot map these ids") + ".")


def _capture_unverified(ctx: Context) -> None:
    """W_CAPTURE_UNVERIFIED: the engine's capture code for the class was not located; which boundaries it captures
    is assumed from the engine-wide behaviour."""
    rules, eng = ctx.rules, ctx.eng
    if not rules.capture_known:
        ctx.rep.add(codes.W_CAPTURE_UNVERIFIED,
                    f"The doctor did not locate {eng}'s capture code for {rules.arch} "
                    f"({rules.evidence.get('decoder_how') or 'no capture site found'}); which boundaries it can "
                    f"capture is assumed from {eng}'s engine-wide behaviour.")


def _capture_value(ctx: Context) -> None:
    """W_CAPTURE_VALUE: the class captures hidden_states without the residual, not what Hugging Face's
    output_hidden_states holds (a draft trained on those reads other values)."""
    rules = ctx.rules
    if rules.entry != "hidden-only" and rules.final_value != "hidden-only":
        return
    holder = rules.evidence.get("holder_class", "").rsplit(".", 1)[-1]
    ctx.rep.add(codes.W_CAPTURE_VALUE,
                f"{ctx.eng} {rules.version}'s {holder} captures hidden_states without the residual "
                f"({rules.entry_code or rules.final_code}; its layer loop carries the residual separately: "
                f"`hidden_states, residual = layer(...)`): each slot holds the previous layer's last branch output "
                f"(the post-feedforward-norm MLP output), not the residual stream Hugging Face's "
                f"output_hidden_states holds. A draft trained through SGLang (SpecForge) saw the same values; one "
                f"trained on Hugging Face hidden states was not.", "Check with --replay on states dumped from SGLang.")


def _engine_default(ctx: Context) -> None:
    """I_ENGINE_DEFAULT: the engine reads no ids from this config and uses its default boundaries, and why."""
    wiring, L = ctx.wiring, ctx.L
    if wiring.ids is None:
        ctx.rep.add(codes.I_ENGINE_DEFAULT,
                    f"{ctx.eng} uses its default boundaries {wiring.config_order} = "
                    f"{', '.join(short_boundary(b, L) for b in wiring.config_order)}, since "
                    f"{wiring.ids_source.split('(', 1)[1].rstrip(')')}.")


# ---- the config's own consistency with the fc weight (K)
def _config_ids_vs_fc(ctx: Context) -> None:
    """E_EMBEDDING_CAPTURE / E_FC_WIDTH: the config lists another number of ids than the fc has slots; one extra
    embedding id is named and dropped from the training for the slot rules below."""
    t_ids, fc_slots, H = ctx.training.ids, ctx.fc_slots, ctx.H
    if fc_slots is None or t_ids is None or len(t_ids) == fc_slots:
        return
    training = ctx.training
    emb_pos = [p for p, b in enumerate(training.boundaries) if b == 0]
    if len(t_ids) == fc_slots + 1 and len(emb_pos) == 1:
        emb_id = t_ids[emb_pos[0]]
        rest = [i for p, i in enumerate(t_ids) if p != emb_pos[0]]
        ctx.rep.add(codes.E_EMBEDDING_CAPTURE,
                    f"The draft config lists {len(t_ids)} ids {t_ids}, including {emb_id} = the token embeddings, "
                    f"but the draft's fc weight takes {ctx.fc_in} = {fc_slots} x {H} inputs: it was trained on "
                    f"{fc_slots} layer outputs, without an embedding capture.",
                    f"Remove {emb_id} (ids {rest}); an embedding slot shifts every other slot and the draft reads "
                    f"garbage.")
        for r in training.readings:
            r.boundaries = [b for p, b in enumerate(r.boundaries) if p != emb_pos[0]]
        ctx.training = ctx.rep.training = Training(rest, training.source + f", without the embedding id {emb_id}",
                                                   training.readings, training.assumed_default)
    else:
        ctx.rep.add(codes.E_FC_WIDTH,
                    f"The draft config lists {len(t_ids)} ids {t_ids} but the fc weight takes {ctx.fc_in} = "
                    f"{fc_slots} x {H} inputs ({fc_slots} slots).",
                    "Config and weights disagree; use the ids the checkpoint was trained with.")
    ctx.explained_k = True


def _target_hidden(ctx: Context) -> None:
    """E_TARGET_HIDDEN: the draft's target_hidden_size is not the target's hidden size (trained for another
    target)."""
    th = ctx.draft.target_hidden_size
    if th is not None and th != ctx.H:
        ctx.rep.add(codes.E_TARGET_HIDDEN,
                    f"The draft's target_hidden_size is {th} but the target's hidden_size is {ctx.H}: this draft was "
                    f"trained for another target model.")


def _fc_not_a_multiple(ctx: Context) -> None:
    """E_FC_WIDTH: the fc's input width is no multiple of the target's hidden size (trained for another target)."""
    if ctx.fc_slots is not None or ctx.fc_in is None:
        return
    th = ctx.draft.target_hidden_size
    ctx.rep.add(codes.E_FC_WIDTH,
                f"The draft's fc weight takes {ctx.fc_in} inputs, which is not a multiple of the target's hidden size "
                f"{ctx.H}: the draft was trained for a target with another hidden size "
                f"({'target_hidden_size ' + str(th) if th else 'unknown'}).", "Pair it with its own target.")
    ctx.explained_k = True


# ---- per-slot capture problems
def _slot_captures(ctx: Context) -> None:
    """E_LAST_LAYER_NOT_CAPTURED / E_PP_NOT_CAPTURED / E_ID_OUT_OF_RANGE: a slot the engine never fills, and why."""
    wiring, L, eng = ctx.wiring, ctx.L, ctx.eng
    for s in wiring.slots:
        if s.captured:
            continue
        idtxt = f"id {s.config_id}" if s.config_id is not None else "the default"
        if s.boundary == L:
            ctx.rep.add(codes.E_LAST_LAYER_NOT_CAPTURED,
                        f"Slot {s.slot}: {idtxt} makes {eng} capture boundary {L} = {describe_boundary(L, L)}. "
                        f"{s.why_not}: this slot stays empty, the draft gets {len(wiring.captured_boundaries)} of "
                        f"{len(wiring.slots)} slots and serving fails or reads garbage.",
                        _suggest_last_layer_fix(wiring.rules, L))
        elif wiring.pp_last_stage is not None and 0 <= s.boundary < wiring.pp_last_stage[0]:
            _pp_not_captured(ctx, s, idtxt)
        else:
            ctx.rep.add(codes.E_ID_OUT_OF_RANGE, f"Slot {s.slot}: {idtxt} -> boundary {s.boundary}: {s.why_not}.",
                        f"{eng} maps ids to boundaries by '{wiring.rule}'; write ids that land on the boundaries the "
                        f"draft was trained on.")


def _pp_not_captured(ctx: Context, s, idtxt: str) -> None:
    """E_PP_NOT_CAPTURED for slot ``s``: with --pp its boundary is computed on a stage that does not capture."""
    opts, wiring, L = ctx.opts, ctx.wiring, ctx.L
    vllm_note = ""
    if opts.engine == "vllm":
        vllm_note = (" (vLLM 0.33.0: the V2 runner relays earlier stages' captures only for llama/qwen2 and "
                     "raises for other models; the V1 runner relays none)")
    ctx.rep.add(codes.E_PP_NOT_CAPTURED,
                f"Slot {s.slot}: {idtxt} -> boundary {s.boundary} ({describe_boundary(s.boundary, L)}). With "
                f"--pp {opts.pp}, {s.why_not}, so it is never captured{vllm_note}.",
                "Serve with a smaller --pp"
                + (f", or set SGLANG_PP_LAYER_PARTITION so that the last stage starts at layer "
                   f"{min(b.boundary for b in wiring.slots if b.boundary >= 0)} or earlier."
                   if opts.engine == "sglang" else "."))


def _pp_unverified(ctx: Context) -> None:
    """W_PP_UNVERIFIED: how TensorRT-LLM forwards captures across pipeline stages is not verified."""
    if ctx.opts.pp > 1 and ctx.opts.engine == "trtllm":
        ctx.rep.add(codes.W_PP_UNVERIFIED,
                    f"--pp {ctx.opts.pp}: the doctor has not verified how TensorRT-LLM forwards EAGLE-3 captures "
                    f"across pipeline stages; check that every rank captures its boundaries.")


def _duplicate_captures(ctx: Context) -> None:
    """E_DUPLICATE_CAPTURE: two ids name the same boundary, which the engine captures once (a slot short)."""
    wiring = ctx.wiring
    if wiring.duplicates:
        ctx.rep.add(codes.E_DUPLICATE_CAPTURE,
                    f"Boundaries {sorted(set(wiring.duplicates))} are named by more than one id ({wiring.ids}); "
                    f"{ctx.eng} captures each boundary once, so the draft gets {len(wiring.slots)} slots instead of "
                    f"{len(wiring.config_order)}.")
    if wiring.duplicates or not all(s.captured for s in wiring.slots):
        ctx.explained_k = True  # the slot count the fc sees is off because of the errors above


def _ids_ignored(ctx: Context) -> None:
    """W_IDS_IGNORED: the engine does not read the ids where the config writes them; its defaults happen to be
    what the draft was trained on, which a retrain can silently change."""
    wiring, training, eng = ctx.wiring, ctx.training, ctx.eng
    if wiring.ignored_ids is None:
        return
    loc, ids = wiring.ignored_ids
    same = all(wiring.captured_boundaries == r.boundaries for r in training.plausible)
    if same and training.plausible:
        ctx.rep.add(codes.W_IDS_IGNORED,
                    f"{eng} does not read {loc} = {ids}; it uses its default boundaries {default_boundaries(ctx.L)}, "
                    f"which happen to be the ones the draft was trained on.",
                    f"Write the ids where {eng} reads them ({IDS_LOCATION[ctx.opts.engine]}) so a later retrain "
                    f"cannot break silently.")


# ---- slot count vs fc (unless an error above explains it)
def _fed_slots_vs_fc(ctx: Context) -> None:
    """E_FC_WIDTH: the engine feeds another number of slots than the fc takes."""
    engine_k, fc_slots, H = len(ctx.wiring.captured_boundaries), ctx.fc_slots, ctx.H
    if fc_slots is not None and engine_k != fc_slots and not ctx.explained_k:
        ctx.rep.add(codes.E_FC_WIDTH,
                    f"{ctx.eng} will feed {engine_k} captured slots ({engine_k} x {H} = {engine_k * H} values per "
                    f"token) but the draft's fc weight takes {ctx.fc_in} = {fc_slots} x {H}.",
                    f"The draft needs exactly {fc_slots} captures.")


def _sglang_fc_size(ctx: Context) -> None:
    """E_FC_WIDTH: SGLang sizes the draft's fc from its config, and that size is not the checkpoint's (loading
    fails with a shape mismatch)."""
    declared_k = _sglang_declared_k(ctx.draft) if ctx.opts.engine == "sglang" else None
    fc_slots = ctx.fc_slots
    if declared_k is not None and fc_slots is not None and declared_k != fc_slots and not ctx.explained_k:
        ctx.rep.add(codes.E_FC_WIDTH,
                    f"SGLang sizes the draft's fc from the config ({declared_k} slots: num_aux_hidden_states, else "
                    f"the number of eagle_config ids, else 3) but the checkpoint's fc.weight takes {fc_slots} slots: "
                    f"loading fails with a shape mismatch.", f"Make the config describe {fc_slots} slots.")


def _vllm_fc_size(ctx: Context) -> None:
    """E_FC_WIDTH: vLLM's EAGLE-3 head sizes the fc from the keys its __init__ reads, and that size is not the
    checkpoint's (loading fails with a shape mismatch)."""
    vllm_k = _vllm_declared_k(ctx.draft, ctx.opts) if ctx.opts.engine == "vllm" else None
    fc_slots, fc_in, H = ctx.fc_slots, ctx.fc_in, ctx.H
    if vllm_k is None or fc_slots is None or vllm_k[0] == fc_slots or ctx.explained_k:
        return
    k, read, head, reads = vllm_k
    where = ("transformer_layer_config (vLLM builds the draft's config from it and copies only the ids, "
             "at the top level)" if ctx.draft.dialect == "speculators" else "the draft's config.json")
    ctx.rep.add(codes.E_FC_WIDTH,
                f"vLLM 0.33.0's {head} sizes the fc from {', else '.join(map(str, reads))} (its __init__, in that "
                f"order): here {read}: {k} slots = {k * H} inputs, but the checkpoint's fc.weight takes {fc_in} = "
                f"{fc_slots} x {H}: loading fails with a shape mismatch ({fc_in} vs {k * H}).",
                f"Add \"num_aux_hidden_states\": {fc_slots} to {where}.")


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


# ---- the wiring itself: engine slot k vs trained slot k, under every reading of the ids
def _slot_table(ctx: Context) -> None:
    """The report's slot table: per slot, what the engine feeds against what the draft was trained on under each
    plausible reading of its ids (no finding)."""
    wiring, training, L = ctx.wiring, ctx.training, ctx.L
    agreed = training.agreed
    n = max([len(wiring.slots)] + [len(r.boundaries) for r in training.readings])
    for k in range(n):
        s = wiring.slots[k] if k < len(wiring.slots) else None
        per = {r.key: (r.boundaries[k] if k < len(r.boundaries) else None) for r in training.plausible}
        tb = agreed[k] if agreed is not None and k < len(agreed) else None
        if tb is None and len(set(per.values())) == 1:
            tb = next(iter(per.values()))
        ctx.rep.slots.append({
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


def _slot_order(ctx: Context) -> None:
    """W_SLOT_ORDER: the engine concatenates its captures in another order than the ids are written."""
    wiring = ctx.wiring
    if not wiring.reordered:
        return
    if ctx.opts.engine == "trtllm":
        why = (f"TensorRT-LLM keeps eagle3_layers_to_capture as a set and concatenates it in ascending id order "
               f"(id -1 first), so with ids {wiring.ids} slot k is not the k-th id")
    else:
        why = (f"the ids {wiring.ids} are not in layer order and {ctx.eng} concatenates captures in layer order, so "
               f"slot k is not the k-th id")
    ctx.rep.add(codes.W_SLOT_ORDER, f"{why[0].upper() + why[1:]}.",
                "If the draft was trained with the ids' order, its slots are permuted; check with --replay.")


def _wiring_verdict(ctx: Context) -> None:
    """The wiring's verdict, from engine slot k against trained slot k under every reading of the ids: one finding
    (or none), from the first case that holds."""
    wiring, training = ctx.wiring, ctx.training
    engine_b = [s.boundary for s in wiring.slots]
    if any(len(r.boundaries) != len(engine_b) for r in training.readings) or \
            not all(s.captured for s in wiring.slots):
        return _readings_only(ctx)
    if not training.plausible:
        return _no_plausible_reading(ctx)
    matching = [r for r in training.plausible if r.boundaries == engine_b]
    if len(matching) == len(training.plausible):
        return _wiring_matches(ctx, engine_b)
    if matching:
        return _training_ambiguous(ctx, engine_b, matching)
    return _wiring_mismatch(ctx)


def _readings_only(ctx: Context) -> None:
    """I_TRAINING_READINGS: slots are missing (the errors above say why); where the readings disagree, what each
    says the draft was trained on."""
    training = ctx.training
    if not training.plausible or (training.agreed is None and len(training.readings) > 1):
        ctx.rep.add(codes.I_TRAINING_READINGS,
                    "What the draft may have been trained on: " + _readings_text(ctx.rep, training, ctx.L) + ".",
                    f"To settle it, {replay_command(ctx.rep)}.")


def _no_plausible_reading(ctx: Context) -> None:
    """E_WIRING_MISMATCH: no reading of the ids is something a trainer could have captured (an edited config)."""
    training = ctx.training
    ctx.rep.add(codes.E_WIRING_MISMATCH,
                f"No reading of the draft config's ids {training.ids} is something a trainer could have captured: "
                + _readings_text(ctx.rep, training, ctx.L) + ".",
                f"The config was likely edited after training: restore the ids the checkpoint was published with, "
                f"or {replay_command(ctx.rep)}.")


def _wiring_matches(ctx: Context, engine_b: List[int]) -> None:
    """W_NO_TRAINING_IDS / I_WIRING_MATCHES: every plausible reading is what the engine feeds (with no ids in the
    config, an assumption: replay to check)."""
    training, eng = ctx.training, ctx.eng
    if training.assumed_default:
        ctx.rep.add(codes.W_NO_TRAINING_IDS,
                    f"The draft config records no layer ids, so the doctor assumes it was trained on the common "
                    f"default boundaries {engine_b}, which is what {eng} feeds. That is an assumption: drafts "
                    f"trained on other layers are published without ids too (a vLLM user reported 1.2% acceptance "
                    f"with the defaults on such a Llama-3.3-70B draft).", f"To check, {replay_command(ctx.rep)}.")
    elif len(training.readings) > 1:
        ctx.rep.add(codes.I_WIRING_MATCHES,
                    f"{eng} feeds {engine_b}, which is what the draft was trained on under every plausible reading "
                    f"of its ids: " + _readings_text(ctx.rep, training, ctx.L) + ".")


def _training_ambiguous(ctx: Context, engine_b: List[int], matching: List[Reading]) -> None:
    """W_TRAINING_AMBIGUOUS: some readings agree with the engine and some do not; the config cannot decide, so
    the doctor does not advise changing the ids (replay settles it)."""
    training, L = ctx.training, ctx.L
    keep = " and ".join(chr(ord("A") + training.readings.index(r)) for r in matching)
    ctx.rep.add(codes.W_TRAINING_AMBIGUOUS,
                f"The draft config cannot tell which hidden states the draft was trained on, and the readings "
                f"disagree about this deployment: {ctx.eng} feeds {engine_b} "
                f"({', '.join(short_boundary(b, L) for b in engine_b)}). " + _readings_text(ctx.rep, training, L)
                + f". Under reading {keep} the deployment is right as configured; do not change the ids on the "
                  f"doctor's word.", f"To settle it, {replay_command(ctx.rep)}.")


def _slot_details(wiring: EngineWiring, trained: List[int], L: int) -> str:
    """The slots that get another boundary than ``trained``, in words."""
    return "; ".join(f"slot {k} gets {short_boundary(s.boundary, L)} but was trained on {short_boundary(b, L)}"
                     for k, (s, b) in enumerate(zip(wiring.slots, trained)) if s.boundary != b)


def _mismatch_fix(ctx: Context):
    """(fix, details) for a wiring no plausible reading matches: ids only from evidence (every reading agrees and
    the doctor passes the ids it names), else why none, else what replay would settle."""
    wiring, training, opts, eng, L = ctx.wiring, ctx.training, ctx.opts, ctx.eng, ctx.L
    agreed = training.agreed
    if agreed is None:
        fix = ("The readings disagree on what the draft was trained on, and none is what the engine feeds: "
               + _readings_text(ctx.rep, training, L) + f". To find out which, {replay_command(ctx.rep)}.")
        return fix, " | ".join(f"reading {chr(ord('A') + training.readings.index(r))}: "
                               f"{_slot_details(wiring, r.boundaries, L)}" for r in training.plausible)
    fix_ids = verified_fix(ctx.rep, agreed)
    if fix_ids is None:
        fix = (f"No ids make {eng} feed exactly {agreed} (in this order) in a configuration the doctor can "
               f"confirm; serve with an engine that can, or retrain the draft on boundaries {eng} captures.")
    elif opts.engine == "sglang" and wiring.rules.rule_key == "id+1-if-first-is-1":
        fix = (f"Set {IDS_LOCATION[opts.engine]} to {fix_ids} (SGLang's deepseek rule adds 1 only when the "
               f"first id is 1).")
    else:
        fix = (f"Set {IDS_LOCATION[opts.engine]} to {fix_ids} ({eng}: boundary = "
               f"{map_ids(wiring.rules, fix_ids, L)[1]}).")
    return fix, _slot_details(wiring, agreed, L)


def _wiring_mismatch(ctx: Context) -> None:
    """E_EMBEDDING_CAPTURE / E_CONVENTION_MISMATCH / E_WIRING_MISMATCH: no plausible reading is what the engine
    feeds; named by its most specific cause, with ids to set only where the evidence agrees."""
    wiring, training, eng = ctx.wiring, ctx.training, ctx.eng
    plausible, agreed = training.plausible, training.agreed
    fix, details = _mismatch_fix(ctx)
    ignored = ""
    if wiring.ignored_ids is not None:
        loc, ids = wiring.ignored_ids
        ignored = f" ({eng} does not read {loc} = {ids}, so it falls back to its default boundaries.)"
    emb = [k for k, s in enumerate(wiring.slots) if s.boundary == 0 and all(r.boundaries[k] != 0 for r in plausible)]
    deltas = {s.boundary - b for r in plausible for s, b in zip(wiring.slots, r.boundaries) if s.boundary != b}
    if emb:
        ctx.rep.add(codes.E_EMBEDDING_CAPTURE,
                    f"Slot {emb[0]} receives the token embeddings, but the draft was not trained on them there "
                    f"({details}).{ignored}", fix)
    elif agreed is not None and len(deltas) == 1 and deltas <= {1, -1} and \
            all(s.boundary != b for s, b in zip(wiring.slots, agreed)):
        d = deltas.pop()
        ctx.rep.add(codes.E_CONVENTION_MISMATCH,
                    f"Every slot is one layer {'later' if d > 0 else 'earlier'} than the draft was trained on under "
                    f"every reading of its ids: {eng} reads them by '{wiring.rule}'.{ignored} {details}.", fix)
    else:
        ctx.rep.add(codes.E_WIRING_MISMATCH,
                    f"{eng} feeds the draft other hidden states than it was trained on: {details}.{ignored}", fix)


def _check_other_vllm_runner(ctx: Context) -> None:
    """W_VLLM_RUNNER: vLLM 0.33.0 reads ids differently per model runner; say what the other one feeds when it
    differs."""
    if ctx.opts.engine != "vllm":
        return
    wiring, opts = ctx.wiring, ctx.opts
    other = "v1" if opts.vllm_runner == "v2" else "v2"
    w = resolve_wiring("vllm", ctx.target, ctx.draft, pp=opts.pp, pp_partition=opts.pp_partition,
                       vllm_runner=other, rules=wiring.rules)
    if w.captured_boundaries == wiring.captured_boundaries:
        return
    how = {"v1": "the V1 runner (VLLM_USE_V2_MODEL_RUNNER=0, and what vLLM falls back to for P-EAGLE parallel "
                 "drafting): gpu_model_runner._get_eagle3_aux_layers_from_config reads the top-level ids, then "
                 "eagle_config's, as given",
           "v2": "the V2 runner (vLLM 0.33.0's default): eagle3_utils.get_eagle3_aux_layers_from_config reads the "
                 "top-level ids only"}[other]
    ok = [r for r in (ctx.training.plausible if ctx.training else []) if r.boundaries == w.captured_boundaries]
    ctx.rep.add(codes.W_VLLM_RUNNER,
                f"This report is for vLLM's {opts.vllm_runner.upper()} runner (--vllm-runner). Under {how}, vLLM "
                f"feeds {w.captured_boundaries} instead ({w.ids_source}), which "
                + ("is what the draft was trained on under some reading" if ok else
                   "matches no reading of what the draft was trained on") + ".",
                f"Write the top-level eagle_aux_hidden_state_layer_ids so both runners agree; rerun with "
                f"--vllm-runner {other} to see that case in full.")


def _norm_before_residual(ctx: Context) -> None:
    """W_NORM_BEFORE_RESIDUAL: draft math SGLang does not support (the draft runs other math than it was trained
    with)."""
    if ctx.opts.engine == "sglang" and ctx.draft.norm_before_residual:
        ctx.rep.add(codes.W_NORM_BEFORE_RESIDUAL,
                    "The draft sets norm_before_residual (vLLM/speculators: the first layer's residual is the normed "
                    "fc output). SGLang 0.5.23's llama_eagle3 always keeps the un-normed fc output as residual, so "
                    "the draft runs with different math than it was trained with.", "Serve it with vLLM or retrain.")


def _check_tp(ctx: Context) -> None:
    """E_TP_PARTIAL_SUM / I_TP_CAPTURE_OK / W_TP_CAPTURE_UNVERIFIED: at TP > 1, whether captures are taken after
    the tensor-parallel all-reduce (before it, each rank feeds its own partial sum)."""
    opts, wiring = ctx.opts, ctx.wiring
    if opts.tp <= 1:
        return
    if opts.capture_point == "before-allreduce":
        ctx.rep.add(codes.E_TP_PARTIAL_SUM,
                    f"--capture-point before-allreduce with --tp {opts.tp}: each rank captures its own partial sum "
                    f"of the layer output (1/{opts.tp} of the attention/MLP contribution plus the residual), not the "
                    f"hidden state the draft was trained on; acceptance drops with no error.",
                    "Move the capture after the tensor-parallel all-reduce (SGLang: capture at the layer boundary "
                    "after stream.complete, as set_eagle3_layers_to_capture does; eagle3_ops: "
                    "fused_add_rmsnorm_capture stores the reduced residual).")
    elif opts.capture_point == "after-allreduce":
        ctx.rep.add(codes.I_TP_CAPTURE_OK,
                    f"--tp {opts.tp}: captures declared to be taken after the all-reduce (--capture-point). The "
                    f"doctor cannot see custom hooks; this relies on that declaration.")
    elif wiring.capture_point == "after-allreduce":
        ctx.rep.add(codes.I_TP_CAPTURE_OK,
                    f"--tp {opts.tp}: {wiring.capture_point_evidence}. Checked: the stock capture path of {ctx.eng} "
                    f"for {wiring.rules.arch}. Not checked: patched engines or custom capture hooks; if you use one, "
                    f"rerun with --capture-point before-allreduce|after-allreduce.")
    else:
        ctx.rep.add(codes.W_TP_CAPTURE_UNVERIFIED,
                    f"--tp {opts.tp}: {wiring.capture_point_evidence}. If captures are taken before the all-reduce, "
                    f"each rank feeds its draft a partial sum.", "Verify, then rerun with --capture-point.")


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
    for _cls, names in _head_names(rows).items():
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


def _check_draft_class(ctx: Context) -> None:
    """E_DRAFT_CLASS / I_DRAFT_CLASS: the draft's ``architectures`` must resolve to one of the engine's EAGLE-3
    heads; the head to name is the one whose load_weights loads the checkpoint's decoder-layer tensors (the engine
    tables record, per head, what its own code loads), never a guess."""
    opts, draft, weights, eng = ctx.opts, ctx.draft, ctx.weights, ctx.eng
    dc = draft_class(opts.engine, draft, opts.engine_code)
    archs = draft.architectures or []
    if not dc.known:
        ctx.rep.add(codes.I_DRAFT_CLASS, f"Draft class not checked for {eng}: {dc.message}.")
        return
    if dc.head is not None:
        if weights is not None:  # without them: the class is one of the heads, whether it loads the layer is unseen
            _check_named_head_fits(ctx.rep, dc, archs, eng, weights)
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
    tensors = _layer_tensors(weights or {})
    fits = _layer_fits(dc.rows, tensors) if tensors else None
    if fits is None:  # nothing to match: name the heads, not one of them
        heads = ", ".join(_head_names(dc.rows)[c][0] for c in _head_names(dc.rows)) or "none"
        why = ("its decoder-layer tensors are in the weights, not here" if weights is None else
               "the checkpoint holds no decoder-layer tensors (layers.N.*) to match them against" if not tensors else
               f"the {eng} table does not record which tensors its heads load")
        ctx.rep.add(codes.E_DRAFT_CLASS, f"{how}.",
                    f"Set \"architectures\" in the draft's config.json to the {eng} EAGLE-3 head whose layer "
                    f"matches the checkpoint's ({heads}); the doctor cannot name it: {why}.")
    elif any(f["fits"] for f in fits.values()):
        _draft_class_rename(ctx, dc, how, tensors, fits)
    else:
        _draft_class_no_head(ctx, dc, how, tensors, fits)


def _draft_class_rename(ctx: Context, dc, how: str, tensors: List[str], fits: Dict[str, dict]) -> None:
    """E_DRAFT_CLASS: a head of the engine loads this draft's layer; name it (and why each other head does not)."""
    eng = ctx.eng
    good = [n for n, f in fits.items() if f["fits"]]
    f = fits[good[0]]
    why_not = []  # why each other head does not fit: tensors it leaves unloaded, else parameters left unfed
    for o, fo in fits.items():
        if o in good:
            continue
        why_not.append(f"{o} does not load {_short(fo['unloaded'], 3)}" if fo["unloaded"] else
                       f"{o} builds {_short(fo['missing'], 3)}, which no tensor of the checkpoint feeds")
    ctx.rep.add(codes.E_DRAFT_CLASS, f"{how}.",
                f"Set \"architectures\" in the draft's config.json to {' or '.join(good)}: "
                + ("it is" if len(good) == 1 else "they are")
                + f" the {eng} {dc.version} EAGLE-3 head{'s' if len(good) > 1 else ''} whose load_weights loads every "
                  f"tensor of this draft's decoder layer (layers.N.{{{_short(tensors, 12)}}}) and feeds every "
                  f"parameter its layer always builds"
                + (f" ({'; '.join(why_not)})" if why_not else "")
                + (f"; {eng} also registers that class as {', '.join(f['names'][1:])}" if len(f["names"]) > 1
                   else "")
                + ".")


def _draft_class_no_head(ctx: Context, dc, how: str, tensors: List[str], fits: Dict[str, dict]) -> None:
    """E_DRAFT_CLASS: no head of the engine loads this draft's layer; say which tensors show it and who serves it
    instead (renaming cannot help)."""
    eng = ctx.eng
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
    others = _other_engines_for_layer(ctx.opts.engine, tensors)
    ctx.rep.add(codes.E_DRAFT_CLASS,
                f"{how}. {eng} {dc.version} serves no EAGLE-3 head with this draft's decoder layer: {detail}."
                + (f" {others}." if others else ""),
                f"Renaming \"architectures\" cannot make {eng} load this layer: serve the draft with an engine that "
                f"has a head for it, or export/retrain it with a layer one of {eng}'s heads loads.")


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
    rep.add(codes.E_DRAFT_CLASS,
            f"The draft's architectures {archs} name {eng}'s EAGLE-3 head {dc.arch}, but the checkpoint's decoder "
            f"layer (layers.N.{{{_short(tensors, 8)}}}) is not that head's: {wrong}. {eng} would load the draft with "
            f"those parameters unset and serve garbage proposals.", fix)


def _check_tied(ctx: Context) -> None:
    """E_TIED_DRAFT_VOCAB / I_TIED_DRAFT / W_TIED_DRAFT: tie_word_embeddings on a draft, and what each engine does
    with its lm_head (a tied head smaller than the target's vocabulary scores the wrong rows)."""
    draft, weights, V = ctx.draft, ctx.weights, ctx.target.vocab_size
    if not draft.tie_word_embeddings or weights is None:  # what the engine does turns on lm_head.weight's presence
        return
    lm = weights.get("lm_head.weight")
    dv = lm.shape[0] if lm is not None and len(lm.shape) == 2 else (draft.draft_vocab_size or draft.vocab_size)
    smaller = V is not None and dv is not None and dv < V
    head = draft_class(ctx.opts.engine, draft, ctx.opts.engine_code).head or {}
    if ctx.opts.engine == "sglang" and head.get("tied_lm_head"):
        _tied_sglang(ctx, head, lm, dv, smaller)
    elif ctx.opts.engine == "vllm" and head:
        _tied_vllm(ctx, head, lm, dv, smaller)
    elif ctx.opts.engine == "trtllm":
        ctx.rep.add(codes.W_TIED_DRAFT,
                    f"The draft sets tie_word_embeddings{_tie_source(draft)} (draft vocabulary {dv}, target {V}); "
                    f"the doctor has not read how TensorRT-LLM's EAGLE-3 draft treats a tied lm_head.",
                    f"SGLang drops the trained lm_head of a tied draft; check that {ctx.eng} loads lm_head.weight "
                    f"({'present' if lm is not None else 'absent'} in the checkpoint).")


def _tie_source(draft: DraftInfo) -> str:
    """Where tie_word_embeddings was set, when not in the draft's config.json (for a finding's text)."""
    return f" ({draft.tie_source})" if draft.tie_source and draft.tie_source != "config.json" else ""


def _tied_sglang(ctx: Context, head: dict, lm: Optional[TensorInfo], dv, smaller: bool) -> None:
    """SGLang's tied head: the target's embedding replaces the draft's, so the trained lm_head is never loaded."""
    V, src = ctx.target.vocab_size, _tie_source(ctx.draft)
    cls = head["class"].rsplit(".", 1)[-1]
    what = (f"SGLang's {cls} ties its lm_head to its embedding (`if self.config.tie_word_embeddings: "
            f"{head['tied_lm_head']}`) and {head.get('set_embed') or 'set_embed'} replaces that embedding with the "
            f"target's: the checkpoint's lm_head.weight is never loaded")
    if not smaller:
        ctx.rep.add(codes.I_TIED_DRAFT,
                    f"The draft sets tie_word_embeddings{src}: {what}; the draft's lm_head is the target's embedding "
                    f"matrix ({V} rows, the same vocabulary). Right only if the draft was trained tied to the "
                    f"target's embedding.")
        return
    fix = ("Set tie_word_embeddings to false in the draft's config.json: SGLang then builds a "
           f"{dv}-row lm_head and loads the trained lm_head.weight." if lm is not None else
           "The checkpoint has no lm_head.weight to load untied: re-export the draft with its trained lm_head "
           "(or retrain untied), then set tie_word_embeddings to false.")
    ctx.rep.add(codes.E_TIED_DRAFT_VOCAB,
                f"The draft sets tie_word_embeddings{src} and predicts {dv} draft tokens, fewer than the target's "
                f"{V}. {what}; the draft scores target tokens 0..{dv - 1} with the target's embedding rows and d2t "
                f"maps those scores to other tokens: its proposals are garbage (no error, acceptance near zero).",
                f"{fix} (vLLM 0.33.0 ignores tie_word_embeddings and loads lm_head.weight, "
                f"{'present' if lm is not None else 'absent'} here.)")


def _tied_vllm(ctx: Context, head: dict, lm: Optional[TensorInfo], dv, smaller: bool) -> None:
    """vLLM's head ignores tie_word_embeddings: it loads the checkpoint's lm_head, else shares the target's."""
    V, src = ctx.target.vocab_size, _tie_source(ctx.draft)
    if head.get("reads_tie_word_embeddings"):
        ctx.rep.add(codes.W_TIED_DRAFT, f"vLLM's {head['class']} reads tie_word_embeddings; the doctor has not "
                                        f"verified what it does with it.")
    elif lm is not None:
        ctx.rep.add(codes.I_TIED_DRAFT,
                    f"The draft sets tie_word_embeddings{src}; vLLM's {head['class']} ignores it (its lm_head has "
                    f"draft_vocab_size rows) and loads the checkpoint's lm_head.weight ({dv} rows).")
    elif smaller and (tables.load("vllm") or {}).get("shares_target_lm_head_without_own"):
        ctx.rep.add(codes.E_TIED_DRAFT_VOCAB,
                    f"The draft sets tie_word_embeddings{src} and has no lm_head.weight; vLLM's {head['class']} "
                    f"ignores the flag and, finding no lm_head in the checkpoint, shares the target's lm_head ({V} "
                    f"rows; spec_decode/eagle/utils.load_eagle_model, has_own_lm_head) while its logits cover {dv} "
                    f"draft tokens mapped by d2t: garbage proposals.", "Export the draft with its trained lm_head.")


def _check_untied_head(ctx: Context) -> None:
    """E_DRAFT_VOCAB_SIZE_MISSING / E_LM_HEAD_REPLACED / E_NO_LM_HEAD: an untied draft's lm_head as the engine
    builds it: one that raises, the target's in place of the trained one, or none loaded (acceptance near zero).
    Rules from the engine table (``untied_lm_head``, vLLM's ``shares_target_lm_head_without_own``)."""
    if ctx.draft.tie_word_embeddings:
        return  # _check_tied
    if ctx.opts.engine == "sglang":
        _untied_sglang(ctx)
    elif ctx.opts.engine == "vllm" and ctx.weights is not None and ctx.weights.get("lm_head.weight") is None:
        _untied_vllm(ctx)


def _untied_sglang(ctx: Context) -> None:
    """SGLang's untied head: draft_vocab_size sizes it (missing: it raises), null gives it the target's head, and a
    checkpoint without lm_head.weight leaves it uninitialised."""
    # SGLang's heads build their own lm_head (draft_vocab_size rows, allocated uninitialised) unless draft_vocab_size
    # is None, when the worker gives them the target's; their load_weights loads the tensors present and nothing
    # notices one missing.
    draft, weights, V = ctx.draft, ctx.weights, ctx.target.vocab_size
    dc = draft_class("sglang", draft, ctx.opts.engine_code)
    rule = (dc.head or {}).get("untied_lm_head")
    if not rule or rule.get("shares_when") != "draft_vocab_size is None":
        return
    raw = draft.config if isinstance(draft.config, dict) else {}
    d2t = weights is not None and "d2t" in weights
    lm = None if weights is None else weights.get("lm_head.weight")
    dv = draft.draft_vocab_size
    cls = dc.head["class"].rsplit(".", 1)[-1]
    rows = lm.shape[0] if lm is not None and len(lm.shape) == 2 else None
    if "draft_vocab_size" not in raw and rule.get("reads_draft_vocab_size") == "attribute":
        ctx.rep.add(codes.E_DRAFT_VOCAB_SIZE_MISSING,
                    f"The draft's config.json has no draft_vocab_size and is untied: SGLang's {cls} reads "
                    f"config.draft_vocab_size to size its lm_head, so the server fails at start-up "
                    f"(AttributeError).",
                    f"Set \"draft_vocab_size\": {rows} (the rows of the checkpoint's lm_head.weight)." if rows else
                    "Set it to the number of tokens the draft predicts (the rows of its lm_head.weight)"
                    + (", or null to share the target's lm_head (only for a draft trained with it)." if not d2t
                       else "."))
    elif weights is None:
        return
    elif dv is None:  # load_lm_head_from_target: the worker replaces the head with the target's
        if lm is not None and (rows != V or d2t):
            ctx.rep.add(codes.E_LM_HEAD_REPLACED,
                        f"The draft's draft_vocab_size is null and it is untied: SGLang's {cls} then sets "
                        f"load_lm_head_from_target and {rule.get('worker') or 'its EAGLE-3 worker'} gives it the "
                        f"target's lm_head ({V} rows) in place of the checkpoint's trained lm_head.weight ({rows} "
                        f"rows{', mapped by d2t' if d2t else ''}): its proposals are scored by the wrong head (no "
                        f"error, acceptance near zero).", f"Set \"draft_vocab_size\": {rows}.")
    elif lm is None:
        keep = ("re-export the draft with its trained lm_head.weight" +
                ("" if d2t else "; or, if it was trained with the target's own lm_head (all "
                                f"{V} tokens, no d2t), set \"draft_vocab_size\": null so that SGLang shares it"))
        ctx.rep.add(codes.E_NO_LM_HEAD,
                    f"The checkpoint has no lm_head.weight, the draft is untied and sets draft_vocab_size {dv}: "
                    f"SGLang's {cls} builds its own {dv}-row lm_head (ParallelLMHead, allocated uninitialised), "
                    f"shares the target's only when draft_vocab_size is None ({rule.get('worker') or 'its worker'}: "
                    f"set_embed, not set_embed_and_head), and its load_weights loads the tensors present without "
                    f"noticing one missing: the head stays uninitialised memory, and the server starts and accepts "
                    f"next to nothing.", f"Fix: {keep}.")


def _untied_vllm(ctx: Context) -> None:
    """vLLM without the checkpoint's lm_head.weight shares the target's, over a smaller (d2t-mapped) vocabulary."""
    # vLLM shares the target's head when the checkpoint has none (spec_decode/eagle/utils.load_eagle_model)
    if not (tables.load("vllm") or {}).get("shares_target_lm_head_without_own"):
        return
    V, dv = ctx.target.vocab_size, ctx.draft.draft_vocab_size
    smaller = dv is not None and V is not None and dv < V
    if smaller or "d2t" in ctx.weights:
        ctx.rep.add(codes.E_NO_LM_HEAD,
                    f"The checkpoint has no lm_head.weight: vLLM 0.33.0 then shares the target's lm_head ({V} rows; "
                    f"spec_decode/eagle/utils.load_eagle_model, has_own_lm_head) while the draft's logits cover "
                    f"{dv or 'its'} draft tokens mapped by d2t: garbage proposals.",
                    "Re-export the draft with its trained lm_head.weight.")


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


def _check_context(ctx: Context) -> None:
    """W_DRAFT_CONTEXT_SHORT: a draft trained on a shorter context than the target serves: the engine refuses to
    start or stretches the draft's positions, and past its length acceptance falls."""
    # SGLang 0.5.23 refuses to start (the draft's ModelConfig gets the target's context_len, eagle_worker_v2;
    # model_config._derive_context_length raises unless SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1, which raises
    # the draft's max_position_embeddings); vLLM 0.33.0 raises the draft's max_position_embeddings to the target's
    # with an INFO line (speculative.py, _maybe_override_draft_max_position_embeddings) for default/linear/llama3 RoPE.
    opts = ctx.opts
    lengths = _context_lengths(ctx.target, ctx.draft, opts)
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
        ctx.rep.add(codes.W_DRAFT_CONTEXT_SHORT,
                    f"The server serves {t_len} tokens of context, the draft's context length is {d_len} ({how}): "
                    f"SGLang started it with SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN, raising the draft's "
                    f"max_position_embeddings, but {past}.",
                    f"Serve with --context-length {d_len} (or less), or use a draft trained on the target's length.")
    elif opts.engine == "sglang":
        _context_sglang(ctx, t_len, d_len, exact, how, past)
    elif opts.engine == "vllm":
        ctx.rep.add(codes.W_DRAFT_CONTEXT_SHORT,
                    f"The draft's context length is {d_len}, the target's {t_len} ({how}). vLLM 0.33.0 starts "
                    f"anyway: for default/linear/llama3 RoPE it raises the draft's max_position_embeddings to the "
                    f"target's with an INFO line (config/speculative.py, _maybe_override_draft_max_position_embeddings)"
                    f"; for other RoPE types the V2 runner lowers the target's max_model_len to {d_len} "
                    f"(_limit_max_model_len_to_draft). Either way {past}.",
                    f"Serve with --max-model-len {d_len} (or less), or use a draft trained on the target's length.")


def _context_sglang(ctx: Context, t_len: int, d_len: int, exact: bool, how: str, past: str) -> None:
    """W_DRAFT_CONTEXT_SHORT for SGLang, which refuses to start without its override (a warning: SGLang says it at
    start-up, the cost is speed)."""
    ctx.rep.add(codes.W_DRAFT_CONTEXT_SHORT,
                f"The draft's context length is {d_len}, the target's {t_len} ({how}). "
                f"SGLang {_sglang_version() + ' ' if exact else ''}"
                f"gives the draft the target's context length and "
                + ("refuses to start" if exact else "then refuses to start if this holds with the factor applied")
                + f" (ValueError: Target model's context_length ({t_len}) is greater than the derived context_length "
                  f"({d_len}) ... set the env var SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1); with that variable "
                  f"it raises the draft's max_position_embeddings to {t_len} and starts, but {past}.",
                f"Serve with --context-length {d_len} (or less), or use a draft trained on the target's length; set "
                f"the variable only for prompts and outputs that stay within {d_len} tokens.")


def _check_embed_scale(ctx: Context) -> None:
    """W_EMBED_SCALE: the target scales its embeddings (its boundary 0 is scaled) and the engine's draft head
    does not scale the draft's: its embedding input differs from the target's."""
    rules, opts = ctx.rules, ctx.opts
    if not rules.scaled_embedding:
        return
    dc = draft_class(opts.engine, ctx.draft, opts.engine_code)
    if dc.head is not None and dc.head.get("scaled_embedding"):
        return
    holder = rules.evidence.get("holder_class", "").rsplit(".", 1)[-1] or rules.arch
    ctx.rep.add(codes.W_EMBED_SCALE,
                f"The target scales its token embeddings ({holder}: `{rules.scaled_embedding}`), and its boundary-0 "
                f"capture is the scaled embedding; {rules.name}'s draft head {dc.arch or 'class'} embeds the draft's "
                f"tokens "
                f"with the target's embedding weights (set_embed) and applies no scale, so its embedding input is "
                f"1/sqrt(hidden_size) of the target's. Right only if the draft was trained with the same unscaled "
                f"embeddings; a draft trained on scaled embeddings reads inputs sqrt(hidden_size) times too small.")


def _check_vocab(ctx: Context) -> None:
    """E_VOCAB_MAP: the draft's vocabulary (its config, lm_head, embedding, d2t / t2d) against the target's: a map
    built for another tokenizer sends draft ids to the wrong target tokens. Runs for every report (FINAL_RULES)."""
    rep, target, draft, weights = ctx.rep, ctx.target, ctx.draft, ctx.weights
    V = target.vocab_size
    other_tokenizer = (f"the draft's vocab_size is {draft.vocab_size} but the target's is {V} (the draft shares the "
                       f"target's embedding and token ids; a different tokenizer cannot work)"
                       if V is not None and draft.vocab_size is not None and draft.vocab_size != V else None)
    if weights is None:  # the configs' own vocabulary: the maps and the head are in the weights
        if other_tokenizer:
            rep.add(codes.E_VOCAB_MAP, f"Draft vocabulary does not match the target: {other_tokenizer}.",
                    "Pair the draft with the target it was trained for.")
        return
    lm = weights.get("lm_head.weight")
    problems = []
    draft_vocab = lm.shape[0] if lm is not None and len(lm.shape) == 2 else draft.draft_vocab_size
    if draft.draft_vocab_size is not None and lm is not None and lm.shape[0] != draft.draft_vocab_size:
        problems.append(f"lm_head.weight has {lm.shape[0]} rows but draft_vocab_size is {draft.draft_vocab_size}")
    if V is None:
        if problems:
            rep.add(codes.E_VOCAB_MAP, "; ".join(problems) + ".")
        return
    if other_tokenizer:
        problems.append(other_tokenizer)
    emb = weights.get("embed_tokens.weight")
    if emb is not None and emb.shape[0] != V:
        problems.append(f"embed_tokens.weight has {emb.shape[0]} rows but the target vocab has {V}")
    if weights.get("d2t") is None:
        if draft_vocab is not None and draft_vocab != V:
            problems.append(f"the draft predicts {draft_vocab} tokens (lm_head rows) but has no d2t map to the "
                            f"target's {V} tokens: its draft ids would be read as target ids")
    else:
        problems += _map_problems(weights, draft_vocab, V)
    if problems:
        rep.add(codes.E_VOCAB_MAP, "Draft vocabulary does not match the target: " + "; ".join(problems) + ".",
                "Rebuild the maps from this target's tokenizer (SpecForge: the vocab-mapping step) or pair the "
                "draft with the target it was trained for.")


def _map_problems(weights: Dict[str, TensorInfo], draft_vocab: Optional[int], V: int) -> List[str]:
    """What is wrong with the d2t (and t2d) maps for a target vocabulary of ``V`` tokens, in words."""
    d2t_i = weights["d2t"]
    tens = load_tensors(rep_weights_subset(weights, ["d2t", "t2d"]), ["d2t", "t2d"])
    d2t = tens.get("d2t")
    if d2t is None or d2t.dim() != 1 or d2t.is_floating_point():
        return [f"d2t must be a 1-D integer tensor, found {d2t_i.dtype} {list(d2t_i.shape)}"]
    import torch

    problems = []
    if draft_vocab is not None and d2t.numel() != draft_vocab:
        problems.append(f"d2t has {d2t.numel()} entries but the draft predicts {draft_vocab} tokens")
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
    return problems


def rep_weights_subset(weights: Dict[str, TensorInfo], names) -> Dict[str, TensorInfo]:
    """The entries of ``weights`` named in ``names`` that it holds (missing names are left out)."""
    return {n: weights[n] for n in names if n in weights}


# ---- the rules, in the order they run (the findings keep this order)
RULES: List[Rule] = [
    _fc_weight, _configs_read, _no_weights, _config_assumed, _engine_rules,
    _check_draft_class, _check_tied, _check_untied_head, _check_context,
    _no_aux, _target_unsupported, _target_support_unverified,                 # STOP: no wiring to check
    _resolve_wiring, _wiring_unknown, _engine_raises,                         # STOP: no wiring resolved
    _id_rule_unnamed, _capture_unverified, _capture_value, _check_embed_scale, _engine_default,
    _config_ids_vs_fc, _target_hidden, _fc_not_a_multiple,
    _slot_captures, _pp_unverified, _duplicate_captures, _ids_ignored,
    _fed_slots_vs_fc, _sglang_fc_size, _vllm_fc_size,
    _slot_table, _slot_order, _wiring_verdict, _check_other_vllm_runner,
    _norm_before_residual, _check_tp,
]
FINAL_RULES: List[Rule] = [_check_vocab]  # after RULES, also when one of them returned STOP
