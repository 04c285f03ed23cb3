// The op's contract is eagle3_ops/validation.py (checked before this is called); the TORCH_CHECKs here only
// keep a direct call of eagle3_cuda::capture from touching memory it must not.
// eagle3_cuda::capture, the tensor-facing half: memory-safety checks, device guard, stream and dtype
// dispatch; the kernels and their launch shapes are in capture.cu.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <climits>

#include "capture_launch.h"
#include "common.h"
#include "ops.h"

namespace eagle3 {
namespace {

template <typename T>
void capture_typed(const at::Tensor& hidden, const std::optional<at::Tensor>& residual, at::Tensor& buffer,
                   int64_t slot) {
  constexpr int VEC = kVecElems<T>;
  const int H = static_cast<int>(hidden.size(1));
  CaptureArgs a{};
  a.hidden = hidden.data_ptr();
  a.hidden_stride = hidden.stride(0);
  a.residual = residual.has_value() ? residual->data_ptr() : nullptr;
  a.residual_stride = residual.has_value() ? residual->stride(0) : 0;
  a.out = static_cast<T*>(buffer.data_ptr()) + slot * H;
  a.out_stride = buffer.stride(0);
  a.rows = hidden.size(0);
  a.H = H;
  // Aligned launch: every row of every tensor starts on a 16-byte boundary and holds whole vectors.
  a.aligned = H % VEC == 0 && a.hidden_stride % VEC == 0 && a.out_stride % VEC == 0 && is_aligned16(a.hidden) &&
              is_aligned16(a.out) && (a.residual == nullptr || (a.residual_stride % VEC == 0 && is_aligned16(a.residual)));
  const int64_t blocks = a.aligned ? a.rows * capture_chunks_per_row(H / VEC) : a.rows;
  TORCH_CHECK(blocks <= INT32_MAX, "eagle3_cuda::capture: too many rows for one launch");
  C10_CUDA_CHECK(launch_capture<T>(a, c10::cuda::getCurrentCUDAStream()));
}

}  // namespace

void capture(const at::Tensor& hidden, const std::optional<at::Tensor>& residual, at::Tensor& buffer,
             int64_t slot) {
  TORCH_CHECK(hidden.is_cuda() && buffer.is_cuda(), "eagle3_cuda::capture: tensors must be on CUDA");
  TORCH_CHECK(hidden.dim() == 2 && buffer.dim() == 2, "eagle3_cuda::capture: hidden and buffer must be 2-D");
  const int64_t H = hidden.size(1);
  TORCH_CHECK(H > 0 && H <= INT32_MAX / 2, "eagle3_cuda::capture: hidden size out of range");
  TORCH_CHECK((H == 1 || hidden.stride(1) == 1) && (buffer.size(1) == 1 || buffer.stride(1) == 1),
              "eagle3_cuda::capture: last dim must be contiguous");
  TORCH_CHECK(!residual.has_value() || (residual->is_cuda() && residual->sizes() == hidden.sizes() &&
                                        (H == 1 || residual->stride(1) == 1) &&
                                        residual->scalar_type() == hidden.scalar_type()),
              "eagle3_cuda::capture: residual must be CUDA, same shape and dtype as hidden, last dim contiguous");
  TORCH_CHECK(buffer.scalar_type() == hidden.scalar_type(), "eagle3_cuda::capture: buffer dtype differs");
  TORCH_CHECK(buffer.size(0) >= hidden.size(0) && (slot + 1) * H <= buffer.size(1) && slot >= 0,
              "eagle3_cuda::capture: slot/rows outside the buffer");
  if (hidden.size(0) == 0) return;
  const c10::cuda::OptionalCUDAGuard guard(hidden.device());
  switch (hidden.scalar_type()) {
    case at::kBFloat16: capture_typed<c10::BFloat16>(hidden, residual, buffer, slot); break;
    case at::kHalf: capture_typed<c10::Half>(hidden, residual, buffer, slot); break;
    case at::kFloat: capture_typed<float>(hidden, residual, buffer, slot); break;
    default: TORCH_CHECK(false, "eagle3_cuda::capture: unsupported dtype ", hidden.scalar_type());
  }
}

}  // namespace eagle3
