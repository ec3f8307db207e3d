// Decode-step halves of one Llama layer (see decode_layer.cpp for the maths and shapes).
#pragma once

#include <ATen/ATen.h>

namespace hybridflow {

// Attention half: rms_norm, qkv, RoPE, write k/v at position pos of this layer's cache,
// attention over positions [0, pos], o projection.  Returns this rank's partial [B, H].
at::Tensor decode_attention(const at::Tensor& x, const at::Tensor& norm_weight, double eps,
                            const at::Tensor& qkv_weight, const at::Tensor& o_weight,
                            const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                            at::Tensor& v_cache, int64_t pos, const at::Tensor& key_mask,
                            int64_t q_per_group);

// MLP half: rms_norm, gate_up, silu(gate) * up, down.  Returns this rank's partial [B, H].
at::Tensor decode_mlp(const at::Tensor& x, const at::Tensor& norm_weight, double eps,
                      const at::Tensor& gate_up_weight, const at::Tensor& down_weight);

}  // namespace hybridflow
