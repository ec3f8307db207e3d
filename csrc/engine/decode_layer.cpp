// Llama decoder layers for a single new token per sequence (the decode step of generation),
// CPU float32.  decode_layers runs every layer of a stage in one call (no TP: nothing to
// all-reduce in between); with TP, decode_attention and decode_mlp are the two halves of a
// layer around the caller's all-reduces.  Either way Python makes one or two calls per step or
// layer instead of about thirty tensor operations per layer.  decode_layers with up to
// kSmallGemmMaxRows rows runs the whole step in one parallel region whose products split the
// weight rows between the threads (SharedDecodeStep, shared_step.h: each weight byte is read
// once a step); otherwise each intra-op thread takes its own block of rows through the work
// (for_row_blocks).  The attention of both is kv_attention.h's.
//
//   x [B, H] --rms_norm--> mm(qkv) [+ qkv_bias] --RoPE(q, k); k, v -> cache[pos]--> attention
//            --> mm(o)                                                     = attention partial
//   x [B, H] --rms_norm--> mm(gate_up) --silu(gate) * up--> mm(down)        = MLP partial
//
// Each returns this rank's partial [B, H]; the caller all-reduces it over the generation TP
// group and adds the residual.  The SwiGLU and the norm are the Python layers' float32 CPU
// kernels (swiglu.cpp, rms_norm.cpp) and the softmax the same ATen kernel (engine/layers.py),
// so those parts round identically; RoPE is written element by element in the same order
// (x*cos + rot*sin, compiled without FMA contraction, so it rounds like the separate ATen
// multiplies and add).  The matrix products of up to
// kSmallGemmMaxRows rows (small_gemm.h: weights read in place, no packed copy) and the
// attention sums (one query against the cached keys, the weighted sum of values) are our own
// loops: their summation order differs from BLAS and scaled_dot_product_attention, so results
// agree with the Python layers to float rounding.
//
// Shapes (h_kv = this rank's KV heads, Q/G = queries per group, D = head dim):
//   qkv weight   [h_kv*(Q/G+2)*D, H]      per group: Q/G query rows, a key row, a value row
//   qkv bias     [h_kv*(Q/G+2)*D]         optional (Qwen2), fused like qkv's rows; added to the
//                                         product before RoPE, as engine/layers.py does
//   o weight     [H, h_q*D] or stacked [m, H, h_q*D/m]
//   gate_up      [2*F/t, H]               gate/up rows interleaved
//   down weight  [H, F/t]   or stacked [m, H, F/t/m]
//   k cache      [B, h_kv, T, D, 64]      one layer's keys, transposed in tiles of 64 positions
//                                         (T * 64 >= L); position pos is written
//   v cache      [B, h_kv, L, D]          one layer's values; row pos is written
//   key_mask     [B, >= pos+1] bool       which cached positions are real tokens
//   cos, sin     [B, D]                   RoPE tables of the new token's position
#include "decode_layer.h"

#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>
#include <omp.h>

#include <algorithm>
#include <optional>
#include <utility>

#include "kv_attention.h"
#include "rms_norm.h"
#include "row_ops.h"
#include "shared_step.h"
#include "small_gemm.h"
#include "swiglu.h"

namespace hybridflow {
namespace {

// the Python layers' float32 norm (rms_norm.cpp) on this thread's rows
at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& weight_in, double eps) {
  const at::Tensor x = x_in.contiguous(), weight = weight_in.contiguous();
  at::Tensor y = at::empty_like(x);
  rms_norm_rows(x.data_ptr<float>(), weight.data_ptr<float>(), x.size(0), x.size(1),
                static_cast<float>(eps), y.data_ptr<float>(), nullptr);
  return y;
}

// out (+)= x @ w.T for w [out, in]: the in-place small-M kernel for a decode step's few rows
// (in the row-lane form where row_lanes: small_gemm.h), BLAS otherwise.
void linear_out(const at::Tensor& x, const at::Tensor& w, at::Tensor out, bool accumulate,
                bool row_lanes) {
  if (small_gemm_enabled() && x.size(0) <= kSmallGemmMaxRows &&
      x.stride(1) == 1 && w.stride(1) == 1 && out.stride(1) == 1) {
    small_linear_out(x, w, out, accumulate, row_lanes);
  } else if (accumulate) {
    out.addmm_(x, w.t());
  } else {
    at::mm_out(out, x, w.t());
  }
}

// x @ w.T into a new tensor (see linear_out).
at::Tensor project(const at::Tensor& x, const at::Tensor& w, bool row_lanes) {
  at::Tensor out = at::empty({x.size(0), w.size(0)}, x.options());
  linear_out(x, w, out, false, row_lanes);
  return out;
}

// out = x @ w.T for w [out, in], or the stacked row-parallel form [m, out, in/m] read in place.
void row_matmul_out(const at::Tensor& x, const at::Tensor& w, at::Tensor out, bool row_lanes) {
  if (w.dim() == 2) {
    linear_out(x, w, out, false, row_lanes);
    return;
  }
  TORCH_CHECK(w.dim() == 3 && x.size(1) == w.size(0) * w.size(2), "decode: stacked weight ",
              w.sizes(), " does not match input ", x.sizes());
  const int64_t m = w.size(0), k = w.size(2);
  for (int64_t i = 0; i < m; ++i) linear_out(x.narrow(1, i * k, k), w[i], out, i > 0, row_lanes);
}

// Runs fn(first_row, rows) on disjoint row blocks, one per intra-op thread.  Inside the
// parallel region ATen and BLAS calls run single-threaded, so each thread takes its rows
// through the whole half-layer without a fork/join per operation.  One block (one row, or one
// thread) is a plain call outside any parallel region: its matrix products then split the
// weight rows over the threads (small_linear_out), with the same bits.
template <typename Fn>
void for_row_blocks(int64_t batch, const Fn& fn) {
  if (batch == 0) return;
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), batch));
  if (blocks == 1) {
    const c10::AutoGradMode no_grad(false);
    fn(0, batch);
    return;
  }
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    const c10::AutoGradMode no_grad(false);  // grad mode is per thread; inference kernels
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b0 = i * batch / blocks, b1 = (i + 1) * batch / blocks;
      if (b1 > b0) fn(b0, b1 - b0);
    }
  });
}

// One layer's per-step attention inputs for the whole batch: RoPE tables [B, D], this layer's
// caches and the key mask [B, pos + 1].
struct AttentionInputs {
  at::Tensor cos, sin, k_cache, v_cache, key_mask;

  AttentionView view() const {
    return {k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), k_cache.size(1),
            k_cache.size(2), v_cache.size(2), k_cache.size(3), cos.data_ptr<float>(),
            sin.data_ptr<float>(), cos.stride(0), sin.stride(0), key_mask.data_ptr<bool>(),
            key_mask.stride(0)};
  }
};

// attend_pairs with its work space allocated here.
void attend_pairs(const float* qkv_p, int64_t bg0, int64_t bg1, const AttentionInputs& in,
                  int64_t pos, int64_t q_per_group, float* out) {
  const int64_t n = bg1 - bg0, head_dim = in.k_cache.size(3);
  const at::TensorOptions options = in.cos.options();
  at::Tensor q_rot = at::empty({n, q_per_group, head_dim}, options);
  at::Tensor scores = at::empty({2, n, q_per_group, pos + 1}, options);  // scores, probs
  attend_pairs(qkv_p, bg0, bg1, in.view(), pos, q_per_group,
               {q_rot.data_ptr<float>(), scores[0].data_ptr<float>(),
                scores[1].data_ptr<float>()},
               out);
}

// Rows [b0, b0 + rows) of x: rms_norm -> qkv (+ qkv_bias where defined) -> attend_pairs;
// returns the attention output [rows, h_q*D] (before the o projection).
at::Tensor attention_rows(const at::Tensor& x_rows, int64_t b0, const AttentionInputs& in,
                          const at::Tensor& norm_weight, double eps,
                          const at::Tensor& qkv_weight, const at::Tensor& qkv_bias, int64_t pos,
                          int64_t q_per_group, bool row_lanes) {
  const int64_t rows = x_rows.size(0);
  at::Tensor qkv = project(rms_norm(x_rows, norm_weight, eps), qkv_weight, row_lanes);
  if (qkv_bias.defined()) qkv.add_(qkv_bias);  // one float add, as qkv + bias in Python
  at::Tensor attn = at::empty({rows, in.k_cache.size(1) * q_per_group * in.k_cache.size(3)},
                              x_rows.options());
  const int64_t groups = in.k_cache.size(1);
  attend_pairs(qkv.data_ptr<float>(), b0 * groups, (b0 + rows) * groups, in, pos, q_per_group,
               attn.data_ptr<float>());
  return attn;
}

void check_float_cpu(const at::Tensor& t, const char* name) {
  hybridflow::check_float_cpu(t, "decode", name);
}

// rms_norm -> gate_up -> silu(gate) * up; returns [rows, F/t] (before the down projection).
at::Tensor mlp_rows(const at::Tensor& x, const at::Tensor& norm_weight, double eps,
                    const at::Tensor& gate_up_weight, bool row_lanes) {
  const at::Tensor gu = project(rms_norm(x, norm_weight, eps), gate_up_weight, row_lanes);
  return swiglu_forward(gu.view({gu.size(0), -1, 2}));  // the training layers' kernel
}

// Shape checks of the attention half (TORCH_CHECK: ValueError-like RuntimeError in Python).
void check_attention(const at::Tensor& x, const at::Tensor& qkv_weight, const at::Tensor& qkv_bias,
                     const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_cache,
                     const at::Tensor& v_cache, int64_t pos, const at::Tensor& key_mask,
                     int64_t q_per_group) {
  for (const auto& [t, name] : {std::pair{&x, "x"}, {&qkv_weight, "qkv_weight"},
                                {&k_cache, "k_cache"}, {&v_cache, "v_cache"}, {&cos, "cos"},
                                {&sin, "sin"}})
    check_float_cpu(*t, name);
  TORCH_CHECK(x.dim() == 2 && k_cache.dim() == 5 && v_cache.dim() == 4 &&
                  k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.size(4) == kKeyTile && k_cache.size(0) == v_cache.size(0) &&
                  k_cache.size(1) == v_cache.size(1) && k_cache.size(3) == v_cache.size(3) &&
                  k_cache.size(2) * kKeyTile >= v_cache.size(2),
              "decode_attention: x [B, H], contiguous k_cache [B, h_kv, T, D, ", kKeyTile,
              "] (keys in tiles of ", kKeyTile, " positions, T * ", kKeyTile,
              " >= L) and v_cache [B, h_kv, L, D] expected, got ", k_cache.sizes(), " and ",
              v_cache.sizes());
  const int64_t batch = x.size(0), groups = k_cache.size(1), max_len = v_cache.size(2),
                head_dim = k_cache.size(3), per_group = q_per_group + 2;
  TORCH_CHECK(head_dim % 2 == 0 && head_dim <= kMaxHeadDim, "decode_attention: head_dim ",
              head_dim, " must be even and <= ", kMaxHeadDim);
  TORCH_CHECK(k_cache.size(0) == batch && pos >= 0 && pos < max_len,
              "decode_attention: cache batch ", k_cache.size(0), " vs ", batch, ", pos ", pos,
              " outside [0, ", max_len, ")");
  TORCH_CHECK(qkv_weight.size(0) == groups * per_group * head_dim, "decode_attention: qkv rows ",
              qkv_weight.size(0), " != h_kv*(Q/G+2)*D = ", groups * per_group * head_dim);
  if (qkv_bias.defined()) {
    check_float_cpu(qkv_bias, "qkv_bias");
    TORCH_CHECK(qkv_bias.dim() == 1 && qkv_bias.size(0) == qkv_weight.size(0),
                "decode_attention: qkv_bias shape ", qkv_bias.sizes(), " != [",
                qkv_weight.size(0), "] (qkv rows)");
  }
  TORCH_CHECK(key_mask.scalar_type() == at::kBool && key_mask.size(0) == batch &&
                  key_mask.size(1) > pos,
              "decode_attention: key_mask must be bool [B, > pos]");
  TORCH_CHECK(cos.size(0) == batch && cos.size(1) == head_dim && cos.stride(1) == 1 &&
                  sin.stride(1) == 1 && sin.sizes() == cos.sizes(),
              "decode_attention: cos/sin must be [B, D] with unit inner stride");
}

// Inputs of a weight of shape [N, K] or of the stacked row-parallel form [m, N, K/m].
int64_t weight_inputs(const at::Tensor& w) {
  return w.dim() == 3 ? w.size(0) * w.size(2) : w.size(-1);
}

// Shapes of one layer's weights (w: input_norm, qkv, o_proj, post_norm, gate_up, down_proj)
// beyond what check_attention covers, before any thread reads them in place: norms [H],
// qkv [., H], o [H, h_q*D], gate_up [2F, H], down [H, F] (o and down possibly stacked).
void check_layer(const at::Tensor* w, int64_t hidden, int64_t n_attn) {
  for (const auto& [t, name] : {std::pair{w, "input_norm"}, {w + 2, "o_proj"},
                                {w + 3, "post_norm"}, {w + 4, "gate_up"}, {w + 5, "down_proj"}})
    check_float_cpu(*t, name);
  TORCH_CHECK(w[0].numel() == hidden && w[3].numel() == hidden, "decode_layers: norm weights of ",
              hidden, " values expected, got ", w[0].sizes(), " and ", w[3].sizes());
  TORCH_CHECK(w[1].dim() == 2 && w[1].size(1) == hidden, "decode_layers: qkv weight ",
              w[1].sizes(), " must be [., H = ", hidden, "]");
  TORCH_CHECK((w[2].dim() == 2 || w[2].dim() == 3) && w[2].size(-2) == hidden &&
                  weight_inputs(w[2]) == n_attn,
              "decode_layers: o_proj ", w[2].sizes(), " must be [H, h_q*D] = [", hidden, ", ",
              n_attn, "] or stacked [m, H, h_q*D/m]");
  TORCH_CHECK(w[4].dim() == 2 && w[4].size(1) == hidden && w[4].size(0) % 2 == 0,
              "decode_layers: gate_up ", w[4].sizes(), " must be [2F, H = ", hidden, "]");
  TORCH_CHECK((w[5].dim() == 2 || w[5].dim() == 3) && w[5].size(-2) == hidden &&
                  weight_inputs(w[5]) == w[4].size(0) / 2,
              "decode_layers: down_proj ", w[5].sizes(), " must be [H, F] = [", hidden, ", ",
              w[4].size(0) / 2, "] or stacked [m, H, F/m]");
}

}  // namespace

at::Tensor decode_attention(const at::Tensor& x, const at::Tensor& norm_weight, double eps,
                            const at::Tensor& qkv_weight, const at::Tensor& o_weight,
                            const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                            at::Tensor& v_cache, int64_t pos, const at::Tensor& key_mask,
                            int64_t q_per_group, const std::optional<at::Tensor>& qkv_bias) {
  const at::Tensor bias = qkv_bias.value_or(at::Tensor());
  check_attention(x, qkv_weight, bias, cos, sin, k_cache, v_cache, pos, key_mask, q_per_group);
  const int64_t batch = x.size(0);
  at::Tensor out = at::empty({batch, o_weight.size(-2)}, x.options());
  const AttentionInputs in{cos, sin, k_cache, v_cache,
                           key_mask.narrow(1, 0, pos + 1).contiguous()};
  for_row_blocks(batch, [&](int64_t b0, int64_t rows) {
    row_matmul_out(attention_rows(x.narrow(0, b0, rows), b0, in, norm_weight, eps, qkv_weight,
                                  bias, pos, q_per_group, false),
                   o_weight, out.narrow(0, b0, rows), false);
  });
  return out;
}

at::Tensor decode_mlp(const at::Tensor& x, const at::Tensor& norm_weight, double eps,
                      const at::Tensor& gate_up_weight, const at::Tensor& down_weight) {
  check_float_cpu(x, "x");
  check_float_cpu(gate_up_weight, "gate_up_weight");
  TORCH_CHECK(x.dim() == 2 && gate_up_weight.size(0) % 2 == 0,
              "decode_mlp: x [B, H] and gate_up [2*F/t, H] expected");
  at::Tensor out = at::empty({x.size(0), down_weight.size(-2)}, x.options());
  for_row_blocks(x.size(0), [&](int64_t b0, int64_t rows) {
    row_matmul_out(mlp_rows(x.narrow(0, b0, rows), norm_weight, eps, gate_up_weight, false),
                   down_weight, out.narrow(0, b0, rows), false);
  });
  return out;
}

std::vector<at::Tensor> check_decode_layers(
    const at::Tensor& x, const std::vector<at::Tensor>& layer_weights, const at::Tensor& cos,
    const at::Tensor& sin, const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t pos,
    const at::Tensor& key_mask, int64_t q_per_group,
    const std::vector<std::optional<at::Tensor>>& qkv_biases) {
  TORCH_CHECK(layer_weights.size() % 6 == 0 && !layer_weights.empty() &&
                  k_cache.dim() == 6 && v_cache.dim() == 5 &&
                  k_cache.size(0) == static_cast<int64_t>(layer_weights.size() / 6) &&
                  v_cache.size(0) == k_cache.size(0),
              "decode_layers: 6 weights per layer and caches [layers, ...] for as many layers");
  const int64_t num_layers = k_cache.size(0);
  TORCH_CHECK(qkv_biases.empty() || static_cast<int64_t>(qkv_biases.size()) == num_layers,
              "decode_layers: ", qkv_biases.size(), " qkv biases for ", num_layers,
              " layers (give none or one, possibly None, per layer)");
  std::vector<at::Tensor> biases(num_layers);  // undefined: no bias
  for (size_t l = 0; l < qkv_biases.size(); ++l) biases[l] = qkv_biases[l].value_or(at::Tensor());
  for (int64_t l = 0; l < num_layers; ++l) {
    check_attention(x, layer_weights[6 * l + 1], biases[l], cos, sin, k_cache.select(0, l),
                    v_cache.select(0, l), pos, key_mask, q_per_group);
    check_layer(layer_weights.data() + 6 * l, x.size(1),
                k_cache.size(2) * q_per_group * k_cache.size(4));
  }
  return biases;
}

at::Tensor decode_layers(const at::Tensor& x, const std::vector<at::Tensor>& layer_weights,
                         double eps, const at::Tensor& cos, const at::Tensor& sin,
                         at::Tensor& k_cache, at::Tensor& v_cache, int64_t pos,
                         const at::Tensor& key_mask, int64_t q_per_group,
                         const std::vector<std::optional<at::Tensor>>& qkv_biases,
                         bool row_lanes) {
  const std::vector<at::Tensor> biases = check_decode_layers(
      x, layer_weights, cos, sin, k_cache, v_cache, pos, key_mask, q_per_group, qkv_biases);
  const int64_t batch = x.size(0), num_layers = k_cache.size(0);
  at::Tensor out = x.clone(at::MemoryFormat::Contiguous);
  if (SharedDecodeStep::applies(batch, layer_weights, biases)) {
    const int threads = at::get_num_threads();
    const SharedDecodeStep step(batch, x.size(1), layer_weights, biases, eps, k_cache, v_cache,
                                key_mask, q_per_group, row_lanes, threads);
    float* h = out.data_ptr<float>();
#pragma omp parallel num_threads(threads)
    {
      const c10::AutoGradMode no_grad(false);  // grad mode is per thread; inference kernels
      step.run(omp_get_thread_num(), omp_get_num_threads(), h, pos, cos.data_ptr<float>(),
               sin.data_ptr<float>(), cos.stride(0), sin.stride(0));
    }
    return out;
  }
  const at::Tensor mask = key_mask.narrow(1, 0, pos + 1).contiguous();
  std::vector<AttentionInputs> inputs;  // each layer's cache views, made once
  for (int64_t l = 0; l < num_layers; ++l)
    inputs.push_back({cos, sin, k_cache.select(0, l), v_cache.select(0, l), mask});
  for_row_blocks(x.size(0), [&](int64_t b0, int64_t rows) {
    at::Tensor h = out.narrow(0, b0, rows);  // this thread's rows, updated in place
    for (int64_t l = 0; l < num_layers; ++l) {
      const at::Tensor* w = layer_weights.data() + 6 * l;
      at::Tensor part = at::empty_like(h);
      row_matmul_out(
          attention_rows(h, b0, inputs[l], w[0], eps, w[1], biases[l], pos, q_per_group,
                         row_lanes),
          w[2], part, row_lanes);
      h.add_(part);
      row_matmul_out(mlp_rows(h, w[3], eps, w[4], row_lanes), w[5], part, row_lanes);
      h.add_(part);
    }
  });
  return out;
}

}  // namespace hybridflow
