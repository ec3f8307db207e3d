// The last stage of a greedy decode step in one call (engine/generation.py): final norm, LM
// head, greedy choice and its log-probability, CPU float32.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <tuple>

namespace hybridflow {

// For the hidden states x [R, H] of the new position: h = rms_norm(x) * norm_weight, logits =
// h @ head.T (head [V, H], unit inner stride), and per row the first column of the largest
// logit other than `banned` (-1: none) with its log-probability under softmax(logits):
// (tokens [R] int64, log_probs [R] float32).  The same bits as rms_norm_forward, small_linear
// and argmax_logsumexp in turn (engine/sampling.py's greedy step), in one parallel region of
// the intra-op threads: the norm and the choice split the rows, the head product the vocab
// rows (each head byte read once).  row_lanes: the head product in the row-lane form
// (small_gemm.h), the same bits as small_linear with it.
std::tuple<at::Tensor, at::Tensor> greedy_head(const at::Tensor& x,
                                               const at::Tensor& norm_weight, double eps,
                                               const at::Tensor& head, int64_t banned,
                                               bool row_lanes = false);

// greedy_head built once for a run of steps (greedy_decode.cpp): the operands checked and the
// work space made at construction, run() by every thread of a parallel region.
class GreedyHeadStep {
 public:
  GreedyHeadStep(int64_t rows, int64_t hidden, const at::Tensor& norm_weight, double eps,
                 const at::Tensor& head, bool row_lanes);

  // On thread t of the region's nt: the rows x [R, H] (contiguous; each thread reads only its
  // own rows [t R / nt, (t + 1) R / nt)); row r's token and log-probability are stored at
  // tokens[r * stride] and log_probs[r * stride] by the thread that owns the row.  banned as
  // greedy_head (checked by the caller: check_banned).
  void run(int64_t t, int64_t nt, const float* x, int64_t banned, int64_t* tokens,
           float* log_probs, int64_t stride) const;

 private:
  int64_t rows_, hidden_, vocab_;
  float eps_;
  bool row_lanes_;
  at::Tensor norm_weight_, head_, normed_, logits_;
};

}  // namespace hybridflow
