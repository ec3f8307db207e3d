// y = x @ w.T for the few rows of a decode step, float32, CPU, the intra-op threads.
#pragma once

#include <ATen/ATen.h>

namespace hybridflow {

// Up to this many rows of x, small_linear_out reads the weight in place faster than BLAS: for a
// handful of rows sgemm spends most of its time packing the weight into its own layout (and
// in a decode step every thread would pack the same weights again).
constexpr int64_t kSmallGemmMaxRows = 32;

// y [M, N] = x [M, K] @ w [N, K].T, or y += ... when accumulate; rows of x, w and y need unit
// inner stride (any row stride).  The intra-op threads (at::parallel_for) split the rows of w
// (inside a parallel region: the calling thread alone).  Each output is the sum of 16 lanes
// (AVX-512) or 8 lanes accumulated with fused multiply-adds over K, then added in a fixed
// order (one tree for every output): the same result on every run of one machine, any thread
// count and any number of rows of x around it (machines with other vector widths, or without
// FMA, round differently).
void small_linear_out(const at::Tensor& x, const at::Tensor& w, at::Tensor& y, bool accumulate);

}  // namespace hybridflow
