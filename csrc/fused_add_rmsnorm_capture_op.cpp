// The op's contract is eagle3_ops/validation.py (checked before this is called); the TORCH_CHECKs here only
// keep a direct call of eagle3_cuda::fused_add_rmsnorm_capture from touching memory it must not.
// eagle3_cuda::fused_add_rmsnorm_capture, the tensor-facing half: memory-safety checks, device guard,
// stream and dtype dispatch; the kernels, their numerics and launch shapes are in
// fused_add_rmsnorm_capture.cu.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <climits>

#include "common.h"
#include "fused_add_rmsnorm_capture_launch.h"
#include "ops.h"

namespace eagle3 {
namespace {

template <typename T>
void fused_typed(at::Tensor& input, at::Tensor& residual, const at::Tensor& weight, double eps, at::Tensor& buffer,
                 int64_t slot) {
  constexpr int VEC = kVecElems<T>;
  const int H = static_cast<int>(input.size(1));
  T* out = static_cast<T*>(buffer.data_ptr()) + slot * H;
  // 16-byte packs only when every row of every tensor starts on a 16-byte boundary and holds whole
  // vectors; any other layout takes the scalar (one element per pack) kernels.
  const bool vectorizable = H % VEC == 0 && input.stride(0) % VEC == 0 && residual.stride(0) % VEC == 0 &&
                            buffer.stride(0) % VEC == 0 && is_aligned16(input.data_ptr()) &&
                            is_aligned16(residual.data_ptr()) && is_aligned16(weight.data_ptr()) && is_aligned16(out);
  const FusedArgs args{input.data_ptr(), input.stride(0), residual.data_ptr(), residual.stride(0),
                       weight.data_ptr(), out, buffer.stride(0), input.size(0), H, static_cast<float>(eps),
                       vectorizable};
  C10_CUDA_CHECK(launch_fused_add_rmsnorm_capture<T>(args, c10::cuda::getCurrentCUDAStream()));
}

}  // namespace

void fused_add_rmsnorm_capture(at::Tensor& input, at::Tensor& residual, const at::Tensor& weight, double eps,
                               at::Tensor& buffer, int64_t slot) {
  const char* op = "eagle3_cuda::fused_add_rmsnorm_capture: ";
  TORCH_CHECK(input.is_cuda() && residual.is_cuda() && weight.is_cuda() && buffer.is_cuda(), op,
              "tensors must be on CUDA");
  TORCH_CHECK(input.dim() == 2 && residual.sizes() == input.sizes() && buffer.dim() == 2 && weight.dim() == 1 &&
                  weight.size(0) == input.size(1),
              op, "shapes: input/residual [T, H], weight [H], buffer [R, K*H]");
  const int64_t H = input.size(1);
  TORCH_CHECK(H > 0 && H <= INT32_MAX / 2, op, "hidden size out of range");
  TORCH_CHECK(residual.scalar_type() == input.scalar_type() && weight.scalar_type() == input.scalar_type() &&
                  buffer.scalar_type() == input.scalar_type(),
              op, "all tensors must have one dtype");
  TORCH_CHECK((H == 1 || (input.stride(1) == 1 && residual.stride(1) == 1 && weight.stride(0) == 1)) &&
                  (buffer.size(1) == 1 || buffer.stride(1) == 1),
              op, "last dim must be contiguous");
  TORCH_CHECK(buffer.size(0) >= input.size(0) && slot >= 0 && (slot + 1) * H <= buffer.size(1), op,
              "slot/rows outside the buffer");
  TORCH_CHECK(input.size(0) <= INT32_MAX, op, "too many rows for one launch");
  if (input.size(0) == 0) return;
  const c10::cuda::OptionalCUDAGuard guard(input.device());
  switch (input.scalar_type()) {
    case at::kBFloat16: fused_typed<c10::BFloat16>(input, residual, weight, eps, buffer, slot); break;
    case at::kHalf: fused_typed<c10::Half>(input, residual, weight, eps, buffer, slot); break;
    case at::kFloat: fused_typed<float>(input, residual, weight, eps, buffer, slot); break;
    default: TORCH_CHECK(false, op, "unsupported dtype ", input.scalar_type());
  }
}

}  // namespace eagle3
