// Llama decoder layers for a single new token per sequence (the decode step of generation),
// CPU float32.  decode_layers runs every layer of a stage in one call (no TP: nothing to
// all-reduce in between); with TP, decode_attention and decode_mlp are the two halves of a
// layer around the caller's all-reduces.  Either way Python makes one or two calls per step or
// layer instead of about thirty tensor operations per layer, and each intra-op thread takes its
// own block of rows through the work (for_row_blocks).
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
//   k cache      [B, h_kv, D, L]          one layer's keys, transposed; column pos is written
//   v cache      [B, h_kv, L, D]          one layer's values; row pos is written
//   key_mask     [B, >= pos+1] bool       which cached positions are real tokens
//   cos, sin     [B, D]                   RoPE tables of the new token's position
#include "decode_layer.h"

#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>

#include "rms_norm.h"
#include "row_ops.h"
#include "small_gemm.h"
#include "swiglu.h"
#include "vec_math.h"

namespace hybridflow {
namespace {

using vec::kLanes;
using vec::splat;
using vec::vf;
constexpr int kMaxBlockQueries = 8;  // the blocked loops below take up to 8 queries per group

// Scores of num_q queries against keys [l0, num_keys), one key at a time: each a sum over
// d = 0, 1, ... of q[d] * k_t[d, l].
inline __attribute__((always_inline)) void scores_plain(const float* q, const float* k_t,
                                                        int64_t num_q, int64_t l0,
                                                        int64_t num_keys, int64_t head_dim,
                                                        int64_t max_len, float* scores) {
  for (int64_t j = 0; j < num_q; ++j) {
    float* s = scores + j * num_keys;
    for (int64_t l = l0; l < num_keys; ++l) s[l] = 0.f;
    for (int64_t d = 0; d < head_dim; ++d) {
      const float qd = q[j * head_dim + d];
      const float* kd = k_t + d * max_len;
      for (int64_t l = l0; l < num_keys; ++l) s[l] += qd * kd[l];
    }
  }
}

// Scores of Q queries against keys [l0, l0 + 16 * V): Q * V accumulators over d, so each key
// vector is loaded once for all queries of the group.  Every score is summed over d = 0, 1, ...
// in order, as scores_plain does.
template <int Q, int V>
inline __attribute__((always_inline)) void scores_block(const float* q, int64_t head_dim,
                                                        const float* k_t, int64_t max_len,
                                                        int64_t l0, float* s,
                                                        int64_t num_keys) {
  vf acc[Q][V];
  for (int j = 0; j < Q; ++j)
    for (int v = 0; v < V; ++v) acc[j][v] = vf{};
  for (int64_t d = 0; d < head_dim; ++d) {
    vf kv[V];
    for (int v = 0; v < V; ++v) kv[v] = vec::load(k_t + d * max_len + l0 + v * kLanes);
    for (int j = 0; j < Q; ++j) {
      const vf qd = splat(q[j * head_dim + d]);
      for (int v = 0; v < V; ++v) acc[j][v] = acc[j][v] + qd * kv[v];
    }
  }
  for (int j = 0; j < Q; ++j)
    for (int v = 0; v < V; ++v) vec::store(s + j * num_keys + l0 + v * kLanes, acc[j][v]);
}

template <int Q>
inline __attribute__((always_inline)) void scores_blocked(const float* q, const float* k_t,
                                                          int64_t num_keys, int64_t head_dim,
                                                          int64_t max_len, float* scores) {
  int64_t l0 = 0;
  for (; l0 + 4 * kLanes <= num_keys; l0 += 4 * kLanes)
    scores_block<Q, 4>(q, head_dim, k_t, max_len, l0, scores, num_keys);
  for (; l0 + kLanes <= num_keys; l0 += kLanes)
    scores_block<Q, 1>(q, head_dim, k_t, max_len, l0, scores, num_keys);
  scores_plain(q, k_t, Q, l0, num_keys, head_dim, max_len, scores);  // fewer than a vector
}

// scores [num_q, num_keys] of one (sequence, KV group) from keys stored transposed
// (k_t [D, L]): a row of scores is a sum over d of q[d] * k_t[d, :], so the inner loop runs
// over contiguous keys and vectorises with no horizontal sums; the order of the additions
// (d = 0, 1, ...) does not depend on the instruction set the clone runs on, nor on whether
// the blocked loops (up to kMaxBlockQueries queries) or the plain ones run.
__attribute__((target_clones("avx512f", "avx2", "default")))
void attention_scores(const float* q, const float* k_t, const bool* key_ok, int64_t num_q,
                      int64_t num_keys, int64_t head_dim, int64_t max_len, float scale,
                      float* scores) {
  switch (num_q) {
    case 1: scores_blocked<1>(q, k_t, num_keys, head_dim, max_len, scores); break;
    case 2: scores_blocked<2>(q, k_t, num_keys, head_dim, max_len, scores); break;
    case 3: scores_blocked<3>(q, k_t, num_keys, head_dim, max_len, scores); break;
    case 4: scores_blocked<4>(q, k_t, num_keys, head_dim, max_len, scores); break;
    case 5: scores_blocked<5>(q, k_t, num_keys, head_dim, max_len, scores); break;
    case 6: scores_blocked<6>(q, k_t, num_keys, head_dim, max_len, scores); break;
    case 7: scores_blocked<7>(q, k_t, num_keys, head_dim, max_len, scores); break;
    case 8: scores_blocked<8>(q, k_t, num_keys, head_dim, max_len, scores); break;
    default: scores_plain(q, k_t, num_q, 0, num_keys, head_dim, max_len, scores);
  }
  for (int64_t j = 0; j < num_q; ++j) {
    float* s = scores + j * num_keys;
    for (int64_t l = 0; l < num_keys; ++l)
      s[l] = key_ok[l] ? s[l] * scale : -std::numeric_limits<float>::infinity();
  }
}

// out[j, d0 : d0 + 64] of Q queries: Q * 4 accumulators over the keys, each value row loaded
// once for all queries.  Keys are added in order; a query skips a key whose probability is 0
// (masked: exp(-inf)), as the scalar loop does.
template <int Q>
inline __attribute__((always_inline)) void values_blocked(const float* probs, const float* v,
                                                          int64_t num_keys, int64_t head_dim,
                                                          int64_t kv_stride, float* out,
                                                          int64_t out_stride) {
  for (int64_t d0 = 0; d0 < head_dim; d0 += 4 * kLanes) {
    vf acc[Q][4];
    for (int j = 0; j < Q; ++j)
      for (int i = 0; i < 4; ++i) acc[j][i] = vf{};
    for (int64_t l = 0; l < num_keys; ++l) {
      float p[Q];
      bool any = false;
      for (int j = 0; j < Q; ++j) {
        p[j] = probs[j * num_keys + l];
        any = any || p[j] != 0.f;
      }
      if (!any) continue;
      vf vv[4];
      for (int i = 0; i < 4; ++i) vv[i] = vec::load(v + l * kv_stride + d0 + i * kLanes);
      for (int j = 0; j < Q; ++j) {
        if (p[j] == 0.f) continue;
        const vf pj = splat(p[j]);
        for (int i = 0; i < 4; ++i) acc[j][i] = acc[j][i] + pj * vv[i];
      }
    }
    for (int j = 0; j < Q; ++j)
      for (int i = 0; i < 4; ++i) vec::store(out + j * out_stride + d0 + i * kLanes, acc[j][i]);
  }
}

__attribute__((target_clones("avx512f", "avx2", "default")))
void weighted_values(const float* probs, const float* v, int64_t num_q, int64_t num_keys,
                     int64_t head_dim, int64_t kv_stride, float* out, int64_t out_stride) {
  // out[j, :] = sum_l probs[j, l] * v[l, :]
  if (head_dim % (4 * kLanes) == 0 && num_q <= kMaxBlockQueries) {
    switch (num_q) {
      case 1: values_blocked<1>(probs, v, num_keys, head_dim, kv_stride, out, out_stride); return;
      case 2: values_blocked<2>(probs, v, num_keys, head_dim, kv_stride, out, out_stride); return;
      case 3: values_blocked<3>(probs, v, num_keys, head_dim, kv_stride, out, out_stride); return;
      case 4: values_blocked<4>(probs, v, num_keys, head_dim, kv_stride, out, out_stride); return;
      case 5: values_blocked<5>(probs, v, num_keys, head_dim, kv_stride, out, out_stride); return;
      case 6: values_blocked<6>(probs, v, num_keys, head_dim, kv_stride, out, out_stride); return;
      case 7: values_blocked<7>(probs, v, num_keys, head_dim, kv_stride, out, out_stride); return;
      case 8: values_blocked<8>(probs, v, num_keys, head_dim, kv_stride, out, out_stride); return;
      default: break;
    }
  }
  for (int64_t j = 0; j < num_q; ++j) {
    float* o = out + j * out_stride;
    for (int64_t d = 0; d < head_dim; ++d) o[d] = 0.f;
    const float* p = probs + j * num_keys;
    for (int64_t l = 0; l < num_keys; ++l) {
      const float pl = p[l];
      if (pl == 0.f) continue;  // masked keys (exp(-inf))
      const float* vl = v + l * kv_stride;
      for (int64_t d = 0; d < head_dim; ++d) o[d] += pl * vl[d];
    }
  }
}

// the Python layers' float32 norm (rms_norm.cpp) on this thread's rows
at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& weight_in, double eps) {
  const at::Tensor x = x_in.contiguous(), weight = weight_in.contiguous();
  at::Tensor y = at::empty_like(x);
  rms_norm_rows(x.data_ptr<float>(), weight.data_ptr<float>(), x.size(0), x.size(1),
                static_cast<float>(eps), y.data_ptr<float>(), nullptr);
  return y;
}

std::atomic<bool> g_small_gemm{true};

// out (+)= x @ w.T for w [out, in]: the in-place small-M kernel for a decode step's few rows,
// BLAS otherwise.
void linear_out(const at::Tensor& x, const at::Tensor& w, at::Tensor out, bool accumulate) {
  if (g_small_gemm.load(std::memory_order_relaxed) && x.size(0) <= kSmallGemmMaxRows &&
      x.stride(1) == 1 && w.stride(1) == 1 && out.stride(1) == 1) {
    small_linear_out(x, w, out, accumulate);
  } else if (accumulate) {
    out.addmm_(x, w.t());
  } else {
    at::mm_out(out, x, w.t());
  }
}

// x @ w.T into a new tensor (see linear_out).
at::Tensor project(const at::Tensor& x, const at::Tensor& w) {
  at::Tensor out = at::empty({x.size(0), w.size(0)}, x.options());
  linear_out(x, w, out, false);
  return out;
}

// out = x @ w.T for w [out, in], or the stacked row-parallel form [m, out, in/m] read in place.
void row_matmul_out(const at::Tensor& x, const at::Tensor& w, at::Tensor out) {
  if (w.dim() == 2) {
    linear_out(x, w, out, false);
    return;
  }
  TORCH_CHECK(w.dim() == 3 && x.size(1) == w.size(0) * w.size(2), "decode: stacked weight ",
              w.sizes(), " does not match input ", x.sizes());
  const int64_t m = w.size(0), k = w.size(2);
  for (int64_t i = 0; i < m; ++i) linear_out(x.narrow(1, i * k, k), w[i], out, i > 0);
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
};

// Rows [b0, b0 + rows) of x: rms_norm -> qkv (+ qkv_bias where defined) -> RoPE -> cache
// write -> attention; returns the attention output [rows, h_q*D] (before the o projection).
at::Tensor attention_rows(const at::Tensor& x_rows, int64_t b0, const AttentionInputs& in,
                          const at::Tensor& norm_weight, double eps,
                          const at::Tensor& qkv_weight, const at::Tensor& qkv_bias, int64_t pos,
                          int64_t q_per_group) {
  const int64_t rows = x_rows.size(0), groups = in.k_cache.size(1),
                head_dim = in.k_cache.size(2), max_len = in.k_cache.size(3),
                per_group = q_per_group + 2, num_keys = pos + 1;
  const at::Tensor cos = in.cos.narrow(0, b0, rows), sin = in.sin.narrow(0, b0, rows);
  const at::Tensor mask = in.key_mask.narrow(0, b0, rows);
  at::Tensor qkv = project(rms_norm(x_rows, norm_weight, eps), qkv_weight);
  if (qkv_bias.defined()) qkv.add_(qkv_bias);  // one float add, as qkv + bias in Python
  at::Tensor q_rot = at::empty({rows, groups, q_per_group, head_dim}, x_rows.options());
  at::Tensor scores = at::empty({rows, groups, q_per_group, num_keys}, x_rows.options());
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  const float* qkv_p = qkv.data_ptr<float>();
  float* kc = in.k_cache.narrow(0, b0, rows).data_ptr<float>();
  float* vc = in.v_cache.narrow(0, b0, rows).data_ptr<float>();
  float* qr = q_rot.data_ptr<float>();
  float* sc = scores.data_ptr<float>();
  const bool* mk = mask.data_ptr<bool>();
  const int64_t mask_stride = mask.stride(0);
  for (int64_t bg = 0; bg < rows * groups; ++bg) {
    const int64_t b = bg / groups;
    const float* block = qkv_p + bg * per_group * head_dim;
    const float* c = cos.data_ptr<float>() + b * cos.stride(0);
    const float* s = sin.data_ptr<float>() + b * sin.stride(0);
    float* qb = qr + bg * q_per_group * head_dim;
    for (int64_t j = 0; j < q_per_group; ++j)
      rope_row(block + j * head_dim, c, s, head_dim, qb + j * head_dim);
    float* kb = kc + bg * head_dim * max_len;  // [D, L]
    float* vb = vc + bg * max_len * head_dim;  // [L, D]
    float k_rot[kMaxHeadDim];
    rope_row(block + q_per_group * head_dim, c, s, head_dim, k_rot);
    const float* v_new = block + (q_per_group + 1) * head_dim;
    for (int64_t d = 0; d < head_dim; ++d) {
      kb[d * max_len + pos] = k_rot[d];
      vb[pos * head_dim + d] = v_new[d];
    }
    attention_scores(qb, kb, mk + b * mask_stride, q_per_group, num_keys, head_dim, max_len,
                     scale, sc + bg * q_per_group * num_keys);
  }
  const at::Tensor probs = at::softmax(scores, -1);
  at::Tensor attn = at::empty({rows, groups * q_per_group * head_dim}, x_rows.options());
  const float* pr = probs.data_ptr<float>();
  float* out = attn.data_ptr<float>();
  for (int64_t bg = 0; bg < rows * groups; ++bg)
    weighted_values(pr + bg * q_per_group * num_keys, vc + bg * max_len * head_dim,
                    q_per_group, num_keys, head_dim, head_dim,
                    out + bg * q_per_group * head_dim, head_dim);
  return attn;
}

void check_float_cpu(const at::Tensor& t, const char* name) {
  hybridflow::check_float_cpu(t, "decode", name);
}

// rms_norm -> gate_up -> silu(gate) * up; returns [rows, F/t] (before the down projection).
at::Tensor mlp_rows(const at::Tensor& x, const at::Tensor& norm_weight, double eps,
                    const at::Tensor& gate_up_weight) {
  const at::Tensor gu = project(rms_norm(x, norm_weight, eps), gate_up_weight);
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
  TORCH_CHECK(x.dim() == 2 && k_cache.dim() == 4 && v_cache.dim() == 4 &&
                  k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.size(2) == v_cache.size(3) && k_cache.size(3) == v_cache.size(2),
              "decode_attention: x [B, H], contiguous k_cache [B, h_kv, D, L] and v_cache "
              "[B, h_kv, L, D] expected");
  const int64_t batch = x.size(0), groups = k_cache.size(1), max_len = k_cache.size(3),
                head_dim = k_cache.size(2), per_group = q_per_group + 2;
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
                                  bias, pos, q_per_group),
                   o_weight, out.narrow(0, b0, rows));
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
    row_matmul_out(mlp_rows(x.narrow(0, b0, rows), norm_weight, eps, gate_up_weight),
                   down_weight, out.narrow(0, b0, rows));
  });
  return out;
}

void use_small_gemm(bool enabled) { g_small_gemm.store(enabled); }

at::Tensor decode_layers(const at::Tensor& x, const std::vector<at::Tensor>& layer_weights,
                         double eps, const at::Tensor& cos, const at::Tensor& sin,
                         at::Tensor& k_cache, at::Tensor& v_cache, int64_t pos,
                         const at::Tensor& key_mask, int64_t q_per_group,
                         const std::vector<std::optional<at::Tensor>>& qkv_biases) {
  TORCH_CHECK(layer_weights.size() % 6 == 0 && !layer_weights.empty() &&
                  k_cache.dim() == 5 && v_cache.dim() == 5 &&
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
    check_attention(x, layer_weights[6 * l + 1], biases[l], cos, sin, k_cache[l], v_cache[l],
                    pos, key_mask, q_per_group);
    check_float_cpu(layer_weights[6 * l + 4], "gate_up_weight");
  }
  at::Tensor out = x.clone();
  const at::Tensor mask = key_mask.narrow(1, 0, pos + 1).contiguous();
  std::vector<AttentionInputs> inputs;
  for (int64_t l = 0; l < num_layers; ++l)
    inputs.push_back({cos, sin, k_cache[l], v_cache[l], mask});
  for_row_blocks(x.size(0), [&](int64_t b0, int64_t rows) {
    at::Tensor h = out.narrow(0, b0, rows);  // this thread's rows, updated in place
    for (int64_t l = 0; l < num_layers; ++l) {
      const at::Tensor* w = layer_weights.data() + 6 * l;
      at::Tensor part = at::empty_like(h);
      row_matmul_out(
          attention_rows(h, b0, inputs[l], w[0], eps, w[1], biases[l], pos, q_per_group), w[2],
          part);
      h.add_(part);
      row_matmul_out(mlp_rows(h, w[3], eps, w[4]), w[5], part);
      h.add_(part);
    }
  });
  return out;
}

}  // namespace hybridflow
