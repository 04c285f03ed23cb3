"""``python -m eagle3_ops`` as a Unix tool, over every command of its own table (__main__.COMMANDS)
and every EAGLE3_OPS_* variable (settings.SETTINGS), so a command or setting added later is
covered by construction: no traceback into a closed pipe (exit 141), unknown flags are argparse's
usage and exit 2, each bad or unknown variable is one line at start, resource failures are one line
and exit 3 (eagle3_ops/_cli.py)."""
from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import spawn
from doctor_fixtures import write_draft, write_target
from eagle3_ops import _cli, settings
from eagle3_ops.__main__ import COMMANDS, main

ROOT = Path(__file__).resolve().parents[1]


def _tiny_llama(path: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    import torch

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
                     ).save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def real_args(tmp_path_factory):
    """A minimal real invocation of every command (fast on a CPU). A new command must get one here."""
    d = tmp_path_factory.mktemp("cli")
    target = write_target(d / "target", num_layers=32)
    draft = write_draft(d / "draft", ids=[1, 15, 28])
    (d / "prompts.json").write_text("[[3, 4, 5, 6]]")
    return d, {
        "demo": [],
        "info": [],
        "qualify": ["--hidden", "16", "--captures", "3", "--rows", "2", "--reps", "1", "--no-cache"],
        "doctor": ["--draft", str(draft), "--target", str(target)],
        "capture-states": ["--model", str(_tiny_llama(d / "llama")), "--prompts", str(d / "prompts.json"),
                           "--out", str(d / "out" / "states.safetensors"), "--dtype", "float32"],
        "spec-report": [str(_spec_report_json(d / "spec_report.json"))],
    }


def _spec_report_json(path):
    """A speculation report as the SGLang plugin writes it (spec_report.SpecReport.to_json of a few counts)."""
    from eagle3_ops.sglang.spec_report import SpecReport

    rep = SpecReport(3)
    rep.acceptance.add([0, 1, 3, 2])
    path.write_text(json.dumps(rep.to_json()))
    return path


def bad_environment(tmp_path) -> dict:
    """One bad value for every runtime variable, from its kind, plus an unknown name."""
    from test_settings import bad_values

    env = {}
    for name, s in settings.SETTINGS.items():
        env[name] = "/dev/full" if s.kind == "output-file" else bad_values(s)[0]
    env["EAGLE3_OPS_NO_SUCH_VARIABLE"] = "1"
    return env


def drive(cases, tmp_path):
    """Run ``cases`` in one subprocess (tests/cli_driver.py); their results."""
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    env = spawn.base_env()
    env.pop("TRITON_INTERPRET", None)  # qualify's candidates: the reference only (the interpreter takes seconds)
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "cli_driver.py"), str(tmp_path / "cases.json"),
                        str(tmp_path / "results.json")], env=env, capture_output=True, text=True, timeout=900,
                       stdin=subprocess.DEVNULL, cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads((tmp_path / "results.json").read_text())


def test_every_command_is_a_unix_tool(real_args, tmp_path):
    d, args = real_args
    assert set(args) == set(COMMANDS), "give the new command a real invocation in real_args"
    bad_env = bad_environment(tmp_path)
    backend_ok = {k: v for k, v in bad_env.items() if k != "EAGLE3_OPS_BACKEND"}
    expected_lines = [f"eagle3_ops: {m}" for m in settings.problems(backend_ok)]
    assert len(expected_lines) == len(backend_ok)  # one message per variable (the unknown one included)
    cases, what = [], []
    for name, _cmd in COMMANDS.items():
        for label, case in (
                ("--help into a closed pipe", {"argv": [name, "--help"], "stdout": "closed"}),
                ("an unknown flag", {"argv": [name, *args[name], "--no-such-flag"], "stdout": "file"}),
                ("a real run, every variable bad, into a closed pipe",
                 {"argv": [name, *args[name]], "stdout": "closed", "env": backend_ok}),
                ("a bad EAGLE3_OPS_BACKEND", {"argv": [name, *args[name]], "stdout": "closed",
                                              "env": {"EAGLE3_OPS_BACKEND": "cublas"}})):
            cases.append(case)
            what.append((name, label))
    cases.append({"argv": ["info"], "stdout": "file", "env": backend_ok})
    what.append(("info", "every variable bad, into a file"))
    cases.append({"argv": ["no-such-command"], "stdout": "file"})
    what.append(("no-such-command", "an unknown command"))
    results = dict(zip(what, drive(cases, tmp_path)))

    for (name, label), r in results.items():
        assert "Traceback" not in r["stderr"], (name, label, r["stderr"])
        lines = [x for x in r["stderr"].splitlines() if x.strip()]
        if label == "--help into a closed pipe":  # argparse ignores errors writing its help: 0, quietly
            assert r["rc"] in (_cli.EXIT_OK, _cli.EXIT_CLOSED_PIPE) and not lines, (name, r)
        elif label == "an unknown flag":
            assert r["rc"] == _cli.EXIT_USAGE, (name, r)
            assert lines[0].startswith(f"usage: python -m eagle3_ops {name}"), (name, lines)
            assert "unrecognized arguments: --no-such-flag" in lines[-1], (name, lines)
        elif label.startswith("a real run") or label.startswith("every variable bad"):
            want = _cli.EXIT_CLOSED_PIPE if "closed pipe" in label else _cli.EXIT_OK
            assert r["rc"] == want, (name, label, r)
            for line in expected_lines:
                assert lines.count(line) == 1, (name, label, line, lines)
        elif label == "a bad EAGLE3_OPS_BACKEND":
            message = "EAGLE3_OPS_BACKEND='cublas' is not valid"
            if COMMANDS[name].needs_backend:
                assert r["rc"] == _cli.EXIT_USAGE and len(lines) == 1 and message in lines[0], (name, r)
            else:  # the doctor runs no op: the one line, then its work
                assert r["rc"] == _cli.EXIT_CLOSED_PIPE and sum(message in x for x in lines) == 1, (name, r)
        else:
            assert r["rc"] == _cli.EXIT_USAGE and "unknown command 'no-such-command'" in r["stderr"]
    assert json.loads(results[("info", "every variable bad, into a file")]["stdout"])["backends"]
    assert (d / "out" / "states.safetensors").is_file()  # capture-states wrote its file before the pipe closed


def test_a_closed_pipe_at_exit_is_quiet():
    """`python -m eagle3_ops info | head -c0`, for real: stdout block-buffered (PYTHONUNBUFFERED unset),
    the pipe meets the closed reader at the interpreter's last flush."""
    r_fd, w_fd = os.pipe()
    os.close(r_fd)
    env = spawn.base_env()
    env.pop("PYTHONUNBUFFERED", None)
    try:
        p = subprocess.run([sys.executable, "-m", "eagle3_ops", "info"], stdout=w_fd, stderr=subprocess.PIPE,
                           text=True, env=env, timeout=300, stdin=subprocess.DEVNULL)
    finally:
        os.close(w_fd)
    assert p.returncode == _cli.EXIT_CLOSED_PIPE and p.stderr == "", p.stderr


def test_usage_lists_every_command(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"  {name} " in out for name in COMMANDS) and "141 stdout closed" in out
    assert main([]) == 2 and "usage: python -m eagle3_ops COMMAND" in capsys.readouterr().err


# ---- resource failures: one line, exit 3 --------------------------------------------------------------------
def test_a_full_disk_in_capture_states_is_one_line_exit_3(real_args, monkeypatch, capsys):
    """The write fails part-way as safetensors reports it (SafetensorError '... (os error 28)', seen
    on a full tmpfs): one line, exit 3, no file and no temporary left."""
    import safetensors.torch
    from safetensors import SafetensorError

    d, args = real_args
    out = d / "full" / "states.safetensors"

    def full_disk(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"\0" * 100)
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    argv = [a if a != args["capture-states"][5] else str(out) for a in args["capture-states"]]
    capsys.readouterr()
    assert main(["capture-states", *argv]) == _cli.EXIT_RESOURCE
    err = capsys.readouterr().err.strip()
    assert err == f"error: could not write {out}: {os.strerror(errno.ENOSPC)}", err
    assert os.listdir(out.parent) == []


@pytest.mark.parametrize("error", ["host", "device"])
def test_out_of_memory_in_the_doctor_is_one_line_exit_3(real_args, monkeypatch, capsys, error):
    import torch

    from eagle3_ops.doctor import cli

    d, args = real_args

    def oom(*_a, **_k):
        if error == "host":
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:121] data. DefaultCPUAllocator: can't allocate memory: "
                               "you tried to allocate 68719476736 bytes. Error code 12 (Cannot allocate memory)")
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB")

    monkeypatch.setattr(cli, "build_report", oom)
    capsys.readouterr()
    assert main(["doctor", *args["doctor"]]) == _cli.EXIT_RESOURCE
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith("error: out of memory: [enforce fail" if error == "host" else
                          "error: out of device memory: CUDA out of memory"), err


def test_capture_states_refuses_an_unusable_out_before_loading_the_model(real_args, capsys, tmp_path):
    d, args = real_args
    for out, needle in (("/dev/full", "/dev/full is a character device, not a regular file"),
                        (str(tmp_path / "file" / "s.safetensors"), "is not a folder")):
        (tmp_path / "file").write_text("x")
        argv = [a if a != args["capture-states"][5] else out for a in args["capture-states"]]
        capsys.readouterr()
        assert main(["capture-states", *argv]) == _cli.EXIT_USAGE
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith(f"error: --out {out}: ") and needle in err, err
