// See vocab_rows.h.  In ATen a greedy step is max() (which also finds the index, at several
// times the cost of amax) and logsumexp (max, subtract, exp, sum: four passes); here the row
// maximum on vectors, the first column holding it, and one pass of exp(z - max) on vectors
// (the polynomial exp of vec_math.h, 2 ulp), summed in 32 lanes.  Rows go to the intra-op threads.
#include "vocab_rows.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "row_ops.h"
#include "vec_math.h"

namespace hybridflow {
namespace {

using vec::kLanes;
using vec::load;
using vec::splat;
using vec::vf;
using vec::vi;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// The largest value of z[a, b) (NaNs skipped) and the first column holding it: each lane keeps
// its largest value and where it first saw it (only a strictly larger value moves it), then
// the lanes holding the largest value give the smallest such column.  at = -1 when no value is
// above -inf (an empty range, all NaN or all -inf).
struct ColumnMax {
  float value;
  int64_t at;
};

__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
ColumnMax range_argmax(const float* z, int64_t a, int64_t b) {
  vf m0 = splat(kNegInf), m1 = m0;
  vi at0 = vi{} - 1, at1 = at0, col;
  for (int64_t l = 0; l < kLanes; ++l) col[l] = static_cast<int32_t>(l);
  int64_t j = a;
  for (; j + 2 * kLanes <= b; j += 2 * kLanes) {
    const vf x0 = load(z + j), x1 = load(z + j + kLanes);
    const vi c0 = col + static_cast<int32_t>(j), c1 = c0 + static_cast<int32_t>(kLanes);
    const vi up0 = x0 > m0, up1 = x1 > m1;
    m0 = up0 ? x0 : m0;
    at0 = up0 ? c0 : at0;
    m1 = up1 ? x1 : m1;
    at1 = up1 ? c1 : at1;
  }
  ColumnMax best{kNegInf, -1};
  auto take = [&best](float v, int64_t c) {
    if (c >= 0 && (v > best.value || (v == best.value && c < best.at))) best = {v, c};
  };
  for (int64_t l = 0; l < kLanes; ++l) {
    take(m0[l], at0[l]);
    take(m1[l], at1[l]);
  }
  for (; j < b; ++j)
    if (z[j] > best.value) best = {z[j], j};  // columns after every vector's: only if larger
  return best;
}

// sum of exp(z[j] - m), j < n
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
float exp_sum(const float* z, int64_t n, float m) {
  const vf mv = splat(m);
  vf s0{}, s1{};
  int64_t j = 0;
  for (; j + 2 * kLanes <= n; j += 2 * kLanes) {
    s0 += vec::exp(load(z + j) - mv);
    s1 += vec::exp(load(z + j + kLanes) - mv);
  }
  float s = vec::lane_sum(s0 + s1);
  for (; j < n; ++j) s += std::exp(z[j] - m);
  return s;
}

}  // namespace

void row_argmax_logsumexp(const float* row, int64_t vocab, int64_t banned, int64_t* arg,
                          float* best, double* lse) {
  ColumnMax sel = range_argmax(row, 0, banned < 0 ? vocab : banned);
  if (banned >= 0) {
    const ColumnMax after = range_argmax(row, banned + 1, vocab);
    if (after.at >= 0 && (sel.at < 0 || after.value > sel.value)) sel = after;
  }
  const float m_sel = sel.value;
  const float m_all = banned >= 0 ? std::max(m_sel, row[banned]) : m_sel;
  int64_t j = sel.at;
  if (j < 0) {  // nothing above -inf: the first allowed -inf, else some allowed column
    j = 0;
    while (j < vocab && (row[j] != m_sel || j == banned)) ++j;
    j = j < vocab ? j : (banned == 0 ? 1 : 0);
  }
  *arg = j;
  *best = row[j];
  *lse = static_cast<double>(m_all) + std::log(static_cast<double>(exp_sum(row, vocab, m_all)));
}

void check_banned(int64_t banned, int64_t vocab, const char* where) {
  TORCH_CHECK(banned >= -1 && banned < vocab && (banned < 0 || vocab > 1), where,
              ": banned column ", banned, " outside [-1, ", vocab, ") or the only one");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> argmax_logsumexp(const at::Tensor& z_in,
                                                                int64_t banned) {
  check_float_cpu(z_in, "argmax_logsumexp", "z");
  TORCH_CHECK(z_in.dim() == 2 && z_in.size(1) > 0, "argmax_logsumexp: z must be [R, V > 0], got ",
              z_in.sizes());
  const at::Tensor z = z_in.contiguous();
  const int64_t rows = z.size(0), vocab = z.size(1);
  check_banned(banned, vocab, "argmax_logsumexp");
  at::Tensor arg = at::empty({rows}, z.options().dtype(at::kLong));
  at::Tensor best = at::empty({rows}, z.options());
  at::Tensor lse = at::empty({rows}, z.options().dtype(at::kDouble));
  const float* zp = z.data_ptr<float>();
  int64_t* ap = arg.data_ptr<int64_t>();
  float* bp = best.data_ptr<float>();
  double* lp = lse.data_ptr<double>();
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      row_argmax_logsumexp(zp + r * vocab, vocab, banned, ap + r, bp + r, lp + r);
  });
  return {arg, best, lse};
}

}  // namespace hybridflow
