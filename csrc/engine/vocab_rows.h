// Per-row statistics of next-token logits, CPU float32 (engine/sampling.py): the greedy
// choice and the log-normaliser in two passes over each row.
#pragma once

#include <ATen/ATen.h>

#include <tuple>

namespace hybridflow {

// For z [R, V]: (arg [R] int64, z[arg] [R] float32, lse [R] float64), arg the first column
// of the largest logit among the columns other than `banned` (-1: none), lse = log sum_j
// exp(z_j) over every column (banned included), summed in float32 after the row maximum.
std::tuple<at::Tensor, at::Tensor, at::Tensor> argmax_logsumexp(const at::Tensor& z,
                                                                int64_t banned);

// One row of argmax_logsumexp on the calling thread: z[arg], its column and the normaliser.
void row_argmax_logsumexp(const float* row, int64_t vocab, int64_t banned, int64_t* arg,
                          float* best, double* lse);

// TORCH_CHECK that `banned` is -1 (none) or a column of [0, vocab) that is not the only one.
void check_banned(int64_t banned, int64_t vocab, const char* where);

}  // namespace hybridflow
