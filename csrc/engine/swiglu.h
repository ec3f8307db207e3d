// SwiGLU of the interleaved gate/up layout, forward and backward, CPU float32 (engine/layers.py
// runs it for float32 CPU tensors; see swiglu.cpp).
#pragma once

#include <ATen/ATen.h>

namespace hybridflow {

// y [..., F] = silu(gate) * up of gu [..., F, 2] (gate, up interleaved).
at::Tensor swiglu_forward(const at::Tensor& gu);

// The same values for `rows` rows of `pairs` interleaved pairs each on raw rows (leading
// dimensions ld_gu, ld_y in floats): y[r, :pairs] = silu(gate) * up of gu[r, :2 * pairs].
// Inside a parallel region it runs on the calling thread (decode_layer.cpp).
void swiglu_forward_rows(const float* gu, int64_t ld_gu, float* y, int64_t ld_y, int64_t rows,
                         int64_t pairs);

// swiglu_forward of the pairs [f0, f1) with the batch's rows in the lanes (the small GEMM's
// row-lane layout, small_gemm.h): gu [R, 2F] held as gu_t [2F, ld] (gu_t[j * ld + r] =
// gu[r, j]; ld a multiple of 16), the output y [R, F] as y_t [F, ld].  Every value rounds as
// in swiglu_forward_rows.
void swiglu_forward_lanes(const float* gu_t, float* y_t, int64_t ld, int64_t f0, int64_t f1);

// The gradient [..., F, 2] (interleaved like gu) of swiglu_forward at gu for dy [..., F]:
// d gate = dy * up * s * (1 + gate * (1 - s)), d up = dy * gate * s, s = sigmoid(gate).
at::Tensor swiglu_backward(const at::Tensor& gu, const at::Tensor& dy);

}  // namespace hybridflow
