"""Every op against a float64 truth on fresh random data, with canaries around every write.

Runs each op through torch.ops.eagle3 on every backend available here (reference always; the
Triton kernels under TRITON_INTERPRET=1 on small shapes). The full shape grid runs on the
reference; the interpreted Triton kernels get a reduced grid (the interpreter is slow).
"""
import itertools


import pytest
import torch

import eagle3_ops
from eagle3_ops import reference
from helpers import (DTYPES, MATMUL_TOL, VARIANTS, assert_only_region_written, assert_rounded_close, backends_for,
                     matmul_rel_err, poisoned_buffer, randn, same_bits)

FULL_T = (0, 1, 7, 64, 300)
FULL_H = (64, 256, 4096)
FULL_K = (1, 2, 3, 4)
SMALL = [(0, 64, 1), (1, 64, 3), (7, 72, 2), (5, 40, 4), (64, 256, 3)]  # (T, H, K) for interpreted Triton


def capture_cases(backend):
    if backend == "reference":
        return [(T, H, K) for T, H, K in itertools.product(FULL_T, FULL_H, FULL_K)]
    return SMALL


def _cases(op):
    out = []
    for backend in backends_for(op):
        for T, H, K in capture_cases(backend):
            out.append(pytest.param(backend, T, H, K, id=f"{backend}-T{T}-H{H}-K{K}"))
    return out


@pytest.fixture
def use_backend(monkeypatch):
    def _use(name):
        monkeypatch.setenv("EAGLE3_OPS_BACKEND", name)
    return _use


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "no_residual"])
@pytest.mark.parametrize("backend,T,H,K", _cases("capture"))
def test_capture_writes_exactly_its_slot(backend, T, H, K, with_residual, dtype, use_backend):
    use_backend(backend)
    gen = torch.Generator().manual_seed(T * 1000 + H + K)
    hidden = randn(T, H, dtype=dtype, gen=gen)
    residual = randn(T, H, dtype=dtype, gen=gen) if with_residual else None
    base, buffer = poisoned_buffer(T + 2, K * H, dtype, gen=gen)
    slot = (T + K) % K
    buffer[:T, slot * H:(slot + 1) * H] = float("nan")  # poison the output region
    before = base.clone()
    eagle3_ops.capture(hidden, residual, buffer, slot)
    want = hidden.double() + (residual.double() if with_residual else 0)
    assert_rounded_close(buffer[:T, slot * H:(slot + 1) * H], want, dtype)
    assert_only_region_written(before, base, slice(0, T), slice(slot * H, (slot + 1) * H))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend,T,H,K", _cases("fused_add_rmsnorm_capture"))
def test_fused_add_rmsnorm_capture_matches_fp64(backend, T, H, K, dtype, use_backend):
    use_backend(backend)
    gen = torch.Generator().manual_seed(7 * T + H + K)
    x = randn(T, H, dtype=dtype, gen=gen)
    res = randn(T, H, dtype=dtype, gen=gen)
    weight = (torch.rand(H, generator=gen, dtype=torch.float64) + 0.5).to(dtype)
    eps = 1e-6
    base, buffer = poisoned_buffer(T + 2, K * H, dtype, gen=gen)
    slot = K - 1
    buffer[:T, slot * H:(slot + 1) * H] = float("nan")
    before = base.clone()
    x64, r64 = x.double(), res.double()
    s64 = x64 + r64
    eagle3_ops.fused_add_rmsnorm_capture(x, res, weight, eps, buffer, slot)
    # residual and captured slot: the sum rounded once
    assert_rounded_close(res, s64, dtype)
    assert same_bits(buffer[:T, slot * H:(slot + 1) * H].contiguous(), res), "captured slot != stored residual"
    # normed output from the unrounded sum (SGLang/FlashInfer numerics)
    normed64 = s64 * torch.rsqrt(s64.pow(2).mean(-1, keepdim=True) + eps) * weight.double()
    if T:
        err = ((x.double() - normed64).abs() / (normed64.abs() + 1e-3)).max().item()
        assert err < {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}[dtype]
    assert_only_region_written(before, base, slice(0, T), slice(slot * H, (slot + 1) * H))


def test_fused_norm_reads_unrounded_sum_like_sglang():
    """Pin the documented numerics: the norm uses the fp32 sum, not the bf16-rounded residual."""
    gen = torch.Generator().manual_seed(3)
    T, H = 4, 256
    x = randn(T, H, dtype=torch.bfloat16, gen=gen)
    r = randn(T, H, dtype=torch.bfloat16, gen=gen, scale=300.0)
    w = torch.ones(H, dtype=torch.bfloat16)
    buf = torch.empty(T, H, dtype=torch.bfloat16)
    xo, ro = x.clone(), r.clone()
    eagle3_ops.fused_add_rmsnorm_capture(xo, ro, w, 1e-6, buf, 0)
    s = x.float() + r.float()
    expect = (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()).to(torch.bfloat16)
    assert torch.equal(xo, expect)


FC_FULL = [(M_rows, H, K) for M_rows, H, K in itertools.product((0, 1, 7, 64, 300), (64, 256), FULL_K)]
FC_FULL += [(7, 4096, 3), (1, 4096, 1)]
FC_SMALL = [(1, 64, 1), (7, 72, 3), (33, 64, 2), (16, 128, 3)]


def _fc_cases():
    out = []
    for backend in backends_for("draft_fc"):
        shapes = FC_FULL if backend == "reference" else FC_SMALL
        for (R, H, K), variant in itertools.product(shapes, VARIANTS):
            out.append(pytest.param(backend, R, H, K, variant, id=f"{backend}-R{R}-H{H}-K{K}-{variant}"))
    return out


def make_fc_problem(R, H, K, dtype, gen, bias=False, rows=False, chunk=False, inorm=False, N=None,
                    rows_dtype=torch.int64):
    N = N or H
    x = randn(R, K * H, dtype=dtype, gen=gen)
    w = randn(N, K * H, dtype=dtype, gen=gen, scale=(K * H) ** -0.5)
    b = randn(N, dtype=dtype, gen=gen) if bias else None
    r = None
    if rows:
        M = max(R // 2 + 1, 1) if R else 0
        r = torch.randint(0, max(R, 1), (M,), generator=gen).to(rows_dtype) if R else torch.empty(0, dtype=rows_dtype)
    cn = (torch.rand(K, H, generator=gen, dtype=torch.float64) + 0.5).to(dtype) if chunk else None
    inw = (torch.rand(K * H, generator=gen, dtype=torch.float64) + 0.5).to(dtype) if inorm else None
    return x, w, b, r, cn, inw


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend,R,H,K,variant", _fc_cases())
def test_draft_fc_matches_fp64(backend, R, H, K, variant, dtype, use_backend):
    use_backend(backend)
    gen = torch.Generator().manual_seed(R * 31 + H + K)
    x, w, b, rows, cn, inw = make_fc_problem(R, H, K, dtype, gen, **VARIANTS[variant])
    want = reference.draft_fc_ref(x, w, b, rows, cn, inw, 1e-6, acc_dtype=torch.float64)
    got = eagle3_ops.draft_fc(x, w, b, rows, cn, inw, 1e-6)
    assert got.dtype == dtype and got.shape == want.shape
    assert not torch.isnan(got).any()
    assert matmul_rel_err(got, want) <= MATMUL_TOL[dtype]
    # the _out variant writes exactly out, nothing around it
    M, N = want.shape
    base = torch.full((M + 2, N + 3), 4.0, dtype=dtype)
    out = base[1:M + 1, :N]
    out.fill_(float("nan"))
    before = base.clone()
    eagle3_ops.draft_fc_out(x, w, b, rows, cn, inw, 1e-6, out)
    assert matmul_rel_err(out, want) <= MATMUL_TOL[dtype]
    assert_only_region_written(before, base, slice(1, M + 1), slice(0, N))


@pytest.mark.parametrize("rows_dtype", [torch.int32, torch.int64], ids=str)
def test_draft_fc_rows_gather_in_given_order_with_repeats(rows_dtype):
    gen = torch.Generator().manual_seed(5)
    x, w, *_ = make_fc_problem(9, 64, 3, torch.float32, gen)
    rows = torch.tensor([8, 0, 3, 3, 8], dtype=rows_dtype)
    got = eagle3_ops.draft_fc(x, w, rows=rows)
    want = x.double()[rows.long()] @ w.double().t()
    assert matmul_rel_err(got, want) < 1e-6


def test_draft_fc_reference_device_rows_out_of_range_give_nan_rows():
    """The device-side contract (no host sync): out-of-range rows produce NaN rows, others are exact."""
    gen = torch.Generator().manual_seed(6)
    x, w, *_ = make_fc_problem(5, 64, 2, torch.float32, gen)
    rows = torch.tensor([0, 5, -1, 4])
    y = reference.draft_fc_ref(x, w, rows=rows)
    assert torch.isnan(y[1]).all() and torch.isnan(y[2]).all()
    assert not torch.isnan(y[[0, 3]]).any()
