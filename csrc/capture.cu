// capture: buffer[:T, slot*H:(slot+1)*H] = hidden + residual (or hidden).
//
// Bytes: reads T*H (or 2*T*H with residual) and writes T*H elements; no FLOPs to speak of, so the
// floor is (reads + writes) / copy bandwidth. Launch: one 256-thread block per (row, 256-vector
// chunk of the row); every thread moves one 16-byte vector (8 bf16/fp16 or 4 fp32 elements) when
// all pointers, H and the row strides allow it, else one element (scalar tail for odd shapes).
// Blocks = T * ceil(H / (256*VEC)) covers H200 (132 SMs) and sm_120 (170-188 SMs) from a few rows on.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "common.cuh"
#include "ops.h"

namespace eagle3 {
namespace {

constexpr int kThreads = 256;

template <typename T, int VEC, bool kHasResidual>
__global__ void capture_kernel(const T* __restrict__ hidden, int64_t hidden_stride,
                               const T* __restrict__ residual, int64_t residual_stride,
                               T* __restrict__ out, int64_t out_stride, int H, int chunks_per_row) {
  const int64_t row = blockIdx.x / chunks_per_row;
  const int chunk = blockIdx.x - row * chunks_per_row;
  const int col = (chunk * kThreads + threadIdx.x) * VEC;
  if (col >= H) return;
  const T* h = hidden + row * hidden_stride + col;
  T* o = out + row * out_stride + col;
  if constexpr (VEC > 1) {
    Vec16<T> hv, rv, ov;
    hv.raw = *reinterpret_cast<const uint4*>(h);
    if constexpr (kHasResidual) rv.raw = *reinterpret_cast<const uint4*>(residual + row * residual_stride + col);
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      float v = to_float(hv.elem[i]);
      if constexpr (kHasResidual) v += to_float(rv.elem[i]);
      ov.elem[i] = from_float<T>(v);
    }
    *reinterpret_cast<uint4*>(o) = ov.raw;
  } else {
    float v = to_float(*h);
    if constexpr (kHasResidual) v += to_float(residual[row * residual_stride + col]);
    *o = from_float<T>(v);
  }
}

template <typename T, int VEC>
void launch_capture(const at::Tensor& hidden, const std::optional<at::Tensor>& residual, T* out,
                    int64_t out_stride, int64_t T_rows, int H, cudaStream_t stream) {
  const int chunks_per_row = (H + kThreads * VEC - 1) / (kThreads * VEC);
  const int64_t blocks = T_rows * chunks_per_row;
  TORCH_CHECK(blocks <= INT32_MAX, "eagle3::capture: too many rows for one launch");
  const T* h = reinterpret_cast<const T*>(hidden.data_ptr());
  if (residual.has_value()) {
    capture_kernel<T, VEC, true><<<blocks, kThreads, 0, stream>>>(
        h, hidden.stride(0), reinterpret_cast<const T*>(residual->data_ptr()), residual->stride(0), out,
        out_stride, H, chunks_per_row);
  } else {
    capture_kernel<T, VEC, false><<<blocks, kThreads, 0, stream>>>(h, hidden.stride(0), nullptr, 0, out,
                                                                   out_stride, H, chunks_per_row);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T>
void capture_typed(const at::Tensor& hidden, const std::optional<at::Tensor>& residual, at::Tensor& buffer,
                   int64_t slot) {
  constexpr int VEC = Vec16<T>::kElems;
  const int64_t T_rows = hidden.size(0);
  const int H = static_cast<int>(hidden.size(1));
  T* out = reinterpret_cast<T*>(buffer.data_ptr()) + slot * H;
  const bool vectorizable = H % VEC == 0 && hidden.stride(0) % VEC == 0 && buffer.stride(0) % VEC == 0 &&
                            is_aligned16(hidden.data_ptr()) && is_aligned16(out) &&
                            (!residual.has_value() ||
                             (residual->stride(0) % VEC == 0 && is_aligned16(residual->data_ptr())));
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  if (vectorizable) {
    launch_capture<T, VEC>(hidden, residual, out, buffer.stride(0), T_rows, H, stream);
  } else {
    launch_capture<T, 1>(hidden, residual, out, buffer.stride(0), T_rows, H, stream);
  }
}

}  // namespace

void capture(const at::Tensor& hidden, const std::optional<at::Tensor>& residual, at::Tensor& buffer,
             int64_t slot) {
  TORCH_CHECK(hidden.is_cuda() && buffer.is_cuda(), "eagle3::capture (cuda): tensors must be on CUDA");
  TORCH_CHECK(hidden.stride(1) == 1 && buffer.stride(1) == 1, "eagle3::capture (cuda): last dim must be contiguous");
  if (hidden.size(0) == 0) return;
  const at::cuda::OptionalCUDAGuard guard(hidden.device());
  switch (hidden.scalar_type()) {
    case at::kBFloat16: capture_typed<c10::BFloat16>(hidden, residual, buffer, slot); break;
    case at::kHalf: capture_typed<c10::Half>(hidden, residual, buffer, slot); break;
    case at::kFloat: capture_typed<float>(hidden, residual, buffer, slot); break;
    default: TORCH_CHECK(false, "eagle3::capture (cuda): unsupported dtype ", hidden.scalar_type());
  }
}

}  // namespace eagle3
