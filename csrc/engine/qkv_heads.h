// The attention inputs of a training layer from its fused q/k/v projection, CPU float32
// (engine/batched_attention.py runs it): bias, RoPE, the query scale and the grouped layout
// of the batched attention products in one pass, and the gradient back in one pass.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

namespace hybridflow {

// qkv [B, S, h_kv * (qpg + 2) * D] (per KV group: qpg query heads, a key, a value) plus the
// optional bias [h_kv * (qpg + 2) * D]; cos, sin [B, S, D].  Returns
//   q [B * h_kv, qpg * S, D]   rope(q + b_q) * scale, the group's query heads stacked on rows
//   k [B * h_kv, S, D]         rope(k + b_k)
//   v [B * h_kv, S, D]         v + b_v
// rounding like engine/layers.py: the bias add, x * cos, rotate_half(x) * sin, their sum and
// the scale are separate float operations.
std::tuple<at::Tensor, at::Tensor, at::Tensor> qkv_heads_forward(
    const at::Tensor& qkv, const std::optional<at::Tensor>& bias, const at::Tensor& cos,
    const at::Tensor& sin, int64_t q_per_group, double scale);

// The gradient [B, S, h_kv * (qpg + 2) * D] of qkv_heads_forward's input from the gradients of
// its three outputs (the bias gradient is its sum over B and S).
at::Tensor qkv_heads_backward(const at::Tensor& grad_q, const at::Tensor& grad_k,
                              const at::Tensor& grad_v, const at::Tensor& cos,
                              const at::Tensor& sin, int64_t q_per_group, double scale);

}  // namespace hybridflow
