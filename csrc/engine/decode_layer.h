// Decode-step halves of one Llama layer (see decode_layer.cpp for the maths and shapes).
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <vector>

namespace hybridflow {

// Attention half: rms_norm, qkv (+ the optional qkv_bias [h_kv*(Q/G+2)*D], before RoPE), RoPE,
// write k/v at position pos of this layer's cache, attention over positions [0, pos],
// o projection.  Returns this rank's partial [B, H].
at::Tensor decode_attention(const at::Tensor& x, const at::Tensor& norm_weight, double eps,
                            const at::Tensor& qkv_weight, const at::Tensor& o_weight,
                            const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                            at::Tensor& v_cache, int64_t pos, const at::Tensor& key_mask,
                            int64_t q_per_group, const std::optional<at::Tensor>& qkv_bias);

// MLP half: rms_norm, gate_up, silu(gate) * up, down.  Returns this rank's partial [B, H].
at::Tensor decode_mlp(const at::Tensor& x, const at::Tensor& norm_weight, double eps,
                      const at::Tensor& gate_up_weight, const at::Tensor& down_weight);

// Every layer of a generation stage for one new token per row, when no TP all-reduce is needed
// between the halves (tp_g == 1): layer_weights holds (input_norm, qkv, o_proj, post_norm,
// gate_up, down_proj) per layer; qkv_biases is empty (no biases) or one optional qkv bias per
// layer (Qwen2, see decode_attention); k_cache [layers, B, h_kv, T, D, 64] (keys transposed in
// tiles of 64 positions, T * 64 >= L: engine/kv_cache.py), v_cache [layers, B, h_kv, L, D].
// Up to kSmallGemmMaxRows rows on several intra-op threads, the threads share the step in one
// parallel region (each product split by weight rows, norms by batch rows, attention by
// (row, KV group) pairs, a barrier between stages); above it each thread takes its block of
// rows through all layers with no synchronisation.  Both give the same bits.  row_lanes picks
// the small products' form (small_gemm.h): one form for a whole generation.  Returns the
// hidden states [B, H] after the last layer.
at::Tensor decode_layers(const at::Tensor& x, const std::vector<at::Tensor>& layer_weights,
                         double eps, const at::Tensor& cos, const at::Tensor& sin,
                         at::Tensor& k_cache, at::Tensor& v_cache, int64_t pos,
                         const at::Tensor& key_mask, int64_t q_per_group,
                         const std::vector<std::optional<at::Tensor>>& qkv_biases,
                         bool row_lanes);

// decode_layers' operand checks (TORCH_CHECK) for the new token at position pos, cos/sin
// [B, D] its RoPE rows; returns the qkv biases, one per layer (undefined: none).
std::vector<at::Tensor> check_decode_layers(
    const at::Tensor& x, const std::vector<at::Tensor>& layer_weights, const at::Tensor& cos,
    const at::Tensor& sin, const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t pos,
    const at::Tensor& key_mask, int64_t q_per_group,
    const std::vector<std::optional<at::Tensor>>& qkv_biases);

}  // namespace hybridflow
