// The launch interface between capture.cu (the kernels) and capture_op.cpp (the op's tensor-facing
// half): plain C++, no ATen (see common.h).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace eagle3 {

// The aligned launch: a row of V vectors is cut into ceil(V / kCaptureChunkThreads) chunks, one block
// each (capture.cu's header); the other layouts run one block of <= kCaptureRowThreads per row.
constexpr int kCaptureChunkThreads = 256;
constexpr int kCaptureRowThreads = 256;

inline int capture_chunks_per_row(int vecs_per_row) {
  return (vecs_per_row + kCaptureChunkThreads - 1) / kCaptureChunkThreads;
}

// out[:rows, :H] = hidden (+ residual); element pointers of T, strides in elements. aligned: every row
// of every tensor starts on a 16-byte boundary and holds whole 16-byte vectors.
struct CaptureArgs {
  const void* hidden;
  int64_t hidden_stride;
  const void* residual;  // nullptr: a copy
  int64_t residual_stride;
  void* out;
  int64_t out_stride;
  int64_t rows;  // > 0; the grid (rows, or rows * chunks when aligned) fits int32
  int H;
  bool aligned;
};

// T: c10::BFloat16, c10::Half or float (instantiated in capture.cu). Returns the launch's error.
template <typename T>
cudaError_t launch_capture(const CaptureArgs& args, cudaStream_t stream);

}  // namespace eagle3
