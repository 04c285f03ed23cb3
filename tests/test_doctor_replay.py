"""Wiring doctor, replay: a real tiny Llama target and an EAGLE-3 draft trained on its own hidden states at
boundaries 3, 5, 7 (SpecForge ids [2, 4, 6]); the replay must pick that wiring, clearly ahead of wrong ones."""
from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from doctor_fixtures import codes, copy_draft_with_ids, finding, run_doctor, tiny_pair, tiny_states  # noqa: F401
from eagle3_ops.doctor.draft import DraftSpec, Eagle3Draft

TRAINED = [3, 5, 7]


def replay(draft, pair, states, *extra):
    return run_doctor("--draft", draft, "--target", pair.target_dir, "--replay", states, *extra)


def test_tiny_pair_is_real(tiny_pair):  # noqa: F811
    assert tiny_pair.trained_ids == [2, 4, 6]
    assert tiny_pair.heldout_accuracy > 0.6  # the draft learned the target's next token on held-out prompts


def test_capture_states_file(tiny_pair, tiny_states):  # noqa: F811
    from transformers import AutoModelForCausalLM

    with safe_open(str(tiny_states), framework="pt") as f:
        meta = f.metadata()
        hs = f.get_tensor("prompt.0.hidden_states")
        ids = f.get_tensor("prompt.0.input_ids")
        last = f.get_tensor("prompt.0.last_layer_output")
        nxt = f.get_tensor("prompt.0.next_token")
    assert meta["format"] == "eagle3_ops.doctor.states/1" and meta["num_layers"] == "8"
    assert hs.shape == (9, 32, 64) and ids.shape == (32,) and last.shape == (32, 64) and nxt.shape == (32,)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_pair.target_dir)).eval()
    with torch.no_grad():
        torch.testing.assert_close(model.model.embed_tokens(ids), hs[0])       # boundary 0 = embeddings
        torch.testing.assert_close(model.model.norm(last), hs[8])              # HF's last entry is after the norm
        assert torch.equal(model(ids[None]).logits[0].argmax(-1), nxt)


def test_replay_picks_the_trained_wiring(tiny_pair, tiny_states):  # noqa: F811
    rc, rep, _ = replay(tiny_pair.draft_dir, tiny_pair, tiny_states)
    assert rc == 0, codes(rep)
    r = rep["replay"]
    assert r["tokens"] >= 2000
    assert r["configured"]["boundaries"] == TRAINED
    conf = r["configured"]["accuracy"]
    assert r["best"]["boundaries"] == TRAINED and conf > 0.6
    assert len(r["candidates"]) >= 5    # the served wiring and the search's finalists, scored on every position
    for c in r["candidates"]:           # every other wiring costs accuracy (the closest ~4 points for seed 0)
        if c["boundaries"] != TRAINED:
            assert c["accuracy"] < conf - 0.01, c
    search = r["search"]                # every boundary in every slot was tried
    assert search["best"] == TRAINED and search["top"][0]["boundaries"] == TRAINED
    assert search["wirings_scanned"] >= 3 * 9 - 2 and search["slot_sweeps"] >= 3
    top1 = {tuple(t["boundaries"]): t["top1"] for t in search["top"]}
    assert all(v < top1[tuple(TRAINED)] for k, v in top1.items() if k != tuple(TRAINED))
    assert "I_REPLAY_CONFIGURED_BEST" in codes(rep, "info") and r["verdict"]["word"] == "OK"


def test_replay_catches_a_config_edited_to_the_wrong_convention(tiny_pair, tiny_states, tmp_path):  # noqa: F811
    # Ids rewritten one layer early (as if "output of layer k" meant "entering layer k"): the config is
    # self-consistent, only replay can tell.
    d = copy_draft_with_ids(tiny_pair, tmp_path / "shifted", nested=[1, 3, 5])
    rc, rep, _ = run_doctor("--draft", d, "--target", tiny_pair.target_dir)
    assert rc == 0
    rc, rep, _ = replay(d, tiny_pair, tiny_states)
    assert rc == 1
    r = rep["replay"]
    assert r["configured"]["boundaries"] == [2, 4, 6]
    assert r["best"]["boundaries"] == TRAINED and r["best"]["ids"] == [2, 4, 6]
    assert r["gain"] > 0.1
    msg = finding(rep, "E_REPLAY_BETTER_WIRING")["message"]
    assert "[2, 4, 6]" in msg and "eagle_config.eagle_aux_hidden_state_layer_ids" in msg


@pytest.mark.parametrize("sweep", [(), ("--replay-sweep",)], ids=["search", "sweep"])
def test_replay_finds_a_slot_replaced_by_the_embeddings(tiny_pair, tiny_states, tmp_path, sweep):  # noqa: F811
    # Slot 0's id was replaced by -1 (embeddings): self-consistent config, and the trained boundary (3) is not a
    # neighbour of the configured one (0); the search finds it by default (--replay-sweep also scores every
    # single-slot change on every position), and the verdict words are the live check's.
    d = copy_draft_with_ids(tiny_pair, tmp_path / "emb", nested=[-1, 4, 6])
    rc, rep, _ = run_doctor("--draft", d, "--target", tiny_pair.target_dir)
    assert rc == 0
    rc, rep, _ = replay(d, tiny_pair, tiny_states, *sweep)
    assert rc == 1
    assert rep["replay"]["configured"]["boundaries"] == [0, 5, 7]
    assert rep["replay"]["best"]["boundaries"] == TRAINED and rep["replay"]["best"]["ids"] == [2, 4, 6]
    assert "E_REPLAY_BETTER_WIRING" in codes(rep, "error")
    assert rep["replay"]["verdict"]["word"] == "WARNING" and rep["replay"]["verdict"]["ids"] == [2, 4, 6]


def test_replay_with_vllm_convention_error(tiny_pair, tiny_states, tmp_path):  # noqa: F811
    # SpecForge ids copied unchanged to the top level: vLLM reads them one layer early. Config check and replay agree.
    d = copy_draft_with_ids(tiny_pair, tmp_path / "vllm", top=[2, 4, 6])
    rc, rep, _ = replay(d, tiny_pair, tiny_states, "--engine", "vllm")
    assert rc == 1
    assert {"E_CONVENTION_MISMATCH", "E_REPLAY_BETTER_WIRING"} <= set(codes(rep, "error"))
    assert rep["replay"]["best"]["boundaries"] == TRAINED and rep["replay"]["best"]["ids"] == [3, 5, 7]
    d = copy_draft_with_ids(tiny_pair, tmp_path / "vllm_ok", top=[3, 5, 7])
    rc, rep, _ = replay(d, tiny_pair, tiny_states, "--engine", "vllm")
    assert rc == 0, codes(rep)


def test_replay_states_from_another_model(tiny_pair, tiny_states, tmp_path):  # noqa: F811
    from doctor_fixtures import write_target

    other = write_target(tmp_path / "t", num_layers=6, hidden=64, vocab=64)
    rc, rep, err = run_doctor("--draft", tiny_pair.draft_dir, "--target", other, "--replay", tiny_states)
    assert rc == 2 and "states from another model" in err


def test_draft_module_matches_sglang_layer_math():
    """The replay draft's first layer follows SGLang llama_eagle3: residual = fc output (not normed),
    q/k/v over [input_layernorm(embeds), hidden_norm(h)], fused residual adds, final norm(h + residual)."""
    torch.manual_seed(0)
    spec = DraftSpec(hidden_size=16, target_hidden_size=8, num_aux=3, vocab_size=32, draft_vocab_size=32,
                     num_heads=2, num_kv_heads=1, intermediate_size=24)
    m = Eagle3Draft(spec).eval()
    for p in m.parameters():
        p.data.normal_(0, 0.3)
    aux, emb = torch.randn(5, 24), torch.randn(5, 16)
    lay = m.layers[0]

    def rms(x, w):
        return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + spec.rms_norm_eps)

    h = m.fc(aux)
    x = torch.cat([rms(emb, lay.input_layernorm.weight), rms(h, lay.hidden_norm.weight)], -1)
    a = lay.self_attn(x, torch.arange(5))
    res = a + h
    y = lay.mlp(rms(res, lay.post_attention_layernorm.weight))
    ref = m.lm_head(rms(y + res, m.norm.weight))
    with torch.no_grad():
        torch.testing.assert_close(m(aux, emb), ref)


def test_replay_reads_only_the_embedding_rows_it_needs(tmp_path):
    """A draft with its own embedding (hidden size != the target's) holds, for a replay, only the rows of
    the tokens the states contain (read as safetensors slices): the same embeddings as the whole matrix."""
    from safetensors.torch import save_file

    from eagle3_ops.doctor.configs import TensorInfo, load_rows

    gen = torch.Generator().manual_seed(4)
    full = torch.randn(50, 8, generator=gen)
    save_file({"model.embed_tokens.weight": full}, str(tmp_path / "model.safetensors"))
    info = TensorInfo("embed_tokens.weight", "model.embed_tokens.weight", (50, 8), "F32",
                      str(tmp_path / "model.safetensors"))
    ids = torch.tensor([[7, 3, 3, 41], [0, 7, 49, 12]])
    subset = torch.unique(ids)
    rows = load_rows(info, subset)
    assert torch.equal(rows, full[subset])
    spec = DraftSpec(hidden_size=8, target_hidden_size=16, num_aux=3, vocab_size=50, draft_vocab_size=10)
    draft = Eagle3Draft(spec, embedding_rows=subset.numel())
    assert draft.embed_tokens.weight.shape == (subset.numel(), 8)  # not the vocabulary
    draft.use_embedding_rows(subset, rows)
    assert torch.equal(draft.embed(ids), full[ids])
    try:
        draft.embed(torch.tensor([5]))
    except ValueError as e:
        assert "not loaded" in str(e)
    else:
        raise AssertionError("a token whose row was not loaded must not embed silently")


def test_the_draft_runs_on_sglangs_own_class_only_with_the_pinned_sglang(monkeypatch):
    """``--replay-draft auto``: SGLang's class where SGLang serves the draft and the pinned SGLang is installed
    (its CPU runtime is what the runner drives); the plain twin for vLLM, another SGLang, none, or a GPU."""
    from eagle3_ops.doctor import sglang_code
    from eagle3_ops.doctor.replay import draft_implementation

    monkeypatch.setattr(sglang_code, "installed_version", lambda: "0.5.23")
    assert draft_implementation("sglang") == "sglang"
    assert draft_implementation("vllm") == draft_implementation("trtllm") == "plain"
    assert draft_implementation("sglang", device="cuda") == "plain"
    assert draft_implementation("vllm", "sglang") == "sglang"  # asked for
    for other in ("0.5.24", None):
        monkeypatch.setattr(sglang_code, "installed_version", lambda v=other: v)
        assert draft_implementation("sglang") == "plain", other


def _verdict_of(conf_hits, best_hits, n, blind_hits=0, margin=0.02):
    """replay._verdict on synthetic per-position results: the served wiring right at ``conf_hits`` of ``n``
    positions, an alternative at ``best_hits`` (its hits a superset, so the paired difference is exact)."""
    import types

    from eagle3_ops.doctor import replay
    from eagle3_ops.doctor.checks import Finding

    def hits(k):
        t = torch.zeros(n, dtype=torch.bool)
        t[:k] = True
        return t

    found = []
    report = types.SimpleNamespace(
        options=types.SimpleNamespace(engine="sglang"), target=types.SimpleNamespace(num_layers=8),
        replay={"search": {"wirings_scanned": 40}}, findings=found,
        add=lambda code, msg, fix="": found.append(Finding(code, code.severity, msg, fix)))
    conf = {"label": "configured", "boundaries": [2, 4, 6], "accuracy": conf_hits / n, "ids": [1, 3, 5],
            "_correct": hits(conf_hits)}
    alt = {"label": "search: slot 0", "boundaries": [3, 4, 6], "accuracy": best_hits / n, "ids": [2, 3, 5],
           "_correct": hits(best_hits)}
    results = [conf, alt]
    order = sorted(range(2), key=lambda i: (-results[i]["accuracy"], i))
    states = types.SimpleNamespace(groups=[{"ids": torch.zeros(n // 30, 31)}])
    replay._verdict(report, None, states, results, order, conf, hits(blind_hits), margin, n, n)
    return report.replay["verdict"], {f.code: f for f in found}


def test_the_verdict_is_never_ok_while_an_alternative_scores_higher():
    # +1.5 points: under the margin; the evidence does not separate them, and no number of prompts would count
    v, codes_ = _verdict_of(180, 184, 300)
    assert v["word"] == "UNDECIDED" and "W_REPLAY_UNDECIDED" in codes_, v
    assert "60.0%" in v["text"] and "61.3%" in v["text"] and "no number of prompts" in v["need"], v
    # +2.7 points, over the margin, but 8 positions differ of 300: under 3 standard errors; how many more would tell
    v, _ = _verdict_of(180, 188, 300)
    assert v["word"] == "UNDECIDED" and v["need"].startswith("about ") and "more prompts" in v["need"], v
    more = int(v["need"].split()[1])
    n2 = 300 + 2 * more  # twice as many more as it says, the same rates: separated
    v2, _ = _verdict_of(180 * n2 // 300, 180 * n2 // 300 + 8 * n2 // 300, n2)
    assert v2["word"] == "WARNING", (more, v2)
    # the same score: no alternative is higher, OK
    v, codes_ = _verdict_of(180, 180, 300)
    assert v["word"] == "OK" and "I_REPLAY_CONFIGURED_BEST" in codes_, v
    # clearly higher: WARNING with the ids
    v, codes_ = _verdict_of(90, 180, 300)
    assert v["word"] == "WARNING" and v["ids"] == [2, 3, 5] and "E_REPLAY_BETTER_WIRING" in codes_, v
