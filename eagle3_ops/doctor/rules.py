"""What an engine does with one target: resolved from the installed engine or from its pinned table.

``target_rules(engine, target)`` returns a :class:`TargetRules` that says which class the engine serves
the target with, whether it can serve EAGLE-3 for it at all (and the error it raises if not), how it turns
the draft's ids into boundaries, which boundaries it can capture and where, and what it captures there.

SGLang: the installed package when it is the pinned version (its own ``set_eagle3_layers_to_capture`` runs
on a stand-in with the target's real config, see :mod:`.sglang_code`), else ``tables/sglang-<pinned>.json``,
and the source is said. vLLM 0.33.0: ``tables/vllm-0.33.0.json`` (generated from the wheel; vLLM is never
imported). TensorRT-LLM: ``tables/trtllm-1.2.1.json`` where present; its engine-wide rules below.
"""
from __future__ import annotations

import dataclasses
import os
import re
from typing import Callable, Dict, List, Optional, Tuple

from . import tables

ENGINE_NAMES = {"sglang": "SGLang", "vllm": "vLLM", "trtllm": "TensorRT-LLM"}
ENGINE_CODE_CHOICES = ("auto", "installed", "table")


@dataclasses.dataclass
class Mapped:
    """What an engine does with a list of ids (or None: its default) for a target with L layers."""
    config_order: List[int]        # the boundary each id names, in the order the ids are written
    error: Optional[str] = None    # what the engine raises at start-up, if anything
    rule: str = ""                 # in words
    unknown: Optional[str] = None  # the source cannot say what the engine does (why)


@dataclasses.dataclass
class TargetRules:
    """What one engine does with one target: the class it serves it with, whether it serves EAGLE-3, how ids map to
    boundaries, where and what it captures, and the evidence; from the installed engine or its table."""
    engine: str
    version: str
    source: str                    # where these rules come from, in words
    arch: str                      # the architecture the engine resolved
    class_name: str                # qualified class name
    supported: Optional[bool]      # None: the source cannot tell
    refusal: str = ""              # what the engine says when it refuses
    rule_key: Optional[str] = None
    rule_text: str = "unknown"
    default: Optional[List[str]] = None      # default boundaries as formulas of L
    entry: Optional[str] = None    # captured at layer i's entry: layer-boundary | hidden+residual | hidden-only
    entry_code: Optional[str] = None
    final: Optional[str] = None    # boundary L: final-norm | after-loop | end (vLLM) | None (never)
    final_value: Optional[str] = None
    final_code: Optional[str] = None
    pp_last_rank_only: bool = True
    pp_relay: bool = False
    # the order the draft's slots get the captures in: "layer" (ascending boundary: SGLang, vLLM's own decoders'
    # tuple(sorted(set(layers)))), "written" (the ids' order: vLLM's Transformers backend records per id)
    capture_order: str = "layer"
    flags: bool = False            # SGLang: per-layer flags (self.layers[b]): b >= L raises, b < 0 wraps
    raises_at_zero: Optional[str] = None     # vLLM: boundary 0 raises (residual still None)
    scaled_embedding: Optional[str] = None
    capture_known: bool = True
    evidence: Dict[str, str] = dataclasses.field(default_factory=dict)
    _live: Optional[Callable] = None

    @property
    def name(self) -> str:
        """The engine's display name (``ENGINE_NAMES``)."""
        return ENGINE_NAMES[self.engine]

    def map_ids(self, ids: Optional[List[int]], L: int) -> Mapped:
        """What the engine does with ``ids`` (None: its default) for a target of ``L`` layers: SGLang's own code run
        live where it can be, else the table's rule."""
        if self._live is not None:
            return self._live(ids, L)
        return _table_map(self, ids, L)

    def last_capturable(self, L: int) -> int:
        """The highest boundary the engine can capture: L when it captures the last layer's output, else L - 1."""
        return L if self.final else L - 1

    def capturable(self, b: int, L: int) -> bool:
        """Whether the engine can capture boundary ``b`` of a target with ``L`` layers at all."""
        if self.engine == "trtllm":
            return 1 <= b <= L + 1
        if self.engine == "vllm":
            return 0 <= b <= L
        return 0 <= b < L or (b == L and self.final is not None)


def eval_formulas(formulas: List[str], L: int) -> List[int]:
    """The engine's default boundaries for ``L`` layers from the table's formulas (``"2"``, ``"L//2"``, ``"L-3"``)."""
    from .sglang_code import eval_default

    return eval_default(formulas, L)


def _table_map(r: TargetRules, ids, L) -> Mapped:
    from .sglang_code import ID_RULES

    if ids is None:
        if r.default is None:
            return Mapped([], None, "engine default",
                          unknown=f"{r.name}'s default ids for {r.arch} are not in its table")
        return Mapped(eval_formulas(r.default, L), None, "engine default")
    if r.engine == "vllm":
        return Mapped(list(ids), None, "id")
    if r.engine == "trtllm":
        return Mapped([L + 1 if i == -1 else i + 1 for i in ids], None,
                      "id + 1 (-1 = the final state after the last norm)")
    if r.rule_key not in ID_RULES:
        return Mapped([], None, "unknown", unknown=f"SGLang's id rule for {r.arch} is not in the table")
    fn, text = ID_RULES[r.rule_key]
    b = fn(list(ids), L)
    detail = text
    if r.rule_key == "id+1-if-first-is-1":
        detail = "id + 1 (first id is 1)" if ids and ids[0] == 1 else "id (first id is not 1)"
    elif r.rule_key == "id-if-max-is-L":
        detail = f"id (largest id is {L})" if ids and max(ids) == L else "id + 1"
    err = None
    if r.flags:
        bad = [x for x in b if x >= L or x < -L]
        if bad:
            err = (f"IndexError: list index out of range ({r.evidence.get('holder_class', 'the model')}."
                   f"set_eagle3_layers_to_capture flags self.layers[{bad[0]}], which does not exist)")
        b = [x % L if -L <= x < 0 else x for x in b]
    return Mapped(b, err, detail)


# ------------------------------------------------------------------------------------------- SGLang
def sglang_mode(engine_code: str = "auto") -> Tuple[bool, str]:
    """(run the installed SGLang's code now, why). ``engine_code``: auto | installed | table."""
    source, why = sglang_source(engine_code)
    return source == "live", why


def kept_table(engine_code: str = "auto") -> Optional[dict]:
    """With ``auto`` and the pinned SGLang installed: the table an earlier run derived from it (engine_cache)."""
    if engine_code != "auto":
        return None
    from . import engine_cache, sglang_code

    if sglang_code.installed_version() != tables.PINNED["sglang"]:
        return None
    return engine_cache.table()


def sglang_source(engine_code: str = "auto") -> Tuple[str, str]:
    """Where SGLang's rules come from, and why: ``live`` (its code runs now), ``kept`` (what its code said in an
    earlier run, :func:`kept_table`; the configs are read as its parser read them then) or ``table`` (the pinned
    table, SGLang's parser not used)."""
    from . import sglang_code

    v = sglang_code.installed_version()
    pinned = tables.PINNED["sglang"]
    if engine_code == "table":
        return "table", f"pinned table tables/sglang-{pinned}.json (--engine-code table)"
    if v == pinned:
        if kept_table(engine_code) is not None:
            from . import engine_cache

            return "kept", (f"the installed SGLang {v}'s own code, run by an earlier check and kept in "
                            f"{engine_code_path(engine_cache.table_path())}")
        return "live", f"the installed SGLang {v} (its own code ran)"
    if engine_code == "installed":
        if v is None:
            raise_input(f"--engine-code installed: SGLang is not installed (pinned: {pinned})")
        return "live", f"the installed SGLang {v} (its own code ran; NOT the pinned {pinned}: --engine-code installed)"
    why = "SGLang is not installed" if v is None else f"the installed SGLang is {v}, not the pinned {pinned}"
    return "table", f"pinned table tables/sglang-{pinned}.json ({why})"


def engine_code_path(p) -> str:
    """A kept file's path as said in a report: ``~`` for the home folder."""
    home = os.path.expanduser("~")
    s = str(p)
    return "~" + s[len(home):] if home and home != "/" and s.startswith(home + os.sep) else s


def raise_input(msg: str):
    """Raises ``configs.DoctorInputError(msg)``: bad usage or input, which the CLI prints as one line with exit status
    2."""
    from .configs import DoctorInputError

    raise DoctorInputError(msg)


def _from_row(engine: str, version: str, source: str, arch: str, row: dict) -> TargetRules:
    from .sglang_code import ID_RULES

    cap = row.get("capture") or {}
    r = TargetRules(engine=engine, version=version, source=source, arch=arch, class_name=row.get("class", arch),
                    supported=row.get("supported"), refusal=row.get("reason", ""))
    if engine == "sglang" and r.supported:
        r.rule_key = row.get("id_rule")
        r.rule_text = ID_RULES[r.rule_key][1] if r.rule_key in ID_RULES else "unknown"
        r.default = row.get("default")
        r.entry, r.entry_code = cap.get("entry"), cap.get("entry_code")
        r.final, r.final_value, r.final_code = cap.get("final"), cap.get("final_value"), cap.get("final_code")
        r.pp_last_rank_only = bool(row.get("pp_last_rank_only", True))
        r.flags = bool(row.get("uses_layer_flags"))
        r.scaled_embedding = cap.get("scaled_embedding")
        r.capture_known = r.entry is not None
        r.evidence = {"ids_method": row.get("ran") or row.get("ids_method", ""),
                      "holder_class": row.get("holder_class") or "",
                      "holder": row.get("holder") or ""}
    return r


def _sglang_live(target, arch: str, cls) -> TargetRules:
    from . import sglang_code

    v = sglang_code.installed_version()
    row = sglang_code.describe_class(arch, cls)
    r = _from_row("sglang", v, f"the installed SGLang {v} (its own code ran)", arch, row)
    if not r.supported:
        return r
    config = target.lib.obj if target.lib is not None and target.lib.obj is not None else \
        sglang_code.RecordingConfig(target.num_layers)

    probes: Dict[Tuple, dict] = {}  # one run of SGLang's code per id list (fixes search many lists)

    def live(ids, L):
        from .sglang_code import ID_RULES

        key = (None if ids is None else tuple(ids), L)
        if key not in probes:
            probes[key] = sglang_code.probe(cls, config, ids, L)
        res = probes[key]
        ltc = res["layers_to_capture"]
        if res["error"] is not None:
            return Mapped(ltc or [], f"{res['error']} (raised by {res['ran']} when SGLang configures the "
                                     f"capture at start-up)", r.rule_text)
        if ltc is None:
            return Mapped([], None, r.rule_text, unknown=f"{res['ran']} set no layers_to_capture on the stand-in")
        if res["flags"]:  # flagged layers are what the forward reads; a negative id wraps to self.layers[b]
            ltc = [x % L if -L <= x < 0 else x for x in ltc]
        if ids is None:
            return Mapped(ltc, None, "engine default")
        detail = _table_map(r, ids, L).rule if r.rule_key in ID_RULES else "as SGLang's own code maps them"
        return Mapped(ltc, None, detail)

    r._live = live
    return r


def _sglang_table(arch_list: List[str], source: str, table: Optional[dict] = None) -> TargetRules:
    t = table if table is not None else tables.load("sglang")
    if t is None:
        return TargetRules("sglang", tables.PINNED["sglang"], source, "", "", None,
                           refusal="the SGLang table is missing from this installation")
    rows = t["targets"]
    hit = next((a for a in arch_list if a in rows), None)
    if hit is None:
        names = ", ".join(arch_list) or "none"
        return TargetRules("sglang", t["version"], source, "TransformersForCausalLM", "TransformersForCausalLM",
                           False, refusal=(f"none of the architectures ({names}) is an SGLang {t['version']} model "
                                           f"class: SGLang falls back to its Transformers backend, which has no "
                                           f"set_eagle3_layers_to_capture"))
    return _from_row("sglang", t["version"], source, hit, rows[hit])


# --------------------------------------------------------------------------------------------- vLLM
def _vllm_table(target) -> TargetRules:
    t = tables.load("vllm")
    src = f"pinned table tables/vllm-{tables.PINNED['vllm']}.json (generated from the vLLM wheel; vLLM is not imported)"
    # never an empty name in a message: the class resolved, else the architecture the config names
    named = next((a for a in target.architectures if a), None) or "the target (its config.json lists no architectures)"
    if t is None:
        return TargetRules("vllm", tables.PINNED["vllm"], src, named, named, None, refusal="no vLLM table")
    rows = t["targets"]
    hit = next((a for a in target.architectures if a in rows), None)
    fallback = None
    if hit is None:
        # vLLM's ModelRegistry falls back to its Transformers backend for an architecture it does not register,
        # when transformers has the class and it is backend-compatible (which the table cannot tell)
        tf = t.get("transformers_fallback") or {}
        fallback = tf.get("multimodal" if target.nested_key else "text")
        if not target.architectures:
            return TargetRules("vllm", t["version"], src, named, named, None,
                               refusal="the target's config.json lists no architectures: the doctor cannot tell which "
                                       "class vLLM would serve it with")
        if fallback not in rows:
            return TargetRules("vllm", t["version"], src, named, named, None,
                               refusal=(f"none of the architectures ({', '.join(target.architectures)}) is in vLLM "
                                        f"{t['version']}'s model registry, and the table records no Transformers-"
                                        f"backend fallback"))
        moe = tf.get("multimodal_moe" if target.nested_key else "moe")
        reg = t.get("registry") or {}
        refusal = (f"none of the architectures ({', '.join(target.architectures)}) is in vLLM {t['version']}'s model "
                   f"registry (the {len(reg.get('order') or [])} dicts registry.py merges into "
                   f"{reg.get('merged_into', 'its registry')}): "
                   f"{tf.get('resolver', 'the registry')} serves it with the Transformers backend ({fallback}"
                   + (f", or {moe} for a mixture-of-experts model" if moe and moe != fallback else "")
                   + f", named by {tf.get('function', 'ModelConfig')}) only when transformers has the class and it "
                     f"is backend-compatible, else vLLM refuses the model; the doctor cannot check that here")
        row = rows[fallback]
    else:
        row = rows[hit]
    cls = row.get("class") or hit or fallback
    r = TargetRules("vllm", t["version"], src, hit or named, cls, row.get("supported"), refusal=row.get("reason", ""),
                    rule_key="id", rule_text="id (0 = embeddings)")
    if fallback is not None:
        r.supported, r.refusal = (None if row.get("supported") else row.get("supported")), refusal
    if r.supported is False:
        return r
    if not row.get("capture") and "text config's architectures" in (row.get("decoder_how") or ""):
        # the wrapper builds its language model from text_config.architectures at start-up: that class's decoder
        lm = next((a for a in (target.text_config.get("architectures") or []) if a in rows), None)
        if lm is not None and rows[lm].get("capture"):
            inner = rows[lm]
            if inner.get("captured_by") and row.get("set_aux_hidden_state_layers") == "SupportsEagle3":
                # SupportsEagle3's own setter unwraps language_model.model and asserts an EagleModelMixin (vLLM's
                # decoders); a language model that records its captures itself (the Transformers backend) is none
                r.supported = False
                r.refusal = (f"vLLM {t['version']}'s {cls} keeps SupportsEagle3.set_aux_hidden_state_layers, which "
                             f"asserts that its language model's .model is an EagleModelMixin; its text_config."
                             f"architectures = {lm} is served by {inner.get('class')}, which captures in "
                             f"{inner['captured_by'].split(' (')[0]} and is not one: vLLM stops at start-up "
                             f"(AssertionError)")
                return r
            # the language model's capture rules, its own placement and order included (the Transformers backend)
            row = dict(row, capture=inner["capture"], decoder=inner.get("decoder"), pp_relay=inner.get("pp_relay"),
                       decoder_how=f"{row['decoder_how']}: text_config.architectures = {lm}",
                       **{k: inner[k] for k in ("capture_order", "id_lookup", "captured_by") if k in inner})
    m = re.fullmatch(r"\(2, num_layers // 2, num_layers - 3\)", row.get("default") or "")
    r.default = ["2", "L//2", "L-3"] if m else None
    cap = row.get("capture") or []
    kinds = {c["boundary"] for c in cap}
    r.capture_known = bool(kinds) and kinds <= {"start", "entry", "after", "end"}
    r.final = "end" if kinds & {"after", "end"} else None
    r.entry = "hidden+residual"
    r.pp_relay = bool(row.get("pp_relay"))
    r.pp_last_rank_only = not r.pp_relay
    r.capture_order = row.get("capture_order") or "layer"
    if any(c["boundary"] == "entry" and c["value"] == "hidden+residual-unguarded" for c in cap):
        r.raises_at_zero = (f"vLLM {t['version']}'s {row.get('decoder')}.forward captures id 0 as hidden_states + "
                            f"residual while residual is still None: the forward raises a TypeError")
    where = row.get("decoder") or row.get("captured_by") or ""
    lookup = row.get("id_lookup") or {}
    if isinstance(lookup.get("offset"), int) and lookup.get("keys_from"):
        # the class looks each id up (self._layer_names[layer - 1]) in a dict keyed by the layer indices 0..L-1
        # (keys_from): an id whose key is not there raises KeyError when vLLM configures the capture
        off, code = lookup["offset"], lookup.get("code", "")
        who = row.get("captured_by", "set_aux_hidden_state_layers").split(" (")[0]

        def key_error(ids, L, _off=off, _code=code, _who=who):
            bad = [i for i in ids if not 0 <= i - _off < L]
            return (f"KeyError: {bad[0] - _off} (vLLM {t['version']}'s {_who} looks id {bad[0]} up as {_code}; the "
                    f"lookup holds the decoder layers' indices 0..{L - 1}, {lookup['keys_from']})") if bad else None

        def live(ids, L, _r=r):
            mapped = _table_map(dataclasses.replace(_r, _live=None), ids, L)
            err = key_error(ids, L) if ids is not None else None
            return dataclasses.replace(mapped, error=err) if err else mapped

        r._live = live
        if off > 0:
            r.raises_at_zero = (f"vLLM {t['version']}'s {who} looks id 0 up as {code} (layer {0 - off}), which the "
                                f"lookup does not hold (its keys are the decoder layers' indices, "
                                f"{lookup['keys_from']}): KeyError at start-up")
    r.evidence = {"decoder": where, "default_from": row.get("default_from") or "",
                  "decoder_how": row.get("decoder_how", ""), "registry": row.get("registry") or ""}
    return r


# --------------------------------------------------------------------------------------- TensorRT-LLM
def _trtllm(target) -> TargetRules:
    t = tables.load("trtllm")
    src = (f"pinned table tables/trtllm-{tables.PINNED['trtllm']}.json" if t is not None else
           "TensorRT-LLM's engine-wide rules (no per-class table in this installation)")
    r = TargetRules("trtllm", tables.PINNED["trtllm"], src, "", "", None, rule_key="id+1",
                    rule_text="id + 1 (captured after layer id; -1 = the final state after the last norm)",
                    default=["2", "L//2", "L-3"], final="post-norm", entry="hidden+residual")
    if t is not None:
        rows = t.get("targets", {})
        hit = next((a for a in target.architectures if a in rows), None)
        if hit is not None:
            r.arch, r.class_name = hit, rows[hit].get("class", hit)
            r.supported, r.refusal = rows[hit].get("supported"), rows[hit].get("reason", "")
        else:
            r.refusal = (f"none of the architectures ({', '.join(target.architectures) or 'none'}) is in the "
                         f"TensorRT-LLM table")
    return r


def target_rules(engine: str, target, engine_code: str = "auto") -> TargetRules:
    """The rules ``engine`` applies to ``target`` (a :class:`~.configs.TargetInfo`), cached on the target."""
    cache = target.__dict__.setdefault("_rules", {})
    key = (engine, engine_code)
    if key not in cache:
        cache[key] = _resolve(engine, target, engine_code)
    return cache[key]


def _resolve(engine: str, target, engine_code: str) -> TargetRules:
    if engine == "vllm":
        return _vllm_table(target)
    if engine == "trtllm":
        return _trtllm(target)
    live, why = sglang_mode(engine_code)
    if live:
        from . import sglang_code

        cls, arch, how = sglang_code.resolve_architecture(target.architectures)
        if cls is None:
            return TargetRules("sglang", sglang_code.installed_version(), why, arch, arch, False,
                               refusal=f"{how}, which has no set_eagle3_layers_to_capture")
        return _sglang_live(target, arch, cls)
    return _sglang_table(target.architectures, why, kept_table(engine_code))


# ------------------------------------------------------------------------------------------ draft class
@dataclasses.dataclass
class DraftClass:
    """The class an engine serves a draft with: the architecture it resolves, its EAGLE-3 head's table row (None: not
    one), whether the source can tell, and every head the engine has."""
    engine: str
    arch: str                      # what the engine resolves the draft's architectures to
    head: Optional[dict]           # the EAGLE-3 head's table row (None: not an EAGLE-3 head / unknown)
    known: bool                    # False: the source cannot tell
    message: str = ""
    heads: List[str] = dataclasses.field(default_factory=list)
    rows: Dict[str, dict] = dataclasses.field(default_factory=dict)  # every head's row (its layer tensors)
    version: str = ""


def draft_class(engine: str, draft, engine_code: str = "auto") -> DraftClass:
    """The :class:`DraftClass` ``engine`` resolves ``draft``'s architectures to: SGLang's registry live or from its
    table, vLLM's rename rule on its table, or unknown for TensorRT-LLM."""
    archs = [a for a in draft.architectures if isinstance(a, str) and a]
    if engine == "sglang":
        live, why = sglang_mode(engine_code)
        if live:
            from . import sglang_code

            reg = sglang_code.registry()
            heads = {a: h for a, c in reg.items() if (h := sglang_code.draft_head(c)) is not None}
            cls, arch, how = sglang_code.resolve_architecture(archs)
            version = sglang_code.installed_version() or tables.PINNED["sglang"]
        else:
            t = kept_table(engine_code) or tables.load("sglang") or {"targets": {}, "draft_heads": {}}
            heads = t["draft_heads"]
            arch = next((a for a in archs if a in t["targets"]), "TransformersForCausalLM")
            version = t.get("version") or tables.PINNED["sglang"]
        if not archs:  # never an empty class name in a message
            return DraftClass("sglang", "TransformersForCausalLM", None, True, heads=sorted(heads), rows=heads,
                              version=version,
                              message="the draft's config.json lists no architectures, so SGLang cannot pick one of "
                                      f"its EAGLE-3 heads ({', '.join(sorted(heads))}) for it")
        return DraftClass("sglang", arch, heads.get(arch), True, heads=sorted(heads), rows=heads, version=version)
    if engine == "vllm":
        t = tables.load("vllm") or {}
        heads = t.get("draft_heads", {})
        version = t.get("version") or tables.PINNED["vllm"]
        rename = (t.get("draft_rename") or {}).get("rule")
        if rename != "prefix-Eagle3":
            return DraftClass("vllm", "unknown", None, False, "vLLM's draft rename rule is not in the table",
                              version=version)
        if draft.dialect == "speculators":  # the speculators config's layer type picks the class
            amap = t.get("speculators_eagle3_arch_map") or {}
            lt = str(draft.layer_config.get("model_type", "llama"))
            if lt not in amap:
                return DraftClass("vllm", f"speculators layer type {lt!r}", None, True, heads=sorted(heads),
                                  rows=heads, version=version,
                                  message=f"vLLM's speculators reader has no EAGLE-3 class for layer type {lt!r}")
            archs = [amap[lt]]
        if not archs:
            return DraftClass("vllm", "no architectures", None, True, heads=sorted(heads), rows=heads,
                              version=version,
                              message="the draft's config.json lists no architectures, so vLLM (EAGLEConfig) has "
                                      "none to rename to one of its EAGLE-3 heads")
        names = [a if a.startswith("Eagle3") or a.endswith("Eagle3") else f"Eagle3{a}" for a in archs]
        arch = next((a for a in names if a in heads), names[0])
        return DraftClass("vllm", arch, heads.get(arch), True, heads=sorted(heads), rows=heads, version=version)
    return DraftClass("trtllm", "TensorRT-LLM's EAGLE-3 draft class", None, False,
                      "TensorRT-LLM picks its EAGLE-3 draft class from the speculative config, not from the draft's "
                      "architectures", version=tables.PINNED["trtllm"])
