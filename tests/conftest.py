import atexit
import os
import shutil
import tempfile

import pytest
import torch

# Without a GPU, Triton kernels run under the Triton interpreter on CPU tensors. The flag is read
# when a kernel is decorated, so it must be set before any eagle3_ops.triton module is imported.
# Set, not defaulted: an inherited TRITON_INTERPRET=0 would silently skip the Triton CPU tests.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

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
