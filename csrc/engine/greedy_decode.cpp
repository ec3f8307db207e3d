// See greedy_decode.h.
#include "greedy_decode.h"

#include "decode_layer.h"
#include "greedy_head.h"

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
  if (steps > 0) {
    const int64_t vocab = embed.size(0);
    TORCH_CHECK(((first_tokens >= 0) & (first_tokens < vocab)).all().item<bool>(),
                "greedy_decode: first_tokens outside [0, ", vocab, ")");
  }
  at::Tensor tokens = at::empty({batch, steps}, first_tokens.options());
  at::Tensor log_probs = at::empty({batch, steps}, embed.options());
  at::Tensor last = first_tokens;
  for (int64_t s = 0; s < steps; ++s) {
    const int64_t pos = start_pos + s;
    const at::Tensor x = embed.index_select(0, last);  // [B, H]: F.embedding's rows
    const at::Tensor h = decode_layers(x, layer_weights, eps, cos.select(1, pos),
                                       sin.select(1, pos), k_cache, v_cache, pos, key_mask,
                                       q_per_group, qkv_biases, row_lanes);
    auto [tok, lp] = greedy_head(h, norm_weight, norm_eps, head, banned[s], row_lanes);
    tokens.select(1, s).copy_(tok);
    log_probs.select(1, s).copy_(lp);
    last = tok;
  }
  return {tokens, log_probs};
}

}  // namespace hybridflow
