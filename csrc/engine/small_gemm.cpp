// Small-M float32 GEMM reading the weight in place (see small_gemm.h).
//
// Register block: 4 rows of x by 4 rows of w = 16 accumulators of 8 lanes; K is walked 8
// floats at a time.  GCC vector extensions give one source for every clone: x86-64-v4
// (AVX-512VL: 32 vector registers, no spills), x86-64-v3 (AVX2 + FMA) and a plain default.
// This is the one place of the extension compiled with FMA contraction (per-function
// attribute); everything else keeps ATen's separate multiply and add.
#include "small_gemm.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

namespace hybridflow {
namespace {

typedef float v8 __attribute__((vector_size(32)));
constexpr int64_t kLanes = 8;
constexpr int64_t kPanel = 4;  // weight rows per register block
// Fewest multiply-adds a thread takes (a few microseconds of work; at one row of x, 256 KiB of
// weights): below it one thread runs alone.
constexpr int64_t kMinMultiplyAdds = 1 << 16;

inline __attribute__((always_inline)) v8 load(const float* p) {
  v8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline __attribute__((always_inline)) v8 load_tail(const float* p, int64_t n) {
  float tmp[kLanes] = {0.f};
  std::memcpy(tmp, p, n * sizeof(float));
  return load(tmp);
}

// Lanes added pairwise in a fixed order.
inline __attribute__((always_inline)) float lane_sum(v8 v) {
  return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
}

template <int MB, int NB>
inline __attribute__((always_inline)) void block(const float* x, int64_t ldx, const float* w,
                                                 int64_t ldw, float* y, int64_t ldy, int64_t k,
                                                 bool accumulate) {
  v8 acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = v8{};
  int64_t kk = 0;
  for (; kk + kLanes <= k; kk += kLanes) {
    v8 wv[NB], xv[MB];
    for (int j = 0; j < NB; ++j) wv[j] = load(w + j * ldw + kk);
    for (int i = 0; i < MB; ++i) xv[i] = load(x + i * ldx + kk);
    for (int i = 0; i < MB; ++i)
      for (int j = 0; j < NB; ++j) acc[i][j] += xv[i] * wv[j];
  }
  if (kk < k) {
    v8 wv[NB], xv[MB];
    for (int j = 0; j < NB; ++j) wv[j] = load_tail(w + j * ldw + kk, k - kk);
    for (int i = 0; i < MB; ++i) xv[i] = load_tail(x + i * ldx + kk, k - kk);
    for (int i = 0; i < MB; ++i)
      for (int j = 0; j < NB; ++j) acc[i][j] += xv[i] * wv[j];
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) {
      const float s = lane_sum(acc[i][j]);
      y[i * ldy + j] = accumulate ? y[i * ldy + j] + s : s;
    }
}

template <int MB>
inline __attribute__((always_inline)) void row_block(const float* x, int64_t ldx,
                                                     const float* w, int64_t ldw, float* y,
                                                     int64_t ldy, int64_t n, int64_t k,
                                                     bool accumulate) {
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) block<MB, 4>(x, ldx, w + j * ldw, ldw, y + j, ldy, k, accumulate);
  for (; j < n; ++j) block<MB, 1>(x, ldx, w + j * ldw, ldw, y + j, ldy, k, accumulate);
}

// Weight rows outer, x rows inner: each 4-row slice of w is read once from memory and used
// for every row of x while it sits in L1.
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default"),
               optimize("fp-contract=fast")))
void gemm(const float* x, int64_t ldx, const float* w, int64_t ldw, float* y, int64_t ldy,
          int64_t m, int64_t n, int64_t k, bool accumulate) {
  for (int64_t j0 = 0; j0 < n; j0 += kPanel) {
    const int64_t nb = std::min(kPanel, n - j0);
    int64_t i = 0;
    for (; i + 4 <= m; i += 4)
      row_block<4>(x + i * ldx, ldx, w + j0 * ldw, ldw, y + i * ldy + j0, ldy, nb, k,
                   accumulate);
    for (; i < m; ++i)
      row_block<1>(x + i * ldx, ldx, w + j0 * ldw, ldw, y + i * ldy + j0, ldy, nb, k,
                   accumulate);
  }
}

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
