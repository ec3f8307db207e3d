// One decode step of every layer of a stage, shared by the threads of a parallel region:
// decode_layers' path for up to kSmallGemmMaxRows rows on several threads (decode_layer.h),
// and each step of greedy_decode.  CPU float32.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace hybridflow {

// Every matrix product splits the weight rows between the threads (each weight byte is read
// once a step, not once per thread), the norms split the batch rows and the attention the
// (row, KV group) pairs, with a barrier between the stages.  Every value is the same sum as on
// decode_layers' row-block path (the small GEMM's outputs do not depend on the rows or threads
// around them; norms are per row, attention per pair), so both give the same bits.
//
// Built once for a run of steps: the operands are checked by the caller (decode_layer.cpp's
// check_decode_layers), the work space is made here; run() is then called by every thread of
// a parallel region of the size given at construction, with no allocation and no check.
class SharedDecodeStep {
 public:
  // Whether decode_layers takes this path: more than one thread, 1 to kSmallGemmMaxRows rows,
  // the small GEMM on, every matrix with unit inner stride and the biases contiguous.
  static bool applies(int64_t batch, const std::vector<at::Tensor>& layer_weights,
                      const std::vector<at::Tensor>& biases);

  // layer_weights: (input_norm, qkv, o_proj, post_norm, gate_up, down_proj) per layer; biases:
  // one qkv bias per layer (undefined: none); k_cache [layers, B, h_kv, T, D, 64], v_cache
  // [layers, B, h_kv, L, D]; key_mask [B, >= L'] bool for every position run() will see;
  // row_lanes: the small products' form (small_gemm.h); threads: the region's size.
  SharedDecodeStep(int64_t batch, int64_t hidden, const std::vector<at::Tensor>& layer_weights,
                   const std::vector<at::Tensor>& biases, double eps, const at::Tensor& k_cache,
                   const at::Tensor& v_cache, const at::Tensor& key_mask, int64_t q_per_group,
                   bool row_lanes, int threads);

  // On thread t of the region's nt: h [B, H] (contiguous) through every layer, in place, for
  // the new token at position pos, whose RoPE rows of sequence b are at cos + b * cos_stride
  // and sin + b * sin_stride.  Each thread first reads only its own rows of h (rows
  // [t B / nt, (t + 1) B / nt)) and, on return, has passed a barrier after the last write to h.
  void run(int64_t t, int64_t nt, float* h, int64_t pos, const float* cos, const float* sin,
           int64_t cos_stride, int64_t sin_stride) const;

 private:
  int64_t batch_, hidden_, layers_, q_per_group_, n_qkv_, n_attn_, n_gu_, scratch_floats_;
  float eps_;
  bool row_lanes_, mlp_in_lanes_;
  std::vector<at::Tensor> weights_, norms_, biases_;
  at::Tensor k_cache_, v_cache_, key_mask_;
  // work space: the normed rows, the o/down partials of a stacked weight, qkv, the attention
  // output, gate/up and the SwiGLU output (in the row-lane layout where mlp_in_lanes_), and
  // each thread's attention scratch (kv_attention.h)
  at::Tensor xn_, part_, qkv_, attn_, gu_, act_, scratch_;
};

}  // namespace hybridflow
