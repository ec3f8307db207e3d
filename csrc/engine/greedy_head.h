// The last stage of a greedy decode step in one call (engine/generation.py): final norm, LM
// head, greedy choice and its log-probability, CPU float32.
#pragma once

#include <ATen/ATen.h>

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

}  // namespace hybridflow
