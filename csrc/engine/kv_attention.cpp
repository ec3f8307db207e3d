// See kv_attention.h.
#include "kv_attention.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>

#include "row_ops.h"
#include "vec_math.h"

namespace hybridflow {
namespace {

using vec::kLanes;
using vec::splat;
using vec::vf;
constexpr int kMaxBlockQueries = 8;  // the blocked loops below take up to 8 queries per group
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
      } else if (n > 0) {  // always (v < ceil(valid / 16)); said for the compiler's bounds
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

}  // namespace

void attend_pairs(const float* qkv_p, int64_t bg0, int64_t bg1, const AttentionView& in,
                  int64_t pos, int64_t q_per_group, const AttentionScratch& scratch, float* out) {
  const int64_t n = bg1 - bg0;
  if (n <= 0) return;
  const int64_t groups = in.groups, head_dim = in.head_dim,
                key_block = in.tiles * head_dim * kKeyTile, max_len = in.max_len,
                per_group = q_per_group + 2, num_keys = pos + 1;
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  float* qr = scratch.q_rot;
  float* sc = scratch.scores;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t bg = bg0 + i, b = bg / groups;
    const float* block = qkv_p + i * per_group * head_dim;
    const float* c = in.cos + b * in.cos_stride;
    const float* s = in.sin + b * in.sin_stride;
    float* qb = qr + i * q_per_group * head_dim;
    for (int64_t j = 0; j < q_per_group; ++j)
      rope_row(block + j * head_dim, c, s, head_dim, qb + j * head_dim);
    float* kb = in.k + bg * key_block;           // [T, D, kKeyTile]
    float* vb = in.v + bg * max_len * head_dim;  // [L, D]
    float k_rot[kMaxHeadDim];
    rope_row(block + q_per_group * head_dim, c, s, head_dim, k_rot);
    const float* v_new = block + (q_per_group + 1) * head_dim;
    for (int64_t d = 0; d < head_dim; ++d) {
      kb[key_offset(pos, d, head_dim)] = k_rot[d];
      vb[pos * head_dim + d] = v_new[d];
    }
    const float* k_next = i + 1 < n ? kb + key_block : kb;
    attention_scores(qb, kb, k_next, in.mask + b * in.mask_stride, q_per_group, num_keys,
                     head_dim, scale, sc + i * q_per_group * num_keys, k_rot);
  }
  {
    const at::TensorOptions options = at::TensorOptions().dtype(at::kFloat);
    at::Tensor probs = at::from_blob(scratch.probs, {n, q_per_group, num_keys}, options);
    at::_softmax_out(probs, at::from_blob(sc, {n, q_per_group, num_keys}, options), -1, false);
  }
  const float* pr = scratch.probs;
  for (int64_t i = 0; i < n; ++i) {
    const float* vb = in.v + (bg0 + i) * max_len * head_dim;
    weighted_values(pr + i * q_per_group * num_keys, vb,
                    i + 1 < n ? vb + max_len * head_dim : vb, q_per_group, num_keys, head_dim,
                    head_dim, out + i * q_per_group * head_dim, head_dim);
  }
}

}  // namespace hybridflow
