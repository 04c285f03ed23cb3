// Shared device helpers for eagle3_ops kernels: 16-byte vector access, fp32 conversion, warp and
// block sums. Included by the .cu files only (the host helpers are in common.h).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cstdint>

#include "common.h"

namespace eagle3 {

// One 16-byte vector of T: the raw bits or its kVecElems<T> elements.
template <typename T>
struct Vec16 {
  static constexpr int kElems = kVecElems<T>;
  union {
    uint4 raw;
    T elem[kElems];
  };
};

template <typename T>
__device__ __forceinline__ float to_float(T v) { return static_cast<float>(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v) { return static_cast<T>(v); }

// Sum over the 32 lanes of a warp (xor butterfly: every lane gets the same total).
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Sum of v over the block; every thread gets the same total. Every thread of the block must call
// it (it has barriers); it may be called repeatedly (the first barrier keeps a call from
// overwriting the partials the previous call's readers still need). The order of the fp32 sum is
// fixed by the launch shape, so equal inputs give equal bits:
// * kWarps > 0: the block has exactly kWarps warps (known at compile time); each warp's total is
//   stored, then every thread adds the kWarps totals in the order 0, 1, ..., kWarps - 1;
// * kWarps == 0: blockDim.x / 32 warps (blockDim.x a multiple of 32, at most 1024); the warp
//   totals are combined by warp_sum in every warp.
// (Two orders because each kernel's numbers are pinned: draft_fc's prepare kernel uses the first,
// fused_add_rmsnorm_capture the second.)
template <int kWarps = 0>
__device__ __forceinline__ float block_sum(float v) {
  static_assert(kWarps >= 0 && kWarps <= 32, "at most 32 warps per block");
  __shared__ float warp_partials[kWarps > 0 ? kWarps : 32];
  v = warp_sum(v);
  __syncthreads();  // the previous call's readers are done with warp_partials
  if ((threadIdx.x & 31) == 0) warp_partials[threadIdx.x >> 5] = v;
  __syncthreads();
  if constexpr (kWarps > 0) {
    float total = 0.f;
#pragma unroll
    for (int i = 0; i < kWarps; ++i) total += warp_partials[i];
    return total;
  } else {
    const int lane = threadIdx.x & 31;
    return warp_sum(lane < static_cast<int>(blockDim.x >> 5) ? warp_partials[lane] : 0.f);
  }
}

}  // namespace eagle3
