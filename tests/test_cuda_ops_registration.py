"""The compiled CUDA backend as torch ops (namespace ``eagle3_cuda``, csrc/bindings.cpp): the ops are
registered with the agreed schemas, the kernels are CUDA-only (plus do-nothing Meta kernels for
tracing) while the workspace size query is a catch-all op (so it runs here, on the CPU), the query's bytes for a
few shapes and paths, ``cuda_backend``'s plan (path, splits, workspace bytes) against the query, and, on a GPU (marker
``gpu``), each op against the reference.

Needs the extension: skipped where no nvcc was found at install time (as tests/test_build.py)."""
import math
import os
import re
import shutil

import pytest
import torch

from eagle3_ops import cuda_backend, plans, reference, skinny_model
from eagle3_ops.workspace import ALIGN, aligned


def _nvcc_expected() -> bool:
    return shutil.which("nvcc") is not None and os.environ.get("EAGLE3_OPS_SKIP_CUDA", "0") != "1"


pytestmark = pytest.mark.skipif(not _nvcc_expected(),
                                reason="no nvcc on PATH (or EAGLE3_OPS_SKIP_CUDA=1): the extension is not built")

SCHEMAS = {
    "capture": "eagle3_cuda::capture(Tensor hidden, Tensor? residual, Tensor(a!) buffer, int slot) -> ()",
    "fused_add_rmsnorm_capture": (
        "eagle3_cuda::fused_add_rmsnorm_capture(Tensor(a!) input, Tensor(b!) residual, Tensor weight, float eps, "
        "Tensor(c!) buffer, int slot) -> ()"),
    "draft_fc": (
        "eagle3_cuda::draft_fc(Tensor x, Tensor weight, Tensor? bias, Tensor? rows, Tensor? chunk_norm_weight, "
        "Tensor? input_norm_weight, float eps, Tensor(a!) out, Tensor(b!)? workspace, int path, int splits, "
        "bool norm_folded=False, int block_rows=64, int stages=0) -> ()"),
    "draft_fc_workspace_bytes": (
        "eagle3_cuda::draft_fc_workspace_bytes(int M, int N, int KH, int K, bool chunk_norm, bool input_norm, "
        "int path, int splits, ScalarType dtype, bool norm_folded=False) -> int"),
    "skinny_occupancy": ("eagle3_cuda::skinny_occupancy(int nt, ScalarType dtype, int block_rows=64, int stages=0) "
                         "-> int"),
}
SKINNY, TILED, CUBLAS = (plans.PATHS.index(p) for p in ("skinny", "tiled", "cublas"))


@pytest.fixture(scope="module")
def ops():
    ext = cuda_backend.cuda_extension()
    assert ext is not None, "nvcc is present but eagle3_ops._C was not built/importable"
    assert cuda_backend.ops_registered(), "eagle3_ops._C imports but registers no eagle3_cuda ops"
    return torch.ops.eagle3_cuda


# ---- registration ------------------------------------------------------------------------------------
def test_ops_are_registered_with_the_agreed_schemas(ops):
    assert set(cuda_backend.OPS) == set(SCHEMAS)
    for name, schema in SCHEMAS.items():
        assert str(getattr(ops, name).default._schema) == schema, name


def test_kernels_are_cuda_only_and_the_size_query_is_a_catch_all(ops):
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    for name in ("capture", "fused_add_rmsnorm_capture", "draft_fc"):
        assert has(f"eagle3_cuda::{name}", "CUDA") and not has(f"eagle3_cuda::{name}", "CPU"), name
    assert has("eagle3_cuda::draft_fc_workspace_bytes", "CompositeImplicitAutograd")
    assert has("eagle3_cuda::skinny_occupancy", "CompositeImplicitAutograd")
    x, w = torch.zeros(2, 8), torch.zeros(4, 8)
    with pytest.raises(NotImplementedError):  # no CPU kernel: the dispatcher says so
        ops.draft_fc(x, w, None, None, None, None, 1e-6, torch.zeros(2, 4), None, CUBLAS, 0)


def test_ops_have_meta_kernels_so_they_trace_without_data(ops):
    """Meta / FakeTensor (torch.compile tracing): the ops write into their arguments and return
    nothing, so their meta kernels do nothing and accept any device-less tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    def run(device):
        x = torch.empty(8, 64, device=device, dtype=torch.bfloat16)
        w = torch.empty(16, 64, device=device, dtype=torch.bfloat16)
        buf = torch.empty(8, 128, device=device, dtype=torch.bfloat16)
        ops.capture(x, None, buf, 1)
        ops.fused_add_rmsnorm_capture(x, x.clone(), torch.empty(64, device=device, dtype=torch.bfloat16), 1e-6, buf, 1)
        ops.draft_fc(x, w, None, None, None, None, 1e-6, torch.empty(8, 16, device=device, dtype=torch.bfloat16),
                     torch.empty(512, device=device, dtype=torch.uint8), CUBLAS, 0)

    run("meta")
    with FakeTensorMode():
        run("cpu")


def test_the_python_module_carries_only_compiled_archs(ops):
    # The ops live in torch.library; the module itself holds the arch list, nothing else (the host-side
    # acceptance twins and plan keys it once carried are gone: issue 39).
    ext = cuda_backend.cuda_extension()
    assert {n for n in dir(ext) if not n.startswith("__")} == {"compiled_archs"}
    assert cuda_backend.compiled_archs() == tuple(ext.compiled_archs.split(","))
    assert not cuda_backend.serves(torch.device("cpu"))


# ---- the size query ----------------------------------------------------------------------------------
def skinny_bytes(M, N, KH, K, chunk, inorm, splits, folded=False, elem=2):
    """The skinny path's workspace, computed independently of the C++ (draft_fc.cu's split rule:
    steps of 64, at least 8 per split, at most 64 splits; then partials [S][M][N] fp32, the norm
    pre-pass's piece sums [M][NC * ceil(CH / 1024)][2] fp32, x*g [M][KH] unless folded; 256-byte
    aligned regions)."""
    CH, NC = (KH // K, K) if chunk else (KH, 1)
    step = 64
    per_chunk = max(1, min(splits, CH // (8 * step), 64 // NC))
    split_len = math.ceil(math.ceil(CH / per_chunk) / step) * step
    S = NC * math.ceil(CH / split_len)
    norm = chunk or inorm
    total = aligned(S * M * N * 4) if S > 1 or norm else 0
    if norm:
        total += aligned(M * NC * math.ceil(CH / 1024) * 2 * 4) + (0 if folded else aligned(M * KH * elem))
    return total


QUERY_CASES = [  # (M, N, KH, K, chunk_norm, input_norm, path, splits, dtype, folded, bytes worked out by hand)
    # S = 3: partials 3*7*72*4 = 6048 -> 6144; sums 7*3*2*4 = 168 -> 256; x*g 7*240*2 = 3360 -> 3584
    (7, 72, 240, 3, True, True, SKINNY, 4, torch.bfloat16, False, 6144 + 256 + 3584),
    (7, 72, 240, 3, True, True, SKINNY, 4, torch.bfloat16, True, 6144 + 256),  # folded: no x*g
    # 8 splits x 3 chunks: 24*7*4096*4 = 2752512; sums 7*12*8 = 672 -> 768; x*g 7*12288*2 = 172032
    (7, 4096, 3 * 4096, 3, True, True, SKINNY, 16, torch.bfloat16, False, 2752512 + 768 + 172032),
    (7, 4096, 3 * 4096, 1, False, False, SKINNY, 16, torch.float16, False, 1835008),  # S = 16, no norm
    (1000, 4096, 3 * 4096, 1, False, False, SKINNY, 1, torch.bfloat16, False, 0),  # one split, no norm: out directly
    (7, 72, 240, 3, False, True, CUBLAS, 0, torch.bfloat16, False, 3584),  # prepared input 7*240*2 = 3360 -> 3584
    (7, 72, 240, 3, True, False, CUBLAS, 0, torch.float32, False, 6912),  # 6720 -> 6912
    (0, 72, 240, 3, True, True, SKINNY, 4, torch.bfloat16, False, 0),  # nothing to compute
]


@pytest.mark.parametrize("M,N,KH,K,chunk,inorm,path,splits,dtype,folded,want", QUERY_CASES)
def test_size_query_bytes(ops, M, N, KH, K, chunk, inorm, path, splits, dtype, folded, want):
    got = ops.draft_fc_workspace_bytes(M, N, KH, K, chunk, inorm, path, splits, dtype, folded)
    assert got == want
    assert got % ALIGN == 0
    if path == SKINNY and M > 0:
        assert got == skinny_bytes(M, N, KH, K, chunk, inorm, splits, folded)


@pytest.mark.parametrize("M", [1, 7, 64, 128, 1000])
@pytest.mark.parametrize("K,chunk,inorm", [(3, True, True), (1, False, False), (3, False, True), (48, True, False)])
@pytest.mark.parametrize("splits", [1, 3, 16, 1000])
@pytest.mark.parametrize("folded", [False, True])
def test_size_query_follows_the_split_rule(ops, M, K, chunk, inorm, splits, folded):
    N, KH = 1000, 3 * 1024
    got = ops.draft_fc_workspace_bytes(M, N, KH, K, chunk, inorm, SKINNY, splits, torch.bfloat16, folded)
    assert got == skinny_bytes(M, N, KH, K, chunk, inorm, splits, folded)


@pytest.mark.parametrize("args,match", [
    ((7, 72, 240, 3, True, True, TILED, 4, torch.bfloat16), "tiled, is a Triton kernel only"),
    ((7, 72, 240, 3, True, True, SKINNY, 4, torch.float32), "bf16/fp16 only"),
    ((7, 72, 240, 7, True, True, SKINNY, 4, torch.bfloat16), "equal, non-zero width"),
    ((7, 72, 0, 1, False, False, SKINNY, 4, torch.bfloat16), "K\\*H > 0"),
    ((7, 72, 65 * 8, 65, True, False, SKINNY, 1, torch.bfloat16), "exceed the reducer's 64"),
    ((7, 72, 240, 3, True, True, SKINNY, 0, torch.bfloat16), "splits >= 1"),
    ((7, 72, 240, 3, True, True, CUBLAS, 0, torch.int32), "unsupported dtype"),
])
def test_size_query_rejects_what_the_kernels_cannot_launch(ops, args, match):
    with pytest.raises(RuntimeError, match=match):
        ops.draft_fc_workspace_bytes(*args)


# ---- cuda_backend's plan against the query -------------------------------------------------------------


H200 = skinny_model.DEVICES["H200"]


@pytest.fixture
def h200_sms(monkeypatch):
    """cuda_backend asks the GPU for its SM count (its device model) and the skinny kernel's
    occupancy; here (CPU tensors) they are an H200's: 132 SMs, occupancy from the sm_90a tables."""
    monkeypatch.setattr(cuda_backend, "device_model", lambda device: H200)
    monkeypatch.setattr(cuda_backend, "skinny_blocks_per_sm",
                        lambda device, shape, dtype: cuda_backend.table_blocks_per_sm("sm_90", shape, dtype))


def test_skinny_occupancy_needs_a_gpu(ops):
    """The occupancy query asks the CUDA runtime about the kernel: no GPU, no answer (an error,
    never a made-up number); cuda_backend then never plans (the backend does not serve)."""
    if torch.cuda.is_available():
        assert ops.skinny_occupancy(8, torch.bfloat16) >= 1
        return
    with pytest.raises(RuntimeError):
        ops.skinny_occupancy(8, torch.bfloat16)


@pytest.mark.parametrize("nt,rows,stages", [(8, 96, 0), (1, 128, 0), (8, 128, 5), (8, 64, 4), (8, -64, 0)])
def test_skinny_occupancy_names_the_block_shapes_built(ops, nt, rows, stages):
    """A block shape that was not built is refused before any CUDA call (so also without a GPU),
    and the message lists the ones that were for that token tile."""
    built = ", ".join(f"({r} rows, {st} stages)" for n, r, st in skinny_model.SKINNY_SHAPES if n == nt)
    with pytest.raises(RuntimeError, match=re.escape(f"block_rows={rows}, stages={stages}; built: {built}")):
        ops.skinny_occupancy(nt, torch.bfloat16, rows, stages)


def fc_args(M, H, K, N, dtype, bias=False, rows=False, chunk=False, inorm=False, device="cpu"):
    gen = torch.Generator().manual_seed(M * 1000 + H)
    R = M + 3
    x = torch.randn(R, K * H, generator=gen).to(device=device, dtype=dtype)
    w = torch.randn(N, K * H, generator=gen).to(device=device, dtype=dtype)
    b = torch.randn(N, generator=gen).to(device=device, dtype=dtype) if bias else None
    r = torch.randint(0, R, (M,), generator=gen).to(device) if rows else None
    cn = torch.rand(K, H, generator=gen).add(0.5).to(device=device, dtype=dtype) if chunk else None
    inw = torch.rand(K * H, generator=gen).add(0.5).to(device=device, dtype=dtype) if inorm else None
    return x, w, b, r, cn, inw


def expected_plan(M, N, KH, NC, norm, dtype, folded=False):
    """(splits, block rows, stages): the planner's answer for this launch on an H200
    (tests/ops/test_kernel_plans.py tests the planner)."""
    nt = {1: 1, 2: 2, 3: 4, 4: 4}.get(math.ceil(min(M, 64) / 8), 8)
    shapes = skinny_model.shapes_for(nt)
    kernels = tuple(cuda_backend.kernel_model("sm_90", shape, dtype) for shape in shapes)
    bpsm = tuple(cuda_backend.table_blocks_per_sm("sm_90", shape, dtype) for shape in shapes)
    k, splits, _ = cuda_backend.skinny_choice(M, N, KH // NC, NC, H200, kernels, bpsm, norm, folded)
    return splits, k.rows, k.stages


VARIANTS = {"plain": {}, "rows": dict(rows=True), "norms": dict(chunk=True, inorm=True),
            "all": dict(bias=True, rows=True, chunk=True, inorm=True)}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("forced", ["skinny", "tiled", "cublas", None])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("M", [7, 300])
def test_backend_plan_agrees_with_the_size_query(ops, h200_sms, variant, forced, dtype, M):
    kw = VARIANTS[variant]
    args = fc_args(M, 256, 3, 200, dtype, **kw)
    x, w, b, rows, cn, inw = args
    M = rows.numel() if rows is not None else x.shape[0]  # fc_args gives x M + 3 rows
    with plans.forced_path(forced):
        p = cuda_backend.plan(*args)
        assert cuda_backend.draft_fc_workspace_bytes(*args) == p.nbytes
    # the path: forced tiled has no CUDA kernel; fp32 and fp16 with norms never go skinny
    table = plans.choose("cuda", x.device, M)
    want_skinny = (forced or table) == "skinny" and dtype != torch.float32 and not (
        dtype == torch.float16 and (cn is not None or inw is not None))
    assert p.path == ("skinny" if want_skinny else "cublas")
    NC = 3 if cn is not None else 1
    norm = cn is not None or inw is not None
    want_plan = expected_plan(M, 200, 768, NC, norm, dtype) if want_skinny else (0, 64, 0)
    assert (p.splits, p.block_rows, p.stages) == want_plan
    assert p.copy_bytes == 0
    prepares = p.path == "skinny" or rows is not None or cn is not None or inw is not None
    path = cuda_backend.PATH_INDEX[p.path]
    want = ops.draft_fc_workspace_bytes(M, 200, 768, NC, cn is not None, inw is not None, path, p.splits, dtype, False)
    assert p.op_bytes == (want if prepares else 0)


def test_backend_plan_copies_strided_views_and_falls_back_on_layouts_skinny_cannot_take(ops, h200_sms):
    x, w, b, rows, cn, inw = fc_args(7, 256, 3, 200, torch.bfloat16, bias=True, rows=True, chunk=True, inorm=True)
    with plans.forced_path("skinny"):
        base = cuda_backend.plan(x, w, b, rows, cn, inw)
        assert base.path == "skinny" and base.copy_bytes == 0
        # strided 1-D views: one aligned copy each, first in the workspace; skinny still serves
        sb, sr, si = (torch.stack([t, t], 1).reshape(-1)[::2] for t in (b, rows, inw))
        p = cuda_backend.plan(x, w, sb, sr, cn, si)
        assert p.path == "skinny" and p.op_bytes == base.op_bytes
        assert p.copy_bytes == aligned(200 * 2) + aligned(7 * 8) + aligned(768 * 2)
        # x not 16-byte aligned, or a row stride that is not a multiple of 8: cuBLAS
        xs = torch.zeros(8, 768 + 1, dtype=torch.bfloat16)[:, 1:]
        assert cuda_backend.plan(xs, w, b, rows, cn, inw).path == "cublas"
        xp = torch.zeros(10, 768 + 4, dtype=torch.bfloat16)[:, :768]
        assert cuda_backend.plan(xp, w, b, rows, cn, inw).path == "cublas"
        # a chunk width that is not a multiple of 8; more chunks than the reducer takes
        x2, w2, _, r2, cn2, _ = fc_args(7, 12, 64, 200, torch.bfloat16, rows=True, chunk=True)
        assert cuda_backend.plan(x2, w2, None, r2, cn2, None).path == "cublas"
        x3, w3, _, r3, cn3, _ = fc_args(7, 8, 96, 200, torch.bfloat16, rows=True, chunk=True)
        assert cuda_backend.plan(x3, w3, None, r3, cn3, None).path == "cublas"
    with plans.forced_path("cublas"):
        assert cuda_backend.draft_fc_workspace_bytes(x, w, b, None, None, None) == 0  # x straight to cuBLAS
        assert cuda_backend.draft_fc_workspace_bytes(x, w, b, rows, None, None) == aligned(7 * 768 * 2)


def test_backend_plan_on_meta_tensors_matches_real_ones(ops, h200_sms):
    for variant in VARIANTS.values():
        args = fc_args(7, 256, 3, 200, torch.bfloat16, **variant)
        meta = tuple(t.to("meta") if t is not None else None for t in args)
        for forced in ("skinny", "cublas"):
            with plans.forced_path(forced):
                assert cuda_backend.plan(*meta) == cuda_backend.plan(*args)


def test_backend_plan_takes_cublas_where_no_skinny_block_can_be_resident(ops, h200_sms, monkeypatch, caplog):
    """Should the runtime answer 0 resident blocks for every block shape of a token tile, the plan is
    cuBLAS, with one warning, never an error in the call."""
    import logging

    monkeypatch.setattr(cuda_backend, "skinny_blocks_per_sm", lambda device, shape, dtype: 0)
    cuda_backend._note_unlaunchable.cache_clear()
    x, w, b, rows, cn, inw = fc_args(64, 256, 3, 200, torch.bfloat16)
    with plans.forced_path("skinny"), caplog.at_level(logging.WARNING, logger="eagle3_ops"):
        p = cuda_backend.plan(x, w, b, rows, cn, inw)
        assert cuda_backend.plan(x, w, b, rows, cn, inw) == p
    assert p.path == "cublas" and p.splits == 0
    warned = [r.getMessage() for r in caplog.records if "0 resident blocks" in r.getMessage()]
    assert len(warned) == 1 and "cublas" in warned[0], warned


def test_backend_plan_decides_on_weights_device(ops, h200_sms, monkeypatch):
    """x (and rows) may be meta tensors when sizing a workspace for a larger M (ops.py): the path
    table and the occupancy are weight's device's, so a meta x plans exactly as a real one."""
    seen = []
    real_choose = plans.choose
    monkeypatch.setattr(plans, "choose", lambda backend, device, M: seen.append(device.type) or
                        real_choose(backend, device, M))
    args = fc_args(100, 256, 3, 200, torch.bfloat16, rows=True)
    x, w, b, rows, cn, inw = args
    got = cuda_backend.plan(x.to("meta"), w, b, rows.to("meta"), cn, inw)
    assert got == cuda_backend.plan(*args) and seen == ["cpu", "cpu"]


# ---- on a GPU: each op against the reference ----------------------------------------------------------
def _gpu_device():
    dev = torch.device("cuda", torch.cuda.current_device())
    if not cuda_backend.serves(dev):
        pytest.skip(f"extension not built for {cuda_backend.device_arch(dev)} (built: {cuda_backend.compiled_archs()})")
    return dev


@pytest.mark.gpu
@pytest.mark.parametrize("H", [4096, 1002])  # 1002: the unaligned launch
@pytest.mark.parametrize("residual", [False, True])
def test_gpu_capture_matches_the_reference(ops, H, residual):
    dev = _gpu_device()
    gen = torch.Generator(device=dev).manual_seed(1)
    T, K, slot = 37, 3, 1
    hidden = torch.randn(T, H, generator=gen, device=dev).to(torch.bfloat16)
    res = torch.randn(T, H, generator=gen, device=dev).to(torch.bfloat16) if residual else None
    got = torch.full((T + 2, K * H), float("nan"), device=dev, dtype=torch.bfloat16)
    want = got.clone()
    ops.capture(hidden, res, got, slot)
    reference.capture_ref(hidden, res, want, slot)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())


@pytest.mark.gpu
# 1002: scalar, 1 element per thread; 16382: scalar, 32 per thread (fused_row_kernel<T, 1, 32>, 512
# threads: the variant whose stack frame was removed); 20000: the two-pass kernel
@pytest.mark.parametrize("H", [4096, 1002, 16382, 20000])
def test_gpu_fused_add_rmsnorm_capture_matches_the_reference(ops, H):
    dev = _gpu_device()
    gen = torch.Generator(device=dev).manual_seed(2)
    T, K, slot = 37, 3, 2
    inp = torch.randn(T, H, generator=gen, device=dev).to(torch.bfloat16)
    res = torch.randn(T, H, generator=gen, device=dev).to(torch.bfloat16)
    weight = torch.rand(H, generator=gen, device=dev).add(0.5).to(torch.bfloat16)
    buf = torch.zeros(T, K * H, device=dev, dtype=torch.bfloat16)
    inp2, res2, buf2 = inp.clone(), res.clone(), buf.clone()
    ops.fused_add_rmsnorm_capture(inp, res, weight, 1e-6, buf, slot)
    reference.fused_add_rmsnorm_capture_ref(inp2, res2, weight, 1e-6, buf2, slot)
    assert torch.equal(res, res2) and torch.equal(buf, buf2)  # one rounding of the same fp32 sum
    torch.testing.assert_close(inp.float(), inp2.float(), rtol=2 ** -7, atol=1e-6)  # rsqrt / sum order


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("forced", ["skinny", "cublas", None])
@pytest.mark.parametrize("M", [7, 300])
def test_gpu_draft_fc_matches_the_reference(ops, variant, forced, M):
    dev = _gpu_device()
    args = fc_args(M, 4096, 3, 1000, torch.bfloat16, device=dev, **VARIANTS[variant])
    x, w, b, rows, cn, inw = args
    want = reference.draft_fc_ref(*args, 1e-6, acc_dtype=torch.float64)
    outs = []
    for _ in range(2):
        with plans.forced_path(forced):
            need = cuda_backend.draft_fc_workspace_bytes(*args)
            ws = torch.empty(need, dtype=torch.uint8, device=dev) if need else None
            out = torch.full((M, 1000), float("nan"), dtype=torch.bfloat16, device=dev)
            cuda_backend.draft_fc(*args, 1e-6, out, ws)
        outs.append(out)
    torch.cuda.synchronize()
    err = ((outs[0].double() - want).abs().max() / want.abs().max()).item()
    assert err <= 1e-2, err
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))  # deterministic


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gpu_skinny_occupancy_matches_the_register_table(ops, dtype):
    """What the CUDA runtime reports for each skinny kernel is what the cubin tables
    (cuda_backend.SKINNY_REGISTERS and the ring's shared memory, checked against the cubins in
    tests/test_build.py) and the occupancy rule predict; the planner uses the runtime's number on
    the device."""
    dev = _gpu_device()
    arch = cuda_backend.device_arch(dev)
    for shape in skinny_model.SKINNY_SHAPES:  # incl. 0 for a ring beyond the device's shared memory per block
        nt, rows, stages = shape
        got = ops.skinny_occupancy(nt, dtype, rows, stages)
        assert got == cuda_backend.table_blocks_per_sm(arch, shape, dtype), (shape, got)
        assert cuda_backend.skinny_blocks_per_sm(dev, shape, dtype) == got
    assert ops.skinny_occupancy(8, dtype) == ops.skinny_occupancy(8, dtype, 64, 3)  # the defaults: the 64-row block


@pytest.mark.gpu
def test_gpu_draft_fc_op_checks_memory_safety(ops):
    dev = _gpu_device()
    x, w, b, rows, cn, inw = fc_args(7, 4096, 3, 1000, torch.bfloat16, device=dev, bias=True, rows=True, chunk=True,
                                     inorm=True)
    out = torch.empty(7, 1000, dtype=torch.bfloat16, device=dev)
    need = ops.draft_fc_workspace_bytes(7, 1000, 3 * 4096, 3, True, True, SKINNY, 4, torch.bfloat16)
    ws = torch.empty(need + 16, dtype=torch.uint8, device=dev)
    ops.draft_fc(x, w, b, rows, cn, inw, 1e-6, out, ws[:need], SKINNY, 4)  # exactly enough
    with pytest.raises(RuntimeError, match="workspace has"):
        ops.draft_fc(x, w, b, rows, cn, inw, 1e-6, out, ws[:need - 1], SKINNY, 4)
    with pytest.raises(RuntimeError, match="16-byte aligned"):
        ops.draft_fc(x, w, b, rows, cn, inw, 1e-6, out, ws[1:need + 1], SKINNY, 4)
    with pytest.raises(RuntimeError, match="needs a workspace"):
        ops.draft_fc(x, w, b, rows, cn, inw, 1e-6, out, None, CUBLAS, 0)
    xs = torch.zeros(8, 3 * 4096 + 1, dtype=torch.bfloat16, device=dev)[:, 1:]
    with pytest.raises(RuntimeError, match="skinny path needs"):
        ops.draft_fc(xs, w, b, rows, cn, inw, 1e-6, out, ws[:need], SKINNY, 4)
    with pytest.raises(RuntimeError, match="stride 1"):
        ops.draft_fc(x, w, torch.stack([b, b], 1).reshape(-1)[::2], rows, cn, inw, 1e-6, out, ws[:need], SKINNY, 4)
    # 7 tokens: a tile of 8, which has only the 64-row block
    with pytest.raises(RuntimeError, match="no skinny kernel with block_rows=128, stages=0 for M=7"):
        ops.draft_fc(x, w, b, rows, cn, inw, 1e-6, out, ws[:need], SKINNY, 4, False, 128, 0)


@pytest.mark.gpu
def test_gpu_a_ring_larger_than_the_device_allows_is_refused_before_any_launch(ops):
    """The 128-row, 6-stage ring (144 KB) fits sm_90's 227 KB per block, not sm_120's 99 KB: there the
    op refuses it with the sizes, before the norm pre-pass runs; here it runs."""
    dev = _gpu_device()
    x, w, b, rows, cn, inw = fc_args(64, 1024, 3, 256, torch.bfloat16, device=dev, rows=True, chunk=True, inorm=True)
    need = ops.draft_fc_workspace_bytes(64, 256, 3 * 1024, 3, True, True, SKINNY, 2, torch.bfloat16)
    ws = torch.empty(need, dtype=torch.uint8, device=dev)
    out = torch.full((64, 256), float("nan"), dtype=torch.bfloat16, device=dev)
    ring = skinny_model.shared_bytes(8, 128, 6)
    if torch.cuda.get_device_properties(dev).shared_memory_per_block_optin < ring:
        with pytest.raises(RuntimeError, match=f"needs {ring} bytes of shared memory per block; this device allows"):
            ops.draft_fc(x, w, b, rows, cn, inw, 1e-6, out, ws, SKINNY, 2, False, 128, 6)
        torch.cuda.synchronize()
        assert torch.isnan(out).all()  # nothing ran
    else:
        ops.draft_fc(x, w, b, rows, cn, inw, 1e-6, out, ws, SKINNY, 2, False, 128, 6)
        want = reference.draft_fc_ref(x, w, b, rows, cn, inw, 1e-6, acc_dtype=torch.float64)
        assert ((out.double() - want).abs().max() / want.abs().max()).item() <= 1e-2


@pytest.mark.gpu
def test_gpu_every_block_shape_replays_in_a_cuda_graph(ops):
    """Each skinny block shape of 64 tokens this device can hold — the dynamic-shared-memory rings
    included (their launch sets the kernel's shared-memory attribute, also while capturing) —
    captured in a CUDA graph and replayed on new x equals the float64 answer for the new x."""
    dev = _gpu_device()
    arch = cuda_backend.device_arch(dev)
    x, w, b, rows, cn, inw = fc_args(64, 1024, 3, 896, torch.bfloat16, device=dev, bias=True, rows=True, chunk=True,
                                     inorm=True)
    need = ops.draft_fc_workspace_bytes(64, 896, 3 * 1024, 3, True, True, SKINNY, 3, torch.bfloat16)
    ws = torch.empty(need, dtype=torch.uint8, device=dev)
    for nt, rows_per_block, stages in skinny_model.shapes_for(8):
        if cuda_backend.table_blocks_per_sm(arch, (nt, rows_per_block, stages), torch.bfloat16) == 0:
            continue
        out = torch.full((64, 896), float("nan"), dtype=torch.bfloat16, device=dev)
        def run(out=out, rows_per_block=rows_per_block, stages=stages):
            return ops.draft_fc(x, w, b, rows, cn, inw, 1e-6, out, ws, SKINNY, 3, False, rows_per_block, stages)

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run()  # warm-up off the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        x.copy_(torch.randn_like(x, dtype=torch.float32).to(torch.bfloat16))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want = reference.draft_fc_ref(x, w, b, rows, cn, inw, 1e-6, acc_dtype=torch.float64)
        err = ((out.double() - want).abs().max() / want.abs().max()).item()
        assert err <= 1e-2, (rows_per_block, stages, err)


SPLIT_SWEEP = [  # (M, H, K, N): every token tile (NT 1, 2, 4, 8 and two tiles of 8), N with a weight-row
    # tail and the sharded Kimi-K2.5 width, chunk widths with a partial last 64-wide step (1000)
    (1, 4096, 3, 896), (8, 1000, 3, 1000), (16, 4096, 3, 1001), (24, 1000, 3, 896), (64, 4096, 3, 1000),
    (100, 1000, 3, 1000),
    (48, 7168, 3, 896)]  # the sharded Kimi-K2.5 fc (TP = 8) at a partial tile of 64: 64- and 128-row blocks


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["plain", "rows", "norm", "folded"])
@pytest.mark.parametrize("M,H,K,N", SPLIT_SWEEP)
def test_gpu_skinny_ring_and_prepass_match_fp64_at_every_split_count(ops, M, H, K, N, variant):
    """The skinny path (norm pre-pass -> ring-pipelined skinny kernel -> reducer, chained by PDL)
    straight through the op at split counts from 1 to past the op's clamp and with every block
    shape built for M's token tile that launches on this device (64 rows; at 33+ tokens also 128
    rows with 4 and, on sm_90, 6 stages): against the float64 answer, into a NaN-poisoned out with
    canary rows around it, twice with the same bits, and the same bits for every block shape at
    one split count. Folded: the weight prepared by fold_norm_weights, the truth is the unfolded
    problem's."""
    import eagle3_ops

    dev = _gpu_device()
    kw = {"plain": {}, "rows": dict(rows=True, bias=True), "norm": dict(rows=True, chunk=True, inorm=True, bias=True),
          "folded": dict(rows=True, chunk=True, inorm=True)}[variant]
    x, w, b, rows, cn, inw = fc_args(M, H, K, N, torch.bfloat16, device=dev, **kw)
    want = reference.draft_fc_ref(x, w, b, rows, cn, inw, 1e-6, acc_dtype=torch.float64)
    folded = variant == "folded"
    weight = eagle3_ops.fold_norm_weights(w, cn, inw) if folded else w
    NC, CH = (K, H) if cn is not None else (1, K * H)
    arch = cuda_backend.device_arch(dev)
    shapes = [s for s in skinny_model.shapes_for(skinny_model.token_groups(M))
              if cuda_backend.table_blocks_per_sm(arch, s, torch.bfloat16) > 0]
    for splits in sorted({1, 2, 3, 7, skinny_model.max_splits_per_chunk(CH, NC), 1000}):
        need = ops.draft_fc_workspace_bytes(M, N, K * H, K, cn is not None, inw is not None, SKINNY, splits,
                                            torch.bfloat16, folded)
        ws = torch.empty(max(need, 1), dtype=torch.uint8, device=dev)
        first = None
        for _, rows_per_block, stages in shapes:
            where = (splits, rows_per_block, stages)
            got = []
            for _ in range(2):
                base = torch.full((M + 4, N), float("nan"), dtype=torch.bfloat16, device=dev)
                base[:2], base[-2:] = 7.0, -7.0
                out = base[2:-2]
                ops.draft_fc(x, weight, b, rows, cn, inw, 1e-6, out, ws if need else None, SKINNY, splits, folded,
                             rows_per_block, stages)
                torch.cuda.synchronize()
                assert torch.all(base[:2] == 7.0) and torch.all(base[-2:] == -7.0), (where, "canary rows written")
                got.append(out.clone())
            err = ((got[0].double() - want).abs().max() / want.abs().max()).item()
            assert err <= 1e-2, (where, err)
            assert torch.equal(got[0].view(torch.int16), got[1].view(torch.int16)), (where, "not deterministic")
            first = got[0] if first is None else first
            assert torch.equal(got[0].view(torch.int16), first.view(torch.int16)), (where, "bits depend on the block")
