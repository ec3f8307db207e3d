// a @ b on oneDNN's matmul primitive (through ATen's at::native::mkldnn_matmul), float32 CPU,
// with either operand a transposed view: no transposed copy (engine/onednn.py).
#pragma once

#include <ATen/ATen.h>

namespace hybridflow {

// out [n, m] = a [n, k] @ b [k, m] (out += ... when accumulate), or batched: out [g, n, m] =
// a [g, n, k] @ b [g, k, m].  a and b may each be row-major or the transpose (of the last two
// dims) of a row-major tensor: oneDNN reads both layouts in place, so the weight gradient
// x.T @ dy needs no transposed copy of the activations.  Any other strides are copied to
// row-major first.  out must be row-major.
void onednn_mm_out(const at::Tensor& a, const at::Tensor& b, at::Tensor& out, bool accumulate);

}  // namespace hybridflow
