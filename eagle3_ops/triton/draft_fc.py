"""Triton draft fc: ``out[M, N] = linear(norm(x[rows]), weight, bias)`` (DESIGN.md §4 op 3).

Exact math: ``eagle3_ops.reference.draft_fc_ref`` (input_norm over the K*H row first, then one
RMSNorm per H-wide chunk, fp32 accumulation, one rounding into ``out``).

Bytes and FLOPs: the weight is N*K*H elements (3*7168*7168*2 B = 308 MB in bf16 at H=7168) and is
read once; x contributes M*K*H elements, out M*N; FLOPs = 2*M*N*K*H. Below M ~ 130-280 (device
dependent, DESIGN.md §2) the weight read is the floor, above it the matrix units are.

Three paths, chosen per call by :data:`CROSSOVER` (the one table of crossover points):

* ``skinny`` (decode/verify, small M): swap-AB split-K. Program (token tile, weight tile, split)
  computes ``W[n tile, k range] @ x[rows][token tile, k range]^T`` with the weight on the MMA's
  wide side, so the weight streams once in 16-byte loads (cp.async pipeline on sm_90/sm_120;
  evict-first / evict-last hints where plain loads are used) while the few gathered x rows stay
  in cache. Each split lies inside one H-wide chunk, so a chunk's RMS scale
  multiplies the fp32 partial (linearity) instead of every program re-reading the whole row. fp32
  partials go to a workspace; a second kernel sums the splits in fixed order (deterministic), adds
  bias and writes ``out``. With one split the first kernel writes ``out`` directly.
* ``tiled`` (mid M): a tiled GEMM with the same prologue (row gather; norm weights and the chunk's
  RMS scale multiply the x tile on the fly); no split, no workspace.
* ``cublas`` (large M): cuBLAS (``torch.addmm``/``torch.mm`` with ``out=``, the GEMM ``F.linear``
  runs) on the prepared input ``norm(x[rows])`` rounded to the dtype (what stock SGLang feeds it);
  x is passed straight through when there is no gather and no norm.

Pre-fc norms without a K-wide pre-pass inside every program (KERNELS.md fact 6): a tiny kernel
computes one fp32 scale per (row, chunk) first, ``a[m, c] = s_m * rsqrt(s_m^2 * mean_c((x*g_in)^2)
+ eps)`` where ``s_m = rsqrt(mean(x^2) + eps)`` is the input-norm scale (1 without it). The norm
weights ``g = input_norm_weight * chunk_norm_weight`` multiply x on the fly. Row indices outside
``[0, R)`` are never dereferenced: those rows load as zeros and their outputs are NaN. Index
arithmetic is int64 wherever a row index meets a row stride (M * K*H or M * N may exceed 2^31).

Memory (DESIGN.md §4, ``_out`` does not allocate): the row scales, the split-K partials, the
prepared cuBLAS input and unit-stride copies of strided 1-D views (rows / bias / input_norm_weight;
contiguous ones are used in place) live in :mod:`eagle3_ops.workspace`, a grow-only scratch per
(device, kind). After one call with the largest problem, ``draft_fc_out`` allocates nothing
(cuBLAS's own workspace is PyTorch's, also allocated once per stream). Growth while a CUDA graph
is being captured is ALLOWED (legal: the buffer comes from the graph's pool) and a buffer a
capture has seen is never freed afterwards, so replays stay valid; warm up eagerly with the
largest M before capturing to keep the graph pool out of it. Calls on one device must be
stream-ordered (they share the scratch).

Under ``TRITON_INTERPRET=1`` (CPU tests) ``_interpreter_shim`` upcasts bf16 ``tl.dot`` operands and
rounds bf16 conversions to nearest even (the interpreter gets both wrong); the compiled GPU kernels
never see that shim (its constexpr flag is False there).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from .. import workspace
from ._interpreter_shim import cast, dot, interpreted, interpreter_bf16


# ---- the crossover table -------------------------------------------------------------------------
@dataclass(frozen=True)
class Crossover:
    """Which path serves which M on one device family: skinny for M <= skinny_max_m, tiled for
    skinny_max_m < M <= tiled_max_m, cuBLAS above."""

    device: str
    skinny_max_m: int
    tiled_max_m: int
    basis: str

    def path(self, M: int) -> str:
        if M <= self.skinny_max_m:
            return "skinny"
        if M <= self.tiled_max_m:
            return "tiled"
        return "cublas"


# THE crossover table. Update it from `pytest benchmarks/bench_draft_fc.py` on the device (the
# benchmark prints every path for every M; set the entries to the measured crossover points and
# replace `basis` with the device, date and numbers). Until then the entries are DESIGN ESTIMATES
# from DESIGN.md §2 / KERNELS.md, NOT measurements: no GPU was available when they were written.
CROSSOVER = {
    "sm_90": Crossover(
        device="H200 (sm_90, 132 SMs, ~4.3 TB/s copy, ~790 TFLOP/s bf16)",
        skinny_max_m=128, tiled_max_m=128,
        basis="design estimate, not measured: the weight read is the floor up to M ~ 790e12/4.3e12 ~ 180 "
              "(72 us at H=7168); skinny stops at 128 to leave margin for the split-K partial traffic "
              "(S*M*N*4 B). Above it cuBLAS's wgmma GEMM is assumed to beat a Triton tile, so tiled is off."),
    "sm_120": Crossover(
        device="RTX PRO 6000 / RTX 5090 (sm_120, 1.79 TB/s, ~500 / ~210 TFLOP/s bf16)",
        skinny_max_m=128, tiled_max_m=512,
        basis="design estimate, not measured: memory-bound up to M ~ 280 (PRO 6000) / ~117 (5090); "
              "cuBLAS on sm_120 runs sm80 tiles plus a separate split-K reduce (KERNELS.md fact 5), so a "
              "fused tiled kernel is assumed to win up to M = 512 by skipping the prepared-input pass."),
    "default": Crossover(
        device="any other GPU", skinny_max_m=64, tiled_max_m=64,
        basis="conservative guess, not measured: short skinny range, cuBLAS above"),
    "interpreter": Crossover(
        device="CPU, Triton interpreter (tests only; no speed meaning)", skinny_max_m=16, tiled_max_m=1 << 30,
        basis="chosen so that the CPU tests run both Triton kernels"),
}


def crossover_for(device: torch.device) -> Crossover:
    if device.type != "cuda":
        return CROSSOVER["interpreter"]
    major, _ = torch.cuda.get_device_capability(device)
    return CROSSOVER.get(f"sm_{major}0", CROSSOVER["default"])


# ---- launch configuration (design estimates as well; the benchmark is the judge) -----------------
def arch_major(device: torch.device) -> int:
    """Compute-capability major of a GPU; 0 stands for the CPU interpreter in the configs below."""
    return torch.cuda.get_device_capability(device)[0] if device.type == "cuda" else 0


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


def _problem(x, weight, rows, chunk_norm_weight, input_norm_weight, out) -> _Problem:
    R, KH = x.shape
    NC, CH = (chunk_norm_weight.shape[0], chunk_norm_weight.shape[1]) if chunk_norm_weight is not None else (1, KH)
    has_scale = chunk_norm_weight is not None or input_norm_weight is not None
    return _Problem(out.shape[0], weight.shape[0], R, KH, NC, CH, has_scale)


def _scratch(device: torch.device, kind: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
    return workspace.get(device, "draft_fc." + kind, numel, dtype)


def _unit_stride(t: Optional[torch.Tensor], kind: str) -> Optional[torch.Tensor]:
    """The kernels index bias / rows / norm weights with stride 1; validation allows any stride for
    1-D tensors, so a strided view is copied into scratch (one copy kernel, no allocation once
    warm); the usual contiguous tensors are passed through untouched."""
    if t is None or t.is_contiguous():
        return t
    dst = _scratch(t.device, kind, t.numel(), t.dtype)
    dst.copy_(t)
    return dst


def _unit_stride_args(bias, rows, input_norm_weight) -> tuple:
    return _unit_stride(bias, "bias"), _unit_stride(rows, "rows"), _unit_stride(input_norm_weight, "input_norm")


def _dummy(t: Optional[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """Kernels take a pointer for every optional tensor; absent ones are never read (constexpr off)."""
    return t if t is not None else like


# ---- kernels ---------------------------------------------------------------------------------------
@triton.jit
def _row_scales_kernel(x_ptr, stride_x, rows_ptr, in_w_ptr, chunk_w_ptr, scale_ptr, prep_ptr, stride_prep,
                       R, KH, CH, NC, eps,
                       HAS_ROWS: tl.constexpr, HAS_IN_NORM: tl.constexpr, HAS_CHUNK_NORM: tl.constexpr,
                       WRITE_PREPARED: tl.constexpr, BLOCK: tl.constexpr, INTERPRETER_BF16: tl.constexpr):
    """One program per output row m. Computes a[m, c] (the fp32 RMS scale of chunk c, see module
    doc) into scale_ptr[m*NC + c], or, with WRITE_PREPARED, writes the whole normalized row
    ``norm(x[rows[m]])`` in the dtype into prep_ptr (NaN row when rows[m] is out of range)."""
    m = tl.program_id(0).to(tl.int64)  # m * stride_prep exceeds int32 once M * K*H > 2^31
    if HAS_ROWS:
        row = tl.load(rows_ptr + m).to(tl.int64)
    else:
        row = m
    valid = (row >= 0) & (row < R)
    row = tl.where(valid, row, 0)
    x_row = x_ptr + row * stride_x
    offs = tl.arange(0, BLOCK)
    if HAS_IN_NORM:
        sq = tl.zeros([BLOCK], dtype=tl.float32)
        for k0 in range(0, KH, BLOCK):
            xv = tl.load(x_row + k0 + offs, mask=((k0 + offs) < KH) & valid, other=0.0).to(tl.float32)
            sq += xv * xv
        s = tl.rsqrt(tl.sum(sq, axis=0) / KH + eps)
    else:
        s = 1.0
    for c in range(0, NC):
        base = c * CH
        if HAS_CHUNK_NORM:
            q = tl.zeros([BLOCK], dtype=tl.float32)
            for k0 in range(0, CH, BLOCK):
                kk = base + k0 + offs
                k_in = (k0 + offs) < CH
                xv = tl.load(x_row + kk, mask=k_in & valid, other=0.0).to(tl.float32)
                if HAS_IN_NORM:
                    xv = xv * tl.load(in_w_ptr + kk, mask=k_in, other=0.0).to(tl.float32)
                q += xv * xv
            a = s * tl.rsqrt(s * s * (tl.sum(q, axis=0) / CH) + eps)
        else:
            a = s
        if WRITE_PREPARED:
            for k0 in range(0, CH, BLOCK):
                kk = base + k0 + offs
                k_in = (k0 + offs) < CH
                v = tl.load(x_row + kk, mask=k_in & valid, other=0.0).to(tl.float32) * a
                if HAS_IN_NORM:
                    v = v * tl.load(in_w_ptr + kk, mask=k_in, other=0.0).to(tl.float32)
                if HAS_CHUNK_NORM:
                    v = v * tl.load(chunk_w_ptr + kk, mask=k_in, other=0.0).to(tl.float32)
                v = tl.where(valid, v, float("nan"))
                tl.store(prep_ptr + m * stride_prep + kk, cast(v, prep_ptr.dtype.element_ty, INTERPRETER_BF16), mask=k_in)
        else:
            tl.store(scale_ptr + m * NC + c, tl.where(valid, a, float("nan")))


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
def _apply_norm_weights(xv, kk, k_in, in_w_ptr, chunk_w_ptr, row_scale, AXIS: tl.constexpr,
                        HAS_IN_NORM: tl.constexpr, HAS_CHUNK_NORM: tl.constexpr, HAS_ROW_SCALE: tl.constexpr,
                        INTERPRETER_BF16: tl.constexpr):
    """x tile (k along axis AXIS) times g = input_norm_weight * chunk_norm_weight, and times the
    per-row scale when HAS_ROW_SCALE, rounded back to the dtype for the matrix product (the stock
    path rounds its normalized input the same way)."""
    if HAS_IN_NORM or HAS_CHUNK_NORM:
        g = tl.full(kk.shape, 1.0, tl.float32)
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
                          INTERPRETER_BF16: tl.constexpr):
    """out[m, n] = sum over splits s = 0, 1, ... S-1 (always this order) + bias; NaN rows for
    out-of-range indices."""
    m = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    n_in = offs < N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(0, S):
        acc += tl.load(ws_ptr + (s * M + m) * N + offs, mask=n_in, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs, mask=n_in, other=0.0).to(tl.float32)
    if HAS_ROWS:
        row = tl.load(rows_ptr + m)
        acc = tl.where((row >= 0) & (row < R), acc, float("nan"))
    tl.store(out_ptr + m * stride_out + offs, cast(acc, out_ptr.dtype.element_ty, INTERPRETER_BF16), mask=n_in)


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
def _row_scales(x, rows, chunk_norm_weight, input_norm_weight, eps, p: _Problem) -> torch.Tensor:
    """fp32 [M, NC] scales a[m, c] (the tiny first pass; reads only the M gathered rows)."""
    scales = _scratch(x.device, "row_scales", p.M * p.NC, torch.float32).view(p.M, p.NC)
    block = 256 if x.device.type != "cuda" else 1024
    _row_scales_kernel[(p.M,)](
        x, x.stride(0), _dummy(rows, x), _dummy(input_norm_weight, x), _dummy(chunk_norm_weight, x), scales, x, 0,
        p.R, p.KH, p.CH, p.NC, float(eps),
        HAS_ROWS=rows is not None, HAS_IN_NORM=input_norm_weight is not None,
        HAS_CHUNK_NORM=chunk_norm_weight is not None, WRITE_PREPARED=False, BLOCK=block,
        INTERPRETER_BF16=interpreter_bf16(_row_scales_kernel, x.dtype), num_warps=4)
    return scales


def skinny_config(arch: int, M: int, itemsize: int) -> dict:
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


def skinny_fc_out(x, weight, bias, rows, chunk_norm_weight, input_norm_weight, eps, out,
                  split_len: Optional[int] = None) -> None:
    """The skinny split-K path (any M; chosen for small M). ``split_len`` overrides the split
    length (tests use it to force several splits per chunk)."""
    bias, rows, input_norm_weight = _unit_stride_args(bias, rows, input_norm_weight)
    p = _problem(x, weight, rows, chunk_norm_weight, input_norm_weight, out)
    device = x.device
    scales = _row_scales(x, rows, chunk_norm_weight, input_norm_weight, eps, p) if p.has_scale else None
    cfg = skinny_config(arch_major(device), p.M, x.element_size())
    tiles_m, tiles_n = triton.cdiv(p.M, cfg["BLOCK_M"]), triton.cdiv(p.N, cfg["BLOCK_N"])
    per_chunk, split_len = split_plan(p.CH, p.NC, tiles_m * tiles_n, cfg["BLOCK_K"], _num_sms(device), split_len)
    S = p.NC * per_chunk
    ws = _scratch(device, "splitk", S * p.M * p.N, torch.float32) if S > 1 else None
    _skinny_kernel[(tiles_m, tiles_n, S)](
        x, x.stride(0), weight, weight.stride(0), _dummy(rows, x), _dummy(input_norm_weight, x),
        _dummy(chunk_norm_weight, x), _dummy(scales, x), _dummy(bias, x), out, out.stride(0), _dummy(ws, x),
        p.M, p.N, p.R, p.CH, p.NC, per_chunk, split_len,
        HAS_ROWS=rows is not None, HAS_IN_NORM=input_norm_weight is not None,
        HAS_CHUNK_NORM=chunk_norm_weight is not None, HAS_SCALE=p.has_scale, HAS_BIAS=bias is not None,
        WRITE_PARTIAL=S > 1, INTERPRETER_BF16=interpreter_bf16(_skinny_kernel, x.dtype),
        INPUT_PRECISION=_input_precision(x.dtype), **cfg)
    if S > 1:
        block = 1024 if device.type == "cuda" else 256
        _splitk_reduce_kernel[(p.M, triton.cdiv(p.N, block))](
            ws, _dummy(bias, x), _dummy(rows, x), out, out.stride(0), p.M, p.N, p.R, S,
            HAS_ROWS=rows is not None, HAS_BIAS=bias is not None, BLOCK=block,
            INTERPRETER_BF16=interpreter_bf16(_splitk_reduce_kernel, x.dtype), num_warps=4)


def tiled_config(arch: int, itemsize: int) -> dict:
    if arch == 0:  # interpreter: few, large programs
        return dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, GROUP_M=2, num_warps=4, num_stages=1)
    bm, bn, bk = 128, 128, 64
    stages = _stages(arch, (bm + bn) * bk * itemsize, max_stages=4)
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=8, num_stages=stages)


def tiled_fc_out(x, weight, bias, rows, chunk_norm_weight, input_norm_weight, eps, out) -> None:
    """The tiled GEMM path with the fused prologue (any M; chosen for mid M)."""
    bias, rows, input_norm_weight = _unit_stride_args(bias, rows, input_norm_weight)
    p = _problem(x, weight, rows, chunk_norm_weight, input_norm_weight, out)
    scales = _row_scales(x, rows, chunk_norm_weight, input_norm_weight, eps, p) if p.has_scale else None
    cfg = tiled_config(arch_major(x.device), x.element_size())
    grid = (triton.cdiv(p.M, cfg["BLOCK_M"]) * triton.cdiv(p.N, cfg["BLOCK_N"]),)
    _tiled_kernel[grid](
        x, x.stride(0), weight, weight.stride(0), _dummy(rows, x), _dummy(input_norm_weight, x),
        _dummy(chunk_norm_weight, x), _dummy(scales, x), _dummy(bias, x), out, out.stride(0),
        p.M, p.N, p.R, p.CH, p.NC,
        HAS_ROWS=rows is not None, HAS_IN_NORM=input_norm_weight is not None,
        HAS_CHUNK_NORM=chunk_norm_weight is not None, HAS_SCALE=p.has_scale, HAS_BIAS=bias is not None,
        INTERPRETER_BF16=interpreter_bf16(_tiled_kernel, x.dtype), INPUT_PRECISION=_input_precision(x.dtype), **cfg)


def prepare_input(x, rows, chunk_norm_weight, input_norm_weight, eps, M: int) -> torch.Tensor:
    """``norm(x[rows])`` rounded to x's dtype, [M, K*H] (NaN rows for out-of-range indices), in
    scratch: valid until the next draft_fc call on this device."""
    R, KH = x.shape
    NC, CH = (chunk_norm_weight.shape[0], chunk_norm_weight.shape[1]) if chunk_norm_weight is not None else (1, KH)
    prep = _scratch(x.device, "prepared", M * KH, x.dtype).view(M, KH)
    block = 256 if x.device.type != "cuda" else 1024
    _row_scales_kernel[(M,)](
        x, x.stride(0), _dummy(rows, x), _dummy(input_norm_weight, x), _dummy(chunk_norm_weight, x), x, prep,
        prep.stride(0), R, KH, CH, NC, float(eps),
        HAS_ROWS=rows is not None, HAS_IN_NORM=input_norm_weight is not None,
        HAS_CHUNK_NORM=chunk_norm_weight is not None, WRITE_PREPARED=True, BLOCK=block,
        INTERPRETER_BF16=interpreter_bf16(_row_scales_kernel, x.dtype), num_warps=4)
    return prep


def cublas_fc_out(x, weight, bias, rows, chunk_norm_weight, input_norm_weight, eps, out) -> None:
    """``F.linear`` (cuBLAS on a GPU) on the prepared input; x itself when nothing is to prepare."""
    bias, rows, input_norm_weight = _unit_stride_args(bias, rows, input_norm_weight)
    if rows is None and chunk_norm_weight is None and input_norm_weight is None:
        inp = x
    else:
        inp = prepare_input(x, rows, chunk_norm_weight, input_norm_weight, eps, out.shape[0])
    if bias is not None:
        torch.addmm(bias, inp, weight.t(), out=out)
    else:
        torch.mm(inp, weight.t(), out=out)


PATHS = {"skinny": skinny_fc_out, "tiled": tiled_fc_out, "cublas": cublas_fc_out}


def choose_path(M: int, device: torch.device) -> str:
    return crossover_for(device).path(M)


def draft_fc_out(x, weight, bias, rows, chunk_norm_weight, input_norm_weight, eps, out) -> None:
    """Backend entry point (arguments already validated, M > 0): the path from :data:`CROSSOVER`."""
    path = choose_path(out.shape[0], x.device)
    if path == "skinny" and x.dtype == torch.float16 and (chunk_norm_weight is not None or input_norm_weight is not None):
        # The skinny kernel feeds the dot x * norm weights *before* the RMS scale (applied to the fp32
        # partials); in fp16 that product can overflow 65504 where norm(x) cannot. The tiled kernel
        # scales x on the fly, so it is safe.
        path = "tiled"
    PATHS[path](x, weight, bias, rows, chunk_norm_weight, input_norm_weight, eps, out)



__all__ = ["CROSSOVER", "Crossover", "choose_path", "crossover_for", "cublas_fc_out", "draft_fc_out",
           "interpreted", "prepare_input", "skinny_fc_out", "split_plan", "tiled_fc_out", "PATHS"]
