"""Fixtures of the op tests. Each op test is parametrised over ``target`` (an
``eagle3_ops.testing.Target``: a backend and a device, see ``testing.params``); the ``device``
fixture forces that backend (EAGLE3_OPS_BACKEND) for the test and returns the torch.device to put
the data on. GPU targets carry the ``gpu`` mark (tests/conftest.py skips them without CUDA)."""
import pytest

import op_testing as testing


@pytest.fixture
def device(target, monkeypatch):
    reason = testing.unusable_reason(target)
    if reason is not None:
        pytest.skip(reason)
    monkeypatch.setenv("EAGLE3_OPS_BACKEND", target.backend)
    return target.torch_device()
