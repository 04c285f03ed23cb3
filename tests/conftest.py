import os

import pytest
import torch

# Without a GPU, Triton kernels run under the Triton interpreter on CPU tensors. The flag is read
# when a kernel is decorated, so it must be set before any eagle3_ops.triton module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (runs in benchmarks/device_check.sh)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _clean_backend_env(monkeypatch):
    """Every test starts with automatic backend choice. (Verification results are a per-process
    cache and stay: tests that plant broken backends reset them, see test_dispatch.py.)"""
    monkeypatch.delenv("EAGLE3_OPS_BACKEND", raising=False)
    monkeypatch.delenv("EAGLE3_OPS_DEBUG", raising=False)
