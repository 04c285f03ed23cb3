// Python bindings of the compiled kernels (module eagle3_ops._C). The public op schemas live in
// eagle3_ops/ops.py (namespace eagle3); these functions are the `cuda` backend behind them.
#include <torch/extension.h>

#include "ops.h"

// EAGLE3_OPS_ARCHS is a bare list such as sm_90a,sm_120a set by the build; stringize it.
#define EAGLE3_STR_(...) #__VA_ARGS__
#define EAGLE3_STR(...) EAGLE3_STR_(__VA_ARGS__)
#ifndef EAGLE3_OPS_ARCHS
#define EAGLE3_OPS_ARCHS
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "eagle3_ops compiled CUDA kernels";
  m.attr("compiled_archs") = EAGLE3_STR(EAGLE3_OPS_ARCHS);
  m.def("capture", &eagle3::capture, "buffer[:T, slot] = hidden (+ residual)", py::arg("hidden"),
        py::arg("residual"), py::arg("buffer"), py::arg("slot"));
  m.def("fused_add_rmsnorm_capture", &eagle3::fused_add_rmsnorm_capture,
        "fused_add_rmsnorm(input, residual, weight, eps) + buffer[:T, slot] = new residual", py::arg("input"),
        py::arg("residual"), py::arg("weight"), py::arg("eps"), py::arg("buffer"), py::arg("slot"));
  m.def("draft_fc_out", &eagle3::draft_fc_out, "out = linear(norm(x[rows]), weight, bias)", py::arg("x"),
        py::arg("weight"), py::arg("bias"), py::arg("rows"), py::arg("chunk_norm_weight"),
        py::arg("input_norm_weight"), py::arg("eps"), py::arg("out"));
}
