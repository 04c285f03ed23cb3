"""Property tests over random shapes, strides and slots (hypothesis), on every backend available."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import eagle3_ops
from eagle3_ops import reference
from helpers import assert_only_region_written, backends_for, same_bits


@pytest.mark.parametrize("backend", backends_for("capture"))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(T=st.integers(0, 20), H=st.integers(1, 70), K=st.integers(1, 4), pad=st.integers(0, 9),
       extra_rows=st.integers(0, 3), data=st.data())
def test_capture_property(backend, T, H, K, pad, extra_rows, data, monkeypatch):
    monkeypatch.setenv("EAGLE3_OPS_BACKEND", backend)  # same value on every example: fixture reuse is fine
    slot = data.draw(st.integers(0, K - 1))
    dtype = data.draw(st.sampled_from([torch.bfloat16, torch.float16, torch.float32]))
    gen = torch.Generator().manual_seed(T * 7919 + H * 31 + K)
    hidden_base = torch.randn(T, H + pad, generator=gen).to(dtype)
    hidden = hidden_base[:, :H]  # row stride H + pad
    residual = torch.randn(T, H, generator=gen).to(dtype) if data.draw(st.booleans()) else None
    base = torch.randn(T + extra_rows, K * H + pad, generator=gen).to(dtype)
    buffer = base[:, :K * H]
    before = base.clone()
    eagle3_ops.capture(hidden, residual, buffer, slot)
    want = base.clone()
    reference.capture_ref(hidden, residual, want[:, :K * H], slot)
    assert same_bits(base, want)
    assert_only_region_written(before, base, slice(0, T), slice(slot * H, (slot + 1) * H))


@settings(max_examples=25, deadline=None)
@given(R=st.integers(1, 12), H=st.integers(1, 24), K=st.integers(1, 4), N=st.integers(1, 20), data=st.data())
def test_draft_fc_linearity_in_weight(R, H, K, N, data):
    """draft_fc(x, W1 + W2) == draft_fc(x, W1) + draft_fc(x, W2) (fp32, rows and norms included)."""
    gen = torch.Generator().manual_seed(R * 1000 + H * 10 + K + N)
    x = torch.randn(R, K * H, generator=gen, dtype=torch.float64).float()
    w1 = torch.randn(N, K * H, generator=gen)
    w2 = torch.randn(N, K * H, generator=gen)
    rows = torch.randint(0, R, (data.draw(st.integers(0, 2 * R)),), generator=gen)
    cn = torch.rand(K, H, generator=gen) + 0.5 if data.draw(st.booleans()) else None
    inw = torch.rand(K * H, generator=gen) + 0.5 if data.draw(st.booleans()) else None
    a = eagle3_ops.draft_fc(x, w1 + w2, None, rows, cn, inw, 1e-6)
    b = eagle3_ops.draft_fc(x, w1, None, rows, cn, inw, 1e-6) + eagle3_ops.draft_fc(x, w2, None, rows, cn, inw, 1e-6)
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
