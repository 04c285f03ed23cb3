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
//
// This file holds the kernels and their launch (no ATen: see common.h); capture_op.cpp the op's
// tensor-facing half (checks, device guard, stream, dtype dispatch).
#include <algorithm>

#include "capture_launch.h"
#include "common.cuh"

namespace eagle3 {
namespace {

template <typename T, bool kHasResidual>
__global__ void __launch_bounds__(kCaptureChunkThreads)
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
__global__ void __launch_bounds__(kCaptureRowThreads)
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

}  // namespace

template <typename T>
cudaError_t launch_capture(const CaptureArgs& a, cudaStream_t stream) {
  const T* hidden = static_cast<const T*>(a.hidden);
  const T* residual = static_cast<const T*>(a.residual);
  T* out = static_cast<T*>(a.out);
  const int H = a.H;
  if (a.aligned) {
    const int vecs_per_row = H / kVecElems<T>;
    const int chunks_per_row = capture_chunks_per_row(vecs_per_row);
    const int per_chunk = (vecs_per_row + chunks_per_row - 1) / chunks_per_row;
    const int threads = (per_chunk + 31) / 32 * 32;
    const auto blocks = static_cast<unsigned>(a.rows * chunks_per_row);
    if (residual != nullptr) {
      capture_aligned_kernel<T, true><<<blocks, threads, 0, stream>>>(hidden, a.hidden_stride, residual, a.residual_stride,
                                                                      out, a.out_stride, vecs_per_row, chunks_per_row);
    } else {
      capture_aligned_kernel<T, false><<<blocks, threads, 0, stream>>>(hidden, a.hidden_stride, nullptr, 0, out,
                                                                       a.out_stride, vecs_per_row, chunks_per_row);
    }
  } else {
    const int threads = std::min(kCaptureRowThreads, (H + 31) / 32 * 32);
    const auto blocks = static_cast<unsigned>(a.rows);
    if (residual != nullptr) {
      capture_any_kernel<T, true><<<blocks, threads, 0, stream>>>(hidden, a.hidden_stride, residual, a.residual_stride,
                                                                  out, a.out_stride, H);
    } else {
      capture_any_kernel<T, false><<<blocks, threads, 0, stream>>>(hidden, a.hidden_stride, nullptr, 0, out,
                                                                   a.out_stride, H);
    }
  }
  return cudaGetLastError();
}

template cudaError_t launch_capture<c10::BFloat16>(const CaptureArgs&, cudaStream_t);
template cudaError_t launch_capture<c10::Half>(const CaptureArgs&, cudaStream_t);
template cudaError_t launch_capture<float>(const CaptureArgs&, cudaStream_t);

}  // namespace eagle3
