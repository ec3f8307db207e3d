// Greedy decode steps of a batch whose rows all run to the end, with no Python between them.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>
#include <vector>

namespace hybridflow {

// `steps` decode steps after the prefill, each the calls the generation loop makes for one
// token (engine/generation.py): the embedding rows of the last tokens -> decode_layers at
// position start_pos + s -> greedy_head with banned[s] -> the next tokens.  The tokens, log
// probabilities and cache contents are the loop's bits (the same kernels on the same
// operands); what it saves is the Python of each step (the loop's bookkeeping, two calls
// into the extension, the views of the tables).  Where decode_layers would share its step
// between the threads, every step runs in one parallel region (SharedDecodeStep and
// GreedyHeadStep, built once: the checks, views and buffers are made once per call, not once
// per step, and there is one fork/join per call); otherwise each step calls decode_layers and
// greedy_head.
//   first_tokens [B] (int64): the tokens the prefill chose;
//   embed [V, H]: the input embedding (rows looked up, no product);
//   layer_weights, eps, k_cache, v_cache, q_per_group, qkv_biases, row_lanes: as
//     decode_layers (decode_layer.h);
//   cos, sin [B, P + N, D]: the RoPE tables of every position; key_mask [B, P + N] (bool);
//   norm_weight, norm_eps, head [V, H]: as greedy_head (greedy_head.h);
//   banned: one column (or -1) per step.
// Returns tokens [B, steps] (int64) and log_probs [B, steps] (float32).
std::tuple<at::Tensor, at::Tensor> greedy_decode(
    const at::Tensor& first_tokens, int64_t steps, const at::Tensor& embed,
    const std::vector<at::Tensor>& layer_weights, double eps, const at::Tensor& cos,
    const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache, int64_t start_pos,
    const at::Tensor& key_mask, int64_t q_per_group,
    const std::vector<std::optional<at::Tensor>>& qkv_biases, const at::Tensor& norm_weight,
    double norm_eps, const at::Tensor& head, const std::vector<int64_t>& banned,
    bool row_lanes);

}  // namespace hybridflow
