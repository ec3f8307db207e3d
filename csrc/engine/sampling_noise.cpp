// See sampling_noise.h.  torch.rand with a seeded CPU generator runs Mersenne Twister one value
// at a time, serially, over the batch x vocabulary uniforms of every decode step.  SplitMix64
// (Steele, Lea, Flood: the output function of Java's SplittableRandom, which passes BigCrush)
// of a counter needs no state, so rows are filled in parallel and in any order.
// engine/sampling.py computes the same numbers with tensor ops where the extension is not
// built, and the tests compare the two.
#include "sampling_noise.h"

#include <ATen/Parallel.h>

#include <cstdint>

namespace hybridflow {
namespace {

constexpr uint64_t kGamma = 0x9E3779B97F4A7C15ull;
constexpr float kTwoToMinus24 = 1.0f / 16777216.0f;

__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
void fill_row(uint64_t seed, uint64_t row, int64_t cols, float* out) {
  const uint64_t base = row << 32;
  for (int64_t j = 0; j < cols; ++j) {
    uint64_t z = seed + (base + static_cast<uint64_t>(j) + 1) * kGamma;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    out[j] = static_cast<float>((z >> 40) + 1) * kTwoToMinus24;
  }
}

}  // namespace

at::Tensor counter_uniforms(int64_t seed, const at::Tensor& row_ids_in, int64_t cols) {
  TORCH_CHECK(row_ids_in.dim() == 1 && row_ids_in.scalar_type() == at::kLong &&
                  row_ids_in.device().is_cpu(),
              "counter_uniforms: row_ids must be a 1-D int64 CPU tensor, got ",
              row_ids_in.toString(), " of shape ", row_ids_in.sizes());
  TORCH_CHECK(cols >= 0 && cols <= (int64_t{1} << 32), "counter_uniforms: cols ", cols,
              " outside [0, 2^32]");
  const at::Tensor row_ids = row_ids_in.contiguous();
  const int64_t rows = row_ids.size(0);
  at::Tensor out = at::empty({rows, cols}, row_ids.options().dtype(at::kFloat));
  const int64_t* ids = row_ids.data_ptr<int64_t>();
  float* o = out.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(cols, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      fill_row(static_cast<uint64_t>(seed), static_cast<uint64_t>(ids[i]), cols, o + i * cols);
  });
  return out;
}

}  // namespace hybridflow
