// 16-float vectors (GCC vector extensions) for the engine's elementwise kernels: one source
// for every target_clones variant (AVX-512: one register; AVX2 and plain: split by the
// compiler).  Used by rms_norm.cpp, swiglu.cpp, vocab_rows.cpp and decode_layer.cpp.
#pragma once

#include <cstdint>
#include <cstring>

// 16-lane vectors pass between inline helpers compiled into every clone.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace hybridflow::vec {

typedef float vf __attribute__((vector_size(64)));    // 16 floats
typedef int32_t vi __attribute__((vector_size(64)));  // 16 int32

constexpr int64_t kLanes = 16;

inline vf splat(float x) { return vf{} + x; }

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

// Lanes summed in index order.
inline float lane_sum(vf v) {
  float s = 0.f;
  for (int64_t l = 0; l < kLanes; ++l) s += v[l];
  return s;
}

// exp(x) within 2 ulp on [-87.3, 88.3] (x is clamped to it, so exp(-inf) gives 1.2e-38, not
// 0): x = n ln2 + r, |r| <= ln2 / 2, exp(r) by the minimax polynomial of Cephes' expf, 2^n
// written into the exponent bits.
inline vf exp(vf x) {
  x = x < splat(88.3f) ? x : splat(88.3f);
  x = x > splat(-87.3f) ? x : splat(-87.3f);
  const vf magic = splat(12582912.f);  // 1.5 * 2^23: adding it rounds to an integer
  const vf n = (x * splat(1.44269504088896341f) + magic) - magic;
  const vf r = (x - n * splat(0.693359375f)) - n * splat(-2.12194440e-4f);
  vf p = splat(1.9875691500e-4f);
  p = p * r + splat(1.3981999507e-3f);
  p = p * r + splat(8.3334519073e-3f);
  p = p * r + splat(4.1665795894e-2f);
  p = p * r + splat(1.6666665459e-1f);
  p = p * r + splat(5.0000001201e-1f);
  p = p * (r * r) + r + splat(1.f);
  const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
  vf scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

}  // namespace hybridflow::vec
