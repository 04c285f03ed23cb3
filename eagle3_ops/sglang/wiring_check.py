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
SGLang's own predicates, wiring_recording.largest_fused_forward), only longer forwards are recorded, so no
recorded forward runs another kernel than stock. The recorded prefills run SGLang's eager path instead
of its prefill graph (on a GPU the exact token count instead of the padded bucket). After it has run,
it costs one list check per hooked call.

The parts, one job each (each imports only parts named before it; none imports this module):
wiring_result (the switch, the JSON result, a failure's words), wiring_workdir (the recording's folder),
limited_run and wiring_replay_process (the replay child), wiring_verdict (the verdict line, the fix),
wiring_acceptance (observed against predicted), wiring_recording (the recorder, what may be recorded),
wiring_doctor (the doctor's reading at start-up), wiring_unservable (a config SGLang cannot serve, the ids served
instead), wiring_startup (this rank's reading at start-up: can the check run, what it records). This module
starts the check (:func:`start`) and runs it (:class:`WiringCheck`).
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
from pathlib import Path
from typing import List, Optional

from .._cli import EXIT_USAGE
from ..doctor.configs import changed_since_start, snapshot_changes
from . import dump_states, groups, lockstep, wiring_recording, wiring_startup
from . import wiring_replay_process as replay_process
from .capture_hooks import capture_state, configured_captures, find_capture_owner
from .wiring_acceptance import ACCEPTANCE_STEPS, ACCEPTANCE_TARGET, GAP_POINTS, AcceptanceCount, correct_drafts
from .wiring_doctor import eagle3_server, locate_draft
from .wiring_replay_process import THREADS, child_env, limited, parse_report, shell
from .wiring_result import (ENV_SWITCH, LABEL, RECORD_TOKENS, advice, cache_write_failure, cause_text, enabled,
                            result_path, write_result)
from .wiring_unservable import UNSERVABLE, advise_now, collects_in_packer, ids_to_serve, unservable_advice
from .wiring_verdict import boundaries_in_words, conclude, verdict_text
from .wiring_workdir import KEEP_RECORDINGS, OWNER_FILE, make_workdir

log = logging.getLogger("eagle3_ops.sglang")

MIN_PROMPT_TOKENS = 32     # a shorter prompt gives the replay too little context per position
CLOSE_AFTER_TOKENS = 256   # the recording closes after the prompt that brings it to this many
TIME_LIMIT_S = 900         # the background replay's wall-clock bound

# The names other modules and tests use from here.
__all__ = ["ACCEPTANCE_STEPS", "ACCEPTANCE_TARGET", "CLOSE_AFTER_TOKENS", "ENV_SWITCH", "GAP_POINTS",
           "KEEP_RECORDINGS", "LABEL", "MIN_PROMPT_TOKENS", "OWNER_FILE", "RECORD_TOKENS", "THREADS", "TIME_LIMIT_S",
           "UNSERVABLE", "WiringCheck", "advice", "after_resolve_spec_tokens", "boundaries_in_words", "checks",
           "child_env", "enabled", "ids_to_serve", "limited", "parse_report", "result_path", "start",
           "unservable_advice"]

_checks: List["WiringCheck"] = []


class WiringCheck(AcceptanceCount):
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
            if self.tp_rank == 0:  # a folder touched within twice the replay's bound may be another host's
                self._workdir, self.workdir_note = make_workdir(self.model_name, 2 * TIME_LIMIT_S)
            else:
                self._workdir = Path(tempfile.gettempdir()) / "eagle3_ops-unused"
        return self._workdir

    @property
    def talks(self) -> bool:
        """Whether this rank logs and scores (TP rank 0; the other ranks only take part in the recording)."""
        return self.tp_rank == 0

    # ---- the recording finished -------------------------------------------------------------------
    def recorded(self, path: Optional[str]) -> None:
        """The recording closed (``path``: the states file, None when nothing was recorded): start the replay in the
        background on rank 0, or say why there is nothing to score."""
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
        unsaved = write_result({"model": self.model_name, "verdict": "not checked", "why": why}, self.model_name,
                               say=False)
        log.warning("eagle3_ops: %s: %s could not be checked: %s; serving is unaffected%s", LABEL, self.model_name,
                    why, f" (the result could not be saved either: {unsaved})" if unsaved else "")
        if not unsaved:
            log.info("eagle3_ops: %s: result written to %s", LABEL, path)

    # ---- the background replay ---------------------------------------------------------------------
    def command(self, states: Path, target_dir: Path, snapshot: Optional[Path] = None) -> List[str]:
        """The doctor replay command for ``states`` (argv, run by :mod:`.wiring_replay_process`)."""
        return replay_process.replay_command(self.draft_dir, states, target_dir, self.tp_size, snapshot,
                                             served_draft_steps())

    def memory_limit(self, states: Path) -> int:
        """The replay process's address-space limit in bytes (:func:`.wiring_replay_process.memory_limit`)."""
        return replay_process.memory_limit(states, self.draft_dir, self.snapshot)

    def _offline_command(self, states: Path) -> str:
        """The command that ran, as a user types it (on the draft as it is on disk then)."""
        return shell(replay_process.as_typed(self.command(states, self.workdir / "target")))

    def _changed_since_start(self) -> Optional[str]:
        """Why the draft's weights on disk are no longer those the server loaded, or None."""
        if self.snapshot is None:
            return None
        changes = snapshot_changes(self.snapshot, roles=("index", "weights"))
        return changed_since_start(self.snapshot, changes) if changes else None

    def _score(self, states: Path) -> None:
        try:
            self._replay(states)
        except Exception as e:  # never stop SGLang: the cause in one line; a real bug's traceback at DEBUG
            log.debug("eagle3_ops: %s: the replay of %s failed", LABEL, states, exc_info=e)
            self._fail(cause_text(e))

    def _replay(self, states: Path) -> None:
        changed = self._changed_since_start()  # what the server loaded must still be on disk to be scored as served
        if changed is not None:
            self._fail(changed)
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
            self._fail(cache_write_failure(writing, e))
            return
        offline = self._offline_command(states)
        run = replay_process.run(self.command(states, target_dir, snapshot_file),
                                 address_space=self.memory_limit(states), time_limit_s=TIME_LIMIT_S, threads=THREADS,
                                 offline=offline)
        if run.report is None:
            # The doctor stops with EXIT_USAGE on input it cannot use, a draft changed while it read it included:
            # the snapshot, read again here, tells that case (the same words the child printed)
            changed = self._changed_since_start() if run.returncode == EXIT_USAGE else None
            self._fail(changed or run.failure)
            return
        result, why = conclude(self, run.report, states, run.seconds, offline)
        if result is None:
            self._fail(why)
            return
        with self.lock:  # the verdict first: the acceptance line reads both
            self.verdict = result
            self.predicted = float(result["configured"]["accuracy"])
            self.phase = "done"
        write_result(result, self.model_name)
        self.maybe_log_acceptance()


# ---- start-up ------------------------------------------------------------------------------------------
def _prepare_check(model, name, cfg, draft_path, served, num_layers, tp_rank, tp_size):
    """This rank's part of the start: (check, why it cannot run or None, boundaries to record, the
    smallest forward that may be recorded)."""
    raw_cfg = cfg if isinstance(cfg, dict) else (cfg.to_dict() if hasattr(cfg, "to_dict") else None)
    draft_dir, why = locate_draft(draft_path)
    if draft_dir is None:
        return None, why, None, 0
    if raw_cfg is None:
        return None, "the target's config cannot be read", None, 0
    check = WiringCheck(name, draft_dir, raw_cfg, served, num_layers, tp_rank, tp_size)
    return (check, *wiring_startup.prepare(check, model, cfg, raw_cfg))


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
                    cause_text(e))
        return None


def _start(model, draft_path, target_config) -> Optional[WiringCheck]:
    name = type(model).__name__
    tp_rank, tp_size = groups.tp_rank_size()
    say = log.info if tp_rank == 0 else (lambda *a, **k: None)
    dumping = bool(os.environ.get("EAGLE3_OPS_DUMP_STATES", "").strip())
    if draft_path is None:
        sa = eagle3_server()
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
            advise_now(model, owner, cfg, draft_path, tp_size,
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
            # the property makes the folder now (rank 0): a folder that cannot be made is said here, before anything
            # is recorded
            check.workdir  # noqa: B018
    except Exception as e:
        log.debug("eagle3_ops: %s: preparing the check failed", LABEL, exc_info=e)
        why_not = (f"no folder for the recording can be made: {cause_text(e)}" if isinstance(e, OSError) else
                   cause_text(e))
    agreed = lockstep.same_on_all_ranks(repr((why_not is None, needed, min_forward)), groups.tp_group())
    feeds = f"{name} feeds its draft {boundaries_in_words(served, num_layers)} (boundaries {served})"
    if why_not is not None or not agreed:
        report = check.report if check is not None else None
        if why_not == UNSERVABLE and tp_rank == 0:
            log.error("eagle3_ops: %s: %s", LABEL, unservable_advice(report, check.draft_dir, name,
                                                                      collects_in_packer(owner)))
            return None
        say("eagle3_ops: %s: %s; %s; the live check cannot run: %s", LABEL, feeds, verdict_text(report),
            why_not or "the TP ranks disagree on what to record (see their logs)")
        return None
    recorder, refused = wiring_recording.install(
        model, check.workdir / "states.safetensors", needed, min_prompt_tokens=MIN_PROMPT_TOKENS,
        min_forward=min_forward, close_after=CLOSE_AFTER_TOKENS, on_written=check.recorded)
    if recorder is None:
        if refused:
            say("eagle3_ops: %s: %s; %s; the live check cannot run: %s%s", LABEL, feeds, verdict_text(check.report),
                refused, f" ({check.workdir_note})" if check.workdir_note else "")
        else:
            say("eagle3_ops: %s: %s is not checked: its states cannot be recorded here (see above)", LABEL, name)
        return None
    check.recorder = recorder
    _checks.append(check)
    say("eagle3_ops: %s: %s; %s; the live check will replay the draft (%s) on %s (%d+ positions, boundaries %s, up "
        "to %.1f MiB host memory) in the background%s (%s=0 turns it off)", LABEL, feeds, verdict_text(check.report),
        check.draft_dir, wiring_recording.waits_for(MIN_PROMPT_TOKENS, min_forward), CLOSE_AFTER_TOKENS,
        recorder.boundaries, recorder.max_bytes / 2**20, wiring_startup.recording_notes(check, recorder), ENV_SWITCH)
    return check


# ---- SGLang hooks ----------------------------------------------------------------------------------
def after_resolve_spec_tokens(result, *args, **kwargs):
    """AFTER SGLang's ``_resolve_spec_v2_tokens(self, result, batch)`` (:data:`ACCEPTANCE_TARGET`): count the verify
    steps whose first draft token was accepted."""
    if not _checks:
        return result
    correct = correct_drafts(args, kwargs)
    if correct:
        for check in _checks:
            check.count(correct)
    return result


def served_draft_steps() -> int:
    """The server's ``--speculative-num-steps`` (1 where it cannot be read): how many draft steps the replay scores."""
    try:
        steps = int(getattr(dump_states.server_args(), "speculative_num_steps", None) or 1)
    except Exception:  # noqa: BLE001 - no server (tests, the offline command): the first step only
        return 1
    return max(1, steps)


def checks() -> List[WiringCheck]:
    """The live checks started in this process (one per target; tests and the offline report read them)."""
    return list(_checks)
