"""The live wiring check: the server tells the user, on its first real prompts, whether the draft is fed
the hidden states it was trained on.

A draft fed other hidden states than it was trained on accepts 20-30% of tokens instead of ~75% (or
~1%), and nothing crashes. The doctor (eagle3_ops.doctor) can tell from the configs where they decide,
and its replay scores candidate wirings with the real draft on the engine's own states where they do
not. This module chains them inside the server, on by default (``EAGLE3_OPS_WIRING_CHECK=0`` turns it
off), with SGLang's default flags:

1. **At start-up** (when SGLang configures the target's capture): one INFO line with what the server
   feeds the draft, in words, the doctor's verdict on the configs (its codes), and what the live check
   waits for.
2. **On the first prompts that qualify** (prefills from position 0 of at least
   :data:`MIN_PROMPT_TOKENS` tokens, until :data:`CLOSE_AFTER_TOKENS` positions, at most
   :data:`RECORD_TOKENS`): the boundaries the
   replay's candidate wirings name, the tokens and the target's greedy next tokens are recorded through
   the states dump's recorder (``dump_states.StatesRecorder``: SGLang's own capture callbacks, post
   all-reduce; TP rank 0 keeps the values in host memory, bounded by the token count; every rank takes
   part in the next-token all-gather, the dump's one collective). SGLang's breakable prefill CUDA
   graphs would replay such a prefill without running Python, so for that one forward the graph runner
   is told it cannot run it (``dump_states.around_can_run_graph``; every TP rank sees the same batch
   and decides the same): those prefills of the target run eagerly (SGLang's own eager path), nothing
   else changes. Only the scheduler's batches are recorded, never SGLang's graph-capture warm-ups;
   under DP attention (each rank runs another batch) the check is off.
3. **In the background** (TP rank 0): the recording is written next to the qualification cache and the
   doctor's replay runs on it in a subprocess (``python -m eagle3_ops doctor --replay``: nice 19,
   :data:`THREADS` threads, no GPU, an address-space limit, :data:`TIME_LIMIT_S` seconds), reading only
   the draft tensors it needs and of the draft's embedding only the recorded tokens' rows. Serving goes
   on; one verdict line follows (OK, or a WARNING with the wiring that predicts the target best, its
   agreement against the served one's, the config change the doctor verifies, and the offline command),
   and the same as JSON (:func:`result_path`). Where the check cannot run, one line says why: the true cause
   (an OS error by its name and path: ENOSPC, EFBIG, EACCES, ELOOP, ...) and advice for this check's own
   settings (``EAGLE3_OPS_WIRING_CHECK``, the cache folder ``XDG_CACHE_HOME`` moves), never a traceback for a
   condition of the machine (a bug of eagle3_ops is said as one, its traceback at DEBUG level).

   **One snapshot of the draft**: at start-up the draft's config.json is read once and the files its weights
   are read from are fixed (``doctor.configs.draft_snapshot``: with ``model.safetensors.index.json`` exactly
   the shards it names, else every ``*.safetensors`` as SGLang loads them; their paths, sizes, mtimes and
   inodes). The doctor's verdict at start-up, the replay (``--draft-snapshot``: the config as read then, the
   same files) and the fix all come from that reading; weights changed on disk since are said ("the draft in
   DIR changed since the server started: ...; restart to check it"), never scored as the served ones, and a
   config.json edited since is named in the verdict, which stays about the config the server serves.
4. **Observed against predicted**: once SGLang has verified :data:`ACCEPTANCE_STEPS` request steps,
   one line compares its first-draft-token acceptance with the replay's top-1 agreement of the served
   wiring; a large gap with the wiring right points at something else (tokenizer, vocabulary map,
   embedding scale).

What it changes: the recorded layers complete their deferred all-reduce before their input norm, as
SGLang does for its own captured layers; where SGLang would instead fuse that all-reduce with the
add+RMSNorm (FlashInfer's, CuTe DSL's or aiter's fusion at TP > 1; the largest fused forward found with
SGLang's own predicates, :func:`_largest_fused_forward`), only longer forwards are recorded, so no
recorded forward runs another kernel than stock. The recorded prefills run SGLang's eager path instead
of its prefill graph (on a GPU the exact token count instead of the padded bucket). After it has run,
it costs one list check per hooked call.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

from ..files import os_error_words

log = logging.getLogger("eagle3_ops.sglang")

ENV_SWITCH = "EAGLE3_OPS_WIRING_CHECK"
MIN_PROMPT_TOKENS = 32     # a shorter prompt gives the replay too little context per position
RECORD_TOKENS = 1024       # positions recorded at most: host memory = tokens x boundaries x H x dtype bytes
CLOSE_AFTER_TOKENS = 256   # the recording closes after the prompt that brings it to this many
TIME_LIMIT_S = 900         # the background replay's wall-clock bound
THREADS = 2                # its CPU threads
ACCEPTANCE_STEPS = 1000    # verified (request, step) pairs before the observed-vs-predicted line
GAP_POINTS = 15.0          # observed vs predicted first-token acceptance: a gap worth a line of its own
LABEL = "live wiring check"

ACCEPTANCE_TARGET = ("sglang.srt.managers.scheduler_components.batch_result_processor."
                     "SchedulerBatchResultProcessor._resolve_spec_v2_tokens")

_checks: List["WiringCheck"] = []


def enabled() -> bool:
    from .. import settings

    try:
        return bool(settings.get(ENV_SWITCH))
    except settings.SettingError as e:
        settings.report_once(e, log)
        return False


KEEP_RECORDINGS = 3  # per model, the newest recordings kept for the offline command


def result_path(model_name: Optional[str] = None) -> Path:
    """Where the verdict is written as JSON: next to the qualification cache, one file per model class."""
    from .. import qualify_cache

    return qualify_cache.path().parent / (f"wiring_check-{model_name}.json" if model_name else "wiring_check.json")


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


class WiringCheck:
    """One target's live check (every TP rank has one; rank 0 does the talking and the scoring)."""

    def __init__(self, model_name: str, draft_dir: Path, target_config: dict, served: List[int],
                 num_layers: int, tp_rank: int, tp_size: int):
        self.model_name, self.draft_dir, self.target_config = model_name, draft_dir, target_config
        self.served, self.num_layers = served, num_layers
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.report = None            # the doctor's config-only report (doctor.checks.Report)
        self.recorder = None
        self.phase = "waiting"        # waiting | scoring | done | failed
        self.verdict: Optional[dict] = None
        self.predicted: Optional[float] = None   # the replay's top-1 agreement of the served wiring
        self.steps = 0                # verified (request, step) pairs seen
        self.first_accepted = 0       # of them, with the first draft token accepted
        self.acceptance_logged = False
        self.thread: Optional[threading.Thread] = None
        self.snapshot: Optional[dict] = None     # the draft as read at start-up (doctor.configs.draft_snapshot)
        self.substitute: Optional[dict] = None   # ids served in place of the config's (ids_to_serve), if any
        self.workdir_note: Optional[str] = None  # why the recording is not in the cache folder, if it is not
        self._workdir: Optional[Path] = None
        self.lock = threading.Lock()

    @property
    def workdir(self) -> Path:
        """This check's folder for the recording, the target's config and the draft snapshot (made on first use:
        beside the qualification cache, else the system's temporary folder, :attr:`workdir_note` saying why).
        Rank 0 alone keeps files (other ranks record nothing to disk)."""
        if self._workdir is None:
            if self.tp_rank == 0:
                self._workdir, self.workdir_note = _workdir(self.model_name)
            else:
                self._workdir = Path(tempfile.gettempdir()) / "eagle3_ops-unused"
        return self._workdir

    @property
    def talks(self) -> bool:
        return self.tp_rank == 0

    # ---- the recording finished -------------------------------------------------------------------
    def recorded(self, path: Optional[str]) -> None:
        if not self.talks:
            self.phase = "done"
            return
        if path is None:
            failure = getattr(self.recorder, "failure", None)
            self._fail(failure or "nothing was recorded (no prefill qualified before the recording was closed)")
            return
        self.phase = "scoring"
        thread = threading.Thread(target=self._score, args=(Path(path),), name="eagle3_ops-wiring-check",
                                  daemon=True)
        try:
            thread.start()
        except RuntimeError as e:  # "can't start new thread": the process is at its thread limit
            self._fail(f"the replay's thread could not be started ({e}): the server process is at its thread limit")
            return
        self.thread = thread  # assigned once started, so whoever sees it can join it

    def wait(self, timeout: Optional[float] = None) -> None:
        """Block until the recording is written and its replay scored (tests and tools; SGLang never waits)."""
        if self.recorder is not None:
            self.recorder.wait(timeout)  # recorded() runs at its end, so self.thread is set (and started) after this
        if self.thread is not None:
            self.thread.join(timeout)

    def _fail(self, why: str) -> None:
        self.phase = "failed"
        self.acceptance_logged = True  # nothing to compare with: stop counting
        path = result_path(self.model_name)
        unsaved = _write_result({"model": self.model_name, "verdict": "not checked", "why": why}, self.model_name,
                                say=False)
        log.warning("eagle3_ops: %s: %s could not be checked: %s; serving is unaffected%s", LABEL, self.model_name,
                    why, f" (the result could not be saved either: {unsaved})" if unsaved else "")
        if not unsaved:
            log.info("eagle3_ops: %s: result written to %s", LABEL, path)

    # ---- the background replay ---------------------------------------------------------------------
    def command(self, states: Path, target_dir: Path, snapshot: Optional[Path] = None) -> List[str]:
        from ..doctor.rules import sglang_mode

        code = "table" if sglang_mode("auto")[0] else "installed"
        return [sys.executable, "-m", "eagle3_ops", "doctor", "--draft", str(self.draft_dir), "--target",
                str(target_dir), "--replay", str(states), "--json", "--engine-code", code,
                *(["--tp", str(self.tp_size)] if self.tp_size > 1 else []),
                *(["--draft-snapshot", str(snapshot)] if snapshot is not None else [])]

    def _score(self, states: Path) -> None:
        try:
            self._replay(states)
        except Exception as e:  # never stop SGLang: the cause in one line; a real bug's traceback at DEBUG
            log.debug("eagle3_ops: %s: the replay of %s failed", LABEL, states, exc_info=e)
            self._fail(_cause_text(e))

    def _replay(self, states: Path) -> None:
        from ..doctor.configs import changed_since_start, snapshot_changes

        if self.snapshot is not None:  # what the server loaded must still be on disk to be scored as served
            changes = snapshot_changes(self.snapshot, roles=("index", "weights"))
            if changes:
                self._fail(changed_since_start(self.snapshot, changes))
                return
        target_dir = self.workdir / "target"  # the target's config as the server read it (kept for the offline command)
        snapshot_file = self.workdir / "draft-snapshot.json" if self.snapshot is not None else None
        writing = target_dir / "config.json"
        try:
            target_dir.mkdir(parents=True, exist_ok=True)
            writing.write_text(json.dumps(self.target_config, default=str))
            if snapshot_file is not None:  # the draft as read at start-up: the replay scores that, nothing newer
                writing = snapshot_file
                snapshot_file.write_text(json.dumps(self.snapshot, default=str))
        except OSError as e:
            self._fail(_cache_write_failure(writing, e))
            return
        cmd = self.command(states, target_dir, snapshot_file)
        t0 = time.monotonic()
        try:
            proc = subprocess.Popen(limited(cmd, self.memory_limit(states), TIME_LIMIT_S * THREADS + 60),
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_child_env())
        except OSError as e:  # EAGAIN (a process limit), ENOMEM
            self._fail(f"the replay process could not be started: {os_error_words(e)}; check offline: "
                       f"{_shell(self._offline_command(states))}")
            return
        try:
            out, err = proc.communicate(timeout=TIME_LIMIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            self._fail(f"the replay did not finish in {TIME_LIMIT_S} s (the time bound); check offline: "
                       f"{_shell(self._offline_command(states))}")
            return
        seconds = time.monotonic() - t0
        report = _parse(out)
        if proc.returncode not in (0, 1) or report is None:
            lines = [ln.strip() for ln in err.decode(errors="replace").strip().splitlines() if ln.strip()]
            changed = next((ln for ln in lines if "changed since the server started" in ln), None)
            if changed is not None:  # the draft changed while the replay read it
                self._fail(changed[len("error: "):] if changed.startswith("error: ") else changed)
                return
            self._fail(f"the replay stopped (exit {proc.returncode}): {lines[-1] if lines else 'no message'}")
            return
        self._conclude(report, states, seconds)

    def memory_limit(self, states: Path) -> int:
        """Address space for the replay process: torch itself, the draft tensors it loads (at most the
        checkpoint's weight files, as fixed at start-up), the states, and room to compute."""
        from ..doctor.configs import checkpoint_files, snapshot_bytes

        if self.snapshot is not None:
            draft_bytes = snapshot_bytes(self.snapshot)
        else:
            draft_bytes = 0
            try:
                for f in checkpoint_files(self.draft_dir).files:
                    draft_bytes += os.stat(f).st_size
            except Exception:  # noqa: BLE001 - the replay reports an unreadable checkpoint itself
                pass
        return int(8 * 2**30 + 3 * draft_bytes + 3 * states.stat().st_size)

    def _offline_command(self, states: Path) -> List[str]:
        """The command that ran, as a user types it (without --json; on the draft as it is on disk then)."""
        cmd = self.command(states, self.workdir / "target")
        return ["python", *[c for c in cmd[1:] if c != "--json"]]

    def _config_change(self) -> Optional[dict]:
        """Where the draft's config.json changed since start-up: {"text": in words, "ids": the ids it holds now
        or None}; None when unchanged (or not known)."""
        from ..doctor.configs import snapshot_changes

        if self.snapshot is None or not snapshot_changes(self.snapshot, roles=("config",)):
            return None
        path = Path(self.snapshot["dir"]) / "config.json"
        served = self.report.wiring.ids if self.report is not None and self.report.wiring is not None else None
        try:
            now = json.loads(path.read_text())
            ids = (now.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") \
                if isinstance(now, dict) and isinstance(now.get("eagle_config") or {}, dict) else None
            holds = f"it now holds eagle_config.eagle_aux_hidden_state_layer_ids = {ids}"
        except (OSError, ValueError) as e:
            ids, holds = None, f"it cannot be read now ({_cause_text(e)})"
        return {"ids": ids, "text": f"{path} changed since the server started ({holds}); this verdict is about the "
                                    f"config the server read at start-up (ids {served}), which it serves until it "
                                    f"restarts"}

    def _conclude(self, report: dict, states: Path, seconds: float) -> None:
        """One verdict line from the replay's verdict (``report["replay"]["verdict"]``: the doctor's words), the
        verdict and the fix first and short; every number and the offline command in the JSON result."""
        replay = report.get("replay")
        codes = {f.get("code"): f for f in report.get("findings", []) if isinstance(f, dict)}
        if not isinstance(replay, dict):
            why = codes.get("I_REPLAY_SKIPPED", {}).get("message") or "the doctor ran no replay"
            self._fail(why)
            return
        conf, best = replay.get("configured"), replay.get("best") or {}
        verdict = replay.get("verdict") or {}
        word = verdict.get("word")
        n = int(replay.get("tokens", 0))
        offline = _shell(self._offline_command(states))
        changed = self._config_change()
        result = {"model": self.model_name, "served": self.served, "tokens": n, "states": str(states),
                  "seconds": round(seconds, 1), "replay_command": offline, "draft_code": replay.get("draft_code"),
                  "compute_dtype": replay.get("compute_dtype"), "search": replay.get("search"),
                  "no_input_accuracy": replay.get("no_input_accuracy"), "doctor_verdict": verdict,
                  "candidates": replay.get("candidates", [])[:12]}
        if self.snapshot is not None:
            result["draft_files"] = [f["path"] for f in self.snapshot["files"] if f["role"] == "weights"]
            result["draft_files_rule"] = self.snapshot.get("rule")
        if changed:
            result["draft_config_changed"] = changed["text"]
        if conf is None or word not in ("OK", "UNDECIDED", "WARNING", "NO_WIRING_FITS"):
            self._fail("the served wiring could not be scored (see the doctor's errors: "
                       + "; ".join(c for c in codes if c.startswith("E_")) + ")")
            return
        details = f"Details: {result_path(self.model_name)}"
        note = " The draft's config.json changed since start-up (see the JSON)." if changed else ""
        served = f"the served {conf['boundaries']} {100 * conf['accuracy']:.1f}%"
        searched = (replay.get("search") or {}).get("wirings_scanned")
        if word == "WARNING":
            gain, se = float(replay.get("gain", 0.0)), float(replay.get("gain_stderr", 0.0))
            fix = self._fix(best["boundaries"], changed)
            feedable = next((c for c in replay.get("candidates", []) if c.get("ids") is not None), None)
            if fix["ids"] is not None and changed is not None and changed.get("ids") == fix["ids"]:
                head = fix["text"].rstrip(".")  # edited since start-up to exactly the fix: a restart serves it
            elif fix["ids"] is not None:
                head = (f"set eagle_config.eagle_aux_hidden_state_layer_ids to {fix['ids']} in "
                        f"{self.draft_dir / 'config.json'} and restart")
            elif feedable is not None and feedable["boundaries"] != conf["boundaries"]:
                head = (f"SGLang cannot feed the wiring the draft was trained on; the best it can feed: ids "
                        f"{feedable['ids']} ({100 * feedable['accuracy']:.1f}%)")
                fix["text"] += (f" The best wiring SGLang can feed is {feedable.get('label')} {feedable['boundaries']} "
                                f"({100 * feedable['accuracy']:.1f}%): set eagle_config.eagle_aux_hidden_state_layer_ids "
                                f"to {feedable['ids']} to serve it.")
            else:
                head = "SGLang cannot feed the wiring the draft was trained on (see the JSON)"
            result.update(verdict="WARNING", best=best, configured=conf, gain=gain, gain_stderr=se, fix=fix)
            log.warning("eagle3_ops: %s: WARNING: %s: %s's draft predicts best with boundaries %s: %.1f%% top-1 vs "
                        "%s (+%.1f ± %.1f points, %d positions).%s %s", LABEL, head, self.model_name,
                        best["boundaries"], 100 * best["accuracy"], served, 100 * gain, 100 * se, n, note, details)
        elif word == "UNDECIDED":
            gain, se = float(replay.get("gain", 0.0)), float(replay.get("gain_stderr", 0.0))
            result.update(verdict="UNDECIDED", best=best, configured=conf, gain=gain, gain_stderr=se,
                          fix=self._fix(best["boundaries"], changed))
            need = verdict.get("need") or "more prompts would tell"
            log.warning("eagle3_ops: %s: UNDECIDED: %s: %s scores %.1f%% top-1 and %s (+%.1f ± %.1f points, %d "
                        "positions): the evidence does not separate them; %s.%s %s", LABEL, self.model_name,
                        best["boundaries"], 100 * best["accuracy"], served, 100 * gain, 100 * se, n, need, note,
                        details)
        elif word == "NO_WIRING_FITS":
            evidence = replay.get("no_fit_evidence") or {}
            result.update(verdict="NO_WIRING_FITS", best=best, configured=conf, evidence=evidence)
            first = "The evidence points at: " + ((evidence.get("points") or ["see the JSON"])[0])
            log.warning("eagle3_ops: %s: WARNING: the wiring is not the problem: no wiring predicts %s well (best %s "
                        "%.1f%%, the draft fed nothing %.1f%%, %d positions). %s.%s %s", LABEL, self.model_name,
                        best["boundaries"], 100 * best["accuracy"], 100 * float(replay.get("no_input_accuracy", 0)),
                        n, first, note, details)
        else:
            runner = next((c for c in replay.get("candidates", []) if c.get("boundaries") != conf["boundaries"]), None)
            result.update(verdict="OK", configured=conf, runner_up=runner)
            log.info("eagle3_ops: %s: OK: %s's draft is fed the wiring it predicts best: %s top-1 on %d positions; "
                     "none of %s wirings searched scores higher%s (%.0f s).%s %s", LABEL, self.model_name, served, n,
                     searched, f" (next: {runner['boundaries']} {100 * runner['accuracy']:.1f}%)" if runner else "",
                     seconds, note, details)
        low = codes.get("W_REPLAY_FEW_TOKENS")
        if low:
            log.warning("eagle3_ops: %s: %s", LABEL, low.get("message"))
        with self.lock:  # the verdict first: the acceptance line reads both
            self.verdict = result
            self.predicted = float(conf["accuracy"])
            self.phase = "done"
        _write_result(result, self.model_name)
        self.maybe_log_acceptance()

    def _fix(self, boundaries: List[int], changed: Optional[dict] = None) -> dict:
        """The draft config change that makes SGLang feed ``boundaries``: the replay is the evidence, so the
        fix is the id list SGLang's own id rule turns into exactly that wiring (checks.verified_fix without
        asking the config's readings to agree), the one closest to the ids the config holds; where none
        exists, why (checks.why_no_fix)."""
        from ..doctor.checks import verified_fix, why_no_fix

        if self.report is None or self.report.wiring is None:
            return {"ids": None, "text": "The doctor's report of the configs is missing, so no id list was checked."}
        ids = verified_fix(self.report, list(boundaries), check_readings=False)
        if ids is None:
            return {"ids": None, "text": f"No id list makes SGLang feed that wiring: {why_no_fix(self.report, list(boundaries))}; "
                                         f"serve the draft with an engine that captures it, or retrain it on "
                                         f"boundaries SGLang captures."}
        where = self.draft_dir / "config.json"
        if changed is not None and changed.get("ids") == ids:  # edited since start-up to exactly that
            return {"ids": ids, "text": f"To serve it, restart: {where} was edited to eagle_config.eagle_aux_hidden_"
                                        f"state_layer_ids = {ids} after the server started (it serves "
                                        f"{self.report.wiring.ids}, read at start-up)."}
        if self.substitute is not None:
            now = (f"it holds {self.substitute['config_ids']}, which SGLang cannot serve; the plugin served "
                   f"{self.substitute['served_ids']} meanwhile")
        elif changed is not None:
            now = f"served: {self.report.wiring.ids}, read at start-up; the file now holds {changed.get('ids')}"
        else:
            now = f"now {self.report.wiring.ids}"
        return {"ids": ids, "text": f"To serve it, set eagle_config.eagle_aux_hidden_state_layer_ids to {ids} in "
                                    f"{where} ({now}) and restart."}

    # ---- observed acceptance ------------------------------------------------------------------------
    def count(self, correct_per_request) -> None:
        if self.acceptance_logged or not self.talks:
            return
        for c in correct_per_request:
            self.steps += 1
            self.first_accepted += int(c) >= 1
        self.maybe_log_acceptance()

    def maybe_log_acceptance(self) -> None:
        with self.lock:  # the forward's thread (counting) and the scoring thread both get here
            if self.acceptance_logged or self.predicted is None or self.steps < ACCEPTANCE_STEPS:
                return
            self.acceptance_logged = True
        observed = self.first_accepted / self.steps
        gap = 100 * (self.predicted - observed)
        wiring_ok = self.verdict is not None and self.verdict.get("verdict") == "OK"
        if abs(gap) < GAP_POINTS:
            tail = "they agree"
        elif wiring_ok:
            tail = ("a large gap with the wiring right points at something else: the tokenizer or chat template the "
                    "draft was trained with, its vocabulary map (d2t), an embedding scale the draft does not apply, "
                    "or a sampling setting")
        else:
            tail = "the wiring warning above is the likely cause"
        log.info("eagle3_ops: %s: %s: SGLang accepted the first draft token in %.1f%% of %d verify steps; the replay "
                 "predicted %.1f%% (top-1 agreement of the served wiring): %s", LABEL, self.model_name,
                 100 * observed, self.steps, 100 * self.predicted, tail)
        if self.verdict is not None:
            self.verdict["observed_first_token_acceptance"] = observed
            self.verdict["acceptance_steps"] = self.steps
            _write_result(self.verdict, self.model_name)


def _workdir(model_name: str):
    """(a fresh folder for the recording, the target's config and the draft snapshot, why it is not in the
    cache folder or None). Beside the qualification cache (the states file stays there for the offline replay);
    the system's temporary folder where the cache folder cannot be used (the note names the OS error). The
    folder records its owner (this process), so another server sharing the cache never prunes it while this one
    runs. Raises OSError where no folder can be made at all."""
    base = result_path().parent / "wiring"
    try:
        base.mkdir(parents=True, exist_ok=True)
        _prune(base, model_name)
        d = Path(tempfile.mkdtemp(prefix=f"{model_name}-{time.strftime('%Y%m%d-%H%M%S')}-", dir=base))
        note = None
    except OSError as e:
        where = f" ({e.filename})" if e.filename and str(e.filename) != str(base) else ""
        note = (f"the cache folder {base} cannot be used: {os_error_words(e)}{where}; XDG_CACHE_HOME moves it")
        d = Path(tempfile.mkdtemp(prefix="eagle3_ops-wiring-"))
    _claim(d)
    return d, note


OWNER_FILE = "owner.json"


def _claim(d: Path) -> None:
    """Mark ``d`` as this process's (pid, host): :func:`_prune` of another server leaves it alone while it runs."""
    import socket

    try:
        (d / OWNER_FILE).write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
    except OSError:  # a full disk: the recording's own write says so
        pass


def _in_use(d: Path) -> bool:
    """Whether ``d``'s owner (:func:`_claim`) is a live process on this host."""
    import socket

    try:
        owner = json.loads((d / OWNER_FILE).read_text())
        pid, host = int(owner["pid"]), str(owner["host"])
    except (OSError, ValueError, KeyError, TypeError):
        return False
    if host != socket.gethostname():
        return False  # another machine sharing the cache: only the age tells
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: alive, another user's
        return True
    return True


def _prune(base: Path, model_name: str) -> None:
    """Keep the newest KEEP_RECORDINGS - 1 earlier recordings of this model (each server start makes one),
    never one whose server still runs on this host (another server sharing the cache folder may be using it)
    nor one touched within the replay's time bound (a server on another host). A folder that vanishes meanwhile
    (another server pruning too) is skipped."""
    import shutil

    recent = time.time() - 2 * TIME_LIMIT_S
    found = []
    for d in base.glob(f"{model_name}-*"):
        try:
            if d.is_dir() and not d.is_symlink():
                found.append((d.stat().st_mtime, d))
        except OSError:
            continue
    old = [d for _, d in sorted(found, key=lambda x: x[0])]
    for d in old[:max(0, len(old) - (KEEP_RECORDINGS - 1))]:
        try:
            if d.stat().st_mtime < recent and not _in_use(d):
                shutil.rmtree(d, ignore_errors=True)
        except OSError:
            continue


def _shell(cmd: List[str]) -> str:
    import shlex

    return " ".join(shlex.quote(c) for c in cmd)


def _parse(out: bytes) -> Optional[dict]:
    text = out.decode(errors="replace").strip()
    if not text:
        return None
    try:
        data = json.loads(text)
    except ValueError:
        start = text.find("{")
        try:
            data = json.loads(text[start:]) if start >= 0 else None
        except ValueError:
            return None
    return data if isinstance(data, dict) else None


def _child_env() -> Dict[str, str]:
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = str(THREADS)
    env["CUDA_VISIBLE_DEVICES"] = ""  # the replay runs on the CPU: it never touches the server's GPUs
    env[ENV_SWITCH] = "0"
    return env


# The child sets its own limits before it runs the command: no preexec_fn (that would fork() the whole
# threaded scheduler process instead of spawning, and is unsafe with threads).
_LIMITS_PROLOGUE = """
import ctypes, json, os, resource, runpy, signal, sys
limits = json.loads(sys.argv[1])
try:
    os.nice(19)
except OSError:
    pass
for name, value in (("RLIMIT_AS", limits["address_space"]), ("RLIMIT_CPU", limits["cpu_seconds"])):
    try:
        resource.setrlimit(getattr(resource, name), (value, value))
    except (ValueError, OSError):
        pass
try:  # PR_SET_PDEATHSIG: the replay ends with the server
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
except Exception:
    pass
sys.argv = [sys.argv[2], *sys.argv[3:]]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


def limited(cmd: List[str], address_space: int, cpu_seconds: int) -> List[str]:
    """``cmd`` (``[python, "-m", module, *args]``) run at nice 19 under an address-space and a CPU-time
    limit, killed if the server dies."""
    assert cmd[1] == "-m", cmd
    return [cmd[0], "-c", _LIMITS_PROLOGUE, json.dumps({"address_space": int(address_space),
                                                        "cpu_seconds": int(cpu_seconds)}), *cmd[2:]]


def _write_result(result: dict, model_name: Optional[str] = None, say: bool = True) -> Optional[str]:
    """Write the verdict as JSON (:func:`result_path`; atomically: two servers sharing the cache folder never
    leave half a file). Returns None when written, else why not (said in one line unless ``say`` is False)."""
    path = result_path(model_name)
    try:
        from ..files import replace_atomically

        path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(result, indent=1, default=str) + "\n"
        replace_atomically(path, lambda tmp: Path(tmp).write_text(text))
    except Exception as e:  # never stop SGLang
        why = _cache_write_failure(path, e) if isinstance(e, OSError) else f"could not write {path}: {_cause_text(e)}"
        if not isinstance(e, OSError):
            log.debug("eagle3_ops: %s: writing %s failed", LABEL, path, exc_info=e)
        if say:
            log.warning("eagle3_ops: %s: %s", LABEL, why)
        return why
    if say:
        log.info("eagle3_ops: %s: result written to %s", LABEL, path)
    return None


def _cache_words() -> str:
    home = os.environ.get("XDG_CACHE_HOME")
    return f"XDG_CACHE_HOME={home}" if home else "~/.cache: XDG_CACHE_HOME unset"


def advice(kind: str, folder) -> str:
    """What a user of the live check can change when its recording or result does not fit (``kind``: "memory",
    "disk", "fsize", "permission", "other"): room on the cache's disk (``XDG_CACHE_HOME`` moves the cache
    folder), the server's file-size limit, a permission; or the check off (``EAGLE3_OPS_WIRING_CHECK=0``). Never
    another feature's settings."""
    off = f"{ENV_SWITCH}=0 turns the check off"
    cache = f"set XDG_CACHE_HOME to a folder on a disk with room (now {_cache_words()})"
    if kind == "memory":
        return f"the live check records at most {RECORD_TOKENS} positions; {off}"
    if kind == "disk":
        return f"free space in {folder}, or {cache}, or {off}"
    if kind == "fsize":
        return f"raise the server's file-size limit (ulimit -f), or {off}"
    if kind == "permission":
        return (f"give the server's user write permission on {folder}, or set XDG_CACHE_HOME to a folder it can "
                f"write (now {_cache_words()}), or {off}")
    return f"set XDG_CACHE_HOME to a usable folder (now {_cache_words()}), or {off}"


def _cache_write_failure(path: Path, e: OSError) -> str:
    """One clause for a file of the live check that could not be written: the path, the OS error's name and
    words, and the advice that fits it."""
    from .dump_states import error_kind

    folder = Path(e.filename).parent if e.filename else Path(path).parent
    return f"could not write {path}: {os_error_words(e)}; {advice(error_kind(e), folder)}"


def _cause_text(e: BaseException) -> str:
    """An exception as the cause in a line: an OS error by its errno's name and path, memory as memory, and
    anything else as what it is, a bug of eagle3_ops (its traceback at DEBUG level)."""
    from .dump_states import _bug_note, _cause

    return _cause(e) + _bug_note(e)


# ---- start-up ------------------------------------------------------------------------------------------
def _largest_true(pred, limit: int = 1 << 22) -> Optional[int]:
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


def _largest_fused_forward(hidden_size, dtype) -> Optional[int]:
    """The most tokens a forward may have for SGLang to fuse a layer's all-reduce with its add+RMSNorm
    (then recording a layer SGLang does not capture would run it unfused), by SGLang's own predicates:
    FlashInfer's fusion (``flashinfer_ar_fusion_applies``), CuTe DSL's (its workspace bound
    ``_resolve_max_m``) and aiter's (``aiter_ar_fusion_applies``, a byte bound). 0: none can; None:
    cannot tell, or no bound."""
    from .groups import tp_rank_size

    if tp_rank_size()[1] <= 1:
        return 0
    try:
        import types

        from sglang.srt.layers.flashinfer_comm_fusion import uses_cutedsl_ar_fusion
        from sglang.srt.layers.layer_boundary.residual import add_norm
        from sglang.srt.model_executor.forward_batch_info import ForwardMode
        from sglang.srt.runtime_context import get_exec

        sizes = [_largest_true(add_norm.flashinfer_ar_fusion_applies)]
        if uses_cutedsl_ar_fusion():
            from sglang.srt.layers.layer_boundary.fusions.cutedsl import _resolve_max_m
            from .dump_states import _server_args

            sizes.append(_resolve_max_m(max_running_requests=getattr(_server_args(), "max_running_requests", None)))
        if getattr(get_exec().comm, "enable_aiter_allreduce_fusion", False):
            fb = types.SimpleNamespace(forward_mode=ForwardMode.EXTEND)
            sizes.append(_largest_true(lambda n: add_norm.aiter_ar_fusion_applies(
                torch.empty((n, int(hidden_size)), dtype=dtype or torch.bfloat16, device="meta"), fb)))
        return None if any(x is None for x in sizes) else max(int(x) for x in sizes)
    except Exception:  # cannot tell: assume no bound
        return None


def _largest_forward() -> Optional[int]:
    """The most tokens one prefill forward can have in this server (``--chunked-prefill-size``, else
    ``--max-prefill-tokens``), or None (no server)."""
    from .dump_states import _server_args

    sa = _server_args()
    if sa is None:
        return None
    for name in ("chunked_prefill_size", "max_prefill_tokens"):
        v = getattr(sa, name, None)
        if isinstance(v, int) and v > 0:
            return v
    return None


def _mlp_sync() -> bool:
    """SGLang's own ``require_mlp_sync`` (DP attention, or an MoE all-to-all / dense-TP layout): then
    ``global_num_tokens_cpu`` is set and the prefill graph is a group decision."""
    try:
        from sglang.srt.utils.common import require_mlp_sync

        return bool(require_mlp_sync())
    except Exception:
        return False


def _draft_dir(draft_path) -> Optional[Path]:
    """The draft checkpoint's local folder: the path itself, or the Hugging Face cache's snapshot of it."""
    return _locate_draft(draft_path)[0]


def _locate_draft(draft_path):
    """(the draft checkpoint's local folder, None) or (None, why not): the path itself, or the Hugging Face
    cache's snapshot of it; where the path is there but cannot be used (a dangling symlink, a symlink loop, a
    folder above it that cannot be searched, a file), the OS error's name and the path."""
    import stat as stat_

    if draft_path is None:
        return None, "the server names no draft checkpoint"
    p = Path(str(draft_path)).expanduser()
    try:
        mode = os.stat(p).st_mode
    except FileNotFoundError:
        if os.path.islink(p):
            try:
                return None, (f"the draft checkpoint {p} is a dangling symlink (-> {os.readlink(p)}): what it points "
                              f"to does not exist (ENOENT)")
            except OSError:
                pass
        mode = None
    except NotADirectoryError as e:
        return None, f"the draft checkpoint {p} cannot be reached: {os_error_words(e)} (a part of the path is a file)"
    except OSError as e:  # EACCES (a folder above it that cannot be searched), ELOOP, ENAMETOOLONG, EIO
        hint = (" (the server's user needs search (x) permission on every folder above it)"
                if getattr(e, "errno", None) in (errno.EACCES, errno.EPERM) else "")
        return None, f"the draft checkpoint {p} cannot be reached: {os_error_words(e)}{hint}"
    if mode is not None:
        if stat_.S_ISDIR(mode):
            return p, None
        return None, f"the draft checkpoint {p} is a file, not a folder (SGLang loads a checkpoint folder)"
    from ..doctor.configs import hf_cached_snapshot

    found = hf_cached_snapshot(str(draft_path))
    if found is not None:
        return found, None
    return None, f"the draft checkpoint {str(draft_path)!r} is not a local folder (nor in the Hugging Face cache)"


def _doctor_report(target_config, draft_dir: Path, tp_size: int, pp_size: int = 1,
                   pp_partition: Optional[List[int]] = None, snapshot: Optional[dict] = None):
    """(the doctor's config report, the draft's weight headers); ``snapshot`` (doctor.configs.draft_snapshot):
    the draft read from it (its config as read then, its weight files and nothing else)."""
    from ..doctor import checks, configs

    target = configs.target_from_config(target_config, use_sglang=True)
    if snapshot is not None:
        draft = configs.draft_from_config(snapshot["config"], snapshot["dir"], use_sglang=True)
        weights = configs.read_weight_headers(draft_dir, files=configs.snapshot_weight_files(snapshot))
    else:
        draft = configs.parse_draft(draft_dir, use_sglang=True)
        weights = configs.read_weight_headers(draft_dir)
    from .dump_states import _server_args

    served = getattr(_server_args(), "context_length", None)  # None: the target's own length
    report = checks.run_checks(target, draft, weights, checks.Options(
        engine="sglang", tp=tp_size, pp=pp_size, pp_partition=pp_partition, engine_code="installed",
        server_running=True, served_context_length=served if isinstance(served, int) else None))
    return report, weights


def _pipeline() -> tuple:
    """(pp size, SGLANG_PP_LAYER_PARTITION as a list or None) of this server: where the doctor's pipeline rule
    (only the last stage captures) applies."""
    from .dump_states import _server_args

    pp = getattr(_server_args(), "pp_size", 1)
    pp = pp if isinstance(pp, int) and pp > 0 else 1
    raw = os.environ.get("SGLANG_PP_LAYER_PARTITION", "").strip()
    try:
        partition = [int(x) for x in raw.split(",")] if raw and pp > 1 else None
    except ValueError:
        partition = None
    return pp, partition if partition and len(partition) == pp else None


def _cannot_replay(report, weights) -> Optional[str]:
    """Why the replay cannot score this draft (known from the configs, before anything is recorded)."""
    from ..doctor.replay import draft_implementation, unsupported_draft

    if report.wiring is None or report.training is None:
        return ("the doctor finds no wiring SGLang would serve (see its errors: "
                + ", ".join(f.code for f in report.findings if f.severity == "error") + ")"
                if report.draft.use_aux_hidden_state else "the draft uses no aux hidden states")
    wrong_class = next((f for f in report.findings if f.code == "E_DRAFT_CLASS"), None)
    if wrong_class is not None:  # SGLang serves such a draft with parameters unset: nothing trained to score
        return f"the draft's class does not fit its checkpoint (E_DRAFT_CLASS: {wrong_class.message})"
    return unsupported_draft(report.draft, weights, draft_implementation("sglang"))  # what the replay child runs


def _verdict_text(report) -> str:
    if report is None:
        return "doctor: not run"
    errors = [f.code for f in report.findings if f.severity == "error"]
    warnings = [f.code for f in report.findings if f.severity == "warning"]
    if errors:
        return f"doctor: ERROR {', '.join(errors)}" + (f"; WARNING {', '.join(warnings)}" if warnings else "")
    if warnings:
        return f"doctor: WARNING {', '.join(warnings)}"
    return "doctor: OK (nothing to warn about in the configs)"


UNSERVABLE = "the draft config asks SGLang for captures it will not take (see the ERROR line)"


def _collects_in_packer(owner) -> Optional[bool]:
    """Whether the capture owner's forward collects into SGLang's ``AuxHiddenStatePacker`` (whose ``finalize``
    raises when it got fewer captures than configured), read from its source; None: cannot tell."""
    import inspect

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
    from ..doctor.checks import verified_fix, why_no_fix
    from ..doctor.engines import short_boundary

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


def _eagle3_server():
    """SGLang's server args where this process is an EAGLE-3 server, else None (a script, another algorithm)."""
    from .dump_states import _server_args

    sa = _server_args()
    return sa if sa is not None and str(getattr(sa, "speculative_algorithm", "") or "").upper() == "EAGLE3" else None


# ---- serving what the config meant, so the check can run (the seed's edit) -----------------------------------
_substitutes: Dict[int, dict] = {}   # id(model) -> {"config_ids", "served_ids", "why"}: ids served in place of the config's


def _substitute(report) -> tuple:
    """(ids SGLang takes that feed the first plausible reading of the draft config, else SGLang's default
    boundaries; in words) or (None, why none)."""
    from ..doctor.checks import verified_fix
    from ..doctor.engines import short_boundary

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
    from . import dump_states
    from .groups import tp_group, tp_rank_size
    from .lockstep import same_on_all_ranks

    sub = None
    try:
        if draft_path is None:
            sa = _eagle3_server()
            if sa is None:
                return None
            draft_path = getattr(sa, "speculative_draft_model_path", None)
        if dump_states.server_refusal() is None:
            from ..doctor.configs import draft_snapshot

            draft_dir = _draft_dir(draft_path)
            cfg = target_config if target_config is not None else getattr(model, "config", None)
            if draft_dir is not None and cfg is not None:
                report, _ = _doctor_report(cfg, draft_dir, tp_rank_size()[1], *_pipeline(),
                                           snapshot=draft_snapshot(draft_dir))
                advice = unservable_advice(report, draft_dir, type(model).__name__, None)
                if report.wiring is not None and list(report.wiring.ids or []) == list(ids) and advice is not None:
                    served, why = _substitute(report)
                    if served is not None:
                        sub = {"config_ids": list(ids), "served_ids": list(served), "why": why,
                               "draft_dir": str(draft_dir), "advice": advice}
    except Exception:  # noqa: BLE001 - SGLang's own behaviour stands
        log.debug("eagle3_ops: %s: deciding what to serve failed", LABEL, exc_info=True)
        sub = None
    if not same_on_all_ranks(repr(sub and sub["served_ids"]), tp_group()):
        return None
    if sub is None:
        return None
    _substitutes[id(model)] = sub
    if tp_rank_size()[0] == 0:
        log.error("eagle3_ops: %s: ERROR: %s's eagle_aux_hidden_state_layer_ids %s ask SGLang for captures it will not "
                  "take (its first forward would fail); serving ids %s instead (%s) so the server runs and this check "
                  "finds the wiring the draft was trained on. Served tokens are unchanged (the target verifies every "
                  "draft token); %s=0 keeps SGLang's own behaviour. Details: %s", LABEL,
                  Path(sub["draft_dir"]) / "config.json", sub["config_ids"], sub["served_ids"], sub["why"], ENV_SWITCH,
                  result_path(type(model).__name__))
        log.debug("eagle3_ops: %s: %s", LABEL, sub["advice"])
    return list(sub["served_ids"])


def _advise_now(model, owner, cfg, draft_path, tp_size, check_off: str) -> bool:
    """Rank 0, where the live check does not start for another reason (a server setting, ``check_off``): the
    same ERROR line as :func:`unservable_advice` when the config asks for captures SGLang will not take. True
    when said."""
    try:
        draft_dir = _draft_dir(draft_path)
        if draft_dir is None or cfg is None:
            return False
        report, _ = _doctor_report(cfg, draft_dir, tp_size, *_pipeline())
        advice = unservable_advice(report, draft_dir, type(model).__name__, _collects_in_packer(owner), check_off)
    except Exception:  # noqa: BLE001 - advice only; the server's own errors stand
        log.debug("eagle3_ops: %s: the start-up advice could not be built", LABEL, exc_info=True)
        return False
    if advice:
        log.error("eagle3_ops: %s: %s", LABEL, advice)
    return bool(advice)


def _prepare_check(model, name, cfg, draft_path, served, num_layers, tp_rank, tp_size):
    """This rank's part of the start: (check, why it cannot run or None, boundaries to record, the
    smallest forward that may be recorded)."""
    from ..doctor.configs import DoctorInputError, draft_snapshot
    from ..doctor.states import needed_boundaries

    raw_cfg = cfg if isinstance(cfg, dict) else (cfg.to_dict() if hasattr(cfg, "to_dict") else None)
    draft_dir, why = _locate_draft(draft_path)
    if draft_dir is None:
        return None, why, None, 0
    if raw_cfg is None:
        return None, "the target's config cannot be read", None, 0
    check = WiringCheck(name, draft_dir, raw_cfg, served, num_layers, tp_rank, tp_size)
    try:  # one reading of the draft: what the server serves, and what the replay will score
        check.snapshot = draft_snapshot(draft_dir)
        check.substitute = _substitutes.get(id(model))
        if check.substitute is not None:  # the server captures these ids in place of the config's (ids_to_serve)
            config = json.loads(json.dumps(check.snapshot["config"]))
            config.setdefault("eagle_config", {})["eagle_aux_hidden_state_layer_ids"] = check.substitute["served_ids"]
            check.snapshot["config"] = config
        check.report, weights = _doctor_report(cfg, draft_dir, tp_size, snapshot=check.snapshot)
    except DoctorInputError as e:  # the file it names, and why
        return check, f"the doctor could not read the configs and weights: {e}", None, 0
    except Exception as e:
        log.debug("eagle3_ops: %s: reading the configs failed", LABEL, exc_info=e)
        return check, f"the doctor could not read the configs and weights ({_cause_text(e)})", None, 0
    if unservable_advice(check.report, draft_dir, name, None) is not None:
        return check, UNSERVABLE, None, 0
    why_not = _cannot_replay(check.report, weights)
    expected = [sl.boundary for sl in check.report.wiring.slots] if check.report.wiring is not None else served
    if why_not is None and expected != served:  # the replay's "served" wiring would not be the server's
        why_not = (f"SGLang captures boundaries {served}, but the draft config makes the doctor expect "
                   f"{expected}; report this (the doctor's engine rules may be out of date)")
    if why_not is not None:
        return check, why_not, None, 0
    text = getattr(cfg, "text_config", None) or raw_cfg.get("text_config") or {}
    hidden = getattr(cfg, "hidden_size", None) or raw_cfg.get("hidden_size") or (
        text.get("hidden_size") if isinstance(text, dict) else getattr(text, "hidden_size", None))
    dtype = getattr(getattr(model, "config", None), "torch_dtype", None)
    fused = _largest_fused_forward(hidden, dtype if isinstance(dtype, torch.dtype) else torch.bfloat16)
    if fused is None:
        return check, ("SGLang may fuse a layer's all-reduce with its add+RMSNorm here for forwards of any size, "
                       "and recording would change that layer's kernels"), None, 0
    largest = _largest_forward()
    if fused and largest is not None and fused >= largest:
        return check, (f"SGLang may fuse a layer's all-reduce with its add+RMSNorm in every prefill here (up to "
                       f"{fused} tokens; the largest prefill is {largest}), and recording would change that "
                       f"layer's kernels"), None, 0
    # every boundary 0..L: the replay's search tries each in every slot (a draft can be off by any number of layers)
    return check, None, needed_boundaries(served, num_layers, "all"), fused + 1 if fused else 0


def start(model, *, draft_path=None, target_config=None) -> Optional[WiringCheck]:
    """Set up the live check for a target SGLang just configured for EAGLE-3 capture. Every TP rank calls
    it (they agree on the recording); rank 0 logs. ``draft_path`` / ``target_config``: the server's
    (``--speculative-draft-model-path``, the target's own config) unless given (scripts, tests). Returns
    the check, or None (switched off, or one line saying why not). Never raises: whatever fails is one line
    (an OS error by its name and path; a bug of eagle3_ops as such, its traceback at DEBUG level)."""
    if not enabled():
        return None
    try:
        return _start(model, draft_path, target_config)
    except Exception as e:  # never stop SGLang
        log.debug("eagle3_ops: %s: start-up failed", LABEL, exc_info=e)
        log.warning("eagle3_ops: %s: %s is not checked: %s; serving is unaffected", LABEL, type(model).__name__,
                    _cause_text(e))
        return None


def _start(model, draft_path, target_config) -> Optional[WiringCheck]:
    from ..doctor.states import DumpSettings
    from . import dump_states
    from .capture_hooks import capture_state, configured_captures, find_capture_owner
    from .groups import tp_group, tp_rank_size
    from .lockstep import same_on_all_ranks

    name = type(model).__name__
    tp_rank, tp_size = tp_rank_size()
    say = log.info if tp_rank == 0 else (lambda *a, **k: None)
    dumping = bool(os.environ.get("EAGLE3_OPS_DUMP_STATES", "").strip())
    if draft_path is None:
        sa = _eagle3_server()
        if sa is None:
            if dumping:
                say("eagle3_ops: %s: off while EAGLE3_OPS_DUMP_STATES records (check offline with doctor --replay "
                    "on that file)", LABEL)
            return None  # no EAGLE-3 server here (a script): nothing to check against
        draft_path = getattr(sa, "speculative_draft_model_path", None)
    owner, _ = find_capture_owner(model)
    if owner is None:
        return None
    cfg = target_config if target_config is not None else getattr(model, "config", None)
    # server settings (every rank returns here); ids SGLang will not capture are still said (rank 0, local)
    refused = None if dumping else dump_states.server_refusal()
    if dumping or refused is not None:
        if tp_rank == 0:
            _advise_now(model, owner, cfg, draft_path, tp_size,
                        "EAGLE3_OPS_DUMP_STATES records" if dumping else f"{refused[0]}: {refused[1]}")
        if dumping:
            say("eagle3_ops: %s: off while EAGLE3_OPS_DUMP_STATES records (check offline with doctor --replay on "
                "that file)", LABEL)
        else:
            say("eagle3_ops: %s: off %s (%s); check offline with python -m eagle3_ops doctor --replay", LABEL,
                *refused)
        return None
    inner = owner.inner
    state = capture_state(model)
    served = list(state.layer_ids) if state is not None else sorted(set(configured_captures(inner)))
    num_layers = int(getattr(getattr(inner, "config", None), "num_hidden_layers", len(getattr(inner, "layers", []))))
    # Local work first (files, the doctor: a rank may fail alone, e.g. a draft present on one node only),
    # then ONE agreement every rank takes part in, then the recording (install_recorder votes again).
    check, why_not, needed, min_forward = None, None, None, 0
    try:
        check, why_not, needed, min_forward = _prepare_check(model, name, cfg, draft_path, served, num_layers,
                                                             tp_rank, tp_size)
        if why_not is None and check is not None:
            check.workdir  # made now (rank 0): a folder that cannot be made is said here, before anything is recorded
    except Exception as e:
        log.debug("eagle3_ops: %s: preparing the check failed", LABEL, exc_info=e)
        why_not = (f"no folder for the recording can be made: {_cause_text(e)}" if isinstance(e, OSError) else
                   _cause_text(e))
    agreed = same_on_all_ranks(repr((why_not is None, needed, min_forward)), tp_group())
    if why_not is not None or not agreed:
        report = check.report if check is not None else None
        if why_not == UNSERVABLE and tp_rank == 0:
            log.error("eagle3_ops: %s: %s", LABEL, unservable_advice(report, check.draft_dir, name,
                                                                      _collects_in_packer(owner)))
            return None
        say("eagle3_ops: %s: %s feeds its draft %s (boundaries %s); %s; the live check cannot run: %s", LABEL, name,
            boundaries_in_words(served, num_layers), served, _verdict_text(report),
            why_not or "the TP ranks disagree on what to record (see their logs)")
        return None
    draft_dir = check.draft_dir
    states = check.workdir / "states.safetensors"  # rank 0's (other ranks never write it)
    refused: List[str] = []
    recorder = dump_states.install_recorder(
        model, DumpSettings(states, RECORD_TOKENS, "auto"), boundaries=needed, label=LABEL,
        min_prompt_tokens=MIN_PROMPT_TOKENS, min_forward_tokens=min_forward, close_after=CLOSE_AFTER_TOKENS,
        on_written=check.recorded, advice=advice, on_refused=refused.append)
    if recorder is None:
        if refused:
            say("eagle3_ops: %s: %s feeds its draft %s (boundaries %s); %s; the live check cannot run: %s%s", LABEL,
                name, boundaries_in_words(served, num_layers), served, _verdict_text(check.report), refused[0],
                f" ({check.workdir_note})" if check.workdir_note else "")
        else:
            say("eagle3_ops: %s: %s is not checked: its states cannot be recorded here (see above)", LABEL, name)
        return None
    recorder.background_write = True  # rank 0 writes the file off the forward's thread
    check.recorder = recorder
    _checks.append(check)
    waits = (f"the first prompt(s) of at least {MIN_PROMPT_TOKENS} tokens" if not min_forward else
             f"the first prefill of more than {min_forward - 1} tokens (shorter ones may take SGLang's fused "
             f"all-reduce+RMSNorm, which recording would change)")
    if _mlp_sync():  # the prefill-graph decision is then a group vote the plugin leaves alone
        waits += (" that SGLang runs eagerly (this server syncs MLP batches across ranks, so prefills replayed "
                  "from a CUDA graph are not seen)")
    unreachable = f"; boundaries {recorder.unreachable} cannot be recorded on this model" if recorder.unreachable else ""
    snap = check.snapshot
    if snap is not None:
        from ..doctor.configs import snapshot_weight_files

        if snap.get("left_out") or [Path(f).name for f in snapshot_weight_files(snap)] != ["model.safetensors"]:
            unreachable += f"; the draft's weights: {snap.get('describe')}"  # which files are the checkpoint, said
    if check.workdir_note:
        unreachable += f"; recording in {check.workdir} ({check.workdir_note})"
    say("eagle3_ops: %s: %s feeds its draft %s (boundaries %s); %s; the live check will replay the draft (%s) on %s "
        "(%d+ positions, boundaries %s, up to %.1f MiB host memory) in the background%s (%s=0 turns it off)", LABEL,
        name, boundaries_in_words(served, num_layers), served, _verdict_text(check.report), draft_dir, waits,
        CLOSE_AFTER_TOKENS, recorder.boundaries, recorder.max_bytes / 2**20, unreachable, ENV_SWITCH)
    return check


# ---- SGLang hooks ----------------------------------------------------------------------------------
def after_resolve_spec_tokens(result, *args, **kwargs):
    """AFTER SGLang's ``_resolve_spec_v2_tokens(self, result, batch)``: count the verify steps whose first
    draft token was accepted (``num_correct_drafts_per_req_cpu``, host ints SGLang already made)."""
    if not _checks:
        return result
    batch_result = kwargs.get("result", args[1] if len(args) > 1 else None)
    correct = getattr(batch_result, "num_correct_drafts_per_req_cpu", None)
    if correct:
        for check in _checks:
            check.count(correct)
    return result


def checks() -> List[WiringCheck]:
    return list(_checks)
