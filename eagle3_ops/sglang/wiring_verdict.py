"""What the live check concludes, in words: from the doctor's replay report to the one verdict line and the JSON
result (:func:`conclude`: OK, WARNING, UNDECIDED, NO_WIRING_FITS), the config change that serves the winning wiring
(:func:`fix`), a draft config edited since start-up (:func:`config_change`), and at start-up the doctor's verdict on
the configs and the served boundaries in words (:func:`verdict_text`, :func:`boundaries_in_words`)."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import List, Optional, Tuple

from ..doctor import codes
from ..doctor.checks import find_finding, findings_from_json, verified_fix, why_no_fix
from ..doctor.configs import snapshot_changes
from .wiring_result import LABEL, cause_text, result_path

log = logging.getLogger("eagle3_ops.sglang")


def boundaries_in_words(boundaries: List[int], num_layers: int) -> str:
    """'the embeddings, the output of layer 1, 29, 57' (boundary b is the output of layer b-1)."""
    parts = []
    layers = [str(b - 1) for b in boundaries if 0 < b <= num_layers]
    if 0 in boundaries:
        parts.append("the embeddings")
    if layers:
        parts.append("the output of layer " + ", ".join(layers) +
                     (" (the last layer, before the final norm)" if num_layers in boundaries else ""))
    odd = [b for b in boundaries if not 0 <= b <= num_layers]
    if odd:
        parts.append(f"boundaries {odd}, which do not exist")
    return ", ".join(parts) or "nothing"


def verdict_text(report) -> str:
    """The doctor's config-only report (doctor.checks.Report) as its codes, for the start-up line."""
    if report is None:
        return "doctor: not run"
    errors = [f.code for f in report.findings if f.severity == "error"]
    warnings = [f.code for f in report.findings if f.severity == "warning"]
    if errors:
        return f"doctor: ERROR {', '.join(errors)}" + (f"; WARNING {', '.join(warnings)}" if warnings else "")
    if warnings:
        return f"doctor: WARNING {', '.join(warnings)}"
    return "doctor: OK (nothing to warn about in the configs)"


def config_change(snapshot: Optional[dict], report) -> Optional[dict]:
    """Where the draft's config.json changed since start-up (``snapshot``: doctor.configs.draft_snapshot; ``report``:
    the doctor's report of the configs served): {"text": in words, "ids": the ids it holds now or None}; None when
    unchanged (or not known)."""
    if snapshot is None or not snapshot_changes(snapshot, roles=("config",)):
        return None
    path = Path(snapshot["dir"]) / "config.json"
    served = report.wiring.ids if report is not None and report.wiring is not None else None
    try:
        now = json.loads(path.read_text())
        ids = (now.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") \
            if isinstance(now, dict) and isinstance(now.get("eagle_config") or {}, dict) else None
        holds = f"it now holds eagle_config.eagle_aux_hidden_state_layer_ids = {ids}"
    except (OSError, ValueError) as e:
        ids, holds = None, f"it cannot be read now ({cause_text(e)})"
    return {"ids": ids, "text": f"{path} changed since the server started ({holds}); this verdict is about the "
                                f"config the server read at start-up (ids {served}), which it serves until it "
                                f"restarts"}


def fix(report, draft_dir: Path, boundaries: List[int], changed: Optional[dict] = None,
        substitute: Optional[dict] = None) -> dict:
    """The draft config change that makes SGLang feed ``boundaries``: the replay is the evidence, so the
    fix is the id list SGLang's own id rule turns into exactly that wiring (checks.verified_fix without
    asking the config's readings to agree), the one closest to the ids the config holds; where none
    exists, why (checks.why_no_fix). ``report``: the doctor's report of the configs served; ``changed``:
    :func:`config_change`; ``substitute``: the ids served in place of the config's (wiring_unservable)."""
    if report is None or report.wiring is None:
        return {"ids": None, "text": "The doctor's report of the configs is missing, so no id list was checked."}
    ids = verified_fix(report, list(boundaries), check_readings=False)
    if ids is None:
        return {"ids": None, "text": f"No id list makes SGLang feed that wiring: "
                                     f"{why_no_fix(report, list(boundaries))}; "
                                     f"serve the draft with an engine that captures it, or retrain it on "
                                     f"boundaries SGLang captures."}
    where = Path(draft_dir) / "config.json"
    if changed is not None and changed.get("ids") == ids:  # edited since start-up to exactly that
        return {"ids": ids, "text": f"To serve it, restart: {where} was edited to eagle_config.eagle_aux_hidden_"
                                    f"state_layer_ids = {ids} after the server started (it serves "
                                    f"{report.wiring.ids}, read at start-up)."}
    if substitute is not None:
        now = (f"it holds {substitute['config_ids']}, which SGLang cannot serve; the plugin served "
               f"{substitute['served_ids']} meanwhile")
    elif changed is not None:
        now = f"served: {report.wiring.ids}, read at start-up; the file now holds {changed.get('ids')}"
    else:
        now = f"now {report.wiring.ids}"
    return {"ids": ids, "text": f"To serve it, set eagle_config.eagle_aux_hidden_state_layer_ids to {ids} in "
                                f"{where} ({now}) and restart."}


def conclude(check, report: dict, states: Path, seconds: float, offline: str) -> Tuple[Optional[dict], Optional[str]]:
    """One verdict line from the replay's verdict (``report["replay"]["verdict"]``: the doctor's words), the
    verdict and the fix first and short; every number and the offline command in the JSON result. ``check``: the
    WiringCheck (its model_name, served, draft_dir, report, snapshot and substitute are read). Returns (the result
    to write, None) once the line is said, or (None, why no verdict)."""
    replay = report.get("replay")
    findings = findings_from_json(f for f in report.get("findings", []) if isinstance(f, dict))
    if not isinstance(replay, dict):
        skipped = find_finding(findings, codes.I_REPLAY_SKIPPED)
        return None, skipped.text if skipped is not None else "the doctor ran no replay"
    conf, best = replay.get("configured"), replay.get("best") or {}
    verdict = replay.get("verdict") or {}
    word = verdict.get("word")
    n = int(replay.get("tokens", 0))
    changed = config_change(check.snapshot, check.report)
    result = {"model": check.model_name, "served": check.served, "tokens": n, "states": str(states),
              "seconds": round(seconds, 1), "replay_command": offline, "draft_code": replay.get("draft_code"),
              "compute_dtype": replay.get("compute_dtype"), "search": replay.get("search"),
              "no_input_accuracy": replay.get("no_input_accuracy"), "doctor_verdict": verdict,
              "candidates": replay.get("candidates", [])[:12], "chain": replay.get("chain")}
    if check.snapshot is not None:
        result["draft_files"] = [f["path"] for f in check.snapshot["files"] if f["role"] == "weights"]
        result["draft_files_rule"] = check.snapshot.get("rule")
    if changed:
        result["draft_config_changed"] = changed["text"]
    if conf is None or word not in ("OK", "UNDECIDED", "WARNING", "NO_WIRING_FITS"):
        return None, ("the served wiring could not be scored (see the doctor's errors: "
                      + "; ".join(dict.fromkeys(f.code for f in findings if f.severity == "error")) + ")")
    details = f"Details: {result_path(check.model_name)}"
    note = " The draft's config.json changed since start-up (see the JSON)." if changed else ""
    served = f"the served {conf['boundaries']} {100 * conf['accuracy']:.1f}%"
    searched = (replay.get("search") or {}).get("wirings_scanned")
    if word == "WARNING":
        gain, se = float(replay.get("gain", 0.0)), float(replay.get("gain_stderr", 0.0))
        the_fix = fix(check.report, check.draft_dir, best["boundaries"], changed, check.substitute)
        feedable = next((c for c in replay.get("candidates", []) if c.get("ids") is not None), None)
        if the_fix["ids"] is not None and changed is not None and changed.get("ids") == the_fix["ids"]:
            head = the_fix["text"].rstrip(".")  # edited since start-up to exactly the fix: a restart serves it
        elif the_fix["ids"] is not None:
            head = (f"set eagle_config.eagle_aux_hidden_state_layer_ids to {the_fix['ids']} in "
                    f"{check.draft_dir / 'config.json'} and restart")
        elif feedable is not None and feedable["boundaries"] != conf["boundaries"]:
            head = (f"SGLang cannot feed the wiring the draft was trained on; the best it can feed: ids "
                    f"{feedable['ids']} ({100 * feedable['accuracy']:.1f}%)")
            the_fix["text"] += (f" The best wiring SGLang can feed is {feedable.get('label')} "
                                f"{feedable['boundaries']} ({100 * feedable['accuracy']:.1f}%): set "
                                f"eagle_config.eagle_aux_hidden_state_layer_ids to {feedable['ids']} to serve it.")
        else:
            head = "SGLang cannot feed the wiring the draft was trained on (see the JSON)"
        result.update(verdict="WARNING", best=best, configured=conf, gain=gain, gain_stderr=se, fix=the_fix)
        log.warning("eagle3_ops: %s: WARNING: %s: %s's draft predicts best with boundaries %s: %.1f%% top-1 vs "
                    "%s (+%.1f ± %.1f points, %d positions).%s %s", LABEL, head, check.model_name,
                    best["boundaries"], 100 * best["accuracy"], served, 100 * gain, 100 * se, n, note, details)
    elif word == "UNDECIDED":
        gain, se = float(replay.get("gain", 0.0)), float(replay.get("gain_stderr", 0.0))
        result.update(verdict="UNDECIDED", best=best, configured=conf, gain=gain, gain_stderr=se,
                      fix=fix(check.report, check.draft_dir, best["boundaries"], changed, check.substitute))
        need = verdict.get("need") or "more prompts would tell"
        log.warning("eagle3_ops: %s: UNDECIDED: %s: %s scores %.1f%% top-1 and %s (+%.1f ± %.1f points, %d "
                    "positions): the evidence does not separate them; %s.%s %s", LABEL, check.model_name,
                    best["boundaries"], 100 * best["accuracy"], served, 100 * gain, 100 * se, n, need, note, details)
    elif word == "NO_WIRING_FITS":
        evidence = replay.get("no_fit_evidence") or {}
        result.update(verdict="NO_WIRING_FITS", best=best, configured=conf, evidence=evidence)
        first = "The evidence points at: " + ((evidence.get("points") or ["see the JSON"])[0])
        log.warning("eagle3_ops: %s: WARNING: the wiring is not the problem: no wiring predicts %s well (best %s "
                    "%.1f%%, the draft fed nothing %.1f%%, %d positions). %s.%s %s", LABEL, check.model_name,
                    best["boundaries"], 100 * best["accuracy"], 100 * float(replay.get("no_input_accuracy", 0)),
                    n, first, note, details)
    else:
        runner = next((c for c in replay.get("candidates", []) if c.get("boundaries") != conf["boundaries"]), None)
        result.update(verdict="OK", configured=conf, runner_up=runner)
        log.info("eagle3_ops: %s: OK: %s's draft is fed the wiring it predicts best: %s top-1 on %d positions; "
                 "none of %s wirings searched scores higher%s (%.0f s).%s %s", LABEL, check.model_name, served, n,
                 searched, f" (next: {runner['boundaries']} {100 * runner['accuracy']:.1f}%)" if runner else "",
                 seconds, note, details)
    low = find_finding(findings, codes.W_REPLAY_FEW_TOKENS)
    if low is not None:
        log.warning("eagle3_ops: %s: %s", LABEL, low.text)
    return result, None
