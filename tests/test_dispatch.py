"""Backend choice, forcing, and verified dispatch (a backend that disagrees with the reference is
disabled with an error log and the next one serves)."""
import logging

import pytest
import torch

import eagle3_ops
from eagle3_ops import dispatch, reference

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _fresh_verification():
    """These tests plant broken backends: forget every verification result before and after."""
    dispatch.reset_verification()
    yield
    dispatch.reset_verification()


def test_cpu_uses_reference_by_default():
    assert eagle3_ops.backends("cpu") == {"capture": "reference", "fused_add_rmsnorm_capture": "reference",
                                          "draft_fc": "reference"}


def test_forced_reference_is_reported(monkeypatch):
    monkeypatch.setenv("EAGLE3_OPS_BACKEND", "reference")
    assert set(eagle3_ops.backends("cpu").values()) == {"reference"}


def _broken_capture(hidden, residual, buffer, slot):
    reference.capture_ref(hidden, residual, buffer, slot)
    H = hidden.shape[1]
    buffer[0, slot * H] += 1.0  # one wrong element


def test_verification_rejects_a_wrong_kernel_and_logs_loudly(caplog):
    with caplog.at_level(logging.ERROR, logger="eagle3_ops"):
        assert not dispatch._passes_verification("capture", "triton", CPU, _broken_capture)
    assert "FAILED verification" in caplog.text and "capture" in caplog.text and "cpu" in caplog.text
    # the result is remembered for the process: no second check, still disabled
    assert not dispatch._passes_verification("capture", "triton", CPU, reference.capture_ref)


def test_verification_rejects_a_kernel_that_writes_outside_its_slot():
    def spills(hidden, residual, buffer, slot):
        reference.capture_ref(hidden, residual, buffer, slot)
        buffer[hidden.shape[0], 0] = 0.0  # canary row after T
    assert not dispatch._passes_verification("capture", "triton", CPU, spills)


def test_verification_rejects_a_crashing_kernel():
    def crashes(*args):
        raise RuntimeError("no kernel image is available for execution on the device")
    assert not dispatch._passes_verification("draft_fc", "cuda", CPU, crashes)


@pytest.mark.parametrize("op,fn", [("capture", reference.capture_ref),
                                   ("fused_add_rmsnorm_capture", reference.fused_add_rmsnorm_capture_ref),
                                   ("draft_fc", reference.draft_fc_out_ref)])
def test_verification_accepts_a_correct_kernel(op, fn):
    assert dispatch._passes_verification(op, "triton", CPU, fn)


def test_failed_backend_falls_back_to_next(monkeypatch, caplog):
    """select() skips a backend that fails verification and serves with the next one."""
    monkeypatch.setattr(dispatch, "candidate_backends", lambda device: dispatch.BACKENDS)
    real = dispatch.implementation

    def fake_impl(backend, op, device):
        if backend == "cuda":
            return _broken_capture if op == "capture" else None
        if backend == "triton":
            return None
        return real(backend, op, device)

    monkeypatch.setattr(dispatch, "implementation", fake_impl)
    with caplog.at_level(logging.ERROR, logger="eagle3_ops"):
        backend, fn = dispatch.select("capture", CPU)
    assert backend == "reference" and fn is reference.capture_ref
    assert "FAILED verification" in caplog.text
    buf = torch.zeros(2, 8)
    eagle3_ops.capture(torch.ones(2, 4), None, buf, 1)  # and the op itself still computes right
    assert torch.equal(buf[:, 4:], torch.ones(2, 4)) and torch.equal(buf[:, :4], torch.zeros(2, 4))


def test_forced_backend_failing_verification_raises(monkeypatch):
    monkeypatch.setenv("EAGLE3_OPS_BACKEND", "triton")
    monkeypatch.setattr(dispatch, "implementation", lambda b, op, d: _broken_capture)
    with pytest.raises(RuntimeError, match="failed verification"):
        dispatch.select("capture", CPU)


def test_verification_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("EAGLE3_OPS_VERIFY", "0")
    assert dispatch._passes_verification("capture", "triton", CPU, _broken_capture)


def test_verification_is_per_dtype(monkeypatch):
    """A kernel that is wrong only for fp16 passes in bf16 and is caught at its first fp16 use."""
    def wrong_in_fp16(hidden, residual, buffer, slot):
        reference.capture_ref(hidden, residual, buffer, slot)
        if hidden.dtype == torch.float16:
            buffer[0, slot * hidden.shape[1]] += 1.0
    assert dispatch._passes_verification("capture", "triton", CPU, wrong_in_fp16, torch.bfloat16)
    assert dispatch._passes_verification("capture", "triton", CPU, wrong_in_fp16, torch.float32)
    assert not dispatch._passes_verification("capture", "triton", CPU, wrong_in_fp16, torch.float16)


def test_backend_first_used_in_graph_capture_that_later_fails_raises(monkeypatch):
    """Graphs captured with an unverified backend keep replaying it: if the first eager check then
    fails, switching eager calls to another backend would differ silently, so it raises."""
    import eagle3_ops.verify as verify

    gpu = torch.device("cuda", 0)  # never touched: capture state and the check are stubbed
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "stub GPU")
    assert dispatch._passes_verification("capture", "cuda", gpu, _broken_capture)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(verify, "verify_backend", lambda op, fn, device, dtype: (False, "max rel err 1"))
    with pytest.raises(dispatch.BackendUnavailableError, match="after CUDA graphs were captured"):
        dispatch._passes_verification("capture", "cuda", gpu, _broken_capture)
