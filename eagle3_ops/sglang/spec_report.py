"""Why speculation pays what it pays: acceptance per draft position, where each cycle's time goes, and the
setting those two predict best, in the server log (TP rank 0) and as JSON; ``python -m eagle3_ops spec-report``
prints the same table offline.

* **Acceptance per draft position**, counted from SGLang's own verify bookkeeping (``num_correct_drafts_per_req_cpu``,
  the host ints ``_resolve_spec_v2_tokens`` makes): a histogram of the accepted draft tokens per verified request
  step. Position i's acceptance is the share of steps that accepted i drafts among those that accepted i - 1 (the
  chain: position i is reached only when the ones before were accepted); the mean accepted length counts the bonus
  token, as SGLang's own ``accept_length`` does. Each position is compared with what the live wiring check's
  replay predicts for the served wiring: its first-step top-1 agreement, and the later steps' acceptance, which the
  replay scores by feeding SGLang's own draft head its own outputs (``doctor --replay-steps``: the server's steps).
* **Where a cycle's time goes**: one decode cycle in :data:`SAMPLE_EVERY` (TP rank 0), its phases timed by events on
  the current stream (CUDA events on a GPU, read once they have completed: no sync; the host clock on a CPU):
  the draft's multi-step forwards (``EagleDraftWorker.draft``), the target's verify forward (``EAGLEWorkerV2.verify``),
  the draft extend after it (``_draft_extend_for_decode``), and the rest of ``forward_batch_generation``. The parts
  sum to the cycle by construction (the rest is what the phases leave).
* **The setting it predicts best, a PREDICTION**: for k = 1..S draft steps (S served; acceptance beyond S is not
  measured) the expected tokens per cycle ``1 + sum_{i<=k} prod_{j<=i} p_j`` and the cycle time
  ``rest + extend + verify + draft * k / S`` (the draft's forwards taken to scale with the steps, the verify forward
  to cost the same for fewer tokens: memory-bound at the batch sizes where speculation pays), their ratio, against
  no speculation (one token per ``verify + rest``: a decode step taken to cost a verify forward).

Counting and sampling cost a few µs per cycle on the host (``benchmarks/bench_spec_report.py``). The report is on
with the plugin; ``EAGLE3_OPS_SPEC_REPORT=0`` turns it off. It never changes what is served: it only reads.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

log = logging.getLogger("eagle3_ops.sglang")

ENV_SWITCH = "EAGLE3_OPS_SPEC_REPORT"
FIRST_AFTER_CYCLES = 1000   # verified request steps before the first report line
EVERY_S = 600.0             # then at most one report per this many seconds
SAMPLE_EVERY = 64           # one decode cycle in this many is timed
KEEP_SAMPLES = 256          # timed cycles kept (the newest)
MIN_TIMED = 4               # timed cycles before a prediction is made (one sample is too few to predict from)
MIN_GAIN = 0.02             # a predicted gain below this is not worth a change of setting (the estimates' noise)

_WORKER = "sglang.srt.speculative.eagle_worker_v2"
CYCLE_TARGET = f"{_WORKER}.EAGLEWorkerV2.forward_batch_generation"
PHASE_TARGETS = {"draft": f"{_WORKER}.EagleDraftWorker.draft",
                 "verify": f"{_WORKER}.EAGLEWorkerV2.verify",
                 "draft_extend": f"{_WORKER}.EagleDraftWorker._draft_extend_for_decode"}
PHASES = ("draft", "verify", "draft_extend")


def enabled() -> bool:
    """Whether the report runs (``EAGLE3_OPS_SPEC_REPORT``, default on; a bad value: one line, and off)."""
    from .. import settings

    return settings.switch_or_off(ENV_SWITCH, log)


# ---- acceptance per position -------------------------------------------------------------------------
@dataclass
class Acceptance:
    """Accepted draft tokens per verified request step, as a histogram (``hist[c]``: steps that accepted c)."""
    hist: List[int] = field(default_factory=list)
    steps: int = 0   # verified request steps counted (the histogram's sum)

    def add(self, correct_per_request) -> None:
        """Count one verify step's requests (``correct_per_request``: accepted draft tokens per request)."""
        hist = self.hist
        n = 0
        for c in correct_per_request:
            c = int(c)
            if c >= len(hist):
                hist.extend([0] * (c + 1 - len(hist)))
            hist[c] += 1
            n += 1
        self.steps += n

    def reached(self, steps: int) -> List[int]:
        """``[n_0, n_1, ..., n_steps]``: request steps that accepted at least i draft tokens (n_0: all)."""
        out, left = [], self.steps
        for i in range(steps + 1):
            out.append(left)
            left -= self.hist[i] if i < len(self.hist) else 0
        return out

    def per_position(self, steps: int) -> List[Optional[float]]:
        """Position i's acceptance given the ones before (i = 1..steps): n_i / n_{i-1}; None where n_{i-1} = 0."""
        n = self.reached(steps)
        return [n[i] / n[i - 1] if n[i - 1] else None for i in range(1, steps + 1)]

    def mean_accepted_length(self) -> Optional[float]:
        """Tokens per verify step, the bonus token included (SGLang's accept length)."""
        total = self.steps
        return (sum(c * k for c, k in enumerate(self.hist)) / total + 1) if total else None


# ---- where a cycle's time goes ---------------------------------------------------------------------------
class _HostMark:
    """A host-clock mark (the CPU): what a CUDA event is on a GPU."""
    __slots__ = ("t",)

    def __init__(self):
        self.t = time.perf_counter()

    def query(self) -> bool:
        return True

    def elapsed_ms(self, end: "_HostMark") -> float:
        return (end.t - self.t) * 1e3


class _DeviceMark:
    """A CUDA event recorded on the current stream (no sync); read once it has completed."""
    __slots__ = ("event",)

    def __init__(self):
        import torch

        self.event = torch.cuda.Event(enable_timing=True)
        self.event.record()

    def query(self) -> bool:
        return self.event.query()

    def elapsed_ms(self, end: "_DeviceMark") -> float:
        return self.event.elapsed_time(end.event)


def make_mark(device_type: str):
    """A mark now on ``device_type``'s timeline (``cuda``: an event on the current stream; else the host clock)."""
    return _DeviceMark() if device_type == "cuda" else _HostMark()


@dataclass
class CycleSample:
    """One timed cycle: its start and end marks and each phase's (start, end) marks, in order."""
    start: object
    end: object = None
    phases: List[tuple] = field(default_factory=list)   # (phase, start mark, end mark)

    def ready(self) -> bool:
        """Whether every mark has completed (its times can be read without waiting; each is queried, so marks on
        different streams are read only once all are done)."""
        return self.end is not None and all(m.query() for m in self._marks())

    def _marks(self):
        yield self.end
        yield self.start
        for _, a, b in self.phases:
            yield a
            yield b

    def times_ms(self) -> Dict[str, float]:
        """{phase: ms, ..., "rest": the cycle minus its phases, "cycle": the whole}: the parts sum to the cycle."""
        out = {p: 0.0 for p in PHASES}
        for phase, a, b in self.phases:
            out[phase] += a.elapsed_ms(b)
        total = self.start.elapsed_ms(self.end)
        out["rest"] = total - sum(out[p] for p in PHASES)
        out["cycle"] = total
        return out


class CycleTimes:
    """Sampled cycles (one in :data:`SAMPLE_EVERY`, from the SAMPLE_EVERY-th on: not the server's first cycles),
    read once complete, the newest :data:`KEEP_SAMPLES` kept."""

    def __init__(self, sample_every: Optional[int] = None):
        self.sample_every = SAMPLE_EVERY if sample_every is None else int(sample_every)
        self.seen = 0
        self.current: Optional[CycleSample] = None
        self.pending: List[CycleSample] = []
        self.done: List[Dict[str, float]] = []

    def begin(self, device_type: str) -> bool:
        """A decode cycle starts: whether it is timed (then :meth:`end` must follow)."""
        self.seen += 1
        if self.current is not None or self.seen % self.sample_every:
            return False
        self.current = CycleSample(make_mark(device_type))
        return True

    def end(self, device_type: str) -> None:
        """The timed cycle ends: its end mark, and any earlier sample that has completed is read."""
        sample, self.current = self.current, None
        if sample is None:
            return
        sample.end = make_mark(device_type)
        self.pending.append(sample)
        self.collect()

    def collect(self) -> None:
        """Read the samples whose marks have completed (never waits)."""
        still = []
        for s in self.pending:
            if s.ready():
                self.done.append(s.times_ms())
            else:
                still.append(s)
        self.pending = still[-KEEP_SAMPLES:]
        del self.done[:-KEEP_SAMPLES]

    def mean_ms(self) -> Optional[Dict[str, float]]:
        """The mean of each part over the read samples, or None before the first."""
        if not self.done:
            return None
        keys = self.done[0].keys()
        return {k: sum(d[k] for d in self.done) / len(self.done) for k in keys}


# ---- the prediction --------------------------------------------------------------------------------------
def predict(p: List[Optional[float]], ms: Dict[str, float]) -> dict:
    """PREDICTION, from measured per-position acceptance ``p`` (served S = len(p) steps) and mean phase times
    ``ms`` (draft, verify, draft_extend, rest): per k = 1..S draft steps the expected tokens per cycle, the cycle
    time and tokens per ms; no speculation (one token per verify + rest); the best setting and its gain over the
    served one. Acceptance beyond S is not measured, so no k > S is predicted."""
    S = len(p)
    rows, reach, tokens = [], 1.0, 1.0
    for k in range(1, S + 1):
        reach *= p[k - 1] if p[k - 1] is not None else 0.0
        tokens += reach
        cycle = ms["rest"] + ms["draft_extend"] + ms["verify"] + ms["draft"] * k / S
        rows.append({"steps": k, "draft_tokens": k + 1, "tokens_per_cycle": tokens, "cycle_ms": cycle,
                     "tokens_per_ms": tokens / cycle if cycle > 0 else None})
    plain = ms["verify"] + ms["rest"]
    served = rows[-1]
    best = max(rows, key=lambda r: r["tokens_per_ms"] or 0.0)
    base = {"steps": 0, "tokens_per_cycle": 1.0, "cycle_ms": plain, "tokens_per_ms": 1.0 / plain if plain > 0 else None}
    for r in rows + [base]:
        r["vs_served"] = (r["tokens_per_ms"] / served["tokens_per_ms"] - 1) if r["tokens_per_ms"] and \
            served["tokens_per_ms"] else None
    return {"rows": rows, "no_speculation": base, "best": best["steps"], "served": S,
            "speculation_pays": bool(base["tokens_per_ms"] is not None and best["tokens_per_ms"] is not None
                                     and best["tokens_per_ms"] > base["tokens_per_ms"])}


# ---- the report ------------------------------------------------------------------------------------------
class SpecReport:
    """This process's report (TP rank 0): the counts, the sampled cycle times, when to say them, where to write."""

    def __init__(self, steps: int, topk: int = 1, draft_tokens: Optional[int] = None, model_name: str = "",
                 device_type: str = "cpu"):
        self.steps, self.topk = int(steps), int(topk)
        self.draft_tokens = draft_tokens if draft_tokens is not None else self.steps + 1
        self.model_name, self.device_type = model_name, device_type
        self.acceptance = Acceptance()
        self.times = CycleTimes()
        self.next_at_steps = FIRST_AFTER_CYCLES
        self.last_logged: Optional[float] = None

    def count(self, correct_per_request) -> None:
        """One verify step's accepted drafts per request; the report line when due."""
        self.acceptance.add(correct_per_request)
        if self.acceptance.steps >= self.next_at_steps and self._due():
            self.say()

    def _due(self) -> bool:
        now = time.monotonic()
        if self.last_logged is not None and now - self.last_logged < EVERY_S:
            return False
        self.last_logged = now
        return True

    def replay_predicted(self) -> Optional[dict]:
        """What the live wiring check's replay predicts for the served wiring, per draft step: {"per_step": [step 1's
        top-1 agreement, the later steps' acceptance given the ones before where it scored them (``--replay-steps``,
        the draft fed its own outputs)], "positions": what each rests on}, or None before it has scored."""
        from .wiring_check import checks

        for check in checks():
            if check.predicted is None:
                continue
            chain = (check.verdict or {}).get("chain") or {}
            if chain.get("per_step"):
                return {"per_step": list(chain["per_step"]), "positions": list(chain.get("positions") or [])}
            return {"per_step": [float(check.predicted)], "positions": [(check.verdict or {}).get("tokens")]}
        return None

    def to_json(self) -> dict:
        """Everything the offline report prints: counts, acceptance, cycle times, the prediction."""
        self.times.collect()
        p = self.acceptance.per_position(self.steps)
        ms = self.times.mean_ms()
        return {"model": self.model_name, "steps": self.steps, "topk": self.topk, "draft_tokens": self.draft_tokens,
                "verified_steps": self.acceptance.steps, "histogram": list(self.acceptance.hist),
                "acceptance_per_position": p, "mean_accepted_length": self.acceptance.mean_accepted_length(),
                "replay_predicted": self.replay_predicted(), "clock": "cuda events" if
                self.device_type == "cuda" else "host clock", "timed_cycles": len(self.times.done),
                "cycle_ms": ms, "prediction": predict(p, ms) if ms is not None and self.steps > 0 and
                len(self.times.done) >= MIN_TIMED else None}

    def say(self) -> None:
        """Log the report (one summary line naming the best setting, then the table) and write the JSON."""
        data = self.to_json()
        path = write(data)
        lines = render(data)
        log.info("eagle3_ops: speculation report: %s%s", lines[0], f" Details: {path}" if path else "")
        for line in lines[1:]:
            log.info("eagle3_ops: speculation report: %s", line)


def result_path(model_name: str = "") -> Path:
    """Where the report is written: next to the live wiring check's result."""
    from .wiring_result import result_path as wiring_path

    return wiring_path().parent / (f"spec_report-{model_name}.json" if model_name else "spec_report.json")


def write(data: dict) -> Optional[Path]:
    """Write ``data`` as the JSON report (atomically); the path, or None where it could not be written (said once)."""
    from ..files import replace_atomically
    from .serving import warn_once

    path = result_path(data.get("model") or "")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(data, indent=1) + "\n"
        replace_atomically(path, lambda tmp: Path(tmp).write_text(text))
    except OSError as e:
        warn_once(f"spec_report:{path}", "eagle3_ops: speculation report: could not write %s (%s)", path, e)
        return None
    return path


def _pct(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def render(data: dict) -> List[str]:
    """The report as lines: a summary naming the best predicted setting, acceptance per position, the cycle's
    parts, and the PREDICTION table."""
    S, p = data["steps"], data["acceptance_per_position"]
    lines = []
    pred, ms = data.get("prediction"), data.get("cycle_ms")
    if pred is None:
        summary = (f"{data['verified_steps']} verified request steps, {data.get('timed_cycles', 0)} timed cycles: no "
                   f"prediction before {MIN_TIMED} (one decode cycle in {SAMPLE_EVERY} is timed)")
    else:
        best = next(r for r in pred["rows"] if r["steps"] == pred["best"])
        if best["tokens_per_ms"] is None or pred["no_speculation"]["tokens_per_ms"] is None:
            summary = "PREDICTION: none (a measured time is zero)"
        elif not pred["speculation_pays"]:
            plain = pred["no_speculation"]["tokens_per_ms"]
            summary = (f"PREDICTION: speculation costs more than it gives here: {plain:.3f} tokens/ms without it, "
                       f"at most {best['tokens_per_ms']:.3f} with it ({best['steps']} draft steps)")
        elif pred["best"] == S:
            summary = (f"PREDICTION: the served {S} draft steps are the best of 1..{S} "
                       f"({best['tokens_per_ms']:.3f} tokens/ms; more steps are not predicted: their acceptance is "
                       f"not measured)")
        elif (best["vs_served"] or 0.0) < MIN_GAIN:
            summary = (f"PREDICTION: the best of 1..{S} draft steps, {best['steps']}, is only "
                       f"{_signed(best['vs_served'])} over the served {S} (within {100 * MIN_GAIN:.0f}%, the "
                       f"estimates' noise): keep the served setting")
        else:
            flags = f"--speculative-num-steps {best['steps']}" + (
                f" --speculative-num-draft-tokens {best['draft_tokens']}" if data["topk"] == 1 else "")
            summary = (f"PREDICTION: {best['steps']} draft steps ({flags}) would give "
                       f"{_signed(best['vs_served'])} tokens/s over the served {S}")
    lines.append(summary + ".")
    pos = ", ".join(f"{i}: {_pct(x)}" for i, x in enumerate(p, 1))
    replayed = data.get("replay_predicted") or {}
    said = ", ".join(f"{i}: {_pct(x)}" + (f" ({n} positions)" if n is not None else "")
                     for i, (x, n) in enumerate(zip(replayed.get("per_step") or [],
                                                   list(replayed.get("positions") or []) + [None] * S), 1))
    lines.append(f"acceptance per draft position (given the ones before; {data['verified_steps']} verified request "
                 f"steps, {S} steps, topk {data['topk']}): {pos}; mean accepted length "
                 f"{data['mean_accepted_length'] or 0:.2f} tokens per step"
                 + (f"; the replay predicts {said} for the served wiring (a gap points at the serving side: sampling, "
                    f"chat template, an engine path)" if said else ""))
    if ms is not None:
        parts = " + ".join(f"{k.replace('_', ' ')} {ms[k]:.3f} ms" for k in ("draft", "verify", "draft_extend", "rest"))
        lines.append(f"a decode cycle ({data['timed_cycles']} timed, {data['clock']}; this server's own): {parts} = "
                     f"{ms['cycle']:.3f} ms")
    if pred is not None:
        lines.append("PREDICTION (from the measured acceptance and times; draft time taken to scale with the steps, "
                     "the verify forward to cost the same for fewer tokens):")
        lines.append(f"  {'steps':>5} {'tokens/cycle':>12} {'cycle ms':>9} {'tokens/ms':>9} {'vs served':>9}")
        for r in [pred["no_speculation"]] + pred["rows"]:
            lines.append(f"  {r['steps']:>5} {r['tokens_per_cycle']:>12.3f} {r['cycle_ms']:>9.3f} "
                         f"{(r['tokens_per_ms'] or 0):>9.3f} {_signed(r['vs_served']):>9}"
                         + ("  (served)" if r["steps"] == S else "  (no speculation)" if r["steps"] == 0 else ""))
    return lines


def _signed(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{100 * x:+.1f}%"


# ---- SGLang hooks ------------------------------------------------------------------------------------------
_report: Optional[SpecReport] = None
_declined = False   # decided at the first decode cycle: no report in this process (off, not rank 0, adaptive, ...)
_lock = threading.Lock()


def report() -> Optional[SpecReport]:
    """This process's report, or None (off, not TP rank 0, or no speculative decode seen yet)."""
    return _report


def _ensure(worker) -> Optional[SpecReport]:
    """The report, made at the first decode cycle of TP rank 0 from the spec worker's own settings; the decision
    not to make one is kept too (every later cycle then costs one check)."""
    global _report, _declined
    if _report is not None or _declined:
        return _report
    with _lock:
        if _report is None and not _declined:
            _declined = True
            if not enabled():
                return None
            from .groups import tp_rank_size

            rank, _ = tp_rank_size()
            if rank != 0:
                return None
            if getattr(worker, "adaptive_controller", None) is not None:
                log.info("eagle3_ops: speculation report: off under adaptive speculation (the draft steps change per "
                         "batch; SGLang's adaptive controller chooses them)")
                return None
            steps = int(getattr(worker, "speculative_num_steps", 0) or 0)
            if steps <= 0:
                return None
            _declined = False
            device = getattr(worker, "device", "cpu")
            target = getattr(getattr(getattr(worker, "target_worker", None), "model_runner", None), "model", None)
            _report = SpecReport(steps, int(getattr(worker, "topk", 1) or 1),
                                 getattr(worker, "speculative_num_draft_tokens", None),
                                 type(target).__name__ if target is not None else "",
                                 str(getattr(device, "type", device)).split(":")[0])
    return _report


def around_cycle(original, *args, **kwargs):
    """AROUND ``EAGLEWorkerV2.forward_batch_generation``: a decode cycle, timed when sampled."""
    worker = kwargs.get("self", args[0] if args else None)
    batch = kwargs.get("batch", args[1] if len(args) > 1 else None)
    rep = None
    try:
        mode = getattr(batch, "forward_mode", None)
        decode = mode is not None and not mode.is_extend() and not getattr(batch, "is_extend_in_batch", False) \
            and not mode.is_idle()
        rep = _ensure(worker) if decode else None
        if rep is not None and (rep.device_type != "cuda" or not _capturing()):
            timed = rep.times.begin(rep.device_type)
        else:
            timed = False
    except Exception:  # a report only: never stop SGLang
        log.debug("eagle3_ops: speculation report: could not time a cycle", exc_info=True)
        timed = False
    try:
        return original(*args, **kwargs)
    finally:
        if timed:
            try:
                rep.times.end(rep.device_type)
            except Exception:
                log.debug("eagle3_ops: speculation report: could not time a cycle", exc_info=True)


def around_phase(phase: str):
    """AROUND hook of one phase (draft, verify, draft_extend): its marks, inside a timed cycle only."""
    def hook(original, *args, **kwargs):
        rep = _report
        sample = rep.times.current if rep is not None else None
        start = None
        if sample is not None:
            try:
                start = make_mark(rep.device_type)
            except Exception:  # a report only: never stop SGLang
                log.debug("eagle3_ops: speculation report: could not time %s", phase, exc_info=True)
        if start is None:
            return original(*args, **kwargs)
        result = original(*args, **kwargs)  # an exception of SGLang's own passes through untouched
        try:
            sample.phases.append((phase, start, make_mark(rep.device_type)))
        except Exception:
            log.debug("eagle3_ops: speculation report: could not time %s", phase, exc_info=True)
        return result
    return hook


def after_resolve_spec_tokens(correct_per_request) -> None:
    """The verify step's accepted drafts per request (SGLang's own bookkeeping), counted."""
    rep = _report
    if rep is not None and correct_per_request:
        rep.count(correct_per_request)


def _capturing() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def reset() -> None:
    """Forget this process's report and its decision (tests)."""
    global _report, _declined
    _report, _declined = None, False
