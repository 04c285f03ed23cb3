"""The live check's search finds the trained wiring wherever it lies (issue 37), on SGLang 0.5.23's own classes
as the scheduler runs them (tests/sglang/harness.py), with the plugin's default settings.

The tiny llama target (eagle3_ops.doctor.tiny: 8 layers, boundaries 0..8; SGLang's llama captures 0..7, in layer
order) with two drafts:

- the tiny pair's, trained on [3, 5, 7]: served with one slot one layer early; the embeddings in slot 0 (the
  seed's kind of edit, ids [-1, 4, 6], three boundaries from the trained one); slots 0 and 1 off by 3 and 4 (half
  the model); its ids written out of order (SGLang feeds layer order: the trained wiring, OK);
- the same draft with its fc slots permuted (fc columns and fc_norm weights), so it computes on [7, 5, 3] exactly
  what the tiny pair's computes on [3, 5, 7]: a draft trained on a permutation, which no ids make SGLang feed;
  served with slot 0 off by 5 and slot 2 by 4, and with its own boundaries in layer order.

(Drafts trained here on other wirings rely on one or two of their slots only: the tiny target predicts nearly
one token per prompt, so for them several wirings score alike and the evidence cannot single out the trained
one; the permuted draft is exactly as discriminating as the tiny pair's.)

Every verdict names the trained wiring and the ids that serve it (or why none does); served as trained stays OK;
a draft that ignores its input is not called a wiring problem. The MLA head (``Eagle3DeepseekV2ForCausalLM`` on
the tiny Kimi-K2.5 target) has its cases in test_wiring_check_kimi.py.
"""
import json
import logging

import pytest
import torch

from doctor_fixtures import copy_draft_with_ids

SEQ = 32


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from eagle3_ops.doctor.tiny import build_tiny_pair

    return build_tiny_pair(tmp_path_factory.getbasetemp() / "doctor_tiny_pair")


PERMUTATION = [2, 1, 0]  # slot s of the permuted draft holds slot PERMUTATION[s] of the tiny pair's


@pytest.fixture(scope="module")
def drafts(pair, tmp_path_factory):
    """{trained boundaries: draft folder}: the tiny pair's draft, and the same with its fc slots permuted."""
    from safetensors.torch import load_file, save_file

    from eagle3_ops.doctor import tiny

    trained = [3, 5, 7]
    permuted = tuple(trained[k] for k in PERMUTATION)
    d = tmp_path_factory.getbasetemp() / "permuted_draft"
    d.mkdir(parents=True, exist_ok=True)
    weights = load_file(str(pair.draft_dir / "model.safetensors"))
    H = tiny.HIDDEN
    weights["fc.weight"] = torch.cat([weights["fc.weight"][:, k * H:(k + 1) * H] for k in PERMUTATION], dim=1)
    norms = {s: weights[f"fc_norm.{s}.weight"].clone() for s in range(3)}
    for s, k in enumerate(PERMUTATION):
        weights[f"fc_norm.{s}.weight"] = norms[k]
    save_file({n: t.contiguous() for n, t in weights.items()}, str(d / "model.safetensors"), metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps(tiny.draft_config([b - 1 for b in permuted])))
    return {tuple(trained): pair.draft_dir, permuted: d}


def _target(h, pair):
    from safetensors.torch import load_file
    from transformers import LlamaConfig

    cfg = LlamaConfig.from_pretrained(pair.target_dir)
    weights = load_file(str(pair.target_dir / "model.safetensors"))
    return cfg, h.sglang_model("llama", cfg, torch.float32, weights=weights.items())


def _live(h, wc, pair, draft, ids, caplog):
    cfg, model = _target(h, pair)
    prompts = json.loads(pair.prompts_file.read_text())[:wc.CLOSE_AFTER_TOKENS // SEQ + 4]
    with caplog.at_level(logging.INFO, logger="eagle3_ops.sglang"):
        h.configure_capture(model, ids)
        check = wc.start(model, draft_path=str(draft), target_config=cfg)
        assert check is not None, caplog.text
        h.serve_prompts(model, cfg, prompts)
        check.wait()
    assert check.phase == "done", caplog.text
    return check


def _verdict_lines(caplog):
    return [r.getMessage() for r in caplog.records
            if "live wiring check: " in r.getMessage() and any(
                w in r.getMessage() for w in (": OK:", ": WARNING:", ": UNDECIDED:"))]


# (trained boundaries, served ids, the ids that serve the trained wiring or None where SGLang cannot)
CASES = [
    ((3, 5, 7), [1, 4, 6], [2, 4, 6]),     # slot 0 one layer early
    ((3, 5, 7), [-1, 4, 6], [2, 4, 6]),    # the embeddings in slot 0 (a hand edit), three boundaries away
    ((3, 5, 7), [-1, 0, 6], [2, 4, 6]),    # slots 0 and 1 off by 3 and 4 (half the model)
    ((3, 5, 7), [6, 4, 2], [2, 4, 6]),     # ids out of order: SGLang feeds layer order, the trained wiring
    ((7, 5, 3), [1, 4, 6], None),          # a permutation; slot 0 off by 5, slot 2 by 4
    ((7, 5, 3), [2, 4, 6], None),          # a permutation, its own boundaries fed in layer order
]


@pytest.mark.parametrize("trained,served,fix", CASES, ids=[f"{t}-served{s}" for t, s, _ in CASES])
def test_the_verdict_names_the_trained_wiring_and_the_ids_that_serve_it(sglang_cpu, wc, pair, drafts, tmp_path,
                                                                         caplog, trained, served, fix):
    draft = copy_draft_with_ids(drafts[trained], tmp_path / "served", nested=served)
    check = _live(sglang_cpu, wc, pair, draft, served, caplog)
    v = check.verdict
    assert set(check.recorder.boundaries) >= set(range(8)), check.recorder.boundaries  # every boundary recorded
    if sorted(served) == sorted(b - 1 for b in trained) and fix is not None:  # the same wiring, in layer order
        assert v["verdict"] == "OK", caplog.text
        return
    assert v["verdict"] == "WARNING", (v, caplog.text)
    assert v["best"]["boundaries"] == list(trained), v["candidates"]
    assert v["fix"]["ids"] == fix, v["fix"]
    (line,) = _verdict_lines(caplog)
    head = "eagle3_ops: live wiring check: WARNING: "
    if fix is not None:
        assert line.startswith(head + f"set eagle_config.eagle_aux_hidden_state_layer_ids to {fix} in "), line
    else:
        assert line.startswith(head + "SGLang cannot feed the wiring the draft was trained on"), line
        assert "No id list makes SGLang feed that wiring" in v["fix"]["text"], v["fix"]
    assert f"boundaries {list(trained)}" in line, line


@pytest.mark.parametrize("trained,ids", [((3, 5, 7), [2, 4, 6])], ids=["tiny-pair"])
def test_served_as_trained_stays_ok(sglang_cpu, wc, pair, drafts, caplog, trained, ids):
    check = _live(sglang_cpu, wc, pair, drafts[trained], ids, caplog)
    assert check.verdict["verdict"] == "OK", caplog.text
    assert check.verdict["search"]["best"] == list(trained)
    (line,) = _verdict_lines(caplog)
    assert line.startswith("eagle3_ops: live wiring check: OK: "), line


def test_a_draft_that_ignores_its_input_is_not_called_a_wiring_problem(sglang_cpu, wc, pair, tmp_path, caplog):
    """The tiny pair's draft with its fc zeroed: every wiring predicts what the draft fed nothing predicts, so
    the verdict says the wiring is not the problem and names the draft's weights."""
    from safetensors.torch import load_file, save_file

    draft = copy_draft_with_ids(pair.draft_dir, tmp_path / "blind", nested=[2, 4, 6])
    weights = load_file(str(draft / "model.safetensors"))
    weights["fc.weight"] = torch.zeros_like(weights["fc.weight"])
    save_file(weights, str(draft / "model.safetensors"), metadata={"format": "pt"})
    check = _live(sglang_cpu, wc, pair, draft, [2, 4, 6], caplog)
    v = check.verdict
    assert v["verdict"] == "NO_WIRING_FITS", (v, caplog.text)
    warn = [r.getMessage() for r in caplog.records if "the wiring is not the problem" in r.getMessage()]
    assert len(warn) == 1 and "untrained or missing" in warn[0], caplog.text
    assert not [r for r in caplog.records if "live wiring check: OK" in r.getMessage()]
