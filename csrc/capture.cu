// capture: buffer[:T, slot*H:(slot+1)*H] = hidden + residual (or hidden); fp32 add, one rounding.
//
// Bytes: reads T*H (2*T*H with residual) and writes T*H elements; no FLOPs to speak of, so the
// floor is (reads + writes) / copy bandwidth (e.g. T=8192, H=7168, bf16, residual: 352 MB).
//
// Two launch shapes:
// * aligned (every pointer 16-byte aligned, H and all row strides multiples of the vector width):
//   one block per (row, row chunk); every thread moves exactly one 16-byte vector (8 bf16/fp16 or
//   4 fp32). A row of V vectors is cut into ceil(V/256) equal chunks of <= 256 threads (a whole
//   number of warps), so H = 4096/5120/7168/8192 bf16 waste <= 32 threads per chunk. Blocks =
//   T * chunks (2-4 chunks per row at H = 4096-8192 bf16): the grid covers the 132 SMs of Hopper
//   and the 188 of Blackwell from T ~ 64-100 rows on and is many waves at prefill sizes; below that
//   the op moves < 2 MB and is bound by launch latency, not bandwidth.
// * any other layout (H not a multiple of the vector width, odd row strides, unaligned views): one
//   block per row; each row gets a scalar head up to the first 16-byte boundary of its buffer row,
//   a vector body, and a scalar tail, when hidden/residual/buffer rows share the same misalignment;
//   otherwise the row is moved element by element (still coalesced).
// The buffer store is a streaming store (st.global.cs): the captured rows are read again only by
// the draft model after the whole target forward, so they should not evict the layer's live data
// from L2. hidden/residual are plain loads (the next layer reads them again right away).
// CUDA-graph safe: no allocation, no host sync, current stream.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "common.cuh"
#include "ops.h"

namespace eagle3 {
namespace {

constexpr int kMaxChunkThreads = 256;
constexpr int kRowThreads = 256;

template <typename T, bool kHasResidual>
__global__ void __launch_bounds__(kMaxChunkThreads)
    capture_aligned_kernel(const T* __restrict__ hidden, int64_t hidden_stride, const T* __restrict__ residual,
                           int64_t residual_stride, T* __restrict__ out, int64_t out_stride, int vecs_per_row,
                           int chunks_per_row) {
  constexpr int VEC = Vec16<T>::kElems;
  const int64_t row = blockIdx.x / chunks_per_row;
  const int chunk = static_cast<int>(blockIdx.x - row * chunks_per_row);
  const int v = chunk * blockDim.x + threadIdx.x;
  if (v >= vecs_per_row) return;
  const int64_t col = static_cast<int64_t>(v) * VEC;
  Vec16<T> hv, ov;
  hv.raw = *reinterpret_cast<const uint4*>(hidden + row * hidden_stride + col);
  if constexpr (kHasResidual) {
    Vec16<T> rv;
    rv.raw = *reinterpret_cast<const uint4*>(residual + row * residual_stride + col);
#pragma unroll
    for (int i = 0; i < VEC; ++i) ov.elem[i] = from_float<T>(to_float(hv.elem[i]) + to_float(rv.elem[i]));
  } else {
    ov.raw = hv.raw;  // a pure copy: same bits, no conversion
  }
  __stcs(reinterpret_cast<uint4*>(out + row * out_stride + col), ov.raw);
}

template <typename T, bool kHasResidual>
__device__ __forceinline__ void capture_scalar(const T* h, const T* r, T* o, int i) {
  if constexpr (!kHasResidual) {  // a pure copy: the same bits as the vector path (NaN payloads too)
    o[i] = h[i];
    return;
  }
  float v = to_float(h[i]);
  if constexpr (kHasResidual) v += to_float(r[i]);
  o[i] = from_float<T>(v);
}

template <typename T, bool kHasResidual>
__global__ void __launch_bounds__(kRowThreads)
    capture_any_kernel(const T* hidden, int64_t hidden_stride, const T* residual, int64_t residual_stride, T* out,
                       int64_t out_stride, int H) {
  constexpr int VEC = Vec16<T>::kElems;
  const int64_t row = blockIdx.x;
  const T* h = hidden + row * hidden_stride;
  const T* r = kHasResidual ? residual + row * residual_stride : nullptr;
  T* o = out + row * out_stride;
  // Vector body only when all rows start at the same offset within a 16-byte line.
  const uintptr_t mis = reinterpret_cast<uintptr_t>(o) & 15u;
  const bool co_aligned = (reinterpret_cast<uintptr_t>(h) & 15u) == mis &&
                          (!kHasResidual || (reinterpret_cast<uintptr_t>(r) & 15u) == mis);
  int head = H, vecs = 0;
  if (co_aligned) {
    head = min(H, static_cast<int>(((16u - mis) & 15u) / sizeof(T)));
    vecs = (H - head) / VEC;
  }
  const int body_end = head + vecs * VEC;
  for (int i = threadIdx.x; i < head; i += blockDim.x) capture_scalar<T, kHasResidual>(h, r, o, i);
  for (int v = threadIdx.x; v < vecs; v += blockDim.x) {
    const int col = head + v * VEC;
    Vec16<T> hv, ov;
    hv.raw = *reinterpret_cast<const uint4*>(h + col);
    if constexpr (kHasResidual) {
      Vec16<T> rv;
      rv.raw = *reinterpret_cast<const uint4*>(r + col);
#pragma unroll
      for (int i = 0; i < VEC; ++i) ov.elem[i] = from_float<T>(to_float(hv.elem[i]) + to_float(rv.elem[i]));
    } else {
      ov.raw = hv.raw;
    }
    __stcs(reinterpret_cast<uint4*>(o + col), ov.raw);
  }
  for (int i = body_end + threadIdx.x; i < H; i += blockDim.x) capture_scalar<T, kHasResidual>(h, r, o, i);
}

template <typename T, bool kHasResidual>
void launch_capture(const T* hidden, int64_t hidden_stride, const T* residual, int64_t residual_stride, T* out,
                    int64_t out_stride, int64_t rows, int H, bool aligned, cudaStream_t stream) {
  constexpr int VEC = Vec16<T>::kElems;
  if (aligned) {
    const int vecs_per_row = H / VEC;
    const int chunks_per_row = (vecs_per_row + kMaxChunkThreads - 1) / kMaxChunkThreads;
    const int per_chunk = (vecs_per_row + chunks_per_row - 1) / chunks_per_row;
    const int threads = (per_chunk + 31) / 32 * 32;
    const int64_t blocks = rows * chunks_per_row;
    TORCH_CHECK(blocks <= INT32_MAX, "eagle3_cuda::capture: too many rows for one launch");
    capture_aligned_kernel<T, kHasResidual><<<static_cast<unsigned>(blocks), threads, 0, stream>>>(
        hidden, hidden_stride, residual, residual_stride, out, out_stride, vecs_per_row, chunks_per_row);
  } else {
    TORCH_CHECK(rows <= INT32_MAX, "eagle3_cuda::capture: too many rows for one launch");
    const int threads = std::min(kRowThreads, (H + 31) / 32 * 32);
    capture_any_kernel<T, kHasResidual><<<static_cast<unsigned>(rows), threads, 0, stream>>>(
        hidden, hidden_stride, residual, residual_stride, out, out_stride, H);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T>
void capture_typed(const at::Tensor& hidden, const std::optional<at::Tensor>& residual, at::Tensor& buffer,
                   int64_t slot) {
  constexpr int VEC = Vec16<T>::kElems;
  const int64_t rows = hidden.size(0);
  const int H = static_cast<int>(hidden.size(1));
  const T* h = reinterpret_cast<const T*>(hidden.data_ptr());
  T* out = reinterpret_cast<T*>(buffer.data_ptr()) + slot * H;
  const T* r = residual.has_value() ? reinterpret_cast<const T*>(residual->data_ptr()) : nullptr;
  const int64_t r_stride = residual.has_value() ? residual->stride(0) : 0;
  // Aligned launch: every row of every tensor starts on a 16-byte boundary and holds whole vectors.
  const bool aligned = H % VEC == 0 && hidden.stride(0) % VEC == 0 && buffer.stride(0) % VEC == 0 &&
                       is_aligned16(h) && is_aligned16(out) &&
                       (r == nullptr || (r_stride % VEC == 0 && is_aligned16(r)));
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (r != nullptr) {
    launch_capture<T, true>(h, hidden.stride(0), r, r_stride, out, buffer.stride(0), rows, H, aligned, stream);
  } else {
    launch_capture<T, false>(h, hidden.stride(0), nullptr, 0, out, buffer.stride(0), rows, H, aligned, stream);
  }
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
