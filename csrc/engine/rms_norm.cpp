// RMSNorm of a layer (engine/layers.py rms_norm), forward and hand-written backward, CPU
// float32: one autograd node where the eager formula records six (pow, mean, add, rsqrt, two
// multiplies), and one pass over each row forward and backward.
//
//   y = weight * x * rstd,  rstd = 1 / sqrt(mean(x^2) + eps)        per row of x [N, H]
//   dx = rstd * (dy * weight - x * rstd * mean(dy * weight * x * rstd))
//   dweight = sum over rows of dy * x * rstd
//
// It is the one training kernel kept by the kernels-vs-torch.compile rule of issue 22 (1.40x
// the compiled formula at the `small` shape, bench/kernels_vs_compile.py); the fused attention
// and MLP blocks and the fused prefill were deleted (within 1.1x of compiled).
#include "rms_norm.h"

#include <ATen/Parallel.h>

#include <cmath>

#include "row_ops.h"

namespace hybridflow {
namespace {

void check_float_cpu(const at::Tensor& t, const char* name) {
  hybridflow::check_float_cpu(t, "rms_norm", name, /*contiguous=*/true);
}

}  // namespace

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
  at::parallel_for(0, N, 32, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const float* row = xp + n * H;
      float ss = 0.f;
      for (int64_t j = 0; j < H; ++j) ss += row[j] * row[j];
      const float r = 1.f / std::sqrt(ss / static_cast<float>(H) + static_cast<float>(eps));
      rp[n] = r;
      for (int64_t j = 0; j < H; ++j) yp[n * H + j] = w[j] * (row[j] * r);
    }
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
  at::parallel_for(0, N, 32, [&](int64_t begin, int64_t end) {
    float* dw = pp + at::get_thread_num() * H;
    for (int64_t n = begin; n < end; ++n) {
      const float *gr = g + n * H, *xr = xp + n * H;
      const float r = rp[n];
      // x_hat = x * r; d x_hat = dy * w; dx = r * (d x_hat - x_hat * mean(d x_hat * x_hat))
      float dot = 0.f;
      for (int64_t j = 0; j < H; ++j) {
        dot += gr[j] * w[j] * xr[j] * r;
        dw[j] += gr[j] * xr[j] * r;
      }
      const float c = dot / static_cast<float>(H);
      for (int64_t j = 0; j < H; ++j) dxp[n * H + j] = r * (gr[j] * w[j] - xr[j] * r * c);
    }
  });
  return {dx, partial.sum(0)};
}

}  // namespace hybridflow
