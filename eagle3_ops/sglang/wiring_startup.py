"""This TP rank's reading at start-up, before anything is recorded: the draft read once (its snapshot: what the
server serves and what the replay will score, with the ids served in place of the config's where the plugin chose
them), the doctor's report on it, and from these whether the live check can run here and what it records
(:func:`prepare`); the notes the start-up line adds about the recording (:func:`recording_notes`)."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import List, Optional, Tuple

from ..doctor.configs import DoctorInputError, draft_snapshot, snapshot_weight_files
from ..doctor.states import needed_boundaries
from . import wiring_recording
from .wiring_doctor import cannot_replay, doctor_report
from .wiring_result import LABEL, cause_text
from .wiring_unservable import UNSERVABLE, served_instead, unservable_advice

log = logging.getLogger("eagle3_ops.sglang")


def prepare(check, model, cfg, raw_cfg: dict) -> Tuple[Optional[str], Optional[List[int]], int]:
    """Read the draft for ``check`` (a new wiring_check.WiringCheck: its snapshot, substitute and report are set
    here) and decide: (why the check cannot run or None, the boundaries to record, the fewest tokens a recorded
    forward may have). ``cfg``: the target's config as SGLang holds it; ``raw_cfg``: as a dict."""
    try:  # one reading of the draft: what the server serves, and what the replay will score
        check.snapshot = draft_snapshot(check.draft_dir)
        check.substitute = served_instead(model)
        if check.substitute is not None:  # the server captures these ids in place of the config's (ids_to_serve)
            config = json.loads(json.dumps(check.snapshot["config"]))
            config.setdefault("eagle_config", {})["eagle_aux_hidden_state_layer_ids"] = check.substitute["served_ids"]
            check.snapshot["config"] = config
        check.report, weights = doctor_report(cfg, check.draft_dir, check.tp_size, snapshot=check.snapshot)
    except DoctorInputError as e:  # the file it names, and why
        return f"the doctor could not read the configs and weights: {e}", None, 0
    except Exception as e:
        log.debug("eagle3_ops: %s: reading the configs failed", LABEL, exc_info=e)
        return f"the doctor could not read the configs and weights ({cause_text(e)})", None, 0
    if unservable_advice(check.report, check.draft_dir, check.model_name, None) is not None:
        return UNSERVABLE, None, 0
    served = check.served
    why_not = cannot_replay(check.report, weights)
    expected = [sl.boundary for sl in check.report.wiring.slots] if check.report.wiring is not None else served
    if why_not is None and expected != served:  # the replay's "served" wiring would not be the server's
        why_not = (f"SGLang captures boundaries {served}, but the draft config makes the doctor expect "
                   f"{expected}; report this (the doctor's engine rules may be out of date)")
    if why_not is not None:
        return why_not, None, 0
    min_forward, why_not = wiring_recording.smallest_forward(model, cfg, raw_cfg)
    if why_not is not None:
        return why_not, None, 0
    # every boundary 0..L: the replay's search tries each in every slot (a draft can be off by any number of layers)
    return None, needed_boundaries(served, check.num_layers, "all"), min_forward


def recording_notes(check, recorder) -> str:
    """What the start-up line adds about a recording that starts: boundaries this model cannot record, which files
    are the draft's checkpoint where that is not plain, and a recording folder outside the cache."""
    notes = (f"; boundaries {recorder.unreachable} cannot be recorded on this model" if recorder.unreachable
             else "")
    snap = check.snapshot
    if snap is not None and (snap.get("left_out") or
                             [Path(f).name for f in snapshot_weight_files(snap)] != ["model.safetensors"]):
        notes += f"; the draft's weights: {snap.get('describe')}"  # which files are the checkpoint, said
    if check.workdir_note:
        notes += f"; recording in {check.workdir} ({check.workdir_note})"
    return notes
