// Host entry points of the compiled eagle3 kernels, registered as the torch ops eagle3_cuda::* in
// csrc/bindings.cpp (the schemas are there). Arguments are validated in Python
// (eagle3_ops/validation.py) and the tuning decisions (draft_fc's path and splits) are made in
// Python (eagle3_ops/cuda_backend.py) before these are called; the TORCH_CHECKs here only guard
// memory safety (devices, dtypes, shapes, strides, bounds, workspace size).
#pragma once

// Only the Tensor class: ATen/ATen.h (every op's declaration) tripled the compile time. Included by
// bindings.cpp and the *_op.cpp files, never by a .cu (see common.h).
#include <ATen/core/Tensor.h>
#include <optional>

namespace eagle3 {

// buffer[:T, slot*H:(slot+1)*H] = hidden (+ residual), fp32 add, one rounding.
void capture(const at::Tensor& hidden, const std::optional<at::Tensor>& residual,
             at::Tensor& buffer, int64_t slot);

// SGLang fused_add_rmsnorm (residual <- input + residual in its dtype; input <- rmsnorm of the
// unrounded fp32 sum * weight) that also writes the new residual into buffer slot `slot`.
void fused_add_rmsnorm_capture(at::Tensor& input, at::Tensor& residual, const at::Tensor& weight,
                               double eps, at::Tensor& buffer, int64_t slot);

// out[M, N] = linear(norm(x[rows]), weight, bias): input norm over the K*H row, then one RMSNorm
// per H-wide chunk, fp32 accumulation, one rounding; rows outside [0, R) give NaN rows.
// path: 0 skinny, 2 cublas (the index in eagle3_ops.plans.PATHS); splits: split-K splits per chunk
// asked for (skinny only; clamped to the launch contract). Scratch is carved from `workspace`
// (uint8, 16-byte aligned, at least draft_fc_workspace_bytes(...) bytes; none needed when that is 0).
// rows, bias and input_norm_weight must have stride 1. norm_folded: the weight already carries the
// norm weights (W[n, k] * input_norm_weight[k] * chunk_norm_weight.flat[k]); they are not applied
// again, only their RMS scales (eagle3_ops.fold_norm_weights). block_rows, stages: the skinny block
// shape (draft_fc_launch.h kSkinnyShapes, for M's token tile; stages 0: the first built with these
// rows); the bits do not depend on it.
void draft_fc(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
              const std::optional<at::Tensor>& rows, const std::optional<at::Tensor>& chunk_norm_weight,
              const std::optional<at::Tensor>& input_norm_weight, double eps, at::Tensor& out,
              const std::optional<at::Tensor>& workspace, int64_t path, int64_t splits, bool norm_folded,
              int64_t block_rows, int64_t stages);

// Bytes of workspace draft_fc needs for M output rows, N features, KH = K*H inputs (K chunks with
// chunk_norm, else ignored), the given norms, path and splits, in dtype, with or without folded norm
// weights (skinny: unfolded norms also need x*g [M, KH]). Path 2 (cublas) counts the prepared input
// [M, KH]; a call with no rows and no norms prepares nothing and needs 0 bytes.
int64_t draft_fc_workspace_bytes(int64_t M, int64_t N, int64_t KH, int64_t K, bool chunk_norm, bool input_norm,
                                 int64_t path, int64_t splits, at::ScalarType dtype, bool norm_folded);

// Resident blocks per SM of the skinny kernel of this block shape (token groups nt in {1, 2, 4, 8},
// block_rows and stages as draft_fc's; bf16/fp16; one kernel serves every norm variant) on the current
// device: cudaOccupancyMaxActiveBlocksPerMultiprocessor for its launch (2 * block_rows threads, its
// ring), 0 where the ring exceeds the device's shared memory per block. Needs a GPU whose arch the
// extension carries; eagle3_ops/cuda_backend.py plans from it (docs/kernels.md §7.5).
int64_t skinny_occupancy(int64_t nt, at::ScalarType dtype, int64_t block_rows, int64_t stages);

}  // namespace eagle3
