"""The speculation report (eagle3_ops/sglang/spec_report.py), on the CPU with SGLang's own classes:

- acceptance per draft position counted from SGLang's own verify bookkeeping (``_resolve_spec_v2_tokens`` as the
  scheduler calls it, through the plugin's hook), exactly a hand-computed fixture; the tokens it serves are the same
  with the report on and off;
- the cycle's time split (SGLang's own ``EAGLEWorkerV2.forward_batch_generation`` around stand-in phases of known
  length, each under the plugin's phase hook) sums to the cycle;
- the PREDICTION exact on a synthetic case, and "speculation costs more than it gives" where it does;
- the report logged after N verified steps, written as JSON, and printed offline by ``python -m eagle3_ops
  spec-report``.
"""
from __future__ import annotations

import inspect
import json
import logging
import subprocess
import sys
import time
import types

import pytest
import torch


@pytest.fixture
def sr(sglang_cpu, monkeypatch, tmp_path):
    from eagle3_ops.sglang import spec_report

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv(spec_report.ENV_SWITCH, raising=False)
    spec_report.reset()
    yield spec_report
    spec_report.reset()


def _worker(steps=4, topk=1):
    """An EAGLEWorkerV2 (SGLang's class, not initialised) with the settings the report reads from it."""
    from sglang.srt.speculative import eagle_worker_v2 as ew

    draft = ew.EagleDraftWorker.__new__(ew.EagleDraftWorker)
    draft.parallel_layout = types.SimpleNamespace(tp_group=None)  # draft_tp_context: the target's TP group
    worker = ew.EAGLEWorkerV2.__new__(ew.EAGLEWorkerV2)
    worker.__dict__.update(_draft_worker=draft, speculative_num_steps=steps, topk=topk,
                           speculative_num_draft_tokens=steps + 1, device=torch.device("cpu"),
                           activate_step_by_batch=lambda n: None)
    return worker


def _decode_batch():
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    return types.SimpleNamespace(forward_mode=ForwardMode.DECODE, is_extend_in_batch=False, seq_lens=torch.zeros(2),
                                 spec_info=types.SimpleNamespace(is_verify_input=lambda: False))


def _stand_in_phases(monkeypatch, sr, seconds):
    """SGLang's three phases replaced by stand-ins that take ``seconds[phase]``, each under the plugin's own phase
    hook, exactly as SGLang's HookRegistry wraps the real ones (``hook(original, *args, **kwargs)``)."""
    from sglang.srt.speculative import eagle_worker_v2 as ew

    verify_input = types.SimpleNamespace(is_verify_input=lambda: True, kv_loc_plan=None)
    returns = {"draft": verify_input, "verify": types.SimpleNamespace(new_seq_lens=None), "draft_extend": None}
    owners = {"draft": (ew.EagleDraftWorker, "draft"), "verify": (ew.EAGLEWorkerV2, "verify"),
              "draft_extend": (ew.EagleDraftWorker, "_draft_extend_for_decode")}
    for phase, (cls, name) in owners.items():
        assert sr.PHASE_TARGETS[phase] == f"{cls.__module__}.{cls.__qualname__}.{name}"

        def stand_in(self, *args, _phase=phase, **kwargs):
            time.sleep(seconds[_phase])
            return returns[_phase]

        hook = sr.around_phase(phase)
        monkeypatch.setattr(cls, name, lambda self, *a, _hook=hook, _f=stand_in, **k: _hook(_f, self, *a, **k))


def _resolve(brp, scheduler, accept_lens, reqs):
    """SGLang's ``_resolve_spec_v2_tokens`` (hooked by the plugin) on one verify step of ``len(accept_lens)``
    requests with 5 draft tokens each (4 steps + the bonus)."""
    n = len(accept_lens)
    result = types.SimpleNamespace(
        next_token_ids=torch.arange(5 * n), accept_lens=torch.tensor(accept_lens), speculative_output_stride=5,
        speculative_num_draft_tokens=5, num_non_draft_tokens_per_req=1, block_accept_lens=None, cap_lens=None,
        grammar_retained_tokens=None)
    return brp.SchedulerBatchResultProcessor._resolve_spec_v2_tokens(scheduler, result, types.SimpleNamespace(
        reqs=reqs)), result


def _reqs(n):
    return [types.SimpleNamespace(is_retracted=False, finished=lambda: False, grammar=None,
                                  kv=types.SimpleNamespace(kv_committed_len=0), spec_verify_ct=0,
                                  spec_num_correct_drafts=0, hist=[],
                                  update_spec_correct_drafts_histogram=lambda c: None) for _ in range(n)]


# accept lengths of three verify steps (drafts accepted + the bonus token)
STEPS = [[1, 3, 5], [2, 2, 5, 1], [4]]


def test_acceptance_per_position_is_counted_from_sglangs_own_verify_bookkeeping(sr, monkeypatch):
    """Accepted drafts 0,2,4 | 1,1,4,0 | 3: 8 request steps; histogram 0:2 1:2 2:1 3:1 4:2; reached n_0..n_4 =
    8,6,4,3,2; per position 6/8, 4/6, 3/4, 2/3; mean accepted length 15/8 + 1 (the bonus counted)."""
    from sglang.srt.managers.scheduler_components import batch_result_processor as brp

    assert "self._resolve_spec_v2_tokens(result, batch)" in \
        inspect.getsource(brp.SchedulerBatchResultProcessor._normalize_decode_outputs)
    scheduler = types.SimpleNamespace(
        metrics_reporter=types.SimpleNamespace(snapshot_spec_decode_metrics=lambda batch, result: None),
        model_worker=types.SimpleNamespace(on_verify_complete_cpu=lambda *a, **k: None),
        advance_grammar_fsm=lambda result, batch: None)
    served = {}
    for on in (False, True):
        monkeypatch.setenv(sr.ENV_SWITCH, "1" if on else "0")
        sr.reset()
        rep = sr._ensure(_worker(steps=4))
        assert (rep is not None) == on
        tokens = []
        for accept_lens in STEPS:
            reqs = _reqs(len(accept_lens))
            got, result = _resolve(brp, scheduler, accept_lens, reqs)
            tokens.append((got, [r.kv.kv_committed_len for r in reqs], result.num_correct_drafts_per_req_cpu))
        served[on] = tokens
    assert served[True] == served[False]  # what SGLang serves and commits is the same with the report on and off
    acc = sr.report().acceptance
    assert acc.hist == [2, 2, 1, 1, 2] and acc.steps == 8
    assert acc.reached(4) == [8, 6, 4, 3, 2]
    assert acc.per_position(4) == [6 / 8, 4 / 6, 3 / 4, 2 / 3]
    assert acc.mean_accepted_length() == 15 / 8 + 1


def test_the_cycle_split_sums_to_the_cycle(sr, monkeypatch):
    """SGLang's own forward_batch_generation (decode), its phases stand-ins of known length under the plugin's
    hooks: one cycle in SAMPLE_EVERY is timed, its parts sum to it, each part is the phase it names."""
    from sglang.srt.speculative import eagle_worker_v2 as ew

    src = inspect.getsource(ew.EAGLEWorkerV2.forward_batch_generation)
    for call in ("self.draft_worker.draft(batch)", "self.verify(", "self.draft_worker._draft_extend_for_decode("):
        assert call in src
    seconds = {"draft": 0.03, "verify": 0.05, "draft_extend": 0.01}
    _stand_in_phases(monkeypatch, sr, seconds)
    worker = _worker(steps=3)
    for _ in range(2 * sr.SAMPLE_EVERY):  # through the hooked class attribute, as the scheduler calls it
        ew.EAGLEWorkerV2.forward_batch_generation(worker, _decode_batch())
    times = sr.report().times
    assert times.seen == 2 * sr.SAMPLE_EVERY and len(times.done) == 2  # the 64th and the 128th
    for t in times.done:
        assert t["draft"] + t["verify"] + t["draft_extend"] + t["rest"] == pytest.approx(t["cycle"], abs=1e-9)
        for phase, s in seconds.items():
            assert s * 1e3 <= t[phase] < s * 1e3 + 50  # at least the stand-in's sleep; a loaded box adds some
        assert 0 <= t["rest"] < 50


def test_the_prediction_is_exact_on_a_synthetic_case(sr):
    """p = 0.8, 0.5, 0.25 (3 steps served); draft 3 ms, verify 6, draft extend 1, rest 2: k steps give
    1.8 / 2.2 / 2.3 tokens per 10 / 11 / 12 ms; no speculation 1 token per 8 ms; best 2 steps, +4.35%."""
    ms = {"draft": 3.0, "verify": 6.0, "draft_extend": 1.0, "rest": 2.0}
    pred = sr.predict([0.8, 0.5, 0.25], ms)
    assert [(r["steps"], r["tokens_per_cycle"], r["cycle_ms"]) for r in pred["rows"]] == \
        [(1, pytest.approx(1.8), 10.0), (2, pytest.approx(2.2), 11.0), (3, pytest.approx(2.3), 12.0)]
    assert pred["no_speculation"]["tokens_per_ms"] == 1 / 8
    assert pred["best"] == 2 and pred["speculation_pays"]
    assert pred["rows"][1]["vs_served"] == pytest.approx((2.2 / 11) / (2.3 / 12) - 1)
    costly = sr.predict([0.1], {"draft": 10.0, "verify": 5.0, "draft_extend": 5.0, "rest": 1.0})
    assert not costly["speculation_pays"]  # 1.1 tokens per 21 ms against 1 per 6 ms
    data = {"steps": 1, "topk": 1, "acceptance_per_position": [0.1], "verified_steps": 10, "mean_accepted_length": 1.1,
            "prediction": costly, "cycle_ms": None, "replay_predicted": None}
    assert "speculation costs more than it gives here" in sr.render(data)[0]


def test_the_report_is_logged_written_and_printed_offline(sr, monkeypatch, caplog):
    from sglang.srt.managers.scheduler_components import batch_result_processor as brp
    from sglang.srt.speculative import eagle_worker_v2 as ew

    from eagle3_ops.sglang import wiring_check

    monkeypatch.setattr(sr, "FIRST_AFTER_CYCLES", 8)
    monkeypatch.setattr(sr, "SAMPLE_EVERY", 1)  # the one cycle below is timed
    monkeypatch.setattr(sr, "MIN_TIMED", 1)     # and predicted from
    check = wiring_check.WiringCheck("LlamaForCausalLM", None, {}, [3, 5, 7], 8, 0, 1)
    check.predicted = 0.7  # the live check's replay: top-1 agreement of the served wiring, and its later steps
    check.verdict = {"tokens": 512, "chain": {"per_step": [0.7, 0.6], "positions": [512, 180]}}
    monkeypatch.setattr(wiring_check, "_checks", [check])
    _stand_in_phases(monkeypatch, sr, {"draft": 0.004, "verify": 0.006, "draft_extend": 0.001})
    worker = _worker(steps=4)
    ew.EAGLEWorkerV2.forward_batch_generation(worker, _decode_batch())  # one timed cycle
    scheduler = types.SimpleNamespace(
        metrics_reporter=types.SimpleNamespace(snapshot_spec_decode_metrics=lambda batch, result: None),
        model_worker=types.SimpleNamespace(on_verify_complete_cpu=lambda *a, **k: None),
        advance_grammar_fsm=lambda result, batch: None)
    with caplog.at_level(logging.INFO, logger="eagle3_ops.sglang"):
        for accept_lens in STEPS:
            _resolve(brp, scheduler, accept_lens, _reqs(len(accept_lens)))
    lines = [r.getMessage() for r in caplog.records if "speculation report" in r.getMessage()]
    assert lines and "PREDICTION" in lines[0] and "Details: " in lines[0], caplog.text
    assert any("acceptance per draft position" in ln and "1: 75.0%, 2: 66.7%, 3: 75.0%, 4: 66.7%" in ln
               for ln in lines)
    assert any("a decode cycle (1 timed, host clock; this server's own)" in ln for ln in lines)
    assert any("the replay predicts 1: 70.0% (512 positions), 2: 60.0% (180 positions) for the served wiring" in ln
               for ln in lines)
    path = sr.result_path(sr.report().model_name)
    data = json.loads(path.read_text())
    assert data["verified_steps"] == 8 and data["histogram"] == [2, 2, 1, 1, 2]
    assert data["prediction"]["served"] == 4
    out = subprocess.run([sys.executable, "-m", "eagle3_ops", "spec-report", str(path)], capture_output=True,
                         text=True, check=True).stdout.splitlines()
    assert out == sr.render(data)
    for ln in out:
        print(ln)  # what docs/sglang.md shows


def test_the_report_never_stops_sglang_and_steps_aside_where_it_cannot_say_the_truth(sr, monkeypatch):
    """A mark that cannot be made (an event that fails) costs the sample, never SGLang's forward; under adaptive
    speculation (the steps change per batch) and off TP rank 0 there is no report."""
    from sglang.srt.speculative import eagle_worker_v2 as ew

    monkeypatch.setattr(sr, "SAMPLE_EVERY", 1)
    _stand_in_phases(monkeypatch, sr, {"draft": 0.0, "verify": 0.0, "draft_extend": 0.0})
    calls = []
    real = sr.make_mark

    def failing(device_type):
        calls.append(device_type)
        if len(calls) == 2:  # the draft phase's start
            raise RuntimeError("no event (simulated)")
        return real(device_type)

    monkeypatch.setattr(sr, "make_mark", failing)
    out = ew.EAGLEWorkerV2.forward_batch_generation(_worker(steps=3), _decode_batch())
    assert out is not None and len(sr.report().times.done) == 1
    sample = sr.report().times.done[0]
    assert sample["draft"] == 0.0 and sample["verify"] > 0  # the draft phase went untimed, the rest did not
    sr.reset()
    adaptive = _worker(steps=3)
    adaptive.adaptive_controller = object()
    assert sr._ensure(adaptive) is None and sr._ensure(_worker(steps=3)) is None  # decided once
    sr.reset()
    from eagle3_ops.sglang import groups

    monkeypatch.setattr(groups, "tp_rank_size", lambda: (1, 2))
    assert sr._ensure(_worker(steps=3)) is None
