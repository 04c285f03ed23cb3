"""fused_add_rmsnorm_capture: SGLang's ``fused_add_rmsnorm`` plus a capture of the new residual.

Numerics (SGLang 0.5.23 ``RMSNorm.forward_native(x, residual)``, which FlashInfer's
``fused_add_rmsnorm`` used by ``forward_cuda`` matches):
  s = float32(input) + float32(residual)
  residual <- s rounded to the residual's dtype      (and the capture slot gets exactly this value)
  input    <- round((s * rsqrt(mean(s * s) + eps)) * float32(weight))
The norm reads the *unrounded* fp32 sum s, not the residual after it was rounded to its dtype.

Every numerics test runs on every target (``eagle3_ops.testing``: reference and interpreted Triton
on the CPU, CUDA/Triton/reference on a GPU with the ``gpu`` mark): the stored residual and the
buffer (slot and canaries) are bitwise the reference backend's, the residual is the float64 sum
rounded once, the normed output is within one rounding of the float64 truth (plus the fp32
summation-order slack), and nothing around any of the three written tensors changes. The SGLang
comparisons need SGLang (a test dependency; the GPU device check runs without it and skips them).
"""
import itertools

import pytest
import torch

import eagle3_ops
from eagle3_ops import reference
import op_testing as testing
from op_testing import (DTYPES, NORM_TOL, ROUNDING_TOL, TARGETS, TRITON_TARGETS, assert_close,
                                capture_problem, params, same_bits)

GPU_T = (1, 3, 64, 1000, 8192)
GPU_H = (2048, 4096, 5120, 7168, 8192, 7000)


def grid(target):
    """(T, H, K, slot) per target: full grid on the reference, small for the interpreter, model sizes on a GPU."""
    if target == testing.REFERENCE_CPU:
        return [(T, H, K, K - 1) for T, H, K in itertools.product((0, 1, 7, 64, 300), (64, 256, 4096), (1, 2, 3, 4))]
    if target == testing.TRITON_CPU:
        return [(T, H, K, K - 1) for T, H, K in [(0, 64, 1), (1, 64, 3), (7, 72, 2), (5, 40, 4), (64, 256, 3)]]
    if target.backend == "reference":
        return [(64, 4096, 3, 1), (3, 7000, 3, 1)]
    return [(T, H, 3, 1) for H in GPU_H for T in GPU_T]


def check_fused(p):
    """The op on p (canaried) vs the reference backend (bitwise residual and buffer) and float64."""
    dtype = p.hidden.dtype
    sum64, normed64 = p.sum64(), p.normed64()
    want = p.clone()
    want.run(reference.fused_add_rmsnorm_capture)
    p.run_canaried()
    assert same_bits(p.residual, want.residual), "stored residual != the fp32 sum rounded once (reference)"
    assert same_bits(p.buffer._base, want.buffer._base), "buffer differs from the reference (slot or a canary)"
    assert_close(p.residual, sum64, ROUNDING_TOL[dtype], what="stored residual")
    assert same_bits(p.slot_view.contiguous(), p.residual.contiguous()), "captured slot != stored residual"
    assert_close(p.hidden, normed64, NORM_TOL[dtype], what="normed output")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("target,T,H,K,slot", params(TARGETS, grid))
def test_fused_matches_fp64_and_writes_only_its_outputs(target, T, H, K, slot, dtype, device):
    check_fused(capture_problem(T, H, K, dtype, device, slot=slot, fused=True, residual_scale=3.0,
                                buffer_pad=16 if target.gpu else 5))


def layouts(target):
    """(T, H, input row pad, residual row pad, view offset): odd H, odd strides, unaligned views;
    on a GPU also rows wider than the registers hold (two-pass), and the T >= 256 launch shape."""
    if not target.gpu:
        return [(4, 37, 0, 0, 0), (3, 1001, 1, 3, 0), (5, 200, 2, 1, 1), (9, 64, 0, 0, 0)]  # 9 rows: 9 programs
    return [
        (3, 7001, 1, 2, 1),      # odd H, odd strides
        (1000, 4095, 3, 4, 0),   # H 4095, many rows
        (5, 16385, 0, 0, 0),     # scalar two-pass
        (3, 40000, 0, 0, 0),     # vector two-pass
        (300, 16384, 0, 0, 0),   # H 16384, many rows
        (3, 16384, 0, 0, 0),     # H 16384, few rows
        (256, 64, 0, 0, 0),      # tiny H, many rows
        (7, 4096, 0, 0, 1),      # unaligned views
    ]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("target,T,H,in_pad,res_pad,offset", params(TARGETS, layouts))
def test_fused_odd_sizes_strides_views_and_wide_rows(target, T, H, in_pad, res_pad, offset, dtype, device):
    K = 3 if target.gpu else 2
    check_fused(capture_problem(T, H, K, dtype, device, slot=1, fused=True, hidden_pad=in_pad, residual_pad=res_pad,
                                offset=offset, residual_scale=3.0, buffer_pad=16 if target.gpu else 3))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("target,H", params(TRITON_TARGETS, [200, 256]))
def test_triton_two_pass_path(target, H, dtype, device, monkeypatch):
    """Rows wider than MAX_ROW_BLOCK take the two-pass kernel (sum of squares, then re-read and
    write); a small limit sends small rows there, with a masked last chunk for H=200."""
    from eagle3_ops.triton import capture as triton_capture

    monkeypatch.setattr(triton_capture, "MAX_ROW_BLOCK", 64)

    class _MustNotLaunch:
        def __getitem__(self, grid):
            raise AssertionError("the one-pass row kernel was launched for a row wider than MAX_ROW_BLOCK")

    monkeypatch.setattr(triton_capture, "_fused_row_kernel", _MustNotLaunch())
    check_fused(capture_problem(4, H, 2, dtype, device, slot=1, fused=True, hidden_pad=1, residual_pad=2,
                                buffer_pad=3))


# ---- the numerics SGLang defines ---------------------------------------------------------------------
def sglang_rmsnorm(H, weight):
    """SGLang's RMSNorm (weight in the model dtype, as a loaded checkpoint has it), or a skip when
    SGLang is not installed (CI installs it; the GPU device check does not)."""
    layernorm = pytest.importorskip("sglang.srt.layers.layernorm", reason="SGLang is a test dependency (make deps)")
    norm = layernorm.RMSNorm(H, eps=testing.EPS, weight_dtype=weight.dtype)
    with torch.no_grad():
        norm.weight.copy_(weight.cpu())
    return norm.to(weight.device)


def run_ours(x, r, w, K=3, slot=1):
    """The op on copies; returns (normed output, new residual, captured slot)."""
    x, r = x.clone(), r.clone()
    T, H = x.shape
    buffer = torch.full((T, K * H), float("nan"), dtype=x.dtype, device=x.device)
    eagle3_ops.fused_add_rmsnorm_capture(x, r, w, testing.EPS, buffer, slot)
    return x, r, buffer[:, slot * H:(slot + 1) * H]


def problem(T, H, dtype, device, key, residual_scale=1.0):
    gen = testing.generator(device, "sglang", T, H, str(dtype), *key)
    return (testing.randn((T, H), dtype, device, gen), testing.randn((T, H), dtype, device, gen, residual_scale),
            testing.positive((H,), dtype, device, gen))


def sglang_shapes(target):
    # The interpreter is slow: small rows for Triton, a model-sized row for the reference.
    if target.gpu:
        return [(3, 64), (64, 7168), (2, 37)]
    return [(3, 64), (5, 200), (2, 37)] if target.backend == "triton" else [(3, 64), (7, 4096), (2, 37)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("target,T,H", params(TARGETS, sglang_shapes))
def test_equals_sglang_rmsnorm_forward_native(target, T, H, dtype, device):
    """The stored residual and the capture are bitwise SGLang's residual; the normed output is
    bitwise SGLang's on the reference (same torch ops), within one rounding elsewhere (the kernels
    sum squares in another order)."""
    x, r, w = problem(T, H, dtype, device, (), residual_scale=4.0)
    want_out, want_res = sglang_rmsnorm(H, w).forward_native(x, r)
    out, res, captured = run_ours(x, r, w)
    assert same_bits(res, want_res), "stored residual differs from SGLang's"
    assert same_bits(captured.contiguous(), want_res), "captured slot is not SGLang's residual"
    if target.backend == "reference":
        assert same_bits(out, want_out), "normed output differs from SGLang's"
    else:
        assert_close(out, want_out.double(), NORM_TOL[dtype], what="normed output vs SGLang's")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("target", params(TARGETS))
def test_norm_reads_the_unrounded_sum_not_the_stored_residual(target, dtype, device):
    """The alternative reading (norm of the residual after rounding to the dtype) gives a different
    output on this data; SGLang and we both give the unrounded-sum answer."""
    T, H = 4, 64
    x, r, w = problem(T, H, dtype, device, ("unrounded",), residual_scale=300.0)  # rounding the sum matters
    want_out, want_res = sglang_rmsnorm(H, w).forward_native(x, r)
    rounded = want_res.float()
    from_rounded = (rounded * torch.rsqrt(rounded.pow(2).mean(-1, keepdim=True) + testing.EPS) * w.float()).to(dtype)
    assert not torch.equal(from_rounded, want_out), "test data does not tell the two readings apart"
    out, _, _ = run_ours(x, r, w)
    if target.backend == "reference":
        assert same_bits(out, want_out)
    else:
        assert_close(out, want_out.double(), NORM_TOL[dtype], what="normed output vs SGLang's")
    # and we are farther from the rounded-residual reading than from SGLang's
    assert (out.double() - want_out.double()).abs().sum() < (out.double() - from_rounded.double()).abs().sum()


@pytest.mark.parametrize("target", params(TARGETS))
def test_norm_reads_the_fp32_sum(target, device):
    """The documented numerics without SGLang: the norm uses the fp32 sum, not the bf16-rounded
    residual (bitwise the fp32 formula on the reference, within one rounding elsewhere)."""
    gen = testing.generator(device, "fp32-sum")
    T, H = 4, 256
    x = testing.randn((T, H), torch.bfloat16, device, gen)
    r = testing.randn((T, H), torch.bfloat16, device, gen, scale=300.0)
    w = torch.ones(H, dtype=torch.bfloat16, device=device)
    buf = torch.empty(T, H, dtype=torch.bfloat16, device=device)
    xo, ro = x.clone(), r.clone()
    eagle3_ops.fused_add_rmsnorm_capture(xo, ro, w, testing.EPS, buf, 0)
    s = x.float() + r.float()
    expect = (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + testing.EPS) * w.float()).to(torch.bfloat16)
    if target.backend == "reference":
        assert torch.equal(xo, expect)
    else:
        assert_close(xo, expect.double(), NORM_TOL[torch.bfloat16], what="normed output vs the fp32 formula")


# ---- opcheck -----------------------------------------------------------------------------------------
def fused_samples(device):
    gen = torch.Generator().manual_seed(1)
    for T, H, K, dtype in ((1, 64, 1, torch.float32), (9, 128, 3, torch.bfloat16)):
        yield (torch.randn(T, H, generator=gen).to(device, dtype), torch.randn(T, H, generator=gen).to(device, dtype),
               torch.rand(H, generator=gen).to(device, dtype), 1e-6,
               torch.randn(T, K * H, generator=gen).to(device, dtype), 0)


@pytest.mark.parametrize("sample", range(2))
@pytest.mark.parametrize("target", params(TARGETS))
def test_opcheck(target, sample, device):
    torch.library.opcheck(torch.ops.eagle3.fused_add_rmsnorm_capture.default, list(fused_samples(device))[sample])


# ---- argument validation (once, on the CPU) ------------------------------------------------------------
H, K, T = 64, 3, 5


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
    "eps <= 0": (dict(eps=0.0), "eps must be"),
    "buffer rows": (dict(buffer=torch.randn(2, K * H)), "expected at least T=5"),
}


@pytest.mark.parametrize("case", list(FUSED_BAD))
def test_rejects_bad_input_before_writing(case):
    over, message = FUSED_BAD[case]
    args = _fused_args(**over)
    snaps = {k: args[k].clone() for k in ("input", "residual", "buffer")}
    with pytest.raises(ValueError, match=message):
        eagle3_ops.fused_add_rmsnorm_capture(**args)
    for k, v in snaps.items():
        assert same_bits(args[k], v), f"{k} changed although the call was rejected"
