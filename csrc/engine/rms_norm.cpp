// RMSNorm of a layer (engine/layers.py rms_norm), forward and hand-written backward, CPU
// float32: one autograd node where the eager formula records six (pow, mean, add, rsqrt, two
// multiplies), one pass over each row forward and two backward, on 16-float vectors.
//
//   y = weight * x * rstd,  rstd = 1 / sqrt(mean(x^2) + eps)        per row of x [N, H]
//   dx = rstd * (dy * weight - x * rstd * mean(dy * weight * x * rstd))
//   dweight = sum over rows of dy * x * rstd
//
// The row sums (x^2, dy * weight * x) run in 32 lanes (two vectors) added up at the end of
// the row: a scalar loop under strict float semantics (no -ffast-math) is one dependent add
// per element and does not vectorise.  Rows go to the intra-op threads in blocks; dweight is
// summed per thread, then over threads.  The decode kernel normalises its rows with
// rms_norm_rows too (decode_layer.cpp).
//
// Kept while it runs >= 1.3x torch.compile of the formula (bench/kernels_vs_compile.py
// --shape small, row train_rms_norm).
#include "rms_norm.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>

#include "row_ops.h"
#include "vec_math.h"

namespace hybridflow {
namespace {

using vec::kLanes;
using vec::lane_sum;
using vec::load;
using vec::store;
using vec::vf;
constexpr int64_t kGrainRows = 32;

// sum of a[j] * b[j] (* c[j] where c is given), j < H: 32 lanes, then the scalar tail
inline float row_dot(const float* a, const float* b, const float* c, int64_t H) {
  vf s0{}, s1{};
  int64_t j = 0;
  for (; j + 2 * kLanes <= H; j += 2 * kLanes) {
    vf p0 = load(a + j) * load(b + j), p1 = load(a + j + kLanes) * load(b + j + kLanes);
    if (c != nullptr) {
      p0 = p0 * load(c + j);
      p1 = p1 * load(c + j + kLanes);
    }
    s0 += p0;
    s1 += p1;
  }
  for (; j + kLanes <= H; j += kLanes) s0 += c ? load(a + j) * load(b + j) * load(c + j)
                                               : load(a + j) * load(b + j);
  float s = lane_sum(s0 + s1);
  for (; j < H; ++j) s += c ? a[j] * b[j] * c[j] : a[j] * b[j];
  return s;
}

__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
void forward_rows(const float* x, const float* w, int64_t begin, int64_t end, int64_t H,
                  float eps, float* y, float* rstd) {
  for (int64_t n = begin; n < end; ++n) {
    const float* xr = x + n * H;
    float* yr = y + n * H;
    const float r = 1.f / std::sqrt(row_dot(xr, xr, nullptr, H) / static_cast<float>(H) + eps);
    if (rstd != nullptr) rstd[n] = r;
    int64_t j = 0;
    for (; j + kLanes <= H; j += kLanes) store(yr + j, load(w + j) * (load(xr + j) * r));
    for (; j < H; ++j) yr[j] = w[j] * (xr[j] * r);
  }
}

// dx of rows [begin, end) and their share of dweight added into dw [H]
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
void backward_rows(const float* dy, const float* x, const float* w, const float* rstd,
                   int64_t begin, int64_t end, int64_t H, float* dx, float* dw) {
  for (int64_t n = begin; n < end; ++n) {
    const float *g = dy + n * H, *xr = x + n * H;
    float* dxr = dx + n * H;
    const float r = rstd[n];
    // x_hat = x * r; d x_hat = dy * w; dx = r * (d x_hat - x_hat * mean(d x_hat * x_hat))
    const float c = row_dot(g, w, xr, H) * r / static_cast<float>(H);
    const float rc = r * c;
    int64_t j = 0;
    for (; j + kLanes <= H; j += kLanes) {
      const vf gj = load(g + j), xj = load(xr + j);
      store(dw + j, load(dw + j) + gj * (xj * r));
      store(dxr + j, r * (gj * load(w + j) - xj * rc));
    }
    for (; j < H; ++j) {
      dw[j] += g[j] * (xr[j] * r);
      dxr[j] = r * (g[j] * w[j] - xr[j] * rc);
    }
  }
}

void check_float_cpu(const at::Tensor& t, const char* name) {
  hybridflow::check_float_cpu(t, "rms_norm", name, /*contiguous=*/true);
}

}  // namespace

void rms_norm_rows(const float* x, const float* weight, int64_t rows, int64_t H, float eps,
                   float* y, float* rstd) {
  forward_rows(x, weight, 0, rows, H, eps, y, rstd);
}

std::tuple<at::Tensor, at::Tensor> rms_norm_forward(const at::Tensor& x,
                                                    const at::Tensor& weight, double eps) {
  check_float_cpu(x, "x");
  check_float_cpu(weight, "norm weight");
  const int64_t H = x.size(-1), N = H > 0 ? x.numel() / H : 0;
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == H, "rms_norm: weight ", weight.sizes(),
              " does not match hidden size ", H);
  at::Tensor y = at::empty_like(x), rstd = at::empty({N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  float* rp = rstd.data_ptr<float>();
  at::parallel_for(0, N, kGrainRows, [&](int64_t begin, int64_t end) {
    forward_rows(xp, w, begin, end, H, static_cast<float>(eps), yp, rp);
  });
  return {y, rstd};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& dy, const at::Tensor& x,
                                                     const at::Tensor& weight,
                                                     const at::Tensor& rstd) {
  check_float_cpu(dy, "dy");
  check_float_cpu(x, "x");
  check_float_cpu(weight, "norm weight");
  check_float_cpu(rstd, "rstd");
  const int64_t H = x.size(-1), N = H > 0 ? x.numel() / H : 0;
  TORCH_CHECK(dy.sizes() == x.sizes(), "rms_norm backward: dy ", dy.sizes(), " != x ",
              x.sizes());
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == H && rstd.numel() == N,
              "rms_norm backward: weight ", weight.sizes(), " / rstd ", rstd.sizes(),
              " do not match x ", x.sizes());
  at::Tensor dx = at::empty_like(x);
  // dweight = sum over rows of dy * x * r: one partial row per thread, summed at the end
  at::Tensor partial = at::zeros({at::get_num_threads(), H}, x.options());
  const float *g = dy.data_ptr<float>(), *xp = x.data_ptr<float>();
  const float *w = weight.data_ptr<float>(), *rp = rstd.data_ptr<float>();
  float* dxp = dx.data_ptr<float>();
  float* pp = partial.data_ptr<float>();
  at::parallel_for(0, N, kGrainRows, [&](int64_t begin, int64_t end) {
    backward_rows(g, xp, w, rp, begin, end, H, dxp, pp + at::get_thread_num() * H);
  });
  return {dx, partial.sum(0)};
}

}  // namespace hybridflow
