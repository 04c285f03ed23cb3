"""tests/spawn.py runs ``python -m MODULE`` commands forked from a server that imported torch once: each
must look, from inside, like a fresh process and end like one (status, traceback, the interpreter's last
flush), and a command whose environment the preloaded modules would have read differently must run as
a real process."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import machine
import spawn

TESTS = Path(__file__).resolve().parent


def real(args, module="spawn_probe", env=None, **kw):
    env = spawn.base_env() if env is None else env
    return subprocess.run([sys.executable, "-m", module, *args], text=True, env=env,
                          timeout=machine.timeout(120), **kw)


def forked(args, module="spawn_probe", **kw):
    before = spawn.counts["forked"]
    r = spawn.run(args, module=module, timeout=machine.timeout(120), **kw)
    assert spawn.counts["forked"] == before + 1, f"ran as a real process, not forked: {spawn.last_difference}"
    return r


def test_a_forked_command_sees_what_a_fresh_process_sees(tmp_path):
    (tmp_path / "in.txt").write_text("from stdin\n")
    env = dict(spawn.base_env(), EAGLE3_OPS_PROBE="set by the test")  # read after start: forks
    runs = []
    for how in (real, forked):
        with open(tmp_path / "in.txt") as stdin:
            runs.append(how(["report", "3"], env=env, cwd=TESTS, stdin=stdin, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE))
    a, b = runs
    assert (a.returncode, a.stdout, a.stderr) == (b.returncode, b.stdout, b.stderr)
    seen = json.loads(b.stdout)
    assert b.returncode == 3 and b.stderr == "to stderr\n"
    assert seen == {"argv": ["spawn_probe.py", "report", "3"], "path0": str(TESTS), "cwd": str(TESTS),
                    "name": "__main__", "probe_var": "set by the test", "stdin": "from stdin\n",
                    "eagle3_ops_loaded": False}


def test_cache_folders_set_after_the_server_started_are_the_ones_used(tmp_path):
    """Importing SGLang in a test sets TRITON_CACHE_DIR and TORCHINDUCTOR_CACHE_DIR (its cache redirect):
    the server forks for them because triton and inductor read them when used, not when imported."""
    env = dict(spawn.base_env(), TRITON_CACHE_DIR=str(tmp_path / "t"), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "i"))
    r = forked(["caches"], env=env, cwd=TESTS)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"triton": str(tmp_path / "t"), "inductor": str(tmp_path / "i")}


def test_an_uncaught_exception_is_a_traceback_and_status_1():
    a = real(["raise"], cwd=TESTS, capture_output=True)
    b = forked(["raise"], cwd=TESTS)
    for r in (a, b):
        assert r.returncode == 1 and r.stderr.startswith("Traceback")
        assert r.stderr.splitlines()[-1] == "ValueError: the probe raised"


def test_output_into_a_closed_pipe_ends_as_the_interpreter_ends_it():
    """Block-buffered stdout (the default): status 120 and the interpreter's "Exception ignored" at its
    last flush; with PYTHONUNBUFFERED set (the server then has it too), the print raises at once."""
    results = []
    for how in (real, forked):
        r_fd, w_fd = os.pipe()
        os.close(r_fd)
        try:
            results.append(how(["unflushed"], cwd=TESTS, stdout=w_fd, stderr=subprocess.PIPE))
        finally:
            os.close(w_fd)
    a, b = results
    assert a.returncode == b.returncode == (1 if os.environ.get("PYTHONUNBUFFERED") else 120), (a, b)
    assert a.stderr.splitlines()[-1] == b.stderr.splitlines()[-1] == "BrokenPipeError: [Errno 32] Broken pipe"


def test_a_command_past_its_timeout_is_killed():
    with pytest.raises(subprocess.TimeoutExpired):
        spawn.run(["sleep", "600"], module="spawn_probe", cwd=TESTS, timeout=1)
    assert forked(["report", "0"], cwd=TESTS).returncode == 0  # the server goes on


def test_a_change_to_this_process_environment_starts_a_new_server(monkeypatch):
    """What a library imported into the test process sets (SGLang's kernels set CUTE_DSL_CACHE_DIR and
    others) is every later command's environment: the server follows it, commands still fork."""
    assert forked(["report", "0"], cwd=TESTS).returncode == 0
    first = spawn._server
    monkeypatch.setenv("EAGLE3_OPS_SPAWN_TEST", "lazy")  # read after start: the same server
    assert forked(["report", "0"], cwd=TESTS).returncode == 0 and spawn._server is first
    monkeypatch.setenv("SPAWN_TEST_READ_AT_IMPORT", "1")
    assert forked(["report", "0"], cwd=TESTS).returncode == 0
    second = spawn._server
    assert second is not first and second.env["SPAWN_TEST_READ_AT_IMPORT"] == "1"
    monkeypatch.undo()  # the environment comes back: so does its server, still running
    assert forked(["report", "0"], cwd=TESTS).returncode == 0
    assert spawn._server is first and first.proc.poll() is None


def test_an_environment_the_preloaded_modules_read_runs_a_real_process(tmp_path):
    env = dict(spawn.base_env(), HF_MODULES_CACHE=str(tmp_path))  # transformers reads it when imported
    before = dict(spawn.counts)
    r = spawn.run(["report", "0"], module="spawn_probe", env=env, cwd=TESTS, timeout=machine.timeout(120))
    assert r.returncode == 0 and json.loads(r.stdout)["cwd"] == str(TESTS)
    assert spawn.counts == dict(before, subprocess=before["subprocess"] + 1)


def test_eagle3_ops_info_forked_is_what_python_m_eagle3_ops_prints():
    """A bad variable: its one line on stderr, then the JSON on stdout, status 0, both ways."""
    env = dict(spawn.base_env(), EAGLE3_OPS_VERIFY="maybe")
    a = real(["info"], module="eagle3_ops", env=env, capture_output=True, cwd=spawn.ROOT)
    b = forked(["info"], module="eagle3_ops", env=env)
    assert a.returncode == b.returncode == 0, (a.stderr, b.stderr)
    assert a.stderr == b.stderr and "EAGLE3_OPS_VERIFY" in b.stderr
    assert json.loads(a.stdout) == json.loads(b.stdout)
