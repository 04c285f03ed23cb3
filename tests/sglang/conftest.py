"""SGLang integration tests: SGLang 0.5.23's own model code on CPU (see harness.py).

One process-wide setup for this directory: gloo groups (world size 1) and the eagle3_ops hooks
registered and applied the way SGLang's ``load_plugins`` does. Models that SGLang never configures
through ``configure_aux_hidden_state_capture`` keep running stock (that is the plugin-off side of
every comparison); tests that need a pristine process (entry point, EAGLE3_OPS_SGLANG=0, TP=2) run
SGLang in subprocesses.
"""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


def _sglang_problem():
    """None if the SGLang these tests are written for imports, else what is wrong. SGLang is a test
    dependency (``make test`` installs it): a missing or broken one must fail these tests, never
    skip them (a skip would let CI pass without testing the plugin at all)."""
    try:
        import sglang  # noqa: F401
        import sglang.srt.plugins.hook_registry  # noqa: F401
    except Exception as e:  # ImportError, or anything a broken install raises on import
        return f"sglang does not import ({type(e).__name__}: {e})"
    from eagle3_ops.sglang.version import check_sglang_version

    ok, reason = check_sglang_version()
    return None if ok else reason


SGLANG_PROBLEM = _sglang_problem()


@pytest.fixture(scope="session", autouse=True)
def _sglang_required():  # session scope: checked before any other fixture of these tests runs
    if SGLANG_PROBLEM is not None:
        pytest.fail(f"the SGLang integration tests need sglang==0.5.23 (`make test` installs it): {SGLANG_PROBLEM}",
                    pytrace=False)


@pytest.fixture(scope="session")
def sglang_cpu():
    import harness

    harness.init_distributed()
    assert harness.plugin_install(), "the eagle3_ops SGLang plugin did not activate"
    return harness


@pytest.fixture(scope="module", autouse=True)
def _no_dynamo_in_sglang():
    """SGLang torch.compiles a few helpers (MoE top-k, vocab-parallel masking, gpt-oss's swiglu); on 2 CPU cores
    each new batch shape costs seconds of dynamo/inductor for nothing these tests look at. Module scope: the
    module-scoped fixtures that serve SGLang models run inside it too (autouse comes first in its scope). When
    one ran compiled (test_wiring_search's gpt-oss draft, at function scope here), inductor's swiglu rounds
    otherwise than eager and its compiled code stayed in use: SGLang's own gpt-oss forward then differed from
    itself between two runs in a later test (1e-8), failing a bitwise test. Other test folders in the session keep
    torch.compile as they expect."""
    import torch._dynamo

    with torch._dynamo.config.patch(disable=True):
        yield


@pytest.fixture(autouse=True)
def _fresh_warn_once():
    """The plugin warns once per process per reason; each test starts with a clean slate."""
    from eagle3_ops import settings
    from eagle3_ops.sglang import serving

    serving._warned.clear()
    settings._reported.clear()
    yield


@pytest.fixture
def wc(monkeypatch, tmp_path):
    """The live wiring check's module with its results kept in this test's folder, the switches it reads unset,
    and no check or recording left from another test."""
    from eagle3_ops.sglang import dump_states, serving, wiring_check

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    for var in ("EAGLE3_OPS_DUMP_STATES", "EAGLE3_OPS_WIRING_CHECK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(wiring_check, "_checks", [])
    monkeypatch.setattr(dump_states, "_recorders", [])  # recordings other tests left unfinished
    # the one-line-per-process messages as in a fresh server: another test file on this worker may have said one
    monkeypatch.setattr(serving, "_warned", set())
    return wiring_check


@pytest.fixture
def fused_norm_qualified(monkeypatch, tmp_path):
    """Qualification on (on the CPU too; the default, auto, qualifies on CUDA only) with timings under
    which every correct candidate beats SGLang's stock (stock closures, named ``run``, take 100 us; the
    candidates 10 us): the plugin then serves the fused add+RMSNorm at the norms whose residual SGLang
    captures, where it is bitwise stock's, and the fused draft fc. A private qualification cache; the
    capture buffer and the draft's largest M at 64 rows (qualification stays quick)."""
    from eagle3_ops import qualify
    from eagle3_ops.sglang import serving

    monkeypatch.setenv("EAGLE3_OPS_QUALIFY", "on")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("EAGLE3_OPS_SGLANG_MAX_TOKENS", "64")
    monkeypatch.setattr(serving, "default_max_tokens", lambda: 64)

    def timer(device, reps=10):
        def time(fn):
            fn()
            return 100.0 if fn.__name__ == "run" else 10.0
        return time

    monkeypatch.setattr(qualify, "Timer", timer)
