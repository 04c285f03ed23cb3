"""draft fc benchmarks: stock PyTorch/cuBLAS vs eagle3_ops, bf16, K = 3, one row per (shape, backend).

* ``draft_fc_rows``: the verify-path fc. stock = ``F.linear(x[rows], weight)`` (gather + cuBLAS);
  ours = ``eagle3_ops.draft_fc_out(x, weight, None, rows, None, None, eps, out)``.
* ``draft_fc_chunk_norm``: a draft with ``fc_norm``. stock = SGLang llama_eagle3's sequence:
  ``x[rows]``, ``chunk(K)``, one RMSNorm per chunk, ``torch.cat``, ``F.linear``; ours = draft_fc_out
  with ``chunk_norm_weight``. The RMSNorm is sgl_kernel's or FlashInfer's when installed, else
  ``F.rms_norm``; the row's ``stock`` names which one ran.
* ``draft_fc_paths``: every path of each backend at H = 7168, to set the one crossover table
  (``eagle3_ops/plans.py`` CROSSOVER, both backends), each forced with ``plans.forced_path``.
  stock = ``F.linear(x[rows], weight)``.

Bytes that must move (the contract's minimum, ``bytes``): weight N*K*H + gathered x rows M*K*H +
out M*N, times 2 bytes; ``weight_GB/s`` = weight bytes / time (the issue's headline number: fc is a
weight read up to M ~ 130-280). ``TFLOP/s`` = 2*M*N*K*H / time, ``%gemm-rate`` = that over a large
bf16 cuBLAS GEMM (8192^3) measured in the same run; ``vs_F.linear`` = F.linear(x[rows]) time / ours.
L2 is flushed before every timed call (conftest ``gpu_time_us``): the fc weight is assumed cold, as
it is in serving (the target model's traffic evicts it between draft steps).

Problems come from ``eagle3_ops.testing.fc_problem`` (the op tests' builder: x [M + 13, K*H] with a
gather of M rows, weight [H, K*H] ~ 1/sqrt(K*H), cached per shape on a GPU), and ours is checked
against stock with ``eagle3_ops.testing.rel_err`` before it is timed.

Shapes: H in {4096, 7168, 8192}, M in {1, 2, 7, 16, 64, 256, 1000, 4096} (chunk norm: H = 7168 only)
on a GPU. On the CPU only a tiny shape runs (H = 256, M = 1, reference backend; the Triton paths at
H = 64 under the interpreter) as a smoke test of this file: those rows are marked smoke and say
nothing about GPU kernels.
"""
import functools

import pytest
import torch
import torch.nn.functional as F

import eagle3_ops
from eagle3_ops import plans, testing

SMOKE = not torch.cuda.is_available()
DTYPE = torch.bfloat16
ELEM = 2
K = 3
EPS = 1e-6
EXTRA_ROWS = 13  # x has more rows than the verify path gathers
H_VALUES = (256,) if SMOKE else (4096, 7168, 8192)
M_VALUES = (1,) if SMOKE else (1, 2, 7, 16, 64, 256, 1000, 4096)
NORM_H_VALUES = (256,) if SMOKE else (7168,)
OURS_BACKENDS = ("reference",) if SMOKE else ("cuda", "triton")
PATH_H = 64 if SMOKE else 7168
PATH_M = (1,) if SMOKE else (1, 16, 64, 128, 256, 512, 1000, 4096)
TRITON_PATHS = ("skinny", "tiled", "cublas")
CUDA_PATHS = {"cuda:skinny": "skinny", "cuda:cublas": "cublas"}  # row name -> plans.forced_path
CUDA_SKINNY_MAX_BENCH_M = 1000  # the skinny kernel at M = 4096 would only measure 64 weight re-reads

_stock_us_cache = {}


def shape_id(M, H):
    return f"M={M},H={H},K={K}"


def fc_bytes(M, H):
    N = H
    return (N * K * H + M * K * H + M * N) * ELEM


def fc_problem(M, H, device):
    """(x, weight, rows, chunk_norm_weight, out) from the op tests' problem builder."""
    p = testing.fc_problem(M, H, K, DTYPE, device, rows=True, chunk=True, extra_rows=EXTRA_ROWS, x_scale=1.0)
    out = torch.empty(M, H, dtype=DTYPE, device=device)
    return p.x, p.weight, p.rows, p.chunk_norm_weight, out


@functools.lru_cache(maxsize=None)
def stock_rmsnorm(device_type):
    """(name, fn(x, weight, eps)) of the best stock RMSNorm here."""
    if device_type == "cuda":
        try:
            from sgl_kernel import rmsnorm as sgl_rmsnorm

            return "sgl_kernel.rmsnorm", lambda x, w, eps: sgl_rmsnorm(x.contiguous(), w, eps)
        except ImportError:
            pass
        try:
            from flashinfer.norm import rmsnorm as fi_rmsnorm

            return "flashinfer.norm.rmsnorm", lambda x, w, eps: fi_rmsnorm(x.contiguous(), w, eps)
        except ImportError:
            pass
    return "F.rms_norm", lambda x, w, eps: F.rms_norm(x, (x.shape[-1],), w, eps)


@pytest.fixture(scope="session")
def gemm_tflops(bench_device, gpu_time_us):
    """bf16 dense rate of this device measured here: F.linear of 8192 x 8192 by 8192 x 8192 (TFLOP/s)."""
    n = 512 if bench_device.type != "cuda" else 8192
    a = torch.randn(n, n, device=bench_device).to(DTYPE)
    b = torch.randn(n, n, device=bench_device).to(DTYPE)
    us = gpu_time_us(lambda: F.linear(a, b), reps=10, flush=False)
    return 2 * n ** 3 / (us * 1e6)


@pytest.fixture
def ours_backend(request, monkeypatch):
    """Force one eagle3_ops backend; a forced backend that cannot serve fails the benchmark."""
    monkeypatch.setenv("EAGLE3_OPS_BACKEND", request.param)
    return request.param


def _stock_time(key, fn, gpu_time_us):
    if key not in _stock_us_cache:
        _stock_us_cache[key] = gpu_time_us(fn)
    return _stock_us_cache[key]


def _close(ours, stock):
    err = testing.rel_err(ours, stock.double(), normwise=True)
    assert err < 3e-2, f"ours and stock disagree (rel err {err:.3g}): not benchmarking the same thing"


def _extra(M, H, us, linear_us, gemm_tflops):
    weight_bytes = H * K * H * ELEM
    tflops = 2 * M * H * K * H / (us * 1e6)
    return {"weight_GB/s": round(weight_bytes / (us * 1e3), 1), "TFLOP/s": round(tflops, 2),
            "%gemm-rate": round(100 * tflops / gemm_tflops, 1), "vs_F.linear": round(linear_us / us, 3),
            "gemm_TFLOP/s_measured": round(gemm_tflops, 1)}


SHAPES = [(M, H) for H in H_VALUES for M in M_VALUES]


@pytest.mark.parametrize("ours_backend", OURS_BACKENDS, indirect=True)
@pytest.mark.parametrize("M,H", SHAPES, ids=[shape_id(*s) for s in SHAPES])
def test_draft_fc_rows(M, H, ours_backend, bench_device, bench_record, gpu_time_us, gemm_tflops):
    x, w, rows, _, out = fc_problem(M, H, bench_device)

    def stock():
        return F.linear(x[rows], w)

    def ours():
        eagle3_ops.draft_fc_out(x, w, None, rows, None, None, EPS, out)

    ours()
    _close(out, stock())
    stock_us = _stock_time(("rows", M, H), stock, gpu_time_us)
    row = bench_record("draft_fc_rows", shape_id(M, H), fc_bytes(M, H), ours_backend, ours,
                       stock_name="F.linear(x[rows])", stock_us=stock_us, dtype="bf16")
    row.update(_extra(M, H, row["ours_us"], stock_us, gemm_tflops))


NORM_SHAPES = [(M, H) for H in NORM_H_VALUES for M in M_VALUES]


@pytest.mark.parametrize("ours_backend", OURS_BACKENDS, indirect=True)
@pytest.mark.parametrize("M,H", NORM_SHAPES, ids=[shape_id(*s) for s in NORM_SHAPES])
def test_draft_fc_chunk_norm(M, H, ours_backend, bench_device, bench_record, gpu_time_us, gemm_tflops):
    x, w, rows, chunk_w, out = fc_problem(M, H, bench_device)
    norm_name, rmsnorm = stock_rmsnorm(bench_device.type)

    def stock():  # SGLang llama_eagle3: chunk, RMSNorm each, cat, fc
        chunks = x[rows].chunk(K, dim=-1)
        return F.linear(torch.cat([rmsnorm(c, chunk_w[k], EPS) for k, c in enumerate(chunks)], dim=-1), w)

    def ours():
        eagle3_ops.draft_fc_out(x, w, None, rows, chunk_w, None, EPS, out)

    ours()
    _close(out, stock())
    stock_us = _stock_time(("chunk_norm", M, H), stock, gpu_time_us)
    linear_us = _stock_time(("rows", M, H), lambda: F.linear(x[rows], w), gpu_time_us)
    row = bench_record("draft_fc_chunk_norm", shape_id(M, H), fc_bytes(M, H), ours_backend, ours,
                       stock_name=f"x[rows] + {K}x {norm_name} + cat + F.linear", stock_us=stock_us, dtype="bf16")
    row.update(_extra(M, H, row["ours_us"], linear_us, gemm_tflops))


def _path_cases():
    cases = [pytest.param("triton", p, M, id=f"triton:{p}-{shape_id(M, PATH_H)}") for p in TRITON_PATHS
             for M in PATH_M]
    if not SMOKE:
        cases += [pytest.param("cuda", p, M, id=f"{p}-{shape_id(M, PATH_H)}") for p in CUDA_PATHS for M in PATH_M
                  if p != "cuda:skinny" or M <= CUDA_SKINNY_MAX_BENCH_M]
    return cases


@pytest.mark.parametrize("backend,path,M", _path_cases())
def test_draft_fc_paths(backend, path, M, bench_device, bench_record, gpu_time_us, gemm_tflops, monkeypatch):
    H = PATH_H
    x, w, rows, _, out = fc_problem(M, H, bench_device)
    monkeypatch.setenv("EAGLE3_OPS_BACKEND", backend)
    forced = path if backend == "triton" else CUDA_PATHS[path]
    name = f"triton:{path}" if backend == "triton" else path

    def ours():
        eagle3_ops.draft_fc_out(x, w, None, rows, None, None, EPS, out)

    def stock():
        return F.linear(x[rows], w)

    with plans.forced_path(forced):  # every call below, timed ones included, takes this path
        ours()
        _close(out, stock())
        stock_us = _stock_time(("rows", M, H), stock, gpu_time_us)
        row = bench_record("draft_fc_paths", shape_id(M, H), fc_bytes(M, H), name, ours,
                           stock_name="F.linear(x[rows])", stock_us=stock_us, dtype="bf16", forced_path=forced)
    row.update(_extra(M, H, row["ours_us"], stock_us, gemm_tflops))
