"""The Triton draft fc kernels, run by the Triton interpreter on CPU tensors (small shapes), plus a
compile check of the same kernels for sm_90 and sm_120 (no GPU needed: Triton compiles to cubin
without a driver). GPU numerics and speed are in test_draft_fc_gpu.py / benchmarks/."""
import os
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

import eagle3_ops
from eagle3_ops import reference, workspace
from eagle3_ops.triton import _interpreter_shim as shim
from eagle3_ops.triton import draft_fc
from helpers import MATMUL_TOL, VARIANTS, assert_only_region_written, matmul_rel_err, randn, same_bits

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(
    not shim.interpreted(draft_fc._skinny_kernel),
    reason="interpreter tests run where TRITON_INTERPRET=1 (CI has no GPU); on a GPU see test_draft_fc_gpu.py")


# ---- the interpreter shim --------------------------------------------------------------------------
@triton.jit
def _dot_probe(a_ptr, b_ptr, c_ptr, INTERPRETER_BF16: tl.constexpr, RAW: tl.constexpr):
    i = tl.arange(0, 16)
    a = tl.load(a_ptr + i[:, None] * 16 + i[None, :])
    b = tl.load(b_ptr + i[:, None] * 16 + i[None, :])
    acc = tl.zeros([16, 16], dtype=tl.float32)
    if RAW:
        acc = tl.dot(a, b, acc)
    else:
        acc = shim.dot(a, b, acc, INTERPRETER_BF16, "tf32")
    tl.store(c_ptr + i[:, None] * 16 + i[None, :], acc)


def _probe(dtype, raw, flag):
    gen = torch.Generator().manual_seed(0)
    a, b = randn(16, 16, dtype=dtype, gen=gen), randn(16, 16, dtype=dtype, gen=gen)
    c = torch.empty(16, 16, dtype=torch.float32)
    _dot_probe[(1,)](a, b, c, INTERPRETER_BF16=flag, RAW=raw)
    return matmul_rel_err(c, a.double() @ b.double())


@triton.jit
def _cast_probe(v_ptr, out_ptr, INTERPRETER_BF16: tl.constexpr, RAW: tl.constexpr):
    i = tl.arange(0, 64)
    v = tl.load(v_ptr + i)
    if RAW:
        tl.store(out_ptr + i, v.to(out_ptr.dtype.element_ty))
    else:
        tl.store(out_ptr + i, shim.cast(v, out_ptr.dtype.element_ty, INTERPRETER_BF16))


def _cast(values, raw):
    v = torch.tensor(values + [0.0] * (64 - len(values)), dtype=torch.float32)
    out = torch.empty(64, dtype=torch.bfloat16)
    _cast_probe[(1,)](v, out, INTERPRETER_BF16=shim.interpreter_bf16(_cast_probe, torch.bfloat16), RAW=raw)
    return out[:len(values)], v[:len(values)].to(torch.bfloat16)  # torch rounds to nearest even


def test_raw_bf16_dot_is_wrong_under_the_interpreter():
    """Why the dot shim exists: Triton 3.8's interpreter multiplies bf16 bit patterns as integers."""
    assert _probe(torch.bfloat16, raw=True, flag=False) > 1.0


def test_shim_makes_bf16_dot_exact_under_the_interpreter():
    assert _probe(torch.bfloat16, raw=False, flag=shim.interpreter_bf16(_dot_probe, torch.bfloat16)) < 1e-6


def test_interpreter_fp16_dot_needs_no_shim():
    assert not shim.interpreter_bf16(_dot_probe, torch.float16)
    assert _probe(torch.float16, raw=True, flag=False) < 1e-6


# 1 + 2^-8 + 2^-9 rounds up, 1 + 2^-9 is a tie (rounds to even: down), 1 + 3*2^-9 a tie rounding up,
# -(1 + 2^-8 + 2^-9), a carry into the exponent (2 - 2^-9), NaN, inf, a large finite value.
CAST_VALUES = [1 + 2 ** -8 + 2 ** -9, 1 + 2 ** -9, 1 + 3 * 2 ** -9, -(1 + 2 ** -8 + 2 ** -9), 2 - 2 ** -9,
               float("nan"), float("inf"), 3.0e38, 1e-3]


def test_raw_bf16_cast_truncates_under_the_interpreter():
    """Why the cast shim exists: the interpreter truncates fp32 -> bf16 where a GPU rounds."""
    got, want = _cast(CAST_VALUES, raw=True)
    assert not same_bits(got[:5], want[:5])


def test_shim_rounds_bf16_casts_to_nearest_even_under_the_interpreter():
    got, want = _cast(CAST_VALUES, raw=False)
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)  # NaN stays NaN (its payload/sign bits may differ)
    assert same_bits(got[~nan], want[~nan])


def test_shim_is_inactive_for_compiled_kernels():
    for kernel in (_dot_probe, _cast_probe, draft_fc._skinny_kernel, draft_fc._tiled_kernel):
        compiled = triton.runtime.jit.JITFunction(kernel.fn)  # what @triton.jit gives without the interpreter
        assert shim.interpreted(kernel) and not shim.interpreted(compiled)
        assert not shim.interpreter_bf16(compiled, torch.bfloat16)


# ---- the three paths vs the float64 reference ------------------------------------------------------
def make_problem(R, H, K, N, dtype, seed, bias=False, rows=False, chunk=False, inorm=False, M=None):
    gen = torch.Generator().manual_seed(seed)
    x = randn(R, K * H, dtype=dtype, gen=gen, scale=3.0)
    w = randn(N, K * H, dtype=dtype, gen=gen, scale=(K * H) ** -0.5)
    b = randn(N, dtype=dtype, gen=gen) if bias else None
    r = torch.randint(0, R, (M or R,), generator=gen) if rows else None
    cn = (torch.rand(K, H, generator=gen, dtype=torch.float64) + 0.5).to(dtype) if chunk else None
    inw = (torch.rand(K * H, generator=gen, dtype=torch.float64) + 0.5).to(dtype) if inorm else None
    return x, w, b, r, cn, inw


def run_into_canaried_out(fn, args, M, N, dtype, **kw):
    """Runs fn into an [M, N] view of a canaried base; checks nothing outside it was written."""
    base = torch.full((M + 2, N + 3), 5.0, dtype=dtype)
    out = base[1:M + 1, 1:N + 1]
    out.fill_(float("nan"))
    before = base.clone()
    fn(*args, 1e-6, out, **kw)
    assert_only_region_written(before, base, slice(1, M + 1), slice(1, N + 1))
    return out


# R, H, K, N: chunk width 80 is not a multiple of the 64-wide k block, N=72 leaves a partial
# weight tile, M=40 a partial token tile.
SHAPE = (40, 80, 3, 72)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("path", ["skinny", "tiled", "cublas"])
def test_path_matches_fp64_reference(path, variant, dtype):
    R, H, K, N = SHAPE
    x, w, b, rows, cn, inw = make_problem(R, H, K, N, dtype, seed=zlib.crc32(f"{path}-{variant}".encode()),
                                          **VARIANTS[variant])
    M = R if rows is None else rows.numel()
    out = run_into_canaried_out(draft_fc.PATHS[path], (x, w, b, rows, cn, inw), M, N, dtype)
    want = reference.draft_fc_ref(x, w, b, rows, cn, inw, 1e-6, acc_dtype=torch.float64)
    assert not torch.isnan(out).any()
    assert matmul_rel_err(out, want) <= MATMUL_TOL[dtype]


@pytest.mark.parametrize("variant", ["plain", "chunk_norm", "all"])
def test_skinny_with_several_splits_per_chunk(variant):
    """split_len = one k block: chunk width 80 -> splits of 64 and 16 in every chunk (3 chunks, or
    4 splits over the 240-wide row without chunk norm); the fixed-order reducer sums them."""
    R, H, K, N = SHAPE
    x, w, b, rows, cn, inw = make_problem(R, H, K, N, torch.bfloat16, seed=11, M=9, **VARIANTS[variant])
    M = R if rows is None else rows.numel()
    per_chunk, _ = draft_fc.split_plan(H if cn is not None else K * H, K if cn is not None else 1, 1, 64, 4, 64)
    assert per_chunk >= 2
    out = run_into_canaried_out(draft_fc.skinny_fc_out, (x, w, b, rows, cn, inw), M, N, torch.bfloat16,
                                split_len=64)
    want = reference.draft_fc_ref(x, w, b, rows, cn, inw, 1e-6, acc_dtype=torch.float64)
    assert matmul_rel_err(out, want) <= MATMUL_TOL[torch.bfloat16]


@pytest.mark.parametrize("path", ["skinny", "tiled", "cublas"])
@pytest.mark.parametrize("rows_dtype", [torch.int32, torch.int64], ids=str)
def test_out_of_range_rows_give_nan_rows_and_no_out_of_bounds_access(path, rows_dtype):
    """Device-side contract: indices outside [0, R) are never dereferenced; their rows are NaN."""
    R, H, K, N = 6, 64, 2, 40
    x, w, b, _, cn, inw = make_problem(R, H, K, N, torch.float32, seed=3, bias=True, chunk=True, inorm=True)
    big = 2 ** 40 if rows_dtype == torch.int64 else 2 ** 30
    rows = torch.tensor([0, R, -1, 5, big, -big, 2], dtype=rows_dtype)
    out = run_into_canaried_out(draft_fc.PATHS[path], (x, w, b, rows, cn, inw), rows.numel(), N, torch.float32)
    want = reference.draft_fc_ref(x, w, b, rows, cn, inw, 1e-6, acc_dtype=torch.float64)
    bad = torch.tensor([False, True, True, False, True, True, False])
    assert torch.isnan(out[bad]).all()
    assert not torch.isnan(out[~bad]).any()
    assert matmul_rel_err(out[~bad], want[~bad]) <= MATMUL_TOL[torch.float32]


def strided_1d_problem():
    """(x, w, bias, rows, chunk_norm_weight, input_norm_weight) with bias, rows and the input norm
    weight as stride-2 views (validation accepts any stride for 1-D arguments)."""
    R, H, K, N = 12, 64, 2, 40
    x, w, _, _, cn, _ = make_problem(R, H, K, N, torch.float32, seed=4, chunk=True)
    gen = torch.Generator().manual_seed(4)
    bias = randn(2 * N, dtype=torch.float32, gen=gen)[::2]
    rows = torch.tensor([11, 0, 5, 5, 3, 9, 1, 2], dtype=torch.int64)[::2]
    inw = (torch.rand(2 * K * H, generator=gen, dtype=torch.float64) + 0.5).float()[::2]
    return x, w, bias, rows, cn, inw


@pytest.mark.parametrize("path", ["skinny", "tiled", "cublas"])
def test_strided_rows_bias_and_norm_weight_views_are_read_correctly(path):
    """Validation accepts any stride for the 1-D arguments; the kernels must not assume stride 1."""
    x, w, bias, rows, cn, inw = strided_1d_problem()
    N = w.shape[0]
    assert not (bias.is_contiguous() or rows.is_contiguous() or inw.is_contiguous())
    out = run_into_canaried_out(draft_fc.PATHS[path], (x, w, bias, rows, cn, inw), rows.numel(), N, torch.float32)
    want = reference.draft_fc_ref(x, w, bias, rows, cn, inw, 1e-6, acc_dtype=torch.float64)
    assert matmul_rel_err(out, want) <= MATMUL_TOL[torch.float32]


@pytest.mark.parametrize("path", ["skinny", "tiled", "cublas"])
def test_empty_inner_dimension_gives_bias(path):
    """K*H = 0 is a valid (degenerate) problem: the product is empty, out = bias."""
    x, w, b = torch.randn(5, 0), torch.randn(7, 0), torch.randn(7)
    out = run_into_canaried_out(draft_fc.PATHS[path], (x, w, b, None, None, None), 5, 7, torch.float32)
    assert torch.equal(out, b.expand(5, 7))


@pytest.mark.parametrize("path", ["skinny", "tiled"])
def test_same_inputs_twice_give_bitwise_equal_results(path):
    R, H, K, N = SHAPE
    x, w, b, rows, cn, inw = make_problem(R, H, K, N, torch.bfloat16, seed=5, **VARIANTS["all"])
    kw = dict(split_len=64) if path == "skinny" else {}
    outs = [run_into_canaried_out(draft_fc.PATHS[path], (x, w, b, rows, cn, inw), rows.numel(), N,
                                  torch.bfloat16, **kw) for _ in range(2)]
    assert same_bits(outs[0], outs[1])


def test_row_scales_are_the_rms_scales_of_the_normalized_chunks():
    """The tiny first pass: a[m, c] = s_m * r_mc, s_m from the whole row, r_mc from the chunk of the
    input-normed row (the reference's order: input norm, then chunk norm)."""
    R, H, K, N = 5, 48, 3, 16
    x, w, _, rows, cn, inw = make_problem(R, H, K, N, torch.bfloat16, seed=8, rows=True, chunk=True, inorm=True)
    p = draft_fc._problem(x, w, rows, cn, inw, torch.empty(rows.numel(), N))
    got = draft_fc._row_scales(x, rows, cn, inw, 1e-6, p)
    xs = x.double()[rows]
    s = torch.rsqrt(xs.pow(2).mean(-1, keepdim=True) + 1e-6)
    y = (xs * s * inw.double()).view(-1, K, H)
    want = s * torch.rsqrt(y.pow(2).mean(-1) + 1e-6)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=0)


def test_prepared_input_is_the_reference_input_rounded_once():
    R, H, K = 7, 40, 3
    x, _, _, _, cn, inw = make_problem(R, H, K, 8, torch.bfloat16, seed=9, chunk=True, inorm=True)
    rows = torch.tensor([6, 0, 7, 3])
    got = draft_fc.prepare_input(x, rows, cn, inw, 1e-6, rows.numel())
    want = reference.draft_fc_input_ref(x, rows, cn, inw, 1e-6, acc_dtype=torch.float64)
    assert torch.isnan(got[2]).all() and not torch.isnan(got[[0, 1, 3]]).any()
    ok = [0, 1, 3]
    err = ((got[ok].double() - want[ok]).abs() / want[ok].abs()).max().item()
    assert err <= 2 ** -8  # half a bf16 ulp (rounded to nearest) plus fp32 noise


# ---- scratch memory: draft_fc_out allocates nothing once warm (DESIGN.md §4) ----------------------
@pytest.fixture
def fresh_workspace():
    workspace.clear()
    yield
    workspace.clear()


def _fc_kinds():
    return {k: workspace.buffer(torch.device("cpu"), "draft_fc." + k)
            for k in ("row_scales", "splitk", "prepared", "rows", "bias", "input_norm")}


def _ptrs():
    return {k: (b.data_ptr(), b.numel()) for k, b in _fc_kinds().items() if b is not None}


def test_workspace_reuses_for_the_same_or_fewer_bytes_and_grows_for_more(fresh_workspace):
    cpu = torch.device("cpu")
    a = workspace.get(cpu, "t", 1024, torch.float32)  # 4 KiB: a multiple of GRANULE, no slack
    assert a.shape == (1024,) and a.dtype == torch.float32
    n = workspace.allocations
    b = workspace.get(cpu, "t", 1024, torch.float32)
    c = workspace.get(cpu, "t", 10, torch.bfloat16)  # fewer bytes, another dtype: same memory
    assert a.data_ptr() == b.data_ptr() == c.data_ptr() and workspace.allocations == n
    assert workspace.get(cpu, "other", 10, torch.float32).data_ptr() != a.data_ptr()  # kinds are separate
    d = workspace.get(cpu, "t", 1025, torch.float32)  # one element more: grows by at least GROWTH
    assert workspace.allocations == n + 2 and d.data_ptr() != a.data_ptr()
    assert workspace.buffer(cpu, "t").numel() >= 4096 * workspace.GROWTH
    assert workspace.retired() == []  # no capture saw the old buffer: it was simply dropped


def test_workspace_growth_during_graph_capture_is_allowed_and_captured_buffers_stay_alive(fresh_workspace, monkeypatch):
    """The policy: growth while capturing is allowed (graph pool); any buffer a capture has seen is
    never freed afterwards, since replays keep writing to its address. (CPU stand-in for a CUDA
    capture: the capture probe is patched; test_draft_fc_gpu.py runs the real thing.)"""
    cpu = torch.device("cpu")
    workspace.get(cpu, "t", 100, torch.float32)  # eager warm-up, too small
    monkeypatch.setattr(workspace, "_capturing", lambda device: True)
    captured = workspace.get(cpu, "t", 1000, torch.float32)  # grows inside the "capture": no error
    assert len(workspace.retired()) == 1  # the replaced buffer may already be in this capture
    monkeypatch.setattr(workspace, "_capturing", lambda device: False)
    again = workspace.get(cpu, "t", 1000, torch.float32)
    assert again.data_ptr() == captured.data_ptr()  # eager calls reuse it
    workspace.get(cpu, "t", 100000, torch.float32)  # eager growth after the capture
    kept = workspace.retired()
    assert len(kept) == 2 and kept[-1].data_ptr() == captured.data_ptr()  # retired, not freed
    workspace.get(cpu, "t", 10 ** 6, torch.float32)  # a buffer no capture saw is not retired
    assert len(workspace.retired()) == 2


SCRATCH_CASES = {  # path -> (keyword arguments, the scratch kinds it must use)
    "skinny": (dict(split_len=64), {"row_scales", "splitk"}),
    "tiled": ({}, {"row_scales"}),
    "cublas": ({}, {"prepared"}),
}


@pytest.mark.parametrize("path", list(SCRATCH_CASES))
def test_draft_fc_out_reuses_its_scratch_and_grows_only_for_a_larger_problem(path, fresh_workspace):
    kw, kinds = SCRATCH_CASES[path]
    fn = draft_fc.PATHS[path]
    R, H, K, N = SHAPE

    def run(M, N, seed):
        x, w, b, rows, cn, inw = make_problem(R, H, K, N, torch.bfloat16, seed=seed, M=M, **VARIANTS["all"])
        out = run_into_canaried_out(fn, (x, w, b, rows, cn, inw), M, N, torch.bfloat16, **kw)
        want = reference.draft_fc_ref(x, w, b, rows, cn, inw, 1e-6, acc_dtype=torch.float64)
        assert matmul_rel_err(out, want) <= MATMUL_TOL[torch.bfloat16]  # reused scratch, right result

    run(M=9, N=N, seed=1)  # warm-up
    warm, n = _ptrs(), workspace.allocations
    assert set(warm) == kinds
    run(M=9, N=N, seed=2)  # same problem, new data
    run(M=3, N=N - 8, seed=3)  # smaller
    assert _ptrs() == warm and workspace.allocations == n
    run(M=64, N=2 * N, seed=4)  # larger (row scales 64*3*4 B > one GRANULE): every kind grows
    grown = _ptrs()
    assert workspace.allocations == n + len(kinds)
    assert all(grown[k][0] != warm[k][0] and grown[k][1] > warm[k][1] for k in kinds)


@pytest.mark.parametrize("path", ["skinny", "tiled", "cublas"])
def test_strided_views_are_copied_into_scratch_not_new_tensors(path, fresh_workspace):
    """The rare strided 1-D views get a unit-stride copy in scratch: one allocation per kind on the
    first call, none after (contiguous views, the usual case, use no scratch at all)."""
    x, w, bias, rows, cn, inw = strided_1d_problem()
    N = w.shape[0]
    args = (x, w, bias, rows, cn, inw)
    run_into_canaried_out(draft_fc.PATHS[path], args, rows.numel(), N, torch.float32)
    warm, n = _ptrs(), workspace.allocations
    assert {"rows", "bias", "input_norm"} <= set(warm)
    out = run_into_canaried_out(draft_fc.PATHS[path], args, rows.numel(), N, torch.float32)
    assert _ptrs() == warm and workspace.allocations == n
    want = reference.draft_fc_ref(*args, 1e-6, acc_dtype=torch.float64)
    assert matmul_rel_err(out, want) <= MATMUL_TOL[torch.float32]


# ---- host-side planning ----------------------------------------------------------------------------
@pytest.mark.parametrize("CH,NC,block_k,split_len", [(7168, 3, 128, None), (80, 3, 64, 64), (21504, 1, 128, None),
                                                     (64, 1, 64, None), (7168, 3, 128, 1000)])
def test_splits_tile_each_chunk_exactly_in_block_multiples(CH, NC, block_k, split_len):
    per_chunk, length = draft_fc.split_plan(CH, NC, programs_per_split=56, block_k=block_k, num_sms=132,
                                            split_len=split_len)
    assert length % block_k == 0 and 1 <= per_chunk <= 16
    assert (per_chunk - 1) * length < CH <= per_chunk * length  # no empty split, nothing left over


def test_crossover_table_names_its_devices_and_basis_and_orders_paths():
    for key, entry in draft_fc.CROSSOVER.items():
        assert entry.device and entry.basis, key
        assert 1 <= entry.skinny_max_m <= entry.tiled_max_m, key
        assert entry.path(1) == "skinny" and entry.path(entry.skinny_max_m) == "skinny"
        assert entry.path(entry.skinny_max_m + 1) == ("tiled" if entry.tiled_max_m > entry.skinny_max_m else "cublas")
        assert entry.path(entry.tiled_max_m + 1) == "cublas"


def test_interpreter_dispatch_runs_both_triton_kernels():
    entry = draft_fc.crossover_for(torch.device("cpu"))
    assert draft_fc.choose_path(entry.skinny_max_m, torch.device("cpu")) == "skinny"
    assert draft_fc.choose_path(entry.skinny_max_m + 1, torch.device("cpu")) == "tiled"


# ---- the GPU kernels compile for sm_90 and sm_120 (no GPU needed) ----------------------------------
_COMPILE_CHECK = textwrap.dedent('''
    import json, re, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from eagle3_ops.triton import draft_fc as d

    def compile_kernel(kernel, cc, consts, opts, fp32_ptrs=()):
        sig = {}
        for n in kernel.arg_names:
            if n in consts:
                sig[n] = "constexpr"
            elif n.endswith("_ptr"):
                sig[n] = "*fp32" if n in fp32_ptrs else ("*i64" if n == "rows_ptr" else "*bf16")
            else:
                sig[n] = "fp32" if n == "eps" else "i32"
        # what the JIT infers for 16-aligned pointers and sizes divisible by 16
        div = [n for n in kernel.arg_names if n not in consts and (n.endswith("_ptr") or n.startswith("stride")
               or n in ("N", "CH", "KH", "SPLIT_LEN"))]
        attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in div}
        src = ASTSource(fn=kernel, signature=sig, attrs=attrs,
                        constexprs={(kernel.arg_names.index(n),): v for n, v in consts.items()})
        ck = triton.compile(src, target=GPUTarget("cuda", cc, 32), options=opts)
        ptx = ck.asm["ptx"]
        return dict(shared=ck.metadata.shared, mma=sorted(set(re.findall(r"(?:wgmma\\.mma_async|mma\\.sync)\\S*", ptx))),
                    cp_async_16="cp.async.cg.shared.global" in ptx or "cp.async.bulk" in ptx)

    flags = dict(HAS_ROWS=True, HAS_IN_NORM=True, HAS_CHUNK_NORM=True, HAS_SCALE=True, HAS_BIAS=True,
                 INTERPRETER_BF16=False, INPUT_PRECISION="tf32")
    report = {}
    for cc in (90, 120):
        for M in (1, 64):
            cfg = d.skinny_config(cc // 10, M, 2)
            opts = dict(num_warps=cfg.pop("num_warps"), num_stages=cfg.pop("num_stages"))
            report[f"skinny_sm{cc}_M{M}"] = compile_kernel(d._skinny_kernel, cc, dict(flags, WRITE_PARTIAL=True, **cfg),
                                                          opts, fp32_ptrs=("scale_ptr", "ws_ptr"))
        cfg = d.tiled_config(cc // 10, 2)
        opts = dict(num_warps=cfg.pop("num_warps"), num_stages=cfg.pop("num_stages"))
        report[f"tiled_sm{cc}"] = compile_kernel(d._tiled_kernel, cc, dict(flags, **cfg), opts, fp32_ptrs=("scale_ptr",))
        report[f"reduce_sm{cc}"] = compile_kernel(d._splitk_reduce_kernel, cc, dict(HAS_ROWS=True, HAS_BIAS=True, BLOCK=1024,
                                                                                              INTERPRETER_BF16=False),
                                                  dict(num_warps=4), fp32_ptrs=("ws_ptr",))
        for prep in (False, True):
            report[f"rows_sm{cc}_prep{prep}"] = compile_kernel(
                d._row_scales_kernel, cc, dict(HAS_ROWS=True, HAS_IN_NORM=True, HAS_CHUNK_NORM=True,
                                               WRITE_PREPARED=prep, BLOCK=1024, INTERPRETER_BF16=False),
                dict(num_warps=4), fp32_ptrs=("scale_ptr",))
    print(json.dumps(report))
''')


def test_gpu_kernels_compile_for_sm90_and_sm120_with_bf16_mma_and_fitting_shared_memory():
    """The compiled kernels (not the interpreter's): bf16 operands reach the tensor cores unchanged
    (wgmma on sm_90, mma.sync on sm_120, i.e. the shim is off), weight tiles stream through 16-byte
    cp.async, and shared memory fits a block (227 KB sm_90, 99 KB sm_120)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", _COMPILE_CHECK], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    report = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, r in report.items():
        limit = 227 * 1024 if "sm90" in name else 99 * 1024
        assert r["shared"] <= limit, (name, r)
        if name.startswith(("skinny", "tiled")):
            mma = " ".join(r["mma"])
            want = "wgmma.mma_async" if "sm90" in name else "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
            assert want in mma and ".bf16.bf16" in mma and "tf32" not in mma, (name, r)
            assert r["cp_async_16"], (name, r)


def test_fp16_large_activations_with_norm_weights_stay_finite(monkeypatch):
    """fp16: x * norm weights can exceed 65504 before the RMS scale brings it back; the dispatched
    Triton path must normalize before rounding for the dot (the skinny kernel would overflow)."""
    monkeypatch.setenv("EAGLE3_OPS_BACKEND", "triton")
    R, H, K, N = 5, 64, 3, 24
    x, w, b, rows, cn, inw = make_problem(R, H, K, N, torch.float16, seed=11, bias=True, chunk=True, inorm=True)
    x[:, ::7] = 20000.0  # representable in fp16; x * 2 * 2 = 80000 is not
    cn.fill_(2.0)
    inw.fill_(2.0)
    assert draft_fc.choose_path(R, x.device) == "skinny"  # what the table alone would pick
    got = eagle3_ops.draft_fc(x, w, b, rows, cn, inw, 1e-6)
    want = reference.draft_fc_ref(x, w, b, rows, cn, inw, 1e-6, acc_dtype=torch.float64)
    assert torch.isfinite(got).all()
    assert matmul_rel_err(got, want) <= MATMUL_TOL[torch.float16]
