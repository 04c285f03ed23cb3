"""Wiring doctor CLI: ``python -m eagle3_ops doctor`` exit statuses (0 clean, 1 error findings, 2 bad usage or
unreadable input, with one clear line and no traceback), the JSON shape, and the human report."""
from __future__ import annotations

import json

import pytest

from doctor_fixtures import eagle3_ops, run_doctor, tiny_pair, tiny_states, write_draft, write_target  # noqa: F401
from eagle3_ops.doctor import cli


@pytest.fixture
def pair(tmp_path):
    t = write_target(tmp_path / "target", num_layers=32)
    return t, write_draft(tmp_path / "good", ids=[1, 15, 28]), write_draft(tmp_path / "bad", ids=[1, 15, 31])


def test_exit_0_when_clean_1_on_errors(pair):
    t, good, bad = pair
    r = eagle3_ops("doctor", "--draft", good, "--target", t)
    assert r.returncode == 0, r.stderr
    assert "Result: 0 error(s)" in r.stdout
    r = eagle3_ops("doctor", "--draft", bad, "--target", t, "--json")
    assert r.returncode == 1, r.stderr
    rep = json.loads(r.stdout)
    assert rep["ok"] is False
    assert set(rep) >= {"slots", "findings", "ok"}
    assert all(set(f) == {"severity", "code", "message", "fix"} for f in rep["findings"])
    assert any(f["severity"] == "error" and f["code"] == "E_LAST_LAYER_NOT_CAPTURED" for f in rep["findings"])


def _assert_usage_error(r, *needles):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout
    assert r.stderr.strip(), "no message"
    for n in needles:
        assert n in r.stderr, r.stderr


def test_exit_2_on_bad_inputs_subprocess(pair, tmp_path):
    t, good, _ = pair
    _assert_usage_error(eagle3_ops("doctor", "--draft", tmp_path / "missing", "--target", t), "does not exist")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2,]}}')
    _assert_usage_error(eagle3_ops("doctor", "--draft", broken, "--target", t), "not valid JSON", "line 1")
    no_fc = write_draft(tmp_path / "nofc", ids=[1, 15, 28], drop=("fc.weight",))
    _assert_usage_error(eagle3_ops("doctor", "--draft", no_fc, "--target", t), "no fc weight")
    rc, rep, err = run_doctor("--draft", good, "--target", t, "--tp", "0")
    assert rc == 2 and "--tp must be >= 1" in err
    rc, rep, err = run_doctor("--draft", good)
    assert rc == 2 and "--target" in err and "Traceback" not in err


@pytest.mark.parametrize("case", ["no_weights", "corrupt_safetensors", "ids_not_ints", "target_no_layers",
                                  "pp_too_large", "bad_partition", "bad_engine", "config_is_list", "no_config"])
def test_exit_2_on_bad_inputs(pair, tmp_path, case):
    t, good, _ = pair
    args = ["--draft", good, "--target", t]
    if case == "no_weights":  # the configs alone are checked (W_NO_WEIGHTS); a replay needs the weights
        (good / "model.safetensors").unlink()
        args += ["--replay", tmp_path / "states.safetensors"]
        needle = "holds no weights"
    elif case == "corrupt_safetensors":
        (good / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header")
        needle = "cannot read safetensors header"
    elif case == "ids_not_ints":
        cfg = json.loads((good / "config.json").read_text())
        cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = "1,15,28"
        (good / "config.json").write_text(json.dumps(cfg))
        needle = "must be a list of integers"
    elif case == "target_no_layers":  # a model type no library knows: the doctor's own parsing needs the field
        (t / "config.json").write_text(json.dumps({"model_type": "mamba_x", "hidden_size": 16}))
        needle = "no 'num_hidden_layers'"
    elif case == "pp_too_large":
        args += ["--pp", "33"]
        needle = "exceeds the target's 32 layers"
    elif case == "bad_partition":
        args += ["--pp", "2", "--pp-partition", "10,10"]
        needle = "summing to 32"
    elif case == "bad_engine":
        args += ["--engine", "tgi"]
        needle = "invalid choice"
    elif case == "config_is_list":
        (good / "config.json").write_text("[1, 2]")
        needle = "must hold a JSON object"
    else:
        (good / "config.json").unlink()
        needle = "no config.json"
    rc, rep, err = run_doctor(*args)
    assert rc == 2 and rep is None
    assert needle in err and "Traceback" not in err


def test_help_exits_0(capsys):
    assert cli.main(["--help"]) == 0
    assert "--replay" in capsys.readouterr().out
    assert cli.capture_states_main(["--help"]) == 0


def test_human_report_readable_without_knowing_the_offset(tiny_pair, tiny_states):  # noqa: F811
    r = eagle3_ops("doctor", "--draft", tiny_pair.draft_dir, "--target", tiny_pair.target_dir, "--replay", tiny_states)
    assert r.returncode == 0, r.stdout + r.stderr
    out = " ".join(r.stdout.split())  # the report wraps long lines
    for text in ("How to read the table", "residual stream entering layer 3 = output of layer 2",
                 "SGLang rule: boundary = id + 1", "what the draft was trained on", "Replay:", "Findings:",
                 "I_REPLAY_CONFIGURED_BEST", "Result: 0 error(s)"):
        assert text in out, text


def test_capture_states_cli(tiny_pair, tmp_path):  # noqa: F811
    out = tmp_path / "s.safetensors"
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps([[5, 6, 7, 8, 9], [10, 11, 12]]))
    r = eagle3_ops("capture-states", "--model", tiny_pair.target_dir, "--prompts", prompts, "--out", out)
    assert r.returncode == 0, r.stderr
    assert "2 prompts, 8 tokens, 9 boundaries x hidden 64" in r.stdout and out.exists()
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([[1, 2], "text", [3, "x"]]))
    rc = cli.capture_states_main(["--model", str(tiny_pair.target_dir), "--prompts", str(bad), "--out",
                                  str(tmp_path / "x.safetensors")])
    assert rc == 2
    big = tmp_path / "big.json"
    big.write_text(json.dumps([[1, 2, 999]]))
    assert cli.capture_states_main(["--model", str(tiny_pair.target_dir), "--prompts", str(big), "--out",
                                    str(tmp_path / "y.safetensors")]) == 2


def test_the_tiny_pair_builder_answers_help_and_makes_nothing(tmp_path):
    """``python -m eagle3_ops.doctor.tiny --help`` printed nothing useful and made a folder named ``--help``."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "eagle3_ops.doctor.tiny", "--help"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.startswith("usage: python -m eagle3_ops.doctor.tiny"), proc
    assert list(tmp_path.iterdir()) == [], list(tmp_path.iterdir())


def _readme_block(after: str) -> list:
    """The lines of README.md's code block that starts with ``after``."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    start = text.index("```\n" + after) + 4
    return text[start:text.index("```", start)].rstrip("\n").split("\n")


def _masked(line: str) -> str:
    import re

    return re.sub(r"\b\d+(\.\d+)? s\b", "N s", line)  # the search's wall time varies


def test_the_readmes_miswired_example_is_one_command_and_its_output(tiny_pair, tmp_path, monkeypatch,  # noqa: F811
                                                                   capsys):
    """``python -m eagle3_ops.doctor.tiny tiny --miswired-example`` builds (here: reuses) the tiny pair, edits the ids,
    records states, runs the doctor twice; README.md shows its real output: every line of the README's block, the
    elisions (``...``) aside, is a line of the run, in order (wall times masked)."""
    import shutil

    from eagle3_ops.doctor import tiny

    shutil.copytree(tiny_pair.root, tmp_path / "tiny", ignore=shutil.ignore_patterns("states*.safetensors"))
    monkeypatch.chdir(tmp_path)
    assert tiny.main(["tiny", "--miswired-example"]) == 0
    run = [_masked(x) for x in capsys.readouterr().out.rstrip("\n").split("\n")]
    block = _readme_block("$ python -m eagle3_ops.doctor.tiny tiny --miswired-example")
    assert block[0] == "$ python -m eagle3_ops.doctor.tiny tiny --miswired-example"
    at = 0
    for line in block[1:]:
        if line == "...":
            continue
        assert _masked(line) in run[at:], f"README line not in the run (after line {at}): {line!r}\n" + "\n".join(run)
        at = run.index(_masked(line), at) + 1
    assert (tmp_path / "tiny" / "draft_edited" / "config.json").exists()


def test_a_clean_config_check_says_what_it_checked_and_the_verification_runs_as_printed(tiny_pair, tmp_path,  # noqa: F811
                                                                                      monkeypatch, capsys):
    """With no error the doctor says what it checked (the configs agree with each other), never that the wiring is
    right, and prints the two commands that verify it; pasted as printed (capture-states' built-in prompts through
    the target's tokenizer), they find the edit."""
    import shlex

    from doctor_fixtures import copy_draft_with_ids

    edited = copy_draft_with_ids(tiny_pair, tmp_path / "draft_edited", nested=[1, 3, 5])
    monkeypatch.chdir(tmp_path)
    assert cli.main(["--draft", str(edited), "--target", str(tiny_pair.target_dir)]) == 0
    out = capsys.readouterr().out
    assert "looks right" not in out and "the configs agree with each other" in out, out
    commands = [x.strip() for x in out.split("Result:", 1)[1].split("\n") if x.startswith("  python -m eagle3_ops")]
    assert [c.split()[3] for c in commands] == ["capture-states", "doctor"], out
    record, replay = (shlex.split(c)[3:] for c in commands)
    assert "--prompts" not in record
    assert cli.capture_states_main(record[1:]) == 0
    assert cli.main(replay[1:] + ["--json"]) == 1
    rep = json.loads(capsys.readouterr().out.split("\n", 1)[1])
    assert rep["replay"]["verdict"]["ids"] == [2, 4, 6] and rep["replay"]["tokens"] > 1000, rep["replay"]["verdict"]


def test_capture_states_without_a_tokenizer_says_so_before_loading_the_model(tiny_pair, tmp_path, monkeypatch,  # noqa: F811
                                                                            capsys):
    """The built-in prompts are text: a target folder without tokenizer files is one line naming --prompts with
    token ids, before the model is loaded (the model's load is never reached)."""
    import shutil

    from eagle3_ops.doctor import capture_states

    target = tmp_path / "target"
    shutil.copytree(tiny_pair.target_dir, target, ignore=shutil.ignore_patterns("tokenizer*", "special_tokens*"))
    monkeypatch.setattr(capture_states, "_load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    rc = cli.capture_states_main(["--model", str(target), "--out", str(tmp_path / "s.safetensors")])
    err = capsys.readouterr().err
    assert rc == 2 and "built-in" in err and "--prompts FILE holding token-id lists" in err, err
    assert len(err.strip().splitlines()) == 1, err
