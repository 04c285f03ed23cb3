// The launch interface between draft_fc.cu (the kernels and their launches) and draft_fc_op.cpp (the
// op's tensor-facing half: checks, the skinny plan, the workspace layout, the cuBLAS path): plain C++,
// no ATen (see common.h).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "common.h"

namespace eagle3 {

// ---- launch shape ----------------------------------------------------------------------------------
// eagle3_ops/cuda_backend.py mirrors kThreads, kRowsPerBlock, the token tile (8 * NT tokens, NT from
// M), kStep, kMinSplitSteps, kMaxSplits, kStages(NT) (draft_fc.cu) and kPiece to plan its split request, and keeps
// each kernel's register count and shared memory (SKINNY_REGISTERS, skinny_shared_bytes; checked
// against the built cubins by tests/test_build.py); keep them in step.
constexpr int kThreads = 128;        // 4 warps
constexpr int kRowsPerWarp = 16;     // the MMA's M side: weight rows
constexpr int kRowsPerBlock = 64;
constexpr int kSlab = 32;            // k covered by one thread group (4 threads x 8 elements) per MMA pair
constexpr int kSlabsPerStep = 2;     // a ring step: 64 k
constexpr int kStep = kSlab * kSlabsPerStep;
constexpr int kMinSplitSteps = 8;    // a split is at least 512 k: the ring's fill is a small part of it
constexpr int kMaxTokenGroups = 8;   // token tile <= 64 tokens (8 groups of 8)
constexpr int kMaxSplits = 64;
constexpr int kReduceThreads = 256;
constexpr int kPrepareThreads = 256;
constexpr int kPieceThreads = 128;   // pre-pass: one 16-byte vector per thread
constexpr int kPiece = kPieceThreads * 8;
// Workspace regions start on this boundary (eagle3_ops.workspace.ALIGN: the Python side carves the
// same way, and the float4 / 16-byte vector accesses need 16).
constexpr int64_t kWorkspaceAlign = 256;
// Path numbers: the index in eagle3_ops.plans.PATHS ("skinny", "tiled", "cublas").
constexpr int64_t kPathSkinny = 0;
constexpr int64_t kPathCublas = 2;


struct FcArgs {
  const void* x;
  int64_t stride_x;
  const void* w;
  int64_t stride_w;
  const void* rows;  // nullptr: row m of x
  bool rows_are_int64;
  const void* in_w;     // input_norm_weight [KH] or nullptr
  const void* chunk_w;  // chunk_norm_weight [K, H] (flat [KH]) or nullptr
  const void* bias;     // [N] or nullptr
  void* out;
  int64_t stride_out;
  float* partial;  // [S][M][N] fp32, or nullptr: the skinny kernel writes out directly
  float* stats;    // [M][P][2] fp32 (sum x^2, sum (x*in_w)^2 per pre-pass piece), or nullptr: no norm
  bool folded;     // the weight carries g = in_w * chunk_w (in_w still feeds the chunk statistic)
  int64_t R;
  int M, N, KH;
  int CH, NC;  // chunk width and count: (H, K) with chunk norm, else (KH, 1)
  int pieces_per_chunk;  // pre-pass pieces of kPiece elements per chunk; P = NC * pieces_per_chunk
  int splits_per_chunk, split_len, S;
  float eps;
};

inline int64_t align_up(int64_t bytes) { return ceil_div(bytes, kWorkspaceAlign) * kWorkspaceAlign; }

// The skinny launch for one problem: token tile, grid and splits (draft_fc.cu's header comment;
// planned by draft_fc_op.cpp's skinny_plan).
struct SkinnyPlan {
  int nt;            // token groups of 8 per tile: 1, 2, 4 or 8
  int token_tiles;   // grid.x
  int weight_tiles;  // grid.y
  int splits_per_chunk, split_len, S;  // grid.z = S = NC * splits_per_chunk
  int pieces_per_chunk;  // the norm pre-pass's grid.y = NC * pieces_per_chunk
};

// Workspace regions of the skinny path, in this order: fp32 partials [S][M][N] (none with one split
// and no norm: the kernel writes out directly); with norms the pre-pass's fp32 piece sums [M][P][2];
// with unfolded norms x*g [M][KH] in the dtype.
struct SkinnyRegions {
  int64_t partial_bytes, stats_bytes, gained_bytes;
  int64_t total() const { return partial_bytes + stats_bytes + gained_bytes; }
};

// T: c10::BFloat16 or c10::Half (instantiated in draft_fc.cu). Each returns the first launch error.
// The skinny path: pre-pass (with norms) -> skinny kernel -> reducer (with partials), each a PDL
// dependent of the previous; the regions are carved from `workspace` in the order above.
template <typename T>
cudaError_t run_skinny(FcArgs args, const SkinnyPlan& plan, const SkinnyRegions& regions, uint8_t* workspace,
                       cudaStream_t stream);

// The cuBLAS path's prepared input: prep[m, :] = norm(x[rows[m]]) in the dtype, row stride
// prep_stride elements (a NaN row where rows[m] is out of range). T: also float.
template <typename T>
cudaError_t launch_prepare(const FcArgs& args, void* prep, int64_t prep_stride, cudaStream_t stream);

// Resident blocks per SM of fc_skinny_kernel<T, nt> (nt in {1, 2, 4, 8}) on the current device.
template <typename T>
cudaError_t skinny_occupancy_blocks(int nt, int* blocks);

}  // namespace eagle3
