// Small-M float32 GEMM reading the weight in place (see small_gemm.h).
//
// Register block: 4 rows of x by 4 rows of w = 16 accumulators of 16 lanes (AVX-512,
// x86-64-v4) or 8 lanes (x86-64-v3: AVX2 + FMA; a plain default); K is walked a vector at a
// time.  GCC vector extensions give one source for every variant, chosen once at load time.
// This is the one place of the extension compiled with FMA contraction (per-function
// attribute); everything else keeps ATen's separate multiply and add.
#include "small_gemm.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

// 16-lane vectors pass between always-inline helpers compiled into the AVX-512 variant only.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace hybridflow {
namespace {

typedef float v8 __attribute__((vector_size(32)));
typedef float v16 __attribute__((vector_size(64)));
constexpr int64_t kPanel = 4;  // weight rows per register block
// Fewest multiply-adds a thread takes (a few microseconds of work; at one row of x, 256 KiB of
// weights): below it one thread runs alone.
constexpr int64_t kMinMultiplyAdds = 1 << 16;

template <typename V>
constexpr int64_t lanes() {
  return sizeof(V) / sizeof(float);
}

template <typename V>
inline __attribute__((always_inline)) V load(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <typename V>
inline __attribute__((always_inline)) V load_tail(const float* p, int64_t n) {
  float tmp[lanes<V>()] = {0.f};
  std::memcpy(tmp, p, n * sizeof(float));
  return load<V>(tmp);
}

// Lanes added pairwise in a fixed order (16 lanes: the two halves first, then as 8).
inline __attribute__((always_inline)) float lane_sum(v8 v) {
  return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
}

inline __attribute__((always_inline)) float lane_sum(v16 v) {
  v8 lo, hi;
  std::memcpy(&lo, &v, sizeof lo);
  std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof lo, sizeof hi);
  return lane_sum(lo + hi);
}

template <typename V, int MB, int NB>
inline __attribute__((always_inline)) void block(const float* x, int64_t ldx, const float* w,
                                                 int64_t ldw, float* y, int64_t ldy, int64_t k,
                                                 bool accumulate) {
  constexpr int64_t L = lanes<V>();
  V acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = V{};
  int64_t kk = 0;
  for (; kk + L <= k; kk += L) {
    V wv[NB], xv[MB];
    for (int j = 0; j < NB; ++j) {
      wv[j] = load<V>(w + j * ldw + kk);
      // the next panel's rows (a hint: never faults past the end): the weights stream from
      // L3/memory once per call, and 4 strided rows defeat the hardware prefetcher (1.3-1.7x
      // at 16-32 rows on a Zen 5)
      __builtin_prefetch(w + (j + NB) * ldw + kk, 0, 3);
    }
    for (int i = 0; i < MB; ++i) xv[i] = load<V>(x + i * ldx + kk);
    for (int i = 0; i < MB; ++i)
      for (int j = 0; j < NB; ++j) acc[i][j] += xv[i] * wv[j];
  }
  if (kk < k) {
    V wv[NB], xv[MB];
    for (int j = 0; j < NB; ++j) wv[j] = load_tail<V>(w + j * ldw + kk, k - kk);
    for (int i = 0; i < MB; ++i) xv[i] = load_tail<V>(x + i * ldx + kk, k - kk);
    for (int i = 0; i < MB; ++i)
      for (int j = 0; j < NB; ++j) acc[i][j] += xv[i] * wv[j];
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) {
      const float s = lane_sum(acc[i][j]);
      y[i * ldy + j] = accumulate ? y[i * ldy + j] + s : s;
    }
}

template <typename V, int MB>
inline __attribute__((always_inline)) void row_block(const float* x, int64_t ldx,
                                                     const float* w, int64_t ldw, float* y,
                                                     int64_t ldy, int64_t n, int64_t k,
                                                     bool accumulate) {
  int64_t j = 0;
  for (; j + 4 <= n; j += 4)
    block<V, MB, 4>(x, ldx, w + j * ldw, ldw, y + j, ldy, k, accumulate);
  for (; j < n; ++j) block<V, MB, 1>(x, ldx, w + j * ldw, ldw, y + j, ldy, k, accumulate);
}

// Weight rows outer, x rows inner: each 4-row slice of w is read once from memory and used
// for every row of x while it sits in L1.
template <typename V>
inline __attribute__((always_inline)) void gemm_lanes(const float* x, int64_t ldx,
                                                      const float* w, int64_t ldw, float* y,
                                                      int64_t ldy, int64_t m, int64_t n,
                                                      int64_t k, bool accumulate) {
  for (int64_t j0 = 0; j0 < n; j0 += kPanel) {
    const int64_t nb = std::min(kPanel, n - j0);
    int64_t i = 0;
    for (; i + 4 <= m; i += 4)
      row_block<V, 4>(x + i * ldx, ldx, w + j0 * ldw, ldw, y + i * ldy + j0, ldy, nb, k,
                      accumulate);
    for (; i < m; ++i)
      row_block<V, 1>(x + i * ldx, ldx, w + j0 * ldw, ldw, y + i * ldy + j0, ldy, nb, k,
                      accumulate);
  }
}

// 8 lanes: x86-64-v3 (AVX2 + FMA) and a plain default clone.
__attribute__((target_clones("arch=x86-64-v3", "default"), optimize("fp-contract=fast")))
void gemm8(const float* x, int64_t ldx, const float* w, int64_t ldw, float* y, int64_t ldy,
           int64_t m, int64_t n, int64_t k, bool accumulate) {
  gemm_lanes<v8>(x, ldx, w, ldw, y, ldy, m, n, k, accumulate);
}

// 16 lanes where the CPU has AVX-512 (x86-64-v4: 32 vector registers hold the 16
// accumulators); 1.3-1.4x the 8-lane kernel on a Zen 5 core (4 to 32 rows).
__attribute__((target("arch=x86-64-v4"), optimize("fp-contract=fast")))
void gemm16(const float* x, int64_t ldx, const float* w, int64_t ldw, float* y, int64_t ldy,
            int64_t m, int64_t n, int64_t k, bool accumulate) {
  gemm_lanes<v16>(x, ldx, w, ldw, y, ldy, m, n, k, accumulate);
}

using GemmFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t,
                        int64_t, int64_t, bool);

GemmFn pick_gemm() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("x86-64-v4") ? gemm16 : gemm8;
}

const GemmFn gemm = pick_gemm();

}  // namespace

void small_linear_out(const at::Tensor& x, const at::Tensor& w, at::Tensor& y,
                      bool accumulate) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat &&
                  y.scalar_type() == at::kFloat && x.device().is_cpu() && w.device().is_cpu(),
              "small_linear: float32 CPU tensors expected, got x ", x.toString(), " and w ",
              w.toString());
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && y.dim() == 2 && x.size(1) == w.size(1) &&
                  y.size(0) == x.size(0) && y.size(1) == w.size(0),
              "small_linear: x [M, K], w [N, K], y [M, N] expected, got ", x.sizes(), ", ",
              w.sizes(), ", ", y.sizes());
  TORCH_CHECK(x.stride(1) == 1 && w.stride(1) == 1 && y.stride(1) == 1,
              "small_linear: rows of x, w and y need unit inner stride");
  // Threads split the weight rows (whole panels of kPanel): every output is the same sum
  // whichever thread computes it, so the result does not depend on the thread count.
  const int64_t m = x.size(0), n = w.size(0), k = x.size(1);
  const int64_t panels = (n + kPanel - 1) / kPanel;
  const int64_t grain = std::max<int64_t>(1, kMinMultiplyAdds / std::max<int64_t>(1, kPanel * k * m));
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t ldx = x.stride(0), ldw = w.stride(0), ldy = y.stride(0);
  at::parallel_for(0, panels, grain, [&](int64_t begin, int64_t end) {
    const int64_t j0 = begin * kPanel, j1 = std::min(n, end * kPanel);
    gemm(xp, ldx, wp + j0 * ldw, ldw, yp + j0, ldy, m, j1 - j0, k, accumulate);
  });
}

}  // namespace hybridflow
