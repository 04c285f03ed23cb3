"""A draft config that asks SGLang for captures it will not take (an id no layer of the model has, e.g. the seed's
``-1`` for "the embeddings"; the last layer's output on a family that cannot capture it; a boundary on an earlier
pipeline stage; a boundary named twice): the ERROR advice in words (:func:`unservable_advice`, said at start-up by
:func:`advise_now` where the live check does not run), and the ids the server captures instead so that it runs and
the check finds the wiring the draft was trained on (:func:`ids_to_serve`; :func:`served_instead` for the check)."""
from __future__ import annotations

import inspect
import logging
import os
from pathlib import Path
from typing import Dict, List, Optional

from ..doctor.checks import verified_fix, why_no_fix
from ..doctor.configs import draft_snapshot
from ..doctor.engines import short_boundary
from . import dump_states, groups, lockstep
from .wiring_doctor import doctor_report, eagle3_server, find_draft_dir, pipeline
from .wiring_result import ENV_SWITCH, LABEL, enabled, result_path

log = logging.getLogger("eagle3_ops.sglang")

UNSERVABLE = "the draft config asks SGLang for captures it will not take (see the ERROR line)"

# id(model) -> {"config_ids", "served_ids", "why", "draft_dir", "advice"}: ids served in place of the config's
_substitutes: Dict[int, dict] = {}


def collects_in_packer(owner) -> Optional[bool]:
    """Whether the capture owner's forward collects into SGLang's ``AuxHiddenStatePacker`` (whose ``finalize``
    raises when it got fewer captures than configured), read from its source; None: cannot tell."""
    try:
        fn = inspect.unwrap(next(k.__dict__["forward"] for k in type(owner.inner).__mro__ if "forward" in k.__dict__))
        return "AuxHiddenStatePacker" in inspect.getsource(fn)
    except (StopIteration, OSError, TypeError):
        return None


def unservable_advice(report, draft_dir: Path, model_name: str, packer: Optional[bool],
                      check_off: Optional[str] = None) -> Optional[str]:
    """Where the draft config asks SGLang for a capture it will not take (an id no layer of this model has, the
    last layer's output on a family that cannot capture it, a boundary on an earlier pipeline stage, a repeated
    boundary): what SGLang will do, each plausible reading of the config with the ids SGLang serves for it, and
    how the trained wiring is then found (the live check, or, where ``check_off`` says why it does not run
    here, the offline replay). None when every configured id is captured."""
    w = report.wiring if report is not None else None
    if w is None or w.ids is None:
        return None
    lost = [sl for sl in w.slots if not sl.captured]
    if not lost and not w.duplicates:
        return None
    L, counted = report.target.num_layers, len(w.config_order)  # SGLang counts one capture per id
    got = len(w.captured_boundaries)
    takes = report.fc_slots if report.fc_slots is not None else counted
    bad = [f"id {sl.config_id} -> boundary {sl.boundary}: {sl.why_not}" for sl in lost]
    if w.duplicates:
        bad.append(f"boundaries {sorted(set(w.duplicates))} are named twice and captured once")
    if packer and got:
        fails = (f"SGLang's first forward of {model_name} fails with its own error, RuntimeError: captured {got} of "
                 f"{counted} aux hidden states (AuxHiddenStatePacker.finalize), before a prompt is served")
    elif got:
        fails = (f"SGLang feeds the draft {got} of the {takes} states its fc takes ({got} x the hidden size wide "
                 f"instead of {takes} x), not the input the draft was trained on")
    else:
        fails = f"SGLang's target captures none of them, and the draft gets none of the {takes} states its fc takes"
    readings, servable, edited = [], False, False
    for n, r in enumerate(report.training.readings if report.training is not None else []):
        tag = chr(ord("A") + n)
        if not r.plausible:
            edited = edited or r.key == "sglang-capture"
            readings.append(f"({tag}) {r.label}: boundaries {r.boundaries}, ruled out ({r.why_not})")
            continue
        ids = verified_fix(report, r.boundaries, check_readings=False)
        servable = servable or ids is not None
        serve = (f"serve it with ids {ids}" if ids is not None else
                 f"SGLang cannot serve it: {why_no_fix(report, r.boundaries)}")
        readings.append(f"({tag}) {r.label}: trained on {r.boundaries} = "
                        f"{', '.join(short_boundary(b, L) for b in r.boundaries)}; {serve}")
    default = w.rules.map_ids(None, L).config_order
    in_words = ", ".join(short_boundary(b, L) for b in default)
    default_ids = verified_fix(report, default, check_readings=False)
    note = (" A draft trained through SGLang cannot have been trained with these ids on this model (reading A is "
            "ruled out), so the config was most likely edited after training (e.g. -1 written for 'the embeddings'): "
            "the ids it was published with are the surest fix." if edited else "")
    what = "one of these lists" if servable else \
        (f"SGLang's default boundaries {default} ({in_words}; ids {default_ids}), since no reading above is one SGLang "
         f"serves" if default_ids is not None else "ids SGLang captures (none of the readings above is one)")
    if check_off is None:
        then = (f"Serve {what}: the live check then replays the draft on the first prompts against the served "
                f"wiring, its neighbours and SGLang's default boundaries {default} ({in_words}), and names the wiring "
                f"the draft was trained on with the ids that serve it")
    else:
        then = (f"Serve {what}; the live check is off here ({check_off}), so record states (EAGLE3_OPS_DUMP_STATES) "
                f"and run python -m eagle3_ops doctor --replay on them: it scores the served wiring, its neighbours "
                f"and SGLang's default boundaries {default} and names the wiring the draft was trained on")
    return (f"{model_name}: ERROR: the draft config asks SGLang for captures it will not take: "
            f"eagle_config.eagle_aux_hidden_state_layer_ids = {w.ids} in {Path(draft_dir) / 'config.json'}; "
            f"{'; '.join(bad)}. {fails}. What the draft may have been trained on, and the ids SGLang serves for each: "
            f"{'; '.join(readings) or 'the config records no readable ids'}.{note} {then}")


def advise_now(model, owner, cfg, draft_path, tp_size, check_off: str) -> bool:
    """Rank 0, where the live check does not start for another reason (a server setting, ``check_off``): the
    same ERROR line as :func:`unservable_advice` when the config asks for captures SGLang will not take. True
    when said."""
    try:
        draft_dir = find_draft_dir(draft_path)
        if draft_dir is None or cfg is None:
            return False
        report, _ = doctor_report(cfg, draft_dir, tp_size, *pipeline())
        advice = unservable_advice(report, draft_dir, type(model).__name__, collects_in_packer(owner), check_off)
    except Exception:  # noqa: BLE001 - advice only; the server's own errors stand
        log.debug("eagle3_ops: %s: the start-up advice could not be built", LABEL, exc_info=True)
        return False
    if advice:
        log.error("eagle3_ops: %s: %s", LABEL, advice)
    return bool(advice)


def substitute(report) -> tuple:
    """(ids SGLang takes that feed the first plausible reading of the draft config, else SGLang's default
    boundaries; in words) or (None, why none)."""
    L = report.target.num_layers
    for n, r in enumerate(report.training.readings if report.training is not None else []):
        if r.plausible:
            ids = verified_fix(report, list(r.boundaries), check_readings=False)
            if ids is not None:
                return ids, f"reading {chr(ord('A') + n)} of the config: boundaries {list(r.boundaries)}"
    default = report.wiring.rules.map_ids(None, L).config_order
    ids = verified_fix(report, default, check_readings=False)
    if ids is not None:
        return ids, (f"SGLang's default boundaries {default} "
                     f"({', '.join(short_boundary(b, L) for b in default)}), since no reading of the config is one "
                     f"SGLang serves")
    return None, "no reading of the config, nor SGLang's default, is a list SGLang serves"


def served_instead(model) -> Optional[dict]:
    """What :func:`ids_to_serve` chose for ``model`` ({"config_ids", "served_ids", "why", "draft_dir", "advice"}),
    or None (it serves the config's ids)."""
    return _substitutes.get(id(model))


def ids_to_serve(model, ids, *, draft_path=None, target_config=None) -> Optional[List[int]]:
    """Before SGLang configures the target's capture (AROUND ``configure_aux_hidden_state_capture``): where the draft
    config asks for captures SGLang will not take (an id no layer has, e.g. the seed's ``-1`` for "the embeddings";
    a boundary named twice), SGLang's first forward fails (or its fc gets fewer states than it takes) and the live
    check could only say so, one restart before the evidence. Instead the server captures the ids returned here
    (the first reading of the config SGLang serves, else its default), so it runs and the check's search finds the
    wiring the draft was trained on at this start. The draft's input never changes the served tokens (the target
    verifies every draft token; only how many are accepted changes). Every TP rank decides the same or none
    substitutes. None: serve ``ids`` as they are (the check off, no EAGLE-3 server, a servable config)."""
    if ids is None or not enabled() or os.environ.get("EAGLE3_OPS_DUMP_STATES", "").strip():
        return None
    sub = None
    try:
        if draft_path is None:
            sa = eagle3_server()
            if sa is None:
                return None
            draft_path = getattr(sa, "speculative_draft_model_path", None)
        if dump_states.server_refusal() is None:
            draft_dir = find_draft_dir(draft_path)
            cfg = target_config if target_config is not None else getattr(model, "config", None)
            if draft_dir is not None and cfg is not None:
                report, _ = doctor_report(cfg, draft_dir, groups.tp_rank_size()[1], *pipeline(),
                                          snapshot=draft_snapshot(draft_dir))
                advice = unservable_advice(report, draft_dir, type(model).__name__, None)
                if report.wiring is not None and list(report.wiring.ids or []) == list(ids) and advice is not None:
                    served, why = substitute(report)
                    if served is not None:
                        sub = {"config_ids": list(ids), "served_ids": list(served), "why": why,
                               "draft_dir": str(draft_dir), "advice": advice}
    except Exception:  # noqa: BLE001 - SGLang's own behaviour stands
        log.debug("eagle3_ops: %s: deciding what to serve failed", LABEL, exc_info=True)
        sub = None
    if not lockstep.same_on_all_ranks(repr(sub and sub["served_ids"]), groups.tp_group()):
        return None
    if sub is None:
        return None
    _substitutes[id(model)] = sub
    if groups.tp_rank_size()[0] == 0:
        log.error("eagle3_ops: %s: ERROR: %s's eagle_aux_hidden_state_layer_ids %s ask SGLang for captures it will not "
                  "take (its first forward would fail); serving ids %s instead (%s) so the server runs and this check "
                  "finds the wiring the draft was trained on. Served tokens are unchanged (the target verifies every "
                  "draft token); %s=0 keeps SGLang's own behaviour. Details: %s", LABEL,
                  Path(sub["draft_dir"]) / "config.json", sub["config_ids"], sub["served_ids"], sub["why"], ENV_SWITCH,
                  result_path(type(model).__name__))
        log.debug("eagle3_ops: %s: %s", LABEL, sub["advice"])
    return list(sub["served_ids"])
