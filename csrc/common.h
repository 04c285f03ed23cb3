// Helpers shared by the kernels (.cu) and the ops' tensor-facing halves (*_op.cpp): plain C++, so that
// the .cpp files, which parse ATen once with the host compiler, and the .cu files, which never see ATen
// (nvcc parses a .cu once per target arch and once for the host), can both include it.
#pragma once

#include <cstdint>

namespace eagle3 {

// Elements of T in one 16-byte vector: 8 for bf16/fp16, 4 for fp32.
template <typename T>
constexpr int kVecElems = static_cast<int>(16 / sizeof(T));

inline bool is_aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace eagle3
