"""draft_fc / draft_fc_out: ``out[M, N] = linear(norm(x[rows]), weight, bias)`` (input norm over the
K*H row first, then one RMSNorm per H-wide chunk; fp32 accumulation, one rounding into ``out``).

Every numerics test runs on every target (``eagle3_ops.testing``): the reference and the
interpreted Triton kernels on the CPU (small shapes for the interpreter), and the CUDA, Triton and
reference backends on a GPU (``gpu`` mark; model-sized shapes). Outputs are compared with the
float64 truth by the normwise relative error (fp32 accumulation order differs between backends),
written into NaN-poisoned views with canaries around them. ``plans.forced_path`` runs each path of
each backend (Triton: skinny, tiled, cublas; CUDA: skinny, cublas); a path a backend cannot take for
an argument set falls back as documented (e.g. Triton skinny in fp16 with norms -> tiled). Argument
validation runs once, on the CPU.
"""
import contextlib
import itertools

import pytest
import torch
try:  # a test dependency (make deps); the GPU device check may run without it (the property test then skips)
    from hypothesis import HealthCheck, given, settings, strategies as st
except ImportError:
    given = None

import eagle3_ops
from eagle3_ops import plans, reference, workspace
import op_testing as testing
from op_testing import (DTYPES, FC_PATHS, MATMUL_TOL, TARGETS, VARIANTS, assert_close, fc_problem, params,
                                rel_err, same_bits)

BF16 = torch.bfloat16
GPU_M = (1, 2, 7, 16, 64, 256, 1000, 4096)


def grid(target):
    """(M, H, K, N, variant, dtype) per target (N None: N = H)."""
    if target == testing.REFERENCE_CPU:
        # Every variant on small shapes; at a model's width (K*H = 12288 and 4096 long fp32 sums) the
        # variant with no option and the one with all of them (a 400 MB fp64 weight per case: the other
        # four variants there cost ~30 s of CPU and run nothing the small shapes do not).
        shapes = list(itertools.product((0, 1, 7, 64, 300), (64, 256), (1, 2, 3, 4)))
        cases = [(M, H, K, None, v, dt) for (M, H, K), v, dt in itertools.product(shapes, VARIANTS, DTYPES)]
        return cases + [(M, 4096, K, None, v, dt) for (M, K), v, dt in
                        itertools.product(((7, 3), (1, 1)), ("plain", "all"), DTYPES)]
    if target == testing.TRITON_CPU:
        shapes = [(1, 64, 1), (7, 72, 3), (33, 64, 2), (16, 128, 3)]
        return [(M, H, K, None, v, dt) for (M, H, K), v, dt in itertools.product(shapes, VARIANTS, DTYPES)]
    if target.backend == "reference":
        return [(7, 4096, 3, None, "all", BF16), (300, 7168, 3, None, "plain", BF16)]
    cases = [(M, H, 3, None, v, BF16) for H in (4096, 7168, 8192)
             for v in (VARIANTS if H == 7168 else ("plain", "all")) for M in GPU_M]
    cases += [(M, 4096, 3, None, "all", dt) for dt in (torch.float16, torch.float32) for M in (7, 300)]
    # chunk width 1002 is not a multiple of 8: the CUDA skinny kernel's 16-byte fragments do not fit
    cases += [(M, 1002, 3, 1000, "all", BF16) for M in (7, 300)]
    # skinny tails: N % 64 != 0 (weight-row tail), N % 4 != 0 (scalar reducer), chunk width % 128 != 0
    cases += [(M, 1000, 3, N, "all", BF16) for N in (1000, 1001) for M in (7, 100)]
    return cases


@pytest.mark.parametrize("target,M,H,K,N,variant,dtype", params(TARGETS, grid))
def test_draft_fc_matches_fp64(target, M, H, K, N, variant, dtype, device):
    p = fc_problem(M, H, K, dtype, device, N=N, **VARIANTS[variant])
    want = p.truth()
    got = eagle3_ops.draft_fc(*p.args, p.eps)
    assert got.dtype == dtype and got.shape == want.shape
    assert_close(got, want, MATMUL_TOL[dtype], normwise=True, what="draft_fc")
    out = p.run_out(p.out())  # draft_fc_out writes exactly out, nothing around it
    assert_close(out, want, MATMUL_TOL[dtype], normwise=True, what="draft_fc_out")


def path_grid(target):
    """(path, M, H, K, N, variant, dtype). CPU: chunk width 80 is not a multiple of the 64-wide k
    block, N = 72 leaves a partial weight tile, M = 40 a partial token tile."""
    paths = FC_PATHS[target.backend]
    if not target.gpu:
        return [(path, 40, 80, 3, 72, v, dt) for path in paths for v in VARIANTS for dt in DTYPES]
    return [(path, M, 7168, 3, None, v, BF16) for path in paths for M in (1, 64, 256, 1000) for v in ("plain", "all")]


@pytest.mark.parametrize("target,path,M,H,K,N,variant,dtype",
                         params([t for t in TARGETS if t.backend != "reference"], path_grid))
def test_every_path_matches_fp64(target, path, M, H, K, N, variant, dtype, device):
    """Each path forced (plans.forced_path), whatever the crossover table picks on this device."""
    p = fc_problem(M, H, K, dtype, device, N=N, key=(path,), **VARIANTS[variant])
    with plans.forced_path(path):
        out = p.run_out(p.out())
    assert_close(out, p.truth(), MATMUL_TOL[dtype], normwise=True, what=f"{path} path")


def skinny_one_split(target):
    if target.gpu:
        return [(v, 1000, 4096, 3, None) for v in ("plain", "bias", "rows")]
    return [(v, 40, 80, 3, 72) for v in ("plain", "bias", "rows")]


@pytest.mark.parametrize("target,variant,M,H,K,N",
                         params([t for t in TARGETS if "skinny" in FC_PATHS[t.backend]], skinny_one_split))
def test_skinny_with_one_split_writes_out_directly(target, variant, M, H, K, N, device):
    """Enough tiles for one split (and no norm): the skinny kernel writes out directly (no reducer,
    no workspace on the Triton backend)."""
    p = fc_problem(M, H, K, BF16, device, N=N, key=("direct",), **VARIANTS[variant])
    with plans.forced_path("skinny"):
        if target.backend == "triton":
            assert eagle3_ops.draft_fc_workspace_bytes(*p.args) == 0
        out = p.run_out(p.out())
    assert_close(out, p.truth(), MATMUL_TOL[BF16], normwise=True)


# ---- row indices -----------------------------------------------------------------------------------
def oob_grid(target):
    """(path, M, rows dtype)."""
    Ms = (7, 300) if target.gpu else (7,)
    return [(path, M, rd) for path in FC_PATHS[target.backend] for M in Ms for rd in (torch.int32, torch.int64)]


@pytest.mark.parametrize("target,path,M,rows_dtype", params(TARGETS, oob_grid))
def test_out_of_range_rows(target, path, M, rows_dtype, device, monkeypatch):
    """The whole contract for row indices outside [0, R), in one place:
    * every backend (called directly, below validation) never dereferences them: their output rows
      are NaN, the others exact, nothing outside out written;
    * device row indices through the op: the same NaN rows without a host sync, and an IndexError
      naming the positions with EAGLE3_OPS_DEBUG=1;
    * host row indices through the op: a ValueError before anything is written."""
    if target.gpu:
        p = fc_problem(M, 4096, 3, BF16, device, rows_dtype=rows_dtype, key=("oob", path), **VARIANTS["all"])
    else:
        p = fc_problem(M, 64, 2, torch.float32, device, N=40, rows_dtype=rows_dtype, key=("oob", path),
                       **VARIANTS["all"])
    R = p.x.shape[0]
    big = 2 ** 40 if rows_dtype == torch.int64 else 2 ** 30
    p.rows[1], p.rows[2], p.rows[3], p.rows[-1] = R, big, -big, -1
    bad = (p.rows < 0) | (p.rows >= R)
    with plans.forced_path(path):
        out = p.run_out(p.out(), backend=target.backend)
        assert torch.isnan(out[bad]).all(), "an out-of-range row is not NaN"
        assert not torch.isnan(out[~bad]).any()
        assert_close(out[~bad], p.truth()[~bad], MATMUL_TOL[p.dtype], normwise=True)
        if target.gpu:  # device indices: NaN rows from the op too, an error in debug mode
            y = eagle3_ops.draft_fc(*p.args, p.eps)
            assert torch.equal(torch.isnan(y).all(dim=1), bad) and not torch.isnan(y[~bad]).any()
            monkeypatch.setenv("EAGLE3_OPS_DEBUG", "1")
            positions = ", ".join(str(i) for i in bad.nonzero().flatten().tolist()[:16])
            with pytest.raises(IndexError, match=rf"rows out of range at positions \[{positions}\]"):
                eagle3_ops.draft_fc(*p.args, p.eps)
        else:  # host indices: refused before anything is written
            out = torch.full((p.M, p.N), 7.0, dtype=p.dtype)
            with pytest.raises(ValueError, match=rf"rows out of range: indices span \[{-big}, {big}\], "
                                                 rf"expected within \[0, {R}\)"):
                eagle3_ops.draft_fc_out(*p.args, p.eps, out)
            assert torch.equal(out, torch.full((p.M, p.N), 7.0, dtype=p.dtype)), "out changed on a refused call"


@pytest.mark.parametrize("target,rows_dtype", params(TARGETS, [torch.int32, torch.int64]))
def test_rows_gather_in_given_order_with_repeats(target, rows_dtype, device):
    p = fc_problem(9, 64, 3, torch.float32, device, key=("order",))
    rows = torch.tensor([8, 0, 3, 3, 8], dtype=rows_dtype, device=device)
    got = eagle3_ops.draft_fc(p.x, p.weight, rows=rows)
    want = p.x.double()[rows.long()] @ p.weight.double().t()
    assert rel_err(got, want, normwise=True) < (MATMUL_TOL[torch.float32] if target.gpu else 1e-6)


def strided_grid(target):
    """(path, M, H, K, N, dtype)."""
    if target.gpu:
        return [(path, M, 4096, 3, None, BF16) for path in FC_PATHS[target.backend] for M in (7, 300)]
    return [(path, 4, 64, 2, 40, torch.float32) for path in FC_PATHS[target.backend]]


@pytest.mark.parametrize("target,path,M,H,K,N,dtype", params(TARGETS, strided_grid))
def test_strided_rows_and_bias_views(target, path, M, H, K, N, dtype, device):
    """Validation accepts any stride for rows and bias; the kernels must not assume stride 1."""
    p = fc_problem(M, H, K, dtype, device, N=N, key=("strided",), **VARIANTS["all"]).strided_1d()
    assert not (p.bias.is_contiguous() or p.rows.is_contiguous())
    with plans.forced_path(path):
        out = p.run_out(p.out())
    assert_close(out, p.truth(), MATMUL_TOL[dtype], normwise=True)


@pytest.mark.parametrize("target,path", params(TARGETS, lambda t: FC_PATHS[t.backend]))
def test_empty_inner_dimension_gives_bias(target, path, device):
    """K*H = 0 is a valid (degenerate) problem: the product is empty, out = bias."""
    dtype = BF16 if target.gpu else torch.float32
    gen = testing.generator(device, "empty")
    x, w = testing.randn((5, 0), dtype, device, gen), testing.randn((7, 0), dtype, device, gen)
    b = testing.randn((7,), dtype, device, gen)
    out = testing.canaried_out(5, 7, dtype, device, gen)
    with plans.forced_path(path):
        testing.run_canaried(lambda: eagle3_ops.draft_fc_out(x, w, b, None, None, None, 1e-6, out), [out], [out])
    assert torch.equal(out, b.expand(5, 7))


@pytest.mark.parametrize("target,M", params(TARGETS, lambda t: (7, 300) if t.gpu else (7, 20)))
def test_many_narrow_chunks(target, M, device):
    """chunk_norm_weight [96, 8]: more chunks than the CUDA reducer's split limit (its fallback serves);
    M = 20 takes the Triton tiled path on the CPU, 7 the skinny one (64 outputs there: the interpreter
    pays per weight tile, and the chunk count is what is tested)."""
    gen = testing.generator(device, "narrow", M)
    N = 256 if target.gpu else 64
    p = testing.FcProblem(testing.randn((M, 768), BF16, device, gen),
                          testing.randn((N, 768), BF16, device, gen, scale=768 ** -0.5),
                          chunk_norm_weight=testing.positive((96, 8), BF16, device, gen))
    out = p.run_out(p.out())
    assert_close(out, p.truth(), MATMUL_TOL[BF16], normwise=True)


def det_grid(target):
    """(path, M, H): the table's path on a GPU, each split-K / tiled path on the CPU interpreter."""
    if target.gpu:
        return [(None, M, 7168) for M in (1, 7, 64, 1000)] if target.backend != "reference" else [(None, 7, 4096)]
    return [(path, 40, 80) for path in FC_PATHS[target.backend] if path != "cublas"]


@pytest.mark.parametrize("target,path,M,H", params(TARGETS, det_grid))
def test_same_inputs_twice_give_bitwise_equal_outputs(target, path, M, H, device):
    """Determinism: the split-K partials are reduced in a fixed order."""
    p = fc_problem(M, H, 3, BF16, device, N=None if target.gpu else 72, key=("det",), **VARIANTS["all"])
    with plans.forced_path(path):
        outs = [p.run_out(p.out()) for _ in range(2)]
    assert same_bits(outs[0], outs[1])


@pytest.mark.parametrize("target,path",
                         params(TARGETS, lambda t: [None] + (["skinny"] if "skinny" in FC_PATHS[t.backend] else [])))
def test_fp16_large_activations_with_norm_weights_stay_finite(target, path, device):
    """fp16: x * norm weights = 80000 > 65504 before the RMS scale brings it back; no path may round
    that to inf (forced skinny, whose dot would see the unscaled product, takes its fallback)."""
    if target.gpu:
        p = fc_problem(7, 4096, 3, torch.float16, device, key=("fp16-big",), **VARIANTS["all"])
        p.x[:, ::97] = 20000.0
    else:
        p = fc_problem(5, 64, 3, torch.float16, device, N=24, key=("fp16-big",), **VARIANTS["all"])
        p.x[:, ::7] = 20000.0  # representable in fp16; x * 2 * 2 = 80000 is not
        if target.backend == "triton" and path is None:
            assert plans.choose("triton", device, p.M) == "skinny"  # what the table alone picks here
    p.chunk_norm_weight.fill_(2.0)
    p.input_norm_weight.fill_(2.0)
    with plans.forced_path(path):
        got = eagle3_ops.draft_fc(*p.args, p.eps)
    assert torch.isfinite(got).all()
    assert_close(got, p.truth(), MATMUL_TOL[torch.float16], normwise=True)


# ---- memory: no allocation once warm; CUDA graphs ------------------------------------------------------
def no_alloc_grid(target):
    """(path, M, variant, strided rows and bias): every path that draws on scratch (split-K
    partials, row scales, prepared input, unit-stride copies) or on none; None = the table's path."""
    if target.gpu:
        H = 4096
        cases = {"triton": [("skinny", 7, "all"), ("tiled", 300, "all"), ("cublas", 300, "all"),
                            ("cublas", 300, "plain"),  # x straight into cuBLAS
                            (None, 7, "all"), (None, 300, "all")],
                 "cuda": [("skinny", 7, "all"),  # split-K partials + sums of squares
                          ("skinny", 1000, "plain"),  # one split: out written directly
                          ("cublas", 7, "all"),  # prepared input + cuBLAS
                          (None, 300, "plain")],
                 "reference": [(None, 7, "all")]}[target.backend]
    else:
        H = 64
        cases = {"triton": [("skinny", 7, "all"), ("tiled", 40, "all"), ("cublas", 40, "all"),
                            ("cublas", 40, "plain"), (None, 7, "all"), (None, 40, "all")],
                 "reference": [(None, 7, "all"), (None, 40, "plain")]}[target.backend]
    return [(path, M, H, v, strided) for path, M, v in cases for strided in ((False, True) if v == "all" else (False,))]


@pytest.mark.parametrize("target,path,M,H,variant,strided", params(TARGETS, no_alloc_grid))
def test_no_allocation_after_one_warm_up_call(target, path, M, H, variant, strided, device):
    """draft_fc_out allocates nothing in steady state (what makes a graph capture after warm-up
    allocate nothing, and eager decode steps cheap); strided 1-D views are copied into the
    workspace, so they allocate nothing either once warm. GPU: the caching allocator's count; CPU:
    the face's scratch. (Diagnosis aid: if only the cuBLAS cases with a bias fail on a GPU, suspect
    PyTorch's addmm bias epilogue; some versions allocate a cuBLASLt workspace per call there.)"""
    p = fc_problem(M, H, 3, BF16, device, key=("noalloc", path, strided), **VARIANTS[variant])
    if strided:
        p = p.strided_1d()
    out = torch.empty(M, p.N, dtype=BF16, device=device)
    with plans.forced_path(path):
        eagle3_ops.draft_fc_out(*p.args, p.eps, out)  # warm-up: verification, compilation, scratch
        before = testing.allocation_count(device)
        for _ in range(3):
            eagle3_ops.draft_fc_out(*p.args, p.eps, out)
        assert testing.allocation_count(device) == before, "allocations in steady-state calls"
    assert_close(out, p.truth(), MATMUL_TOL[BF16], normwise=True)  # reused scratch: still right


@pytest.mark.parametrize("target,M", params(TARGETS, lambda t: (7, 64, 1000) if t.gpu else (7, 20)))
def test_graph_replay_with_new_x_and_rows(target, M, device):
    """A CUDA graph of draft_fc_out replayed with new x and rows equals the truth on the new data
    (device rows: an out-of-range one gives a NaN row on the replay). CPU twin: the same calls."""
    H = 4096 if target.gpu else 64
    p = fc_problem(M, H, 3, BF16, device, key=("graph",), **VARIANTS["all"])
    out = torch.full((M, p.N), float("nan"), dtype=BF16, device=device)
    run = lambda: eagle3_ops.draft_fc_out(*p.args, p.eps, out)  # noqa: E731
    run()  # eager warm-up (verification, compilation, scratch); then nothing allocates
    before = testing.allocation_count(device)
    run()
    assert testing.allocation_count(device) == before
    replay = testing.Replay(run, device, warmup=False)
    new = fc_problem(M, H, 3, BF16, device, key=("graph-new",), rows=True)
    if target.gpu:
        new.rows[0] = p.x.shape[0]  # out of range on the replay: NaN row, no fault
    p.x.copy_(new.x)
    p.rows.copy_(new.rows)
    out.fill_(float("nan"))
    replay.replay()
    want = p.truth()
    if target.gpu:
        assert torch.isnan(out[0]).all() and not torch.isnan(out[1:]).any()
        out, want = out[1:], want[1:]
    assert_close(out, want, MATMUL_TOL[BF16], normwise=True)


@pytest.mark.parametrize("target", params(TARGETS))
def test_graph_replay_stays_correct_after_the_scratch_grows(target, device, monkeypatch):
    """The scratch policy: growth during capture is allowed, and a buffer a capture used is never
    freed when the scratch of that stream grows later (graphs keep its address). The scratch is
    emptied first, so the capture itself allocates it (graph pool); then an eager call with a larger
    problem on the capture's stream grows it; then fresh tensors are allocated in the ordinary pool
    and, by a second graph, in the first graph's pool (where a freed graph-pool buffer would go).
    The replay must stay right and must not touch those tensors. (Best effort: whether a wrongly
    freed buffer would be handed out again is up to the caching allocator.) CPU twin: the capture is
    a call with the capture probe patched, the rest the same."""
    H, M = (4096, 7) if target.gpu else (64, 7)
    p = fc_problem(M, H, 3, BF16, device, key=("regrow",), **VARIANTS["all"])
    out = torch.full((M, p.N), float("nan"), dtype=BF16, device=device)
    run = lambda: eagle3_ops.draft_fc_out(*p.args, p.eps, out)  # noqa: E731
    run()  # verification and compilation (eager)
    need = eagle3_ops.draft_fc_workspace_bytes(*p.args)
    workspace.clear()  # no graph holds these yet: the capture must grow the scratch itself
    stream = torch.cuda.Stream() if target.gpu else None
    on_capture_stream = lambda: torch.cuda.stream(stream) if target.gpu else contextlib.nullcontext()  # noqa: E731
    if target.gpu:
        replay = testing.Replay(run, device, stream=stream, warmup=False)
    else:
        with monkeypatch.context() as m:
            m.setattr(workspace, "_capturing", lambda d: True)
            run()
        replay = testing.Replay(run, device)
    with on_capture_stream():
        held = workspace.buffer(device)
    assert (held is not None) == (need > 0), "the capture did not take its scratch from the face"
    # Eager growth on the capture's stream: a split-K problem larger than any other here.
    big_m = (1000 if target.backend == "cuda" else 64) if target.gpu else 40
    big = fc_problem(big_m, H, 3, BF16, device, key=("regrow-big",), **VARIANTS["all"])
    big_out = torch.empty(big_m, big.N, dtype=BF16, device=device)
    with plans.forced_path("skinny" if target.backend != "reference" else None), on_capture_stream():
        eagle3_ops.draft_fc_out(*big.args, big.eps, big_out)
        grown = workspace.buffer(device)
    if need:
        assert grown is not held, "the larger problem did not grow the scratch"
        assert any(t is held for t in workspace.retired()), "the captured scratch was freed, not retired"
    junk = []
    if target.gpu:
        torch.cuda.synchronize()
        sizes = sorted({t.numel() for t in workspace.retired()} | {1 << 20, 4 << 20, 16 << 20, 64 << 20})
        junk = [torch.full((n,), 7, dtype=torch.uint8, device=device) for n in sizes]
        second = torch.cuda.CUDAGraph()
        with torch.cuda.graph(second, pool=replay.graph.pool()):
            junk += [torch.full((n,), 7, dtype=torch.uint8, device=device) for n in sizes]
        second.replay()
    p.x.copy_(fc_problem(M, H, 3, BF16, device, key=("regrow-new",), rows=True).x)
    out.fill_(float("nan"))
    replay.replay()
    assert all(bool((j == 7).all()) for j in junk), "the replay wrote into memory handed out again"
    assert_close(out, p.truth(), MATMUL_TOL[BF16], normwise=True)


@pytest.mark.parametrize("target,path", params([testing.TRITON_CUDA], ["tiled", "skinny", "cublas"]))
def test_triton_row_offsets_beyond_int32(target, path, device):
    """Row index x row stride past 2^31 elements (int64 offsets): out [M, N] with M*N > 2^31 for the
    tiled and skinny (one split per chunk: S = 2, the reducer writes out) kernels, the prepared input
    [M, K*H] with M*K*H > 2^31 for the cuBLAS path. Only sampled rows are checked against fp64 (the
    last ones are past 2^31). No CPU twin: 2^31-element tensors are beyond the interpreter."""
    gen = testing.generator(device, "int64", path)
    if path == "cublas":
        M, N, K, H = 1 << 17, 16, 2, 8224  # prepared input: 2^17 * 16448 = 2.16e9 elements
    else:
        M, N, K, H = 65539, 32800, 2, 32  # out: 2.15e9 elements
    R = 16
    # bytes: out or prepared input (bf16), plus the skinny path's fp32 partials [2, M, N]
    need = M * max(N, K * H) * 2 * (1 + (4 if path == "skinny" else 0)) + (1 << 30)
    if torch.cuda.mem_get_info()[0] < need:
        pytest.skip(f"needs {need / 2 ** 30:.0f} GiB of free device memory")
    p = testing.FcProblem(testing.randn((R, K * H), BF16, device, gen),
                          testing.randn((N, K * H), BF16, device, gen, scale=(K * H) ** -0.5),
                          bias=testing.randn((N,), BF16, device, gen),
                          rows=torch.randint(0, R, (M,), generator=gen, device=device),
                          chunk_norm_weight=testing.positive((K, H), BF16, device, gen))
    out = torch.empty(M, N, dtype=BF16, device=device)
    try:
        with plans.forced_path(path):
            eagle3_ops.draft_fc_out(*p.args, p.eps, out)
        torch.cuda.synchronize()
        sample = torch.tensor([0, 1, M // 2, M - 2, M - 1], device=device)
        assert_close(out[sample], p.truth(rows=p.rows[sample]), MATMUL_TOL[BF16], normwise=True)
    finally:
        del out
        workspace.clear()  # gigabytes of scratch; no graph holds them
        torch.cuda.empty_cache()


# ---- properties (hypothesis) -------------------------------------------------------------------------
if given is not None:
    @pytest.mark.parametrize("target", params(TARGETS))
    @settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(R=st.integers(1, 12), H=st.integers(1, 24), K=st.integers(1, 4), N=st.integers(1, 20), data=st.data())
    def test_linearity_in_weight(target, device, R, H, K, N, data):
        """draft_fc(x, W1 + W2) == draft_fc(x, W1) + draft_fc(x, W2) (fp32, rows and norms included)."""
        gen = torch.Generator().manual_seed(R * 1000 + H * 10 + K + N)
        x = torch.randn(R, K * H, generator=gen).to(device)
        w1 = torch.randn(N, K * H, generator=gen).to(device)
        w2 = torch.randn(N, K * H, generator=gen).to(device)
        rows = torch.randint(0, R, (data.draw(st.integers(0, 2 * R)),), generator=gen).to(device)
        cn = (torch.rand(K, H, generator=gen) + 0.5).to(device) if data.draw(st.booleans()) else None
        inw = (torch.rand(K * H, generator=gen) + 0.5).to(device) if data.draw(st.booleans()) else None
        a = eagle3_ops.draft_fc(x, w1 + w2, None, rows, cn, inw, 1e-6)
        b = (eagle3_ops.draft_fc(x, w1, None, rows, cn, inw, 1e-6)
             + eagle3_ops.draft_fc(x, w2, None, rows, cn, inw, 1e-6))
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
else:
    @pytest.mark.parametrize("target", params(TARGETS))
    def test_linearity_in_weight(target):
        pytest.skip("hypothesis is not installed (a test dependency: make deps)")


# ---- folded norm weights (eagle3_ops.fold_norm_weights + norm_folded=True) --------------------------------
NORM_VARIANTS = ("chunk_norm", "input_norm", "all")


def _foldable(variant, dtype) -> bool:
    """fp16 folds with a chunk norm only (validation.FOLDED_FP16_INPUT_NORM)."""
    return not (dtype == torch.float16 and VARIANTS[variant].get("inorm"))


def folded_grid(target):
    """(path, M, H, K, N, variant, dtype): every path of the backend with each norm combination."""
    paths = FC_PATHS[target.backend]
    if not target.gpu:
        return [(path, M, 80, 3, 72, v, dt) for path in paths for M in (1, 40) for v in NORM_VARIANTS
                for dt in DTYPES if _foldable(v, dt)]
    return [(path, M, 7168, 3, None, v, dt) for path in paths for M in (1, 16, 64, 256, 1000)
            for v in NORM_VARIANTS for dt in (BF16, torch.float16) if _foldable(v, dt)]


@pytest.mark.parametrize("target,path,M,H,K,N,variant,dtype", params(TARGETS, folded_grid))
def test_folded_norm_weights_match_fp64_of_the_unfolded_fc(target, path, M, H, K, N, variant, dtype, device):
    """draft_fc(x, fold_norm_weights(W, g...), ..., norm_folded=True) against the float64 answer of
    the UNFOLDED problem (original W and norm weights): folding changes one rounding (W * g into the
    dtype) and nothing else, so the tolerance is the unfolded one."""
    p = fc_problem(M, H, K, dtype, device, N=N, key=("folded", path), **VARIANTS[variant])
    before = p.weight.clone()
    folded = eagle3_ops.fold_norm_weights(p.weight, p.chunk_norm_weight, p.input_norm_weight)
    assert folded.data_ptr() != p.weight.data_ptr() and same_bits(p.weight, before)  # a new tensor, W untouched
    out = p.out()
    with plans.forced_path(path):
        testing.run_canaried(lambda: eagle3_ops.draft_fc_out(p.x, folded, p.bias, p.rows, p.chunk_norm_weight,
                                                             p.input_norm_weight, p.eps, out, norm_folded=True),
                             [out], poison=[out])
        functional = eagle3_ops.draft_fc(p.x, folded, p.bias, p.rows, p.chunk_norm_weight, p.input_norm_weight,
                                         p.eps, norm_folded=True)
    truth = p.truth()
    assert_close(out, truth, MATMUL_TOL[dtype], normwise=True, what=f"folded {path}")
    assert_close(functional, truth, MATMUL_TOL[dtype], normwise=True, what=f"folded {path} (functional)")
    # and it is the folded math, not the unfolded one applied to the folded weight (g twice)
    twice = reference.draft_fc_ref(p.x, folded, p.bias, p.rows, p.chunk_norm_weight, p.input_norm_weight, p.eps,
                                   acc_dtype=torch.float64)
    assert rel_err(out, twice, normwise=True) > 10 * MATMUL_TOL[dtype]


@pytest.mark.parametrize("variant", NORM_VARIANTS)
def test_folded_reference_is_the_unfolded_math_in_float64(variant):
    """The reference's folded formula (scales only, input_norm_weight in the chunk statistic) with an
    exact float64 fold equals the unfolded formula to float64 rounding."""
    p = fc_problem(9, 48, 3, torch.float32, "cpu", key=("f64",), **VARIANTS[variant])
    w64 = p.weight.double()
    cn = None if p.chunk_norm_weight is None else p.chunk_norm_weight.double()
    inw = None if p.input_norm_weight is None else p.input_norm_weight.double()
    x64 = p.x.double()
    folded64 = w64 * reference.fold_gains(cn, inw, torch.float64)
    a = reference.draft_fc_ref(x64, w64, None, p.rows, cn, inw, p.eps, acc_dtype=torch.float64)
    b = reference.draft_fc_ref(x64, folded64, None, p.rows, cn, inw, p.eps, acc_dtype=torch.float64,
                               norm_folded=True)
    assert rel_err(b, a, normwise=True) < 1e-13


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fold_norm_weights_rounds_once_and_writes_where_asked(dtype):
    gen = torch.Generator().manual_seed(7)
    K, H, N = 3, 40, 33
    w = testing.randn((N, K * H), dtype, "cpu", gen)
    cn = testing.positive((K, H), dtype, "cpu", gen)
    inw = testing.positive((K * H,), dtype, "cpu", gen)
    assert same_bits(eagle3_ops.fold_norm_weights(w, cn), (w.float() * cn.float().flatten()).to(dtype))
    inplace = w.clone()
    assert eagle3_ops.fold_norm_weights(inplace, cn, out=inplace) is inplace  # in place: the caller's memory
    assert same_bits(inplace, (w.float() * cn.float().flatten()).to(dtype))
    if dtype == torch.float16:  # refused with an input norm (validation.FOLDED_FP16_INPUT_NORM)
        with pytest.raises(ValueError, match="norm_folded with float16 and input_norm_weight is refused"):
            eagle3_ops.fold_norm_weights(w, cn, inw)
        return
    want = (w.float() * (inw.float() * cn.float().flatten())).to(dtype)  # g first, as documented
    assert same_bits(eagle3_ops.fold_norm_weights(w, cn, inw), want)
    assert same_bits(eagle3_ops.fold_norm_weights(w, None, inw), (w.float() * inw.float()).to(dtype))


def test_fold_norm_weights_rejects_what_it_cannot_fold():
    w = torch.randn(8, 12)
    with pytest.raises(ValueError, match="nothing to fold"):
        eagle3_ops.fold_norm_weights(w)
    with pytest.raises(ValueError, match="chunk_norm_weight has 10 elements"):
        eagle3_ops.fold_norm_weights(w, torch.ones(2, 5))
    with pytest.raises(ValueError, match="out is"):
        eagle3_ops.fold_norm_weights(w, None, torch.ones(12), out=torch.empty(8, 12, dtype=torch.float16))
    big = torch.full((2, 4), 300.0, dtype=torch.float16)
    gain = torch.tensor([[1.0, 300.0], [1.0, 1.0]], dtype=torch.float16)
    with pytest.raises(ValueError, match=r"weight\[0, 1\] \* g\[1\] = .* not finite in torch.float16"):
        eagle3_ops.fold_norm_weights(big, gain)
    # a refused fold never leaves a half-written out: every row block is checked before any is written
    many = torch.ones(300, 1 << 16, dtype=torch.float16)  # two row blocks of 256 (64 MB of fp32 each)
    many[299, 7] = 300.0
    gain = torch.ones(2, 1 << 15, dtype=torch.float16)
    gain[0, 7] = 300.0
    out = torch.full_like(many, 2.0)
    with pytest.raises(ValueError, match=r"weight\[299, 7\]"):
        eagle3_ops.fold_norm_weights(many, gain, out=out)
    assert bool((out == 2.0).all())


def test_norm_folded_needs_the_norm_weights():
    x, w = torch.randn(3, 8), torch.randn(4, 8)
    h = torch.randn(3, 8, dtype=torch.float16)
    with pytest.raises(ValueError, match="norm_folded with float16 and input_norm_weight is refused"):
        eagle3_ops.draft_fc(h, w.half(), None, None, None, torch.ones(8, dtype=torch.float16), norm_folded=True)
    with pytest.raises(ValueError, match="norm_folded=True but neither chunk_norm_weight nor input_norm_weight"):
        eagle3_ops.draft_fc(x, w, norm_folded=True)
    with pytest.raises(ValueError, match="norm_folded=True"):
        eagle3_ops.draft_fc_out(x, w, None, None, None, None, 1e-6, torch.empty(3, 4), norm_folded=True)


def test_folded_fp16_keeps_the_skinny_path():
    """Unfolded fp16 with norm weights leaves the skinny kernels (x * g could overflow fp16); with the
    weights folded x is never multiplied, so skinny serves it."""
    from eagle3_ops.triton import draft_fc as triton_fc

    x = torch.empty(4, 3 * 64, dtype=torch.float16)
    w = torch.empty(64, 3 * 64, dtype=torch.float16)
    cn = torch.empty(3, 64, dtype=torch.float16)
    with plans.forced_path("skinny"):
        assert triton_fc.plan(x, w, None, None, cn, None).path == "tiled"
        assert triton_fc.plan(x, w, None, None, cn, None, norm_folded=True).path == "skinny"


# ---- opcheck and torch.compile ---------------------------------------------------------------------------
def fc_samples(device):
    gen = torch.Generator().manual_seed(2)
    for R, H, K, N, opts in ((4, 64, 3, 32, ()), (9, 32, 2, 48, ("bias", "rows", "chunk", "inorm")),
                             (1, 64, 1, 16, ("rows",))):
        x = torch.randn(R, K * H, generator=gen).to(device)
        w = torch.randn(N, K * H, generator=gen).to(device)
        yield (x, w, torch.randn(N, generator=gen).to(device) if "bias" in opts else None,
               torch.tensor([R - 1, 0, R // 2], device=device) if "rows" in opts else None,
               torch.rand(K, H, generator=gen).to(device) if "chunk" in opts else None,
               torch.rand(K * H, generator=gen).to(device) if "inorm" in opts else None, 1e-6, "folded" in opts)


def fc_sample(device, index):
    """(x, weight, bias, rows, chunk_norm_weight, input_norm_weight, eps, norm_folded); index 3 is
    index 1 with its norm weights folded into the weight."""
    samples = list(fc_samples(device))
    if index < 3:
        return samples[index]
    x, w, b, rows, cn, inw, eps, _ = samples[1]
    return (x, eagle3_ops.fold_norm_weights(w, cn, inw), b, rows, cn, inw, eps, True)


@pytest.mark.parametrize("sample", range(4))
@pytest.mark.parametrize("target", params(TARGETS))
def test_opcheck_draft_fc(target, sample, device):
    torch.library.opcheck(torch.ops.eagle3.draft_fc.default, fc_sample(device, sample))


@pytest.mark.parametrize("sample", range(4))
@pytest.mark.parametrize("target", params(TARGETS))
def test_opcheck_draft_fc_out(target, sample, device):
    args = fc_sample(device, sample)
    x, w, _, rows = args[:4]
    M = x.shape[0] if rows is None else rows.shape[0]
    out = torch.empty(M, w.shape[0], device=device)
    torch.library.opcheck(torch.ops.eagle3.draft_fc_out.default, (*args[:7], out, None, args[7]))


@pytest.mark.parametrize("target", params(TARGETS))
def test_torch_compile_fullgraph_draft_input_path(target, device):
    """The three ops in one fullgraph torch.compile (aot_eager) give eager's results and side effects."""
    T, H, K, N = 6, 64, 3, 32
    gen = torch.Generator().manual_seed(3)
    hs = [torch.randn(T, H, generator=gen).to(device) for _ in range(K)]
    rs = [torch.randn(T, H, generator=gen).to(device) for _ in range(K)]
    w = torch.randn(N, K * H, generator=gen).to(device)
    norm_w = torch.rand(H, generator=gen).to(device)
    chunk_w = torch.rand(K, H, generator=gen).to(device)
    rows = torch.tensor([5, 0, 2], device=device)

    def path(buffer, x0, r0):
        eagle3_ops.fused_add_rmsnorm_capture(x0, r0, norm_w, 1e-6, buffer, 0)
        for k in range(1, K):
            eagle3_ops.capture(hs[k], rs[k], buffer, k)
        return eagle3_ops.draft_fc(buffer[:T], w, None, rows, chunk_w, None, 1e-6) * 2.0

    eager_buf, comp_buf = torch.zeros(T, K * H, device=device), torch.zeros(T, K * H, device=device)
    e_x, e_r = hs[0].clone(), rs[0].clone()
    c_x, c_r = hs[0].clone(), rs[0].clone()
    want = path(eager_buf, e_x, e_r)
    got = torch.compile(path, fullgraph=True, backend="aot_eager")(comp_buf, c_x, c_r)
    assert torch.equal(got, want)
    assert torch.equal(comp_buf, eager_buf) and torch.equal(c_x, e_x) and torch.equal(c_r, e_r)


@pytest.mark.parametrize("target", params(TARGETS))
def test_torch_compile_inductor(target, device):
    x = torch.randn(5, 96, device=device)
    w = torch.randn(16, 96, device=device)
    fn = torch.compile(lambda a: eagle3_ops.draft_fc(a, w) + 1.0, fullgraph=True)
    torch.testing.assert_close(fn(x), eagle3_ops.draft_fc(x, w) + 1.0)


def test_fake_impl_reports_bad_shapes_at_trace_time():
    w = torch.randn(16, 96)
    fn = torch.compile(lambda a: eagle3_ops.draft_fc(a, w), fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match="weight has shape"):
        fn(torch.randn(5, 95))


# ---- argument validation (once, on the CPU; out-of-range host rows: test_out_of_range_rows) --------------
H, K, R, N = 64, 3, 6, 32


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
    "rows wrong dtype": (dict(rows=torch.tensor([0.0, 1.0])), "rows has dtype torch.float32"),
    "rows 2-D": (dict(rows=torch.tensor([[0, 1]])), "rows must be 1-D"),
    "chunk norm weight shape": (dict(chunk_norm_weight=torch.rand(K, H + 1)), "chunk_norm_weight has shape"),
    "input norm weight shape": (dict(input_norm_weight=torch.rand(K * H - 1)), "input_norm_weight has shape"),
    "x dtype mismatch": (dict(weight=torch.randn(N, K * H).half()), "weight has dtype"),
    "x non-contiguous": (dict(x=torch.randn(K * H, R).t()), "x must have a contiguous last dim"),
}


@pytest.mark.parametrize("case", list(FC_BAD))
def test_rejects_bad_input_before_writing(case):
    over, message = FC_BAD[case]
    args = _fc_args(**over)
    M = args["rows"].shape[0] if args["rows"].dim() == 1 else 2
    out = torch.full((M, N), 7.0)
    with pytest.raises(ValueError, match=message):
        eagle3_ops.draft_fc_out(**args, out=out)
    assert torch.equal(out, torch.full((M, N), 7.0)), "out changed although the call was rejected"
    with pytest.raises(ValueError, match=message):
        eagle3_ops.draft_fc(**args)


def test_rejects_wrong_out_shape():
    args = _fc_args()
    out = torch.full((4, N), 7.0)
    with pytest.raises(ValueError, match=r"out has shape \(4, 32\), expected \(3, 32\)"):
        eagle3_ops.draft_fc_out(**args, out=out)
    assert torch.equal(out, torch.full((4, N), 7.0))


def test_rejects_norms_on_empty_width():
    with pytest.raises(ValueError, match="input_norm_weight given but x has width 0"):
        eagle3_ops.draft_fc(torch.randn(3, 0), torch.randn(4, 0), None, None, None, torch.randn(0), 1e-6)
    with pytest.raises(ValueError, match="chunk_norm_weight given but x has width 0"):
        eagle3_ops.draft_fc(torch.randn(3, 0), torch.randn(4, 0), None, None, torch.randn(0, 8), None, 1e-6)
