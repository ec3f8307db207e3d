// See swiglu.h.  The interleaved layout [..., F, 2] lets any tensor-parallel split of the
// gate/up projection keep each rank's gate and up columns together, but the stride-2 reads
// defeat the vectoriser of torch.compile (bench/kernels_vs_compile.py, row train_swiglu,
// compares the two).  Here 16 pairs are loaded as two vectors and split by one shuffle each way;
// exp is a polynomial on vectors (libm's expf does not vectorise without -ffast-math).
#include "swiglu.h"

#include <ATen/Parallel.h>

#include <cstring>

#include "row_ops.h"
#include "vec_math.h"

namespace hybridflow {
namespace {

using vec::kLanes;
using vec::splat;
using vec::vf;
using vec::vi;
constexpr int64_t kGrainPairs = 1 << 14;

inline vf vsigmoid(vf x) { return splat(1.f) / (splat(1.f) + vec::exp(-x)); }

constexpr vi kEven = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
constexpr vi kOdd = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
constexpr vi kLow = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23};
constexpr vi kHigh = {8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};

// 16 pairs of gu (32 floats) -> gate, up
inline void load_pairs(const float* gu, vf& gate, vf& up) {
  vf a, b;
  std::memcpy(&a, gu, sizeof a);
  std::memcpy(&b, gu + kLanes, sizeof b);
  gate = __builtin_shuffle(a, b, kEven);
  up = __builtin_shuffle(a, b, kOdd);
}

// pairs [f0, f1) with the batch rows in the lanes: gate and up of pair f are the rows 2f and
// 2f + 1 of gu_t [2F, ld], the output the row f of y_t [F, ld]; each lane rounds by the same
// operations as forward_pairs
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
void forward_pairs_lanes(const float* gu_t, float* y_t, int64_t ld, int64_t f0, int64_t f1) {
  for (int64_t f = f0; f < f1; ++f)
    for (int64_t c = 0; c < ld; c += kLanes) {
      vf gate, up;
      std::memcpy(&gate, gu_t + 2 * f * ld + c, sizeof gate);
      std::memcpy(&up, gu_t + (2 * f + 1) * ld + c, sizeof up);
      const vf out = gate * vsigmoid(gate) * up;
      std::memcpy(y_t + f * ld + c, &out, sizeof out);
    }
}

// pairs [begin, end) of a run whose length is a multiple of kLanes
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
void forward_pairs(const float* gu, float* y, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; i += kLanes) {
    vf gate, up;
    load_pairs(gu + 2 * i, gate, up);
    const vf out = gate * vsigmoid(gate) * up;
    std::memcpy(y + i, &out, sizeof out);
  }
}

__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
void backward_pairs(const float* gu, const float* dy, float* dgu, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; i += kLanes) {
    vf gate, up, g;
    load_pairs(gu + 2 * i, gate, up);
    std::memcpy(&g, dy + i, sizeof g);
    const vf s = vsigmoid(gate);
    const vf d_gate = g * up * (s * (splat(1.f) + gate * (splat(1.f) - s)));
    const vf d_up = g * (gate * s);
    const vf lo = __builtin_shuffle(d_gate, d_up, kLow);
    const vf hi = __builtin_shuffle(d_gate, d_up, kHigh);
    std::memcpy(dgu + 2 * i, &lo, sizeof lo);
    std::memcpy(dgu + 2 * i + kLanes, &hi, sizeof hi);
  }
}

// Runs body(gu, dy, out, begin, end) over whole vectors on the intra-op threads and the last
// pairs (fewer than kLanes) through zero-padded copies, so every pair rounds alike.
template <typename Body>
void over_pairs(int64_t pairs, const float* gu, const float* dy, float* out, int64_t out_per_pair,
                Body body) {
  const int64_t whole = pairs / kLanes * kLanes;
  at::parallel_for(0, whole / kLanes, kGrainPairs / kLanes, [&](int64_t b, int64_t e) {
    body(gu, dy, out, b * kLanes, e * kLanes);
  });
  const int64_t rest = pairs - whole;
  if (rest == 0) return;
  float gu_tail[2 * kLanes] = {}, dy_tail[kLanes] = {}, out_tail[2 * kLanes] = {};
  std::memcpy(gu_tail, gu + 2 * whole, 2 * rest * sizeof(float));
  if (dy != nullptr) std::memcpy(dy_tail, dy + whole, rest * sizeof(float));
  body(gu_tail, dy_tail, out_tail, 0, kLanes);
  std::memcpy(out + out_per_pair * whole, out_tail, out_per_pair * rest * sizeof(float));
}

void check_pairs(const at::Tensor& gu) {
  check_float_cpu(gu, "swiglu", "gu");
  TORCH_CHECK(gu.dim() >= 1 && gu.size(-1) == 2, "swiglu: gu must be [..., F, 2], got ",
              gu.sizes());
}

}  // namespace

void swiglu_forward_rows(const float* gu, int64_t ld_gu, float* y, int64_t ld_y, int64_t rows,
                         int64_t pairs) {
  for (int64_t r = 0; r < rows; ++r)
    over_pairs(pairs, gu + r * ld_gu, nullptr, y + r * ld_y, 1,
               [](const float* g, const float*, float* o, int64_t b, int64_t e) {
                 forward_pairs(g, o, b, e);
               });
}

void swiglu_forward_lanes(const float* gu_t, float* y_t, int64_t ld, int64_t f0, int64_t f1) {
  forward_pairs_lanes(gu_t, y_t, ld, f0, f1);
}

at::Tensor swiglu_forward(const at::Tensor& gu_in) {
  check_pairs(gu_in);
  const at::Tensor gu = gu_in.contiguous();
  at::Tensor y = at::empty(gu.sizes().slice(0, gu.dim() - 1), gu.options());
  swiglu_forward_rows(gu.data_ptr<float>(), 0, y.data_ptr<float>(), 0, 1, y.numel());
  return y;
}

at::Tensor swiglu_backward(const at::Tensor& gu_in, const at::Tensor& dy_in) {
  check_pairs(gu_in);
  check_float_cpu(dy_in, "swiglu", "dy");
  TORCH_CHECK(dy_in.sizes() == gu_in.sizes().slice(0, gu_in.dim() - 1),
              "swiglu: dy must be [..., F] of gu [..., F, 2], got ", dy_in.sizes(), " and ",
              gu_in.sizes());
  const at::Tensor gu = gu_in.contiguous(), dy = dy_in.contiguous();
  at::Tensor dgu = at::empty(gu.sizes(), gu.options());
  over_pairs(dy.numel(), gu.data_ptr<float>(), dy.data_ptr<float>(), dgu.data_ptr<float>(), 2,
             [](const float* g, const float* d, float* o, int64_t b, int64_t e) {
               backward_pairs(g, d, o, b, e);
             });
  return dgu;
}

}  // namespace hybridflow
