// RMSNorm over the last dim, forward and hand-written backward, CPU float32 (engine/layers.py
// runs it for float32 CPU tensors; see rms_norm.cpp).
#pragma once

#include <ATen/ATen.h>

#include <tuple>

namespace hybridflow {

// y = weight * x / rms(x) over the last dim of x [N, H]; returns (y, rstd [N]).
std::tuple<at::Tensor, at::Tensor> rms_norm_forward(const at::Tensor& x,
                                                    const at::Tensor& weight, double eps);

// Gradients (dx [N, H], dweight [H]) of rms_norm_forward from dy [N, H].
std::tuple<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& dy, const at::Tensor& x,
                                                     const at::Tensor& weight,
                                                     const at::Tensor& rstd);

}  // namespace hybridflow
