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
* the split-K splits per chunk: enough skinny blocks for :data:`BLOCKS_PER_SM` per SM, at most
  :data:`MAX_SPLITS_PER_CHUNK` (the op clamps further to its launch contract);
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

OPS = ("capture", "fused_add_rmsnorm_capture", "draft_fc", "draft_fc_workspace_bytes")
# The op's path argument: the index in plans.PATHS (skinny 0, tiled 1, cublas 2; CUDA has no tiled).
PATH_INDEX = {name: i for i, name in enumerate(plans.PATHS)}

# Split-K tuning (a design estimate, not measured): resident skinny blocks per SM to aim for. Each
# keeps 128 threads x 8 x 16 B = 16 KB of weight loads in flight; ~3 per SM cover the
# latency-bandwidth product of H200 (~4.3 TB/s x ~1 us / 132 SMs). More splits also cost S*M*N*4
# bytes of workspace traffic, hence the cap per chunk.
BLOCKS_PER_SM = 3
MAX_SPLITS_PER_CHUNK = 16
# The skinny kernel's launch shape, mirrored from csrc/draft_fc.cu (kRowsPerBlock, kMaxTokenGroups,
# kMaxSplits): a block covers 64 weight rows and a token tile of 8, 16, 32 or 64 tokens.
ROWS_PER_BLOCK = 64
MAX_TOKEN_GROUPS = 8
MAX_SPLITS = 64


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


def skinny_splits(M: int, N: int, NC: int, sms: int) -> int:
    """Split-K splits per chunk to ask the skinny kernel for: enough blocks for BLOCKS_PER_SM per SM
    over the (token tile, weight tile, chunk) grid, at most MAX_SPLITS_PER_CHUNK."""
    groups = -(-min(M, 8 * MAX_TOKEN_GROUPS) // 8)
    nt = 1 if groups <= 1 else 2 if groups <= 2 else 4 if groups <= 4 else 8
    tiles = -(-M // (8 * nt)) * -(-N // ROWS_PER_BLOCK) * NC
    return min(MAX_SPLITS_PER_CHUNK, -(-(BLOCKS_PER_SM * sms) // tiles))


def skinny_launchable(x, weight, chunk_norm_weight, input_norm_weight) -> bool:
    """The skinny kernel's launch contract for these arguments (see the module doc). A strided
    input_norm_weight counts as aligned with stride 1: it is copied into the (16-byte aligned)
    workspace first."""
    if x.dtype not in (torch.bfloat16, torch.float16):
        return False
    if fc_rules.fp16_norm_overflow(x.dtype, chunk_norm_weight, input_norm_weight):
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


def plan(x, weight, bias, rows, chunk_norm_weight, input_norm_weight) -> Plan:
    """Path, splits and workspace bytes of one draft_fc call (pure; nothing runs on the GPU)."""
    M, N, KH = fc_rules.num_rows(x, rows), int(weight.shape[0]), int(x.shape[1])
    copy_bytes = fc_rules.unit_stride_copy_bytes(bias, rows, input_norm_weight)
    if M == 0 or N == 0:
        return Plan("cublas", 0, 0, 0)  # nothing to compute (the face never calls with an empty output)
    path = plans.choose("cuda", x.device, M)
    if path != "skinny" or not skinny_launchable(x, weight, chunk_norm_weight, input_norm_weight):
        path = "cublas"
    NC, _ = fc_rules.chunks(x, chunk_norm_weight)
    splits = skinny_splits(M, N, NC, sm_count(x.device)) if path == "skinny" else 0
    if path == "cublas" and not fc_rules.prepares_input(rows, chunk_norm_weight, input_norm_weight):
        op_bytes = 0  # x goes straight to cuBLAS
    else:
        op_bytes = _op_bytes(M, N, KH, NC, chunk_norm_weight is not None, input_norm_weight is not None,
                             PATH_INDEX[path], splits, x.dtype)
    return Plan(path, splits, copy_bytes, op_bytes)


def draft_fc_workspace_bytes(x, weight, bias, rows, chunk_norm_weight, input_norm_weight) -> int:
    """Workspace bytes :func:`draft_fc` needs for exactly these arguments on x.device."""
    return plan(x, weight, bias, rows, chunk_norm_weight, input_norm_weight).nbytes


def draft_fc(x, weight, bias, rows, chunk_norm_weight, input_norm_weight, eps, out, workspace) -> None:
    """out = linear(norm(x[rows]), weight, bias) by eagle3_cuda::draft_fc; scratch is carved from
    ``workspace`` (uint8, >= draft_fc_workspace_bytes(...) bytes; None when that is 0)."""
    p = plan(x, weight, bias, rows, chunk_norm_weight, input_norm_weight)
    carver = Carver(workspace)
    bias, rows, input_norm_weight = fc_rules.unit_stride_copies(carver, bias, rows, input_norm_weight)
    op_ws = carver.take(p.op_bytes, torch.uint8) if p.op_bytes > 0 else None
    _ops().draft_fc.default(x, weight, bias, rows, chunk_norm_weight, input_norm_weight, float(eps), out, op_ws,
                            PATH_INDEX[p.path], p.splits)


__all__ = ["BLOCKS_PER_SM", "MAX_SPLITS_PER_CHUNK", "OPS", "PATH_INDEX", "Plan", "capture", "compiled_archs",
           "cuda_extension", "device_arch", "draft_fc", "draft_fc_workspace_bytes", "fused_add_rmsnorm_capture",
           "ops_registered", "plan", "serves", "skinny_launchable", "skinny_splits",
           "sm_count"]
