// See greedy_head.h.  One OpenMP region for the norm, the head product and the choice: no
// fork/join between them and no Python, which matter most at batch 1.
#include "greedy_head.h"

#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>
#include <omp.h>

#include "rms_norm.h"
#include "row_ops.h"
#include "small_gemm.h"
#include "vocab_rows.h"

namespace hybridflow {

GreedyHeadStep::GreedyHeadStep(int64_t rows, int64_t hidden, const at::Tensor& norm_weight,
                               double eps, const at::Tensor& head, bool row_lanes)
    : rows_(rows),
      hidden_(hidden),
      vocab_(head.size(0)),
      eps_(static_cast<float>(eps)),
      row_lanes_(row_lanes) {
  check_float_cpu(norm_weight, "greedy_head", "norm_weight");
  check_float_cpu(head, "greedy_head", "head");
  TORCH_CHECK(rows > 0 && norm_weight.dim() == 1 && norm_weight.size(0) == hidden &&
                  head.dim() == 2 && head.size(1) == hidden && head.size(0) > 0 &&
                  head.stride(1) == 1,
              "greedy_head: x [R > 0, H], norm_weight [H] and head [V > 0, H] with unit inner "
              "stride expected, got [", rows, ", ", hidden, "], ", norm_weight.sizes(), " and ",
              head.sizes(), " (strides ", head.strides(), ")");
  norm_weight_ = norm_weight.contiguous();
  head_ = head;
  normed_ = at::empty({rows, hidden}, head.options());
  logits_ = at::empty({rows, vocab_}, head.options());
}

void GreedyHeadStep::run(int64_t t, int64_t nt, const float* x, int64_t banned,
                         int64_t* tokens, float* log_probs, int64_t stride) const {
  const int64_t r0 = t * rows_ / nt, r1 = (t + 1) * rows_ / nt;
  float *hp = normed_.data_ptr<float>(), *zp = logits_.data_ptr<float>();
  if (r1 > r0)
    rms_norm_rows(x + r0 * hidden_, norm_weight_.data_ptr<float>(), r1 - r0, hidden_, eps_,
                  hp + r0 * hidden_, nullptr);
#pragma omp barrier
  const auto [n0, n1] = small_gemm_share(vocab_, t, nt);
  small_gemm_rows(hp, hidden_, head_.data_ptr<float>(), head_.stride(0), zp, vocab_, rows_, n0,
                  n1, hidden_, false, row_lanes_);
#pragma omp barrier
  for (int64_t r = r0; r < r1; ++r) {
    float best;
    double lse;
    row_argmax_logsumexp(zp + r * vocab_, vocab_, banned, tokens + r * stride, &best, &lse);
    // as (best.double() - lse)
    log_probs[r * stride] = static_cast<float>(static_cast<double>(best) - lse);
  }
}

std::tuple<at::Tensor, at::Tensor> greedy_head(const at::Tensor& x_in,
                                               const at::Tensor& norm_weight, double eps,
                                               const at::Tensor& head, int64_t banned,
                                               bool row_lanes) {
  check_float_cpu(x_in, "greedy_head", "x");
  TORCH_CHECK(x_in.dim() == 2, "greedy_head: x must be [R, H], got ", x_in.sizes());
  const GreedyHeadStep step(x_in.size(0), x_in.size(1), norm_weight, eps, head, row_lanes);
  check_banned(banned, head.size(0), "greedy_head");
  const at::Tensor x = x_in.contiguous();
  at::Tensor tokens = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  at::Tensor log_probs = at::empty({x.size(0)}, x.options());
  const float* xp = x.data_ptr<float>();
  int64_t* tp = tokens.data_ptr<int64_t>();
  float* lpp = log_probs.data_ptr<float>();
#pragma omp parallel num_threads(at::get_num_threads())
  {
    const c10::AutoGradMode no_grad(false);
    step.run(omp_get_thread_num(), omp_get_num_threads(), xp, banned, tp, lpp, 1);
  }
  return {tokens, log_probs};
}

}  // namespace hybridflow
