"""CPU twin of the CUDA skinny path's algorithm (csrc/draft_fc.cu; docs/kernels.md §7): the norm
pre-pass over 1024-element pieces inside each chunk (sums of x^2 and (x*g_in)^2 per piece, x*g
rounded to the dtype unless folded), split-K partials in fp32 over exactly the split shapes the op
launches (skinny_model.split_shape: 64-wide steps, at least 8, at most 64 splits), and the
reducer's per-chunk scales from the piece sums, summed over splits in order, one rounding, NaN rows.

It runs the decomposition on the CPU, in torch, at shapes with every tail the kernels see (a chunk
width that is no multiple of 64 or of 1024, a weight-row tail, partial token tiles, rows out of
range) and checks it against the float64 answer of the op's contract (reference.draft_fc_ref):
the split bounds, the piece partition and the scale formula are the ones the CUDA code uses. What
it cannot check is the CUDA code itself (the ring, ldmatrix fragments): the `gpu` tests do
(tests/test_cuda_ops_registration.py test_gpu_skinny_ring_and_prepass_match_fp64_at_every_split_count,
tests/ops/test_draft_fc.py), and qualification guards every kernel on the device."""
import math

import pytest
import torch

from eagle3_ops import reference, skinny_model
import op_testing as testing

BF16 = torch.bfloat16


def twin(x, w, bias, rows, cn, inw, eps, splits, folded):
    """The CUDA skinny path's arithmetic, step for step in structure (not in fp32 summation order)."""
    R, KH = x.shape
    N, M = w.shape[0], (rows.numel() if rows is not None else R)
    NC, CH = (cn.shape[0], cn.shape[1]) if cn is not None else (1, KH)
    norm = cn is not None or inw is not None
    src = rows.long() if rows is not None else torch.arange(M)
    valid = (src >= 0) & (src < R)
    xr = torch.where(valid[:, None], x[src.clamp(0, R - 1)].float(), torch.zeros(()))  # never read: zeros
    g_in = inw.float() if inw is not None else torch.ones(KH)
    g_ch = cn.reshape(-1).float() if cn is not None else torch.ones(KH)
    # pre-pass: pieces of PIECE elements inside each chunk (the last one partial)
    ppc = math.ceil(CH / skinny_model.PIECE)
    stats = torch.zeros(M, NC * ppc, 2)
    for c in range(NC):
        for q in range(ppc):
            lo = c * CH + q * skinny_model.PIECE
            hi = min(lo + skinny_model.PIECE, (c + 1) * CH)
            piece = xr[:, lo:hi]
            stats[:, c * ppc + q, 0] = (piece * piece).sum(1)
            stats[:, c * ppc + q, 1] = ((piece * g_in[lo:hi]) ** 2).sum(1)
    xk = xr if (folded or not norm) else (xr * (g_in * g_ch)).to(x.dtype).float()  # x*g rounded once
    # skinny: fp32 partial per split over the op's split bounds
    per_chunk, split_len = skinny_model.split_shape(CH, NC, splits)
    parts = []
    for c in range(NC):
        for s in range(per_chunk):
            lo = c * CH + s * split_len
            hi = min(lo + split_len, (c + 1) * CH)
            assert lo < hi and (hi - lo) % 8 == 0
            parts.append(xk[:, lo:hi] @ w[:, lo:hi].float().t())
    # reducer: chunk scales from the piece sums, then the splits in order
    scale = torch.ones(M, NC)
    if norm:
        row = torch.rsqrt(stats[:, :, 0].sum(1) / KH + eps) if inw is not None else torch.ones(M)
        for c in range(NC):
            q = stats[:, c * ppc:(c + 1) * ppc, 1].sum(1)
            scale[:, c] = row * torch.rsqrt(row * row * (q / CH) + eps) if cn is not None else row
    out = torch.zeros(M, N)
    for i, p in enumerate(parts):
        out += scale[:, i // per_chunk, None] * p
    if bias is not None:
        out += bias.float()
    out = torch.where(valid[:, None], out, torch.full((), float("nan")))
    return out.to(x.dtype)


CASES = [  # (M, H, K, N): chunk 1000 = 15 steps of 64 + 40 (and no multiple of 1024); N % 64 != 0
    (1, 1000, 3, 72), (7, 1000, 3, 130), (40, 1024, 2, 100), (3, 3000, 1, 64)]


@pytest.mark.parametrize("variant", ["plain", "rows", "chunk_norm", "input_norm", "all", "folded"])
@pytest.mark.parametrize("M,H,K,N", CASES)
def test_the_skinny_decomposition_matches_fp64(M, H, K, N, variant):
    folded = variant == "folded"
    p = testing.fc_problem(M, H, K, BF16, "cpu", N=N, key=("twin",), **testing.VARIANTS["all" if folded else variant])
    want = p.truth()
    weight = reference.fold_norm_weights_ref(p.weight, p.chunk_norm_weight, p.input_norm_weight) if folded else p.weight
    NC, CH = (K, H) if p.chunk_norm_weight is not None else (1, K * H)
    for splits in sorted({1, 3, skinny_model.max_splits_per_chunk(CH, NC), 99}):
        got = twin(p.x, weight, p.bias, p.rows, p.chunk_norm_weight, p.input_norm_weight, p.eps, splits, folded)
        testing.assert_close(got, want, testing.MATMUL_TOL[BF16], normwise=True, what=f"twin splits={splits}")


def test_out_of_range_rows_give_nan_rows_and_are_never_read():
    p = testing.fc_problem(6, 1000, 3, BF16, "cpu", N=72, key=("twin-oob",), **testing.VARIANTS["all"])
    rows = p.rows.clone()
    rows[1], rows[4] = -1, p.x.shape[0]
    got = twin(p.x, p.weight, p.bias, rows, p.chunk_norm_weight, p.input_norm_weight, p.eps, 3, False)
    assert got[[1, 4]].isnan().all() and not got[[0, 2, 3, 5]].isnan().any()
