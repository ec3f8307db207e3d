// Pieces of the engine's kernels: the float32 CPU argument check, the largest head dim and
// RoPE of one head's row (decode_layer.cpp, qkv_heads.cpp).
#pragma once

#include <ATen/ATen.h>

namespace hybridflow {

// Largest head dim the kernels take (a head's row lives in a stack buffer).
constexpr int64_t kMaxHeadDim = 512;

// TORCH_CHECK (a RuntimeError in Python) that t is a float32 CPU tensor (and contiguous when
// asked); `where` names the kernel family in the message.
inline void check_float_cpu(const at::Tensor& t, const char* where, const char* name,
                            bool contiguous = false) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat &&
                  (!contiguous || t.is_contiguous()),
              where, ": ", name, " must be a ", contiguous ? "contiguous " : "",
              "float32 CPU tensor, got ", t.toString(), " of shape ", t.sizes());
}

// out = x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1), for one head's row of
// head_dim values (half-split convention of transformers' Llama).  The product and the sum
// are separate roundings (the extension is compiled with -ffp-contract=off), like ATen's
// separate multiplies and add in engine/layers.py.
// The two halves are separate loops (each vectorises; one loop with the choice of rotated
// element in it did not).  out must not overlap x.
inline void rope_row(const float* __restrict__ x, const float* __restrict__ cos,
                     const float* __restrict__ sin, int64_t head_dim, float* __restrict__ out) {
  const int64_t half = head_dim / 2;
  for (int64_t d = 0; d < half; ++d) out[d] = x[d] * cos[d] + (-x[d + half]) * sin[d];
  for (int64_t d = half; d < head_dim; ++d) out[d] = x[d] * cos[d] + x[d - half] * sin[d];
}

}  // namespace hybridflow
