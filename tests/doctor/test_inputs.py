"""Wiring doctor and capture-states: every bad input exits with status 2 and one clear line naming the argument
or file (no traceback, no hang), and capture-states refuses models it would record wrongly (missing weights,
remote code not allowed)."""
from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from doctor_fixtures import draft_tensors, eagle3_ops, run_doctor, write_draft, write_target
from eagle3_ops.doctor import cli
from machine import needs_sglang

L = 32  # target layers of the hand-written pair


def assert_exit_2(rc, err, *phrases):
    assert rc == 2, (rc, err)
    assert "Traceback" not in err
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1, err
    for p in phrases:
        assert p in err, (p, err)


def doctor(capsys, *args):
    capsys.readouterr()  # only what this command prints
    rc = cli.main([str(a) for a in args])
    return rc, capsys.readouterr().err


def capture(capsys, *args):
    capsys.readouterr()
    rc = cli.capture_states_main([str(a) for a in args])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture
def pair(tmp_path):
    return write_target(tmp_path / "target", num_layers=L), write_draft(tmp_path / "draft", ids=[1, 15, 28])


def write_states(path, *, prompts=2, tokens=8, hidden=16, fill=None) -> Path:
    """A STATES file for the hand-written target (random states: enough to reach the replay's input checks)."""
    g = torch.Generator().manual_seed(0)
    t = {}
    for i in range(prompts):
        hs = torch.randn(L + 1, tokens, hidden, generator=g)
        if fill is not None and i == fill[0]:
            hs[fill[1]] = fill[2]
        t[f"prompt.{i}.input_ids"] = torch.randint(0, 128, (tokens,), generator=g)
        t[f"prompt.{i}.hidden_states"] = hs
        t[f"prompt.{i}.next_token"] = torch.randint(0, 128, (tokens,), generator=g)
    save_file(t, str(path), metadata={"format": "eagle3_ops.doctor.states/1"})
    return Path(path)


def edit_config(d: Path, **changes) -> Path:
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


# ------------------------------------------------------------------------------------- A1: negative id lists
@pytest.mark.parametrize("ids", [["--trained-ids", "-1,4,6"], ["--trained-ids=-1,4,6"], ["--trained-ids", "-1,4,6,"]],
                         ids=["separate", "equals", "trailing-comma"])
def test_trained_ids_may_start_with_a_negative_id(pair, ids):
    t, d = pair
    rc, rep, err = run_doctor("--draft", d, "--target", t, *ids)
    assert rc in (0, 1), err
    assert rep["training"]["ids"] == [-1, 4, 6]


def test_trained_ids_negative_subprocess(pair):
    t, d = pair
    r = eagle3_ops("doctor", "--draft", d, "--target", t, "--trained-ids", "-1,4,6", "--json")
    assert r.returncode in (0, 1), r.stderr
    assert json.loads(r.stdout)["training"]["ids"] == [-1, 4, 6]


@pytest.mark.parametrize("form", ["separate", "equals"])
def test_pp_partition_with_a_negative_count_reaches_its_check(pair, capsys, form):
    t, d = pair
    part = ["--pp-partition", "-1,33"] if form == "separate" else ["--pp-partition=-1,33"]
    rc, err = doctor(capsys, "--draft", d, "--target", t, "--pp", "2", *part)
    assert_exit_2(rc, err, "--pp-partition [-1, 33] must list 2 positive layer counts")


# ---------------------------------------------------------------------------------- A2: numeric options
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "-0.1", "1", "1.5"])
def test_replay_margin_out_of_range(pair, capsys, value):
    t, d = pair
    rc, err = doctor(capsys, "--draft", d, "--target", t, f"--replay-margin={value}")
    assert_exit_2(rc, err, "--replay-margin must be an accuracy gain in [0, 1)")


@pytest.mark.parametrize("opt,value,phrase", [("--replay-max-tokens", "0", "--replay-max-tokens must be >= 1"),
                                              ("--tp", "0", "--tp must be >= 1"),
                                              ("--pp", "-2", "--pp must be >= 1")])
def test_counts_must_be_positive(pair, capsys, opt, value, phrase):
    t, d = pair
    rc, err = doctor(capsys, "--draft", d, "--target", t, f"{opt}={value}")
    assert_exit_2(rc, err, phrase)


def test_margin_in_range_is_accepted(pair, capsys):
    t, d = pair
    rc, err = doctor(capsys, "--draft", d, "--target", t, "--replay-margin", "0")
    assert rc == 0, err


# ------------------------------------------------------------------------------------ A3, B5: replay's draft
# the replay's draft: SGLang's own class (the default where SGLang is installed, as here) or the plain twin
SGLANG_CODE, PLAIN_CODE = ("--replay-draft", "sglang"), ("--replay-draft", "plain")


def test_unknown_hidden_act_is_refused(pair, tmp_path, capsys):
    t, d = pair
    edit_config(d, hidden_act="squared_relu")
    rc, err = doctor(capsys, "--draft", d, "--target", t, "--replay", write_states(tmp_path / "s.safetensors"),
                     *PLAIN_CODE)
    assert_exit_2(rc, err, "hidden_act 'squared_relu' is not supported", "supported: silu")


@needs_sglang
def test_unknown_hidden_act_is_refused_by_sglangs_class(pair, tmp_path, capsys):
    t, d = pair
    edit_config(d, hidden_act="squared_relu")
    rc, err = doctor(capsys, "--draft", d, "--target", t, "--replay", write_states(tmp_path / "s.safetensors"))
    assert_exit_2(rc, err, "LlamaForCausalLMEagle3 (sglang.srt.models.llama_eagle3) cannot build this draft",
                  "Unsupported activation: squared_relu")


def test_other_architectures_are_refused(pair, tmp_path, capsys):
    t, d = pair
    edit_config(d, architectures=["DeepseekV3ForCausalLMEagle3"])
    rc, err = doctor(capsys, "--draft", d, "--target", t, "--replay", write_states(tmp_path / "s.safetensors"),
                     *PLAIN_CODE)
    assert_exit_2(rc, err, "replay runs LlamaForCausalLMEagle3 drafts only; this draft is DeepseekV3ForCausalLMEagle3")


@needs_sglang
def test_other_architectures_are_refused_by_sglangs_class(pair, tmp_path, capsys):
    t, d = pair
    edit_config(d, architectures=["DeepseekV3ForCausalLMEagle3"])
    rc, err = doctor(capsys, "--draft", d, "--target", t, "--replay", write_states(tmp_path / "s.safetensors"),
                     *SGLANG_CODE)
    assert_exit_2(rc, err, "the draft's architectures ['DeepseekV3ForCausalLMEagle3'] name none of SGLang 0.5.23's "
                           "EAGLE-3 heads (Eagle3DeepseekV2ForCausalLM, LlamaForCausalLMEagle3)")


def _no_architectures(tmp_path):
    t = write_target(tmp_path / "target", num_layers=L)
    return t, write_states(tmp_path / "s.safetensors"), \
        edit_config(write_draft(tmp_path / "llama", ids=[1, 15, 28]), architectures=[])


def test_no_architectures_needs_the_llama_layout(tmp_path, capsys):
    """The plain twin replays a draft without architectures when its tensors are llama_eagle3's."""
    t, states, llama = _no_architectures(tmp_path)
    rc, err = doctor(capsys, "--draft", llama, "--target", t, "--replay", states, *PLAIN_CODE)
    assert rc in (0, 1), err  # replayed
    layer = {k: v for k, v in draft_tensors().items() if k.startswith("midlayer.")}
    renamed = {"decoder." + k[len("midlayer."):]: v for k, v in layer.items()}  # not the llama_eagle3 names
    other = edit_config(write_draft(tmp_path / "other", ids=[1, 15, 28], tensors=renamed, drop=tuple(layer)),
                        architectures=[])
    rc, err = doctor(capsys, "--draft", other, "--target", t, "--replay", states, *PLAIN_CODE)
    assert_exit_2(rc, err, "replay runs LlamaForCausalLMEagle3 drafts only; this draft is of unknown architecture")


@needs_sglang
def test_no_architectures_cannot_pick_sglangs_class(tmp_path, capsys):
    """SGLang resolves a draft's class from its architectures: its own class cannot be picked for such a draft
    (and the replay says so; the default where SGLang is installed)."""
    t, states, llama = _no_architectures(tmp_path)
    rc, err = doctor(capsys, "--draft", llama, "--target", t, "--replay", states)
    assert_exit_2(rc, err, "the draft's architectures [] name none of SGLang 0.5.23's EAGLE-3 heads")


# ---------------------------------------------------------------------------------------- A4: STATES values
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_states_are_refused(pair, tmp_path, capsys, value):
    t, d = pair
    states = write_states(tmp_path / "s.safetensors", fill=(1, slice(None), value))
    rc, err = doctor(capsys, "--draft", d, "--target", t, "--replay", states)
    assert_exit_2(rc, err, "holds non-finite values in prompt 1")


def test_one_nan_is_enough(pair, tmp_path, capsys):
    t, d = pair
    states = write_states(tmp_path / "s.safetensors", fill=(0, (5, 3, 2), float("nan")))
    rc, err = doctor(capsys, "--draft", d, "--target", t, "--replay", states)
    assert_exit_2(rc, err, "non-finite values in prompt 0")


# ------------------------------------------------------------------------------- A5, A6, A7: files and paths
@pytest.mark.parametrize("which", ["weights", "config", "states", "prompts"])
def test_fifo_is_refused_not_opened(pair, tmp_path, which):
    t, d = pair
    states = write_states(tmp_path / "s.safetensors")
    fifo = {"weights": d / "model.safetensors", "config": d / "config.json", "states": states,
            "prompts": tmp_path / "prompts.txt"}[which]
    if fifo.exists():
        fifo.unlink()
    os.mkfifo(fifo)
    if which == "prompts":
        args = ["capture-states", "--model", t, "--prompts", fifo, "--out", tmp_path / "o.safetensors"]
    else:
        args = ["doctor", "--draft", d, "--target", t, "--replay", states]
    r = eagle3_ops(*args, timeout=60)  # a hang fails as TimeoutExpired
    assert_exit_2(r.returncode, r.stderr, f"{fifo} is a FIFO, not a regular file")


def test_replay_directory_is_named_a_directory(pair, tmp_path, capsys):
    t, d = pair
    rc, err = doctor(capsys, "--draft", d, "--target", t, "--replay", tmp_path)
    assert_exit_2(rc, err, f"{tmp_path} is a directory; expected a STATES .safetensors file")
    assert "does not exist" not in err


def _deny_reading(monkeypatch, path: Path):
    """chmod 000, and (root reads anyway) make opening it fail the way it does for other users."""
    path.chmod(0)
    if os.geteuid() == 0:
        real_open = os.open

        def fake_open(p, flags, *a, **k):
            if os.path.abspath(p) == os.path.abspath(path):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(p))
            return real_open(p, flags, *a, **k)

        monkeypatch.setattr(os, "open", fake_open)


@pytest.mark.parametrize("which", ["weights", "config", "states", "prompts"])
def test_unreadable_file_says_permission_denied(pair, tmp_path, capsys, monkeypatch, which):
    t, d = pair
    states = write_states(tmp_path / "s.safetensors")
    prompts = tmp_path / "prompts.json"
    prompts.write_text("[[1, 2, 3]]")
    path = {"weights": d / "model.safetensors", "config": d / "config.json", "states": states,
            "prompts": prompts}[which]
    _deny_reading(monkeypatch, path)
    try:
        if which == "prompts":
            rc, _, err = capture(capsys, "--model", t, "--prompts", prompts, "--out", tmp_path / "o.safetensors")
        else:
            rc, err = doctor(capsys, "--draft", d, "--target", t, "--replay", states)
    finally:
        path.chmod(0o644)
    assert_exit_2(rc, err, f"cannot read {path}: permission denied")
    assert "No such file" not in err


def test_sharded_index_with_list_weight_map(pair, capsys):
    t, d = pair
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["model.safetensors"]}))
    rc, err = doctor(capsys, "--draft", d, "--target", t)
    assert_exit_2(rc, err, "weight_map must be a JSON object mapping tensor names to files", "found list")


def test_sharded_index_that_is_not_an_object(pair, capsys):
    t, d = pair
    (d / "model.safetensors.index.json").write_text("[]")
    rc, err = doctor(capsys, "--draft", d, "--target", t)
    assert_exit_2(rc, err, "model.safetensors.index.json must hold a JSON object")


# ------------------------------------------------------------------------------------------ B: capture-states
def write_llama(path: Path, *, tie: bool = False, drop=(), extra_config=None) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=tie)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(str(path))
    if drop:
        f = path / "model.safetensors"
        t = load_file(str(f))
        for name in drop:
            del t[name]
        save_file(t, str(f), metadata={"format": "pt"})
    if extra_config:
        edit_config(path, **extra_config)
    return path


@pytest.fixture
def prompts(tmp_path):
    p = tmp_path / "prompts.json"
    p.write_text(json.dumps([[3, 4, 5, 6, 7], [8, 9, 10]]))
    return p


def test_default_dtype_is_bfloat16(tmp_path, prompts, capsys):
    out = tmp_path / "s.safetensors"
    rc, stdout, err = capture(capsys, "--model", write_llama(tmp_path / "m"), "--prompts", prompts, "--out", out)
    assert rc == 0, err
    assert "2 prompts, 8 tokens, 3 boundaries x hidden 16" in stdout
    with safe_open(str(out), framework="pt") as f:
        states = [f.get_tensor(k) for k in f.keys() if f.get_tensor(k).is_floating_point()]
    assert states and all(t.dtype == torch.bfloat16 for t in states)


def test_missing_weight_is_refused(tmp_path, prompts, capsys):
    m = write_llama(tmp_path / "m", drop=("model.layers.1.mlp.down_proj.weight",))
    out = tmp_path / "s.safetensors"
    rc, _, err = capture(capsys, "--model", m, "--prompts", prompts, "--out", out)
    assert_exit_2(rc, err, "lacks 1 weight(s)", "model.layers.1.mlp.down_proj.weight")
    assert not out.exists()


def test_many_missing_weights_are_counted(tmp_path, prompts, capsys):
    names = [f"model.layers.{i}.{w}" for i in range(2) for w in
             ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
              "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight")]
    m = write_llama(tmp_path / "m", drop=names)
    rc, _, err = capture(capsys, "--model", m, "--prompts", prompts, "--out", tmp_path / "s.safetensors")
    assert_exit_2(rc, err, "lacks 12 weight(s)", "and 2 more")


def test_tied_lm_head_is_not_missing(tmp_path, prompts, capsys):
    m = write_llama(tmp_path / "m", tie=True)
    with safe_open(str(m / "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" not in f.keys()  # tied: only the embedding is stored
    rc, _, err = capture(capsys, "--model", m, "--prompts", prompts, "--out", tmp_path / "s.safetensors",
                         "--dtype", "float32")
    assert rc == 0, err


def _remote_code_model(path: Path, *, weights: bool) -> Path:
    """A Llama under a model type transformers does not know, with its code in the checkpoint (auto_map)."""
    if weights:
        write_llama(path)
    else:
        path.mkdir(parents=True)
        (path / "config.json").write_text(json.dumps({"hidden_size": 16, "num_hidden_layers": 2}))
    (path / "configuration_e3.py").write_text(
        "from transformers import LlamaConfig\n\n\nclass E3Config(LlamaConfig):\n    model_type = 'e3test'\n")
    (path / "modeling_e3.py").write_text(
        "from transformers import LlamaForCausalLM\n\nfrom .configuration_e3 import E3Config\n\n\n"
        "class E3ForCausalLM(LlamaForCausalLM):\n    config_class = E3Config\n")
    return edit_config(path, model_type="e3test", architectures=["E3ForCausalLM"],
                       auto_map={"AutoConfig": "configuration_e3.E3Config",
                                 "AutoModelForCausalLM": "modeling_e3.E3ForCausalLM"})


class _Prompted(BaseException):
    pass


def test_remote_code_needs_the_flag_and_never_prompts(tmp_path, prompts, capsys, monkeypatch):
    def no_prompt(*_a, **_k):
        raise _Prompted("transformers asked y/N")

    monkeypatch.setattr("builtins.input", no_prompt)
    m = _remote_code_model(tmp_path / "m", weights=False)
    rc, _, err = capture(capsys, "--model", m, "--prompts", prompts, "--out", tmp_path / "s.safetensors")
    assert_exit_2(rc, err, "this model needs --trust-remote-code (its config.json has auto_map)")


def test_trust_remote_code_loads_the_model(tmp_path, prompts):
    m = _remote_code_model(tmp_path / "m", weights=True)
    out = tmp_path / "s.safetensors"
    r = eagle3_ops("capture-states", "--model", m, "--prompts", prompts, "--out", out, "--trust-remote-code")
    assert r.returncode == 0, r.stderr
    # its code went into the run's folder (tests/conftest.py), not the user's cache
    assert any(Path(os.environ["HF_MODULES_CACHE"]).rglob("modeling_e3.py"))
    assert "2 prompts, 8 tokens, 3 boundaries" in r.stdout and out.exists()


def test_device_map_needs_accelerate(tmp_path, prompts, capsys, monkeypatch):
    from eagle3_ops.doctor import capture_states

    monkeypatch.setattr(capture_states, "_accelerate_available", lambda: False)
    rc, _, err = capture(capsys, "--model", write_llama(tmp_path / "m"), "--prompts", prompts,
                         "--out", tmp_path / "s.safetensors", "--device-map", "cpu")
    assert_exit_2(rc, err, "--device-map needs accelerate (pip install accelerate)")


def test_device_map_runs_where_accelerate_is_installed(tmp_path, prompts, capsys):
    import importlib.util

    out = tmp_path / "s.safetensors"
    rc, stdout, err = capture(capsys, "--model", write_llama(tmp_path / "m"), "--prompts", prompts,
                              "--out", out, "--device-map", "cpu")
    if importlib.util.find_spec("accelerate") is None:
        assert_exit_2(rc, err, "pip install accelerate")
    else:
        assert rc == 0, err
        assert "2 prompts, 8 tokens" in stdout and out.exists()


def test_device_and_device_map_together(tmp_path, prompts, capsys):
    rc, _, err = capture(capsys, "--model", tmp_path, "--prompts", prompts, "--out", tmp_path / "s.safetensors",
                         "--device", "cpu", "--device-map", "auto")
    assert_exit_2(rc, err, "use either --device or --device-map")


def test_out_is_a_directory(tmp_path, prompts, capsys):
    rc, _, err = capture(capsys, "--model", tmp_path, "--prompts", prompts, "--out", tmp_path)
    assert_exit_2(rc, err, f"--out {tmp_path} is a directory")


@needs_sglang
def test_a_draft_served_with_the_targets_lm_head_is_refused_by_sglangs_runner(pair, tmp_path, capsys):
    """No draft_vocab_size (and not tied): SGLang's head loads the target's lm_head (load_lm_head_from_target),
    which a STATES file does not hold. Said before anything is scored."""
    t, d = pair
    cfg = json.loads((d / "config.json").read_text())
    cfg.pop("draft_vocab_size")
    (d / "config.json").write_text(json.dumps(cfg))
    rc, err = doctor(capsys, "--draft", d, "--target", t, "--replay", write_states(tmp_path / "s.safetensors"),
                     *SGLANG_CODE)
    assert_exit_2(rc, err, "SGLang serves this draft with the target's lm_head",
                  "LlamaForCausalLMEagle3.load_lm_head_from_target")
