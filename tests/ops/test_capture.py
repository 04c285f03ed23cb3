"""capture: ``buffer[:T, slot*H:(slot+1)*H] = hidden + residual`` (or ``hidden``), fp32 add, one
rounding; nothing else changes.

Every numerics test runs on every target (``eagle3_ops.testing``): the reference and the
interpreted Triton kernels on the CPU (small shapes for the interpreter), and the CUDA, Triton and
reference backends on a GPU (``gpu`` mark; model-sized shapes). Each checks the slot against the
float64 truth (one rounding), the whole buffer bitwise against the reference backend (the contract
is exact: one fp32 add, one rounding), and the canaries around the slot (poisoned buffer: rows
after T, the neighbouring slots, padding columns). Argument validation runs once, on the CPU.
"""
import itertools

import pytest
import torch
try:  # a test dependency (make deps); the GPU device check may run without it (the property test then skips)
    from hypothesis import HealthCheck, given, settings, strategies as st
except ImportError:
    given = None

import eagle3_ops
from eagle3_ops import reference
import op_testing as testing
from op_testing import (DTYPES, ROUNDING_TOL, TARGETS, TRITON_TARGETS,
                                assert_close, capture_problem, params, same_bits)
from eagle3_ops.validation import Eagle3ArgumentError

GPU_T = (1, 3, 64, 1000, 8192)
GPU_H = (2048, 4096, 5120, 7168, 8192, 7000)


def grid(target):
    """(T, H, K, slot): the full grid on the reference (CPU), a small one for the interpreter, the
    model-sized one on a GPU (K = 3, the middle slot: both neighbours are canaries)."""
    if target == testing.REFERENCE_CPU:
        return [(T, H, K, T % K) for T, H, K in itertools.product((0, 1, 7, 64, 300), (64, 256, 4096), (1, 2, 3, 4))]
    if target == testing.TRITON_CPU:
        return [(T, H, K, T % K) for T, H, K in [(0, 64, 1), (1, 64, 3), (7, 72, 2), (5, 40, 4), (64, 256, 3)]]
    if target.backend == "reference":  # on a GPU: the reference is the yardstick, a few shapes suffice
        return [(64, 4096, 3, 1), (3, 7000, 3, 1)]
    return [(T, H, 3, 1) for H in GPU_H for T in GPU_T]


def check_capture(p):
    """The op on p (canaried) vs float64 (one rounding) and vs the reference backend (bitwise)."""
    want = p.clone()
    want.run(reference.capture)
    p.run_canaried()
    assert_close(p.slot_view, p.sum64(), ROUNDING_TOL[p.hidden.dtype], what="captured slot")
    assert same_bits(p.buffer._base, want.buffer._base), "buffer differs from the reference backend's"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "no_residual"])
@pytest.mark.parametrize("target,T,H,K,slot", params(TARGETS, grid))
def test_capture_matches_fp64_and_writes_only_its_slot(target, T, H, K, slot, with_residual, dtype, device):
    # 16 padding columns keep GPU buffer rows 16-byte aligned (the vector path); 5 on the CPU (odd)
    check_capture(capture_problem(T, H, K, dtype, device, slot=slot, residual=with_residual,
                                  buffer_pad=16 if target.gpu else 5))


def layouts(target):
    """(T, H, hidden row pad, residual row pad, buffer row pad, hidden view offset, buffer view offset):
    H not a multiple of the vector width, odd row strides, unaligned views, co-aligned or not."""
    if not target.gpu:
        return [(5, 37, 0, 1, 3, 0, 0), (3, 37, 1, 2, 0, 1, 1), (4, 1001, 3, 4, 5, 3, 3), (2, 8, 1, 2, 1, 1, 1),
                (6, 13, 0, 1, 0, 0, 0)]
    return [
        (3, 7001, 1, 1, 3, 1, 1),     # odd H, odd strides
        (1000, 4095, 0, 0, 5, 0, 0),  # H 4095, many rows
        (5, 13, 1, 1, 1, 1, 0),       # tiny H
        (64, 8192, 0, 0, 0, 1, 1),    # co-aligned unaligned views: a vector body after a scalar head
        (64, 8192, 0, 0, 0, 1, 0),    # not co-aligned: element by element
        (3, 4096, 8, 8, 8, 0, 0),     # padded strides, aligned
    ]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "no_residual"])
@pytest.mark.parametrize("target,T,H,hpad,rpad,bpad,h_off,b_off", params(TARGETS, layouts))
def test_capture_odd_sizes_strides_and_views(target, T, H, hpad, rpad, bpad, h_off, b_off, with_residual, dtype,
                                             device):
    check_capture(capture_problem(T, H, 3, dtype, device, slot=1, residual=with_residual, hidden_pad=hpad,
                                  residual_pad=rpad, offset=h_off, buffer_pad=bpad, buffer_offset=b_off))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("target", params(TRITON_TARGETS))
def test_triton_row_spread_over_several_programs(target, dtype, device, monkeypatch):
    """A row wider than one program's block: the column chunks tile it with no gap or overlap."""
    from eagle3_ops.triton import capture as triton_capture

    monkeypatch.setattr(triton_capture, "CAPTURE_BLOCK", 64)
    check_capture(capture_problem(3, 64 * 3 + 5, 2, dtype, device, slot=1, hidden_pad=1, residual_pad=0))


# ---- a CUDA graph of three captures (CPU twin: the same calls, replayed eagerly) -------------------
class ThreeCaptures:
    """Slot 0: capture(hidden + residual); slot 1: fused add-RMSNorm capture; slot 2: capture(hidden)."""

    def __init__(self, T, H, dtype, device, key):
        gen = testing.generator(device, "three", T, H, str(dtype), *key)
        rand = lambda: testing.randn((T, H), dtype, device, gen)  # noqa: E731
        self.h0, self.r0, self.x1, self.r1, self.h2 = rand(), rand(), rand(), rand(), rand()
        self.w = testing.positive((H,), dtype, device, gen)
        self.buffer = torch.full((T, 3 * H), float("nan"), dtype=dtype, device=device)

    def inputs(self):
        return (self.h0, self.r0, self.x1, self.r1, self.h2)

    def run(self):
        eagle3_ops.capture(self.h0, self.r0, self.buffer, 0)
        eagle3_ops.fused_add_rmsnorm_capture(self.x1, self.r1, self.w, testing.EPS, self.buffer, 1)
        eagle3_ops.capture(self.h2, None, self.buffer, 2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("target,T,H",
                         params(TARGETS, lambda t: [(64, 4096), (3, 7000)] if t.gpu else [(5, 64), (3, 37)]))
def test_three_captures_replay_like_eager_without_allocating(target, T, H, dtype, device):
    graph_side, eager_side = ThreeCaptures(T, H, dtype, device, ()), ThreeCaptures(T, H, dtype, device, ())
    replay = testing.Replay(graph_side.run, device)  # GPU: eager warm-up on a side stream, then capture
    assert replay.allocations_during_capture == 0, "allocations while capturing the graph"
    before = testing.allocation_count(device)
    graph_side.run()  # eager, after warm-up: the ops themselves allocate nothing
    assert testing.allocation_count(device) == before, "an eager call allocated memory"
    gen = testing.generator(device, "three-new", T, H, str(dtype))
    for trial in range(3):  # new inputs each time, copied into the graph's static tensors
        for g_t, e_t in zip(graph_side.inputs(), eager_side.inputs()):
            fresh = testing.randn(g_t.shape, dtype, device, gen)
            g_t.copy_(fresh)
            e_t.copy_(fresh)
        graph_side.buffer.fill_(float("nan"))
        eager_side.buffer.fill_(float("nan"))
        count = testing.allocation_count(device)
        allocated = torch.cuda.memory_allocated() if target.gpu else 0
        replay.replay()
        assert testing.allocation_count(device) == count, "replay allocated memory"
        assert (torch.cuda.memory_allocated() if target.gpu else 0) == allocated, "replay allocated memory"
        eager_side.run()
        if target.gpu:
            torch.cuda.synchronize()
        assert not torch.isnan(graph_side.buffer).any(), f"trial {trial}: replay left part of the buffer unwritten"
        assert same_bits(graph_side.buffer, eager_side.buffer), f"trial {trial}: replayed buffer != eager"
        assert same_bits(graph_side.x1, eager_side.x1) and same_bits(graph_side.r1, eager_side.r1), \
            f"trial {trial}: replayed fused outputs != eager"


# ---- properties (hypothesis) -------------------------------------------------------------------------
if given is not None:
    @pytest.mark.parametrize("target", params(TARGETS))
    @settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(T=st.integers(0, 20), H=st.integers(1, 70), K=st.integers(1, 4), pad=st.integers(0, 9),
           extra_rows=st.integers(0, 3), data=st.data())
    def test_capture_property(target, device, T, H, K, pad, extra_rows, data):
        """Random shapes, strides, slots and dtypes: the buffer is bitwise what the reference makes of
        it, and only the slot changed."""
        slot = data.draw(st.integers(0, K - 1))
        dtype = data.draw(st.sampled_from(DTYPES))
        gen = torch.Generator().manual_seed(T * 7919 + H * 31 + K)
        hidden = torch.randn(T, H + pad, generator=gen).to(device, dtype)[:, :H]  # row stride H + pad
        residual = torch.randn(T, H, generator=gen).to(device, dtype) if data.draw(st.booleans()) else None
        base = torch.randn(T + extra_rows, K * H + pad, generator=gen).to(device, dtype)
        buffer = base[:, :K * H]
        want = base.clone()
        reference.capture(hidden, residual, want[:, :K * H], slot)
        testing.run_canaried(lambda: eagle3_ops.capture(hidden, residual, buffer, slot),
                             [buffer[:T, slot * H:(slot + 1) * H]])
        assert same_bits(base, want)
else:
    @pytest.mark.parametrize("target", params(TARGETS))
    def test_capture_property(target):
        pytest.skip("hypothesis is not installed (a test dependency: make deps)")


# ---- opcheck -----------------------------------------------------------------------------------------
def capture_samples(device):
    gen = torch.Generator().manual_seed(0)
    for T, H, K, with_res in ((1, 64, 1, True), (7, 64, 3, False), (33, 128, 2, True)):
        h = torch.randn(T, H, generator=gen).to(device)
        r = torch.randn(T, H, generator=gen).to(device) if with_res else None
        yield h, r, torch.randn(T + 2, K * H, generator=gen).to(device), K - 1


@pytest.mark.parametrize("sample", range(3))
@pytest.mark.parametrize("target", params(TARGETS))
def test_opcheck(target, sample, device):
    """torch.library.opcheck: schema, fake impl, aliasing, autograd registration, AOT dispatch."""
    torch.library.opcheck(torch.ops.eagle3.capture.default, list(capture_samples(device))[sample])


# ---- argument validation (once, on the CPU: it runs before any backend) ------------------------------
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
def test_rejects_bad_input_before_writing(case):
    over, message = CAPTURE_BAD[case]
    args = _capture_args(**over)
    buf = args["buffer"]
    snapshot = buf.clone()
    with pytest.raises(ValueError, match=message) as info:
        eagle3_ops.capture(**args)
    assert isinstance(info.value, Eagle3ArgumentError)
    assert "eagle3::capture" in str(info.value)
    assert same_bits(buf, snapshot), "buffer changed although the call was rejected"

