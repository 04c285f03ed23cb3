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

pytest.importorskip("sglang", reason="the SGLang integration tests need sglang==0.5.23 (installed in CI)")


@pytest.fixture(scope="session")
def sglang_cpu():
    import harness

    harness.init_distributed()
    assert harness.plugin_install(), "the eagle3_ops SGLang plugin did not activate"
    return harness


@pytest.fixture(autouse=True)
def _no_dynamo_in_sglang():
    """SGLang torch.compiles a few helpers (MoE top-k, vocab-parallel masking); on 2 CPU cores each
    new batch shape costs seconds of dynamo/inductor for nothing these tests look at. Scoped to
    each test here so other tests in the session keep torch.compile as they expect."""
    import torch._dynamo

    with torch._dynamo.config.patch(disable=True):
        yield


@pytest.fixture(autouse=True)
def _fresh_warn_once():
    """The plugin warns once per process per reason; each test starts with a clean slate."""
    from eagle3_ops.sglang import capture_hooks

    capture_hooks._warned.clear()
    yield
