// SwiGLU of the interleaved gate/up layout, forward and backward, CPU float32 (engine/layers.py
// runs it for float32 CPU tensors; see swiglu.cpp).
#pragma once

#include <ATen/ATen.h>

namespace hybridflow {

// y [..., F] = silu(gate) * up of gu [..., F, 2] (gate, up interleaved).
at::Tensor swiglu_forward(const at::Tensor& gu);

// The gradient [..., F, 2] (interleaved like gu) of swiglu_forward at gu for dy [..., F]:
// d gate = dy * up * s * (1 + gate * (1 - s)), d up = dy * gate * s, s = sigmoid(gate).
at::Tensor swiglu_backward(const at::Tensor& gu, const at::Tensor& dy);

}  // namespace hybridflow
