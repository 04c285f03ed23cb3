"""GPU checks of the capture kernels, both accelerated backends (cuda, triton) against the reference.

Marker ``gpu``: skipped without CUDA (CI), run by ``benchmarks/device_check.sh`` on a GPU machine.
A forced backend that cannot serve (e.g. the extension was not built for this GPU) makes the test
fail, not skip: the device check must prove the CUDA path, not quietly test Triton twice.

What is checked:
* capture: the whole poisoned buffer (canary rows after T, the neighbouring slots, padding columns
  after the K*H row) is bitwise what the reference makes of it (fp32 add, one rounding).
* fused_add_rmsnorm_capture: the stored residual and the buffer (slot + canaries) are bitwise the
  reference's; the normed output is within one rounding of the float64 truth.
* the odd layouts (H not a multiple of 8, odd row strides, unaligned views, co-aligned or not),
  the two-pass path of the fused kernels (rows wider than the registers hold) and the T >= 256
  launch shape.
* a CUDA graph of three captures into one buffer, replayed with new inputs, equals eager, and
  neither capturing nor replaying allocates (caching-allocator stats before/after).
"""
import zlib

import pytest
import torch

import eagle3_ops
from eagle3_ops import reference
from helpers import DTYPES

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
GPU_BACKENDS = ("cuda", "triton")
H_VALUES = (2048, 4096, 5120, 7168, 8192, 7000)
T_VALUES = (1, 3, 64, 1000, 8192)
K, SLOT = 3, 1  # the middle slot: both neighbours are canaries
PAD_ROWS = 2  # buffer rows after T (R > T): must stay untouched
PAD_COLS = 16  # columns after K*H in each buffer row; 16 keeps the row stride vector-friendly
EPS = 1e-6


@pytest.fixture
def use_backend(monkeypatch):
    def use(name):
        monkeypatch.setenv("EAGLE3_OPS_BACKEND", name)
    return use


def gen_for(*key):
    """A generator seeded from the test's parameters (stable across processes, unlike hash())."""
    return torch.Generator(device=DEVICE).manual_seed(zlib.crc32(repr(key).encode()))


def randn(shape, dtype, gen, scale=1.0):
    return (torch.randn(shape, generator=gen, device=DEVICE, dtype=torch.float32) * scale).to(dtype)


def strided(T, H, dtype, gen, row_pad=0, offset=0, scale=1.0):
    """[T, H] view with row stride H + row_pad + offset, starting ``offset`` elements into its base."""
    return randn((T, H + row_pad + offset), dtype, gen, scale)[:, offset:offset + H]


def poisoned(rows, cols, dtype, gen):
    """Random garbage with NaNs: any stray write shows up bitwise."""
    base = randn((rows, cols), dtype, gen, scale=1000.0)
    base[::7, ::3] = float("nan")
    return base


def bits(t):
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def same_bits(a, b):
    return a.shape == b.shape and torch.equal(bits(a), bits(b))


def assert_within_rounding(got, want64, dtype):
    """|got - truth| <= one unit in the last place of dtype (+ fp32 summation-order slack)."""
    slack = torch.finfo(dtype).eps + 4e-6
    err = (got.double() - want64).abs()
    bad = err > slack * want64.abs() + 1e-30
    assert not torch.isnan(got).any(), "NaN in the output (unwritten element?)"
    assert not bad.any(), f"{int(bad.sum())} elements off by more than one rounding; max err {err.max().item():.3g}"


# ---- capture -------------------------------------------------------------------------------------
def check_capture(T, H, dtype, with_residual, gen, hpad=0, bpad=PAD_COLS, h_offset=0, b_offset=0):
    hidden = strided(T, H, dtype, gen, row_pad=hpad, offset=h_offset)
    residual = strided(T, H, dtype, gen, row_pad=hpad, offset=h_offset) if with_residual else None
    base = poisoned(T + PAD_ROWS, b_offset + K * H + bpad, dtype, gen)
    want = base.clone()
    reference.capture_ref(hidden, residual, want[:, b_offset:b_offset + K * H], SLOT)
    eagle3_ops.capture(hidden, residual, base[:, b_offset:b_offset + K * H], SLOT)
    torch.cuda.synchronize()
    assert same_bits(base, want), "buffer differs from the reference (slot value or a canary)"


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "no_residual"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("H", H_VALUES)
@pytest.mark.parametrize("T", T_VALUES)
def test_capture_matches_reference(T, H, dtype, with_residual, backend, use_backend):
    use_backend(backend)
    check_capture(T, H, dtype, with_residual, gen_for("capture", T, H, str(dtype), with_residual))


# (T, H, hidden row pad, buffer row pad, hidden view offset, buffer view offset)
ODD_CAPTURE_LAYOUTS = [
    pytest.param(3, 7001, 1, 3, 1, 1, id="odd-H-odd-strides"),
    pytest.param(1000, 4095, 0, 5, 0, 0, id="H-4095-many-rows"),
    pytest.param(5, 13, 1, 1, 1, 0, id="tiny-H"),
    pytest.param(64, 8192, 0, 0, 1, 1, id="co-aligned-unaligned-views"),  # vector body after a scalar head
    pytest.param(64, 8192, 0, 0, 1, 0, id="not-co-aligned"),  # element by element
    pytest.param(3, 4096, 8, 8, 0, 0, id="padded-strides-aligned"),
]


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "no_residual"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T,H,hpad,bpad,h_offset,b_offset", ODD_CAPTURE_LAYOUTS)
def test_capture_odd_layouts(T, H, hpad, bpad, h_offset, b_offset, dtype, with_residual, backend, use_backend):
    use_backend(backend)
    check_capture(T, H, dtype, with_residual, gen_for("odd", T, H, hpad, h_offset, str(dtype)),
                  hpad=hpad, bpad=bpad, h_offset=h_offset, b_offset=b_offset)


# ---- fused_add_rmsnorm_capture -------------------------------------------------------------------
def check_fused(T, H, dtype, gen, pad=0, offset=0, bpad=PAD_COLS):
    x = strided(T, H, dtype, gen, row_pad=pad, offset=offset)
    r = strided(T, H, dtype, gen, row_pad=pad + 1 if pad else 0, offset=offset, scale=3.0)
    w = (torch.rand(H, generator=gen, device=DEVICE) + 0.5).to(dtype)
    base = poisoned(T + PAD_ROWS, offset + K * H + bpad, dtype, gen)
    s64 = x.double() + r.double()
    want64 = s64 * torch.rsqrt(s64.pow(2).mean(-1, keepdim=True) + EPS) * w.double()
    del s64
    x_ref, r_ref, base_ref = x.clone(), r.clone(), base.clone()
    eagle3_ops.fused_add_rmsnorm_capture(x, r, w, EPS, base[:, offset:offset + K * H], SLOT)
    reference.fused_add_rmsnorm_capture_ref(x_ref, r_ref, w, EPS, base_ref[:, offset:offset + K * H], SLOT)
    torch.cuda.synchronize()
    assert same_bits(r, r_ref), "stored residual != fp32 sum rounded once"
    assert same_bits(base, base_ref), "buffer differs from the reference (captured slot or a canary)"
    assert_within_rounding(x, want64, dtype)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("H", H_VALUES)
@pytest.mark.parametrize("T", T_VALUES)
def test_fused_add_rmsnorm_capture_matches_reference(T, H, dtype, backend, use_backend):
    use_backend(backend)
    check_fused(T, H, dtype, gen_for("fused", T, H, str(dtype)))


# (T, H, row pad, view offset): scalar path, wide rows (two-pass), the T >= 256 launch shape
FUSED_LAYOUTS = [
    pytest.param(3, 7001, 1, 1, id="odd-H-odd-strides"),
    pytest.param(1000, 4095, 3, 0, id="H-4095-many-rows"),
    pytest.param(5, 16385, 0, 0, id="scalar-two-pass"),
    pytest.param(3, 40000, 0, 0, id="vector-two-pass"),
    pytest.param(300, 16384, 0, 0, id="H-16384-many-rows"),
    pytest.param(3, 16384, 0, 0, id="H-16384-few-rows"),
    pytest.param(256, 64, 0, 0, id="tiny-H-many-rows"),
    pytest.param(7, 4096, 0, 1, id="unaligned-views"),
]


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T,H,pad,offset", FUSED_LAYOUTS)
def test_fused_odd_layouts_and_wide_rows(T, H, pad, offset, dtype, backend, use_backend):
    use_backend(backend)
    check_fused(T, H, dtype, gen_for("fused-odd", T, H, pad, offset, str(dtype)), pad=pad, offset=offset)


# ---- CUDA graphs ---------------------------------------------------------------------------------
def allocation_count() -> int:
    return torch.cuda.memory_stats().get("allocation.all.allocated", 0)


class ThreeCaptures:
    """Slot 0: capture(hidden + residual); slot 1: fused add-RMSNorm capture; slot 2: capture(hidden)."""

    def __init__(self, T, H, dtype, gen):
        self.h0, self.r0 = randn((T, H), dtype, gen), randn((T, H), dtype, gen)
        self.x1, self.r1 = randn((T, H), dtype, gen), randn((T, H), dtype, gen)
        self.w = (torch.rand(H, generator=gen, device=DEVICE) + 0.5).to(dtype)
        self.h2 = randn((T, H), dtype, gen)
        self.buffer = torch.full((T, K * H), float("nan"), dtype=dtype, device=DEVICE)

    def inputs(self):
        return (self.h0, self.r0, self.x1, self.r1, self.h2)

    def run(self):
        eagle3_ops.capture(self.h0, self.r0, self.buffer, 0)
        eagle3_ops.fused_add_rmsnorm_capture(self.x1, self.r1, self.w, EPS, self.buffer, 1)
        eagle3_ops.capture(self.h2, None, self.buffer, 2)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T,H", [(64, 4096), (3, 7000)])
def test_cuda_graph_of_three_captures_replays_like_eager_without_allocating(T, H, dtype, backend, use_backend):
    use_backend(backend)
    gen = gen_for("graph", T, H, str(dtype))
    graph_side, eager_side = ThreeCaptures(T, H, dtype, gen), ThreeCaptures(T, H, dtype, gen)
    # Warm up eagerly on a side stream (verification, Triton compilation), as torch's graph docs do.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        graph_side.run()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()

    before = allocation_count()
    graph_side.run()  # eager, after warm-up: the ops themselves allocate nothing
    torch.cuda.synchronize()
    assert allocation_count() == before, "an eager call allocated memory"

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        before = allocation_count()
        graph_side.run()
        during_capture = allocation_count() - before
    assert during_capture == 0, f"{during_capture} allocations while capturing the graph"

    for trial in range(3):  # new inputs each time, copied into the graph's static tensors
        for g_t, e_t in zip(graph_side.inputs(), eager_side.inputs()):
            fresh = randn(g_t.shape, dtype, gen)
            g_t.copy_(fresh)
            e_t.copy_(fresh)
        graph_side.buffer.fill_(float("nan"))
        eager_side.buffer.fill_(float("nan"))
        torch.cuda.synchronize()
        allocated, count = torch.cuda.memory_allocated(), allocation_count()
        graph.replay()
        torch.cuda.synchronize()
        assert allocation_count() == count and torch.cuda.memory_allocated() == allocated, "replay allocated memory"
        eager_side.run()
        torch.cuda.synchronize()
        assert not torch.isnan(graph_side.buffer).any(), f"trial {trial}: replay left part of the buffer unwritten"
        assert same_bits(graph_side.buffer, eager_side.buffer), f"trial {trial}: replayed buffer != eager"
        assert same_bits(graph_side.x1, eager_side.x1) and same_bits(graph_side.r1, eager_side.r1), \
            f"trial {trial}: replayed fused outputs != eager"
