"""GPU checks of draft_fc, both accelerated backends (cuda, triton) against the float64 reference.

Marker ``gpu``: skipped without CUDA (CI), run by ``benchmarks/device_check.sh`` on a GPU machine.
A forced backend that cannot serve makes the test fail, not skip (the check must prove the CUDA
path, not quietly test Triton twice); only a GPU arch the extension was not built for is skipped.

What is checked:
* the grid M in {1, 2, 7, 16, 64, 256, 1000, 4096} x H in {4096, 7168, 8192}, K = 3, bf16:
  every variant (plain, bias, rows, chunk norm, input norm, all) at H = 7168; plain and all at the
  other H. The output is written into a view of a poisoned base: nothing around it may change.
* every Triton path (skinny, tiled, cuBLAS on the prepared input) directly, whatever the crossover
  table picks on this GPU; fp16 / fp32; a chunk width that is not a multiple of 8 (the CUDA
  backend's fallback), many narrow chunks, K*H = 0; strided rows / bias views; out-of-range device row indices give
  NaN rows.
* determinism: the same inputs twice give bitwise-equal outputs (fixed-order split-K reduction).
* no allocation in steady state: after one warm-up call, further eager draft_fc_out calls do not
  change torch.cuda.memory_stats()["allocation.all.allocated"], for every path of both backends
  (EAGLE3_OPS_CUDA_FC_SKINNY_MAX_M forces the CUDA paths), strided rows / bias included.
* a CUDA graph of draft_fc_out replayed with new x and new rows equals the reference on the new
  data; a graph stays correct after the scratch grows eagerly (captured buffers are never freed).
* Triton int64 offsets: out and prepared-input offsets past 2^31 elements.
"""
import functools
import zlib

import pytest
import torch

import eagle3_ops
from eagle3_ops import dispatch, reference
from helpers import MATMUL_TOL, VARIANTS, matmul_rel_err, same_bits

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
GPU_BACKENDS = ("cuda", "triton")
K = 3
EPS = 1e-6
M_VALUES = (1, 2, 7, 16, 64, 256, 1000, 4096)
H_VALUES = (4096, 7168, 8192)
EXTRA_ROWS = 13  # x has more rows than are gathered


@pytest.fixture
def use_backend(monkeypatch):
    def use(name):
        if name == "cuda":
            dev = torch.device(DEVICE, torch.cuda.current_device())
            if dispatch.cuda_extension() is not None and dispatch.implementation("cuda", "draft_fc", dev) is None:
                major, minor = torch.cuda.get_device_capability(dev)
                if not any(a.rstrip("a") == f"sm_{major}{minor}" for a in dispatch.compiled_archs()):
                    pytest.skip(f"extension not built for sm_{major}{minor} (built: {dispatch.compiled_archs()})")
        monkeypatch.setenv("EAGLE3_OPS_BACKEND", name)
    return use


def gen_for(*key):
    return torch.Generator(device=DEVICE).manual_seed(zlib.crc32(repr(key).encode()))


@functools.lru_cache(maxsize=4)
def weight(H, N, dtype):
    """(weight, weight in float64): one per shape, shared by the tests (400 MB at H=8192)."""
    gen = gen_for("weight", H, N, str(dtype))
    w = (torch.randn(N, K * H, generator=gen, device=DEVICE) * (K * H) ** -0.5).to(dtype)
    return w, w.double()


def problem(M, H, dtype, key, bias=False, rows=False, chunk=False, inorm=False, N=None, rows_dtype=torch.int64):
    N = N or H
    gen = gen_for(*key)
    R = M + EXTRA_ROWS if rows else M
    x = (torch.randn(R, K * H, generator=gen, device=DEVICE) * 3.0).to(dtype)
    w, _ = weight(H, N, dtype)
    b = torch.randn(N, generator=gen, device=DEVICE).to(dtype) if bias else None
    r = torch.randint(0, R, (M,), generator=gen, device=DEVICE).to(rows_dtype) if rows else None
    cn = (torch.rand(K, H, generator=gen, device=DEVICE) + 0.5).to(dtype) if chunk else None
    inw = (torch.rand(K * H, generator=gen, device=DEVICE) + 0.5).to(dtype) if inorm else None
    return x, w, b, r, cn, inw


def truth(x, w, b, rows, cn, inw):
    """float64 reference, reusing the cached float64 weight."""
    xs = reference.draft_fc_input_ref(x, rows, cn, inw, EPS, acc_dtype=torch.float64)
    y = xs @ weight(x.shape[1] // K, w.shape[0], w.dtype)[1].t()
    return y + b.double() if b is not None else y


def run_canaried(fn, M, N, dtype):
    """Runs fn(out) into an [M, N] view of a poisoned base; asserts nothing else was written."""
    base = torch.full((M + 2, N + 8), 1234.0, dtype=dtype, device=DEVICE)
    base[::5, ::3] = float("nan")
    out = base[1:M + 1, :N]
    out.fill_(float("nan"))
    before = base.clone()
    fn(out)
    torch.cuda.synchronize()
    mask = torch.ones_like(base, dtype=torch.bool)
    mask[1:M + 1, :N] = False
    assert same_bits(base[mask], before[mask]), "a write landed outside out"
    return out


def check(x, w, b, rows, cn, inw, fn=None):
    M, N = (rows.numel() if rows is not None else x.shape[0]), w.shape[0]
    fn = fn or (lambda out: eagle3_ops.draft_fc_out(x, w, b, rows, cn, inw, EPS, out))
    out = run_canaried(fn, M, N, x.dtype)
    want = truth(x, w, b, rows, cn, inw)
    assert not torch.isnan(out).any(), "NaN in the output (unwritten element?)"
    err = matmul_rel_err(out, want)
    assert err <= MATMUL_TOL[x.dtype], f"max |err| / max |want| = {err:.3g}"
    return out


def _grid():
    for H in H_VALUES:
        for variant in (VARIANTS if H == 7168 else ("plain", "all")):
            for M in M_VALUES:
                for backend in GPU_BACKENDS:
                    yield pytest.param(backend, M, H, variant, id=f"{backend}-M{M}-H{H}-{variant}")


@pytest.mark.parametrize("backend,M,H,variant", list(_grid()))
def test_draft_fc_matches_fp64_over_the_grid(backend, M, H, variant, use_backend):
    use_backend(backend)
    check(*problem(M, H, torch.bfloat16, ("grid", M, H, variant), **VARIANTS[variant]))


@pytest.mark.parametrize("variant", ["plain", "all"])
@pytest.mark.parametrize("M", [1, 64, 256, 1000])
@pytest.mark.parametrize("path", ["skinny", "tiled", "cublas"])
def test_every_triton_path_matches_fp64(path, M, variant):
    from eagle3_ops.triton import draft_fc as tdf

    x, w, b, rows, cn, inw = problem(M, 7168, torch.bfloat16, ("path", path, M, variant), **VARIANTS[variant])
    check(x, w, b, rows, cn, inw, fn=lambda out: tdf.PATHS[path](x, w, b, rows, cn, inw, EPS, out))


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("M", [7, 300])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_fp16_and_fp32(dtype, M, backend, use_backend):
    use_backend(backend)
    check(*problem(M, 4096, dtype, ("dtype", str(dtype), M), **VARIANTS["all"]))


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("M", [7, 300])
def test_chunk_width_not_a_multiple_of_8(M, backend, use_backend):
    """H = 1002: the CUDA skinny kernel's 16-byte fragments do not fit; its fallback serves."""
    use_backend(backend)
    check(*problem(M, 1002, torch.bfloat16, ("odd", M), N=1000, **VARIANTS["all"]))


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("M", [7, 300])
def test_many_narrow_chunks(M, backend, use_backend):
    """chunk_norm_weight [96, 8]: more chunks than the CUDA reducer's split limit (its fallback serves)."""
    use_backend(backend)
    gen = gen_for("narrow", M)
    x = torch.randn(M, 768, generator=gen, device=DEVICE).to(torch.bfloat16)
    w = (torch.randn(256, 768, generator=gen, device=DEVICE) / 768 ** 0.5).to(torch.bfloat16)
    cn = (torch.rand(96, 8, generator=gen, device=DEVICE) + 0.5).to(torch.bfloat16)
    out = torch.empty(M, 256, dtype=torch.bfloat16, device=DEVICE)
    eagle3_ops.draft_fc_out(x, w, None, None, cn, None, EPS, out)
    want = reference.draft_fc_ref(x, w, None, None, cn, None, EPS, acc_dtype=torch.float64)
    assert matmul_rel_err(out, want) <= MATMUL_TOL[torch.bfloat16]


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_empty_inner_dimension_gives_bias(backend, use_backend):
    use_backend(backend)
    x = torch.randn(5, 0, device=DEVICE, dtype=torch.bfloat16)
    w = torch.randn(7, 0, device=DEVICE, dtype=torch.bfloat16)
    b = torch.randn(7, device=DEVICE, dtype=torch.bfloat16)
    out = torch.full((5, 7), float("nan"), device=DEVICE, dtype=torch.bfloat16)
    eagle3_ops.draft_fc_out(x, w, b, None, None, None, EPS, out)
    assert torch.equal(out, b.expand(5, 7))


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("M", [7, 300])
def test_strided_rows_and_bias_views(M, backend, use_backend):
    """Validation accepts any stride for rows and bias; the backends must not assume stride 1."""
    use_backend(backend)
    x, w, b, rows, cn, inw = problem(M, 4096, torch.bfloat16, ("strided", M), **VARIANTS["all"])
    b2 = torch.stack([b, -b], dim=1).reshape(-1)[::2]
    rows2 = torch.stack([rows, rows.flip(0)], dim=1).reshape(-1)[::2]
    assert not (b2.is_contiguous() or rows2.is_contiguous())
    check(x, w, b2, rows2, cn, inw)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("M", [7, 300])
@pytest.mark.parametrize("rows_dtype", [torch.int32, torch.int64], ids=str)
def test_out_of_range_device_rows_give_nan_rows(rows_dtype, M, backend, use_backend):
    use_backend(backend)
    x, w, b, rows, cn, inw = problem(M, 4096, torch.bfloat16, ("oob", M, str(rows_dtype)), rows_dtype=rows_dtype,
                                     **VARIANTS["all"])
    R = x.shape[0]
    big = 2 ** 40 if rows_dtype == torch.int64 else 2 ** 30
    rows[1], rows[-1] = R, -1
    if M > 2:
        rows[2] = big
    bad = (rows < 0) | (rows >= R)
    out = torch.empty(M, w.shape[0], dtype=x.dtype, device=DEVICE)
    eagle3_ops.draft_fc_out(x, w, b, rows, cn, inw, EPS, out)
    torch.cuda.synchronize()
    assert torch.isnan(out[bad]).all()
    assert not torch.isnan(out[~bad]).any()
    want = truth(x, w, b, rows, cn, inw)
    assert matmul_rel_err(out[~bad], want[~bad]) <= MATMUL_TOL[x.dtype]


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("M", [1, 7, 64, 1000])
def test_same_inputs_twice_give_bitwise_equal_outputs(M, backend, use_backend):
    use_backend(backend)
    x, w, b, rows, cn, inw = problem(M, 7168, torch.bfloat16, ("det", M), **VARIANTS["all"])
    outs = []
    for _ in range(2):
        out = torch.full((M, w.shape[0]), float("nan"), dtype=x.dtype, device=DEVICE)
        eagle3_ops.draft_fc_out(x, w, b, rows, cn, inw, EPS, out)
        outs.append(out)
    torch.cuda.synchronize()
    assert same_bits(outs[0], outs[1])


def allocations() -> int:
    """Device allocations served so far (cache hits of the caching allocator included)."""
    torch.cuda.synchronize()
    return torch.cuda.memory_stats().get("allocation.all.allocated", 0)


def assert_no_allocation_after_warm_up(fn, calls=3):
    fn()  # warm-up: verification, compilation, scratch growth, cuBLAS workspace
    before = allocations()
    for _ in range(calls):
        fn()
    assert allocations() == before, f"{allocations() - before} allocations in {calls} steady-state calls"


# (backend, path, M, variant, forced CUDA skinny limit): every path of both backends that draws on
# scratch (split-K partials, row scales, prepared input, unit-stride copies) or on none.
NO_ALLOC_CASES = [
    ("triton", "skinny", 7, "all", None),
    ("triton", "tiled", 300, "all", None),
    ("triton", "cublas", 300, "all", None),
    ("triton", "cublas", 300, "plain", None),  # x straight into cuBLAS
    ("triton", "dispatch", 7, "all", None),  # the public op, whatever path the table picks
    ("triton", "dispatch", 300, "all", None),
    ("cuda", "skinny", 7, "all", None),  # split-K partials + sums of squares
    ("cuda", "skinny", 1000, "plain", "4096"),  # one split: out written directly
    ("cuda", "cublas", 7, "all", "0"),  # prepared input + cuBLAS
    ("cuda", "cublas", 300, "plain", None),
]


def _no_alloc_params():
    for b, p, m, v, s in NO_ALLOC_CASES:
        for strided in ((False, True) if v == "all" else (False,)):  # strided rows / bias need both
            name = f"{b}-{p}-M{m}-{v}" + (f"-skinny{s}" if s else "") + ("-strided" if strided else "")
            yield pytest.param(b, p, m, v, s, strided, id=name)


@pytest.mark.parametrize("backend,path,M,variant,skinny_max_m,strided", list(_no_alloc_params()))
def test_eager_draft_fc_out_does_not_allocate_after_one_warm_up_call(backend, path, M, variant, skinny_max_m, strided,
                                                                      use_backend, monkeypatch):
    """DESIGN.md §4: draft_fc_out allocates nothing in steady state (what makes a graph capture
    after warm-up allocate nothing, and eager decode steps cheap). Strided rows / bias views are
    copied into scratch, so they allocate nothing either once warm. (Diagnosis aid: if only the
    cuBLAS cases with a bias fail, suspect PyTorch's addmm bias epilogue; some PyTorch versions
    allocate a cuBLASLt workspace per call there, outside this package.)"""
    use_backend(backend)
    if skinny_max_m is not None:
        monkeypatch.setenv("EAGLE3_OPS_CUDA_FC_SKINNY_MAX_M", skinny_max_m)
    x, w, b, rows, cn, inw = problem(M, 4096, torch.bfloat16, ("noalloc", backend, path, M, variant, strided),
                                     **VARIANTS[variant])
    if strided:
        b = torch.stack([b, -b], dim=1).reshape(-1)[::2]
        rows = torch.stack([rows, rows.flip(0)], dim=1).reshape(-1)[::2]
        assert not (b.is_contiguous() or rows.is_contiguous())
    out = torch.empty(M, w.shape[0], dtype=x.dtype, device=DEVICE)
    if path == "dispatch" or backend == "cuda":
        fn = lambda: eagle3_ops.draft_fc_out(x, w, b, rows, cn, inw, EPS, out)  # noqa: E731
    else:
        from eagle3_ops.triton import draft_fc as tdf

        fn = lambda: tdf.PATHS[path](x, w, b, rows, cn, inw, EPS, out)  # noqa: E731
    assert_no_allocation_after_warm_up(fn)
    assert matmul_rel_err(out, truth(x, w, b, rows, cn, inw)) <= MATMUL_TOL[x.dtype]  # reused scratch: still right


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("M", [7, 64, 1000])
def test_cuda_graph_replay_with_new_x_and_rows(M, backend, use_backend):
    use_backend(backend)
    H = 4096
    x, w, b, rows, cn, inw = problem(M, H, torch.bfloat16, ("graph", M), **VARIANTS["all"])
    out = torch.full((M, w.shape[0]), float("nan"), dtype=x.dtype, device=DEVICE)
    run = lambda: eagle3_ops.draft_fc_out(x, w, b, rows, cn, inw, EPS, out)  # noqa: E731
    # Eager warm-up (verification, compilation, scratch), then steady-state calls allocate nothing:
    # the capture below then records only kernels on memory that outlives it.
    assert_no_allocation_after_warm_up(run)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    x2, _, _, rows2, _, _ = problem(M, H, torch.bfloat16, ("graph-new", M), rows=True)
    rows2[0] = x.shape[0]  # out of range on the replay: NaN row, no fault
    x.copy_(x2)
    rows.copy_(rows2)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    want = truth(x, w, b, rows, cn, inw)
    assert torch.isnan(out[0]).all() and not torch.isnan(out[1:]).any()
    assert matmul_rel_err(out[1:], want[1:]) <= MATMUL_TOL[x.dtype]


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_graph_replay_stays_correct_after_the_scratch_grows_eagerly(backend, use_backend, monkeypatch):
    """The scratch policy: growth during capture is allowed, and a buffer a capture used is never
    freed when the scratch grows later (graphs keep its address). Triton: the scratch is emptied
    first, so the capture itself grows it (graph pool). Both backends: after the capture an eager
    call with a larger problem grows the split-K scratch; then fresh tensors are allocated in the
    ordinary pool and, by a second graph, in the first graph's pool (where a freed graph-pool
    buffer would go). The replay must stay right and must not touch those tensors. (Best effort:
    whether a wrongly freed buffer would be handed out again is up to the caching allocator.)"""
    from eagle3_ops import workspace
    from eagle3_ops.triton import draft_fc as tdf

    use_backend(backend)
    H, M = 4096, 7
    x, w, b, rows, cn, inw = problem(M, H, torch.bfloat16, ("regrow", backend), **VARIANTS["all"])
    out = torch.full((M, w.shape[0]), float("nan"), dtype=x.dtype, device=DEVICE)
    run = lambda: eagle3_ops.draft_fc_out(x, w, b, rows, cn, inw, EPS, out)  # noqa: E731
    run()  # verification and compilation (eager)
    torch.cuda.synchronize()
    if backend == "triton":
        workspace.clear()  # no graph holds these yet: the capture must grow the scratch itself
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    if backend == "triton":
        assert workspace.buffer(x.device, "draft_fc.splitk") is not None  # allocated during the capture
    # Eager growth: a split-K problem larger than any other in this file (CUDA: forced skinny).
    big_m = 64 if backend == "triton" else 1000
    big = problem(big_m, H, torch.bfloat16, ("regrow-big", backend), **VARIANTS["all"])
    big_out = torch.empty(big_m, H, dtype=x.dtype, device=DEVICE)
    if backend == "triton":
        tdf.skinny_fc_out(*big, EPS, big_out)
        assert len(workspace.retired()) >= 1  # the captured buffers were retired, not freed
    else:
        monkeypatch.setenv("EAGLE3_OPS_CUDA_FC_SKINNY_MAX_M", "4096")
        eagle3_ops.draft_fc_out(*big, EPS, big_out)
        monkeypatch.delenv("EAGLE3_OPS_CUDA_FC_SKINNY_MAX_M")
    torch.cuda.synchronize()
    sizes = sorted({t.numel() for t in workspace.retired()} | {1 << 20, 4 << 20, 16 << 20, 64 << 20})
    junk = [torch.full((n,), 7, dtype=torch.uint8, device=DEVICE) for n in sizes]
    second = torch.cuda.CUDAGraph()
    with torch.cuda.graph(second, pool=graph.pool()):
        junk_in_pool = [torch.full((n,), 7, dtype=torch.uint8, device=DEVICE) for n in sizes]
    x.copy_(problem(M, H, torch.bfloat16, ("regrow-new", backend))[0])
    out.fill_(float("nan"))
    second.replay()
    graph.replay()
    torch.cuda.synchronize()
    assert all(bool((j == 7).all()) for j in junk + junk_in_pool), "the replay wrote into memory handed out again"
    assert matmul_rel_err(out, truth(x, w, b, rows, cn, inw)) <= MATMUL_TOL[x.dtype]


@pytest.mark.parametrize("path", ["tiled", "skinny", "cublas"])
def test_triton_row_offsets_beyond_int32(path):
    """Row index x row stride past 2^31 elements (int64 offsets): out [M, N] with M*N > 2^31 for the
    tiled and skinny (split-K reduce) kernels, the prepared input [M, K*H] with M*K*H > 2^31 for
    the cuBLAS path. Only sampled rows are checked against fp64 (the last ones are past 2^31)."""
    from eagle3_ops import workspace
    from eagle3_ops.triton import draft_fc as tdf

    gen = gen_for("int64", path)
    dt = torch.bfloat16
    if path == "cublas":
        M, N, K_, H = 1 << 17, 16, 2, 8224  # prepared input: 2^17 * 16448 = 2.16e9 elements
        R = 16
    else:
        M, N, K_, H = 65539, 32800, 2, 32  # out: 2.15e9 elements
        R = 16
    # bytes: out or prepared input (bf16), plus the skinny path's fp32 partials [2, M, N]
    need = M * max(N, K_ * H) * 2 * (1 + (4 if path == "skinny" else 0)) + (1 << 30)
    if torch.cuda.mem_get_info()[0] < need:
        pytest.skip(f"needs {need / 2 ** 30:.0f} GiB of free device memory")
    x = torch.randn(R, K_ * H, generator=gen, device=DEVICE).to(dt)
    w = (torch.randn(N, K_ * H, generator=gen, device=DEVICE) * (K_ * H) ** -0.5).to(dt)
    b = torch.randn(N, generator=gen, device=DEVICE).to(dt)
    rows = torch.randint(0, R, (M,), generator=gen, device=DEVICE)
    cn = (torch.rand(K_, H, generator=gen, device=DEVICE) + 0.5).to(dt)
    out = torch.empty(M, N, dtype=dt, device=DEVICE)
    kw = dict(split_len=H) if path == "skinny" else {}  # one split per chunk: S = 2, the reducer writes out
    try:
        tdf.PATHS[path](x, w, b, rows, cn, None, EPS, out, **kw)
        torch.cuda.synchronize()
        sample = torch.tensor([0, 1, M // 2, M - 2, M - 1], device=DEVICE)
        want = reference.draft_fc_ref(x, w, b, rows[sample], cn, None, EPS, acc_dtype=torch.float64)
        assert matmul_rel_err(out[sample], want) <= MATMUL_TOL[dt]
    finally:
        del out
        workspace.clear()  # gigabytes of scratch; no graph holds them
        torch.cuda.empty_cache()


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_fp16_large_activations_with_norm_weights_stay_finite(backend, use_backend):
    """x * norm weights = 80000 > fp16 max before normalization: no path may round that to inf."""
    use_backend(backend)
    x, w, b, rows, cn, inw = problem(7, 4096, torch.float16, ("fp16-big",), **VARIANTS["all"])
    x[:, ::97] = 20000.0
    cn.fill_(2.0)
    inw.fill_(2.0)
    check(x, w, b, rows, cn, inw)


@pytest.mark.parametrize("variant", ["plain", "bias", "rows"])
def test_cuda_skinny_direct_output_path(variant, monkeypatch, use_backend):
    """Enough tiles for one split (S == 1): the skinny kernel writes out directly (no reducer)."""
    use_backend("cuda")
    monkeypatch.setenv("EAGLE3_OPS_CUDA_FC_SKINNY_MAX_M", "4096")
    check(*problem(1000, 4096, torch.bfloat16, ("direct", variant), **VARIANTS[variant]))


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("M", [7, 100])
@pytest.mark.parametrize("N", [1000, 1001])
def test_skinny_tails(N, M, backend, use_backend):
    """N % 64 != 0 (weight-row tail), N % 4 != 0 (scalar reducer), chunk width % 128 != 0 (k tail)."""
    use_backend(backend)
    check(*problem(M, 1000, torch.bfloat16, ("tails", M, N), N=N, **VARIANTS["all"]))
