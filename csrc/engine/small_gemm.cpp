// Small-M float32 GEMM reading the weight in place (see small_gemm.h).
//
// Register block: 4 rows of x by 4 rows of w = 16 accumulators of 16 lanes (AVX-512,
// x86-64-v4) or 8 lanes (x86-64-v3: AVX2 + FMA; a plain default); K is walked a vector at a
// time.  GCC vector extensions give one source for every variant, chosen once at load time.
// The row-lane form (AVX-512 only) puts 16 rows of x in the lanes instead: x is transposed into
// a per-thread buffer, each weight element is broadcast, and every output is one chain of
// fused multiply-adds over k in order (no lane sums).
// This is the one place of the extension compiled with FMA contraction (per-function
// attribute); everything else keeps ATen's separate multiply and add.
#include "small_gemm.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

// 16-lane vectors pass between always-inline helpers compiled into the AVX-512 variant only.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace hybridflow {
namespace {

typedef float v8 __attribute__((vector_size(32)));
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i8 __attribute__((vector_size(32)));
typedef int32_t i16 __attribute__((vector_size(64)));
constexpr int64_t kPanel = kSmallGemmPanel;  // weight rows per register block
// Accumulators of a register block of the row-lane form: 8 weight rows x 2 vectors of rows of
// x, or 16 weight rows x 1.
constexpr int kRowLaneAccumulators = 16;
// Locality hint of the weight prefetches: prefetcht1 (into L2 and L3).  The weights are read
// once per decode step.  A non-temporal prefetch (prefetchnta) keeps them out of the KV
// cache's way in L3 on some AMD cores, but on Intel server cores it fills L1 only and bypasses
// L2/L3, so weights that would fit in L3 stream from memory every step, several times slower;
// on an AMD EPYC (Zen 4) prefetcht1 was as fast at batch 32 and faster at batch 1
// (`bench/roofline.py --shape small` times both decode steps; docs/benchmarks.md).
constexpr int kWeightLocality = 2;
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

// Sums of the lanes of L vectors at once (transpose-reduce): pairs of vectors holding O outputs
// of P partial sums each (O * P = L lanes) are combined into vectors of 2 O outputs of P / 2
// partials by two shuffles and an add, until one vector holds the L sums in order.  For the
// 16 accumulators of a 4 x 4 block: 45 vector instructions instead of ~16 each.
template <int L, int P, bool High>
constexpr int reduce_lane(int t) {
  const int half = P / 2, out = t / half;
  return (out < L / P ? out * P : L + (out - L / P) * P) + t % half + (High ? half : 0);
}

template <typename I, int L, int P, bool High, std::size_t... T>
constexpr I reduce_mask(std::index_sequence<T...>) {
  return I{reduce_lane<L, P, High>(static_cast<int>(T))...};
}

template <typename V, typename I, int P>
inline __attribute__((always_inline)) V combine(V a, V b) {
  constexpr int L = lanes<V>();
  constexpr I lo = reduce_mask<I, L, P, false>(std::make_index_sequence<L>{});
  constexpr I hi = reduce_mask<I, L, P, true>(std::make_index_sequence<L>{});
  return __builtin_shuffle(a, b, lo) + __builtin_shuffle(a, b, hi);
}

// a[0 .. L) -> one vector whose lane i is the sum of a[i]'s lanes (a is overwritten)
template <typename V, typename I>
inline __attribute__((always_inline)) V reduce_lanes(V* a) {
  constexpr int L = lanes<V>();
  int n = L;
  if constexpr (L == 16) {
    for (int i = 0; i < n / 2; ++i) a[i] = combine<V, I, 16>(a[2 * i], a[2 * i + 1]);
    n /= 2;
  }
  for (int i = 0; i < n / 2; ++i) a[i] = combine<V, I, 8>(a[2 * i], a[2 * i + 1]);
  n /= 2;
  for (int i = 0; i < n / 2; ++i) a[i] = combine<V, I, 4>(a[2 * i], a[2 * i + 1]);
  return combine<V, I, 2>(a[0], a[1]);
}

template <typename V, int MB, int NB>
inline __attribute__((always_inline)) void block(const float* x, int64_t ldx, const float* w,
                                                 int64_t ldw, float* y, int64_t ldy, int64_t k,
                                                 bool accumulate, const float* bias) {
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
      // L3/memory once per call, and 4 strided rows defeat the hardware prefetcher
      __builtin_prefetch(w + (j + NB) * ldw + kk, 0, kWeightLocality);
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
  // the MB * NB sums by one transpose-reduce, the accumulators in the first slots and zeros
  // after them: every output is summed by the same tree whatever block it is in, so a row's
  // result does not depend on how many rows come with it
  using I = std::conditional_t<lanes<V>() == 16, i16, i8>;
  constexpr int64_t count = MB * NB, groups = (count + L - 1) / L;
  V a[groups * L];
  for (int t = 0; t < groups * L; ++t) a[t] = t < count ? acc[t / NB][t % NB] : V{};
  float sums[groups * L];
  for (int g = 0; g < groups; ++g) {
    const V r = reduce_lanes<V, I>(a + g * L);
    std::memcpy(sums + g * L, &r, sizeof r);
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) {
      const float s = sums[i * NB + j];
      y[i * ldy + j] = accumulate ? y[i * ldy + j] + s : bias != nullptr ? s + bias[j] : s;
    }
}

template <typename V, int MB>
inline __attribute__((always_inline)) void row_block(const float* x, int64_t ldx,
                                                     const float* w, int64_t ldw, float* y,
                                                     int64_t ldy, int64_t n, int64_t k,
                                                     bool accumulate, const float* bias) {
  int64_t j = 0;
  for (; j + 4 <= n; j += 4)
    block<V, MB, 4>(x, ldx, w + j * ldw, ldw, y + j, ldy, k, accumulate,
                    bias != nullptr ? bias + j : nullptr);
  for (; j < n; ++j)
    block<V, MB, 1>(x, ldx, w + j * ldw, ldw, y + j, ldy, k, accumulate,
                    bias != nullptr ? bias + j : nullptr);
}

// Weight rows outer, x rows inner: each 4-row slice of w is read once from memory and used
// for every row of x while it sits in L1.
template <typename V>
inline __attribute__((always_inline)) void gemm_lanes(const float* x, int64_t ldx,
                                                      const float* w, int64_t ldw, float* y,
                                                      int64_t ldy, int64_t m, int64_t n,
                                                      int64_t k, bool accumulate,
                                                      const float* bias) {
  for (int64_t j0 = 0; j0 < n; j0 += kPanel) {
    const int64_t nb = std::min(kPanel, n - j0);
    const float* b = bias != nullptr ? bias + j0 : nullptr;
    int64_t i = 0;
    for (; i + 4 <= m; i += 4)
      row_block<V, 4>(x + i * ldx, ldx, w + j0 * ldw, ldw, y + i * ldy + j0, ldy, nb, k,
                      accumulate, b);
    for (; i < m; ++i)
      row_block<V, 1>(x + i * ldx, ldx, w + j0 * ldw, ldw, y + i * ldy + j0, ldy, nb, k,
                      accumulate, b);
  }
}

// 8 lanes: x86-64-v3 (AVX2 + FMA) and a plain default clone.
__attribute__((target_clones("arch=x86-64-v3", "default"), optimize("fp-contract=fast")))
void gemm8(const float* x, int64_t ldx, const float* w, int64_t ldw, float* y, int64_t ldy,
           int64_t m, int64_t n, int64_t k, bool accumulate, const float* bias) {
  gemm_lanes<v8>(x, ldx, w, ldw, y, ldy, m, n, k, accumulate, bias);
}

// 16 lanes where the CPU has AVX-512 (x86-64-v4: 32 vector registers hold the 16
// accumulators); 1.3-1.4x the 8-lane kernel on a Zen 5 core (4 to 32 rows).
__attribute__((target("arch=x86-64-v4"), optimize("fp-contract=fast")))
void gemm16(const float* x, int64_t ldx, const float* w, int64_t ldw, float* y, int64_t ldy,
            int64_t m, int64_t n, int64_t k, bool accumulate, const float* bias) {
  gemm_lanes<v16>(x, ldx, w, ldw, y, ldy, m, n, k, accumulate, bias);
}

// ---- the row-lane form: lanes over the rows of x ------------------------------------------

// x rows [0, m) (m <= kSmallGemmMaxRows), columns [0, k) -> xt [k, 32]: xt[c * 32 + r] = x[r, c],
// rows m .. 15 (m <= 16) or m .. 31 zero: the vectors the blocks read.  16 x 16 blocks
// transposed in registers (4 rounds of two-source shuffles).
template <int S, bool High, std::size_t... T>
constexpr i16 transpose_mask(std::index_sequence<T...>) {
  // round S swaps the S x S sub-blocks: lanes [0, S) of each 2S group from a, the next S from b
  return i16{(static_cast<int>(T) % (2 * S) < S
                  ? static_cast<int>(T / (2 * S) * 2 * S + T % (2 * S) + (High ? S : 0))
                  : static_cast<int>(16 + T / (2 * S) * 2 * S + T % (2 * S) - S +
                                     (High ? S : 0)))...};
}

template <int S>
inline __attribute__((always_inline)) void transpose_round(v16* r) {
  constexpr i16 lo = transpose_mask<S, false>(std::make_index_sequence<16>{});
  constexpr i16 hi = transpose_mask<S, true>(std::make_index_sequence<16>{});
  for (int g = 0; g < 16; g += 2 * S)
    for (int i = g; i < g + S; ++i) {
      const v16 a = r[i], b = r[i + S];
      r[i] = __builtin_shuffle(a, b, lo);
      r[i + S] = __builtin_shuffle(a, b, hi);
    }
}

inline __attribute__((always_inline)) void transpose_rows(const float* x, int64_t ldx, int64_t m,
                                                          int64_t k, float* xt) {
  constexpr int64_t ld = kSmallGemmMaxRows;
  for (int64_t r0 = 0; r0 < (m > 16 ? ld : 16); r0 += 16) {
    int64_t c0 = 0;
    for (; c0 + 16 <= k; c0 += 16) {
      v16 r[16];
      for (int i = 0; i < 16; ++i)
        r[i] = r0 + i < m ? load<v16>(x + (r0 + i) * ldx + c0) : v16{};
      transpose_round<8>(r);
      transpose_round<4>(r);
      transpose_round<2>(r);
      transpose_round<1>(r);
      for (int j = 0; j < 16; ++j) std::memcpy(xt + (c0 + j) * ld + r0, &r[j], sizeof r[j]);
    }
    for (; c0 < k; ++c0)
      for (int64_t i = 0; i < 16; ++i)
        xt[c0 * ld + r0 + i] = r0 + i < m ? x[(r0 + i) * ldx + c0] : 0.f;
  }
}

// Outputs of NB weight rows by MV vectors of 16 rows of x, from xt: acc[j][v] holds y[16 v + i,
// j] in lane i.  Stored as they are (vector stores) at yt + j * ldt + 16 v.
template <int NB, int MV>
inline __attribute__((always_inline)) void row_lane_block(const float* xt, const float* w,
                                                          int64_t ldw, float* yt, int64_t ldt,
                                                          int64_t k) {
  constexpr int64_t ld = kSmallGemmMaxRows;
  v16 acc[NB][MV];
  for (int j = 0; j < NB; ++j)
    for (int v = 0; v < MV; ++v) acc[j][v] = v16{};
  for (int64_t kk = 0; kk < k; ++kk) {
    v16 xv[MV];
    for (int v = 0; v < MV; ++v) xv[v] = load<v16>(xt + kk * ld + 16 * v);
    if (kk % 16 == 0)  // the next block's rows, a cache line each (a hint, as in block above)
      for (int j = 0; j < NB; ++j)
        __builtin_prefetch(w + (j + NB) * ldw + kk, 0, kWeightLocality);
    for (int j = 0; j < NB; ++j) {
      const v16 b = w[j * ldw + kk] - v16{};  // broadcast
      for (int v = 0; v < MV; ++v) acc[j][v] = xv[v] * b + acc[j][v];
    }
  }
  for (int j = 0; j < NB; ++j)
    for (int v = 0; v < MV; ++v) std::memcpy(yt + j * ldt + 16 * v, &acc[j][v], sizeof(v16));
}

// y[0:m, 0:nb] (+)= the chunk yt [nb, 16 MV] (yt[j, i] = y[i, j]), nb <= 16: each 16 x 16
// block transposed in registers, then one vector store per row of y instead of 16 scalar
// stores (a chunk of fewer than 16 columns, at the end of a share, is stored element by
// element).  Every output is stored, or added to y once, as before; a bias is added to each.
template <int MV>
inline __attribute__((always_inline)) void store_chunk(const float* yt, int64_t nb, float* y,
                                                       int64_t ldy, int64_t m, bool accumulate,
                                                       const float* bias) {
  v16 b{};
  if (bias != nullptr) {
    float lanes[16] = {};
    std::memcpy(lanes, bias, nb * sizeof(float));
    b = load<v16>(lanes);
  }
  for (int v = 0; v < MV; ++v) {
    v16 r[16];
    for (int j = 0; j < 16; ++j) r[j] = j < nb ? load<v16>(yt + j * 16 * MV + 16 * v) : v16{};
    transpose_round<8>(r);
    transpose_round<4>(r);
    transpose_round<2>(r);
    transpose_round<1>(r);
    const int64_t rows = std::min<int64_t>(16, m - 16 * v);
    for (int64_t i = 0; i < rows; ++i) {
      float* yr = y + (16 * v + i) * ldy;
      if (nb == 16) {
        const v16 out = accumulate ? load<v16>(yr) + r[i] : bias != nullptr ? r[i] + b : r[i];
        std::memcpy(yr, &out, sizeof out);
      } else {
        float lanes[16];
        std::memcpy(lanes, &r[i], sizeof lanes);
        for (int64_t j = 0; j < nb; ++j)
          yr[j] = accumulate ? yr[j] + lanes[j] : bias != nullptr ? lanes[j] + bias[j] : lanes[j];
      }
    }
  }
}

// y[0:m, 0:n] (+)= x @ w[0:n].T from xt, in chunks of 16 weight rows (kRowLaneAccumulators / MV
// rows a register block) stored by store_chunk.
template <int MV>
inline __attribute__((always_inline)) void row_lane_rows(const float* xt, const float* w,
                                                         int64_t ldw, float* y, int64_t ldy,
                                                         int64_t m, int64_t n, int64_t k,
                                                         bool accumulate, const float* bias) {
  constexpr int nb = kRowLaneAccumulators / MV;  // weight rows a block
  alignas(64) float yt[16 * 16 * MV];             // one chunk: 16 weight rows x 16 MV rows
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    for (int b = 0; b < 16; b += nb)
      row_lane_block<nb, MV>(xt, w + (j + b) * ldw, ldw, yt + b * 16 * MV, 16 * MV, k);
    store_chunk<MV>(yt, 16, y + j, ldy, m, accumulate, bias != nullptr ? bias + j : nullptr);
  }
  if (j < n) {
    int64_t b = 0;
    for (; j + b + 4 <= n; b += 4)
      row_lane_block<4, MV>(xt, w + (j + b) * ldw, ldw, yt + b * 16 * MV, 16 * MV, k);
    for (; j + b < n; ++b)
      row_lane_block<1, MV>(xt, w + (j + b) * ldw, ldw, yt + b * 16 * MV, 16 * MV, k);
    store_chunk<MV>(yt, n - j, y + j, ldy, m, accumulate, bias != nullptr ? bias + j : nullptr);
  }
}

// This thread's buffer for x [<= 32, k] transposed into the lane layout ([k, 32] floats).
inline float* thread_lanes(int64_t k) {
  thread_local std::vector<float> xt;
  if (static_cast<int64_t>(xt.size()) < k * kSmallGemmMaxRows) xt.resize(k * kSmallGemmMaxRows);
  return xt.data();
}

// y[0:m, 0:n] (+)= x @ w[0:n].T (+ bias) from xt, x's m <= 32 rows in the lane layout.
__attribute__((target("arch=x86-64-v4"), optimize("fp-contract=fast")))
void gemm_from_lanes(const float* xt, int64_t m, const float* w, int64_t ldw, float* y,
                     int64_t ldy, int64_t n, int64_t k, bool accumulate, const float* bias) {
  if (m > 16)
    row_lane_rows<2>(xt, w, ldw, y, ldy, m, n, k, accumulate, bias);
  else
    row_lane_rows<1>(xt, w, ldw, y, ldy, m, n, k, accumulate, bias);
}

__attribute__((target("arch=x86-64-v4"), optimize("fp-contract=fast")))
void gemm_row_lanes(const float* x, int64_t ldx, const float* w, int64_t ldw, float* y,
                    int64_t ldy, int64_t m, int64_t n, int64_t k, bool accumulate,
                    const float* bias) {
  float* xt = thread_lanes(k);
  for (int64_t i = 0; i < m; i += kSmallGemmMaxRows) {  // a decode step: one pass of <= 32
    const int64_t rows = std::min(kSmallGemmMaxRows, m - i);
    transpose_rows(x + i * ldx, ldx, rows, k, xt);
    gemm_from_lanes(xt, rows, w, ldw, y + i * ldy, ldy, n, k, accumulate, bias);
  }
}

// y_t [n, 32] = (x @ w[0:n].T) in the lane layout, from x [m, k] row-major (rows past m of
// y_t hold the products of zero rows).
template <int MV>
inline __attribute__((always_inline)) void row_lane_rows_t(const float* xt, const float* w,
                                                           int64_t ldw, float* yt, int64_t n,
                                                           int64_t k) {
  constexpr int nb = kRowLaneAccumulators / MV;
  constexpr int64_t ld = kSmallGemmMaxRows;
  int64_t j = 0;
  for (; j + nb <= n; j += nb) row_lane_block<nb, MV>(xt, w + j * ldw, ldw, yt + j * ld, ld, k);
  for (; j + 4 <= n; j += 4) row_lane_block<4, MV>(xt, w + j * ldw, ldw, yt + j * ld, ld, k);
  for (; j < n; ++j) row_lane_block<1, MV>(xt, w + j * ldw, ldw, yt + j * ld, ld, k);
}

__attribute__((target("arch=x86-64-v4"), optimize("fp-contract=fast")))
void gemm_to_lanes(const float* x, int64_t ldx, int64_t m, const float* w, int64_t ldw,
                   float* yt, int64_t n, int64_t k) {
  float* xt = thread_lanes(k);
  transpose_rows(x, ldx, m, k, xt);
  if (m > 16)
    row_lane_rows_t<2>(xt, w, ldw, yt, n, k);
  else
    row_lane_rows_t<1>(xt, w, ldw, yt, n, k);
}

using GemmFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t,
                        int64_t, int64_t, bool, const float*);

GemmFn pick_gemm() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("x86-64-v4") ? gemm16 : gemm8;
}

const GemmFn gemm = pick_gemm();
// the row-lane form is AVX-512 code: it runs where the 16-lane k-lane kernel does
const bool row_lanes_here = gemm == gemm16;

std::atomic<bool> g_enabled{true};

}  // namespace

void use_small_gemm(bool enabled) { g_enabled.store(enabled); }

bool small_gemm_enabled() { return g_enabled.load(std::memory_order_relaxed); }

std::pair<int64_t, int64_t> small_gemm_share(int64_t n, int64_t thread, int64_t threads) {
  const int64_t panels = (n + kPanel - 1) / kPanel;
  return {std::min(n, thread * panels / threads * kPanel),
          std::min(n, (thread + 1) * panels / threads * kPanel)};
}

bool row_lanes_supported() { return row_lanes_here; }

void small_gemm_rows(const float* x, int64_t ldx, const float* w, int64_t ldw, float* y,
                     int64_t ldy, int64_t m, int64_t n0, int64_t n1, int64_t k, bool accumulate,
                     bool row_lanes, const float* bias) {
  if (n1 <= n0) return;
  const float* b = bias != nullptr ? bias + n0 : nullptr;
  if (row_lanes && row_lanes_here)
    gemm_row_lanes(x, ldx, w + n0 * ldw, ldw, y + n0, ldy, m, n1 - n0, k, accumulate, b);
  else
    gemm(x, ldx, w + n0 * ldw, ldw, y + n0, ldy, m, n1 - n0, k, accumulate, b);
}

void small_gemm_rows_to_lanes(const float* x, int64_t ldx, int64_t m, const float* w,
                              int64_t ldw, float* yt, int64_t n0, int64_t n1, int64_t k) {
  if (n1 > n0) gemm_to_lanes(x, ldx, m, w + n0 * ldw, ldw, yt + n0 * kSmallGemmMaxRows, n1 - n0, k);
}

void small_gemm_rows_from_lanes(const float* xt, int64_t m, const float* w, int64_t ldw,
                                float* y, int64_t ldy, int64_t n0, int64_t n1, int64_t k,
                                bool accumulate) {
  if (n1 > n0)
    gemm_from_lanes(xt, m, w + n0 * ldw, ldw, y + n0, ldy, n1 - n0, k, accumulate, nullptr);
}

void small_linear_out(const at::Tensor& x, const at::Tensor& w, at::Tensor& y, bool accumulate,
                      bool row_lanes) {
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
  const int64_t grain =
      std::max<int64_t>(1, kMinMultiplyAdds / std::max<int64_t>(1, kPanel * k * m));
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t ldx = x.stride(0), ldw = w.stride(0), ldy = y.stride(0);
  at::parallel_for(0, panels, grain, [&](int64_t begin, int64_t end) {
    small_gemm_rows(xp, ldx, wp, ldw, yp, ldy, m, begin * kPanel, std::min(n, end * kPanel), k,
                    accumulate, row_lanes);
  });
}

}  // namespace hybridflow
