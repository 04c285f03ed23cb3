"""fused_add_rmsnorm_capture computes what SGLang's own RMSNorm computes.

The numerics we follow (SGLang 0.5.23 ``RMSNorm.forward_native(x, residual)``, which FlashInfer's
``fused_add_rmsnorm`` used by ``forward_cuda`` matches):
  s = float32(input) + float32(residual)
  residual <- s rounded to the residual's dtype      (and the capture slot gets exactly this value)
  input    <- round((s * rsqrt(mean(s * s) + eps)) * float32(weight))
The norm reads the *unrounded* fp32 sum s, not the residual after it was rounded to its dtype.

Checked on the CPU for every backend available here (reference; Triton under the interpreter)
against SGLang's module itself, for bf16, fp16 and fp32. The stored residual and the capture are
bitwise SGLang's residual. The normed output is bitwise SGLang's for the reference (same torch ops);
the Triton kernel sums squares in another order, so its output may differ by one unit in the last
place of the dtype (plus a few fp32 ulps for fp32 outputs).
"""
import pytest
import torch

import eagle3_ops
from helpers import DTYPES, backends_for, same_bits

layernorm = pytest.importorskip("sglang.srt.layers.layernorm", reason="SGLang is a test dependency (make deps)")

EPS = 1e-6


def sglang_rmsnorm(H, weight):
    """SGLang's RMSNorm with its weight in the model dtype, as a loaded checkpoint has it."""
    norm = layernorm.RMSNorm(H, eps=EPS, weight_dtype=weight.dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
    return norm


def run_ours(backend, x, r, w, K=3, slot=1):
    """Our op on copies; returns (normed output, new residual, captured slot)."""
    x, r = x.clone(), r.clone()
    T, H = x.shape
    buffer = torch.full((T, K * H), float("nan"), dtype=x.dtype)
    eagle3_ops.fused_add_rmsnorm_capture(x, r, w, EPS, buffer, slot)
    return x, r, buffer[:, slot * H:(slot + 1) * H]


def within_rounding(got, want):
    g, w = got.double(), want.double()
    tol = (torch.finfo(want.dtype).eps + 8 * 2.0 ** -23) * w.abs() + torch.finfo(want.dtype).tiny
    return bool(((g - w).abs() <= tol).all())


def problem(T, H, dtype, seed, residual_scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen, dtype=torch.float64).to(dtype)
    r = (torch.randn(T, H, generator=gen, dtype=torch.float64) * residual_scale).to(dtype)
    w = (torch.rand(H, generator=gen, dtype=torch.float64) + 0.5).to(dtype)
    return x, r, w


def _shapes(backend):
    # The interpreter is slow: small rows for Triton, a model-sized row for the reference.
    return [(3, 64), (5, 200), (2, 37)] if backend == "triton" else [(3, 64), (7, 4096), (2, 37)]


CASES = [pytest.param(b, T, H, id=f"{b}-T{T}-H{H}") for b in backends_for("fused_add_rmsnorm_capture")
         for T, H in _shapes(b)]


@pytest.fixture
def backend_env(monkeypatch):
    def use(name):
        monkeypatch.setenv("EAGLE3_OPS_BACKEND", name)
        monkeypatch.setenv("EAGLE3_OPS_VERIFY", "0")  # compared with SGLang directly below
    return use


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend,T,H", CASES)
def test_fused_op_equals_sglang_rmsnorm_forward_native(backend, T, H, dtype, backend_env):
    backend_env(backend)
    x, r, w = problem(T, H, dtype, seed=T * 1000 + H, residual_scale=4.0)
    want_out, want_res = sglang_rmsnorm(H, w).forward_native(x, r)
    out, res, captured = run_ours(backend, x, r, w)
    assert same_bits(res, want_res), "stored residual differs from SGLang's"
    assert same_bits(captured.contiguous(), want_res), "captured slot is not SGLang's residual"
    if backend == "reference":
        assert same_bits(out, want_out), "normed output differs from SGLang's"
    else:
        assert within_rounding(out, want_out), "normed output differs from SGLang's by more than one rounding"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("backend", backends_for("fused_add_rmsnorm_capture"))
def test_norm_reads_the_unrounded_sum_not_the_stored_residual(backend, dtype, backend_env):
    """The alternative reading (norm of the residual after rounding to the dtype) gives a different
    output on this data; SGLang and we both give the unrounded-sum answer."""
    backend_env(backend)
    T, H = 4, 64
    x, r, w = problem(T, H, dtype, seed=3, residual_scale=300.0)  # big residual: rounding the sum matters
    want_out, want_res = sglang_rmsnorm(H, w).forward_native(x, r)
    rounded = want_res.float()
    from_rounded = (rounded * torch.rsqrt(rounded.pow(2).mean(-1, keepdim=True) + EPS) * w.float()).to(dtype)
    assert not torch.equal(from_rounded, want_out), "test data does not tell the two readings apart"
    out, _, _ = run_ours(backend, x, r, w)
    exact = same_bits(out, want_out)
    assert exact if backend == "reference" else within_rounding(out, want_out)
    # and we are farther from the rounded-residual reading than from SGLang's
    assert (out.double() - want_out.double()).abs().sum() < (out.double() - from_rounded.double()).abs().sum()
