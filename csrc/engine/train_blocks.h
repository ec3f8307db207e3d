// Training-side blocks of one Llama layer with hand-written backward passes (see
// train_blocks.cpp for the maths, shapes and what each forward saves).
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>
#include <vector>

namespace hybridflow {

// y = weight * x / rms(x) over the last dim of x [N, H]; returns (y, rstd [N]).
std::tuple<at::Tensor, at::Tensor> rms_norm_forward(const at::Tensor& x,
                                                    const at::Tensor& weight, double eps);

// Gradients (dx [N, H], dweight [H]) of rms_norm_forward from dy [N, H].
std::tuple<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& dy, const at::Tensor& x,
                                                     const at::Tensor& weight,
                                                     const at::Tensor& rstd);

// Attention between the TP collectives: qkv projection, RoPE, causal (masked) attention,
// o projection.  a [B, S, H] (normalised input), mask bool [B, 1, S, S] (True = attend) or
// none for plain causal.  Returns {y [B, S, H] (this rank's partial), then the tensors
// attention_backward needs: q, k, v (RoPE applied, heads first), probs, attn}.
std::vector<at::Tensor> attention_forward(const at::Tensor& a, const at::Tensor& qkv_weight,
                                          const at::Tensor& o_weight, const at::Tensor& cos,
                                          const at::Tensor& sin,
                                          const std::optional<at::Tensor>& mask,
                                          int64_t q_per_group);

// {da, dqkv_weight, do_weight} of attention_forward from dy [B, S, H] and its saved tensors.
std::vector<at::Tensor> attention_backward(const at::Tensor& dy, const at::Tensor& a,
                                           const at::Tensor& qkv_weight,
                                           const at::Tensor& o_weight, const at::Tensor& cos,
                                           const at::Tensor& sin,
                                           const std::vector<at::Tensor>& saved);

// SwiGLU between the TP collectives: gate_up projection (rows interleaved), silu(gate) * up,
// down projection.  b [B, S, H].  Returns {z [B, S, H] (partial), gate_up, sigmoid(gate), act}.
std::vector<at::Tensor> mlp_forward(const at::Tensor& b, const at::Tensor& gate_up_weight,
                                    const at::Tensor& down_weight);

// {db, dgate_up_weight, ddown_weight} of mlp_forward from dz [B, S, H] and its saved tensors.
std::vector<at::Tensor> mlp_backward(const at::Tensor& dz, const at::Tensor& b,
                                     const at::Tensor& gate_up_weight,
                                     const at::Tensor& down_weight, const at::Tensor& gate_up,
                                     const at::Tensor& sig, const at::Tensor& act);

}  // namespace hybridflow
