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

- SGLang's gpt-oss (which captures its last layer's output, boundary L, after its layer loop; served through the
  sink-attention test backend): a draft trained on its own states, recorded by the plugin's dump, with the last
  layer's output in slot 2; served with slot 1 one off, and with the last layer not captured.

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


# ---- the last layer's output, where the family captures it: SGLang's gpt-oss ("after-loop" capture) -------------
GPT_OSS_PROMPTS = 32  # recorded by the check here (the default is 8)
GPT_OSS_TRAINED = (1, 3, 4)  # boundary 4 = the output of the last of its 4 layers


def _gpt_oss_target(h):
    """SGLang's own GptOssForCausalLM over a random Hugging Face gpt-oss (harness family), its layers' output
    projections scaled as the tiny pair's (distinct boundaries), its attention sinks visible; served through the
    sink-attention test backend of test_target_capture_more_families.py (SGLang's CPU backend takes no sinks)."""
    from test_target_capture_more_families import _kv_cache

    cfg = h.FAMILIES["gpt_oss"].make_config()
    hf = h.hf_model("gpt_oss", cfg, torch.float32)
    with torch.no_grad():
        for i, layer in enumerate(hf.model.layers):
            layer.self_attn.sinks.copy_(torch.randn_like(layer.self_attn.sinks))
            for n in ("self_attn.o_proj.weight", "self_attn.o_proj.bias", "mlp.experts.down_proj",
                      "mlp.experts.down_proj_bias"):
                layer.get_parameter(n).mul_(2.0 ** (i + 1))
    return cfg, h.sglang_from_hf("gpt_oss", cfg, torch.float32, hf), _kv_cache


def _serve_gpt_oss(h, model, cfg, kv_cache, prompts):
    for s in range(0, len(prompts), 8):
        chunk = prompts[s:s + 8]
        kv = kv_cache(h, cfg, torch.float32)
        h.run(model, h.extend_batch(kv, [h.Req(kv.new_req()) for _ in chunk], chunk), kv)


@pytest.fixture(scope="module")
def gpt_oss_draft(sglang_cpu, tmp_path_factory):
    """A draft trained on SGLang's own gpt-oss states (recorded by the plugin's states dump, every boundary) at
    GPT_OSS_TRAINED, config ids [0, 2, 3] (SGLang's gpt-oss rule: boundary = id + 1; id 3 is its last layer)."""
    import os

    from safetensors.torch import save_file

    from eagle3_ops.doctor import tiny
    from eagle3_ops.doctor.states import read_states
    from eagle3_ops.sglang import dump_states

    h = sglang_cpu
    root = tmp_path_factory.mktemp("gpt_oss")
    cfg, model, kv_cache = _gpt_oss_target(h)
    states = root / "train.safetensors"
    n = 400
    saved = {k: os.environ.get(k) for k in ("EAGLE3_OPS_DUMP_STATES", "EAGLE3_OPS_DUMP_TOKENS",
                                            "EAGLE3_OPS_DUMP_BOUNDARIES")}
    os.environ.update(EAGLE3_OPS_DUMP_STATES=str(states), EAGLE3_OPS_DUMP_TOKENS=str(n * SEQ),
                      EAGLE3_OPS_DUMP_BOUNDARIES="all")
    try:
        h.configure_capture(model, [0, 1, 2])
        g = torch.Generator().manual_seed(5)
        _serve_gpt_oss(h, model, cfg, kv_cache, torch.randint(2, cfg.vocab_size, (n, SEQ), generator=g).tolist())
        dump_states.wait_all()
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    f = read_states(states, num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size)
    hidden = torch.stack([torch.stack([p["boundaries"][b] for p in f.prompts]) for b in range(5)])
    nxt = torch.stack([p["next_token"] for p in f.prompts])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        dcfg = dict(tiny.draft_config([0, 2, 3]), vocab_size=cfg.vocab_size, draft_vocab_size=64)
        draft = tiny.train_draft(hidden, nxt, list(GPT_OSS_TRAINED), steps=300, seed=31,
                                 draft=tiny.Eagle3Draft(tiny._spec_from(dcfg)))
    finally:
        torch.set_num_threads(threads)
    d = root / "draft"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(dcfg))
    save_file(draft.checkpoint_state_dict(include_embeddings=False), str(d / "model.safetensors"),
              metadata={"format": "pt"})
    return d


@pytest.mark.parametrize("served", [[0, 1, 3], [0, 1, 2]], ids=["slot1-one-off", "last-layer-not-served"])
def test_the_last_layers_output_is_found_where_the_family_captures_it(sglang_cpu, wc, gpt_oss_draft, tmp_path,
                                                                       caplog, monkeypatch, served):
    """gpt-oss captures the output of its last layer (boundary L, after its layer loop): a draft trained with it
    in slot 2 ([1, 3, 4], ids [0, 2, 3] by SGLang's gpt-oss rule), served with slot 1 one off, or with the last
    layer not captured at all, gets a WARNING whose wiring has the last layer's output in slot 2 and ids that
    feed it (id 3), with the trained wiring among the candidates scored on every position."""
    h = sglang_cpu
    monkeypatch.setattr(wc, "CLOSE_AFTER_TOKENS", GPT_OSS_PROMPTS * (SEQ - 1))
    cfg, model, kv_cache = _gpt_oss_target(h)
    draft = copy_draft_with_ids(gpt_oss_draft, tmp_path / "served", nested=served)
    prompts = torch.randint(2, cfg.vocab_size, (GPT_OSS_PROMPTS + 4, SEQ),
                            generator=torch.Generator().manual_seed(9)).tolist()
    with caplog.at_level(logging.INFO, logger="eagle3_ops.sglang"):
        h.configure_capture(model, served)
        check = wc.start(model, draft_path=str(draft), target_config=cfg)
        assert check is not None, caplog.text
        assert 4 in check.recorder.boundaries, check.recorder.boundaries
        _serve_gpt_oss(h, model, cfg, kv_cache, prompts)
        check.wait()
    assert check.phase == "done", caplog.text
    v = check.verdict
    assert v["verdict"] == "WARNING", (v, caplog.text)
    # slot 0 is weakly decided by this tiny draft ([1, 3, 4] 53.4%, [0, 3, 4] 53.0% of 992 positions, seeded):
    # what the evidence decides is slots 1 and 2, the last layer's output in slot 2, and the ids that feed it
    best = v["best"]["boundaries"]
    assert best[1:] == [3, 4] and v["fix"]["ids"][1:] == [2, 3], v["candidates"]
    scored = {tuple(c["boundaries"]): c["accuracy"] for c in v["candidates"]}
    assert scored[GPT_OSS_TRAINED] >= v["best"]["accuracy"] - 0.01, v["candidates"]  # the trained one, named
    assert scored[tuple(v["configured"]["boundaries"])] < v["best"]["accuracy"] - 0.05
