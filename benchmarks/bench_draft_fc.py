"""draft fc benchmarks: stock PyTorch/cuBLAS vs eagle3_ops, bf16, K = 3, one row per (shape, backend).

* ``draft_fc_rows``: the verify-path fc. stock = ``F.linear(x[rows], weight)`` (gather + cuBLAS);
  ours = ``eagle3_ops.draft_fc_out(x, weight, None, rows, None, None, eps, out)``. N = H, plus the
  Kimi-K2.5 draft fc sharded over TP = 8 (H = 7168, N = 896 rows per rank).
* ``draft_fc_chunk_norm``: a draft with ``fc_norm``. stock = SGLang llama_eagle3's sequence:
  ``x[rows]``, ``chunk(K)``, one RMSNorm per chunk, ``torch.cat``, ``F.linear``; ours = draft_fc_out
  with ``chunk_norm_weight``. The RMSNorm is sgl_kernel's or FlashInfer's when it imports and passes
  a probe on this device, else ``F.rms_norm`` (torch); the row's ``stock_impl`` names which one ran
  and ``stock_note`` why (the device image has no SGLang).
* ``draft_fc_chunk_norm_folded``: the same draft with the norm weights folded into a prepared copy
  of the weight once (``eagle3_ops.fold_norm_weights``; ``draft_fc_out(..., norm_folded=True)``:
  the plain hot loop plus per-(row, chunk) scales); same stock.
* ``draft_fc_paths``: every path of each backend at H = 7168, to set the one crossover table
  (``eagle3_ops/plans.py`` CROSSOVER, both backends), each forced with ``plans.forced_path``.
  stock = ``F.linear(x[rows], weight)``.

Every row records what ran: ``backend`` (``eagle3_ops.backends()[\"draft_fc\"]`` under the forced
backend), ``path_table`` (``plans.choose(backend, device, M)``), ``path`` and ``splits_per_chunk``
(the backend's own plan for exactly these arguments: what it launches after its launch-contract
fallbacks) and, in ``draft_fc_paths``, ``forced_path``.

Bytes that must move (the contract's minimum, ``bytes``): weight N*K*H + gathered x rows M*K*H +
out M*N, times 2 bytes. The fc only READS its weight, so the floor is
``max(bytes / read bandwidth, FLOPs / gemm rate)``, both measured in the same run (conftest: a
1 GiB read-only stream; here: an 8192^3 bf16 ``F.linear``); the M*N output writes are counted at
the read rate (negligible below M ~ 1000, FLOP-bound above). ``weight_GB/s`` = weight bytes /
time (the headline number: fc is a weight read up to M ~ 130-280); ``TFLOP/s`` = 2*M*N*K*H / time,
``%gemm-rate`` = that over the measured gemm rate; ``vs_F.linear`` = F.linear(x[rows]) time / ours.
L2 is flushed by a read before every timed call (conftest): the fc weight is cold, as it is in
serving (the target model's traffic evicts it between draft steps).

Problems come from ``eagle3_ops.testing.fc_problem`` (the op tests' builder: x [M + 13, K*H] with a
gather of M rows, weight [N, K*H] ~ 1/sqrt(K*H), cached per shape on a GPU), and ours is checked
against stock with ``eagle3_ops.testing.rel_err`` before it is timed.

Shapes: H in {4096, 7168, 8192}, M in {1, 2, 7, 16, 64, 256, 1000, 4096} (chunk norm and TP-8: H =
7168 only) on a GPU (``EAGLE3_BENCH_SET=quick``: H in {7168, 4096}, M in {1, 16, 64, 256, 4096};
``EAGLE3_BENCH_SET=seed``, the device check's first timings: H in {7168, 4096} and Kimi-K2.5's TP = 8 shard,
M in {1, 8, 16, 32, 64}, no path sweep).
On the CPU only a tiny shape runs (H = 256, M = 1, reference backend; the Triton paths at H = 64
under the interpreter) as a smoke test of this file: those rows are marked smoke and say nothing
about GPU kernels.
"""
import functools
import os

import pytest
import torch
import torch.nn.functional as F

import eagle3_ops
from eagle3_ops import plans
import op_testing as testing

SMOKE = not torch.cuda.is_available()
BENCH_SET = os.environ.get("EAGLE3_BENCH_SET", "full")
QUICK = BENCH_SET == "quick"
SEED = BENCH_SET == "seed"  # the device check's first timings: the seed user's decode / verify shapes only
DTYPE = torch.bfloat16
ELEM = 2
K = 3
EPS = 1e-6
EXTRA_ROWS = 13  # x has more rows than the verify path gathers
TP8 = 8          # Kimi-K2.5's draft fc sharded over 8 ranks: N = 7168 / 8 rows per rank
if SMOKE:
    H_VALUES, M_VALUES, NORM_H_VALUES, TP_H_VALUES = (256,), (1,), (256,), ()
elif SEED:  # Kimi-K2.5 replicated and at TP = 8, Llama-3.1-8B; M from decode to a verify batch
    H_VALUES, M_VALUES, NORM_H_VALUES, TP_H_VALUES = (7168, 4096), (1, 8, 16, 32, 64), (7168,), (7168,)
elif QUICK:
    H_VALUES, M_VALUES, NORM_H_VALUES, TP_H_VALUES = (7168, 4096), (1, 16, 64, 256, 4096), (7168,), (7168,)
else:
    H_VALUES, M_VALUES = (7168, 4096, 8192), (1, 2, 7, 16, 64, 256, 1000, 4096)
    NORM_H_VALUES, TP_H_VALUES = (7168,), (7168,)
OURS_BACKENDS = ("reference",) if SMOKE else ("cuda", "triton")
PATH_H = 64 if SMOKE else 7168
PATH_M = (1,) if SMOKE else (1, 16, 64, 128, 256, 512, 1000, 4096)
TRITON_PATHS = ("skinny", "tiled", "cublas")
CUDA_PATHS = {"cuda:skinny": "skinny", "cuda:cublas": "cublas"}  # row name -> plans.forced_path
CUDA_SKINNY_MAX_BENCH_M = 1000  # the skinny kernel at M = 4096 would only measure 64 weight re-reads


def shape_id(M, H, N=None):
    return f"M={M},H={H},K={K}" + ("" if N is None or N == H else f",N={N}")


def fc_bytes(M, H, N=None):
    N = H if N is None else N
    return (N * K * H + M * K * H + M * N) * ELEM


def fc_flops(M, H, N=None):
    N = H if N is None else N
    return 2 * M * N * K * H


def fc_problem(M, H, device, N=None):
    """(x, weight, rows, chunk_norm_weight, out) from the op tests' problem builder."""
    N = H if N is None else N
    p = testing.fc_problem(M, H, K, DTYPE, device, N=N, rows=True, chunk=True, extra_rows=EXTRA_ROWS, x_scale=1.0)
    out = torch.empty(M, N, dtype=DTYPE, device=device)
    return p.x, p.weight, p.rows, p.chunk_norm_weight, out


def path_info(backend, x, weight, bias, rows, chunk_norm_weight, input_norm_weight, M, norm_folded=False):
    """What ``backend`` launches for these arguments right now (call inside any forced_path scope):
    ``path_table`` = plans.choose, ``path`` / ``splits_per_chunk`` / ``launch`` = the backend's own
    plan (after its launch-contract fallbacks; for the CUDA skinny kernel ``launch`` names the block
    shape)."""
    if backend == "reference":
        return {"path_table": None, "path": "reference (torch)", "splits_per_chunk": None}
    info = {"path_table": plans.choose(backend, x.device, M)}
    try:
        if backend == "cuda":
            from eagle3_ops import cuda_backend

            pl = cuda_backend.plan(x, weight, bias, rows, chunk_norm_weight, input_norm_weight, norm_folded)
            info.update(path=pl.path, splits_per_chunk=getattr(pl, "splits", None),
                        launch=f"{pl.block_rows}-row blocks, stages {pl.stages}" if pl.path == "skinny" else None)
        else:
            from eagle3_ops.triton import draft_fc as triton_fc

            pl = triton_fc.plan(x, weight, bias, rows, chunk_norm_weight, input_norm_weight, norm_folded=norm_folded)
            info.update(path=pl.path, splits_per_chunk=getattr(pl, "splits_per_chunk", None),
                        launch=str(pl.cfg) if getattr(pl, "cfg", None) else None)
    except Exception as e:  # the row still says what the table chose, and why the plan is unknown
        info.update(path=f"unknown ({type(e).__name__}: {e})"[:200], splits_per_chunk=None)
    return info


def _probe_rmsnorm(fn, device):
    gen = testing.generator(device, "rmsnorm-probe")
    x = testing.randn((5, 512), DTYPE, device, gen)
    w = testing.positive((512,), DTYPE, device, gen)
    got = fn(x, w, EPS)
    want = F.rms_norm(x.float(), (512,), w.float(), EPS)
    err = testing.rel_err(got, want.double())
    if not err <= 2 * testing.NORM_TOL[DTYPE] + 2.0 ** -8:
        raise RuntimeError(f"differs from F.rms_norm (rel err {err:.3g})")


@functools.lru_cache(maxsize=None)
def stock_rmsnorm(device_type):
    """(impl, note, fn(x, weight, eps)) of the best stock RMSNorm here: sgl_kernel's, then
    FlashInfer's, each only if it imports and passes a probe on this device; else ``F.rms_norm``."""
    if device_type != "cuda":
        return "F.rms_norm", "CPU smoke run", lambda x, w, eps: F.rms_norm(x, (x.shape[-1],), w, eps)
    device = torch.device("cuda", torch.cuda.current_device())
    why = []
    try:
        from sgl_kernel import rmsnorm as sgl_rmsnorm

        fn = lambda x, w, eps: sgl_rmsnorm(x.contiguous(), w, eps)  # noqa: E731
        _probe_rmsnorm(fn, device)
        return "sgl_kernel.rmsnorm", "SGLang's own kernel", fn
    except Exception as e:
        why.append(f"sgl_kernel: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:160])
    try:
        from flashinfer.norm import rmsnorm as fi_rmsnorm

        fn = lambda x, w, eps: fi_rmsnorm(x.contiguous(), w, eps)  # noqa: E731
        _probe_rmsnorm(fn, device)
        return "flashinfer.norm.rmsnorm", f"FlashInfer's kernel ({why[0]})", fn
    except Exception as e:
        why.append(f"flashinfer: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:160])
    return ("F.rms_norm", "torch (F.rms_norm): " + "; ".join(why) + ". On the device image (no SGLang) this is the "
            "baseline; SGLang's rmsnorm kernel may be faster",
            lambda x, w, eps: F.rms_norm(x, (x.shape[-1],), w, eps))


@pytest.fixture(scope="session")
def gemm_tflops(bench_device, gpu_time_us, bench_results):
    """bf16 dense rate of this device measured here: F.linear of 8192 x 8192 by 8192 x 8192 (TFLOP/s;
    random data, never zeros). Recorded in the JSON meta as ``gemm_TFLOPs``."""
    n = 512 if bench_device.type != "cuda" else 8192
    a = torch.randn(n, n, device=bench_device).to(DTYPE)
    b = torch.randn(n, n, device=bench_device).to(DTYPE)
    us = gpu_time_us(lambda: F.linear(a, b), reps=10, flush=False)
    tflops = 2 * n ** 3 / (us * 1e6)
    bench_results.meta_extra.update(gemm_TFLOPs=round(tflops, 1), gemm_method=f"F.linear bf16 {n}^3, median of 10")
    return tflops


@pytest.fixture
def ours_backend(request, monkeypatch):
    """Force one eagle3_ops backend; a forced backend that cannot serve fails the benchmark."""
    monkeypatch.setenv("EAGLE3_OPS_BACKEND", request.param)
    return request.param


def _close(ours, stock):
    err = testing.rel_err(ours, stock.double(), normwise=True)
    assert err < 3e-2, f"ours and stock disagree (rel err {err:.3g}): not benchmarking the same thing"


def _extra(M, H, N, row, linear_us, gemm_tflops):
    us = row["ours_us"]
    weight_bytes = N * K * H * ELEM
    tflops = fc_flops(M, H, N) / (us * 1e6)
    return {"weight_GB/s": round(weight_bytes / (us * 1e3), 1), "TFLOP/s": round(tflops, 2),
            "%gemm-rate": round(100 * tflops / gemm_tflops, 1),
            "vs_F.linear": None if not linear_us else round(linear_us / us, 3)}


LINEAR_STOCK = dict(stock_name="F.linear(x[rows])", stock_impl="torch: index gather + F.linear (cuBLAS)",
                    stock_note="what SGLang's draft runs (nn.Linear on the gathered rows)")

SHAPES = [(M, H, H) for H in H_VALUES for M in M_VALUES] + \
         [(M, H, H // TP8) for H in TP_H_VALUES for M in M_VALUES]


@pytest.mark.parametrize("ours_backend", OURS_BACKENDS, indirect=True)
@pytest.mark.parametrize("M,H,N", SHAPES, ids=[shape_id(*s) for s in SHAPES])
def test_draft_fc_rows(M, H, N, ours_backend, bench_device, bench_record, bench_timer, gemm_tflops):
    x, w, rows, _, out = fc_problem(M, H, bench_device, N)

    def stock():
        return F.linear(x[rows], w)

    def ours():
        eagle3_ops.draft_fc_out(x, w, None, rows, None, None, EPS, out)

    ours()
    _close(out, stock())
    key = ("rows", M, H, N)
    bench_record("draft_fc_rows", shape_id(M, H, N), fc_bytes(M, H, N), ours_backend, ours, op="draft_fc",
                       stock_fn=stock, stock_key=key, dtype="bf16", bw="read", flops=fc_flops(M, H, N),
                       tflops=gemm_tflops, post=lambda row: _extra(M, H, N, row, row["stock_us"], gemm_tflops),
                       **LINEAR_STOCK, **path_info(ours_backend, x, w, None, rows, None, None, M))


NORM_SHAPES = [(M, H) for H in NORM_H_VALUES for M in M_VALUES]


@pytest.mark.parametrize("folded", [False, True], ids=["unfolded", "folded"])
@pytest.mark.parametrize("ours_backend", OURS_BACKENDS, indirect=True)
@pytest.mark.parametrize("M,H", NORM_SHAPES, ids=[shape_id(*s) for s in NORM_SHAPES])
def test_draft_fc_chunk_norm(M, H, ours_backend, folded, bench_device, bench_record, bench_timer, gemm_tflops):
    x, w, rows, chunk_w, out = fc_problem(M, H, bench_device)
    # folded: the norm weights folded into a copy of the weight once, as the plugin does at install
    weight = eagle3_ops.fold_norm_weights(w, chunk_w) if folded else w
    norm_impl, norm_note, rmsnorm = stock_rmsnorm(bench_device.type)

    def stock():  # SGLang llama_eagle3: chunk, RMSNorm each, cat, fc (the unfolded weight)
        chunks = x[rows].chunk(K, dim=-1)
        return F.linear(torch.cat([rmsnorm(c, chunk_w[k], EPS) for k, c in enumerate(chunks)], dim=-1), w)

    def ours():
        eagle3_ops.draft_fc_out(x, weight, None, rows, chunk_w, None, EPS, out, norm_folded=folded)

    ours()
    _close(out, stock())
    linear = bench_timer.measure_cached(("rows", M, H, H), lambda: F.linear(x[rows], w))
    bench_record("draft_fc_chunk_norm_folded" if folded else "draft_fc_chunk_norm", shape_id(M, H), fc_bytes(M, H),
                 ours_backend, ours, op="draft_fc",
                 stock_name=f"x[rows] + {K}x {norm_impl} + cat + F.linear", stock_fn=stock,
                 stock_key=("chunk_norm", M, H), stock_impl=f"torch gather/cat + {norm_impl} + F.linear (cuBLAS)",
                 stock_note=norm_note, dtype="bf16", bw="read", flops=fc_flops(M, H), tflops=gemm_tflops,
                 post=lambda row: _extra(M, H, H, row, linear.eager_us, gemm_tflops),
                 **path_info(ours_backend, x, weight, None, rows, chunk_w, None, M, norm_folded=folded))


def _path_cases():
    if SEED:
        return []  # the crossover table's rows are not the first run's question
    cases = [pytest.param("triton", p, M, id=f"triton:{p}-{shape_id(M, PATH_H)}") for p in TRITON_PATHS
             for M in PATH_M]
    if not SMOKE:
        cases += [pytest.param("cuda", p, M, id=f"{p}-{shape_id(M, PATH_H)}") for p in CUDA_PATHS for M in PATH_M
                  if p != "cuda:skinny" or M <= CUDA_SKINNY_MAX_BENCH_M]
    return cases


@pytest.mark.parametrize("backend,path,M", _path_cases())
def test_draft_fc_paths(backend, path, M, bench_device, bench_record, gemm_tflops, monkeypatch):
    H = PATH_H
    x, w, rows, _, out = fc_problem(M, H, bench_device)
    monkeypatch.setenv("EAGLE3_OPS_BACKEND", backend)
    forced = path if backend == "triton" else CUDA_PATHS[path]
    name = f"triton:{path}" if backend == "triton" else path

    def ours():
        eagle3_ops.draft_fc_out(x, w, None, rows, None, None, EPS, out)

    def stock():
        return F.linear(x[rows], w)

    with plans.forced_path(forced):  # every call below, timed and captured ones included, takes this path
        ours()
        _close(out, stock())
        bench_record("draft_fc_paths", shape_id(M, H), fc_bytes(M, H), name, ours, op="draft_fc",
                           stock_fn=stock, stock_key=("rows", M, H, H), dtype="bf16", bw="read",
                           flops=fc_flops(M, H), tflops=gemm_tflops, forced_path=forced,
                           post=lambda row: _extra(M, H, H, row, row["stock_us"], gemm_tflops),
                           **LINEAR_STOCK, **path_info(backend, x, w, None, rows, None, None, M))
