"""The doctor keeps what the installed SGLang's code said (doctor/engine_cache.py): a config check of a pair seen
before reads the kept rule table and config readings instead of importing SGLang (its model registry alone is
~15 s of CPU on 2 cores), and says so; what it reports is what the live run reported. The kept files are named by
the installed SGLang's version and its sources' sizes and modification times, so an edited SGLang is derived again.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import machine
from doctor_fixtures import run_doctor
from machine import needs_sglang

REAL = Path(__file__).resolve().parent / "real"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def keeping(tmp_path, monkeypatch):
    from eagle3_ops.doctor import engine_cache

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("EAGLE3_OPS_DOCTOR_KEEP", "1")
    engine_cache._kept_table.cache_clear()
    yield tmp_path / "xdg" / "eagle3_ops" / "engine"
    engine_cache._kept_table.cache_clear()


def _pair(tmp_path, case="kimi-k25_specforge"):
    sys.path.insert(0, str(REAL))
    from test_real_configs import make_pair

    return make_pair(tmp_path / case, case)


def _same(a: dict, b: dict) -> None:
    for rep in (a, b):
        rep["engine"].pop("rules_from")
        rep.pop("conclusion", None)
        rep["findings"] = [f for f in rep["findings"] if f["code"] != "I_ENGINE_CODE"]
    assert a == b


@needs_sglang
@pytest.mark.parametrize("case", ["kimi-k25_specforge", "llama-3.1-8b_eagle-official-train",
                                  "qwen3.5-35b-a3b_specforge"])
def test_a_second_check_reads_what_sglang_said_and_reports_the_same(keeping, tmp_path, case):
    """The first run runs SGLang's code (and keeps its table and its readings of both configs); the second reads
    them: the same report, its source named (the kept file), SGLang's registry never imported."""
    draft, target = _pair(tmp_path, case)
    rc1, first, err = run_doctor("--draft", draft, "--target", target)
    assert first is not None, err
    assert first["engine"]["rules_from"].endswith("(its own code ran)")
    kept = sorted(p.name for p in keeping.iterdir())
    assert [n.rsplit(".", 2)[1] for n in kept] == ["configs", "table"], kept
    probe = (f"import json, sys; from eagle3_ops.doctor import cli; import io, contextlib; out = io.StringIO()\n"
             f"with contextlib.redirect_stdout(out): rc = cli.main(['--draft', {str(draft)!r}, '--target', "
             f"{str(target)!r}, '--json'])\n"
             f"print(json.dumps({{'rc': rc, 'report': json.loads(out.getvalue()), "
             f"'sglang': sorted(m for m in sys.modules if m.startswith('sglang.srt'))}}))")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env,
                       timeout=machine.timeout(300))
    assert r.returncode == 0, r.stderr
    second = json.loads(r.stdout.strip().splitlines()[-1])
    assert second["sglang"] == [], f"a kept check imported SGLang: {second['sglang'][:8]}"
    assert second["rc"] == rc1
    said = second["report"]["engine"]["rules_from"]
    assert "run by an earlier check and kept in" in said and "table.json" in said, said
    _same(first, second["report"])


def test_the_key_follows_the_installed_sglang(tmp_path, monkeypatch):
    """Another version, or a source file of SGLang changed (its size or modification time), is another key: what
    was kept for the old one is never read for the new one. No SGLang: no key, nothing kept."""
    import importlib.metadata

    from eagle3_ops.doctor import engine_cache

    pkg = tmp_path / "site" / "sglang"
    (pkg / "srt" / "models").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    model = pkg / "srt" / "models" / "llama.py"
    model.write_text("x = 1\n")
    spec = importlib.machinery.ModuleSpec("sglang", None, is_package=True)
    spec.submodule_search_locations = [str(pkg)]
    version = {"v": "0.5.23"}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: spec if name == "sglang" else None)
    monkeypatch.setattr(importlib.metadata, "version", lambda name: version["v"])

    def key():
        engine_cache.installed_key.cache_clear()
        return engine_cache.installed_key()

    try:
        k1 = key()
        assert k1.startswith("sglang-0.5.23-") and key() == k1
        os.utime(model, ns=(1, 1))
        k2 = key()
        assert k2 != k1
        model.write_text("x = 22\n")
        os.utime(model, ns=(1, 1))
        assert key() not in (k1, k2)
        version["v"] = "0.5.24"
        assert key().startswith("sglang-0.5.24-")

        def none(name):
            raise importlib.metadata.PackageNotFoundError(name)

        monkeypatch.setattr(importlib.metadata, "version", none)
        assert key() is None
    finally:
        engine_cache.installed_key.cache_clear()


def test_nothing_is_kept_or_read_when_keeping_is_off(tmp_path, monkeypatch):
    """EAGLE3_OPS_DOCTOR_KEEP=0 (the tests' own setting, conftest.py) and a bad value: SGLang's code every time."""
    from eagle3_ops.doctor import engine_cache

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    for value in ("0", "sometimes"):
        monkeypatch.setenv("EAGLE3_OPS_DOCTOR_KEEP", value)
        assert not engine_cache.enabled() and engine_cache.table() is None
        engine_cache.remember({"model_type": "llama"}, {"reader": "x"})
        assert engine_cache.parsed({"model_type": "llama"}) is None
    assert not (tmp_path / "xdg").exists()
