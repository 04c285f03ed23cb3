"""Bad inputs: each raises a ValueError that names the problem, and writes nothing."""
import pytest
import torch

import eagle3_ops
from eagle3_ops.validation import Eagle3ArgumentError
from helpers import same_bits

H, K, T = 64, 3, 5


def _capture_args(**over):
    gen = torch.Generator().manual_seed(0)
    args = dict(hidden=torch.randn(T, H, generator=gen), residual=torch.randn(T, H, generator=gen),
                buffer=torch.randn(T + 1, K * H, generator=gen), slot=1)
    args.update(over)
    return args


CAPTURE_BAD = {
    "dtype mismatch": (dict(residual=torch.randn(T, H).half()), "residual has dtype"),
    "buffer dtype mismatch": (dict(buffer=torch.randn(T, K * H).double()), "buffer has dtype"),
    "device mismatch": (dict(residual=torch.randn(T, H, device="meta")), "residual is on meta"),
    "H mismatch": (dict(residual=torch.randn(T, H + 1)), "residual has shape"),
    "slot -1": (dict(slot=-1), "slot -1 out of range"),
    "slot K": (dict(slot=K), f"slot {K} out of range"),
    "buffer rows < T": (dict(buffer=torch.randn(T - 1, K * H)), "buffer has 4 rows, expected at least T=5"),
    "buffer width not multiple of H": (dict(buffer=torch.randn(T, K * H + 1)), "not a positive multiple"),
    "non-contiguous last dim": (dict(hidden=torch.randn(H, T).t()), "contiguous last dim"),
    "buffer non-contiguous last dim": (dict(buffer=torch.randn(K * H, T).t()), "buffer must have a contiguous"),
    "unsupported dtype": (dict(hidden=torch.randn(T, H).double(), residual=None,
                               buffer=torch.randn(T, K * H).double()), "expected one of"),
    "hidden 3-D": (dict(hidden=torch.randn(1, T, H)), "hidden must be 2-D"),
}


@pytest.mark.parametrize("case", list(CAPTURE_BAD))
def test_capture_rejects_bad_input_before_writing(case):
    over, message = CAPTURE_BAD[case]
    args = _capture_args(**over)
    buf = args["buffer"]
    snapshot = buf.clone() if buf.device.type != "meta" else None
    with pytest.raises(ValueError, match=message) as info:
        eagle3_ops.capture(**args)
    assert isinstance(info.value, Eagle3ArgumentError)
    assert "eagle3::capture" in str(info.value)
    assert same_bits(buf, snapshot), "buffer changed although the call was rejected"


def _fused_args(**over):
    gen = torch.Generator().manual_seed(1)
    args = dict(input=torch.randn(T, H, generator=gen), residual=torch.randn(T, H, generator=gen),
                weight=torch.rand(H, generator=gen), eps=1e-6, buffer=torch.randn(T, K * H, generator=gen), slot=0)
    args.update(over)
    return args


FUSED_BAD = {
    "weight shape": (dict(weight=torch.rand(H + 1)), "weight has shape"),
    "weight dtype": (dict(weight=torch.rand(H).half()), "weight has dtype"),
    "residual shape": (dict(residual=torch.randn(T + 1, H)), "residual has shape"),
    "slot K": (dict(slot=K), "slot 3 out of range"),
    "eps <= 0": (dict(eps=0.0), "eps must be > 0"),
    "buffer rows": (dict(buffer=torch.randn(2, K * H)), "expected at least T=5"),
}


@pytest.mark.parametrize("case", list(FUSED_BAD))
def test_fused_add_rmsnorm_capture_rejects_bad_input_before_writing(case):
    over, message = FUSED_BAD[case]
    args = _fused_args(**over)
    snaps = {k: args[k].clone() for k in ("input", "residual", "buffer")}
    with pytest.raises(ValueError, match=message):
        eagle3_ops.fused_add_rmsnorm_capture(**args)
    for k, v in snaps.items():
        assert same_bits(args[k], v), f"{k} changed although the call was rejected"


R, N = 6, 32


def _fc_args(**over):
    gen = torch.Generator().manual_seed(2)
    args = dict(x=torch.randn(R, K * H, generator=gen), weight=torch.randn(N, K * H, generator=gen),
                bias=torch.randn(N, generator=gen), rows=torch.tensor([0, 5, 2]),
                chunk_norm_weight=torch.rand(K, H, generator=gen), input_norm_weight=torch.rand(K * H, generator=gen),
                eps=1e-6)
    args.update(over)
    return args


FC_BAD = {
    "weight shape mismatch": (dict(weight=torch.randn(N, K * H + 1)), "weight has shape"),
    "bias shape mismatch": (dict(bias=torch.randn(N + 1)), "bias has shape"),
    "rows out of range (host)": (dict(rows=torch.tensor([0, 6])), r"rows out of range: indices span \[0, 6\]"),
    "rows negative (host)": (dict(rows=torch.tensor([-1, 2])), "rows out of range"),
    "rows wrong dtype": (dict(rows=torch.tensor([0.0, 1.0])), "rows has dtype torch.float32"),
    "rows 2-D": (dict(rows=torch.tensor([[0, 1]])), "rows must be 1-D"),
    "chunk norm weight shape": (dict(chunk_norm_weight=torch.rand(K, H + 1)), "chunk_norm_weight has shape"),
    "input norm weight shape": (dict(input_norm_weight=torch.rand(K * H - 1)), "input_norm_weight has shape"),
    "x dtype mismatch": (dict(weight=torch.randn(N, K * H).half()), "weight has dtype"),
    "x non-contiguous": (dict(x=torch.randn(K * H, R).t()), "x must have a contiguous last dim"),
}


@pytest.mark.parametrize("case", list(FC_BAD))
def test_draft_fc_out_rejects_bad_input_before_writing(case):
    over, message = FC_BAD[case]
    args = _fc_args(**over)
    M = args["rows"].shape[0] if args["rows"].dim() == 1 else 2
    out = torch.full((M, N), 7.0)
    with pytest.raises(ValueError, match=message):
        eagle3_ops.draft_fc_out(**args, out=out)
    assert torch.equal(out, torch.full((M, N), 7.0)), "out changed although the call was rejected"
    with pytest.raises(ValueError, match=message):
        eagle3_ops.draft_fc(**args)


def test_draft_fc_out_rejects_wrong_out_shape():
    args = _fc_args()
    out = torch.full((4, N), 7.0)
    with pytest.raises(ValueError, match=r"out has shape \(4, 32\), expected \(3, 32\)"):
        eagle3_ops.draft_fc_out(**args, out=out)
    assert torch.equal(out, torch.full((4, N), 7.0))


def test_forced_backend_that_cannot_serve_raises(monkeypatch):
    monkeypatch.setenv("EAGLE3_OPS_BACKEND", "cuda")
    buf = torch.zeros(T, K * H)
    with pytest.raises(RuntimeError, match="EAGLE3_OPS_BACKEND=cuda cannot serve device cpu"):
        eagle3_ops.capture(torch.randn(T, H), None, buf, 0)
    assert torch.equal(buf, torch.zeros(T, K * H))


def test_unknown_backend_name_raises(monkeypatch):
    monkeypatch.setenv("EAGLE3_OPS_BACKEND", "cublas")
    with pytest.raises(ValueError, match="EAGLE3_OPS_BACKEND='cublas' is not valid: expected auto, cuda, triton or reference"):
        eagle3_ops.capture(torch.randn(T, H), None, torch.zeros(T, K * H), 0)


def test_draft_fc_rejects_norms_on_empty_width():
    with pytest.raises(ValueError, match="input_norm_weight given but x has width 0"):
        eagle3_ops.draft_fc(torch.randn(3, 0), torch.randn(4, 0), None, None, None, torch.randn(0), 1e-6)
    with pytest.raises(ValueError, match="chunk_norm_weight given but x has width 0"):
        eagle3_ops.draft_fc(torch.randn(3, 0), torch.randn(4, 0), None, None, torch.randn(0, 8), None, 1e-6)
