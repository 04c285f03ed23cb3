"""The live wiring check (eagle3_ops.sglang.wiring_check) on SGLang's own llama class (CPU).

The tiny target of ``eagle3_ops.doctor.tiny`` (its draft trained on ids [2, 4, 6] -> boundaries [3, 5, 7]) is
loaded into SGLang's ``LlamaForCausalLM`` and served:

- mis-wired (the draft's config edited to ids [1, 3, 5]: SGLang feeds boundaries [2, 4, 6]): the check's
  verdict is a WARNING naming the trained wiring [3, 5, 7] and the config change [2, 4, 6] that serves it;
- as trained: OK;
- where it cannot run (a checkpoint path that is not there, a draft class replay cannot run, the time
  bound): one line each, and serving goes on;
- served outputs are bitwise the same with the check on and off; the one forward it wants to record is
  taken off SGLang's prefill CUDA graph (the default flags), nothing else;
- observed acceptance against predicted: one line, and what a gap with the wiring right points at.
"""
import inspect
import json
import logging
import types

import pytest
import torch

from doctor_fixtures import copy_draft_with_ids
from eagle3_ops.sglang import dump_states

SEQ = 32  # the tiny pair's held-out prompts are 32 tokens: each qualifies (MIN_PROMPT_TOKENS)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from eagle3_ops.doctor.tiny import build_tiny_pair

    return build_tiny_pair(tmp_path_factory.getbasetemp() / "doctor_tiny_pair")


def _target(h, pair):
    from safetensors.torch import load_file
    from transformers import LlamaConfig

    cfg = LlamaConfig.from_pretrained(pair.target_dir)
    weights = load_file(str(pair.target_dir / "model.safetensors"))
    return cfg, h.sglang_model("llama", cfg, torch.float32, weights=weights.items())


def _serve(h, model, cfg, prompts):
    return h.serve_prompts(model, cfg, prompts)


def _run_check(h, wc, pair, draft_dir, served_ids, prompts, caplog):
    cfg, model = _target(h, pair)
    h.configure_capture(model, served_ids)
    with caplog.at_level(logging.INFO, logger="eagle3_ops.sglang"):
        check = wc.start(model, draft_path=str(draft_dir), target_config=cfg)
        assert check is not None, caplog.text
        outs = _serve(h, model, cfg, prompts)
        assert check.recorder.done, "the recording closed after CLOSE_AFTER_TOKENS"
        check.wait()  # the file is written, then scored, in threads of their own
        assert check.phase in ("done", "failed"), check.phase
    return check, outs, model, cfg


def _lines(caplog, needle):
    return [r.getMessage() for r in caplog.records if needle in r.getMessage()]


def test_miswired_draft_gets_a_warning_with_the_trained_wiring_and_the_fix(sglang_cpu, wc, pair, tmp_path, caplog):
    h = sglang_cpu
    prompts = json.loads(pair.prompts_file.read_text())[:wc.CLOSE_AFTER_TOKENS // SEQ + 4]
    draft = copy_draft_with_ids(pair, tmp_path / "miswired", nested=[1, 3, 5])
    check, outs, model, cfg = _run_check(h, wc, pair, draft, [1, 3, 5], prompts, caplog)
    assert dump_states.around_can_run_graph(lambda *a: True, None, h.extend_batch(h.KVCache(cfg, torch.float32),
                                   [h.Req(0)], [prompts[0]])) is True, "after its recording, SGLang decides alone"

    start = _lines(caplog, "feeds its draft")
    assert len(start) == 1, caplog.text
    assert "the output of layer 1, 3, 5" in start[0] and "boundaries [2, 4, 6]" in start[0]
    assert "doctor: OK" in start[0] and f"at least {wc.MIN_PROMPT_TOKENS} tokens" in start[0]
    # what it records: the boundaries the candidate wirings name (and the embeddings), not every one
    assert 0 in check.recorder.boundaries and {2, 3, 4, 5, 6, 7} <= set(check.recorder.boundaries)

    assert check.phase == "done", caplog.text
    v = check.verdict
    assert v["verdict"] == "WARNING", v
    assert v["configured"]["boundaries"] == [2, 4, 6] and v["best"]["boundaries"] == [3, 5, 7]
    assert v["fix"]["ids"] == [2, 4, 6]
    assert v["gain"] >= 3 * v["gain_stderr"] > 0
    warn = _lines(caplog, "live wiring check: WARNING")
    assert len(warn) == 1, caplog.text
    assert "[3, 5, 7]" in warn[0] and "eagle_aux_hidden_state_layer_ids to [2, 4, 6]" in warn[0]
    # the verdict and the fix first, the line short (paths aside); the detail, the offline command, in the JSON
    assert warn[0].startswith("eagle3_ops: live wiring check: WARNING: set eagle_config.eagle_aux_hidden_state_layer_"
                              "ids to [2, 4, 6] in "), warn[0]
    assert len(warn[0].replace(str(draft), "D").replace(str(wc.result_path("LlamaForCausalLM")), "J")) <= 300, warn[0]
    assert f"Details: {wc.result_path('LlamaForCausalLM')}" in warn[0]
    assert v["replay_command"].startswith("python -m eagle3_ops doctor") and "--replay" in v["replay_command"]
    # the same verdict as JSON next to the qualification cache, and the path logged
    saved = json.loads(wc.result_path("LlamaForCausalLM").read_text())
    assert saved["verdict"] == "WARNING" and saved["fix"]["ids"] == [2, 4, 6]
    assert str(wc.result_path("LlamaForCausalLM")) in caplog.text
    assert v["fix"]["ids"] == pair.trained_ids  # the ids the draft was trained with
    # the offline command reproduces the verdict
    import shlex

    from doctor_fixtures import run_doctor

    argv = shlex.split(v["replay_command"])
    assert argv[:4] == ["python", "-m", "eagle3_ops", "doctor"]
    rc, rep, err = run_doctor(*argv[4:])
    assert rc == 1 and rep["replay"]["best"]["boundaries"] == [3, 5, 7], err

def test_served_as_trained_gets_ok_and_served_tokens_are_bitwise_the_same(sglang_cpu, wc, pair, caplog,
                                                                          monkeypatch):
    h = sglang_cpu
    prompts = json.loads(pair.prompts_file.read_text())[:wc.CLOSE_AFTER_TOKENS // SEQ + 4]
    check, outs, _, _ = _run_check(h, wc, pair, pair.draft_dir, [2, 4, 6], prompts, caplog)
    assert check.phase == "done" and check.verdict["verdict"] == "OK", caplog.text
    ok = _lines(caplog, "live wiring check: OK")
    assert len(ok) == 1 and "the served [3, 5, 7]" in ok[0] and "top-1" in ok[0], caplog.text
    assert "wirings searched scores higher" in ok[0] and check.verdict["search"]["wirings_scanned"] >= 25
    assert len(ok[0].replace(str(wc.result_path("LlamaForCausalLM")), "J")) <= 300, ok[0]
    assert check.predicted == pytest.approx(check.verdict["configured"]["accuracy"])

    # the check off: the same model served the same prompts gives bitwise the same outputs
    monkeypatch.setenv("EAGLE3_OPS_WIRING_CHECK", "0")
    cfg, model = _target(h, pair)
    h.configure_capture(model, [2, 4, 6])
    assert wc.start(model, draft_path=str(pair.draft_dir), target_config=cfg) is None
    stock = _serve(h, model, cfg, prompts)
    for (aux, logits), (aux0, logits0) in zip(outs, stock):
        assert torch.equal(aux, aux0) and torch.equal(logits, logits0), "the check changed what was served"


def test_a_path_that_is_not_there_gets_one_line_and_serving_goes_on(sglang_cpu, wc, pair, tmp_path, caplog):
    h = sglang_cpu
    cfg, model = _target(h, pair)
    h.configure_capture(model, [2, 4, 6])
    with caplog.at_level(logging.INFO, logger="eagle3_ops.sglang"):
        assert wc.start(model, draft_path=str(tmp_path / "no-such-draft"), target_config=cfg) is None
    lines = _lines(caplog, "live wiring check")
    assert len(lines) == 1 and "cannot run" in lines[0] and "no-such-draft" in lines[0], caplog.text
    assert wc.checks() == []
    _serve(h, model, cfg, json.loads(pair.prompts_file.read_text())[:2])


def test_a_draft_class_that_does_not_fit_its_checkpoint_gets_one_line_at_start(sglang_cpu, wc, pair, tmp_path,
                                                                              caplog):
    """The llama draft relabelled as SGLang's MLA head (the Kimi-K2.x drafts' class): SGLang would load it with
    the MLA layer's parameters unset, so there is nothing trained to score. The check says so at start-up, with
    the doctor's verdict naming the head that fits, and records nothing (no prefill leaves its CUDA graph)."""
    h = sglang_cpu
    draft = copy_draft_with_ids(pair, tmp_path / "mla", nested=[2, 4, 6])
    cfg_d = json.loads((draft / "config.json").read_text())
    cfg_d["architectures"] = ["Eagle3DeepseekV2ForCausalLM"]
    (draft / "config.json").write_text(json.dumps(cfg_d))
    cfg, model = _target(h, pair)
    h.configure_capture(model, [2, 4, 6])
    with caplog.at_level(logging.INFO, logger="eagle3_ops.sglang"):
        assert wc.start(model, draft_path=str(draft), target_config=cfg) is None
    lines = _lines(caplog, "live wiring check")
    assert len(lines) == 1, caplog.text
    assert "cannot run: the draft's class does not fit its checkpoint (E_DRAFT_CLASS" in lines[0]
    assert "Eagle3DeepseekV2ForCausalLM" in lines[0] and "doctor: ERROR E_DRAFT_CLASS" in lines[0]
    assert "to LlamaForCausalLMEagle3" in lines[0], lines[0]
    assert wc.checks() == [] and not dump_states._recorders
    _serve(h, model, cfg, json.loads(pair.prompts_file.read_text())[:2])


def test_the_time_bound_gets_one_line_and_serving_goes_on(sglang_cpu, wc, pair, caplog, monkeypatch):
    h = sglang_cpu
    monkeypatch.setattr(wc, "TIME_LIMIT_S", 0.01)
    prompts = json.loads(pair.prompts_file.read_text())[:wc.CLOSE_AFTER_TOKENS // SEQ + 1]
    check, outs, model, cfg = _run_check(h, wc, pair, pair.draft_dir, [2, 4, 6], prompts, caplog)
    assert check.phase == "failed"
    lines = _lines(caplog, "could not be checked")
    assert len(lines) == 1 and "the time bound" in lines[0] and "doctor --draft" in lines[0], caplog.text
    assert json.loads(wc.result_path("LlamaForCausalLM").read_text())["verdict"] == "not checked"
    _serve(h, model, cfg, prompts[:2])  # the recorder is gone: serving is stock


def test_default_flags_the_wanted_prefill_runs_eagerly_and_nothing_else(sglang_cpu, wc, pair, monkeypatch, caplog):
    """SGLang's default flags keep prefill CUDA graphs on; a replayed graph runs no Python, so the check
    takes the forward it wants to record off the graph (AROUND ``PrefillCudaGraphRunner.can_run_graph``, the
    call ModelRunner makes for every extend) and leaves every other decision to SGLang. The server's own
    args name the draft (``speculative_draft_model_path``)."""
    h = sglang_cpu
    from sglang.srt import runtime_context
    from sglang.srt.model_executor import model_runner
    from sglang.srt.model_executor.runner.prefill_cuda_graph_runner import PrefillCudaGraphRunner

    assert "self.prefill_cuda_graph_runner.can_run_graph(forward_batch)" in \
        inspect.getsource(model_runner.ModelRunner._forward_raw)
    server = types.SimpleNamespace(speculative_algorithm="EAGLE3", speculative_draft_model_path=str(pair.draft_dir))
    monkeypatch.setattr(runtime_context, "get_server_args", lambda: server)
    cfg, model = _target(h, pair)
    with caplog.at_level(logging.INFO, logger="eagle3_ops.sglang"):
        h.configure_capture(model, [2, 4, 6])  # the plugin's hook starts the check from the server's args
    assert len(wc.checks()) == 1 and wc.checks()[0].draft_dir == pair.draft_dir, caplog.text

    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    kv = h.KVCache(cfg, torch.float32)
    reqs = [h.Req(kv.new_req()) for _ in range(4)]
    prompts = json.loads(pair.prompts_file.read_text())

    def scheduled(fb):  # what the scheduler's batches of an EAGLE-3 server carry
        fb.spec_algorithm = SpeculativeAlgorithm.EAGLE3
        return fb

    wanted = scheduled(h.extend_batch(kv, reqs[:1], [prompts[0]]))
    short = scheduled(h.extend_batch(kv, reqs[1:2], [prompts[1][:8]]))     # under MIN_PROMPT_TOKENS
    cached = scheduled(h.extend_batch(kv, reqs[:1], [prompts[2]]))         # a continuation (cached prefix)
    verify = scheduled(h.extend_batch(kv, reqs[2:3], [prompts[3][:4]], mode="TARGET_VERIFY"))
    # SGLang's prefill-graph capture warms each bucket up eagerly with a dummy EXTEND from position 0
    # (prefill_cuda_graph_runner.capture_prepare): no spec_algorithm; never recorded
    warmup = h.extend_batch(kv, reqs[3:4], [[0] * 64])
    seen = []

    def stock(self, fb):
        seen.append(fb)
        return True

    assert dump_states.around_can_run_graph(stock, None, wanted) is False and not seen
    for fb in (short, cached, verify, warmup):
        assert dump_states.around_can_run_graph(stock, None, fb) is True
    assert seen == [short, cached, verify, warmup]
    assert not wc.checks()[0].recorder.wants(warmup)
    dp = scheduled(h.extend_batch(kv, reqs[1:2], [prompts[4]]))
    dp.global_num_tokens_cpu = [SEQ, SEQ]  # DP attention / MLP sync: a group vote, SGLang decides alone
    assert dump_states.around_can_run_graph(stock, None, dp) is True
    # the draft's prefill graph runner (another model) is not taken off its graph
    draft_runner = types.SimpleNamespace(model_runner=types.SimpleNamespace(model=torch.nn.Linear(1, 1)))
    assert dump_states.around_can_run_graph(stock, draft_runner, wanted) is True
    target_runner = types.SimpleNamespace(model_runner=types.SimpleNamespace(model=model))
    assert dump_states.around_can_run_graph(stock, target_runner, wanted) is False
    # the plugin hooked SGLang's class: on a wanted batch the graph runner is not consulted at all
    bare = object.__new__(PrefillCudaGraphRunner)
    assert PrefillCudaGraphRunner.can_run_graph(
        bare, scheduled(h.extend_batch(kv, [h.Req(kv.new_req())], [prompts[5]]))) is False
    # SGLang's shared warm-up forward (BaseRunner._dummy_run: FlashInfer autotune, DeepGEMM's compile
    # warm-up, PD prefill's extend autotune) builds batches that carry the runner's spec_algorithm and
    # may be EXTEND from position 0: inside it (the plugin's AROUND hook) or FlashInfer's autotune flag,
    # nothing is recorded
    from sglang.srt.layers import logits_processor
    from sglang.srt.layers.deep_gemm_wrapper import compile_utils
    from sglang.srt.model_executor.runner import base_runner, flashinfer_autotune

    assert "spec_algorithm=mr.spec_algorithm" in inspect.getsource(base_runner.BaseRunner._dummy_run)
    assert "runner._dummy_run(" in inspect.getsource(compile_utils)
    assert "runner._dummy_run" in inspect.getsource(flashinfer_autotune.maybe_flashinfer_autotune_extend)
    recorder = wc.checks()[0].recorder
    assert recorder.wants(wanted)
    assert dump_states.around_dummy_run(lambda: recorder.wants(wanted)) is False
    with logits_processor.autotune_dummy_run_mode(run_lm_head=False):
        assert not recorder.wants(wanted)
    assert recorder.wants(wanted), "after the warm-up, the same batch is wanted again"
    # once the recording is written (its write() sets done), SGLang decides every forward again
    wc.checks()[0].recorder.done = True
    assert dump_states.around_can_run_graph(stock, None, wanted) is True


def test_observed_acceptance_against_predicted(wc, caplog, tmp_path):
    def check(verdict):
        c = wc.WiringCheck("LlamaForCausalLM", tmp_path, {}, [3, 5, 7], 8, 0, 1)
        c.predicted, c.verdict = 0.72, {"verdict": verdict}
        return c

    with caplog.at_level(logging.INFO, logger="eagle3_ops.sglang"):
        right = check("OK")
        right.count([1, 0, 2, 0] * (wc.ACCEPTANCE_STEPS // 8))
        assert not _lines(caplog, "verify steps"), "not before ACCEPTANCE_STEPS"
        right.count([1, 0, 2, 0] * (wc.ACCEPTANCE_STEPS // 8))
        right.count([3] * 100)  # once logged, counting stops
        wrong = check("WARNING")
        wrong.count([0] * wc.ACCEPTANCE_STEPS)
        close = check("OK")
        close.count([1, 1, 1, 0] * (wc.ACCEPTANCE_STEPS // 4))
    lines = _lines(caplog, "verify steps")
    assert len(lines) == 3, lines
    assert "50.0% of 1000 verify steps" in lines[0] and "predicted 72.0%" in lines[0]
    assert "tokenizer" in lines[0] and "vocabulary map" in lines[0] and "embedding scale" in lines[0]
    assert "0.0% of 1000" in lines[1] and "the wiring warning above is the likely cause" in lines[1]
    assert "75.0% of 1000" in lines[2] and "they agree" in lines[2]
    assert right.verdict["observed_first_token_acceptance"] == 0.5
    # other TP ranks count nothing
    quiet = wc.WiringCheck("LlamaForCausalLM", tmp_path, {}, [3, 5, 7], 8, 1, 2)
    quiet.predicted = 0.7
    quiet.count([1] * wc.ACCEPTANCE_STEPS)
    assert quiet.steps == 0


def test_switched_off_by_its_setting(sglang_cpu, wc, pair, monkeypatch, caplog):
    monkeypatch.setenv("EAGLE3_OPS_WIRING_CHECK", "off")
    cfg, model = _target(sglang_cpu, pair)
    sglang_cpu.configure_capture(model, [2, 4, 6])
    assert wc.start(model, draft_path=str(pair.draft_dir), target_config=cfg) is None
    monkeypatch.setenv("EAGLE3_OPS_WIRING_CHECK", "maybe")
    with caplog.at_level(logging.INFO, logger="eagle3_ops"):
        assert wc.start(model, draft_path=str(pair.draft_dir), target_config=cfg) is None
    assert any("EAGLE3_OPS_WIRING_CHECK='maybe'" in r.getMessage() for r in caplog.records), caplog.text


def test_a_server_capturing_other_boundaries_than_the_config_names_is_not_scored(sglang_cpu, wc, pair, caplog):
    """The replay scores the wiring the draft config names as the served one; where SGLang captures other
    boundaries, that score would not be the server's: one line, no recording."""
    cfg, model = _target(sglang_cpu, pair)
    sglang_cpu.configure_capture(model, [1, 3, 5])  # the draft's config says [2, 4, 6]
    with caplog.at_level(logging.INFO, logger="eagle3_ops.sglang"):
        assert wc.start(model, draft_path=str(pair.draft_dir), target_config=cfg) is None
    lines = _lines(caplog, "live wiring check")
    assert len(lines) == 1 and "SGLang captures boundaries [2, 4, 6], but the draft config makes the doctor " \
                                "expect [3, 5, 7]" in lines[0], caplog.text


def test_sglang_s_own_verify_bookkeeping_feeds_the_acceptance_count(sglang_cpu, wc, tmp_path):
    """Every spec-decode batch of SGLang 0.5.23 goes through ``_resolve_spec_v2_tokens`` (the one spec
    path of ``_normalize_decode_outputs``), which makes ``num_correct_drafts_per_req_cpu``; the plugin's
    AFTER hook on it counts them. Called here through the hooked class attribute, with stand-ins for
    the scheduler parts it touches."""
    from sglang.srt.managers.scheduler_components import batch_result_processor as brp

    assert "self._resolve_spec_v2_tokens(result, batch)" in \
        inspect.getsource(brp.SchedulerBatchResultProcessor._normalize_decode_outputs)
    check = wc.WiringCheck("LlamaForCausalLM", tmp_path, {}, [3, 5, 7], 8, 0, 1)
    check.predicted, check.verdict = 0.7, {"verdict": "OK"}
    wc._checks.append(check)
    scheduler = types.SimpleNamespace(
        metrics_reporter=types.SimpleNamespace(snapshot_spec_decode_metrics=lambda batch, result: None),
        model_worker=types.SimpleNamespace(on_verify_complete_cpu=lambda *a, **k: None),
        advance_grammar_fsm=lambda result, batch: None)
    # 3 requests, 4 draft tokens each (+1 bonus): accept lengths 1 (no draft accepted), 3 and 5
    result = types.SimpleNamespace(
        next_token_ids=torch.arange(15), accept_lens=torch.tensor([1, 3, 5]), speculative_output_stride=5,
        speculative_num_draft_tokens=5, num_non_draft_tokens_per_req=1, block_accept_lens=None, cap_lens=None,
        grammar_retained_tokens=None)
    brp.SchedulerBatchResultProcessor._resolve_spec_v2_tokens(scheduler, result, types.SimpleNamespace(reqs=[]))
    assert result.num_correct_drafts_per_req_cpu == [0, 2, 4]
    assert (check.steps, check.first_accepted) == (3, 2)


def _assert_off(h, wc, pair, caplog, needle, first_line):
    """Under a server setting the check and the dump refuse: one line each, nothing installed."""
    from eagle3_ops.sglang import dump_states

    cfg, model = _target(h, pair)
    h.configure_capture(model, [2, 4, 6])
    # only what the two calls below say: where an earlier test on this worker registered the plugin's SGLang
    # hooks, configure_capture has started (and refused) a check already
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="eagle3_ops.sglang"):
        assert wc.start(model, draft_path=str(pair.draft_dir), target_config=cfg) is None
        assert dump_states.install_recorder(model, None, label="x") is None
    lines = [r.getMessage() for r in caplog.records if needle in r.getMessage() and r.levelno < logging.ERROR]
    assert len(lines) == 2 and first_line in lines[0], caplog.text
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


def test_off_under_dp_attention(sglang_cpu, wc, pair, monkeypatch, caplog):
    """Under DP attention each TP rank runs another batch: the recording's all-gather could pair rows of
    different requests and wait for ranks that never reach it, so the check (and the dump) stay off."""
    from eagle3_ops.sglang import dump_states

    monkeypatch.setattr(dump_states, "dp_attention_enabled", lambda: True)
    _assert_off(sglang_cpu, wc, pair, caplog, "DP attention", "live wiring check: off under DP attention")


def test_off_under_pipeline_parallelism(sglang_cpu, wc, pair, monkeypatch, caplog):
    """PP > 1: each stage holds some layers only and the last one the logits (and PP's dynamic chunking
    profiles random prompts through scheduler batches), so the check and the dump stay off."""
    from sglang.srt import runtime_context

    from eagle3_ops.sglang import dump_states

    server = types.SimpleNamespace(speculative_algorithm="EAGLE3", pp_size=2, enable_dp_attention=False)
    monkeypatch.setattr(runtime_context, "get_server_args", lambda: server)
    assert dump_states.pipeline_parallel()
    errors = _assert_off(sglang_cpu, wc, pair, caplog, "pipeline parallelism",
                         "live wiring check: off under pipeline parallelism")
    # with 2 stages of the 8 layers the last one (layers 4..7) captures boundary 3 of [3, 5, 7] on no rank: said
    # at start-up, with the check's own reason for not running
    assert len(errors) == 1 and "boundary 3 is computed on an earlier stage" in errors[0], caplog.text
    assert "the live check is off here (under pipeline parallelism" in errors[0]
    server.pp_size = 1
    assert not dump_states.pipeline_parallel()


def test_off_with_custom_warmups(sglang_cpu, wc, pair, monkeypatch, caplog):
    """``--warmups prefill_shapes`` / ``voice_chat``: the server sends requests of random token ids through
    the scheduler before any user prompt (SGLang's entrypoints/warmup.py), which a recording would take for
    the first prompts: the check and the dump stay off, with one line each."""
    from sglang.srt import runtime_context
    from sglang.srt.entrypoints import http_server

    from eagle3_ops.sglang import dump_states

    assert "get_serving().warmups" in inspect.getsource(http_server)
    monkeypatch.setattr(runtime_context, "get_serving", lambda: types.SimpleNamespace(warmups="prefill_shapes"))
    assert dump_states.custom_warmups() == "prefill_shapes"
    _assert_off(sglang_cpu, wc, pair, caplog, "--warmups prefill_shapes", "live wiring check: off with --warmups")


def test_prompts_with_media_are_not_recorded(sglang_cpu, wc, pair, caplog):
    """A sequence with images or audio (``forward_batch.mm_inputs[i]``) has placeholder ids where the
    target read encoder embeddings: it is skipped, the text sequences of the same batch are recorded."""
    h = sglang_cpu
    cfg, model = _target(h, pair)
    h.configure_capture(model, [2, 4, 6])
    with caplog.at_level(logging.INFO, logger="eagle3_ops.sglang"):
        check = wc.start(model, draft_path=str(pair.draft_dir), target_config=cfg)
    assert check is not None, caplog.text
    prompts = json.loads(pair.prompts_file.read_text())[:2]
    kv = h.KVCache(cfg, torch.float32)
    fb = h.extend_batch(kv, [h.Req(kv.new_req()) for _ in prompts], prompts)
    fb.mm_inputs = [object(), None]  # the first request carries an image
    plan = check.recorder._plan(fb)
    assert plan.rows is not None and plan.rows.tolist() == list(range(len(prompts[0]), len(prompts[0]) + SEQ))
    fb.mm_inputs = [object(), object()]
    assert not check.recorder.wants(fb)
    fb.mm_inputs = None
    assert check.recorder.wants(fb)


def test_the_fusion_guard_follows_sglangs_own_predicates(wc, monkeypatch):
    """At TP > 1 a recorded layer completes its all-reduce before its norm; where SGLang would fuse the
    two (FlashInfer up to its batch limit, CuTe DSL up to its workspace bound, aiter up to a byte bound),
    only longer forwards are recorded. The bounds come from SGLang's predicates, searched."""
    import sglang.srt.layers.layer_boundary.residual.add_norm as add_norm
    from eagle3_ops.sglang import groups
    from eagle3_ops.sglang.wiring_recording import largest_fused_forward, largest_true

    assert largest_true(lambda n: n <= 2048) == 2048
    assert largest_true(lambda n: False) == 0 and largest_true(lambda n: True) is None
    assert largest_fused_forward(64, torch.bfloat16) == 0  # TP = 1: nothing to fuse
    monkeypatch.setattr(groups, "tp_rank_size", lambda: (0, 2))
    monkeypatch.setattr(add_norm, "flashinfer_ar_fusion_applies", lambda n: n <= add_norm.FUSE_ALLREDUCE_MAX_BATCH_SIZE)
    assert largest_fused_forward(64, torch.bfloat16) == add_norm.FUSE_ALLREDUCE_MAX_BATCH_SIZE
    monkeypatch.setattr(add_norm, "flashinfer_ar_fusion_applies", lambda n: False)
    assert largest_fused_forward(64, torch.bfloat16) == 0  # e.g. sm_120 (FlashInfer's fusion is sm_90/100)
    monkeypatch.setattr(add_norm, "flashinfer_ar_fusion_applies", lambda n: 1 / 0)
    assert largest_fused_forward(64, torch.bfloat16) is None  # cannot tell: the check does not record


def test_the_replay_runs_niced_bounded_off_the_gpu(tmp_path, wc):
    import subprocess
    import sys

    (tmp_path / "show_limits.py").write_text(
        "import os, resource\n"
        "print(os.nice(0), resource.getrlimit(resource.RLIMIT_AS)[0], resource.getrlimit(resource.RLIMIT_CPU)[0],"
        " os.environ['CUDA_VISIBLE_DEVICES'] == '', os.environ['OMP_NUM_THREADS'],"
        " os.environ['EAGLE3_OPS_WIRING_CHECK'])\n")
    env = dict(wc.child_env(), PYTHONPATH=str(tmp_path))
    out = subprocess.run(wc.limited([sys.executable, "-m", "show_limits"], 6 << 30, 123), env=env,
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == ["19", str(6 << 30), "123", "True", str(wc.THREADS), "0"], out


def test_an_unreadable_checkpoint_gets_one_line_and_serving_goes_on(sglang_cpu, wc, pair, tmp_path, caplog):
    """A draft folder that is there but whose weights cannot be read (a truncated safetensors header)."""
    h = sglang_cpu
    draft = copy_draft_with_ids(pair, tmp_path / "broken", nested=[2, 4, 6])
    (draft / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\":")
    cfg, model = _target(h, pair)
    h.configure_capture(model, [2, 4, 6])
    with caplog.at_level(logging.INFO, logger="eagle3_ops.sglang"):
        assert wc.start(model, draft_path=str(draft), target_config=cfg) is None
    lines = _lines(caplog, "live wiring check")
    assert len(lines) == 1 and "cannot run: the doctor could not read the configs" in lines[0], caplog.text
    assert "model.safetensors" in lines[0]
    _serve(h, model, cfg, json.loads(pair.prompts_file.read_text())[:2])


def test_the_fix_is_sglangs_own_id_list_or_says_why_none_exists(sglang_cpu, wc, pair, tmp_path):
    """The replay is evidence: the fix is the id list SGLang's own rule turns into the winning wiring (the readings
    of the config need not agree); where none exists (the last layer's output, which SGLang's llama never
    captures) the text says why and never advises ids."""
    from transformers import LlamaConfig

    from eagle3_ops.sglang.wiring_doctor import doctor_report
    from eagle3_ops.sglang.wiring_verdict import fix as the_fix

    draft = copy_draft_with_ids(pair, tmp_path / "d", nested=[1, 3, 5])
    report, _ = doctor_report(LlamaConfig.from_pretrained(pair.target_dir), draft, 1)
    fix = the_fix(report, draft, [3, 5, 7])
    assert fix["ids"] == [2, 4, 6] and "to [2, 4, 6]" in fix["text"] and "(now [1, 3, 5])" in fix["text"]
    none = the_fix(report, draft, [3, 5, 8])
    assert none["ids"] is None and "SGLang never captures the output of layer 7 (boundary 8)" in none["text"], none
    assert "retrain" in none["text"] and "set eagle_config" not in none["text"]
