// Counter-based uniforms for the sampler's exponential race (engine/sampling.py).
#pragma once

#include <ATen/ATen.h>

namespace hybridflow {

// u [B, cols] float32 in (0, 1]: u[i, j] = (top 24 bits of splitmix64(seed, counter) + 1) /
// 2^24 with counter = row_ids[i] << 32 | j.  A value depends on (seed, row id, column) only:
// never on which other rows are asked for, nor on the thread count.
at::Tensor counter_uniforms(int64_t seed, const at::Tensor& row_ids, int64_t cols);

}  // namespace hybridflow
