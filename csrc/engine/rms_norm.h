// RMSNorm over the last dim, forward and hand-written backward, CPU float32 (engine/layers.py
// runs it for float32 CPU tensors; see rms_norm.cpp).
#pragma once

#include <ATen/ATen.h>

#include <tuple>

namespace hybridflow {

// y = weight * x / rms(x) of `rows` rows of H floats on the calling thread; rstd [rows]
// (1 / rms of each row) is written where not null.
void rms_norm_rows(const float* x, const float* weight, int64_t rows, int64_t H, float eps,
                   float* y, float* rstd);

// y = weight * x / rms(x) over the last dim of x [N, H]; returns (y, rstd [N]).
std::tuple<at::Tensor, at::Tensor> rms_norm_forward(const at::Tensor& x,
                                                    const at::Tensor& weight, double eps);

// Gradients (dx [N, H], dweight [H]) of rms_norm_forward from dy [N, H].
std::tuple<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& dy, const at::Tensor& x,
                                                     const at::Tensor& weight,
                                                     const at::Tensor& rstd);

}  // namespace hybridflow
