"""The Triton capture kernels under the interpreter, on the layouts the shared grid
(test_ops_reference.py) does not reach: H not a multiple of the vector width, odd row strides,
unaligned views, a row spread over several programs, and the fused op's two-pass path.

Every case runs through the public op with EAGLE3_OPS_BACKEND=triton and is compared with the
reference on the same inputs: capture, the stored residual and the captured slot must be bitwise
equal (one fp32 add, one rounding); the normed output may differ only by the order of the fp32
sum of squares (at most one unit in the last place of the dtype).
"""
import textwrap

import pytest
import torch
import triton

import eagle3_ops
from eagle3_ops import reference
from eagle3_ops.triton import _interpreter_shim as shim
from eagle3_ops.triton import capture as triton_capture
from helpers import DTYPES, assert_only_region_written, backends_for, same_bits

pytestmark = pytest.mark.skipif("triton" not in backends_for("capture"),
                                reason="Triton kernels need a GPU or TRITON_INTERPRET=1 (set by conftest on CPU)")


@pytest.fixture(autouse=True)
def _triton_backend(monkeypatch):
    monkeypatch.setenv("EAGLE3_OPS_BACKEND", "triton")
    # Each test compares with the reference itself; the one-time dispatch check (tested in
    # test_dispatch.py) would rerun in every test here (conftest resets it) and triple the time.
    monkeypatch.setenv("EAGLE3_OPS_VERIFY", "0")


def _strided(T, H, dtype, gen, row_pad=0, col_offset=0):
    """[T, H] view with row stride H + row_pad, starting col_offset elements into its base."""
    base = torch.randn(T, H + row_pad + col_offset, generator=gen).to(dtype)
    return base[:, col_offset:col_offset + H]


def _buffer(T, K, H, dtype, gen, extra_rows=2, row_pad=3, col_offset=0):
    base = torch.randn(T + extra_rows, col_offset + K * H + row_pad, generator=gen).mul_(100).to(dtype)
    base[::5, ::3] = float("nan")
    return base, base[:, col_offset:col_offset + K * H]


def _within_rounding(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Elementwise |got - want| <= one unit in the last place of ``want``'s dtype at |want|, plus
    8 fp32 ulps for the summation order of the sum of squares (what fp32 outputs differ by)."""
    g, w = got.double(), want.double()
    ulp = (torch.finfo(want.dtype).eps + 8 * 2.0 ** -23) * w.abs() + torch.finfo(want.dtype).tiny
    return bool(((g - w).abs() <= ulp).all())


# (T, H, hidden row pad, buffer row pad, view offset): odd H, odd strides, unaligned views
CAPTURE_LAYOUTS = [
    (5, 37, 0, 3, 0),
    (3, 37, 1, 0, 1),
    (4, 1001, 3, 5, 3),
    (2, 8, 1, 1, 1),
    (6, 13, 0, 0, 0),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "no_residual"])
@pytest.mark.parametrize("T,H,hpad,bpad,offset", CAPTURE_LAYOUTS)
def test_capture_handles_odd_sizes_and_strides(T, H, hpad, bpad, offset, with_residual, dtype):
    gen = torch.Generator().manual_seed(T * 131 + H + hpad + offset)
    K, slot = 3, 1
    hidden = _strided(T, H, dtype, gen, row_pad=hpad, col_offset=offset)
    residual = _strided(T, H, dtype, gen, row_pad=hpad + 1, col_offset=offset) if with_residual else None
    base, buffer = _buffer(T, K, H, dtype, gen, row_pad=bpad, col_offset=offset)
    want_base = base.clone()
    reference.capture_ref(hidden, residual, want_base[:, offset:offset + K * H], slot)
    before = base.clone()
    eagle3_ops.capture(hidden, residual, buffer, slot)
    assert same_bits(base, want_base)
    assert_only_region_written(before, base, slice(0, T), slice(offset + slot * H, offset + (slot + 1) * H))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_capture_row_spread_over_several_programs(dtype, monkeypatch):
    """A row wider than one program's block: the column chunks tile it with no gap or overlap."""
    monkeypatch.setattr(triton_capture, "CAPTURE_BLOCK", 64)
    gen = torch.Generator().manual_seed(11)
    T, H, K = 3, 64 * 3 + 5, 2
    hidden = _strided(T, H, dtype, gen, row_pad=1)
    residual = _strided(T, H, dtype, gen)
    base, buffer = _buffer(T, K, H, dtype, gen)
    want = base.clone()
    reference.capture_ref(hidden, residual, want[:, :K * H], 1)
    eagle3_ops.capture(hidden, residual, buffer, 1)
    assert same_bits(base, want)


def _fused_both(T, H, dtype, gen, in_pad=0, res_pad=0, offset=0, K=2, slot=1):
    """Run the Triton op and the reference on identical copies; return (ours, reference) tuples."""
    x = _strided(T, H, dtype, gen, row_pad=in_pad, col_offset=offset)
    r = _strided(T, H, dtype, gen, row_pad=res_pad, col_offset=offset)
    w = (torch.rand(H, generator=gen) + 0.5).to(dtype)
    base, buffer = _buffer(T, K, H, dtype, gen, col_offset=offset)
    x2, r2, base2 = x.clone(), r.clone(), base.clone()
    before = base.clone()
    eagle3_ops.fused_add_rmsnorm_capture(x, r, w, 1e-5, buffer, slot)
    reference.fused_add_rmsnorm_capture_ref(x2, r2, w, 1e-5, base2[:, offset:offset + K * H], slot)
    assert_only_region_written(before, base, slice(0, T), slice(offset + slot * H, offset + (slot + 1) * H))
    return (x, r, base), (x2, r2, base2)


# (T, H, input row pad, residual row pad, view offset)
FUSED_LAYOUTS = [
    (4, 37, 0, 0, 0),
    (3, 1001, 1, 3, 0),
    (5, 200, 2, 1, 1),
    (9, 64, 0, 0, 0),  # nine rows: nine programs
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T,H,in_pad,res_pad,offset", FUSED_LAYOUTS)
def test_fused_handles_odd_sizes_and_strides(T, H, in_pad, res_pad, offset, dtype):
    gen = torch.Generator().manual_seed(T * 17 + H + in_pad)
    (x, r, base), (x2, r2, base2) = _fused_both(T, H, dtype, gen, in_pad, res_pad, offset)
    assert same_bits(r, r2), "stored residual != round(fp32 sum)"
    assert same_bits(base, base2), "captured slot (or a canary) differs"
    assert _within_rounding(x, x2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("H", [200, 64 * 4])
def test_fused_two_pass_path_matches_reference(H, dtype, monkeypatch):
    """Rows wider than MAX_ROW_BLOCK take the two-pass kernel (sum of squares, then re-read and
    write); a small limit sends small rows there, with a masked last chunk for H=200."""
    monkeypatch.setattr(triton_capture, "MAX_ROW_BLOCK", 64)

    class _MustNotLaunch:
        def __getitem__(self, grid):
            raise AssertionError("the one-pass row kernel was launched for a row wider than MAX_ROW_BLOCK")

    monkeypatch.setattr(triton_capture, "_fused_row_kernel", _MustNotLaunch())
    gen = torch.Generator().manual_seed(H)
    (x, r, base), (x2, r2, base2) = _fused_both(4, H, dtype, gen, in_pad=1, res_pad=2)
    assert same_bits(r, r2)
    assert same_bits(base, base2)
    assert _within_rounding(x, x2)


def test_interpreter_bf16_shim_is_needed_and_only_on_the_interpreter():
    """The shim exists because the interpreter truncates fp32 -> bf16 (the compiled kernel rounds
    to nearest even); it is switched on only for interpreted kernels and bf16 outputs."""
    from triton.runtime.interpreter import InterpretedFunction

    assert isinstance(triton_capture._capture_kernel, InterpretedFunction)
    # the capture module uses the one shared shim (no private copy of it)
    assert triton_capture.cast is shim.cast and triton_capture.interpreter_bf16 is shim.interpreter_bf16
    assert shim.interpreter_bf16(triton_capture._capture_kernel, torch.bfloat16)
    assert not shim.interpreter_bf16(triton_capture._capture_kernel, torch.float16)
    compiled = triton.runtime.jit.JITFunction(triton_capture._capture_kernel.fn)  # no interpreter
    assert not shim.interpreter_bf16(compiled, torch.bfloat16)
    # Without the shim the interpreter would truncate: 1 + 2^-8 + 2^-9 rounds up to 1 + 2^-7 in bf16.
    h = torch.tensor([[1.0 + 2 ** -8 + 2 ** -9]], dtype=torch.float32)
    out = torch.empty(1, 1, dtype=torch.bfloat16)
    triton_capture._capture_kernel[(1, 1)](h, 1, h, 1, out, 1, 1, HAS_RESIDUAL=False, BLOCK=2,
                                           INTERPRETER_BF16=False)
    assert out.item() == 1.0  # truncated
    triton_capture._capture_kernel[(1, 1)](h, 1, h, 1, out, 1, 1, HAS_RESIDUAL=False, BLOCK=2,
                                           INTERPRETER_BF16=True)
    assert out.item() == 1.0 + 2 ** -7 == h.to(torch.bfloat16).item()


# ---- the GPU kernels compile for sm_90 and sm_120 (no GPU needed) ----------------------------------
_COMPILE_CHECK = textwrap.dedent('''
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


def test_gpu_kernels_compile_for_sm90_and_sm120_with_16_byte_accesses():
    """The compiled kernels (not the interpreter's), bf16: aligned rows move 16-byte vectors (loads
    of input and residual, stores of every output), unaligned ones still compile (scalar), outputs
    are rounded to nearest even (cvt.rn), and the interpreter shim is compiled out."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", _COMPILE_CHECK], capture_output=True, text=True, env=env, cwd=root,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
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
