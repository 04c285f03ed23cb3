"""Every entry point of the repository answers ``--help`` with its usage and does nothing else: found, not listed
(each tracked Python file with a ``__main__`` block, each tracked executable script), run with ``--help`` in a
folder of its own that must stay empty. The Python ones run in this process (runpy, as ``python FILE`` /
``python -m MODULE`` would): a fresh interpreter per entry point would cost seconds of torch import each."""
from __future__ import annotations

import contextlib
import io
import os
import re
import runpy
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _tracked():
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:  # not a git checkout (an sdist): every file
        return sorted(str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if p.is_file() and ".venv" not in p.parts)
    return sorted(out.stdout.split())


def _python_entry_points():
    main = re.compile(r'^if __name__ == "__main__":', re.M)
    return [f for f in _tracked() if f.endswith(".py") and main.search((ROOT / f).read_text())]


def _scripts():
    return [f for f in _tracked() if not f.endswith(".py") and (ROOT / f).stat().st_mode & stat.S_IXUSR
            and (ROOT / f).read_bytes()[:2] == b"#!"]


def test_the_entry_points_are_found():
    py, sh = _python_entry_points(), _scripts()
    assert {"eagle3_ops/__main__.py", "eagle3_ops/doctor/tiny.py", "benchmarks/bench_host_path.py",
            "tools/engine_tables.py"} <= set(py), py
    assert {"benchmarks/device_check.sh", ".ci/run"} <= set(sh), sh


@pytest.mark.parametrize("path", _python_entry_points())
def test_python_entry_point_help(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [str(ROOT / path), "--help"])
    monkeypatch.setattr(sys, "path", [str(ROOT / Path(path).parent)] + sys.path)
    out, err = io.StringIO(), io.StringIO()
    code = None
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            if path.startswith("eagle3_ops/"):  # python -m eagle3_ops.X (its relative imports need the package)
                module = path[:-3].replace("/", ".").removesuffix(".__main__")
                runpy.run_module(module, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(str(ROOT / path), run_name="__main__")
        except SystemExit as e:
            code = e.code
    text = out.getvalue()
    assert code in (0, None), (code, text, err.getvalue())
    assert "usage:" in text.lower(), f"{path} --help printed no usage:\n{text}\n{err.getvalue()}"
    assert not os.listdir(tmp_path), f"{path} --help made {os.listdir(tmp_path)}"


@pytest.mark.parametrize("path", _scripts())
def test_script_help(path, tmp_path):
    r = subprocess.run([str(ROOT / path), "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip(), (r.returncode, r.stdout, r.stderr)
    assert not os.listdir(tmp_path), os.listdir(tmp_path)
