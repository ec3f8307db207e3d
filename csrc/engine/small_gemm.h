// y = x @ w.T for the few rows of a decode step, float32, CPU, the intra-op threads.
#pragma once

#include <ATen/ATen.h>

#include <utility>

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
//
// row_lanes (where row_lanes_supported(), else the form above; meant for a decode step's rows):
// the vector lanes hold 16 rows of x (transposed into a per-thread buffer) and each weight
// element is broadcast, so every output is one chain of fused multiply-adds over k = 0, 1, ...
// in order, with no lane sums (x read half as often, no transpose-reduce).  It pays from about
// 28 rows up: 1-16 rows cost what 16 do (one vector of rows: a broadcast per multiply-add).
// Its outputs too do not depend on the rows or threads around them, but they are other
// roundings than the form above: a caller picks one form for a whole generation
// (engine/forward_paths.py plan_call, by the full batch).
void small_linear_out(const at::Tensor& x, const at::Tensor& w, at::Tensor& y, bool accumulate,
                      bool row_lanes = false);

// Matrix products of a decode step (decode_layer.cpp, shared_step.cpp): this kernel (default)
// or BLAS for all (benchmarks and tests compare the two).
void use_small_gemm(bool enabled);
bool small_gemm_enabled();

// Does this CPU run the row-lane form (AVX-512: x86-64-v4)?  Elsewhere row_lanes is ignored.
bool row_lanes_supported();

// Weight rows a thread of small_linear_out takes as a unit.
constexpr int64_t kSmallGemmPanel = 4;

// Weight rows [n0, n1) of this thread's share when `threads` threads split n rows in whole
// panels (as even as the panels allow; possibly empty).
std::pair<int64_t, int64_t> small_gemm_share(int64_t n, int64_t thread, int64_t threads);

// The product of small_linear_out for the weight rows [n0, n1) only, on the calling thread,
// on raw rows (leading dimensions ldx, ldw, ldy): y[:, n0:n1] (+)= x [m, k] @ w[n0:n1].T.
// Every output is the same sum as in small_linear_out (in the form row_lanes picks).  With a
// bias (indexed like the columns of y, all n of them; ignored with accumulate) each output is
// stored as sum + bias[j]: one float add, as (x @ w.T) + bias in ATen.
void small_gemm_rows(const float* x, int64_t ldx, const float* w, int64_t ldw, float* y,
                     int64_t ldy, int64_t m, int64_t n0, int64_t n1, int64_t k, bool accumulate,
                     bool row_lanes = false, const float* bias = nullptr);

// The row-lane form with the rows of x or y in the vector lanes, as its kernel holds them (for
// chained products that skip the transposes between them).  Only where row_lanes_supported(),
// for 1 to kSmallGemmMaxRows rows: the caller checks (these run inside parallel regions and
// check nothing).  The lane layout of a matrix a [m, n] is a_t [n, kSmallGemmMaxRows],
// a_t[j * kSmallGemmMaxRows + r] = a[r, j].  Every output is the same sum as in
// small_gemm_rows(..., row_lanes = true).
// y_t[n0:n1] = (x [m, k] @ w[n0:n1].T) in the lane layout (rows m.. of y_t: the products of
// zero rows).
void small_gemm_rows_to_lanes(const float* x, int64_t ldx, int64_t m, const float* w,
                              int64_t ldw, float* yt, int64_t n0, int64_t n1, int64_t k);
// y[:, n0:n1] (+)= x @ w[n0:n1].T for x given in the lane layout, x_t [k, kSmallGemmMaxRows].
void small_gemm_rows_from_lanes(const float* xt, int64_t m, const float* w, int64_t ldw,
                                float* y, int64_t ldy, int64_t n0, int64_t n1, int64_t k,
                                bool accumulate);

}  // namespace hybridflow
