// The op's contract is eagle3_ops/validation.py (checked before this is called); the TORCH_CHECKs here only
// keep a direct call of eagle3_cuda::draft_fc from touching memory it must not.
// eagle3_cuda::draft_fc and its helpers, the tensor-facing half: memory-safety checks, the skinny plan
// (token tile, splits) and the workspace layout, the cuBLAS path (at::addmm / at::mm on the prepared
// input), device guard, stream and dtype dispatch. The kernels and their launches are in draft_fc.cu
// (its header comment describes the paths); draft_fc_launch.h holds what both halves share.
#include <ATen/ops/addmm.h>
#include <ATen/ops/mm.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <climits>
#include <string>
#include <type_traits>

#include "common.h"
#include "draft_fc_launch.h"
#include "ops.h"

namespace eagle3 {
namespace {

std::string built_shapes(int nt) {
  std::string out;
  for (const SkinnyShape& s : kSkinnyShapes) {
    if (s.nt != nt) continue;
    out += std::string(out.empty() ? "" : ", ") + "(" + std::to_string(s.rows) + " rows, " +
           std::to_string(s.stages) + " stages)";
  }
  return out;
}

// The built shape (kSkinnyShapes) of token tile nt with these block rows and stages (0: the first
// built with these rows), or an error naming `op`, the request (`lead` and `tail` around it) and the
// shapes that were built.
SkinnyShape built_shape(const char* op, int nt, int64_t block_rows, int64_t stages, const std::string& lead,
                        const std::string& tail) {
  const bool small = block_rows > 0 && block_rows <= INT_MAX && stages >= 0 && stages <= INT_MAX;
  const SkinnyShape shape =
      small ? find_skinny_shape(nt, static_cast<int>(block_rows), static_cast<int>(stages)) : SkinnyShape{0, 0, 0};
  TORCH_CHECK(shape.nt != 0, op, ": no skinny kernel with ", lead, "block_rows=", block_rows, ", stages=", stages, tail,
              "; built: ", built_shapes(nt));
  return shape;
}

// block_rows, stages: the block shape (built_shape, for M's token tile).
SkinnyPlan skinny_plan(int64_t M, int64_t N, int CH, int NC, int64_t splits, int64_t block_rows, int64_t stages) {
  TORCH_CHECK(CH > 0 && NC > 0, "eagle3_cuda::draft_fc: the skinny path needs K*H > 0");
  TORCH_CHECK(splits >= 1, "eagle3_cuda::draft_fc: the skinny path needs splits >= 1, got ", splits);
  SkinnyPlan p{};
  const int groups = static_cast<int>(ceil_div(std::min<int64_t>(M, 8 * kMaxTokenGroups), 8));
  const int nt = groups <= 1 ? 1 : groups <= 2 ? 2 : groups <= 4 ? 4 : 8;
  p.shape = built_shape("eagle3_cuda::draft_fc", nt, block_rows, stages, "",
                        " for M=" + std::to_string(M) + " (a token tile of " + std::to_string(8 * nt) + ")");
  p.token_tiles = static_cast<int>(ceil_div(M, 8 * nt));
  p.weight_tiles = static_cast<int>(ceil_div(N, p.shape.rows));
  // Each split a whole number of kStep steps inside one chunk, at least kMinSplitSteps of them
  // (unless the chunk is narrower), at most kMaxSplits splits in all.
  const int asked = static_cast<int>(std::min<int64_t>(splits, INT_MAX));
  const int per_chunk = std::max(1, std::min({asked, CH / (kMinSplitSteps * kStep), kMaxSplits / NC}));
  p.split_len = static_cast<int>(ceil_div(ceil_div(CH, per_chunk), kStep) * kStep);
  p.splits_per_chunk = static_cast<int>(ceil_div(CH, p.split_len));
  p.S = NC * p.splits_per_chunk;
  TORCH_CHECK(p.S <= kMaxSplits, "eagle3_cuda::draft_fc: ", p.S, " splits exceed the reducer's ", kMaxSplits,
              " (more than ", kMaxSplits, " chunks: use the cublas path)");
  p.pieces_per_chunk = static_cast<int>(ceil_div(CH, kPiece));
  return p;
}

SkinnyRegions skinny_regions(const SkinnyPlan& p, int64_t M, int64_t N, int64_t KH, bool norm, bool folded,
                             int64_t elem_bytes) {
  SkinnyRegions r{0, 0, 0};
  if (p.S > 1 || norm) r.partial_bytes = align_up(static_cast<int64_t>(p.S) * M * N * static_cast<int64_t>(sizeof(float)));
  if (norm) {
    const int64_t pieces = static_cast<int64_t>(p.S / p.splits_per_chunk) * p.pieces_per_chunk;  // NC * ppc
    r.stats_bytes = align_up(M * pieces * 2 * static_cast<int64_t>(sizeof(float)));
    if (!folded) r.gained_bytes = align_up(M * KH * elem_bytes);
  }
  return r;
}

// (chunk width, chunk count): (H, K) with chunk norm, else (KH, 1).
std::pair<int64_t, int64_t> chunks(int64_t KH, int64_t K, bool chunk_norm) {
  if (!chunk_norm) return {KH, 1};
  TORCH_CHECK(K >= 1 && KH % K == 0 && KH / K > 0, "eagle3_cuda::draft_fc: chunk_norm needs K >= 1 chunks of ",
              "equal, non-zero width (K*H = KH), got KH=", KH, ", K=", K);
  return {KH / K, K};
}

int64_t workspace_bytes(int64_t M, int64_t N, int64_t KH, int64_t K, bool chunk_norm, bool input_norm, int64_t path,
                        int64_t splits, at::ScalarType dtype, bool norm_folded) {
  TORCH_CHECK(M >= 0 && N >= 0 && KH >= 0, "eagle3_cuda::draft_fc_workspace_bytes: negative size");
  TORCH_CHECK(M <= INT32_MAX && N <= INT32_MAX && KH <= INT32_MAX,
              "eagle3_cuda::draft_fc_workspace_bytes: sizes must fit int32");
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kHalf || dtype == at::kFloat,
              "eagle3_cuda::draft_fc_workspace_bytes: unsupported dtype ", dtype);
  if (M == 0 || N == 0) return 0;
  const int64_t elem = static_cast<int64_t>(c10::elementSize(dtype));
  if (path == kPathSkinny) {
    TORCH_CHECK(dtype != at::kFloat, "eagle3_cuda::draft_fc: the skinny path takes bf16/fp16 only");
    const auto [CH, NC] = chunks(KH, K, chunk_norm);
    // the workspace does not depend on the block shape: the default one
    const SkinnyPlan p = skinny_plan(M, N, static_cast<int>(CH), static_cast<int>(NC), splits, kDefaultSkinnyRows, 0);
    return skinny_regions(p, M, N, KH, chunk_norm || input_norm, norm_folded, elem).total();
  }
  TORCH_CHECK(path == kPathCublas, "eagle3_cuda::draft_fc: path must be 0 (skinny) or 2 (cublas), got ", path,
              " (1, tiled, is a Triton kernel only)");
  // The prepared input norm(x[rows]) [M, KH] in the dtype. (A call with no gather and no norm has
  // nothing to prepare and needs none of it; the caller knows, see draft_fc below.)
  return align_up(M * KH * elem);
}

// norm(x[rows]) [M, KH] in the dtype, written into the workspace's first region.
template <typename T>
at::Tensor prepare_input(const FcArgs& a, const at::Tensor& workspace, at::ScalarType dtype, cudaStream_t stream) {
  const int64_t bytes = static_cast<int64_t>(a.M) * a.KH * static_cast<int64_t>(sizeof(T));
  at::Tensor prep = workspace.narrow(0, 0, bytes).view(dtype).view({a.M, a.KH});
  C10_CUDA_CHECK(launch_prepare<T>(a, prep.data_ptr(), prep.stride(0), stream));
  return prep;
}

bool aligned16(const std::optional<at::Tensor>& t) { return !t.has_value() || is_aligned16(t->data_ptr()); }

template <typename T>
void draft_fc_typed(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                    const std::optional<at::Tensor>& rows, const std::optional<at::Tensor>& chunk_norm_weight,
                    const std::optional<at::Tensor>& input_norm_weight, double eps, at::Tensor& out,
                    const std::optional<at::Tensor>& workspace, int64_t path, int64_t splits,
                    bool norm_folded, int64_t block_rows, int64_t stages) {
  FcArgs a{};
  a.folded = norm_folded;
  a.x = x.data_ptr();
  a.stride_x = x.stride(0);
  a.w = weight.data_ptr();
  a.stride_w = weight.stride(0);
  a.rows = rows.has_value() ? rows->data_ptr() : nullptr;
  a.rows_are_int64 = rows.has_value() && rows->scalar_type() == at::kLong;
  a.in_w = input_norm_weight.has_value() ? input_norm_weight->data_ptr() : nullptr;
  a.chunk_w = chunk_norm_weight.has_value() ? chunk_norm_weight->data_ptr() : nullptr;
  a.bias = bias.has_value() ? bias->data_ptr() : nullptr;
  a.out = out.data_ptr();
  a.stride_out = out.stride(0);
  a.R = x.size(0);
  a.M = static_cast<int>(out.size(0));
  a.N = static_cast<int>(weight.size(0));
  a.KH = static_cast<int>(x.size(1));
  a.NC = chunk_norm_weight.has_value() ? static_cast<int>(chunk_norm_weight->size(0)) : 1;
  a.CH = chunk_norm_weight.has_value() ? static_cast<int>(chunk_norm_weight->size(1)) : a.KH;
  a.eps = static_cast<float>(eps);

  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (path == kPathSkinny) {
    if constexpr (!std::is_same_v<T, float>) {
      // The launch contract of the 16-byte fragments (cuda_backend checks it before choosing this
      // path; here it guards direct callers against misaligned loads).
      TORCH_CHECK(a.KH > 0 && a.CH % 8 == 0 && a.stride_x % 8 == 0 && a.stride_w % 8 == 0 && is_aligned16(a.x) &&
                      is_aligned16(a.w) && aligned16(chunk_norm_weight) && aligned16(input_norm_weight),
                  "eagle3_cuda::draft_fc: the skinny path needs K*H > 0, a chunk width and row strides that are ",
                  "multiples of 8 and 16-byte aligned x, weight and norm weights; use the cublas path");
      const SkinnyPlan p = skinny_plan(a.M, a.N, a.CH, a.NC, splits, block_rows, stages);
      const int ring = skinny_shared_bytes(p.shape);
      if (ring > kStaticSharedLimit) {  // checked before anything launches (the pre-pass would run first)
        int per_block = 0;
        C10_CUDA_CHECK(max_shared_per_block(&per_block));
        TORCH_CHECK(ring <= per_block, "eagle3_cuda::draft_fc: the skinny block of ", p.shape.rows, " rows and ",
                    p.shape.stages, " stages needs ", ring, " bytes of shared memory per block; this device allows ",
                    per_block, " (eagle3_cuda::skinny_occupancy answers 0 for it: use another block shape)");
      }
      const bool norm = a.in_w != nullptr || a.chunk_w != nullptr;
      const SkinnyRegions regions = skinny_regions(p, a.M, a.N, a.KH, norm, a.folded, sizeof(T));
      uint8_t* ws = workspace.has_value() ? static_cast<uint8_t*>(workspace->data_ptr()) : nullptr;
      C10_CUDA_CHECK(run_skinny<T>(a, p, regions, ws, stream));
      return;
    }
    TORCH_CHECK(false, "eagle3_cuda::draft_fc: the skinny path takes bf16/fp16 only");
  }
  at::Tensor input = x;
  if (rows.has_value() || chunk_norm_weight.has_value() || input_norm_weight.has_value()) {
    // K*H = 0: nothing to prepare (and no workspace): an empty [M, 0] view; out = bias.
    input = a.KH > 0 ? prepare_input<T>(a, *workspace, x.scalar_type(), stream) : x.as_strided({a.M, 0}, {0, 1});
  }
  if (bias.has_value()) {
    at::addmm_out(out, *bias, input, weight.t());
  } else {
    at::mm_out(out, input, weight.t());
  }
}

bool unit_stride(const std::optional<at::Tensor>& t) {
  return !t.has_value() || t->numel() <= 1 || t->stride(0) == 1;
}

}  // namespace

int64_t skinny_occupancy(int64_t nt, at::ScalarType dtype, int64_t block_rows, int64_t stages) {
  TORCH_CHECK(nt == 1 || nt == 2 || nt == 4 || nt == 8, "eagle3_cuda::skinny_occupancy: nt must be 1, 2, 4 or 8, got ",
              nt);
  const SkinnyShape shape = built_shape("eagle3_cuda::skinny_occupancy", static_cast<int>(nt), block_rows, stages,
                                        "nt=" + std::to_string(nt) + ", ", "");
  int blocks = 0;
  switch (dtype) {
    case at::kBFloat16: C10_CUDA_CHECK(skinny_occupancy_blocks<c10::BFloat16>(shape, &blocks)); break;
    case at::kHalf: C10_CUDA_CHECK(skinny_occupancy_blocks<c10::Half>(shape, &blocks)); break;
    default: TORCH_CHECK(false, "eagle3_cuda::skinny_occupancy: the skinny kernel takes bf16/fp16 only, got ", dtype);
  }
  return blocks;
}

int64_t draft_fc_workspace_bytes(int64_t M, int64_t N, int64_t KH, int64_t K, bool chunk_norm, bool input_norm,
                                 int64_t path, int64_t splits, at::ScalarType dtype, bool norm_folded) {
  return workspace_bytes(M, N, KH, K, chunk_norm, input_norm, path, splits, dtype, norm_folded);
}

void draft_fc(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
              const std::optional<at::Tensor>& rows, const std::optional<at::Tensor>& chunk_norm_weight,
              const std::optional<at::Tensor>& input_norm_weight, double eps, at::Tensor& out,
              const std::optional<at::Tensor>& workspace, int64_t path, int64_t splits, bool norm_folded,
              int64_t block_rows, int64_t stages) {
  const char* op = "eagle3_cuda::draft_fc: ";
  // eagle3_ops/validation.py checks all of this with clear messages first; these guard direct
  // callers of the op against out-of-bounds accesses.
  TORCH_CHECK(x.is_cuda() && weight.is_cuda() && out.is_cuda(), op, "tensors must be on CUDA");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && out.dim() == 2 && weight.size(1) == x.size(1) &&
                  out.size(1) == weight.size(0) && (rows.has_value() || out.size(0) == x.size(0)),
              op, "shapes: x [R, KH], weight [N, KH], out [M, N] (M = R without rows)");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && out.scalar_type() == x.scalar_type() &&
                  weight.device() == x.device() && out.device() == x.device(),
              op, "one dtype, one device");
  TORCH_CHECK(!rows.has_value() || (rows->device() == x.device() && rows->dim() == 1 && rows->numel() == out.size(0) &&
                                    (rows->scalar_type() == at::kInt || rows->scalar_type() == at::kLong)),
              op, "rows must be int32/int64 [M] on x's device");
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->numel() == weight.size(0) &&
                                    bias->scalar_type() == x.scalar_type() && bias->device() == x.device()),
              op, "bias must be [N]");
  TORCH_CHECK(!input_norm_weight.has_value() ||
                  (input_norm_weight->dim() == 1 && input_norm_weight->numel() == x.size(1) &&
                   input_norm_weight->scalar_type() == x.scalar_type() && input_norm_weight->device() == x.device()),
              op, "input_norm_weight must be [KH]");
  TORCH_CHECK(!chunk_norm_weight.has_value() ||
                  (chunk_norm_weight->dim() == 2 && chunk_norm_weight->numel() == x.size(1) &&
                   chunk_norm_weight->size(1) > 0 && chunk_norm_weight->scalar_type() == x.scalar_type() &&
                   chunk_norm_weight->device() == x.device()),
              op, "chunk_norm_weight must be [K, H], K*H = KH");
  TORCH_CHECK((x.size(1) <= 1 || x.stride(1) == 1) && (weight.size(1) <= 1 || weight.stride(1) == 1) &&
                  (out.size(1) <= 1 || out.stride(1) == 1),
              op, "last dims must be contiguous");
  TORCH_CHECK(!chunk_norm_weight.has_value() || chunk_norm_weight->is_contiguous(), op,
              "chunk_norm_weight must be contiguous");
  TORCH_CHECK(unit_stride(rows) && unit_stride(bias) && unit_stride(input_norm_weight), op,
              "rows, bias and input_norm_weight must have stride 1 (copy strided views first)");
  TORCH_CHECK(x.size(1) <= INT32_MAX && weight.size(0) <= INT32_MAX && out.size(0) <= INT32_MAX, op,
              "sizes must fit int32");
  TORCH_CHECK(path == kPathSkinny || path == kPathCublas, op, "path must be 0 (skinny) or 2 (cublas), got ", path);
  TORCH_CHECK(!norm_folded || chunk_norm_weight.has_value() || input_norm_weight.has_value(), op,
              "norm_folded needs the norm weights (their shapes and input_norm_weight's values give the scales)");
  if (out.size(0) == 0 || out.size(1) == 0) return;
  const bool prepares = rows.has_value() || chunk_norm_weight.has_value() || input_norm_weight.has_value();
  const int64_t K = chunk_norm_weight.has_value() ? chunk_norm_weight->size(0) : 1;
  const int64_t need = (path == kPathCublas && !prepares)
                           ? 0
                           : workspace_bytes(out.size(0), weight.size(0), x.size(1), K, chunk_norm_weight.has_value(),
                                             input_norm_weight.has_value(), path, splits, x.scalar_type(),
                                             norm_folded);
  if (need > 0) {
    TORCH_CHECK(workspace.has_value(), op, "this call needs a workspace of ", need,
                " bytes (eagle3_cuda::draft_fc_workspace_bytes), got none");
    TORCH_CHECK(workspace->device() == x.device() && workspace->scalar_type() == at::kByte && workspace->dim() == 1 &&
                    (workspace->numel() <= 1 || workspace->stride(0) == 1),
                op, "workspace must be a 1-D uint8 tensor with stride 1 on x's device");
    TORCH_CHECK(workspace->numel() >= need, op, "workspace has ", workspace->numel(), " bytes, this call needs ", need,
                " (eagle3_cuda::draft_fc_workspace_bytes)");
    TORCH_CHECK(is_aligned16(workspace->data_ptr()), op, "workspace must be 16-byte aligned");
  }
  const c10::cuda::OptionalCUDAGuard guard(x.device());
  switch (x.scalar_type()) {
    case at::kBFloat16:
      draft_fc_typed<c10::BFloat16>(x, weight, bias, rows, chunk_norm_weight, input_norm_weight, eps, out, workspace,
                                    path, splits, norm_folded, block_rows, stages);
      break;
    case at::kHalf:
      draft_fc_typed<c10::Half>(x, weight, bias, rows, chunk_norm_weight, input_norm_weight, eps, out, workspace, path,
                                splits, norm_folded, block_rows, stages);
      break;
    case at::kFloat:
      draft_fc_typed<float>(x, weight, bias, rows, chunk_norm_weight, input_norm_weight, eps, out, workspace, path,
                            splits, norm_folded, block_rows, stages);
      break;
    default:
      TORCH_CHECK(false, op, "unsupported dtype ", x.scalar_type());
  }
}

}  // namespace eagle3
