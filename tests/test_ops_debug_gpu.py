"""Device-side row indices (GPU): out-of-range rows give NaN rows without a sync, and
EAGLE3_OPS_DEBUG=1 turns them into an IndexError. CPU twin: test_ops_reference.py
(test_draft_fc_reference_device_rows_out_of_range_give_nan_rows) and the host-row validation tests."""
import pytest
import torch

import eagle3_ops

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("backend", ["cuda", "triton", "reference"])
def test_device_rows_out_of_range_nan_rows_then_debug_error(backend, monkeypatch):
    from eagle3_ops import dispatch

    if dispatch.implementation(backend, "draft_fc", torch.device("cuda", torch.cuda.current_device())) is None:
        pytest.skip(f"{backend} cannot serve this GPU")
    monkeypatch.setenv("EAGLE3_OPS_BACKEND", backend)
    x = torch.randn(5, 3 * 64, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(32, 3 * 64, device="cuda", dtype=torch.bfloat16)
    rows = torch.tensor([0, 5, -1, 4], device="cuda")
    y = eagle3_ops.draft_fc(x, w, rows=rows)
    assert torch.isnan(y[1]).all() and torch.isnan(y[2]).all() and not torch.isnan(y[[0, 3]]).any()
    monkeypatch.setenv("EAGLE3_OPS_DEBUG", "1")
    with pytest.raises(IndexError, match=r"rows out of range at positions \[1, 2\]"):
        eagle3_ops.draft_fc(x, w, rows=rows)
