// One decode step's attention over the KV cache, by (sequence, KV group) pairs: RoPE of the new
// token's query and key, the cache writes, the scores, the softmax and the weighted values
// (both paths of decode_layer.cpp).  CPU float32.
#pragma once

#include <cstdint>

namespace hybridflow {

// Positions per tile of the cached keys (engine/kv_cache.py KEY_TILE): a (sequence, KV group)'s
// keys are tiles [T, D, kKeyTile], tile t holding positions t * kKeyTile + [0, kKeyTile) as D
// rows, so the keys of positions [0, n) are one contiguous run read front to back.
constexpr int64_t kKeyTile = 64;

// One layer's caches, the step's RoPE rows and the key mask as raw pointers (the caller checks
// the shapes: decode_layer.cpp's check_attention):
//   k      [B, h_kv, T, D, kKeyTile] contiguous: keys in tiles (T * kKeyTile >= L)
//   v      [B, h_kv, L, D] contiguous
//   cos, sin: the new token's RoPE row of sequence b at cos + b * cos_stride ([B, D] with unit
//          inner stride), likewise sin
//   mask:  row b at mask + b * mask_stride: which cached positions are real tokens
struct AttentionView {
  float* k;
  float* v;
  int64_t groups, tiles, max_len, head_dim;
  const float* cos;
  const float* sin;
  int64_t cos_stride, sin_stride;
  const bool* mask;
  int64_t mask_stride;
};

// Work space of attend_pairs for n pairs at position pos (Q/G queries per pair, D = head_dim):
// q_rot n * Q/G * D floats, scores and probs n * Q/G * (pos + 1) floats each.
struct AttentionScratch {
  float* q_rot;
  float* scores;
  float* probs;
};

// The (sequence, KV group) pairs [bg0, bg1) of the batch (pair bg = sequence bg / h_kv, group
// bg % h_kv) from their qkv blocks at `qkv_p` (per pair (Q/G+2)*D floats: Q/G queries, the key,
// the value; bias added): RoPE -> cache write at pos -> attention over positions [0, pos];
// writes each pair's attention output (Q/G*D floats, before the o projection) contiguously
// from `out`.  Pairs rather than rows, so that threads can share the attention of fewer rows
// than threads (batch 1: one group each).  The softmax is ATen's (as in engine/layers.py).
void attend_pairs(const float* qkv_p, int64_t bg0, int64_t bg1, const AttentionView& in,
                  int64_t pos, int64_t q_per_group, const AttentionScratch& scratch, float* out);

}  // namespace hybridflow
