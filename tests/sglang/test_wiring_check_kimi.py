"""The seed user's family on SGLang 0.5.23's own classes (CPU): the tiny Kimi-K2.5 target of kimi_pair.py
(``KimiK25ForConditionalGeneration`` over ``DeepseekV3ForCausalLM``) served with trained drafts of both SGLang
EAGLE-3 draft classes (``LlamaForCausalLMEagle3`` and the MLA head ``Eagle3DeepseekV2ForCausalLM``), the plugin
with its default settings, the live wiring check scoring with SGLang's own draft class:

- served as trained -> OK;
- every id one too high -> WARNING whose ids feed the trained boundaries, in the config's own form; every id one
  too low is the same wiring under SGLang's deepseek rule ([1, 4, 6]: the first id is 1, so every id + 1);
- trained with "output of layer k" numbering and served with its config's ids -> WARNING with the ids that
  serve it ([3, 6, 8]: evidence, not the readings of the config, decides);
- the seed's own edit (a -1 for "the embeddings") -> one ERROR line at configuration, before SGLang's first
  forward fails with its own error, naming the id, what SGLang does, each reading with ids SGLang serves; a
  second server with the advised ids -> the live check's verdict names the trained wiring and the ids for it.
"""
import json
import logging
import re
import types

import pytest
import torch

import kimi_pair
from doctor_fixtures import copy_draft_with_ids, run_doctor

SEQ = 32
PROMPTS = 32  # recorded by the live check here
CLASSES = ["llama", "mla"]


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    return kimi_pair.build(tmp_path_factory.getbasetemp() / "kimi_pair")


@pytest.fixture
def wc(wc, monkeypatch):
    # conftest's wc, closed after 32 prompts, not the default 8: the tiny target predicts nearly one token per
    # prompt (kimi_pair.py)
    monkeypatch.setattr(wc, "CLOSE_AFTER_TOKENS", PROMPTS * (SEQ - 1))
    return wc


def _target(h, kimi):
    from safetensors.torch import load_file
    from sglang.srt.models.kimi_k25 import KimiK25ForConditionalGeneration

    cfg = kimi_pair.kimi_config()
    weights = load_file(str(kimi.target_dir / "model.safetensors"))
    return cfg, h.build_model(KimiK25ForConditionalGeneration, cfg, torch.float32, weights=weights.items())


def _serve(h, model, cfg, prompts):
    return h.serve_prompts(model, cfg.text_config, prompts)


def _prompts(kimi, wc):
    return json.loads(kimi.prompts_file.read_text())[:PROMPTS + 4]


def _live(h, wc, kimi, draft, ids, caplog):
    """A server of the Kimi target with ``draft`` configured to ``ids`` (SGLang's own configure call, the
    plugin's hooks), its first prompts served, the live check's recording written and scored."""
    cfg, model = _target(h, kimi)
    with caplog.at_level(logging.INFO, logger="eagle3_ops.sglang"):
        h.configure_capture(model, ids)
        check = wc.start(model, draft_path=str(draft), target_config=cfg)
        assert check is not None, caplog.text
        _serve(h, model, cfg, _prompts(kimi, wc))
        assert check.recorder.done, "the recording closed after CLOSE_AFTER_TOKENS"
        check.wait()
    assert check.phase == "done", caplog.text
    return check


def _lines(caplog, needle):
    return [r for r in caplog.records if needle in r.getMessage()]


def _draft(kimi, cls, kind, tmp_path, ids):
    return copy_draft_with_ids(kimi.drafts[f"{cls}_{kind}"], tmp_path / f"{cls}_{kind}_{'_'.join(map(str, ids))}",
                               nested=list(ids))


def test_the_drafts_are_trained_and_sglang_runs_them_as_trained(sglang_cpu, kimi):
    """The premise of every test below: each draft predicts the target's next token well on its trained wiring
    (held-out prompts, Hugging Face's states, the training twin), and SGLang's own class, loaded from the saved
    checkpoint by the replay's runner, computes the same predictions from the same inputs."""
    from safetensors.torch import load_file

    from eagle3_ops.doctor import configs
    from eagle3_ops.doctor.draft import Eagle3Draft
    from eagle3_ops.doctor.sglang_draft import SGLangDraftRunner
    from eagle3_ops.doctor.tiny import _spec_from, target_states

    assert all(acc > 0.6 for acc in kimi.accuracy.values()), kimi.accuracy
    prompts = torch.tensor(json.loads(kimi.prompts_file.read_text())[:8])
    hidden, _ = target_states(kimi_pair.hf_target(), prompts)
    for name, draft_dir in kimi.drafts.items():
        cfg = json.loads((draft_dir / "config.json").read_text())
        saved = load_file(str(draft_dir / "model.safetensors"))
        if name.startswith("mla"):
            twin = kimi_pair.MlaDraftTwin(cfg)
            twin.load_state_dict({k.removeprefix("layers.0."): v for k, v in saved.items()})
        else:
            twin = Eagle3Draft(_spec_from(cfg))
            missing = twin.load_checkpoint(saved)
            assert missing == ["embed_tokens.weight"], missing  # the target's serves
        aux = torch.cat([hidden[b] for b in kimi.trained[name]], dim=-1)[:, :-1]
        with torch.no_grad():
            want = twin(aux, hidden[0][:, 1:]).double()
        runner = SGLangDraftRunner(configs.parse_draft(draft_dir, use_sglang=True),
                                   configs.read_weight_headers(draft_dir), prompts)
        got = runner.logits(aux, prompts[:, 1:], hidden[0][:, 1:]).double()
        assert ((got - want).norm() / want.norm()).item() < 1e-4, name  # float32 rounding, two implementations
        sglang_cpu.same_where_clear(runner.predict(aux, prompts[:, 1:], hidden[0][:, 1:]),
                         twin.draft_to_target(want.argmax(-1)), want)


@pytest.mark.parametrize("cls", CLASSES)
def test_served_as_trained_is_ok(sglang_cpu, wc, kimi, cls, caplog):
    check = _live(sglang_cpu, wc, kimi, kimi.drafts[f"{cls}_default"], kimi_pair.CONFIG_IDS, caplog)
    assert check.verdict["verdict"] == "OK", caplog.text
    assert check.verdict["configured"]["boundaries"] == kimi_pair.DEFAULT_BOUNDARIES
    assert check.verdict["configured"]["accuracy"] > 0.6
    ok = [r.getMessage() for r in _lines(caplog, "live wiring check: OK")]
    assert len(ok) == 1 and "the served [2, 5, 7]" in ok[0], caplog.text
    head = {"llama": "LlamaForCausalLMEagle3", "mla": "Eagle3DeepseekV2ForCausalLM"}[cls]
    saved = json.loads(wc.result_path("KimiK25ForConditionalGeneration").read_text())
    assert saved["verdict"] == "OK"
    assert check.verdict["draft_code"].startswith(f"SGLang 0.5.23's own {head}"), check.verdict


@pytest.mark.parametrize("cls", CLASSES)
def test_every_id_one_too_high_gets_the_ids_in_the_configs_own_form(sglang_cpu, wc, kimi, cls, tmp_path, caplog):
    draft = _draft(kimi, cls, "default", tmp_path, [3, 6, 8])
    check = _live(sglang_cpu, wc, kimi, draft, [3, 6, 8], caplog)
    v = check.verdict
    assert v["verdict"] == "WARNING", caplog.text
    assert v["configured"]["boundaries"] == [3, 6, 8] and v["best"]["boundaries"] == kimi_pair.DEFAULT_BOUNDARIES
    # [1, 4, 6] feeds the same boundaries (first id 1: every id + 1); the config writes ids as boundaries
    assert v["fix"]["ids"] == [2, 5, 7], v["fix"]
    warn = [r for r in _lines(caplog, "live wiring check: WARNING")]
    assert len(warn) == 1 and warn[0].levelno == logging.WARNING
    assert "eagle_aux_hidden_state_layer_ids to [2, 5, 7]" in warn[0].getMessage()


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("ids", [[7, 8, 9], [0, 5, 7]], ids=["slot0-off-by-5", "embeddings-in-slot0"])
def test_the_search_finds_the_trained_wiring_far_from_the_served_one(sglang_cpu, wc, kimi, cls, ids, tmp_path,
                                                                      caplog):
    """Served [7, 8, 9] (slot 0 five layers late, the others three and two) or [0, 5, 7] (the embeddings in slot
    0): no neighbour of the served wiring is the trained one; the search over every boundary finds it."""
    check = _live(sglang_cpu, wc, kimi, _draft(kimi, cls, "default", tmp_path, ids), ids, caplog)
    v = check.verdict
    assert v["verdict"] == "WARNING" and v["configured"]["boundaries"] == ids, caplog.text
    assert v["best"]["boundaries"] == kimi_pair.DEFAULT_BOUNDARIES and v["fix"]["ids"] == [2, 5, 7], v
    assert set(check.recorder.boundaries) == set(range(kimi_pair.NUM_LAYERS + 1)) - set(check.recorder.unreachable)


def test_every_id_one_too_low_is_the_same_wiring_on_this_family(kimi):
    """SGLang's deepseek rule adds 1 to every id when the first id is 1: [1, 4, 6] feeds [2, 5, 7], what the
    draft was trained on; the doctor says so from SGLang's own code (no replay needed)."""
    for cls in CLASSES:
        rc, rep, err = run_doctor("--draft", copy_draft_with_ids(kimi.drafts[f"{cls}_default"],
                                                                 kimi.root / f"low_{cls}", nested=[1, 4, 6]),
                                  "--target", kimi.target_dir)
        assert [s["capture_index"] for s in rep["slots"]] == kimi_pair.DEFAULT_BOUNDARIES, (cls, rep["slots"])
        assert rep["engine"]["class"].endswith("KimiK25ForConditionalGeneration")


@pytest.mark.parametrize("cls", CLASSES)
def test_output_of_layer_k_numbering_gets_the_ids_that_serve_it(sglang_cpu, wc, kimi, cls, caplog):
    """Trained on "the outputs of layers 2, 5, 7" (boundaries [3, 6, 8]), config ids [2, 5, 7]: SGLang takes
    them as boundaries. The readings of the config disagree, but the replay is evidence: [3, 6, 8] serves it."""
    check = _live(sglang_cpu, wc, kimi, kimi.drafts[f"{cls}_hf"], kimi_pair.CONFIG_IDS, caplog)
    v = check.verdict
    assert v["verdict"] == "WARNING", caplog.text
    assert v["configured"]["boundaries"] == [2, 5, 7] and v["best"]["boundaries"] == kimi_pair.HF_BOUNDARIES
    assert v["fix"]["ids"] == [3, 6, 8], v["fix"]
    msg = _lines(caplog, "live wiring check: WARNING")[0].getMessage()
    assert "eagle_aux_hidden_state_layer_ids to [3, 6, 8]" in msg and "retrain" not in msg, msg


@pytest.mark.parametrize("cls", CLASSES)
def test_the_seeds_edit_gets_the_trained_ids_at_the_first_start(sglang_cpu, wc, kimi, cls, tmp_path, caplog,
                                                                 monkeypatch):
    """The seed's edit ([-1, 2, 5]: a -1 for "the embeddings"; SGLang's first forward would fail) on a server
    started as SGLang starts it (its configure call with the server's args naming the draft): the plugin serves the
    first reading SGLang takes ([0, 3, 6], the -1 read as the embeddings) so the server runs, and the live check's
    verdict at this first start names the trained wiring and its ids. Served tokens are those of a stock server
    configured with [0, 3, 6]; with the check off, SGLang's own error stands."""
    h = sglang_cpu
    from sglang.srt import runtime_context

    edited = _draft(kimi, cls, "default", tmp_path, [-1, 2, 5])
    server = types.SimpleNamespace(speculative_algorithm="EAGLE3", speculative_draft_model_path=str(edited))
    monkeypatch.setattr(runtime_context, "get_server_args", lambda: server)
    cfg, model = _target(h, kimi)
    with caplog.at_level(logging.INFO, logger="eagle3_ops.sglang"):
        h.configure_capture(model, [-1, 2, 5])  # SGLang's configure call; the plugin's hooks decide and start
        (check,) = wc.checks()
        assert model.language_model.model.layers_to_capture == [0, 3, 6]  # SGLang configured the substitute
        outs = h.serve_prompts(model, cfg.text_config, _prompts(kimi, wc), spec_algorithm="EAGLE3")
        check.wait()
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1, caplog.text
    assert errors[0].startswith("eagle3_ops: live wiring check: ERROR: "), errors[0]
    assert "[-1, 2, 5] ask SGLang for captures it will not take" in errors[0]
    assert "serving ids [0, 3, 6] instead" in errors[0] and "Served tokens are unchanged" in errors[0]
    assert check.phase == "done", caplog.text
    v = check.verdict
    assert v["verdict"] == "WARNING" and v["configured"]["boundaries"] == [0, 3, 6], v
    assert v["best"]["boundaries"] == kimi_pair.DEFAULT_BOUNDARIES and v["fix"]["ids"] == [2, 5, 7], v
    assert "it holds [-1, 2, 5], which SGLang cannot serve" in v["fix"]["text"], v["fix"]
    (warn,) = [r.getMessage() for r in _lines(caplog, "live wiring check: WARNING")]
    assert warn.startswith("eagle3_ops: live wiring check: WARNING: set eagle_config.eagle_aux_hidden_state_layer_ids"
                           " to [2, 5, 7] in "), warn

    # served as a stock server with [0, 3, 6] serves (the check off: no substitution, nothing recorded)
    monkeypatch.setenv("EAGLE3_OPS_WIRING_CHECK", "0")
    cfg0, model0 = _target(h, kimi)
    h.configure_capture(model0, [0, 3, 6])
    for (aux, logits), (aux0, logits0) in zip(outs, _serve(h, model0, cfg0, _prompts(kimi, wc))):
        assert torch.equal(aux, aux0) and torch.equal(logits, logits0), "the check changed what was served"
    # and with the check off, the edit is SGLang's to fail on, with its own error
    cfg1, model1 = _target(h, kimi)
    h.configure_capture(model1, [-1, 2, 5])
    with pytest.raises(RuntimeError, match=re.escape("captured 2 of 3 aux hidden states")):
        _serve(h, model1, cfg1, _prompts(kimi, wc)[:1])


@pytest.mark.parametrize("cls", CLASSES)
def test_the_seeds_edit_is_said_where_the_check_cannot_substitute(sglang_cpu, wc, kimi, cls, tmp_path, caplog):
    """Started without the server's args (a script: no EAGLE-3 server to read the draft from), the plugin leaves
    SGLang's configuration alone; the check, started by hand, says at configuration what SGLang will do and each
    reading with the ids SGLang serves for it."""
    h = sglang_cpu
    from eagle3_ops.sglang.capture_hooks import capture_state

    edited = _draft(kimi, cls, "default", tmp_path, [-1, 2, 5])
    cfg, model = _target(h, kimi)
    with caplog.at_level(logging.INFO, logger="eagle3_ops.sglang"):
        h.configure_capture(model, [-1, 2, 5])  # SGLang accepts it: layers_to_capture = [-1, 2, 5]
        assert wc.start(model, draft_path=str(edited), target_config=cfg) is None
    assert capture_state(model) is None, "no buffer with fewer slots than the draft's fc takes"
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1, caplog.text
    line = errors[0].getMessage()
    assert "= [-1, 2, 5]" in line and "id -1 -> boundary -1" in line, line
    assert "RuntimeError: captured 2 of 3 aux hidden states" in line
    assert "ruled out" in line and "serve it with ids [0, 3, 6]" in line
    with pytest.raises(RuntimeError, match=re.escape("captured 2 of 3 aux hidden states")):
        _serve(h, model, cfg, _prompts(kimi, wc)[:1])


def test_a_repeated_id_is_caught_with_sglangs_default_as_the_list_to_serve(sglang_cpu, wc, kimi, tmp_path, caplog):
    """[2, 2, 5]: SGLang's deepseek rule captures boundary 2 once but its packer counts three captures. No reading
    of the config is a wiring SGLang serves (each names a boundary twice), so the line names SGLang's default."""
    h = sglang_cpu
    edited = _draft(kimi, "mla", "default", tmp_path, [2, 2, 5])
    cfg, model = _target(h, kimi)
    with caplog.at_level(logging.INFO, logger="eagle3_ops.sglang"):
        h.configure_capture(model, [2, 2, 5])
        assert wc.start(model, draft_path=str(edited), target_config=cfg) is None
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1, caplog.text
    line = errors[0]
    assert "boundaries [2] are named twice and captured once" in line and "captured 2 of 3 aux hidden states" in line
    assert "Serve SGLang's default boundaries [2, 5, 7]" in line and "ids [2, 5, 7]" in line, line
    with pytest.raises(RuntimeError, match=re.escape("captured 2 of 3 aux hidden states")):
        _serve(h, model, cfg, _prompts(kimi, wc)[:1])


def test_the_start_up_line_is_said_where_the_check_is_off(sglang_cpu, wc, kimi, tmp_path, caplog, monkeypatch):
    """With EAGLE3_OPS_DUMP_STATES recording, the live check does not start: the ERROR line still comes, and it
    points at the offline replay instead of a check that will not run."""
    h = sglang_cpu
    monkeypatch.setenv("EAGLE3_OPS_DUMP_STATES", str(tmp_path / "dump.safetensors"))
    edited = _draft(kimi, "llama", "default", tmp_path, [-1, 2, 5])
    cfg, model = _target(h, kimi)
    with caplog.at_level(logging.INFO, logger="eagle3_ops.sglang"):
        model.set_eagle3_layers_to_capture([-1, 2, 5])  # the dump's own install is not what this test is about
        assert wc.start(model, draft_path=str(edited), target_config=cfg) is None
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "serve it with ids [0, 3, 6]" in errors[0], caplog.text
    assert "the live check is off here (EAGLE3_OPS_DUMP_STATES records)" in errors[0]
    assert "doctor --replay" in errors[0] and "the live check then replays" not in errors[0]
    assert any("off while EAGLE3_OPS_DUMP_STATES records" in r.getMessage() for r in caplog.records)

