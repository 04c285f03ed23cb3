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
* the skinny block shape and split-K splits per chunk (:func:`skinny_choice`): over the block
  shapes built for M's token tile (``skinny_model.SKINNY_SHAPES``: 64-row blocks, and at 33-64
  tokens also 128-row ones) and every split count the op can launch (no cap of its own), the one
  with the least modelled time in ``eagle3_ops.skinny_model`` (one model for planner and static
  model: waves of the blocks that can really be resident, the weight bytes each keeps in flight in
  its ring against the device's bandwidth-latency product, fill latency, L2, issue and tensor rates,
  split-K partials). Resident blocks per SM (:func:`skinny_blocks_per_sm`): on the GPU the kernel's
  ``cudaOccupancyMaxActiveBlocksPerMultiprocessor`` through ``eagle3_cuda::skinny_occupancy``, asked
  once per (device, block shape, dtype), 0 for a ring larger than the device's shared memory per
  block (never chosen); without a GPU the built cubins' registers and shared memory
  (:data:`SKINNY_REGISTERS`, ``skinny_model.shared_bytes``); the op clamps the count to its launch
  contract exactly as ``skinny_model.split_shape`` does. At one split count every shape gives the
  same bits (each split is summed in the same order, the splits by the reducer in a fixed order);
  the shape chosen can change the split count chosen, and so the bits, as M or the device can;
  where no shape can be resident (the runtime answers 0 for all), cuBLAS serves;
* the workspace: strided 1-D arguments are copied into its first regions
  (``fc_rules.unit_stride_copies``), the rest goes to the op, which carves its split-K partials,
  norm pre-pass sums and x*g, or its prepared input from it (``eagle3_cuda::draft_fc_workspace_bytes`` says how
  many bytes).
"""
from __future__ import annotations

import functools
import importlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Tuple

import torch

from . import fc_rules, plans, skinny_model
from .workspace import Carver

log = logging.getLogger("eagle3_ops")

OPS = ("capture", "fused_add_rmsnorm_capture", "draft_fc", "draft_fc_workspace_bytes", "skinny_occupancy")
# The op's path argument: the index in plans.PATHS (skinny 0, tiled 1, cublas 2; CUDA has no tiled).
PATH_INDEX = {name: i for i, name in enumerate(plans.PATHS)}

# The skinny kernel's launch shapes, mirrored from csrc/draft_fc_launch.h in skinny_model
# (kSkinnyShapes, kMaxTokenGroups, kMaxSplits, kStep, kMinSplitSteps, kPiece).
SKINNY_SHAPES = skinny_model.SKINNY_SHAPES
MAX_TOKEN_GROUPS = skinny_model.MAX_TOKEN_GROUPS
MAX_SPLITS = skinny_model.MAX_SPLITS

# What a skinny launch does around the one fc_skinny_kernel<T, NT, rows, stages> (the same hot loop for all):
# no norm; a norm pre-pass writing the statistics and x*g; a pre-pass writing only the statistics
# (the weight carries the norm weights, eagle3_ops.fold_norm_weights).
SKINNY_VARIANTS = ("plain", "norm", "folded")


def skinny_variant(chunk_norm_weight, input_norm_weight, norm_folded: bool) -> str:
    """Which of :data:`SKINNY_VARIANTS` a skinny launch with these norm arguments runs: ``plain`` (no norm weight),
    ``folded`` (norm weights already in the fc weight), else ``norm`` (a pre-pass writing the statistics and x*g)."""
    if not fc_rules.has_norm(chunk_norm_weight, input_norm_weight):
        return "plain"
    return "folded" if norm_folded else "norm"


# Registers per thread of every fc_skinny_kernel<T, NT, rows, stages>, (dtype, NT, rows, stages) ->
# REG, as ptxas allocated them in the built cubins (`cuobjdump -res-usage eagle3_ops/_C*.so`; none has
# a stack frame or local memory), and the hot loop's instructions per 64-wide k step and warp (the
# SASS, NOPs excluded). tests/test_build.py checks both tables against the built extension, so a
# kernel change that moves a number fails CI until the table is regenerated (the failure prints it).
SKINNY_REGISTERS = {
    "sm_90a": {("bfloat16", 1, 64, 4): 59, ("bfloat16", 2, 64, 4): 67, ("bfloat16", 4, 64, 4): 98,
               ("bfloat16", 8, 64, 3): 124, ("bfloat16", 8, 128, 4): 110, ("bfloat16", 8, 128, 6): 80,
               ("float16", 1, 64, 4): 59, ("float16", 2, 64, 4): 67, ("float16", 4, 64, 4): 98,
               ("float16", 8, 64, 3): 124, ("float16", 8, 128, 4): 110, ("float16", 8, 128, 6): 80},
    "sm_120a": {("bfloat16", 1, 64, 4): 71, ("bfloat16", 2, 64, 4): 83, ("bfloat16", 4, 64, 4): 101,
                ("bfloat16", 8, 64, 3): 134, ("bfloat16", 8, 128, 4): 80, ("bfloat16", 8, 128, 6): 80,
                ("float16", 1, 64, 4): 71, ("float16", 2, 64, 4): 83, ("float16", 4, 64, 4): 101,
                ("float16", 8, 64, 3): 134, ("float16", 8, 128, 4): 80, ("float16", 8, 128, 6): 80},
}
SKINNY_STEP_INSTRUCTIONS = {
    "sm_90a": {("bfloat16", 1, 64, 4): 75.5, ("bfloat16", 2, 64, 4): 77.0, ("bfloat16", 4, 64, 4): 97.0,
               ("bfloat16", 8, 64, 3): 151.0, ("bfloat16", 8, 128, 4): 123.0, ("bfloat16", 8, 128, 6): 128.0,
               ("float16", 1, 64, 4): 75.5, ("float16", 2, 64, 4): 77.0, ("float16", 4, 64, 4): 97.0,
               ("float16", 8, 64, 3): 151.0, ("float16", 8, 128, 4): 123.0, ("float16", 8, 128, 6): 128.0},
    "sm_120a": {("bfloat16", 1, 64, 4): 76.5, ("bfloat16", 2, 64, 4): 75.0, ("bfloat16", 4, 64, 4): 95.5,
                ("bfloat16", 8, 64, 3): 147.0, ("bfloat16", 8, 128, 4): 122.0, ("bfloat16", 8, 128, 6): 139.0,
                ("float16", 1, 64, 4): 76.5, ("float16", 2, 64, 4): 75.0, ("float16", 4, 64, 4): 95.5,
                ("float16", 8, 64, 3): 147.0, ("float16", 8, 128, 4): 122.0, ("float16", 8, 128, 6): 139.0},
}
SmLimits = skinny_model.SmLimits
SM_LIMITS = skinny_model.SM_LIMITS


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def _shape(shape) -> tuple:
    """(NT, rows, stages) from a shape or an NT alone (its 64-row block)."""
    return (shape, skinny_model.DEFAULT_ROWS, skinny_model.STAGES[shape]) if isinstance(shape, int) else tuple(shape)


def kernel_model(arch: str, shape, dtype) -> skinny_model.Kernel:
    """skinny_model's view of fc_skinny_kernel<dtype, NT, rows, stages> on ``arch`` (sm_90 / sm_120,
    with or without the ``a``), from the tables of the built cubins. ``shape``: (NT, rows, stages),
    or an NT alone for its 64-row block."""
    nt, rows, stages = _shape(shape)
    key = (_dtype_name(dtype), nt, rows, stages)
    arch = arch.rstrip("a") + "a"
    return skinny_model.Kernel(nt, SKINNY_REGISTERS[arch][key], skinny_model.shared_bytes(nt, rows, stages), stages,
                               SKINNY_STEP_INSTRUCTIONS[arch][key], 2, rows)


def blocks_per_sm_from_registers(regs_per_thread: int, threads_per_block: int, limits: SmLimits,
                                 shared: int = 0) -> int:
    """Resident blocks per SM (``skinny_model.blocks_per_sm``: registers, shared memory, threads)."""
    return skinny_model.blocks_per_sm(regs_per_thread, shared, threads_per_block, limits)


token_groups = skinny_model.token_groups
skinny_split_shape = skinny_model.split_shape


@functools.lru_cache(maxsize=4096)
def skinny_choice(M: int, N: int, CH: int, NC: int, device: skinny_model.Device, kernels: tuple, blocks_per_sm: tuple,
                  norm: bool = False, folded: bool = False) -> tuple:
    """(kernel, splits per chunk, skinny_model.Prediction): over ``kernels`` (the block shapes of M's
    token tile) with their resident blocks per SM, the least modelled time (skinny_model.best_plan)."""
    return skinny_model.best_plan(M, N, CH, NC, device, kernels, norm, folded, blocks_per_sm)


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
    major, minor = plans.capability(device.index if device.index is not None else torch.cuda.current_device())
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
    """Backend ``capture``: ``eagle3_cuda::capture`` (``buffer[:T, slot*H:(slot+1)*H] = hidden + residual``, or
    ``hidden``), on validated arguments."""
    _ops().capture.default(hidden, residual, buffer, slot)


def fused_add_rmsnorm_capture(input, residual, weight, eps, buffer, slot) -> None:
    """Backend ``fused_add_rmsnorm_capture``: ``eagle3_cuda::fused_add_rmsnorm_capture`` (SGLang's in-place fused
    add+RMSNorm that also writes the new residual into buffer slot ``slot``), on validated arguments."""
    _ops().fused_add_rmsnorm_capture.default(input, residual, weight, float(eps), buffer, slot)


# ---- draft_fc ----------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a GPU (the current one for an index-less cuda device)."""
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _measured_occupancy(device_index: int, shape: tuple, dtype: torch.dtype) -> int:
    nt, rows, stages = shape
    with torch.cuda.device(device_index):
        blocks = int(_ops().skinny_occupancy(nt, dtype, rows, stages))
    log.debug("eagle3_ops: skinny kernel (%s, NT=%d, %d rows, %d stages) on cuda:%d: %d resident blocks per SM", dtype,
              nt, rows, stages, device_index, blocks)
    return blocks


def table_blocks_per_sm(arch: str, shape, dtype: torch.dtype) -> int:
    """Resident skinny blocks per SM predicted from the built cubins' registers and shared memory
    (arch ``sm_90`` or ``sm_120``, with or without the ``a``; ``shape`` (NT, rows, stages) or an NT
    for its 64-row block); 0 where the ring exceeds the arch's shared memory per block."""
    k = kernel_model(arch, shape, dtype)
    return skinny_model.blocks_per_sm(k.regs, k.shared, k.threads, SM_LIMITS[arch.rstrip("a")])


def skinny_blocks_per_sm(device: torch.device, shape, dtype: torch.dtype) -> int:
    """Resident blocks per SM of fc_skinny_kernel<dtype, shape> on a GPU this backend serves: the CUDA
    runtime's answer (``eagle3_cuda::skinny_occupancy``; 0 where the ring does not fit the device),
    asked at first use and cached per (device, shape, dtype)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _measured_occupancy(index, _shape(shape), dtype)


@functools.lru_cache(maxsize=None)
def _nvml_peaks(uuid: str) -> Tuple[Optional[float], Optional[float]]:
    """(the memory's peak read bandwidth in bytes/s, the SM boost clock in Hz) as NVML reports them for the GPU
    of ``uuid`` (memory clock x 2 (double data rate) x bus width; the UUID, since CUDA_VISIBLE_DEVICES renumbers
    CUDA's devices but not NVML's); (None, None) where NVML cannot say."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
            mem_mhz = pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_MEM)
            bus_bits = pynvml.nvmlDeviceGetMemoryBusWidth(handle)
            sm_mhz = pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_SM)
        finally:
            pynvml.nvmlShutdown()
        return (2 * mem_mhz * 1e6 * bus_bits / 8 or None), (sm_mhz * 1e6 or None)
    except Exception:  # noqa: BLE001 - no NVML here (or a device index it orders otherwise): the table's figures
        return None, None


@functools.lru_cache(maxsize=None)
def _device_model(name: str, arch: str, sms: int, peak_read_bw: Optional[float] = None,
                  clock: Optional[float] = None) -> skinny_model.Device:
    return skinny_model.device_for(name, arch, sms, peak_read_bw, clock)


def device_model(device: torch.device) -> skinny_model.Device:
    """The skinny model's device for a GPU, read off the GPU where it can be (skinny_model.device_for): its
    name, arch and SM count (torch), its memory's peak bandwidth and boost clock (NVML, where installed); the
    rest (latency, L2 and tensor rates: design estimates) from the modelled device its name names."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    peak_bw, clock = device_peaks(props)
    return _device_model(props.name, device_arch(device), sm_count(device), peak_bw, clock)


def device_peaks(props) -> Tuple[Optional[float], Optional[float]]:
    """(peak read bandwidth in bytes/s, SM clock in Hz) of a GPU from its CUDA properties (cudaDeviceProp's
    memoryClockRate x 2 x memoryBusWidth, CUDA's deviceQuery formula; clockRate), where torch exposes them,
    else from NVML; (None, None) where neither can say."""
    mem_khz, bus_bits = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
    if mem_khz and bus_bits:
        return 2 * mem_khz * 1e3 * bus_bits / 8, (getattr(props, "clock_rate", 0) * 1e3 or None)
    uuid = getattr(props, "uuid", None)
    return _nvml_peaks(f"GPU-{uuid}") if uuid is not None else (None, None)


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
              dtype: torch.dtype, norm_folded: bool) -> int:
    return int(_ops().draft_fc_workspace_bytes(M, N, KH, K, chunk_norm, input_norm, path, splits, dtype, norm_folded))


@dataclass(frozen=True)
class Plan:
    """The plan of one CUDA ``draft_fc`` call (from :func:`plan`): path, split-K splits, skinny block shape and the
    workspace bytes it carves."""
    path: str        # "skinny" or "cublas"
    splits: int      # split-K splits per chunk asked for (skinny), else 0
    copy_bytes: int  # unit-stride copies of strided 1-D arguments (first in the workspace)
    op_bytes: int    # what eagle3_cuda::draft_fc carves (after the copies)
    block_rows: int = skinny_model.DEFAULT_ROWS  # the skinny block shape (rows, stages; 0: the op's default)
    stages: int = 0

    @property
    def nbytes(self) -> int:
        """Workspace bytes the call needs: the unit-stride copies, then what the op carves."""
        return self.copy_bytes + self.op_bytes


def plan(x, weight, bias, rows, chunk_norm_weight, input_norm_weight, norm_folded: bool = False,
         path: Optional[str] = None) -> Plan:
    """Path, splits, block shape and workspace bytes of one draft_fc call (pure; nothing runs on the GPU):
    ``path`` when given (a forced ``tiled``, or a skinny call outside the kernel's launch contract, takes
    cublas), else the crossover table's (``plans.choose``). The caller plans once per call (the face), or
    once per row count at install (the plugin's bound call, eagle3_ops.bound)."""
    return _plan(x, weight, bias, rows, chunk_norm_weight, input_norm_weight, norm_folded, path)


draft_fc_plan = plan  # the name every backend's planner has (registry.py)


@functools.lru_cache(maxsize=None)
def _note_unlaunchable(device, shapes, dtype) -> None:
    log.warning("eagle3_ops: the CUDA runtime reports 0 resident blocks on %s for every skinny kernel %s (%s); "
                "draft_fc takes the cublas path there", device, shapes, dtype)


def _plan(x, weight, bias, rows, chunk_norm_weight, input_norm_weight, norm_folded: bool = False,
          path: Optional[str] = None) -> Plan:
    M, N, KH = fc_rules.num_rows(x, rows), int(weight.shape[0]), int(x.shape[1])
    copy_bytes = fc_rules.unit_stride_copy_bytes(bias, rows, input_norm_weight)
    if M == 0 or N == 0:
        return Plan("cublas", 0, 0, 0)  # nothing to compute (the face never calls with an empty output)
    # The GPU is weight's device: x and rows may be meta tensors when sizing a workspace (ops.py).
    device = weight.device
    path = path or plans.choose("cuda", device, M)
    if path != "skinny" or not skinny_launchable(x, weight, chunk_norm_weight, input_norm_weight, norm_folded):
        path = "cublas"
    NC, CH = fc_rules.chunks(x, chunk_norm_weight)
    splits, block_rows, stages = 0, skinny_model.DEFAULT_ROWS, 0
    if path == "skinny":
        norm = fc_rules.has_norm(chunk_norm_weight, input_norm_weight)
        shapes = skinny_model.shapes_for(token_groups(M))
        model = device_model(device)
        kernels = tuple(kernel_model(model.arch, shape, x.dtype) for shape in shapes)
        bpsm = tuple(skinny_blocks_per_sm(device, shape, x.dtype) for shape in shapes)
        if not any(b > 0 for b in bpsm):  # the runtime says none can be resident here: cuBLAS serves
            _note_unlaunchable(device, shapes, x.dtype)
            path = "cublas"
        else:
            kernel, splits, _ = skinny_choice(M, N, CH, NC, model, kernels, bpsm, norm, bool(norm_folded) and norm)
            block_rows, stages = kernel.rows, kernel.stages
    if path == "cublas" and not fc_rules.prepares_input(rows, chunk_norm_weight, input_norm_weight):
        op_bytes = 0  # x goes straight to cuBLAS
    else:
        op_bytes = _op_bytes(M, N, KH, NC, chunk_norm_weight is not None, input_norm_weight is not None,
                             PATH_INDEX[path], splits, x.dtype, bool(norm_folded) and path == "skinny")
    return Plan(path, splits, copy_bytes, op_bytes, block_rows, stages)


def draft_fc_workspace_bytes(x, weight, bias, rows, chunk_norm_weight, input_norm_weight,
                             norm_folded: bool = False) -> int:
    """Workspace bytes :func:`draft_fc` needs for exactly these arguments on x.device."""
    return plan(x, weight, bias, rows, chunk_norm_weight, input_norm_weight, norm_folded).nbytes


def draft_fc(x, weight, bias, rows, chunk_norm_weight, input_norm_weight, eps, out, workspace,
             norm_folded: bool = False, planned: Optional[Plan] = None) -> None:
    """out = linear(norm(x[rows]), weight, bias) by eagle3_cuda::draft_fc on ``planned`` (this call's
    :func:`plan`, made once by the caller; planned here when None); scratch is carved from ``workspace``
    (uint8, >= the plan's bytes; None when that is 0)."""
    p = planned if planned is not None else _plan(x, weight, bias, rows, chunk_norm_weight, input_norm_weight,
                                                  norm_folded)
    carver = Carver(workspace)
    bias, rows, input_norm_weight = fc_rules.unit_stride_copies(carver, bias, rows, input_norm_weight)
    op_ws = carver.take(p.op_bytes, torch.uint8) if p.op_bytes > 0 else None
    _ops().draft_fc.default(x, weight, bias, rows, chunk_norm_weight, input_norm_weight, float(eps), out, op_ws,
                            PATH_INDEX[p.path], p.splits, bool(norm_folded), p.block_rows, p.stages)


__all__ = ["MAX_SPLITS", "OPS", "PATH_INDEX", "Plan", "SKINNY_REGISTERS", "SKINNY_SHAPES", "SKINNY_STEP_INSTRUCTIONS",
           "SKINNY_VARIANTS", "SM_LIMITS", "SmLimits", "blocks_per_sm_from_registers", "capture", "compiled_archs",
           "cuda_extension", "device_arch", "device_model", "draft_fc", "draft_fc_workspace_bytes",
           "fused_add_rmsnorm_capture", "kernel_model", "ops_registered", "plan", "draft_fc_plan",
           "serves", "skinny_blocks_per_sm",
           "skinny_choice", "skinny_launchable", "skinny_split_shape",
           "skinny_variant", "sm_count", "table_blocks_per_sm", "token_groups"]
