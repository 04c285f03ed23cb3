// The compiled kernels as torch ops in the namespace eagle3_cuda (torch.ops.eagle3_cuda.*, callable
// from C++ through the dispatcher as well), and the Python module eagle3_ops._C, which carries only
// `compiled_archs`; importing it registers the ops. The public op schemas live in eagle3_ops/registry.py
// (namespace eagle3, registered by eagle3_ops/ops.py); these ops are the `cuda` backend behind them (eagle3_ops/cuda_backend.py decides
// draft_fc's path, splits and workspace).
// Not torch/extension.h (the whole C++ frontend): the registration and a pybind11 module need only these.
#include <pybind11/pybind11.h>
#include <torch/library.h>

#include "ops.h"

// EAGLE3_OPS_ARCHS is a bare list such as sm_90a,sm_120a set by the build; stringize it.
#define EAGLE3_STR_(...) #__VA_ARGS__
#define EAGLE3_STR(...) EAGLE3_STR_(__VA_ARGS__)
#ifndef EAGLE3_OPS_ARCHS
#define EAGLE3_OPS_ARCHS
#endif

TORCH_LIBRARY(eagle3_cuda, m) {
  m.def("capture(Tensor hidden, Tensor? residual, Tensor(a!) buffer, int slot) -> ()");
  m.def(
      "fused_add_rmsnorm_capture(Tensor(a!) input, Tensor(b!) residual, Tensor weight, float eps, Tensor(c!) buffer, "
      "int slot) -> ()");
  // path: 0 skinny, 2 cublas (eagle3_ops.plans.PATHS index); splits: split-K splits per chunk asked for;
  // norm_folded: the weight carries the norm weights (eagle3_ops.fold_norm_weights); block_rows,
  // stages: the skinny block shape (csrc/draft_fc_launch.h kSkinnyShapes; stages 0: the first built).
  m.def(
      "draft_fc(Tensor x, Tensor weight, Tensor? bias, Tensor? rows, Tensor? chunk_norm_weight, "
      "Tensor? input_norm_weight, float eps, Tensor(a!) out, Tensor(b!)? workspace, int path, int splits, "
      "bool norm_folded=False, int block_rows=64, int stages=0) -> ()");
  // No tensor arguments: one catch-all kernel, callable without a GPU.
  m.def(
      "draft_fc_workspace_bytes(int M, int N, int KH, int K, bool chunk_norm, bool input_norm, int path, int splits, "
      "ScalarType dtype, bool norm_folded=False) -> int",
      &eagle3::draft_fc_workspace_bytes);
  // Resident skinny blocks per SM on the current GPU (cudaOccupancyMaxActiveBlocksPerMultiprocessor);
  // no tensor arguments: a catch-all kernel, which raises without a usable GPU.
  m.def("skinny_occupancy(int nt, ScalarType dtype, int block_rows=64, int stages=0) -> int",
        &eagle3::skinny_occupancy);
}

TORCH_LIBRARY_IMPL(eagle3_cuda, CUDA, m) {
  m.impl("capture", &eagle3::capture);
  m.impl("fused_add_rmsnorm_capture", &eagle3::fused_add_rmsnorm_capture);
  m.impl("draft_fc", &eagle3::draft_fc);
}

// Meta (and so FakeTensor / torch.compile tracing): the ops only write into their arguments and
// return nothing, so there is nothing to compute on tensors without data.
namespace {
void capture_meta(const at::Tensor&, const std::optional<at::Tensor>&, at::Tensor&, int64_t) {}
void fused_add_rmsnorm_capture_meta(at::Tensor&, at::Tensor&, const at::Tensor&, double, at::Tensor&, int64_t) {}
void draft_fc_meta(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                   const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                   const std::optional<at::Tensor>&, double, at::Tensor&, const std::optional<at::Tensor>&, int64_t,
                   int64_t, bool, int64_t, int64_t) {}
}  // namespace

TORCH_LIBRARY_IMPL(eagle3_cuda, Meta, m) {
  m.impl("capture", &capture_meta);
  m.impl("fused_add_rmsnorm_capture", &fused_add_rmsnorm_capture_meta);
  m.impl("draft_fc", &draft_fc_meta);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "eagle3_ops compiled CUDA kernels: importing this module registers the torch ops eagle3_cuda::*";
  m.attr("compiled_archs") = EAGLE3_STR(EAGLE3_OPS_ARCHS);
}
