"""The ``cuda`` backend: the compiled kernels of ``eagle3_ops._C`` (csrc/), which registers them as
the torch ops ``torch.ops.eagle3_cuda.*`` when it is imported.

Backend functions (the contract every backend module follows; arguments are already validated and
the output is non-empty): :func:`capture`, :func:`fused_add_rmsnorm_capture`, :func:`draft_fc`,
:func:`draft_fc_workspace_bytes`, plus :func:`serves`.

``draft_fc`` decisions made here, in Python, and passed to the op as arguments:

* the path: ``plans.choose("cuda", device, M)`` (the one crossover table, ``eagle3_ops/plans.py``),
  then the skinny kernel's launch contract (the same rule csrc/draft_fc.cu applied before it became
  an op): bf16/fp16 and not fp16 with norm weights (``fc_rules.fp16_norm_overflow``), K*H > 0, at
  most 64 chunks, a chunk width and x / weight row strides that are multiples of 8, 16-byte aligned
  x, weight, chunk_norm_weight and input_norm_weight with stride 1 (after the unit-stride copy).
  Anything else, and a forced ``tiled`` (the CUDA backend has no tiled kernel), takes ``cublas``;
* the split-K splits per chunk (:func:`skinny_splits`): the count whose grid fills whole waves of
  the blocks that can really be resident (:func:`skinny_blocks_per_sm`: on the GPU, the kernel
  variant's ``cudaOccupancyMaxActiveBlocksPerMultiprocessor`` through ``eagle3_cuda::skinny_occupancy``,
  asked once per (device, variant); without a GPU, the register counts of the built cubins,
  :data:`SKINNY_REGISTERS`, through :func:`blocks_per_sm_from_registers`), at most
  :data:`MAX_SPLITS_PER_CHUNK` (the op clamps to its launch contract exactly as
  :func:`skinny_split_shape` does);
* the workspace: strided 1-D arguments are copied into its first regions
  (``fc_rules.unit_stride_copies``), the rest goes to the op, which carves its split-K partials /
  sums of squares or its prepared input from it (``eagle3_cuda::draft_fc_workspace_bytes`` says how
  many bytes).
"""
from __future__ import annotations

import functools
import importlib
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from . import fc_rules, plans
from .workspace import Carver

log = logging.getLogger("eagle3_ops")

OPS = ("capture", "fused_add_rmsnorm_capture", "draft_fc", "draft_fc_workspace_bytes", "skinny_occupancy")
# The op's path argument: the index in plans.PATHS (skinny 0, tiled 1, cublas 2; CUDA has no tiled).
PATH_INDEX = {name: i for i, name in enumerate(plans.PATHS)}

# Split-K tuning (a design estimate, not measured): skinny blocks per SM that saturate the weight
# stream. Each keeps 128 threads x 8 x 16 B = 16 KB of weight loads in flight; ~3 per SM cover the
# latency-bandwidth product of H200 (~4.3 TB/s x ~1 us / 132 SMs). Fewer resident blocks run
# latency-bound; more share the bandwidth. More splits also cost S*M*N*4 bytes of partials written
# and read again, hence the cap per chunk.
BLOCKS_PER_SM = 3
MAX_SPLITS_PER_CHUNK = 16
# The skinny kernel's launch shape, mirrored from csrc/draft_fc.cu (kThreads, kRowsPerBlock,
# kMaxTokenGroups, kMaxSplits, kSlab * kUnroll): a block is 128 threads, covers 64 weight rows and a
# token tile of 8, 16, 32 or 64 tokens; a split is a whole number of 128-wide k steps, at least 4.
SKINNY_THREADS = 128
ROWS_PER_BLOCK = 64
MAX_TOKEN_GROUPS = 8
MAX_SPLITS = 64
SPLIT_STEP = 128
MIN_STEPS_PER_SPLIT = 4

# The fc_skinny_kernel variants (csrc/draft_fc.cu kPlain / kNormed / kFolded; the `variant` of
# eagle3_cuda::skinny_occupancy is the index): no norm; norm weights multiplied into x in the hot
# loop; norm weights folded into the weight (eagle3_ops.fold_norm_weights), plain hot loop.
SKINNY_VARIANTS = ("plain", "norm", "folded")


def skinny_variant(chunk_norm_weight, input_norm_weight, norm_folded: bool) -> str:
    if not fc_rules.has_norm(chunk_norm_weight, input_norm_weight):
        return "plain"
    return "folded" if norm_folded else "norm"


# Registers per thread of every fc_skinny_kernel variant, (dtype, NT, variant) -> REG, as ptxas
# allocated them in the built cubins (`cuobjdump -res-usage eagle3_ops/_C*.so`; none has a stack
# frame or local memory). tests/test_build.py checks this table against the built extension, so a
# kernel change that moves a count fails CI until the table is regenerated (the failure prints it).
SKINNY_REGISTERS = {
    "sm_90a": {
        ("bfloat16", 1, "plain"): 72, ("bfloat16", 1, "norm"): 94, ("bfloat16", 1, "folded"): 72,
        ("bfloat16", 2, "plain"): 80, ("bfloat16", 2, "norm"): 110, ("bfloat16", 2, "folded"): 88,
        ("bfloat16", 4, "plain"): 93, ("bfloat16", 4, "norm"): 143, ("bfloat16", 4, "folded"): 102,
        ("bfloat16", 8, "plain"): 148, ("bfloat16", 8, "norm"): 191, ("bfloat16", 8, "folded"): 200,
        ("float16", 1, "plain"): 72, ("float16", 1, "norm"): 92, ("float16", 1, "folded"): 72,
        ("float16", 2, "plain"): 80, ("float16", 2, "norm"): 114, ("float16", 2, "folded"): 88,
        ("float16", 4, "plain"): 93, ("float16", 4, "norm"): 142, ("float16", 4, "folded"): 102,
        ("float16", 8, "plain"): 148, ("float16", 8, "norm"): 194, ("float16", 8, "folded"): 200,
    },
    "sm_120a": {
        ("bfloat16", 1, "plain"): 72, ("bfloat16", 1, "norm"): 93, ("bfloat16", 1, "folded"): 72,
        ("bfloat16", 2, "plain"): 70, ("bfloat16", 2, "norm"): 110, ("bfloat16", 2, "folded"): 66,
        ("bfloat16", 4, "plain"): 84, ("bfloat16", 4, "norm"): 148, ("bfloat16", 4, "folded"): 84,
        ("bfloat16", 8, "plain"): 111, ("bfloat16", 8, "norm"): 214, ("bfloat16", 8, "folded"): 149,
        ("float16", 1, "plain"): 72, ("float16", 1, "norm"): 94, ("float16", 1, "folded"): 72,
        ("float16", 2, "plain"): 70, ("float16", 2, "norm"): 105, ("float16", 2, "folded"): 66,
        ("float16", 4, "plain"): 84, ("float16", 4, "norm"): 150, ("float16", 4, "folded"): 84,
        ("float16", 8, "plain"): 111, ("float16", 8, "norm"): 211, ("float16", 8, "folded"): 149,
    },
}


@dataclass(frozen=True)
class SmLimits:
    """Per-SM residency limits of a compute capability (CUDA C++ Programming Guide, "Features and
    Technical Specifications"; the register allocation rule of the CUDA occupancy calculator,
    cuda_occupancy.h: registers per warp rounded up to 256, allocated per SM sub-partition)."""

    max_threads: int       # resident threads per SM: 2048 on cc 9.0, 1536 on cc 12.0
    max_blocks: int = 32   # resident blocks per SM
    registers: int = 65536
    reg_alloc_unit: int = 256
    sub_partitions: int = 4


SM_LIMITS = {"sm_90": SmLimits(max_threads=2048), "sm_120": SmLimits(max_threads=1536)}


def blocks_per_sm_from_registers(regs_per_thread: int, threads_per_block: int, limits: SmLimits) -> int:
    """Resident blocks per SM for a kernel with these registers per thread and block size (no
    shared memory): the smallest of the register, thread and block limits. E.g. 148 registers x 128
    threads on sm_90: 4864 registers per warp -> 3 warps per sub-partition -> 12 warps -> 3 blocks."""
    warps = -(-threads_per_block // 32)
    per_warp = -(-(regs_per_thread * 32) // limits.reg_alloc_unit) * limits.reg_alloc_unit
    warps_by_regs = (limits.registers // limits.sub_partitions // per_warp) * limits.sub_partitions
    return max(0, min(warps_by_regs // warps, limits.max_threads // (32 * warps), limits.max_blocks))


def token_groups(M: int) -> int:
    """NT, the skinny kernel's token groups of 8 per tile for M output rows (1, 2, 4 or 8)."""
    groups = -(-min(M, 8 * MAX_TOKEN_GROUPS) // 8)
    return 1 if groups <= 1 else 2 if groups <= 2 else 4 if groups <= 4 else 8


def skinny_split_shape(CH: int, NC: int, asked: int) -> tuple:
    """(splits per chunk, split length) the op launches for ``asked`` splits per chunk: the clamp
    of csrc/draft_fc.cu skinny_plan (whole 128-wide steps, at least 4 of them, at most 64 splits)."""
    per_chunk = max(1, min(asked, CH // (MIN_STEPS_PER_SPLIT * SPLIT_STEP), MAX_SPLITS // NC))
    split_len = -(-(-(-CH // per_chunk)) // SPLIT_STEP) * SPLIT_STEP
    return -(-CH // split_len), split_len


def skinny_cost(M: int, N: int, CH: int, NC: int, asked: int, sms: int, blocks_per_sm: int, norm: bool,
                elem_bytes: int = 2) -> float:
    """Predicted time of the skinny launch in bytes moved at full bandwidth (a model, not a
    measurement): the grid runs in waves of ``blocks_per_sm * sms`` resident blocks, all blocks of
    a wave stream split_len/128 steps of 64x128 weight elements, and a wave of n blocks runs at the
    rate of max(n, BLOCKS_PER_SM * sms) blocks (fewer than that are latency-bound, more share the
    bandwidth); plus the split-K partials written and read again (S*M*N*4 bytes twice)."""
    per_chunk, split_len = skinny_split_shape(CH, NC, asked)
    S = NC * per_chunk
    blocks = -(-M // (8 * token_groups(M))) * -(-N // ROWS_PER_BLOCK) * S
    slots = max(1, blocks_per_sm * sms)
    saturating = BLOCKS_PER_SM * sms
    step_bytes = ROWS_PER_BLOCK * split_len * elem_bytes  # one block's weight bytes
    full, rest = divmod(blocks, slots)
    cost = full * step_bytes * max(slots, saturating) + (step_bytes * max(rest, saturating) if rest else 0)
    if S > 1 or norm:
        cost += 2 * S * M * N * 4
    return float(cost)


@functools.lru_cache(maxsize=4096)
def skinny_splits(M: int, N: int, CH: int, NC: int, sms: int, blocks_per_sm: int, norm: bool = False,
                  elem_bytes: int = 2) -> int:
    """Split-K splits per chunk to ask the skinny kernel for: the count (<= MAX_SPLITS_PER_CHUNK,
    after the op's clamp) with the least :func:`skinny_cost`, fewest splits on a tie. With all
    blocks equally long this is the count whose grid fills whole waves of the resident blocks:
    e.g. H200, M = 64 (NT = 8, 148 registers -> 3 blocks per SM, 396 slots), N = 7168 (112 weight
    tiles), K*H = 21504: 7 splits = 784 blocks = 1.98 waves, where 4 (448 blocks) left a
    latency-bound tail of 52."""
    best, best_cost, seen = 1, None, set()
    for asked in range(1, MAX_SPLITS_PER_CHUNK + 1):
        shape = skinny_split_shape(CH, NC, asked)
        if shape in seen:
            continue
        seen.add(shape)
        cost = skinny_cost(M, N, CH, NC, asked, sms, blocks_per_sm, norm, elem_bytes)
        if best_cost is None or cost < best_cost:
            best, best_cost = asked, cost
    return best


# ---- the extension -------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def cuda_extension():
    """The compiled extension module (its import registers the ops), or None when the package was
    built without nvcc or the built module does not load."""
    try:
        return importlib.import_module("eagle3_ops._C")
    except ImportError as e:
        built = list(Path(__file__).parent.glob("_C*.so")) + list(Path(__file__).parent.glob("_C*.pyd"))
        if built:  # built but not loadable (e.g. compiled against another torch): say so
            log.warning("eagle3_ops: the CUDA extension %s exists but does not import (%s); the triton/reference "
                        "backends serve. Rebuild with `pip install --no-build-isolation -e .`.", built[0].name, e)
        else:
            log.debug("eagle3_ops._C not built: %s", e)
        return None


@functools.lru_cache(maxsize=None)
def compiled_archs() -> tuple:
    """The archs the extension carries cubins for, e.g. ("sm_90a", "sm_120a"); () without it."""
    ext = cuda_extension()
    if ext is None:
        return ()
    return tuple(a for a in str(ext.compiled_archs).split(",") if a)


@functools.lru_cache(maxsize=None)
def ops_registered() -> bool:
    """Whether the imported extension registered every eagle3_cuda op (an extension built from an
    older source tree may import without them)."""
    if cuda_extension() is None:
        return False
    try:
        for name in OPS:
            getattr(torch.ops.eagle3_cuda, name)
    except (AttributeError, RuntimeError):
        log.warning("eagle3_ops: eagle3_ops._C imports but does not register the eagle3_cuda ops (built from an "
                    "older source?); rebuild with `pip install --no-build-isolation -e .`")
        return False
    return True


def device_arch(device: torch.device) -> str:
    """``sm_<major><minor>`` of a GPU, e.g. sm_90 or sm_120."""
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def serves(device) -> bool:
    """Whether this backend can run on ``device``: a GPU whose arch the extension was compiled for
    (sm_90a cubins run only on sm_90, sm_120a only on sm_120), with the ops registered."""
    device = torch.device(device)
    if device.type != "cuda" or not ops_registered():
        return False
    arch = device_arch(device)
    return any(a.rstrip("a") == arch for a in compiled_archs())


def _ops():
    cuda_extension()  # importing eagle3_ops._C registers the ops
    return torch.ops.eagle3_cuda


# ---- capture ops -----------------------------------------------------------------------------------
def capture(hidden, residual, buffer, slot) -> None:
    _ops().capture.default(hidden, residual, buffer, slot)


def fused_add_rmsnorm_capture(input, residual, weight, eps, buffer, slot) -> None:
    _ops().fused_add_rmsnorm_capture.default(input, residual, weight, float(eps), buffer, slot)


# ---- draft_fc ----------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a GPU (the current one for an index-less cuda device)."""
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _measured_occupancy(device_index: int, nt: int, variant: str, dtype: torch.dtype) -> int:
    with torch.cuda.device(device_index):
        blocks = int(_ops().skinny_occupancy(nt, SKINNY_VARIANTS.index(variant), dtype))
    log.debug("eagle3_ops: skinny kernel (%s, NT=%d, %s) on cuda:%d: %d resident blocks per SM",
              dtype, nt, variant, device_index, blocks)
    return blocks


def table_blocks_per_sm(arch: str, nt: int, variant: str, dtype: torch.dtype) -> int:
    """Resident skinny blocks per SM predicted from :data:`SKINNY_REGISTERS` (arch ``sm_90`` or
    ``sm_120``, with or without the ``a``)."""
    base = arch.rstrip("a")
    regs = SKINNY_REGISTERS[base + "a"][(str(dtype).replace("torch.", ""), nt, variant)]
    return blocks_per_sm_from_registers(regs, SKINNY_THREADS, SM_LIMITS[base])


def skinny_blocks_per_sm(device: torch.device, nt: int, variant: str, dtype: torch.dtype) -> int:
    """Resident blocks per SM of the skinny variant on a GPU this backend serves: the CUDA runtime's
    answer (``eagle3_cuda::skinny_occupancy``), asked at first use and cached per (device, variant).
    Should the runtime answer 0 (it cannot, for a kernel that launches), the register table's."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    blocks = _measured_occupancy(index, nt, variant, dtype)
    if blocks <= 0:
        return table_blocks_per_sm(device_arch(torch.device("cuda", index)), nt, variant, dtype)
    return blocks


def skinny_launchable(x, weight, chunk_norm_weight, input_norm_weight, norm_folded: bool = False) -> bool:
    """The skinny kernel's launch contract for these arguments (see the module doc). A strided
    input_norm_weight counts as aligned with stride 1: it is copied into the (16-byte aligned)
    workspace first."""
    if x.dtype not in (torch.bfloat16, torch.float16):
        return False
    if fc_rules.fp16_norm_overflow(x.dtype, chunk_norm_weight, input_norm_weight, norm_folded):
        return False
    NC, CH = fc_rules.chunks(x, chunk_norm_weight)
    if x.shape[1] == 0 or NC > MAX_SPLITS:
        return False
    inw = input_norm_weight
    inw_ok = inw is None or fc_rules.needs_unit_stride_copy(inw) or (fc_rules.aligned16(inw) and inw.stride(0) == 1)
    return (CH % 8 == 0 and x.stride(0) % 8 == 0 and weight.stride(0) % 8 == 0 and fc_rules.aligned16(x)
            and fc_rules.aligned16(weight) and fc_rules.aligned16(chunk_norm_weight) and inw_ok)


@functools.lru_cache(maxsize=4096)
def _op_bytes(M: int, N: int, KH: int, K: int, chunk_norm: bool, input_norm: bool, path: int, splits: int,
              dtype: torch.dtype) -> int:
    return int(_ops().draft_fc_workspace_bytes(M, N, KH, K, chunk_norm, input_norm, path, splits, dtype))


@dataclass(frozen=True)
class Plan:
    path: str        # "skinny" or "cublas"
    splits: int      # split-K splits per chunk asked for (skinny), else 0
    copy_bytes: int  # unit-stride copies of strided 1-D arguments (first in the workspace)
    op_bytes: int    # what eagle3_cuda::draft_fc carves (after the copies)

    @property
    def nbytes(self) -> int:
        return self.copy_bytes + self.op_bytes


def plan(x, weight, bias, rows, chunk_norm_weight, input_norm_weight, norm_folded: bool = False) -> Plan:
    """Path, splits and workspace bytes of one draft_fc call (pure; nothing runs on the GPU)."""
    M, N, KH = fc_rules.num_rows(x, rows), int(weight.shape[0]), int(x.shape[1])
    copy_bytes = fc_rules.unit_stride_copy_bytes(bias, rows, input_norm_weight)
    if M == 0 or N == 0:
        return Plan("cublas", 0, 0, 0)  # nothing to compute (the face never calls with an empty output)
    # The GPU is weight's device: x and rows may be meta tensors when sizing a workspace (ops.py).
    device = weight.device
    path = plans.choose("cuda", device, M)
    if path != "skinny" or not skinny_launchable(x, weight, chunk_norm_weight, input_norm_weight, norm_folded):
        path = "cublas"
    NC, CH = fc_rules.chunks(x, chunk_norm_weight)
    splits = 0
    if path == "skinny":
        norm = fc_rules.has_norm(chunk_norm_weight, input_norm_weight)
        variant = skinny_variant(chunk_norm_weight, input_norm_weight, norm_folded)
        occupancy = skinny_blocks_per_sm(device, token_groups(M), variant, x.dtype)
        splits = skinny_splits(M, N, CH, NC, sm_count(device), occupancy, norm, x.element_size())
    if path == "cublas" and not fc_rules.prepares_input(rows, chunk_norm_weight, input_norm_weight):
        op_bytes = 0  # x goes straight to cuBLAS
    else:
        op_bytes = _op_bytes(M, N, KH, NC, chunk_norm_weight is not None, input_norm_weight is not None,
                             PATH_INDEX[path], splits, x.dtype)
    return Plan(path, splits, copy_bytes, op_bytes)


def draft_fc_workspace_bytes(x, weight, bias, rows, chunk_norm_weight, input_norm_weight,
                             norm_folded: bool = False) -> int:
    """Workspace bytes :func:`draft_fc` needs for exactly these arguments on x.device."""
    return plan(x, weight, bias, rows, chunk_norm_weight, input_norm_weight, norm_folded).nbytes


def draft_fc(x, weight, bias, rows, chunk_norm_weight, input_norm_weight, eps, out, workspace,
             norm_folded: bool = False) -> None:
    """out = linear(norm(x[rows]), weight, bias) by eagle3_cuda::draft_fc; scratch is carved from
    ``workspace`` (uint8, >= draft_fc_workspace_bytes(...) bytes; None when that is 0)."""
    p = plan(x, weight, bias, rows, chunk_norm_weight, input_norm_weight, norm_folded)
    carver = Carver(workspace)
    bias, rows, input_norm_weight = fc_rules.unit_stride_copies(carver, bias, rows, input_norm_weight)
    op_ws = carver.take(p.op_bytes, torch.uint8) if p.op_bytes > 0 else None
    _ops().draft_fc.default(x, weight, bias, rows, chunk_norm_weight, input_norm_weight, float(eps), out, op_ws,
                            PATH_INDEX[p.path], p.splits, bool(norm_folded))


__all__ = ["BLOCKS_PER_SM", "MAX_SPLITS_PER_CHUNK", "OPS", "PATH_INDEX", "Plan", "SKINNY_REGISTERS", "SM_LIMITS",
           "SKINNY_VARIANTS", "SmLimits", "blocks_per_sm_from_registers", "capture", "compiled_archs",
           "cuda_extension", "device_arch",
           "draft_fc", "draft_fc_workspace_bytes", "fused_add_rmsnorm_capture", "ops_registered", "plan", "serves",
           "skinny_blocks_per_sm", "skinny_cost", "skinny_launchable", "skinny_split_shape", "skinny_splits",
           "skinny_variant",
           "sm_count", "table_blocks_per_sm", "token_groups"]
