"""What a GPU runs first (benchmarks/device_check.sh, stage 2): every kernel of the GPU backends at the shapes of
the user this project exists for, against the float64 reference, before any timing.

- ``draft_fc``: the Kimi-K2.5 draft fc (H = 7168, K = 3) replicated (N = 7168) and sharded over TP = 8 (N = 896
  rows per rank), and Llama-3.1-8B's (H = 4096, N = 4096); bf16, the served dtype; M from one decode token to a
  verify batch; plain, with the verify path's row gather, with the eagle3.1 per-slot fc_norm (as the op and
  folded into the weight); through the face (the path the tables choose) and each path forced.
- ``capture`` and ``fused_add_rmsnorm_capture``: T from one token to a prefill chunk at H = 7168 and 4096.

Every output is poisoned first and every write canaried (eagle3_ops.testing). The ``seed`` mark lets the device
check run exactly these first (``pytest -m "gpu and seed"``) and the rest of the ``gpu`` tests after the
timings; without a GPU they are skipped like every ``gpu`` test (the CPU twins of each case are the op tests).
"""
import pytest
import torch

import eagle3_ops
from eagle3_ops import plans
import op_testing as testing
from op_testing import (CUDA, FC_PATHS, MATMUL_TOL, NORM_TOL, ROUNDING_TOL, TRITON_CUDA, VARIANTS,
                                assert_close, capture_problem, fc_problem, params, same_bits)

pytestmark = pytest.mark.seed
BF16 = torch.bfloat16
K = 3
# (model, H, N): the draft fc shapes of the seed user (Kimi-K2.5 at TP = 1 and TP = 8) and of Llama-3.1-8B
FC_SHAPES = (("kimi-k2.5", 7168, 7168), ("kimi-k2.5-tp8", 7168, 896), ("llama-3.1-8b", 4096, 4096))
FC_M = (1, 8, 16, 64, 256)
CAPTURE_T = (1, 64, 2048)
CAPTURE_H = (7168, 4096)
GPU = (CUDA, TRITON_CUDA)


def fc_cases(target):
    return [(model, H, N, M, variant) for model, H, N in FC_SHAPES for M in FC_M
            for variant in ("plain", "rows", "chunk_norm")]


@pytest.mark.parametrize("target,model,H,N,M,variant", params(GPU, fc_cases))
def test_draft_fc_at_the_seed_shapes(target, model, H, N, M, variant, device):
    p = fc_problem(M, H, K, BF16, device, N=N, key=("seed", model), **VARIANTS[variant])
    out = p.run_out(p.out())
    assert_close(out, p.truth(), MATMUL_TOL[BF16], normwise=True, what=f"{model} draft_fc {variant} M={M}")


def path_cases(target):
    return [(model, H, N, M, path) for model, H, N in FC_SHAPES for M in (1, 64) for path in FC_PATHS[target.backend]]


@pytest.mark.parametrize("target,model,H,N,M,path", params(GPU, path_cases))
def test_every_draft_fc_path_at_the_seed_shapes(target, model, H, N, M, path, device):
    p = fc_problem(M, H, K, BF16, device, N=N, key=("seed-path", model, path), **VARIANTS["chunk_norm"])
    with plans.forced_path(path):
        out = p.run_out(p.out())
    assert_close(out, p.truth(), MATMUL_TOL[BF16], normwise=True, what=f"{model} {path} path M={M}")


@pytest.mark.parametrize("target,model,H,N,M", params(GPU, lambda t: [(m, H, N, M) for m, H, N in FC_SHAPES
                                                                       for M in (1, 64)]))
def test_folded_fc_norm_at_the_seed_shapes(target, model, H, N, M, device):
    """The eagle3.1 fc_norm folded into a prepared weight once (norm_folded=True): the plain hot loop."""
    p = fc_problem(M, H, K, BF16, device, N=N, key=("seed-folded", model), **VARIANTS["chunk_norm"])
    folded = eagle3_ops.fold_norm_weights(p.weight, p.chunk_norm_weight)
    out = p.out()
    testing.run_canaried(lambda: eagle3_ops.draft_fc_out(p.x, folded, None, None, p.chunk_norm_weight, None, p.eps,
                                                         out, norm_folded=True), [out], poison=[out])
    assert_close(out, p.truth(), MATMUL_TOL[BF16], normwise=True, what=f"{model} folded fc_norm M={M}")


@pytest.mark.parametrize("target,T,H", params(GPU, [(T, H) for H in CAPTURE_H for T in CAPTURE_T]))
def test_capture_at_the_seed_shapes(target, T, H, device):
    p = capture_problem(T, H, K, BF16, device, key=("seed",), buffer_pad=16)
    p.run_canaried()
    assert_close(p.slot_view, p.sum64(), ROUNDING_TOL[BF16], what="captured slot")


@pytest.mark.parametrize("target,T,H", params(GPU, [(T, H) for H in CAPTURE_H for T in CAPTURE_T]))
def test_fused_add_rmsnorm_capture_at_the_seed_shapes(target, T, H, device):
    from eagle3_ops import reference

    p = capture_problem(T, H, K, BF16, device, key=("seed-fused",), fused=True, residual_scale=3.0, buffer_pad=16)
    sum64, normed64 = p.sum64(), p.normed64()
    want = p.clone()
    want.run(reference.fused_add_rmsnorm_capture)
    p.run_canaried()
    assert same_bits(p.residual, want.residual), "stored residual != the fp32 sum rounded once (reference)"
    assert same_bits(p.slot_view.contiguous(), p.residual.contiguous()), "captured slot != stored residual"
    assert_close(p.residual, sum64, ROUNDING_TOL[BF16], what="stored residual")
    assert_close(p.hidden, normed64, NORM_TOL[BF16], what="normed output")
