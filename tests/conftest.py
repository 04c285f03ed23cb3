import atexit
import os
import shutil
import sys
import tempfile

import pytest
import torch

# The source checkout's root: the maintainer tools (tools/: SASS reading, table and doc generators) are
# tested here but never shipped in the package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Without a GPU, Triton kernels run under the Triton interpreter on CPU tensors. The flag is read
# when a kernel is decorated, so it must be set before any eagle3_ops.triton module is imported.
# Set, not defaulted: an inherited TRITON_INTERPRET=0 would silently skip the Triton CPU tests.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

# The doctor keeps what the installed SGLang's code said (doctor/engine_cache.py) and reads it on later runs; the
# tests run SGLang's code every time, so each test sees the same path whatever ran before it
# (tests/doctor/test_engine_cache.py turns keeping on in a folder of its own).
os.environ["EAGLE3_OPS_DOCTOR_KEEP"] = "0"



def _fix_interpreter_index() -> str:
    """Triton's interpreter (before 3.7) turns a scalar into a Python int with ``int(handle.data)``, a 1-element
    1-D array, which numpy 2.4 refuses ("only 0-dimensional arrays can be converted to Python scalars",
    triton-lang/triton#9171): every interpreted kernel with a ``range()`` over run-time bounds fails. Triton 3.7
    fixed it upstream (``int(handle.data.squeeze())``); on the broken pair the tests apply that same change to
    the interpreter (a test tool, never the product's path on a GPU), and say so in the session header."""
    try:
        import inspect

        import numpy as np
        import triton
        from triton.runtime import interpreter
    except Exception:  # noqa: BLE001 - no Triton (or no interpreter): nothing to fix
        return ""
    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None or "int(self.handle.data)" not in inspect.getsource(patch):
        return ""  # a fixed interpreter (3.7+), or one this fix does not know
    try:
        int(np.zeros(1))
        return ""  # numpy < 2.4 converts the 1-element array: nothing breaks
    except TypeError:
        pass

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patched
    return (f"triton {triton.__version__} + numpy {np.__version__}: the interpreter's scalar __index__ is patched "
            f"as triton 3.7 fixed it upstream (triton-lang/triton#9171)")


INTERPRETER_FIX = _fix_interpreter_index() if os.environ.get("TRITON_INTERPRET") == "1" else ""


def pytest_report_header(config):
    return [INTERPRETER_FIX] if INTERPRETER_FIX else []


# Hermetic tests: SGLang's model constructors ask the Hugging Face hub for optional files (e.g.
# Qwen3.5's joint-head config). Without a network the hub client retries with backoff (~23 s
# per call, seen here); offline it answers "not there" at once, which is what those calls handle.
# Subprocess and forked workers inherit os.environ.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
# Remote code a test loads (--trust-remote-code) goes into a folder of this run, not the user's cache.
# Set here, before transformers is imported (it reads the variable then), so that the commands
# tests/spawn.py forks share it and a test needs no variable of its own (which would mean a real process).
_HF_MODULES = tempfile.mkdtemp(prefix="eagle3_ops-tests-hf-modules-")
atexit.register(shutil.rmtree, _HF_MODULES, ignore_errors=True)
os.environ["HF_MODULES_CACHE"] = _HF_MODULES

GPU_SKIP_REASON = "needs a CUDA device (runs in benchmarks/device_check.sh)"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason=GPU_SKIP_REASON)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _clean_backend_env(monkeypatch):
    """Every test starts with automatic backend choice. (Verification results are a per-process
    cache and stay: tests that plant broken backends reset them, see tests/ops/test_backend_internals.py.)"""
    monkeypatch.delenv("EAGLE3_OPS_BACKEND", raising=False)
    monkeypatch.delenv("EAGLE3_OPS_DEBUG", raising=False)


def pytest_sessionfinish(session, exitstatus):
    """In CI (CI set), any skip other than a `gpu` test without a GPU fails the run: a skipped
    test must never hide a failure (e.g. a broken sglang install turning integration tests into skips)."""
    if not os.environ.get("CI") or torch.cuda.is_available():
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter else []
    bad = [r for r in skipped if GPU_SKIP_REASON not in str(r.longrepr)]
    if bad:
        for r in bad[:20]:
            print(f"\nCI: not allowed to skip: {r.nodeid}: {r.longrepr}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
