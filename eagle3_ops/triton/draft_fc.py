"""Triton draft fc: ``out[M, N] = linear(norm(x[rows]), weight, bias)`` (docs/design.md §5.4).

Backend functions: :func:`draft_fc` and :func:`draft_fc_workspace_bytes` (the contract of every
backend: arguments already validated, output non-empty, scratch carved from a caller-owned
workspace). Exact math: ``eagle3_ops.reference.draft_fc_ref`` (input_norm over the K*H row first,
then one RMSNorm per H-wide chunk, fp32 accumulation, one rounding into ``out``).

Bytes and FLOPs: the weight is N*K*H elements (3*7168*7168*2 B = 308 MB in bf16 at H=7168) and is
read once; x contributes M*K*H elements, out M*N; FLOPs = 2*M*N*K*H. Below M ~ 130-280 (device
dependent, docs/kernels.md §4) the weight read is the floor, above it the matrix units are.

Three paths; ``eagle3_ops.plans.choose("triton", device, M)`` picks one per call (the one crossover
table, ``eagle3_ops/plans.py``, docs/design.md §9; ``plans.forced_path`` forces one for tests and benchmarks):

* ``skinny`` (decode/verify, small M): swap-AB split-K. Program (token tile, weight tile, split)
  computes ``W[n tile, k range] @ x[rows][token tile, k range]^T`` with the weight on the MMA's
  wide side, so the weight streams once in 16-byte loads (cp.async pipeline on sm_90/sm_120;
  evict-first / evict-last hints where plain loads are used) while the few gathered x rows stay
  in cache. Each split lies inside one H-wide chunk, so a chunk's RMS scale
  multiplies the fp32 partial (linearity) instead of every program re-reading the whole row. fp32
  partials go to the workspace; a second kernel sums the splits in fixed order (deterministic), adds
  bias and writes ``out``. With one split the first kernel writes ``out`` directly. fp16 with norm
  weights takes ``tiled`` instead, forced or not (``fc_rules.fp16_norm_overflow``: the skinny
  kernel rounds x * norm weights before the RMS scale, which can overflow fp16).
* ``tiled`` (mid M): a tiled GEMM with the same prologue (row gather; norm weights and the chunk's
  RMS scale multiply the x tile on the fly); no split.
* ``cublas`` (large M): cuBLAS (``torch.addmm``/``torch.mm`` with ``out=``, the GEMM ``F.linear``
  runs) on the prepared input ``norm(x[rows])`` rounded to the dtype (what stock SGLang feeds it);
  x is passed straight through when there is no gather and no norm.

Pre-fc norms without a K-wide pre-pass inside every program (docs/kernels.md §5): a tiny kernel
computes one fp32 scale per (row, chunk) first, ``a[m, c] = s_m * rsqrt(s_m^2 * mean_c((x*g_in)^2)
+ eps)`` where ``s_m = rsqrt(mean(x^2) + eps)`` is the input-norm scale (1 without it). The norm
weights ``g = input_norm_weight * chunk_norm_weight`` multiply x on the fly, unless the weight
carries them (``norm_folded``, ``eagle3_ops.fold_norm_weights``): then the hot loops are the plain
ones and only the scales apply (input_norm_weight still feeds the chunk statistic). Row indices outside
``[0, R)`` are never dereferenced: those rows load as zeros and their outputs are NaN. Index
arithmetic is int64 wherever a row index meets a row stride (M * K*H or M * N may exceed 2^31).

Memory (docs/design.md §7.2, docs/kernels.md §9): nothing is allocated. Every scratch region is
carved from the ``workspace`` argument with ``eagle3_ops.workspace.Carver`` (256-byte aligned
regions, in this order): the unit-stride copies of strided 1-D arguments
(``fc_rules.unit_stride_copies``: bias, rows, input_norm_weight), then the fp32 row scales [M, K]
(skinny and tiled, with norms), then the fp32 split-K partials [S, M, N] (skinny, S > 1), or the
prepared cuBLAS input [M, K*H] in the dtype (cublas, with a gather or a norm).
:func:`draft_fc_workspace_bytes` is the sum for exactly those arguments (cuBLAS's own workspace is
PyTorch's).

Under ``TRITON_INTERPRET=1`` (CPU tests) ``_interpreter_shim`` upcasts bf16 ``tl.dot`` operands and
rounds bf16 conversions to nearest even (the interpreter gets both wrong); the compiled GPU kernels
never see that shim (its constexpr flag is False there).
"""
from __future__ import annotations

import contextlib
import math
import threading
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from .. import fc_rules, plans
from ..workspace import Carver, aligned
from ._interpreter_shim import cast, dot, interpreted, interpreter_bf16


# The Triton interpreter is not thread-safe: while a kernel runs it patches triton.language
# module-wide, so interpreted launches from two threads corrupt each other (InterpreterError, wrong
# grids). Interpreted calls (the CPU test vehicle) are serialized, here and in triton/capture.py;
# compiled kernels never take the lock.
_INTERPRETER_LOCK = threading.RLock()


def interpreter_serialized(kernel):
    """A context manager: the interpreter's lock when ``kernel`` is interpreted, else nothing."""
    return _INTERPRETER_LOCK if interpreted(kernel) else contextlib.nullcontext()


# ---- launch configuration (design estimates; the benchmark is the judge) -------------------------
def arch_major(device: torch.device) -> int:
    """Compute-capability major of a GPU; 0 stands for the CPU interpreter in the configs below."""
    if device.type != "cuda":
        return 0
    return plans.capability(device.index if device.index is not None else torch.cuda.current_device())[0]


def _rows_per_program(kernel, M: int) -> int:
    """Rows per program of the row-wise kernels (row scales, split-K reduce). On a GPU one row per
    program, as before: M programs to spread over the SMs. The interpreter runs programs one after
    another and pays per operation, not per element: up to 64 rows at once give the same numbers
    (each row is reduced along its own axis) in a fraction of the time."""
    return min(triton.next_power_of_2(M), 64) if interpreted(kernel) else 1


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # interpreter: small, so that the split-K logic is exercised on tiny shapes


def _stages(arch: int, bytes_per_stage: int, max_stages: int) -> int:
    """Pipeline depth that fits shared memory: sm_120 allows 99 KB per block, sm_90 227 KB."""
    budget = 200 * 1024 if arch in (9, 10) else 96 * 1024
    return max(1, min(max_stages, budget // bytes_per_stage))


def _input_precision(dtype: torch.dtype) -> str:
    # fp32 inputs must not silently drop to tf32 (10-bit mantissa) inside tl.dot.
    return "ieee" if dtype == torch.float32 else "tf32"


@dataclass(frozen=True)
class _Problem:
    M: int
    N: int
    R: int
    KH: int
    NC: int  # chunks with their own RMS scale (K with chunk norm, else 1)
    CH: int  # chunk width (H with chunk norm, else K*H)
    has_scale: bool


def _problem(x, weight, rows, chunk_norm_weight, input_norm_weight, out=None) -> _Problem:
    R, KH = x.shape
    M = out.shape[0] if out is not None else fc_rules.num_rows(x, rows)
    NC, CH = fc_rules.chunks(x, chunk_norm_weight)
    return _Problem(M, weight.shape[0], R, KH, NC, CH, fc_rules.has_norm(chunk_norm_weight, input_norm_weight))


def _dummy(t: Optional[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """Kernels take a pointer for every optional tensor; absent ones are never read (constexpr off)."""
    return t if t is not None else like


# ---- kernels ---------------------------------------------------------------------------------------
@triton.jit
def _gather_rows(rows_ptr, offs_m, m_in, R, HAS_ROWS: tl.constexpr):
    """Row gather of a token tile: (source row of each output row as int64, with out-of-range and
    masked-off ones replaced by row 0 so they are never dereferenced out of bounds; validity mask)."""
    if HAS_ROWS:
        rows = tl.load(rows_ptr + offs_m, mask=m_in, other=0).to(tl.int64)
    else:
        rows = offs_m.to(tl.int64)
    valid = m_in & (rows >= 0) & (rows < R)
    return tl.where(valid, rows, 0), valid


@triton.jit
def _row_scales_kernel(x_ptr, stride_x, rows_ptr, in_w_ptr, chunk_w_ptr, scale_ptr, prep_ptr, stride_prep,
                       M, R, KH, CH, NC, eps,
                       HAS_ROWS: tl.constexpr, HAS_IN_NORM: tl.constexpr, HAS_CHUNK_NORM: tl.constexpr,
                       WRITE_PREPARED: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
                       INTERPRETER_BF16: tl.constexpr, APPLY_GAINS: tl.constexpr = True):
    """ROWS output rows m per program (:func:`_rows_per_program`). Computes a[m, c] (the fp32 RMS
    scale of chunk c, see module doc) into scale_ptr[m*NC + c], or, with WRITE_PREPARED, writes the
    whole normalized row ``norm(x[rows[m]])`` in the dtype into prep_ptr (NaN row when rows[m] is out
    of range). Each row's sums run along its own axis: the same for any ROWS."""
    offs_m = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # m * stride_prep exceeds int32
    m_in = offs_m < M
    row, valid = _gather_rows(rows_ptr, offs_m, m_in, R, HAS_ROWS)
    x_rows = x_ptr + row[:, None] * stride_x
    offs = tl.arange(0, BLOCK)[None, :]
    if HAS_IN_NORM:
        sq = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
        for k0 in range(0, KH, BLOCK):
            xv = tl.load(x_rows + k0 + offs, mask=((k0 + offs) < KH) & valid[:, None], other=0.0).to(tl.float32)
            sq += xv * xv
        s = tl.rsqrt(tl.sum(sq, axis=1) / KH + eps)
    else:
        s = tl.full([ROWS], 1.0, tl.float32)
    for c in range(0, NC):
        base = c * CH
        if HAS_CHUNK_NORM:
            q = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
            for k0 in range(0, CH, BLOCK):
                kk = base + k0 + offs
                k_in = (k0 + offs) < CH
                xv = tl.load(x_rows + kk, mask=k_in & valid[:, None], other=0.0).to(tl.float32)
                if HAS_IN_NORM:
                    xv = xv * tl.load(in_w_ptr + kk, mask=k_in, other=0.0).to(tl.float32)
                q += xv * xv
            a = s * tl.rsqrt(s * s * (tl.sum(q, axis=1) / CH) + eps)
        else:
            a = s
        if WRITE_PREPARED:
            for k0 in range(0, CH, BLOCK):
                kk = base + k0 + offs
                k_in = (k0 + offs) < CH
                v = tl.load(x_rows + kk, mask=k_in & valid[:, None], other=0.0).to(tl.float32) * a[:, None]
                if HAS_IN_NORM and APPLY_GAINS:
                    v = v * tl.load(in_w_ptr + kk, mask=k_in, other=0.0).to(tl.float32)
                if HAS_CHUNK_NORM and APPLY_GAINS:
                    v = v * tl.load(chunk_w_ptr + kk, mask=k_in, other=0.0).to(tl.float32)
                v = tl.where(valid[:, None], v, float("nan"))
                tl.store(prep_ptr + offs_m[:, None] * stride_prep + kk,
                         cast(v, prep_ptr.dtype.element_ty, INTERPRETER_BF16), mask=m_in[:, None] & k_in)
        else:
            tl.store(scale_ptr + offs_m * NC + c, tl.where(valid, a, float("nan")), mask=m_in)


@triton.jit
def _apply_norm_weights(xv, kk, k_in, in_w_ptr, chunk_w_ptr, row_scale, AXIS: tl.constexpr,
                        HAS_IN_NORM: tl.constexpr, HAS_CHUNK_NORM: tl.constexpr, HAS_ROW_SCALE: tl.constexpr,
                        INTERPRETER_BF16: tl.constexpr):
    """x tile (k along axis AXIS) times g = input_norm_weight * chunk_norm_weight, and times the
    per-row scale when HAS_ROW_SCALE, rounded back to the dtype for the matrix product (the stock
    path rounds its normalized input the same way)."""
    if HAS_IN_NORM or HAS_CHUNK_NORM or HAS_ROW_SCALE:
        g = tl.full(kk.shape, 1.0, tl.float32)  # stays 1 with folded norm weights (flags off)
        if HAS_IN_NORM:
            g = g * tl.load(in_w_ptr + kk, mask=k_in, other=0.0).to(tl.float32)
        if HAS_CHUNK_NORM:
            g = g * tl.load(chunk_w_ptr + kk, mask=k_in, other=0.0).to(tl.float32)
        if AXIS == 0:
            v = xv.to(tl.float32) * g[:, None]
            if HAS_ROW_SCALE:
                v = v * row_scale[None, :]
        else:
            v = xv.to(tl.float32) * g[None, :]
            if HAS_ROW_SCALE:
                v = v * row_scale[:, None]
        xv = cast(v, xv.dtype, INTERPRETER_BF16)
    return xv


@triton.jit
def _skinny_kernel(x_ptr, stride_x, w_ptr, stride_w, rows_ptr, in_w_ptr, chunk_w_ptr, scale_ptr, bias_ptr,
                   out_ptr, stride_out, ws_ptr,
                   M, N, R, CH, NC, SPLITS_PER_CHUNK, SPLIT_LEN,
                   HAS_ROWS: tl.constexpr, HAS_IN_NORM: tl.constexpr, HAS_CHUNK_NORM: tl.constexpr,
                   HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, WRITE_PARTIAL: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                   INTERPRETER_BF16: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    # Token tile is the fastest grid axis: programs that share a weight tile run side by side, so
    # for M > BLOCK_M the weight still comes from DRAM about once.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    c = pid_s // SPLITS_PER_CHUNK
    k_lo = c * CH + (pid_s % SPLITS_PER_CHUNK) * SPLIT_LEN
    k_hi = tl.minimum(k_lo + SPLIT_LEN, (c + 1) * CH)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_in = offs_n < N
    m_in = offs_m < M
    rows, valid = _gather_rows(rows_ptr, offs_m, m_in, R, HAS_ROWS)

    w_tile = w_ptr + offs_n.to(tl.int64)[:, None] * stride_w
    x_tile = x_ptr + rows[None, :] * stride_x
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_in = kk < k_hi
        w = tl.load(w_tile + kk[None, :], mask=n_in[:, None] & k_in[None, :], other=0.0,
                    eviction_policy="evict_first")
        xt = tl.load(x_tile + kk[:, None], mask=k_in[:, None] & valid[None, :], other=0.0,
                     eviction_policy="evict_last")
        xt = _apply_norm_weights(xt, kk, k_in, in_w_ptr, chunk_w_ptr, 1.0, 0, HAS_IN_NORM, HAS_CHUNK_NORM, False,
                                 INTERPRETER_BF16)
        acc = dot(w, xt, acc, INTERPRETER_BF16, INPUT_PRECISION)
    if HAS_SCALE:
        a = tl.load(scale_ptr + offs_m.to(tl.int64) * NC + c, mask=m_in, other=0.0)
        acc = acc * a[None, :]
    if WRITE_PARTIAL:
        ws = ws_ptr + (pid_s.to(tl.int64) * M + offs_m)[None, :] * N + offs_n[:, None]
        tl.store(ws, acc, mask=n_in[:, None] & m_in[None, :])
    else:
        if HAS_BIAS:
            acc = acc + tl.load(bias_ptr + offs_n, mask=n_in, other=0.0).to(tl.float32)[:, None]
        acc = tl.where(valid[None, :], acc, float("nan"))
        dst = out_ptr + offs_m.to(tl.int64)[None, :] * stride_out + offs_n[:, None]
        tl.store(dst, cast(acc, out_ptr.dtype.element_ty, INTERPRETER_BF16), mask=n_in[:, None] & m_in[None, :])


@triton.jit
def _splitk_reduce_kernel(ws_ptr, bias_ptr, rows_ptr, out_ptr, stride_out, M, N, R, S,
                          HAS_ROWS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
                          ROWS: tl.constexpr, INTERPRETER_BF16: tl.constexpr):
    """out[m, n] = sum over splits s = 0, 1, ... S-1 (always this order) + bias, ROWS rows m per
    program (:func:`_rows_per_program`); NaN rows for out-of-range indices."""
    offs_m = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    m_in = offs_m < M
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    n_in = offs < N
    mask = m_in[:, None] & n_in[None, :]
    acc = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
    for s in range(0, S):
        acc += tl.load(ws_ptr + (s * M + offs_m[:, None]) * N + offs[None, :], mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs, mask=n_in, other=0.0).to(tl.float32)[None, :]
    if HAS_ROWS:
        _, valid = _gather_rows(rows_ptr, offs_m, m_in, R, HAS_ROWS)
        acc = tl.where(valid[:, None], acc, float("nan"))  # masked-off rows are not stored
    tl.store(out_ptr + offs_m[:, None] * stride_out + offs[None, :],
             cast(acc, out_ptr.dtype.element_ty, INTERPRETER_BF16), mask=mask)


@triton.jit
def _tiled_kernel(x_ptr, stride_x, w_ptr, stride_w, rows_ptr, in_w_ptr, chunk_w_ptr, scale_ptr, bias_ptr,
                  out_ptr, stride_out, M, N, R, CH, NC,
                  HAS_ROWS: tl.constexpr, HAS_IN_NORM: tl.constexpr, HAS_CHUNK_NORM: tl.constexpr,
                  HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                  INTERPRETER_BF16: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    # Grouped tile order: GROUP_M token tiles share each weight tile while it is in L2.
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * tiles_n)
    first_m = group * GROUP_M
    group_size = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * tiles_n)) % group_size
    pid_n = (pid % (GROUP_M * tiles_n)) // group_size

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_in = offs_m < M
    n_in = offs_n < N
    rows, valid = _gather_rows(rows_ptr, offs_m, m_in, R, HAS_ROWS)
    x_tile = x_ptr + rows[:, None] * stride_x
    w_tile = w_ptr + offs_n.to(tl.int64)[None, :] * stride_w

    # One accumulator: chunk c's RMS scale multiplies the x tile on the fly together with the norm
    # weights (x is multiplied by g anyway whenever there is a scale), keeping registers for the tile.
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    row_scale = tl.full([BLOCK_M], 1.0, tl.float32)
    for c in range(0, NC):
        if HAS_SCALE:
            row_scale = tl.load(scale_ptr + offs_m.to(tl.int64) * NC + c, mask=m_in, other=0.0)
        for k0 in range(c * CH, (c + 1) * CH, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            k_in = kk < (c + 1) * CH
            xv = tl.load(x_tile + kk[None, :], mask=valid[:, None] & k_in[None, :], other=0.0)
            xv = _apply_norm_weights(xv, kk, k_in, in_w_ptr, chunk_w_ptr, row_scale, 1, HAS_IN_NORM,
                                     HAS_CHUNK_NORM, HAS_SCALE, INTERPRETER_BF16)
            wt = tl.load(w_tile + kk[:, None], mask=k_in[:, None] & n_in[None, :], other=0.0)
            acc = dot(xv, wt, acc, INTERPRETER_BF16, INPUT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_in, other=0.0).to(tl.float32)[None, :]
    acc = tl.where(valid[:, None], acc, float("nan"))
    dst = out_ptr + offs_m.to(tl.int64)[:, None] * stride_out + offs_n[None, :]
    tl.store(dst, cast(acc, out_ptr.dtype.element_ty, INTERPRETER_BF16), mask=m_in[:, None] & n_in[None, :])


# ---- host side -------------------------------------------------------------------------------------
def _row_scales(x, rows, chunk_norm_weight, input_norm_weight, eps, p: _Problem,
                scales: Optional[torch.Tensor] = None) -> torch.Tensor:
    """fp32 [M, NC] scales a[m, c] (the tiny first pass; reads only the M gathered rows), written
    into ``scales`` (M*NC fp32 elements; a new tensor when None: tests)."""
    if scales is None:
        scales = torch.empty(p.M * p.NC, dtype=torch.float32, device=x.device)
    scales = scales.view(p.M, p.NC)
    block = 256 if x.device.type != "cuda" else 1024
    per_program = _rows_per_program(_row_scales_kernel, p.M)
    _row_scales_kernel[(triton.cdiv(p.M, per_program),)](
        x, x.stride(0), _dummy(rows, x), _dummy(input_norm_weight, x), _dummy(chunk_norm_weight, x), scales, x, 0,
        p.M, p.R, p.KH, p.CH, p.NC, float(eps),
        HAS_ROWS=rows is not None, HAS_IN_NORM=input_norm_weight is not None,
        HAS_CHUNK_NORM=chunk_norm_weight is not None, WRITE_PREPARED=False, BLOCK=block, ROWS=per_program,
        INTERPRETER_BF16=interpreter_bf16(_row_scales_kernel, x.dtype), num_warps=4)
    return scales


def skinny_config(arch: int, M: int, itemsize: int) -> dict:
    """The skinny kernel's launch configuration (block sizes, warps, pipeline stages) for compute-capability major
    ``arch`` (0: the CPU interpreter), ``M`` output rows and elements of ``itemsize`` bytes."""
    if arch == 0:  # interpreter: few, large programs (its cost is per program and per op)
        return dict(BLOCK_N=64, BLOCK_M=min(32, max(16, triton.next_power_of_2(M))), BLOCK_K=64, num_warps=4,
                    num_stages=1)
    block_m = min(64, max(16, triton.next_power_of_2(M)))
    block_n, block_k = 64, 128
    stages = _stages(arch, (block_n + block_m) * block_k * itemsize, max_stages=5)
    return dict(BLOCK_N=block_n, BLOCK_M=block_m, BLOCK_K=block_k, num_warps=4, num_stages=stages)


def split_plan(CH: int, NC: int, programs_per_split: int, block_k: int, num_sms: int,
               split_len: Optional[int] = None) -> tuple:
    """(splits per chunk, split length): enough programs for ~2 per SM, each split a multiple of
    BLOCK_K inside one chunk, at least 4 BLOCK_K long, at most 16 splits per chunk."""
    if split_len is None:
        want = max(1, math.ceil(2 * num_sms / max(1, programs_per_split * NC)))
        want = min(want, 16, max(1, CH // (4 * block_k)))
        split_len = math.ceil(CH / want)
    split_len = max(block_k, math.ceil(split_len / block_k) * block_k)
    return max(1, math.ceil(CH / split_len)), split_len  # one (empty) split when K*H = 0


def tiled_config(arch: int, itemsize: int) -> dict:
    """The tiled kernel's launch configuration (block sizes, GROUP_M, warps, pipeline stages) for compute-capability
    major ``arch`` (0: the CPU interpreter) and elements of ``itemsize`` bytes."""
    if arch == 0:  # interpreter: few, large programs
        return dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, GROUP_M=2, num_warps=4, num_stages=1)
    # sm_120 (188 / 170 SMs, mma.sync, 64K registers for 1-2 programs): 128 x 64 tiles. 128 x 128
    # needed 255 registers and spilled with rows and norms (compile-checked), and at M = 256,
    # N = 7168 gave 112 programs, 0.6 of a wave; 128 x 64 holds 140 registers without a spill and
    # gives 224 programs (>= one wave), still reading the weight once per 128 tokens. Two stages on
    # sm_120: under SGLang, FlashInfer points Triton's Blackwell ptxas at the CUDA toolkit's
    # (TRITON_PTXAS_BLACKWELL_PATH), and CUDA 13.0's ptxas gives 3 or 4 stages a 24-byte stack frame
    # (128 registers); 2 stages hold 142 registers, no stack, with either ptxas.
    # (tests/ops/test_kernel_plans.py compile-checks both archs, with each ptxas Triton may use.)
    bm, bn, bk = (128, 64, 64) if arch == 12 else (128, 128, 64)
    stages = _stages(arch, (bm + bn) * bk * itemsize, max_stages=2 if arch == 12 else 4)
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=8, num_stages=stages)


@dataclass(frozen=True)
class Plan:
    """One draft_fc call: its path, launch configuration and workspace regions (bytes, each
    ``workspace.ALIGN``-aligned, carved in this order)."""

    path: str  # "skinny" | "tiled" | "cublas"
    problem: _Problem
    cfg: dict  # the kernel's launch configuration (skinny / tiled); {} for cublas
    splits_per_chunk: int = 1  # skinny
    split_len: int = 0  # skinny
    copy_bytes: int = 0  # unit-stride copies of strided bias / rows / input_norm_weight
    scale_bytes: int = 0  # fp32 row scales [M, NC]
    partial_bytes: int = 0  # fp32 split-K partials [S, M, N]
    prepared_bytes: int = 0  # prepared cuBLAS input [M, K*H]

    @property
    def S(self) -> int:
        """Total split-K splits: chunks x splits per chunk (the partials' leading dimension)."""
        return self.problem.NC * self.splits_per_chunk

    @property
    def nbytes(self) -> int:
        """Workspace bytes the call needs: copies, row scales, split-K partials and prepared input together."""
        return self.copy_bytes + self.scale_bytes + self.partial_bytes + self.prepared_bytes


def plan(x, weight, bias, rows, chunk_norm_weight, input_norm_weight, split_len: Optional[int] = None,
         norm_folded: bool = False, path: Optional[str] = None) -> Plan:
    """The path (``path`` when given, else ``plans.choose``; then the fp16-with-norms rule) and workspace
    regions of one call. ``split_len`` overrides the skinny split length (tests use it to force several
    splits)."""
    p = _problem(x, weight, rows, chunk_norm_weight, input_norm_weight)
    device = weight.device  # x and rows may be meta tensors (a plan made ahead of the call: eagle3_ops.bound)
    path = path or plans.choose("triton", device, p.M)
    if path == "skinny" and fc_rules.fp16_norm_overflow(x.dtype, chunk_norm_weight, input_norm_weight, norm_folded):
        path = "tiled"  # the tiled kernel scales x on the fly: no fp16 overflow
    copy_bytes = fc_rules.unit_stride_copy_bytes(bias, rows, input_norm_weight)
    scale_bytes = aligned(p.M * p.NC * 4) if p.has_scale and path != "cublas" else 0
    if path == "skinny":
        cfg = skinny_config(arch_major(device), p.M, x.element_size())
        tiles = triton.cdiv(p.M, cfg["BLOCK_M"]) * triton.cdiv(p.N, cfg["BLOCK_N"])
        per_chunk, length = split_plan(p.CH, p.NC, tiles, cfg["BLOCK_K"], _num_sms(device), split_len)
        S = p.NC * per_chunk
        return Plan(path, p, cfg, per_chunk, length, copy_bytes, scale_bytes,
                    partial_bytes=aligned(S * p.M * p.N * 4) if S > 1 else 0)
    if path == "tiled":
        return Plan(path, p, tiled_config(arch_major(device), x.element_size()), copy_bytes=copy_bytes,
                    scale_bytes=scale_bytes)
    prepared = fc_rules.prepares_input(rows, chunk_norm_weight, input_norm_weight)
    return Plan(path, p, {}, copy_bytes=copy_bytes,
                prepared_bytes=aligned(p.M * p.KH * x.element_size()) if prepared else 0)


def _scales_for(x, rows, chunk_norm_weight, input_norm_weight, eps, carver: Carver, pl: Plan):
    """The fp32 row scales [M, NC] carved from the workspace (None without norms)."""
    p = pl.problem
    if not p.has_scale:
        return None
    return _row_scales(x, rows, chunk_norm_weight, input_norm_weight, eps, p, carver.take(p.M * p.NC, torch.float32))


def _gain_flags(chunk_norm_weight, input_norm_weight, folded: bool) -> dict:
    """Which norm weights the fc kernels multiply into x: none when the weight carries them."""
    return dict(HAS_IN_NORM=input_norm_weight is not None and not folded,
                HAS_CHUNK_NORM=chunk_norm_weight is not None and not folded)


def _skinny(x, weight, bias, rows, chunk_norm_weight, input_norm_weight, eps, out, carver: Carver, pl: Plan,
            folded: bool = False) -> None:
    p = pl.problem
    device = x.device
    scales = _scales_for(x, rows, chunk_norm_weight, input_norm_weight, eps, carver, pl)
    cfg = pl.cfg
    tiles_m, tiles_n = triton.cdiv(p.M, cfg["BLOCK_M"]), triton.cdiv(p.N, cfg["BLOCK_N"])
    S = pl.S
    ws = carver.take(S * p.M * p.N, torch.float32) if S > 1 else None
    _skinny_kernel[(tiles_m, tiles_n, S)](
        x, x.stride(0), weight, weight.stride(0), _dummy(rows, x), _dummy(input_norm_weight, x),
        _dummy(chunk_norm_weight, x), _dummy(scales, x), _dummy(bias, x), out, out.stride(0), _dummy(ws, x),
        p.M, p.N, p.R, p.CH, p.NC, pl.splits_per_chunk, pl.split_len,
        HAS_ROWS=rows is not None, HAS_SCALE=p.has_scale, HAS_BIAS=bias is not None,
        **_gain_flags(chunk_norm_weight, input_norm_weight, folded), WRITE_PARTIAL=S > 1,
        INTERPRETER_BF16=interpreter_bf16(_skinny_kernel, x.dtype),
        INPUT_PRECISION=_input_precision(x.dtype), **cfg)
    if S > 1:
        block = 1024 if device.type == "cuda" else 256
        per_program = _rows_per_program(_splitk_reduce_kernel, p.M)
        _splitk_reduce_kernel[(triton.cdiv(p.M, per_program), triton.cdiv(p.N, block))](
            ws, _dummy(bias, x), _dummy(rows, x), out, out.stride(0), p.M, p.N, p.R, S,
            HAS_ROWS=rows is not None, HAS_BIAS=bias is not None, BLOCK=block, ROWS=per_program,
            INTERPRETER_BF16=interpreter_bf16(_splitk_reduce_kernel, x.dtype), num_warps=4)


def _tiled(x, weight, bias, rows, chunk_norm_weight, input_norm_weight, eps, out, carver: Carver, pl: Plan,
           folded: bool = False) -> None:
    p = pl.problem
    scales = _scales_for(x, rows, chunk_norm_weight, input_norm_weight, eps, carver, pl)
    cfg = pl.cfg
    grid = (triton.cdiv(p.M, cfg["BLOCK_M"]) * triton.cdiv(p.N, cfg["BLOCK_N"]),)
    _tiled_kernel[grid](
        x, x.stride(0), weight, weight.stride(0), _dummy(rows, x), _dummy(input_norm_weight, x),
        _dummy(chunk_norm_weight, x), _dummy(scales, x), _dummy(bias, x), out, out.stride(0),
        p.M, p.N, p.R, p.CH, p.NC,
        HAS_ROWS=rows is not None, HAS_SCALE=p.has_scale, HAS_BIAS=bias is not None,
        **_gain_flags(chunk_norm_weight, input_norm_weight, folded),
        INTERPRETER_BF16=interpreter_bf16(_tiled_kernel, x.dtype), INPUT_PRECISION=_input_precision(x.dtype), **cfg)


def prepare_input(x, rows, chunk_norm_weight, input_norm_weight, eps, M: int,
                  out: Optional[torch.Tensor] = None, folded: bool = False) -> torch.Tensor:
    """``norm(x[rows])`` rounded to x's dtype, [M, K*H] (NaN rows for out-of-range indices),
    written into ``out`` (M*K*H elements of x's dtype; a new tensor when None: tests). ``folded``:
    the RMS scales only (the norm weights are in the fc weight)."""
    R, KH = x.shape
    NC, CH = fc_rules.chunks(x, chunk_norm_weight)
    if out is None:
        out = torch.empty(M * KH, dtype=x.dtype, device=x.device)
    prep = out.view(M, KH)
    if KH == 0:
        return prep
    block = 256 if x.device.type != "cuda" else 1024
    per_program = _rows_per_program(_row_scales_kernel, M)
    _row_scales_kernel[(triton.cdiv(M, per_program),)](
        x, x.stride(0), _dummy(rows, x), _dummy(input_norm_weight, x), _dummy(chunk_norm_weight, x), x, prep,
        prep.stride(0), M, R, KH, CH, NC, float(eps),
        HAS_ROWS=rows is not None, HAS_IN_NORM=input_norm_weight is not None,
        HAS_CHUNK_NORM=chunk_norm_weight is not None, WRITE_PREPARED=True, BLOCK=block, ROWS=per_program,
        INTERPRETER_BF16=interpreter_bf16(_row_scales_kernel, x.dtype), APPLY_GAINS=not folded, num_warps=4)
    return prep


def _cublas(x, weight, bias, rows, chunk_norm_weight, input_norm_weight, eps, out, carver: Carver, pl: Plan,
            folded: bool = False) -> None:
    """``F.linear`` (cuBLAS on a GPU) on the prepared input; x itself when nothing is to prepare."""
    p = pl.problem
    if not fc_rules.prepares_input(rows, chunk_norm_weight, input_norm_weight):
        inp = x
    elif p.KH == 0:
        inp = x.as_strided((p.M, 0), (0, 1))  # nothing to prepare: out = bias (or 0)
    else:
        inp = prepare_input(x, rows, chunk_norm_weight, input_norm_weight, eps, p.M, carver.take(p.M * p.KH, x.dtype),
                            folded)
    if bias is not None:
        torch.addmm(bias, inp, weight.t(), out=out)
    else:
        torch.mm(inp, weight.t(), out=out)


_RUN = {"skinny": _skinny, "tiled": _tiled, "cublas": _cublas}


def draft_fc_workspace_bytes(x, weight, bias, rows, chunk_norm_weight, input_norm_weight, norm_folded: bool = False,
                             split_len: Optional[int] = None) -> int:
    """Workspace bytes :func:`draft_fc` carves for exactly these arguments on x.device (pure)."""
    return plan(x, weight, bias, rows, chunk_norm_weight, input_norm_weight, split_len, norm_folded).nbytes


def draft_fc_plan(x, weight, bias, rows, chunk_norm_weight, input_norm_weight, norm_folded: bool = False,
                  path: Optional[str] = None) -> Plan:
    """:func:`plan` in the argument order every backend's ``draft_fc_plan`` takes."""
    return plan(x, weight, bias, rows, chunk_norm_weight, input_norm_weight, None, norm_folded, path)


def draft_fc(x, weight, bias, rows, chunk_norm_weight, input_norm_weight, eps, out, workspace,
             norm_folded: bool = False, split_len: Optional[int] = None, planned: Optional[Plan] = None) -> None:
    """Backend entry point (arguments validated, M > 0): ``out = linear(norm(x[rows]), weight, bias)``
    on the path of ``planned`` (this call's :func:`plan`, made once by the caller), else of :func:`plan`;
    scratch is carved from ``workspace`` (uint8, at least the plan's bytes; None when that is 0).
    ``split_len``: see :func:`plan`."""
    pl = planned if planned is not None else plan(x, weight, bias, rows, chunk_norm_weight, input_norm_weight,
                                                  split_len, norm_folded)
    carver = Carver(workspace)
    bias, rows, input_norm_weight = fc_rules.unit_stride_copies(carver, bias, rows, input_norm_weight)
    with interpreter_serialized(_skinny_kernel):
        _RUN[pl.path](x, weight, bias, rows, chunk_norm_weight, input_norm_weight, eps, out, carver, pl, norm_folded)


__all__ = ["Plan", "draft_fc", "draft_fc_plan", "draft_fc_workspace_bytes", "interpreted", "interpreter_serialized",
           "plan",
           "prepare_input", "skinny_config", "split_plan", "tiled_config"]
