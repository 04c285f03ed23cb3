"""Backend internals, apart from the op contracts (tests/ops/test_<op>.py):

* the draft_fc plans: the crossover table (``eagle3_ops.plans``), path forcing, Triton split plans,
  launch configurations, workspace regions (``draft_fc_workspace_bytes`` is exactly what
  ``draft_fc`` carves), the row-scale and prepared-input passes;
* the Triton interpreter shim, and a compile check of the Triton kernels for sm_90 and sm_120
  (no GPU needed: Triton compiles to PTX without a driver);
* the face's scratch (``eagle3_ops.workspace``): one grow-only buffer per (device, stream), reuse,
  growth factor, buffers a CUDA-graph capture saw are retired (never freed), two streams never
  share one;
* dispatch: backend choice and forcing, verification against the reference (a backend that
  disagrees is disabled with an error log and the next one serves).
"""
import dataclasses
import json
import logging
import os
import subprocess
import sys
import textwrap
import math
import threading
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

import eagle3_ops
from eagle3_ops import dispatch, plans, reference, registry, workspace
import op_testing as testing
from op_testing import MATMUL_TOL, VARIANTS, assert_close, fc_problem, params, same_bits
from eagle3_ops.triton import _interpreter_shim as shim
from eagle3_ops.triton import capture as triton_capture
from eagle3_ops.triton import draft_fc as triton_fc

ROOT = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")
BF16 = torch.bfloat16
interpreter_only = pytest.mark.skipif(
    not shim.interpreted(triton_fc._skinny_kernel),
    reason="checks the Triton interpreter (TRITON_INTERPRET=1, set by tests/conftest.py where there is no GPU)")


# ---- the crossover table and path forcing ---------------------------------------------------------------
def test_crossover_table_names_its_devices_and_basis_and_orders_paths():
    for key, entry in plans.CROSSOVER.items():
        backend, _ = key
        assert entry.device and entry.basis, key
        assert 1 <= entry.skinny_max_m <= entry.tiled_max_m, key
        if backend == "cuda":
            assert entry.tiled_max_m == entry.skinny_max_m, (key, "the CUDA backend has no tiled kernel")
        assert entry.path(1) == "skinny" and entry.path(entry.skinny_max_m) == "skinny"
        assert entry.path(entry.skinny_max_m + 1) == ("tiled" if entry.tiled_max_m > entry.skinny_max_m else "cublas")
        assert entry.path(entry.tiled_max_m + 1) == "cublas"
    for backend in ("cuda", "triton"):
        assert (backend, "default") in plans.CROSSOVER


def test_interpreter_table_runs_both_triton_kernels():
    entry = plans.crossover_for("triton", CPU)
    assert plans.choose("triton", CPU, entry.skinny_max_m) == "skinny"
    assert plans.choose("triton", CPU, entry.skinny_max_m + 1) == "tiled"


def test_forced_path_is_scoped_and_per_thread():
    seen = {}
    with plans.forced_path("cublas"):
        assert plans.choose("triton", CPU, 1) == "cublas"
        with plans.forced_path(None):
            assert plans.choose("triton", CPU, 1) == "skinny"  # None: the table decides again
        thread = threading.Thread(target=lambda: seen.setdefault("other", plans.choose("triton", CPU, 1)))
        thread.start()
        thread.join()
        assert plans.choose("triton", CPU, 1) == "cublas"
    assert seen["other"] == "skinny", "a forced path leaked into another thread"
    assert plans.forced() is None
    with pytest.raises(ValueError, match="path must be one of"):
        with plans.forced_path("fast"):
            pass


# ---- Triton split plans, configurations, workspace regions ----------------------------------------------
@pytest.mark.parametrize("CH,NC,block_k,split_len", [(7168, 3, 128, None), (80, 3, 64, 64), (21504, 1, 128, None),
                                                     (64, 1, 64, None), (7168, 3, 128, 1000)])
def test_splits_tile_each_chunk_exactly_in_block_multiples(CH, NC, block_k, split_len):
    per_chunk, length = triton_fc.split_plan(CH, NC, programs_per_split=56, block_k=block_k, num_sms=132,
                                             split_len=split_len)
    assert length % block_k == 0 and 1 <= per_chunk <= 16
    assert (per_chunk - 1) * length < CH <= per_chunk * length  # no empty split, nothing left over


@pytest.mark.parametrize("variant", ["plain", "chunk_norm", "all"])
@pytest.mark.parametrize("target", params(testing.TRITON_TARGETS))
def test_skinny_with_several_splits_per_chunk(target, variant, device):
    """split_len = one k block (64 on the interpreter, 128 compiled): chunk width 80 (200 on a GPU)
    -> two splits in every chunk, the last one partial (or 4-5 over the whole row without chunk
    norm); the fixed-order reducer sums them."""
    p = fc_problem(9, 200 if target.gpu else 80, 3, BF16, device, N=72, key=("splits",), **VARIANTS[variant])
    with plans.forced_path("skinny"):
        pl = triton_fc.plan(*p.args, split_len=64)
        assert pl.path == "skinny" and pl.splits_per_chunk >= 2 and pl.partial_bytes > 0
        ws = torch.empty(triton_fc.draft_fc_workspace_bytes(*p.args, split_len=64), dtype=torch.uint8, device=device)
        out = p.out()
        testing.run_canaried(lambda: triton_fc.draft_fc(*p.args, p.eps, out, ws, split_len=64), [out], [out])
    assert_close(out, p.truth(), MATMUL_TOL[BF16], normwise=True)


def _workspace_cases(target):
    """(path, M, variant, strided): per backend with a workspace, a path that carves each region."""
    M_small, M_big, H = (7, 300, 4096) if target.gpu else (7, 40, 80)
    cases = [(path, M, v, s) for path in testing.FC_PATHS[target.backend] for M in (M_small, M_big)
             for v in ("plain", "all") for s in ((False, True) if v == "all" else (False,))]
    return [(path, M, H, v, s) for path, M, v, s in cases]


@pytest.mark.parametrize("target,path,M,H,variant,strided",
                         params([t for t in testing.TARGETS if t.backend != "reference"], _workspace_cases))
def test_workspace_bytes_are_exactly_what_draft_fc_carves(target, path, M, H, variant, strided, device):
    """The backend's draft_fc_workspace_bytes is the size draft_fc carves: a workspace of exactly
    that size serves (the Carver raises when a region does not fit), one byte less is refused."""
    p = fc_problem(M, H, 3, BF16, device, key=("ws", path), **VARIANTS[variant])
    if strided:
        p = p.strided_1d()
    with plans.forced_path(path):
        need = int(testing.backend_function(target.backend, "draft_fc_workspace_bytes")(*p.args))
        if variant == "all" and target.backend == "triton":
            assert need > 0, "row scales / prepared input need workspace"
        if strided:
            assert need >= workspace.aligned(p.M * 8) + workspace.aligned(p.N * 2), "no room for the unit-stride copies"
        out = p.run_out(p.out(), backend=target.backend)
        assert_close(out, p.truth(), MATMUL_TOL[BF16], normwise=True)
        if need:
            short = torch.empty(need - 1, dtype=torch.uint8, device=device)
            with pytest.raises((ValueError, RuntimeError)):
                testing.backend_function(target.backend, "draft_fc")(*p.args, p.eps, p.out(), short)
                if target.gpu:
                    torch.cuda.synchronize()


@pytest.mark.parametrize("target,path", params([t for t in testing.TARGETS if t.backend != "reference"],
                                                lambda t: testing.FC_PATHS[t.backend]))
def test_backends_copy_strided_1d_arguments_to_unit_stride(target, path, device):
    """The kernels index bias, rows and input_norm_weight with stride 1; a backend called with
    strided views (below validation, which refuses a strided input_norm_weight) copies them into
    its workspace first (fc_rules.unit_stride_copies) and computes the same result."""
    H = 4096 if target.gpu else 64
    p = fc_problem(7, H, 2, torch.float32 if not target.gpu else BF16, device, key=("copies", path),
                   **VARIANTS["all"]).strided_1d(input_norm_weight=True)
    assert not (p.bias.is_contiguous() or p.rows.is_contiguous() or p.input_norm_weight.is_contiguous())
    with plans.forced_path(path):
        out = p.run_out(p.out(), backend=target.backend)
    assert_close(out, p.truth(), MATMUL_TOL[p.dtype], normwise=True)


def test_triton_plan_regions():
    """Which regions each Triton path carves (strided copies first, then row scales, then partials
    or the prepared input), and the fp16-with-norms rule: skinny falls back to tiled."""
    p = fc_problem(7, 80, 3, BF16, CPU, N=72, key=("plan",), **VARIANTS["all"])
    with plans.forced_path("skinny"):
        pl = triton_fc.plan(*p.args, split_len=64)
        assert (pl.scale_bytes == workspace.aligned(7 * 3 * 4)
                and pl.partial_bytes == workspace.aligned(pl.S * 7 * 72 * 4))
        assert pl.copy_bytes == 0 and pl.prepared_bytes == 0
        s = p.strided_1d()
        assert triton_fc.plan(*s.args).copy_bytes == workspace.aligned(72 * 2) + workspace.aligned(7 * 8)
        f16 = fc_problem(7, 80, 3, torch.float16, CPU, N=72, key=("plan",), **VARIANTS["all"])
        assert triton_fc.plan(*f16.args).path == "tiled"
    with plans.forced_path("tiled"):
        pl = triton_fc.plan(*p.args)
        assert pl.path == "tiled" and pl.partial_bytes == 0 and pl.prepared_bytes == 0 and pl.scale_bytes > 0
    with plans.forced_path("cublas"):
        pl = triton_fc.plan(*p.args)
        assert pl.nbytes == pl.prepared_bytes == workspace.aligned(7 * 240 * 2)
        plain = fc_problem(7, 80, 3, BF16, CPU, N=72, key=("plan",))
        assert triton_fc.plan(*plain.args).nbytes == 0  # x straight into the GEMM


@interpreter_only
def test_row_scales_are_the_rms_scales_of_the_normalized_chunks():
    """The tiny first pass: a[m, c] = s_m * r_mc, s_m from the whole row, r_mc from the chunk of the
    input-normed row (the reference's order: input norm, then chunk norm)."""
    p = fc_problem(5, 48, 3, BF16, CPU, N=16, key=("scales",), rows=True, chunk=True, inorm=True)
    x, rows, cn, inw = p.x, p.rows, p.chunk_norm_weight, p.input_norm_weight
    got = triton_fc._row_scales(x, rows, cn, inw, 1e-6, triton_fc._problem(x, p.weight, rows, cn, inw))
    xs = x.double()[rows]
    s = torch.rsqrt(xs.pow(2).mean(-1, keepdim=True) + 1e-6)
    y = (xs * s * inw.double()).view(-1, 3, 48)
    want = s * torch.rsqrt(y.pow(2).mean(-1) + 1e-6)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=0)


@interpreter_only
def test_prepared_input_is_the_reference_input_rounded_once():
    p = fc_problem(4, 40, 3, BF16, CPU, N=8, key=("prepared",), chunk=True, inorm=True)
    x, cn, inw = p.x, p.chunk_norm_weight, p.input_norm_weight
    rows = torch.tensor([3, 0, 4, 1])  # 4 is out of range (R = 4): a NaN row
    got = triton_fc.prepare_input(x, rows, cn, inw, 1e-6, rows.numel())
    want = reference.draft_fc_input_ref(x, rows, cn, inw, 1e-6, acc_dtype=torch.float64)
    assert torch.isnan(got[2]).all() and not torch.isnan(got[[0, 1, 3]]).any()
    ok = [0, 1, 3]
    err = ((got[ok].double() - want[ok]).abs() / want[ok].abs()).max().item()
    assert err <= 2 ** -8  # half a bf16 ulp (rounded to nearest) plus fp32 noise


@interpreter_only
@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_rows_per_program_never_change_a_bit(dtype, monkeypatch):
    """The row-wise kernels take up to 64 rows per program under the interpreter and one on a GPU
    (_rows_per_program): row scales, prepared inputs and split-K sums (an out-of-range row included)
    come out the same bits either way, and with a row count no power of two divides."""
    M = 37
    p = fc_problem(M, 80, 3, dtype, CPU, N=24, key=("rows-per-program",), bias=True, rows=True, chunk=True,
                   inorm=True)
    x, rows, cn, inw = p.x, p.rows.clone(), p.chunk_norm_weight, p.input_norm_weight
    rows[5] = x.shape[0]  # out of range: a NaN row
    args = (x, p.weight, p.bias, rows, cn, inw)

    def results():
        prob = triton_fc._problem(x, p.weight, rows, cn, inw)
        out = torch.empty(M, 24, dtype=dtype)
        with plans.forced_path("skinny"):  # two splits per chunk: the reducer runs
            assert triton_fc.plan(*args, split_len=64).partial_bytes > 0
            ws = torch.empty(triton_fc.draft_fc_workspace_bytes(*args, split_len=64), dtype=torch.uint8)
            triton_fc.draft_fc(*args, 1e-6, out, ws, split_len=64)
        return [triton_fc._row_scales(x, rows, cn, inw, 1e-6, prob), triton_fc.prepare_input(x, rows, cn, inw, 1e-6, M),
                out]

    assert triton_fc._rows_per_program(triton_fc._row_scales_kernel, M) == 64
    many = results()
    monkeypatch.setattr(triton_fc, "_rows_per_program", lambda kernel, m: 1)  # what a GPU launches
    one = results()
    for a, b in zip(many, one):
        assert same_bits(a, b)
    assert torch.isnan(many[2][5]).all() and not torch.isnan(many[2][[4, 6]]).any()


# ---- the interpreter shim ---------------------------------------------------------------------------------
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
    gen = testing.generator(CPU, "dot-probe", str(dtype))
    a, b = testing.randn((16, 16), dtype, CPU, gen), testing.randn((16, 16), dtype, CPU, gen)
    c = torch.empty(16, 16, dtype=torch.float32)
    _dot_probe[(1,)](a, b, c, INTERPRETER_BF16=flag, RAW=raw)
    return testing.rel_err(c, a.double() @ b.double(), normwise=True)


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


@interpreter_only
def test_raw_bf16_dot_is_wrong_under_the_interpreter():
    """Why the dot shim exists: Triton 3.8's interpreter multiplies bf16 bit patterns as integers."""
    assert _probe(torch.bfloat16, raw=True, flag=False) > 1.0


@interpreter_only
def test_shim_makes_bf16_dot_exact_under_the_interpreter():
    assert _probe(torch.bfloat16, raw=False, flag=shim.interpreter_bf16(_dot_probe, torch.bfloat16)) < 1e-6


@interpreter_only
def test_interpreter_fp16_dot_needs_no_shim():
    assert not shim.interpreter_bf16(_dot_probe, torch.float16)
    assert _probe(torch.float16, raw=True, flag=False) < 1e-6


# 1 + 2^-8 + 2^-9 rounds up, 1 + 2^-9 is a tie (rounds to even: down), 1 + 3*2^-9 a tie rounding up,
# -(1 + 2^-8 + 2^-9), a carry into the exponent (2 - 2^-9), NaN, inf, a large finite value.
CAST_VALUES = [1 + 2 ** -8 + 2 ** -9, 1 + 2 ** -9, 1 + 3 * 2 ** -9, -(1 + 2 ** -8 + 2 ** -9), 2 - 2 ** -9,
               float("nan"), float("inf"), 3.0e38, 1e-3]


@interpreter_only
def test_raw_bf16_cast_truncates_under_the_interpreter():
    """Why the cast shim exists: the interpreter truncates fp32 -> bf16 where a GPU rounds."""
    got, want = _cast(CAST_VALUES, raw=True)
    assert not same_bits(got[:5], want[:5])


@interpreter_only
def test_shim_rounds_bf16_casts_to_nearest_even_under_the_interpreter():
    got, want = _cast(CAST_VALUES, raw=False)
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)  # NaN stays NaN (its payload/sign bits may differ)
    assert same_bits(got[~nan], want[~nan])


@interpreter_only
def test_shim_is_inactive_for_compiled_kernels():
    for kernel in (_dot_probe, _cast_probe, triton_fc._skinny_kernel, triton_fc._tiled_kernel,
                   triton_capture._capture_kernel):
        compiled = triton.runtime.jit.JITFunction(kernel.fn)  # what @triton.jit gives without the interpreter
        assert shim.interpreted(kernel) and not shim.interpreted(compiled)
        assert not shim.interpreter_bf16(compiled, torch.bfloat16)


@interpreter_only
def test_capture_kernels_use_the_shared_shim_only_on_the_interpreter_and_only_for_bf16():
    """The capture module uses the one shared shim (no private copy); without it the interpreted
    capture kernel would truncate: 1 + 2^-8 + 2^-9 rounds up to 1 + 2^-7 in bf16."""
    assert triton_capture.cast is shim.cast and triton_capture.interpreter_bf16 is shim.interpreter_bf16
    assert shim.interpreter_bf16(triton_capture._capture_kernel, torch.bfloat16)
    assert not shim.interpreter_bf16(triton_capture._capture_kernel, torch.float16)
    h = torch.tensor([[1.0 + 2 ** -8 + 2 ** -9]], dtype=torch.float32)
    out = torch.empty(1, 1, dtype=torch.bfloat16)
    triton_capture._capture_kernel[(1, 1)](h, 1, h, 1, out, 1, 1, HAS_RESIDUAL=False, BLOCK=2, INTERPRETER_BF16=False)
    assert out.item() == 1.0  # truncated
    triton_capture._capture_kernel[(1, 1)](h, 1, h, 1, out, 1, 1, HAS_RESIDUAL=False, BLOCK=2, INTERPRETER_BF16=True)
    assert out.item() == 1.0 + 2 ** -7 == h.to(torch.bfloat16).item()


# ---- the GPU kernels compile for sm_90 and sm_120 (no GPU needed) -------------------------------------------
def _compile_report(script: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


_CAPTURE_COMPILE = textwrap.dedent('''
    import json, re
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from eagle3_ops.triton import capture as c

    def compile_kernel(kernel, cc, consts, num_warps, aligned):
        sig = {n: "constexpr" if n in consts else ("*bf16" if n.endswith("_ptr") else ("fp32" if n == "eps" else "i32"))
               for n in kernel.arg_names}
        # what the JIT infers for 16-byte aligned pointers and strides/H divisible by 16
        div = [n for n in kernel.arg_names if n not in consts and
               (n.endswith("_ptr") or (aligned and (n.endswith("_stride") or n == "H")))]
        attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in div}
        src = ASTSource(fn=kernel, signature=sig, attrs=attrs,
                        constexprs={(kernel.arg_names.index(n),): v for n, v in consts.items()})
        ptx = triton.compile(src, target=GPUTarget("cuda", cc, 32), options=dict(num_warps=num_warps)).asm["ptx"]
        return dict(ld_v4=len(re.findall(r"ld\\.global\\S*\\.v4\\.b32", ptx)),
                    st_v4=len(re.findall(r"st\\.global\\S*\\.v4\\.b32", ptx)),
                    st=len(re.findall(r"st\\.global", ptx)),
                    cvt_rn_bf16=bool(re.search(r"cvt\\.rn\\.bf16(x2)?\\.f32", ptx)),
                    shim_bits=bool(re.search(r"\\b(32767|0x7FFF|0x00007FFF)\\b", ptx)))

    off = dict(INTERPRETER_BF16=False)
    report = {}
    for cc in (90, 120):
        for aligned in (True, False):
            report[f"capture_sm{cc}_aligned{aligned}"] = compile_kernel(
                c._capture_kernel, cc, dict(off, HAS_RESIDUAL=True, BLOCK=2048), 8, aligned)
        report[f"row_sm{cc}"] = compile_kernel(c._fused_row_kernel, cc, dict(off, BLOCK=8192), 16, True)
        report[f"twopass_sm{cc}"] = compile_kernel(c._fused_two_pass_kernel, cc, dict(off, BLOCK=4096), 8, True)
    print(json.dumps(report))
''')


def test_capture_kernels_compile_for_sm90_and_sm120_with_16_byte_accesses():
    """The compiled kernels (not the interpreter's), bf16: aligned rows move 16-byte vectors (loads
    of input and residual, stores of every output), unaligned ones still compile (scalar), outputs
    are rounded to nearest even (cvt.rn), and the interpreter shim is compiled out."""
    report = _compile_report(_CAPTURE_COMPILE)
    for cc in (90, 120):
        aligned, odd = report[f"capture_sm{cc}_alignedTrue"], report[f"capture_sm{cc}_alignedFalse"]
        assert aligned["ld_v4"] >= 2 and aligned["st_v4"] >= 1 and aligned["st"] == aligned["st_v4"], aligned
        assert odd["ld_v4"] == 0 and odd["st"] > 0, odd
        for name in (f"row_sm{cc}", f"twopass_sm{cc}"):
            r = report[name]
            assert r["ld_v4"] >= 2 and r["st_v4"] >= 3 and r["st"] == r["st_v4"], (name, r)
            assert r["cvt_rn_bf16"], (name, r)
    for name, r in report.items():
        assert not r["shim_bits"], (name, "interpreter shim constant in GPU code")


_FC_COMPILE = textwrap.dedent('''
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
        return dict(shared=ck.metadata.shared,
                    mma=sorted(set(re.findall(r"(?:wgmma\\.mma_async|mma\\.sync)\\S*", ptx))),
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
        report[f"tiled_sm{cc}"] = compile_kernel(d._tiled_kernel, cc, dict(flags, **cfg), opts,
                                                 fp32_ptrs=("scale_ptr",))
        report[f"reduce_sm{cc}"] = compile_kernel(d._splitk_reduce_kernel, cc,
                                                  dict(HAS_ROWS=True, HAS_BIAS=True, BLOCK=1024, ROWS=1,
                                                       INTERPRETER_BF16=False),
                                                  dict(num_warps=4), fp32_ptrs=("ws_ptr",))
        for prep in (False, True):
            report[f"rows_sm{cc}_prep{prep}"] = compile_kernel(
                d._row_scales_kernel, cc, dict(HAS_ROWS=True, HAS_IN_NORM=True, HAS_CHUNK_NORM=True,
                                               WRITE_PREPARED=prep, BLOCK=1024, ROWS=1, INTERPRETER_BF16=False),
                dict(num_warps=4), fp32_ptrs=("scale_ptr",))
    print(json.dumps(report))
''')


def test_draft_fc_kernels_compile_for_sm90_and_sm120_with_bf16_mma_and_fitting_shared_memory():
    """The compiled kernels (not the interpreter's): bf16 operands reach the tensor cores unchanged
    (wgmma on sm_90, mma.sync on sm_120, i.e. the shim is off), weight tiles stream through 16-byte
    cp.async, and shared memory fits a block (227 KB sm_90, 99 KB sm_120)."""
    report = _compile_report(_FC_COMPILE)
    for name, r in report.items():
        limit = 227 * 1024 if "sm90" in name else 99 * 1024
        assert r["shared"] <= limit, (name, r)
        if name.startswith(("skinny", "tiled")):
            mma = " ".join(r["mma"])
            want = "wgmma.mma_async" if "sm90" in name else "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
            assert want in mma and ".bf16.bf16" in mma and "tf32" not in mma, (name, r)
            assert r["cp_async_16"], (name, r)


# ---- the face's scratch: per (device, stream), grow-only -----------------------------------------------
@pytest.fixture
def fresh_workspace():
    workspace.clear()
    yield
    workspace.clear()


def test_scratch_reuses_for_the_same_or_fewer_bytes_and_grows_for_more(fresh_workspace):
    a = workspace.scratch(CPU, 4096)  # a multiple of GRANULE: no slack
    assert a.dtype == torch.uint8 and a.dim() == 1 and a.numel() == 4096
    n = workspace.allocations
    b = workspace.scratch(CPU, 4096)
    c = workspace.scratch(CPU, 10)  # fewer bytes: the same memory
    assert a.data_ptr() == b.data_ptr() == c.data_ptr() and workspace.allocations == n
    assert workspace.buffer(CPU) is a
    d = workspace.scratch(CPU, 4097)  # one byte more: a new buffer, at least GROWTH times larger
    assert workspace.allocations == n + 1 and d.data_ptr() != a.data_ptr()
    assert d.numel() >= 4096 * workspace.GROWTH and d.numel() % workspace.GRANULE == 0
    assert workspace.retired() == []  # no capture saw the old buffer: it was simply dropped


def test_scratch_grows_by_the_growth_factor_so_a_slowly_rising_size_allocates_rarely(fresh_workspace):
    n = workspace.allocations
    for nbytes in range(1000, 100_000, 1000):  # 99 calls, each a little larger
        assert workspace.scratch(CPU, nbytes).numel() >= nbytes
    grown = workspace.allocations - n
    assert grown <= 2 + int(math.log(100, workspace.GROWTH)), grown  # ~ log_1.25(100) = 21 growths, not 99


def test_carver_hands_out_aligned_regions_and_refuses_to_overrun():
    ws = torch.empty(1024, dtype=torch.uint8)
    carver = workspace.Carver(ws)
    a = carver.take(3, torch.float32)  # 12 bytes -> a 256-byte region
    b = carver.take(10, BF16)
    assert a.numel() == 3 and a.dtype == torch.float32 and b.numel() == 10 and b.dtype == BF16
    assert a.data_ptr() == ws.data_ptr() and b.data_ptr() == ws.data_ptr() + workspace.ALIGN
    carver.take(512, torch.uint8)
    with pytest.raises(ValueError, match="workspace too small"):
        carver.take(1, torch.uint8)
    with pytest.raises(ValueError, match="workspace too small"):
        workspace.Carver(None).take(1, torch.float32)


def test_growth_during_graph_capture_is_allowed_and_captured_buffers_stay_alive(fresh_workspace, monkeypatch):
    """The policy: growth while capturing is allowed (graph pool); any buffer a capture has seen is
    never freed afterwards, since replays keep writing to its address. (CPU stand-in for a CUDA
    capture: the capture probe is patched; test_draft_fc.py runs the real thing on a GPU.)"""
    workspace.scratch(CPU, 400)  # eager warm-up, too small
    monkeypatch.setattr(workspace, "_capturing", lambda device: True)
    captured = workspace.scratch(CPU, 4000)  # grows inside the "capture": no error
    assert len(workspace.retired()) == 1  # the replaced buffer may already be in this capture
    monkeypatch.setattr(workspace, "_capturing", lambda device: False)
    again = workspace.scratch(CPU, 4000)
    assert again.data_ptr() == captured.data_ptr()  # eager calls reuse it
    workspace.scratch(CPU, 400_000)  # eager growth after the capture
    kept = workspace.retired()
    assert len(kept) == 2 and kept[-1].data_ptr() == captured.data_ptr()  # retired, not freed
    workspace.scratch(CPU, 4_000_000)  # a buffer no capture saw is not retired
    assert len(workspace.retired()) == 2


def test_threads_on_the_cpu_never_share_scratch(fresh_workspace):
    """On the CPU (the interpreter runs kernels in the calling thread) each thread has its own."""
    mine = workspace.scratch(CPU, 2048)
    seen = {}

    def other():
        seen["buf"] = workspace.scratch(CPU, 2048)
        seen["grown"] = workspace.scratch(CPU, 100_000)

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert seen["buf"].data_ptr() != mine.data_ptr()
    assert workspace.buffer(CPU) is mine, "another thread's growth replaced this thread's scratch"


@pytest.mark.parametrize("dev", [pytest.param("cpu", id="cpu-stream-key-patched"),
                                 pytest.param("cuda", marks=pytest.mark.gpu, id="cuda-streams")])
def test_two_streams_never_share_scratch(dev, fresh_workspace, monkeypatch):
    """Scratch is keyed by (device, stream): a call on another stream gets another buffer, and its
    growth leaves the first stream's buffer alone. GPU: two real streams; CPU twin: the stream key
    patched to two stream ids (the CPU has no streams)."""
    if dev == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
        streams = [torch.cuda.Stream(), torch.cuda.Stream()]
        on = lambda i: torch.cuda.stream(streams[i])  # noqa: E731
    else:
        device = CPU
        current = {"id": 0}
        monkeypatch.setattr(workspace, "_stream_key", lambda d: (d, 1000 + current["id"]))

        class on:  # noqa: N801
            def __init__(self, i):
                self.i = i

            def __enter__(self):
                current["id"] = self.i

            def __exit__(self, *exc):
                current["id"] = 0
    with on(0):
        first = workspace.scratch(device, 4096)
        assert workspace.scratch(device, 100).data_ptr() == first.data_ptr()  # same stream: reused
    with on(1):
        second = workspace.scratch(device, 4096)
        assert second.data_ptr() != first.data_ptr()
        workspace.scratch(device, 1 << 20)  # grows stream 1's only
    with on(0):
        assert workspace.buffer(device) is first


def _face_cases(target):
    return list(testing.FC_PATHS[target.backend])


@pytest.mark.parametrize("target,path", params([t for t in testing.TARGETS if t.backend != "reference"], _face_cases))
def test_face_reuses_its_scratch_and_grows_only_for_a_larger_problem(target, path, device, fresh_workspace):
    """draft_fc_out without ``workspace=`` draws on the face's scratch of the current stream: the
    same or a smaller problem reuses it (no allocation), a larger one grows it once."""
    H = 4096 if target.gpu else 80

    def run(M, N, key):
        p = fc_problem(M, H, 3, BF16, device, N=N, key=key, **VARIANTS["all"])
        with plans.forced_path(path):
            out = p.run_out(p.out())
            need = eagle3_ops.draft_fc_workspace_bytes(*p.args)
        assert_close(out, p.truth(), MATMUL_TOL[BF16], normwise=True)  # reused scratch, right result
        return need

    N = 512 if target.gpu else 72
    need = run(9, N, ("warm",))
    warm, n = workspace.buffer(device), workspace.allocations
    assert warm is not None and warm.numel() >= need > 0
    run(9, N, ("again",))  # same problem, new data
    run(3, N - 8, ("smaller",))
    assert workspace.buffer(device) is warm and workspace.allocations == n
    bigger = run(64, 2 * N, ("larger",))
    assert bigger > warm.numel(), "test problem does not need more scratch"
    assert workspace.allocations == n + 1 and workspace.buffer(device).numel() >= bigger


# ---- dispatch: backend choice, forcing, verification -----------------------------------------------------
@pytest.fixture
def fresh_verification():
    """These tests plant broken backends: forget every verification result before and after."""
    dispatch.reset_verification()
    yield
    dispatch.reset_verification()


def _broken_capture(hidden, residual, buffer, slot):
    reference.capture(hidden, residual, buffer, slot)
    buffer[0, slot * hidden.shape[1]] += 1.0  # one wrong element


def test_cpu_uses_reference_by_default(fresh_verification):
    assert eagle3_ops.backends("cpu") == {"capture": "reference", "fused_add_rmsnorm_capture": "reference",
                                          "draft_fc": "reference"}


def test_forced_reference_is_reported(fresh_verification, monkeypatch):
    monkeypatch.setenv("EAGLE3_OPS_BACKEND", "reference")
    assert set(eagle3_ops.backends("cpu").values()) == {"reference"}


def test_forced_backend_that_cannot_serve_raises(monkeypatch):
    monkeypatch.setenv("EAGLE3_OPS_BACKEND", "cuda")
    buf = torch.zeros(5, 3 * 64)
    with pytest.raises(RuntimeError, match="EAGLE3_OPS_BACKEND=cuda cannot serve device cpu"):
        eagle3_ops.capture(torch.randn(5, 64), None, buf, 0)
    assert torch.equal(buf, torch.zeros(5, 3 * 64))


def test_unknown_backend_name_raises(monkeypatch):
    monkeypatch.setenv("EAGLE3_OPS_BACKEND", "cublas")
    with pytest.raises(ValueError, match="EAGLE3_OPS_BACKEND='cublas' is not valid"):
        eagle3_ops.capture(torch.randn(5, 64), None, torch.zeros(5, 3 * 64), 0)


def test_verification_rejects_a_wrong_kernel_and_logs_loudly(fresh_verification, caplog):
    with caplog.at_level(logging.ERROR, logger="eagle3_ops"):
        assert not dispatch._passes_verification("capture", "triton", CPU, _broken_capture)
    assert "FAILED verification" in caplog.text and "capture" in caplog.text and "cpu" in caplog.text
    # the result is remembered for the process: no second check, still disabled
    assert not dispatch._passes_verification("capture", "triton", CPU, reference.capture)


def test_verification_rejects_a_kernel_that_writes_outside_its_slot(fresh_verification):
    def spills(hidden, residual, buffer, slot):
        reference.capture(hidden, residual, buffer, slot)
        buffer[hidden.shape[0], 0] = 0.0  # canary row after T
    assert not dispatch._passes_verification("capture", "triton", CPU, spills)


def test_verification_rejects_a_crashing_kernel(fresh_verification):
    def crashes(*args):
        raise RuntimeError("no kernel image is available for execution on the device")
    assert not dispatch._passes_verification("draft_fc", "cuda", CPU, crashes)


@pytest.mark.parametrize("op", ["capture", "fused_add_rmsnorm_capture", "draft_fc"])
def test_verification_accepts_a_correct_kernel(op, fresh_verification):
    assert dispatch._passes_verification(op, "triton", CPU, getattr(reference, op))


def test_failed_backend_falls_back_to_next(fresh_verification, monkeypatch, caplog):
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
    assert backend == "reference" and fn is reference.capture
    assert "FAILED verification" in caplog.text
    buf = torch.zeros(2, 8)
    eagle3_ops.capture(torch.ones(2, 4), None, buf, 1)  # and the op itself still computes right
    assert torch.equal(buf[:, 4:], torch.ones(2, 4)) and torch.equal(buf[:, :4], torch.zeros(2, 4))


def test_forced_backend_failing_verification_raises(fresh_verification, monkeypatch):
    monkeypatch.setenv("EAGLE3_OPS_BACKEND", "triton")
    monkeypatch.setattr(dispatch, "implementation", lambda b, op, d: _broken_capture)
    with pytest.raises(RuntimeError, match="failed verification"):
        dispatch.select("capture", CPU)


def test_verification_can_be_turned_off(fresh_verification, monkeypatch):
    monkeypatch.setenv("EAGLE3_OPS_VERIFY", "0")
    assert dispatch._passes_verification("capture", "triton", CPU, _broken_capture)


def test_verification_is_per_dtype(fresh_verification):
    """A kernel that is wrong only for fp16 passes in bf16 and is caught at its first fp16 use."""
    def wrong_in_fp16(hidden, residual, buffer, slot):
        reference.capture(hidden, residual, buffer, slot)
        if hidden.dtype == torch.float16:
            buffer[0, slot * hidden.shape[1]] += 1.0
    assert dispatch._passes_verification("capture", "triton", CPU, wrong_in_fp16, torch.bfloat16)
    assert dispatch._passes_verification("capture", "triton", CPU, wrong_in_fp16, torch.float32)
    assert not dispatch._passes_verification("capture", "triton", CPU, wrong_in_fp16, torch.float16)


def test_backend_first_used_in_graph_capture_that_later_fails_raises(fresh_verification, monkeypatch):
    """Graphs captured with an unverified backend keep replaying it: if the first eager check then
    fails, switching eager calls to another backend would differ silently, so it raises."""
    gpu = torch.device("cuda", 0)  # never touched: capture state and the check are stubbed
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "stub GPU")
    assert dispatch._passes_verification("capture", "cuda", gpu, _broken_capture)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    failing = dataclasses.replace(registry.OPS["capture"], selfcheck=lambda *a, **k: (False, "max rel err 1"))
    monkeypatch.setitem(registry.OPS, "capture", failing)
    with pytest.raises(dispatch.BackendUnavailableError, match="after CUDA graphs were captured"):
        dispatch._passes_verification("capture", "cuda", gpu, _broken_capture)
