// Llama decoder layers for a single new token per sequence (the decode step of generation),
// CPU float32.  decode_layers runs every layer of a stage in one call (no TP: nothing to
// all-reduce in between); with TP, decode_attention and decode_mlp are the two halves of a
// layer around the caller's all-reduces.  Either way Python makes one or two calls per step or
// layer instead of about thirty tensor operations per layer.  decode_layers with up to
// kSmallGemmMaxRows rows runs the whole step in one parallel region whose products split the
// weight rows between the threads (layers_shared_step: each weight byte is read once a step);
// otherwise each intra-op thread takes its own block of rows through the work (for_row_blocks).
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
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <utility>

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
// Positions per tile of the cached keys (engine/kv_cache.py KEY_TILE): a (sequence, KV group)'s
// keys are tiles [T, D, kKeyTile], tile t holding positions t * kKeyTile + [0, kKeyTile) as D
// rows, so the keys of positions [0, n) are one contiguous run read front to back.
constexpr int64_t kKeyTile = 64;
constexpr int kTileVectors = static_cast<int>(kKeyTile / kLanes);
static_assert(kKeyTile % kLanes == 0 && kTileVectors == 4, "a key tile row is 4 vectors");

// Offset of key l's dim d in one (sequence, KV group)'s tiles.
inline int64_t key_offset(int64_t l, int64_t d, int64_t head_dim) {
  return (l / kKeyTile) * head_dim * kKeyTile + d * kKeyTile + l % kKeyTile;
}

// Scores of num_q queries against keys [0, num_keys), one key at a time: each a sum over
// d = 0, 1, ... of q[d] * k[d, l], tile by tile.  Rows of scores are ld apart.
inline __attribute__((always_inline)) void scores_plain(const float* q, const float* k,
                                                        int64_t num_q, int64_t num_keys,
                                                        int64_t head_dim, float* scores,
                                                        int64_t ld) {
  for (int64_t j = 0; j < num_q; ++j) {
    float* s = scores + j * ld;
    for (int64_t l = 0; l < num_keys; ++l) s[l] = 0.f;
    for (int64_t t0 = 0; t0 < num_keys; t0 += kKeyTile) {
      const float* kt = k + key_offset(t0, 0, head_dim);
      const int64_t n = std::min(kKeyTile, num_keys - t0);
      for (int64_t d = 0; d < head_dim; ++d) {
        const float qd = q[j * head_dim + d];
        for (int64_t l = 0; l < n; ++l) s[t0 + l] += qd * kt[d * kKeyTile + l];
      }
    }
  }
}

// Scores of Q queries against the V key vectors at `kt` (a tile's column, V * 16 positions):
// Q * V accumulators over d, so each key vector is loaded once for all queries of the group.
// Every score is summed over d = 0, 1, ... in order, as scores_plain does.  The first `valid`
// scores are stored (the last vector may reach past the filled positions: those lanes, read
// inside the tile, are dropped).  kt_next: the next group's keys at the same place (a hint).
template <int Q, int V>
inline __attribute__((always_inline)) void scores_block(const float* q, int64_t head_dim,
                                                        const float* kt, const float* kt_next,
                                                        float* s, int64_t num_keys,
                                                        int64_t valid) {
  vf acc[Q][V];
  for (int j = 0; j < Q; ++j)
    for (int v = 0; v < V; ++v) acc[j][v] = vf{};
  for (int64_t d = 0; d < head_dim; ++d) {
    vf kv[V];
    for (int v = 0; v < V; ++v) {
      kv[v] = vec::load(kt + d * kKeyTile + v * kLanes);
      __builtin_prefetch(kt_next + d * kKeyTile + v * kLanes, 0, 3);
    }
    for (int j = 0; j < Q; ++j) {
      const vf qd = splat(q[j * head_dim + d]);
      for (int v = 0; v < V; ++v) acc[j][v] = acc[j][v] + qd * kv[v];
    }
  }
  for (int j = 0; j < Q; ++j)
    for (int v = 0; v < V; ++v) {
      float* out = s + j * num_keys + v * kLanes;
      const int64_t n = valid - v * kLanes;
      if (n >= kLanes) {
        vec::store(out, acc[j][v]);
      } else {
        float lanes[kLanes];
        vec::store(lanes, acc[j][v]);
        std::memcpy(out, lanes, n * sizeof(float));
      }
    }
}

// Q queries against every filled position, a tile (or the filled part of the last one) at a
// time.
template <int Q>
inline __attribute__((always_inline)) void scores_blocked(const float* q, const float* k,
                                                          const float* k_next, int64_t num_keys,
                                                          int64_t head_dim, float* scores,
                                                          int64_t ld) {
  for (int64_t t0 = 0; t0 < num_keys; t0 += kKeyTile) {
    const int64_t at = key_offset(t0, 0, head_dim), n = std::min(kKeyTile, num_keys - t0);
    const float *kt = k + at, *kn = k_next + at;
    switch ((n + kLanes - 1) / kLanes) {
      case 4: scores_block<Q, 4>(q, head_dim, kt, kn, scores + t0, ld, n); break;
      case 3: scores_block<Q, 3>(q, head_dim, kt, kn, scores + t0, ld, n); break;
      case 2: scores_block<Q, 2>(q, head_dim, kt, kn, scores + t0, ld, n); break;
      default: scores_block<Q, 1>(q, head_dim, kt, kn, scores + t0, ld, n); break;
    }
  }
}

// The blocked loops for the query counts 1 .. kMaxBlockQueries, picked by a fold (no lambda:
// it would not be compiled for the caller's target clone); false for other counts.
using kBlockCounts = std::integer_sequence<int, 1, 2, 3, 4, 5, 6, 7, 8>;
static_assert(kMaxBlockQueries == 8, "kBlockCounts lists 1 .. kMaxBlockQueries");

template <int... Q>
inline __attribute__((always_inline)) bool scores_by_count(std::integer_sequence<int, Q...>,
                                                           int64_t num_q, const float* q,
                                                           const float* k, const float* k_next,
                                                           int64_t num_keys, int64_t head_dim,
                                                           float* scores, int64_t ld) {
  return ((num_q == Q &&
           (scores_blocked<Q>(q, k, k_next, num_keys, head_dim, scores, ld), true)) ||
          ...);
}

// scores [num_q, num_keys] of one (sequence, KV group) from keys stored transposed in tiles
// (k [T, D, kKeyTile]): a row of scores is a sum over d of q[d] * k[d, :], so the inner loop
// runs over contiguous keys and vectorises with no horizontal sums; the order of the additions
// (d = 0, 1, ...) does not depend on the instruction set the clone runs on, nor on whether
// the blocked loops (up to kMaxBlockQueries queries) or the plain ones run.
__attribute__((target_clones("avx512f", "avx2", "default")))
void attention_scores(const float* q, const float* k, const float* k_next, const bool* key_ok,
                      int64_t num_q, int64_t num_keys, int64_t head_dim, float scale,
                      float* scores, const float* new_key) {
  // the new key (the last, num_keys - 1) from new_key, the others from the cache: the same
  // sums in the same order, but no load waits on the stores that have just put the new key
  // into its tiles (a vector load over a pending 4-byte store cannot be forwarded from it)
  const int64_t cached = num_keys - 1;
  if (!scores_by_count(kBlockCounts{}, num_q, q, k, k_next, cached, head_dim, scores, num_keys))
    scores_plain(q, k, num_q, cached, head_dim, scores, num_keys);
  for (int64_t j = 0; j < num_q; ++j) {
    float sum = 0.f;
    for (int64_t d = 0; d < head_dim; ++d) sum += q[j * head_dim + d] * new_key[d];
    scores[j * num_keys + cached] = sum;
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
                                                          const float* v_next, int64_t num_keys,
                                                          int64_t head_dim, int64_t kv_stride,
                                                          float* out, int64_t out_stride) {
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
      for (int i = 0; i < 4; ++i) {
        vv[i] = vec::load(v + l * kv_stride + d0 + i * kLanes);
        __builtin_prefetch(v_next + l * kv_stride + d0 + i * kLanes, 0, 3);  // next group's
      }
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

template <int... Q>
inline __attribute__((always_inline)) bool values_by_count(std::integer_sequence<int, Q...>,
                                                           int64_t num_q, const float* probs,
                                                           const float* v, const float* v_next,
                                                           int64_t num_keys, int64_t head_dim,
                                                           int64_t kv_stride, float* out,
                                                           int64_t out_stride) {
  return ((num_q == Q && (values_blocked<Q>(probs, v, v_next, num_keys, head_dim, kv_stride,
                                             out, out_stride),
                          true)) ||
          ...);
}

__attribute__((target_clones("avx512f", "avx2", "default")))
void weighted_values(const float* probs, const float* v, const float* v_next, int64_t num_q,
                     int64_t num_keys, int64_t head_dim, int64_t kv_stride, float* out,
                     int64_t out_stride) {
  // out[j, :] = sum_l probs[j, l] * v[l, :]
  if (head_dim % (4 * kLanes) == 0 && num_q <= kMaxBlockQueries) {
    if (values_by_count(kBlockCounts{}, num_q, probs, v, v_next, num_keys, head_dim, kv_stride,
                        out, out_stride))
      return;
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

// out (+)= x @ w.T for w [out, in]: the in-place small-M kernel for a decode step's few rows
// (in the row-lane form where row_lanes: small_gemm.h), BLAS otherwise.
void linear_out(const at::Tensor& x, const at::Tensor& w, at::Tensor out, bool accumulate,
                bool row_lanes) {
  if (g_small_gemm.load(std::memory_order_relaxed) && x.size(0) <= kSmallGemmMaxRows &&
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
};

// The (sequence, KV group) pairs [bg0, bg1) of the batch (pair bg = sequence bg / h_kv, group
// bg % h_kv) from their qkv blocks at `qkv_p` (per pair (Q/G+2)*D floats: Q/G queries, the key,
// the value; bias added): RoPE -> cache write -> attention; writes each pair's attention
// output (Q/G*D floats, before the o projection) contiguously from `out`.  Pairs rather than
// rows, so that threads can share the attention of fewer rows than threads (batch 1: one
// group each).
void attend_pairs(const float* qkv_p, int64_t bg0, int64_t bg1, const AttentionInputs& in,
                  int64_t pos, int64_t q_per_group, float* out) {
  const int64_t n = bg1 - bg0;
  if (n <= 0) return;
  const int64_t groups = in.k_cache.size(1), head_dim = in.k_cache.size(3),
                key_block = in.k_cache.size(2) * head_dim * kKeyTile,
                max_len = in.v_cache.size(2), per_group = q_per_group + 2, num_keys = pos + 1;
  const at::TensorOptions options = in.cos.options();
  at::Tensor q_rot = at::empty({n, q_per_group, head_dim}, options);
  at::Tensor scores = at::empty({n, q_per_group, num_keys}, options);
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  float* kc = in.k_cache.data_ptr<float>();  // contiguous [B, h_kv, T, D, kKeyTile]
  float* vc = in.v_cache.data_ptr<float>();  // contiguous [B, h_kv, L, D]
  float* qr = q_rot.data_ptr<float>();
  float* sc = scores.data_ptr<float>();
  const float *cos = in.cos.data_ptr<float>(), *sin = in.sin.data_ptr<float>();
  const bool* mk = in.key_mask.data_ptr<bool>();
  const int64_t cos_stride = in.cos.stride(0), sin_stride = in.sin.stride(0),
                mask_stride = in.key_mask.stride(0);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t bg = bg0 + i, b = bg / groups;
    const float* block = qkv_p + i * per_group * head_dim;
    const float* c = cos + b * cos_stride;
    const float* s = sin + b * sin_stride;
    float* qb = qr + i * q_per_group * head_dim;
    for (int64_t j = 0; j < q_per_group; ++j)
      rope_row(block + j * head_dim, c, s, head_dim, qb + j * head_dim);
    float* kb = kc + bg * key_block;           // [T, D, kKeyTile]
    float* vb = vc + bg * max_len * head_dim;  // [L, D]
    float k_rot[kMaxHeadDim];
    rope_row(block + q_per_group * head_dim, c, s, head_dim, k_rot);
    const float* v_new = block + (q_per_group + 1) * head_dim;
    for (int64_t d = 0; d < head_dim; ++d) {
      kb[key_offset(pos, d, head_dim)] = k_rot[d];
      vb[pos * head_dim + d] = v_new[d];
    }
    const float* k_next = i + 1 < n ? kb + key_block : kb;
    attention_scores(qb, kb, k_next, mk + b * mask_stride, q_per_group, num_keys, head_dim,
                     scale, sc + i * q_per_group * num_keys, k_rot);
  }
  const at::Tensor probs = at::softmax(scores, -1);
  const float* pr = probs.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    const float* vb = vc + (bg0 + i) * max_len * head_dim;
    weighted_values(pr + i * q_per_group * num_keys, vb,
                    i + 1 < n ? vb + max_len * head_dim : vb, q_per_group, num_keys, head_dim,
                    head_dim, out + i * q_per_group * head_dim, head_dim);
  }
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

// y[r, c] += add[r, c] for the columns [c0, c1) of `rows` rows (one float add each, as add_).
void add_columns(float* y, int64_t ldy, const float* add, int64_t ld_add, int64_t rows,
                 int64_t c0, int64_t c1) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = c0; c < c1; ++c) y[r * ldy + c] += add[r * ld_add + c];
}

// One product of the shared-step path for this thread's share of the weight rows:
// y[:, n0:n1] = x @ w[n0:n1].T (+ bias) for w [N, K], or the stacked row-parallel form
// [m, N, K/m] summed slice by slice as row_matmul_out does.  Returns [n0, n1).
std::pair<int64_t, int64_t> product_share(const float* x, int64_t ldx, const at::Tensor& w,
                                          float* y, int64_t ldy, int64_t rows, int64_t thread,
                                          int64_t threads, bool row_lanes,
                                          const float* bias = nullptr) {
  const int64_t n = w.size(-2), k = w.size(-1), slices = w.dim() == 3 ? w.size(0) : 1;
  const auto [n0, n1] = small_gemm_share(n, thread, threads);  // shapes: check_layer
  const float* wp = w.data_ptr<float>();
  for (int64_t i = 0; i < slices; ++i)
    small_gemm_rows(x + i * k, ldx, wp + i * (slices > 1 ? w.stride(0) : 0), w.stride(-2), y,
                    ldy, rows, n0, n1, k, i > 0, row_lanes, i == 0 ? bias : nullptr);
  return {n0, n1};
}

// h[:, n0:n1] += x @ w[n0:n1].T, this thread's share of a product that ends in the residual
// stream: a plain weight [N, K] adds each output to h as it is stored (one float add, as
// h.add_(part)); the stacked form [m, N, K/m] sums its slices into `part` first (their sum is
// what row_matmul_out adds to h).
void residual_share(const float* x, int64_t ldx, const at::Tensor& w, float* h, float* part,
                    int64_t hidden, int64_t rows, int64_t thread, int64_t threads,
                    bool row_lanes) {
  if (w.dim() == 2) {
    const auto [n0, n1] = small_gemm_share(w.size(0), thread, threads);
    small_gemm_rows(x, ldx, w.data_ptr<float>(), w.stride(0), h, hidden, rows, n0, n1,
                    w.size(1), true, row_lanes);
    return;
  }
  const auto [n0, n1] = product_share(x, ldx, w, part, hidden, rows, thread, threads, row_lanes);
  add_columns(h, hidden, part, hidden, rows, n0, n1);
}


// Can decode_layers take its batch on the shared-step path: more than one thread, 1 to
// kSmallGemmMaxRows rows (the small GEMM takes them whole), every matrix with unit inner stride
// (their shapes are check_layer's)?
bool shared_step_applies(int64_t batch, const std::vector<at::Tensor>& layer_weights,
                         const std::vector<at::Tensor>& biases) {
  if (at::get_num_threads() < 2 || batch < 1 || batch > kSmallGemmMaxRows ||
      !g_small_gemm.load(std::memory_order_relaxed))
    return false;
  for (size_t i = 0; i < layer_weights.size(); ++i)
    if (i % 6 != 0 && i % 6 != 3 && layer_weights[i].stride(-1) != 1) return false;  // not norms
  for (const at::Tensor& b : biases)
    if (b.defined() && !b.is_contiguous()) return false;
  return true;
}

// decode_layers on the shared-step path: one OpenMP parallel region for the whole step, in
// which every matrix product splits the weight rows between the threads (each weight byte is
// read once a step, not once per thread: at 32 rows the step streams half the bytes) and the
// norms split the batch rows and the attention the (row, KV group) pairs, with a barrier
// between the stages.  Every value is the same sum as on the row-block path (the small GEMM's
// outputs do not depend on the rows or threads around them; norms are per row, attention per
// pair), so both give the same bits.  h [B, H] is updated in place.
void layers_shared_step(at::Tensor& h, const std::vector<at::Tensor>& layer_weights,
                        const std::vector<at::Tensor>& biases,
                        const std::vector<AttentionInputs>& inputs, double eps, int64_t pos,
                        int64_t q_per_group, bool row_lanes) {
  const int64_t batch = h.size(0), hidden = h.size(1),
                num_layers = static_cast<int64_t>(inputs.size());
  const at::Tensor& w0 = layer_weights[1];
  const int64_t groups = inputs[0].k_cache.size(1), n_qkv = w0.size(0),
                n_attn = groups * q_per_group * inputs[0].k_cache.size(3),
                n_gu = layer_weights[4].size(0);
  const at::TensorOptions options = h.options();
  at::Tensor xn = at::empty({batch, hidden}, options), part = at::empty({batch, hidden}, options);
  at::Tensor qkv = at::empty({batch, n_qkv}, options), attn = at::empty({batch, n_attn}, options);
  // the MLP in the row-lane layout (small_gemm.h) where the products take the row-lane form:
  // gate/up stored as gu_t [2F, 32], the SwiGLU on it, and the down projection reading act_t
  // [F, 32] as its transposed input (no transposes in between); same bits as the row layout
  const bool mlp_in_lanes = row_lanes && row_lanes_supported() && layer_weights[5].dim() == 2;
  const int64_t mlp_rows = mlp_in_lanes ? kSmallGemmMaxRows : batch;
  at::Tensor gu = at::empty({mlp_rows, n_gu}, options), act = at::empty({mlp_rows, n_gu / 2}, options);
  std::vector<at::Tensor> norms;
  for (int64_t l = 0; l < num_layers; ++l)
    for (int j : {0, 3}) norms.push_back(layer_weights[6 * l + j].contiguous());
  float *hp = h.data_ptr<float>(), *xp = xn.data_ptr<float>(), *pp = part.data_ptr<float>(),
        *qp = qkv.data_ptr<float>(), *ap = attn.data_ptr<float>(), *gp = gu.data_ptr<float>(),
        *actp = act.data_ptr<float>();
  const float epsf = static_cast<float>(eps);
  const int threads = at::get_num_threads();
#pragma omp parallel num_threads(threads)
  {
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    const c10::AutoGradMode no_grad(false);  // grad mode is per thread; inference kernels
    const int64_t r0 = t * batch / nt, rows = (t + 1) * batch / nt - r0;
    const int64_t p0 = t * batch * groups / nt, p1 = (t + 1) * batch * groups / nt;  // pairs
    for (int64_t l = 0; l < num_layers; ++l) {
      const at::Tensor* w = layer_weights.data() + 6 * l;
      rms_norm_rows(hp + r0 * hidden, norms[2 * l].data_ptr<float>(), rows, hidden, epsf,
                    xp + r0 * hidden, nullptr);
#pragma omp barrier
      product_share(xp, hidden, w[1], qp, n_qkv, batch, t, nt, row_lanes,
                    biases[l].defined() ? biases[l].data_ptr<float>() : nullptr);
#pragma omp barrier
      attend_pairs(qp + p0 * n_qkv / groups, p0, p1, inputs[l], pos, q_per_group,
                   ap + p0 * n_attn / groups);
#pragma omp barrier
      residual_share(ap, n_attn, w[2], hp, pp, hidden, batch, t, nt, row_lanes);
#pragma omp barrier
      rms_norm_rows(hp + r0 * hidden, norms[2 * l + 1].data_ptr<float>(), rows, hidden, epsf,
                    xp + r0 * hidden, nullptr);
#pragma omp barrier
      if (mlp_in_lanes) {
        const auto [g0, g1] = small_gemm_share(n_gu, t, nt);  // whole panels: even
        small_gemm_rows_to_lanes(xp, hidden, batch, w[4].data_ptr<float>(), w[4].stride(0), gp,
                                 g0, g1, hidden);
        swiglu_forward_lanes(gp, actp, kSmallGemmMaxRows, g0 / 2, g1 / 2);
      } else {
        const auto [g0, g1] = product_share(xp, hidden, w[4], gp, n_gu, batch, t, nt, row_lanes);
        swiglu_forward_rows(gp + g0, n_gu, actp + g0 / 2, n_gu / 2, batch, (g1 - g0) / 2);
      }
#pragma omp barrier
      if (mlp_in_lanes) {
        const auto [d0, d1] = small_gemm_share(hidden, t, nt);
        small_gemm_rows_from_lanes(actp, batch, w[5].data_ptr<float>(), w[5].stride(0), hp,
                                   hidden, d0, d1, n_gu / 2, true);
      } else {
        residual_share(actp, n_gu / 2, w[5], hp, pp, hidden, batch, t, nt, row_lanes);
      }
#pragma omp barrier
    }
  }
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

void use_small_gemm(bool enabled) { g_small_gemm.store(enabled); }

at::Tensor decode_layers(const at::Tensor& x, const std::vector<at::Tensor>& layer_weights,
                         double eps, const at::Tensor& cos, const at::Tensor& sin,
                         at::Tensor& k_cache, at::Tensor& v_cache, int64_t pos,
                         const at::Tensor& key_mask, int64_t q_per_group,
                         const std::vector<std::optional<at::Tensor>>& qkv_biases,
                         bool row_lanes) {
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
  std::vector<AttentionInputs> inputs;  // each layer's cache views, made once
  for (int64_t l = 0; l < num_layers; ++l) {
    inputs.push_back({cos, sin, k_cache.select(0, l), v_cache.select(0, l), at::Tensor()});
    check_attention(x, layer_weights[6 * l + 1], biases[l], cos, sin, inputs[l].k_cache,
                    inputs[l].v_cache, pos, key_mask, q_per_group);
    check_layer(layer_weights.data() + 6 * l, x.size(1),
                k_cache.size(2) * q_per_group * k_cache.size(4));
  }
  const at::Tensor mask = key_mask.narrow(1, 0, pos + 1).contiguous();
  for (AttentionInputs& in : inputs) in.key_mask = mask;
  at::Tensor out = x.clone(at::MemoryFormat::Contiguous);
  if (shared_step_applies(x.size(0), layer_weights, biases)) {
    layers_shared_step(out, layer_weights, biases, inputs, eps, pos, q_per_group, row_lanes);
    return out;
  }
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
