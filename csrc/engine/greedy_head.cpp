// See greedy_head.h.  One OpenMP region instead of three calls (norm, head product, choice),
// each with its own fork/join, and the Python between them (about 0.05 ms a step at batch 1).
#include "greedy_head.h"

#include <ATen/Parallel.h>
#include <omp.h>

#include "rms_norm.h"
#include "row_ops.h"
#include "small_gemm.h"
#include "vocab_rows.h"

namespace hybridflow {

std::tuple<at::Tensor, at::Tensor> greedy_head(const at::Tensor& x_in,
                                               const at::Tensor& norm_weight_in, double eps,
                                               const at::Tensor& head, int64_t banned,
                                               bool row_lanes) {
  check_float_cpu(x_in, "greedy_head", "x");
  check_float_cpu(norm_weight_in, "greedy_head", "norm_weight");
  check_float_cpu(head, "greedy_head", "head");
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(0) > 0 && norm_weight_in.dim() == 1 &&
                  norm_weight_in.size(0) == x_in.size(1) && head.dim() == 2 &&
                  head.size(1) == x_in.size(1) && head.size(0) > 0 && head.stride(1) == 1,
              "greedy_head: x [R > 0, H], norm_weight [H] and head [V > 0, H] with unit inner "
              "stride expected, got ", x_in.sizes(), ", ", norm_weight_in.sizes(), " and ",
              head.sizes(), " (strides ", head.strides(), ")");
  const int64_t rows = x_in.size(0), hidden = x_in.size(1), vocab = head.size(0);
  check_banned(banned, vocab, "greedy_head");
  const at::Tensor x = x_in.contiguous(), norm_weight = norm_weight_in.contiguous();
  at::Tensor h = at::empty({rows, hidden}, x.options());
  at::Tensor logits = at::empty({rows, vocab}, x.options());
  at::Tensor tokens = at::empty({rows}, x.options().dtype(at::kLong));
  at::Tensor log_probs = at::empty({rows}, x.options());
  const float *xp = x.data_ptr<float>(), *wp = norm_weight.data_ptr<float>(),
              *headp = head.data_ptr<float>();
  float *hp = h.data_ptr<float>(), *zp = logits.data_ptr<float>(),
        *lpp = log_probs.data_ptr<float>();
  int64_t* tp = tokens.data_ptr<int64_t>();
  const float epsf = static_cast<float>(eps);
  const int64_t ld_head = head.stride(0);
  const int threads = at::get_num_threads();
#pragma omp parallel num_threads(threads)
  {
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t r0 = t * rows / nt, r1 = (t + 1) * rows / nt;
    if (r1 > r0) rms_norm_rows(xp + r0 * hidden, wp, r1 - r0, hidden, epsf, hp + r0 * hidden,
                               nullptr);
#pragma omp barrier
    const auto [n0, n1] = small_gemm_share(vocab, t, nt);
    small_gemm_rows(hp, hidden, headp, ld_head, zp, vocab, rows, n0, n1, hidden, false,
                    row_lanes);
#pragma omp barrier
    for (int64_t r = r0; r < r1; ++r) {
      float best;
      double lse;
      row_argmax_logsumexp(zp + r * vocab, vocab, banned, tp + r, &best, &lse);
      lpp[r] = static_cast<float>(static_cast<double>(best) - lse);  // as (best.double() - lse)
    }
  }
  return {tokens, log_probs};
}

}  // namespace hybridflow
