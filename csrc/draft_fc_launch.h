// The launch interface between draft_fc.cu (the kernels and their launches) and draft_fc_op.cpp (the
// op's tensor-facing half: checks, the skinny plan, the workspace layout, the cuBLAS path): plain C++,
// no ATen (see common.h).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "common.h"

namespace eagle3 {

// ---- launch shape ----------------------------------------------------------------------------------
// eagle3_ops/skinny_model.py mirrors the block shapes below (SKINNY_SHAPES), the token tile (8 * NT
// tokens, NT from M), kStep, kMinSplitSteps, kMaxSplits and kPiece to plan its split request, and
// cuda_backend.py keeps each kernel's register count (SKINNY_REGISTERS; checked against the built
// cubins by tests/test_build.py, with the shared memory skinny_model.shared_bytes computes); keep
// them in step.
constexpr int kRowsPerWarp = 16;     // the MMA's M side: weight rows
constexpr int kSlab = 32;            // k covered by one thread group (4 threads x 8 elements) per MMA pair
constexpr int kSlabsPerStep = 2;     // a ring step: 64 k
constexpr int kStep = kSlab * kSlabsPerStep;
constexpr int kMinSplitSteps = 8;    // a split is at least 512 k: the ring's fill is a small part of it
constexpr int kMaxTokenGroups = 8;   // token tile <= 64 tokens (8 groups of 8)
constexpr int kStaticSharedLimit = 48 * 1024;  // above it a kernel's ring is dynamic shared memory (opt-in)

// The skinny kernels built, fc_skinny_kernel<T, nt, rows, stages> for T in {bf16, fp16}: a block of
// rows / 16 warps (2 * rows threads) owns `rows` weight rows and one token tile of 8 * nt tokens,
// and streams its k range through a ring of `stages` 64-wide steps (stages - 1 in flight). 64 rows
// for every token tile; at nt = 8 also 128 rows (x, as many bytes per step as a 64-row weight tile
// at 64 tokens, is then copied from L2 half as often per weight byte), with 4 stages (fits sm_120's
// 99 KB per block) or 6 (sm_90 only: more bytes in flight per block, fewer splits). The planner
// (cuda_backend.py) picks the shape; the op accepts only these.
struct SkinnyShape {
  int nt, rows, stages;
};
constexpr SkinnyShape kSkinnyShapes[] = {{1, 64, 4}, {2, 64, 4}, {4, 64, 4}, {8, 64, 3}, {8, 128, 4}, {8, 128, 6}};
constexpr int kNumSkinnyShapes = static_cast<int>(sizeof(kSkinnyShapes) / sizeof(kSkinnyShapes[0]));
constexpr int kDefaultSkinnyRows = 64;

constexpr int skinny_threads(int rows) { return 2 * rows; }  // rows / kRowsPerWarp warps
// The ring's bytes: per stage the weight tile [rows][kStep] and the x tile [8 nt][kStep], 16-byte chunks.
constexpr int skinny_shared_bytes(SkinnyShape s) { return s.stages * (s.rows + 8 * s.nt) * (kStep / 8) * 16; }
// The first built shape with this token tile and block rows (stages == 0 asks for it), or {0, 0, 0}.
constexpr SkinnyShape find_skinny_shape(int nt, int rows, int stages) {
  for (int i = 0; i < kNumSkinnyShapes; ++i) {
    const SkinnyShape s = kSkinnyShapes[i];
    if (s.nt == nt && s.rows == rows && (stages == 0 || s.stages == stages)) return s;
  }
  return SkinnyShape{0, 0, 0};
}

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
  SkinnyShape shape;  // shape.nt: token groups of 8 per tile, 1, 2, 4 or 8 (from M)
  int token_tiles;    // grid.x
  int weight_tiles;   // grid.y: blocks of shape.rows weight rows
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

// The current device's largest shared memory one block may opt in to (a ring beyond it cannot launch).
cudaError_t max_shared_per_block(int* bytes);

// Resident blocks per SM of fc_skinny_kernel<T, shape> (one of kSkinnyShapes) on the current device;
// 0 where its ring does not fit the device's shared memory per block.
template <typename T>
cudaError_t skinny_occupancy_blocks(SkinnyShape shape, int* blocks);

}  // namespace eagle3
