// Shared device helpers for eagle3_ops kernels: 16-byte vector access and fp32 conversion.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cstdint>

namespace eagle3 {

// Elements of T in one 16-byte vector: 8 for bf16/fp16, 4 for fp32.
template <typename T>
struct Vec16 {
  static constexpr int kElems = 16 / sizeof(T);
  union {
    uint4 raw;
    T elem[kElems];
  };
};

template <typename T>
__device__ __forceinline__ float to_float(T v) { return static_cast<float>(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v) { return static_cast<T>(v); }

inline bool is_aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace eagle3
