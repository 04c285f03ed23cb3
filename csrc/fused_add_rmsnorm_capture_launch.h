// The launch interface between fused_add_rmsnorm_capture.cu (the kernels) and
// fused_add_rmsnorm_capture_op.cpp (the op's tensor-facing half): plain C++, no ATen (see common.h).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace eagle3 {

// One launch: rows of input/residual [rows, H] (strides in elements), weight [H], out = the buffer
// slot's first element. vectorizable: every row of every tensor starts on a 16-byte boundary and
// holds whole 16-byte vectors (else the scalar kernels run).
struct FusedArgs {
  void* input;
  int64_t input_stride;
  void* residual;
  int64_t residual_stride;
  const void* weight;
  void* out;
  int64_t out_stride;
  int64_t rows;  // 1 .. INT32_MAX
  int H;
  float eps;
  bool vectorizable;
};

// T: c10::BFloat16, c10::Half or float (instantiated in fused_add_rmsnorm_capture.cu). Returns the
// launch's error.
template <typename T>
cudaError_t launch_fused_add_rmsnorm_capture(const FusedArgs& args, cudaStream_t stream);

}  // namespace eagle3
