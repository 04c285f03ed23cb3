"""The CUDA skinny draft fc's performance model: ONE model, used by the split planner
(``cuda_backend.skinny_choice``) and printed by the static model (``benchmarks/static_model.py``,
which fills it from the built cubins). Pure Python, no torch. **A model, not a measurement**: every
device number below is a datasheet figure or a design estimate (docs/kernels.md §1, §7.5); the
qualification in front of every kernel (design.md §14) measures on the device and overrules it.

What it models (csrc/draft_fc.cu, docs/kernels.md §7): the grid runs in waves of the blocks that
can be resident (registers, shared memory, threads: :func:`blocks_per_sm`). Each block (one of
:data:`SKINNY_SHAPES`: ``rows`` weight rows, ``rows / 16`` warps) streams its split of the weight
through a ring of ``stages`` steps of 64 k, so it keeps ``(stages - 1)`` steps =
``(stages - 1) * rows * 128`` bytes of weight requests in flight. A wave of ``n`` blocks then reads
DRAM at ``min(bandwidth, n * in_flight / latency)`` (Little's law) after one latency to fill; it is
also bounded by what the SMs can issue (instructions per step from the SASS), by the tensor rate
(``mma.sync``), and by L2 -> SM traffic (the weight plus the x tile each block copies: at 64 tokens
per tile x is as many bytes as a 64-row block's weight, half as many as a 128-row block's). Around
the waves: the norm pre-pass's bytes (its latency overlaps the skinny kernel's first weight
requests by PDL), the split-K partials (written back to DRAM, read again from L2 by the reducer)
and the reducer's dependent L2 round trip (its launch overlaps the skinny grid's tail by PDL).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Dict, Optional, Sequence, Tuple

# ---- the kernel's launch shape (csrc/draft_fc_launch.h; tests/test_build.py checks the cubins) ------
# (NT, rows, stages) of every fc_skinny_kernel<T, NT, rows, stages> built (kSkinnyShapes): 64-row
# blocks for every token tile, and at NT = 8 128-row blocks with a 4-stage ring (fits sm_120) or a
# 6-stage one (sm_90 only).
SKINNY_SHAPES = ((1, 64, 4), (2, 64, 4), (4, 64, 4), (8, 64, 3), (8, 128, 4), (8, 128, 6))
DEFAULT_ROWS = 64        # kDefaultSkinnyRows
MAX_TOKEN_GROUPS = 8     # kMaxTokenGroups: token tile of 8, 16, 32 or 64 tokens
MAX_SPLITS = 64          # kMaxSplits
SPLIT_STEP = 64          # kStep: k per ring step
MIN_STEPS_PER_SPLIT = 8  # kMinSplitSteps
PIECE = 1024             # kPiece: elements per norm pre-pass block
STATIC_SHARED_LIMIT = 48 * 1024  # kStaticSharedLimit: larger rings are dynamic shared memory
# The ring depth of the 64-row block of each token tile (what a launch without a block shape gets).
STAGES = {nt: st for nt, rows, st in SKINNY_SHAPES if rows == DEFAULT_ROWS}


def token_groups(M: int) -> int:
    """NT, the skinny kernel's token groups of 8 per tile for M output rows (1, 2, 4 or 8)."""
    groups = -(-min(M, 8 * MAX_TOKEN_GROUPS) // 8)
    return 1 if groups <= 1 else 2 if groups <= 2 else 4 if groups <= 4 else 8


def shapes_for(nt: int) -> Tuple[Tuple[int, int, int], ...]:
    """The built (NT, rows, stages) block shapes of token tile ``nt``."""
    return tuple(shape for shape in SKINNY_SHAPES if shape[0] == nt)


def threads(rows: int) -> int:
    """Threads of a block of ``rows`` weight rows: a warp per 16 rows (skinny_threads)."""
    return 2 * rows


def shared_bytes(nt: int, rows: int = DEFAULT_ROWS, stages: Optional[int] = None) -> int:
    """Shared memory of fc_skinny_kernel<T, nt, rows, stages> (skinny_shared_bytes): the ring's
    weight tiles [rows][64] and x tiles [8 nt][64], 16-byte chunks."""
    stages = STAGES[nt] if stages is None else stages
    return stages * (rows * SPLIT_STEP // 8 + 8 * nt * SPLIT_STEP // 8) * 16


def in_flight_bytes(nt: int, elem_bytes: int = 2, rows: int = DEFAULT_ROWS, stages: Optional[int] = None) -> int:
    """Weight bytes one block keeps requested while it multiplies a step: stages - 1 steps."""
    stages = STAGES[nt] if stages is None else stages
    return (stages - 1) * rows * SPLIT_STEP * elem_bytes


def split_shape(CH: int, NC: int, asked: int) -> Tuple[int, int]:
    """(splits per chunk, split length) the op launches for ``asked`` splits per chunk: the clamp of
    csrc/draft_fc.cu skinny_plan (whole 64-wide steps, at least 8 of them, at most 64 splits)."""
    per_chunk = max(1, min(asked, CH // (MIN_STEPS_PER_SPLIT * SPLIT_STEP), MAX_SPLITS // NC))
    per_split = -(-CH // per_chunk)  # ceil(CH / per_chunk)
    split_len = -(-per_split // SPLIT_STEP) * SPLIT_STEP  # rounded up to whole steps
    return -(-CH // split_len), split_len


def max_splits_per_chunk(CH: int, NC: int) -> int:
    """The most splits per chunk the op's clamp allows (asking for more launches this many)."""
    return split_shape(CH, NC, 1 << 30)[0]


# ---- devices ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SmLimits:
    """Per-SM residency limits of a compute capability (CUDA C++ Programming Guide, "Features and
    Technical Specifications"; the register allocation rule of the CUDA occupancy calculator,
    cuda_occupancy.h: registers per warp rounded up to 256, allocated per SM sub-partition; 1 KB of
    shared memory reserved per block)."""

    max_threads: int          # resident threads per SM: 2048 on cc 9.0, 1536 on cc 12.0
    shared_per_sm: int        # bytes: 228 KB on cc 9.0, 100 KB on cc 12.0
    shared_per_block: int     # the opt-in maximum of one block: 227 KB on cc 9.0, 99 KB on cc 12.0
    max_blocks: int = 32
    registers: int = 65536
    reg_alloc_unit: int = 256
    sub_partitions: int = 4
    shared_reserved_per_block: int = 1024


SM_LIMITS = {"sm_90": SmLimits(max_threads=2048, shared_per_sm=228 * 1024, shared_per_block=227 * 1024),
             "sm_120": SmLimits(max_threads=1536, shared_per_sm=100 * 1024, shared_per_block=99 * 1024)}


def blocks_per_sm(regs_per_thread: int, shared: int, threads_per_block: int, limits: SmLimits) -> int:
    """Resident blocks per SM: the smallest of the register, shared memory, thread and block limits.
    E.g. 124 registers x 128 threads, 48 KB shared on sm_90: 3968 -> 4096 registers per warp -> 4
    warps per sub-partition -> 4 blocks; 228 KB / 49 KB -> 4 blocks. 0 where one block's shared memory
    exceeds the per-block maximum (the kernel cannot launch there)."""
    if shared > limits.shared_per_block:
        return 0
    warps = -(-threads_per_block // 32)
    per_warp = -(-(regs_per_thread * 32) // limits.reg_alloc_unit) * limits.reg_alloc_unit
    warps_by_regs = (limits.registers // limits.sub_partitions // per_warp) * limits.sub_partitions
    by_shared = limits.shared_per_sm // (shared + limits.shared_reserved_per_block) if shared else limits.max_blocks
    return max(0, min(warps_by_regs // warps, limits.max_threads // (32 * warps), limits.max_blocks, by_shared))


@dataclass(frozen=True)
class Device:
    """What the model needs of a GPU. Sources: ``read_bw`` as docs/kernels.md §1 (H200: ~90% of the
    4.8 TB/s datasheet, a design estimate; sm_120: the 1792 GB/s datasheet); ``latency`` a design
    estimate of loaded DRAM latency (~1 us, docs/kernels.md §7.5); ``l2_bw`` (L2 -> SM) and
    ``l2_latency`` and ``sm_l2_bytes_per_clock`` (one SM's L2 port) design estimates, no datasheet
    gives them; ``mma_rate`` the dense bf16 rate with fp32 accumulate that
    mma.sync is assumed to reach (sm_90: ~2/3 of the 989 TFLOP/s datasheet, wgmma being the rest;
    sm_120: docs/kernels.md §1); ``clock`` the boost clock of the datasheets."""

    name: str
    arch: str       # "sm_90" or "sm_120"
    sms: int
    read_bw: float  # bytes/s
    latency: float  # s
    l2_bw: float    # bytes/s
    mma_rate: float  # FLOP/s
    clock: float    # Hz
    l2_latency: float = 0.5e-6  # s, one dependent L2 round trip under load
    # bytes one SM can take from L2 per clock (its L1 <- L2 port), a design estimate: with fewer
    # resident blocks than SMs (the 128-row blocks at small N) each SM must stream faster
    sm_l2_bytes_per_clock: float = 64.0

    @property
    def limits(self) -> SmLimits:
        """The per-SM resource limits of this device's arch (:data:`SM_LIMITS`), for the occupancy model."""
        return SM_LIMITS[self.arch]

    @property
    def bytes_in_flight_needed(self) -> float:
        """Little's law: what the whole GPU must keep requested to stream at ``read_bw``."""
        return self.read_bw * self.latency


# Read bandwidth a streaming kernel can reach, as a fraction of the memory's peak (H200: 4.3 of the 4.8 TB/s
# datasheet, docs/kernels.md §1): a design estimate, applied to the peak a GPU reports (device_for).
READ_FRACTION = 0.9

DEVICES = {
    # H100 SXM5 80 GB (HBM3, 3.35 TB/s datasheet; a device-to-device copy moved ~3.0 TB/s on the lent one)
    "H100": Device("H100", "sm_90", 132, 3.0e12, 1.0e-6, 7.0e12, 650e12, 1.98e9),
    "H200": Device("H200", "sm_90", 132, 4.3e12, 1.0e-6, 7.0e12, 650e12, 1.98e9),
    "RTX PRO 6000": Device("RTX PRO 6000", "sm_120", 188, 1.79e12, 1.0e-6, 5.0e12, 500e12, 2.6e9),
    "RTX 5090": Device("RTX 5090", "sm_120", 170, 1.79e12, 1.0e-6, 4.5e12, 210e12, 2.4e9),
}


def device_for(name: str, arch: str, sms: int, peak_read_bw: Optional[float] = None,
               clock: Optional[float] = None) -> Device:
    """The model's device for a GPU as it reports itself: its own name, arch and SM count; where it reports them
    (NVML: memory clock x bus width, the boost clock), its memory's peak read bandwidth (times
    :data:`READ_FRACTION`) and clock. What no GPU reports (loaded latency, L2 and tensor rates) comes from the
    modelled device its name names (``H100`` in "NVIDIA H100 80GB HBM3"), else from the one of its arch with the
    nearest SM count; so does what it did not report."""
    same_arch = [d for d in DEVICES.values() if d.arch == arch] or [DEVICES["H200"]]
    named = [d for d in same_arch if d.name.lower() in name.lower()]
    base = max(named, key=lambda d: len(d.name)) if named else min(same_arch, key=lambda d: abs(d.sms - sms))
    label = name if named else f"{name} ({base.name}-like {arch})"
    return replace(base, name=label, sms=sms,
                   read_bw=base.read_bw if not peak_read_bw else READ_FRACTION * peak_read_bw,
                   clock=base.clock if not clock else clock)


@dataclass(frozen=True)
class Kernel:
    """What the model needs of one fc_skinny_kernel<T, NT, rows, stages> build: from the cubins
    (``cuobjdump -res-usage`` and the SASS hot loop) or from cuda_backend's tables of them."""

    nt: int
    regs: int
    shared: int
    stages: int
    instructions_per_step: float  # per warp and 64-wide k step, the hot loop's issue count
    elem_bytes: int = 2
    rows: int = DEFAULT_ROWS      # weight rows per block

    @property
    def shape(self) -> Tuple[int, int, int]:
        """(NT, rows, stages): the block shape this build was made for."""
        return (self.nt, self.rows, self.stages)

    @property
    def threads(self) -> int:
        """Threads per block: a warp per 16 weight rows (:func:`threads`)."""
        return threads(self.rows)

    @property
    def in_flight(self) -> int:
        """Bytes of weight one block keeps requested in its ring: (stages - 1) steps of ``rows`` x ``SPLIT_STEP``
        elements."""
        return (self.stages - 1) * self.rows * SPLIT_STEP * self.elem_bytes


@dataclass
class Prediction:
    """The model's prediction for one skinny call: total time (inf: cannot launch), the weight-read floor, the losses
    above it by cause, and the split, block and wave counts behind them."""
    time: float                 # s, the whole call (pre-pass, skinny, reducer); inf: cannot launch
    floor: float                # s, the weight read at read_bw
    limiter: str                # the largest loss (see LOSSES)
    losses: Dict[str, float] = field(default_factory=dict)  # s above the floor, by cause
    splits_per_chunk: int = 0
    split_len: int = 0
    S: int = 0
    blocks: int = 0
    blocks_per_sm: int = 0
    waves: float = 0.0
    in_flight: float = 0.0      # bytes requested by the first wave's blocks

    @property
    def fraction(self) -> float:
        """Predicted fraction of the read bandwidth: floor / time."""
        return self.floor / self.time if self.time > 0 else 0.0


LOSSES = ("fill latency", "bytes in flight", "L2 bandwidth", "issue rate", "tensor rate", "split-K partials",
          "norm pre-pass", "reducer")


def predict(M: int, N: int, CH: int, NC: int, asked: int, device: Device, kernel: Kernel, norm: bool = False,
            folded: bool = False, bpsm: Optional[int] = None) -> Prediction:
    """The modelled time of one skinny draft fc call asking ``asked`` splits per chunk (see the
    module doc). ``bpsm`` overrides the resident blocks per SM (the CUDA runtime's answer on a GPU)."""
    e = kernel.elem_bytes
    per_chunk, split_len = split_shape(CH, NC, asked)
    S = NC * per_chunk
    KH = NC * CH
    tiles_m = -(-M // (8 * kernel.nt))
    tiles_n = -(-N // kernel.rows)
    blocks = tiles_m * tiles_n * S
    in_flight = kernel.in_flight * N / (tiles_n * kernel.rows)  # rows past N are zero-filled, not requested
    if bpsm is None:
        bpsm = blocks_per_sm(kernel.regs, kernel.shared, kernel.threads, device.limits)
    weight = N * KH * e
    floor = weight / device.read_bw
    if bpsm <= 0:  # the ring does not fit this device: never planned
        return Prediction(math.inf, floor, "shared memory", {}, per_chunk, split_len, S, blocks, 0)
    slots = bpsm * device.sms
    # per block (averages over the grid): DRAM weight bytes (token tiles of one weight tile share it
    # through L2: blockIdx.x is the fastest axis), L2 -> SM bytes (weight + x tile), steps, FLOPs
    dram_blk = weight / (tiles_n * S)
    l2_blk = dram_blk + 8 * kernel.nt * (KH / S) * e
    steps_blk = KH / S / SPLIT_STEP
    flops_blk = 2 * 8 * kernel.nt * kernel.rows * (KH / S)
    warps_per_scheduler = kernel.threads / 32 / 4  # 4 schedulers per SM
    losses = {k: 0.0 for k in LOSSES}
    total = 0.0
    full, rest = divmod(blocks, slots)
    first_wave = min(blocks, slots)
    for n, count_ in ((slots, full), (rest, 1 if rest else 0)):
        if not count_:
            continue
        dram = n * dram_blk / tiles_m
        rate = min(device.read_bw, n * in_flight / device.latency)
        t_mem = device.latency + dram / rate
        per_sm = -(-n // device.sms)
        t_l2 = max(n * l2_blk / device.l2_bw, per_sm * l2_blk / (device.sm_l2_bytes_per_clock * device.clock))
        t_issue = per_sm * warps_per_scheduler * steps_blk * kernel.instructions_per_step / device.clock
        t_mma = per_sm * flops_blk / (device.mma_rate / device.sms)
        t_wave = max(t_mem, t_l2, t_issue, t_mma)
        ideal = dram / device.read_bw
        if t_wave == t_mem:
            losses["fill latency"] += count_ * device.latency
            losses["bytes in flight"] += count_ * (dram / rate - ideal)
        else:
            name = {t_l2: "L2 bandwidth", t_issue: "issue rate", t_mma: "tensor rate"}[t_wave]
            losses[name] += count_ * (t_wave - ideal)
        total += count_ * t_wave
    if S > 1 or norm:
        partial = S * M * N * 4
        losses["split-K partials"] = partial / device.read_bw + partial / device.l2_bw
        losses["reducer"] = device.l2_latency
    if norm:
        losses["norm pre-pass"] = M * KH * e * (1 if folded else 2) / device.read_bw
    time = total + losses["split-K partials"] + losses["reducer"] + losses["norm pre-pass"]
    limiter = max(LOSSES, key=lambda k: losses[k])
    if time - floor < 0.05 * time:
        limiter = "DRAM bandwidth"
    return Prediction(time, floor, limiter, losses, per_chunk, split_len, S, blocks, bpsm, blocks / slots,
                      first_wave * in_flight)


def best_splits(M: int, N: int, CH: int, NC: int, device: Device, kernel: Kernel, norm: bool = False,
                folded: bool = False, bpsm: Optional[int] = None) -> Tuple[int, Prediction]:
    """(splits per chunk to ask for, its prediction) for one kernel: the least modelled time over
    every split shape the op's clamp can launch (no other cap), fewest splits on a tie."""
    best = None
    seen = set()
    for asked in range(1, max_splits_per_chunk(CH, NC) + 1):
        shape = split_shape(CH, NC, asked)
        if shape in seen:
            continue
        seen.add(shape)
        p = predict(M, N, CH, NC, asked, device, kernel, norm, folded, bpsm)
        if best is None or p.time < best[1].time * (1 - 1e-9):
            best = (asked, p)
    return best


def best_plan(M: int, N: int, CH: int, NC: int, device: Device, kernels: Sequence[Kernel], norm: bool = False,
              folded: bool = False, bpsm: Optional[Sequence[Optional[int]]] = None) -> Tuple[Kernel, int, Prediction]:
    """(kernel, splits per chunk, prediction): the least modelled time over the block shapes of M's
    token tile (``kernels``, each with its resident blocks per SM in ``bpsm`` or from the model) and,
    for each, every split count; the first kernel listed on a tie (the 64-row one). A kernel that
    cannot launch on the device (0 blocks per SM) is never chosen."""
    best = None
    for i, k in enumerate(kernels):
        asked, p = best_splits(M, N, CH, NC, device, k, norm, folded, None if bpsm is None else bpsm[i])
        if best is None or p.time < best[2].time * (1 - 1e-9):
            best = (k, asked, p)
    if best is None or math.isinf(best[2].time):
        raise ValueError(f"skinny_model.best_plan: no kernel of {[k.shape for k in kernels]} launches on {device.name}")
    return best


__all__ = ["DEFAULT_ROWS", "DEVICES", "Device", "READ_FRACTION", "device_for", "Kernel", "LOSSES", "MAX_SPLITS",
           "MAX_TOKEN_GROUPS",
           "MIN_STEPS_PER_SPLIT", "PIECE", "Prediction", "SKINNY_SHAPES", "SM_LIMITS", "SPLIT_STEP",
           "STAGES", "STATIC_SHARED_LIMIT", "SmLimits", "best_plan", "best_splits", "blocks_per_sm",
           "in_flight_bytes", "max_splits_per_chunk", "predict", "shapes_for", "shared_bytes", "split_shape", "threads",
           "token_groups"]
