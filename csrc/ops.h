// Host entry points of the compiled eagle3 kernels. Arguments are validated in Python
// (eagle3_ops/validation.py) before these are called; the TORCH_CHECKs here only guard the
// assumptions each kernel makes about its launch.
#pragma once

#include <ATen/ATen.h>
#include <optional>

namespace eagle3 {

// buffer[:T, slot*H:(slot+1)*H] = hidden (+ residual), fp32 add, one rounding.
void capture(const at::Tensor& hidden, const std::optional<at::Tensor>& residual,
             at::Tensor& buffer, int64_t slot);

// SGLang fused_add_rmsnorm (residual <- input + residual in its dtype; input <- rmsnorm of the
// unrounded fp32 sum * weight) that also writes the new residual into buffer slot `slot`.
void fused_add_rmsnorm_capture(at::Tensor& input, at::Tensor& residual, const at::Tensor& weight,
                               double eps, at::Tensor& buffer, int64_t slot);

// out[M, N] = linear(norm(x[rows]), weight, bias): input norm over the K*H row, then one RMSNorm
// per H-wide chunk, fp32 accumulation, one rounding; rows outside [0, R) give NaN rows.
void draft_fc_out(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                  const std::optional<at::Tensor>& rows, const std::optional<at::Tensor>& chunk_norm_weight,
                  const std::optional<at::Tensor>& input_norm_weight, double eps, at::Tensor& out);

}  // namespace eagle3
