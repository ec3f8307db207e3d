// See greedy_decode.h.
#include "greedy_decode.h"

#include "decode_layer.h"
#include "greedy_head.h"
#include "shared_step.h"
#include "vocab_rows.h"

#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>
#include <omp.h>

#include <cstring>

namespace hybridflow {

std::tuple<at::Tensor, at::Tensor> greedy_decode(
    const at::Tensor& first_tokens, int64_t steps, const at::Tensor& embed,
    const std::vector<at::Tensor>& layer_weights, double eps, const at::Tensor& cos,
    const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache, int64_t start_pos,
    const at::Tensor& key_mask, int64_t q_per_group,
    const std::vector<std::optional<at::Tensor>>& qkv_biases, const at::Tensor& norm_weight,
    double norm_eps, const at::Tensor& head, const std::vector<int64_t>& banned,
    bool row_lanes) {
  TORCH_CHECK(first_tokens.dim() == 1 && first_tokens.scalar_type() == at::kLong &&
                  first_tokens.size(0) > 0,
              "greedy_decode: first_tokens must be int64 [B > 0], got ", first_tokens.sizes(),
              " ", first_tokens.scalar_type());
  const int64_t batch = first_tokens.size(0);
  TORCH_CHECK(steps >= 0 && static_cast<int64_t>(banned.size()) == steps,
              "greedy_decode: ", banned.size(), " banned columns for ", steps,
              " steps (one per step)");
  TORCH_CHECK(embed.dim() == 2 && embed.scalar_type() == at::kFloat,
              "greedy_decode: embed must be float32 [V, H], got ", embed.sizes());
  TORCH_CHECK(cos.dim() == 3 && sin.sizes() == cos.sizes() && cos.size(0) == batch &&
                  key_mask.dim() == 2 && key_mask.size(0) == batch &&
                  start_pos >= 0 && start_pos + steps <= cos.size(1) &&
                  start_pos + steps <= key_mask.size(1),
              "greedy_decode: cos/sin [B, P + N, D] and key_mask [B, P + N] covering positions "
              "[", start_pos, ", ", start_pos + steps, ") expected, got ", cos.sizes(), " and ",
              key_mask.sizes());
  at::Tensor tokens = at::empty({batch, steps}, first_tokens.options());
  at::Tensor log_probs = at::empty({batch, steps}, embed.options());
  if (steps == 0) return {tokens, log_probs};
  const int64_t vocab = embed.size(0);
  TORCH_CHECK(((first_tokens >= 0) & (first_tokens < vocab)).all().item<bool>(),
              "greedy_decode: first_tokens outside [0, ", vocab, ")");
  // the checks of every step's calls, made once: decode_layers' at the last position (the
  // first step's operands otherwise), greedy_head's and every banned column
  const int64_t last_pos = start_pos + steps - 1;
  const at::Tensor x = embed.index_select(0, first_tokens);  // [B, H]: F.embedding's rows
  const std::vector<at::Tensor> biases =
      check_decode_layers(x, layer_weights, cos.select(1, last_pos), sin.select(1, last_pos),
                          k_cache, v_cache, last_pos, key_mask, q_per_group, qkv_biases);
  const GreedyHeadStep head_step(batch, x.size(1), norm_weight, norm_eps, head, row_lanes);
  for (const int64_t b : banned) check_banned(b, head.size(0), "greedy_decode");
  if (!SharedDecodeStep::applies(batch, layer_weights, biases) || embed.stride(1) != 1) {
    at::Tensor last;  // the tokens the previous step chose (step 0's rows are x)
    for (int64_t s = 0; s < steps; ++s) {
      const int64_t pos = start_pos + s;
      const at::Tensor h = decode_layers(s == 0 ? x : embed.index_select(0, last),
                                         layer_weights, eps, cos.select(1, pos),
                                         sin.select(1, pos), k_cache, v_cache, pos, key_mask,
                                         q_per_group, qkv_biases, row_lanes);
      auto [tok, lp] = greedy_head(h, norm_weight, norm_eps, head, banned[s], row_lanes);
      tokens.select(1, s).copy_(tok);
      log_probs.select(1, s).copy_(lp);
      last = tok;
    }
    return {tokens, log_probs};
  }
  // every step in one parallel region: each thread looks up the embedding rows of its own
  // rows (those it chose the tokens of; the first step's are x), runs the layers' shared step
  // and the head
  const int threads = at::get_num_threads();
  const int64_t hidden = x.size(1);
  const SharedDecodeStep layers(batch, hidden, layer_weights, biases, eps, k_cache, v_cache,
                                key_mask, q_per_group, row_lanes, threads);
  const float *emb = embed.data_ptr<float>(), *cp = cos.data_ptr<float>(),
              *sp = sin.data_ptr<float>();
  float *hp = x.data_ptr<float>(), *lpp = log_probs.data_ptr<float>();  // x: the first rows
  int64_t* tp = tokens.data_ptr<int64_t>();
#pragma omp parallel num_threads(threads)
  {
    const c10::AutoGradMode no_grad(false);  // grad mode is per thread; inference kernels
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t r0 = t * batch / nt, r1 = (t + 1) * batch / nt;
    for (int64_t s = 0; s < steps; ++s) {
      const int64_t pos = start_pos + s;
      for (int64_t r = r0; r < r1 && s > 0; ++r)  // the rows of the tokens this thread chose
        std::memcpy(hp + r * hidden, emb + tp[r * steps + s - 1] * embed.stride(0),
                    hidden * sizeof(float));
      layers.run(t, nt, hp, pos, cp + pos * cos.stride(1), sp + pos * sin.stride(1),
                 cos.stride(0), sin.stride(0));
      head_step.run(t, nt, hp, banned[s], tp + s, lpp + s, steps);
    }
  }
  return {tokens, log_probs};
}

}  // namespace hybridflow
