// Training blocks of a Llama layer, forward and hand-written backward, CPU float32.
//
// The Python layers (engine/layers.py) record about 40 autograd nodes per layer; small models
// (the RLHF recipes, tests) spend most of a training step dispatching them, and CPU
// scaled_dot_product_attention is slow at short sequences.  Here a layer is four blocks, each
// one autograd node (engine/fused_layers.py), with the TP collectives between them as before:
//
//   x --rms_norm--> a --[copy_to_tp]--> attention: mm(qkv), RoPE, softmax(q k^T/sqrt(D)) v,
//                                       mm(o) --[reduce_from_tp]--> + x = h
//   h --rms_norm--> b --[copy_to_tp]--> mlp: mm(gate_up), silu(gate) * up, mm(down)
//                                       --[reduce_from_tp]--> + h = out
//
// Matrix products and the exponentials (sigmoid, softmax) are ATen's (BLAS, vectorised
// kernels); the other element-wise parts (norm, RoPE with the change to a heads-first layout,
// masking and normalising the softmax, SwiGLU) and their gradients are loops here.
//
// Shapes (N = B*S tokens, h_kv = this rank's KV heads, qpg = queries per KV group, D = head dim,
// BG = B*h_kv):
//   qkv weight  [h_kv*(qpg+2)*D, H]   per group: qpg query rows, a key row, a value row
//   o weight    [H, h_kv*qpg*D]
//   gate_up     [2F, H]               gate/up rows interleaved (even = gate, odd = up)
//   down        [H, F]
//   cos, sin    [B, S, D]             RoPE tables (half-split convention)
//   saved q     [B, h_kv, qpg, S, D]  = [BG, qpg*S, D]: a group's queries stacked, so one
//                                       batched product serves all of them
//   saved k, v  [B, h_kv, S, D]
//   saved probs [BG, qpg*S, S]        softmax rows, 0 where masked
//   saved attn  [N, h_kv*qpg*D]       attention output in the o projection's input order
//   saved mlp   gate_up [N, 2F], sigmoid(gate) [N, F], silu(gate) * up [N, F]
#include "train_blocks.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <limits>

#include "row_ops.h"

namespace hybridflow {
namespace {

void check_float_cpu(const at::Tensor& t, const char* name) {
  hybridflow::check_float_cpu(t, "train blocks", name, /*contiguous=*/true);
}

// Heads-first layout of one layer's attention, derived from the weight and RoPE shapes.
struct AttentionShape {
  int64_t batch, seq, hidden_in, head_dim, groups, q_per_group;
  int64_t tokens() const { return batch * seq; }
  int64_t batch_groups() const { return batch * groups; }
  int64_t row_width() const { return groups * (q_per_group + 2) * head_dim; }
};

AttentionShape attention_shape(const at::Tensor& a, const at::Tensor& qkv_weight,
                               const at::Tensor& cos, int64_t q_per_group) {
  TORCH_CHECK(a.dim() == 3, "attention: input must be [B, S, H], got ", a.sizes());
  TORCH_CHECK(q_per_group >= 1, "attention: q_per_group must be >= 1, got ", q_per_group);
  AttentionShape s{a.size(0), a.size(1), a.size(2), cos.size(-1), 0, q_per_group};
  TORCH_CHECK(cos.dim() == 3 && cos.size(0) == s.batch && cos.size(1) == s.seq &&
                  s.head_dim % 2 == 0,
              "attention: cos/sin must be [B, S, D] with even D, got ", cos.sizes());
  const int64_t per_group = (q_per_group + 2) * s.head_dim;
  TORCH_CHECK(qkv_weight.dim() == 2 && qkv_weight.size(1) == s.hidden_in &&
                  qkv_weight.size(0) % per_group == 0,
              "attention: qkv weight ", qkv_weight.sizes(), " does not fit input ", a.sizes(),
              " with ", q_per_group, " queries per group and head dim ", s.head_dim);
  s.groups = qkv_weight.size(0) / per_group;
  return s;
}

// Transpose of rope: dx = g * cos + rotate_half^T(g * sin), rotate_half^T(y) = (y2, -y1).
inline void rope_backward(const float* g, const float* cos, const float* sin, int64_t d,
                          float* dx) {
  const int64_t h = d / 2;
  for (int64_t j = 0; j < h; ++j) dx[j] = g[j] * cos[j] + g[j + h] * sin[j + h];
  for (int64_t j = h; j < d; ++j) dx[j] = g[j] * cos[j] - g[j - h] * sin[j - h];
}

// Softmax of each row of scores [BG, qpg*S, S] in place: scaled, keys masked out (mask
// [B, 1, S, S] or causal) get probability 0.  Loops for the row maxima and sums, and one
// vectorised ATen exp over all rows in between (a scalar exp per score is several times slower
// at long sequences; separate ATen ops for scale, mask and softmax cost more at short ones).
// A row with no allowed key (the callers' masks always allow a row's own position) gets all
// zeros, so its attention output and gradients are 0.
void masked_softmax_(at::Tensor& scores, const std::optional<at::Tensor>& mask,
                     const AttentionShape& s, float scale) {
  const int64_t S = s.seq, rows = s.batch_groups() * s.q_per_group * S;
  const int64_t rows_per_batch = s.groups * s.q_per_group * S;
  float* p = scores.data_ptr<float>();
  const bool* m = mask ? mask->data_ptr<bool>() : nullptr;
  constexpr float kMasked = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t b = r / rows_per_batch, i = r % S;
      const bool* ok = m ? m + (b * S + i) * S : nullptr;
      float* row = p + r * S;
      float mx = kMasked;
      for (int64_t k = 0; k < S; ++k) {
        row[k] = (ok ? ok[k] : k <= i) ? row[k] * scale : kMasked;
        mx = std::max(mx, row[k]);
      }
      // -inf stays -inf (exp gives 0); a row with no allowed key stays all -inf
      if (mx != kMasked)
        for (int64_t k = 0; k < S; ++k) row[k] -= mx;
    }
  });
  scores.exp_();
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* row = p + r * S;
      float sum = 0.f;
      for (int64_t k = 0; k < S; ++k) sum += row[k];
      const float inv = sum > 0.f ? 1.f / sum : 0.f;  // fully masked row: all zeros, no NaN
      for (int64_t k = 0; k < S; ++k) row[k] *= inv;
    }
  });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> rms_norm_forward(const at::Tensor& x,
                                                    const at::Tensor& weight, double eps) {
  check_float_cpu(x, "x");
  check_float_cpu(weight, "norm weight");
  const int64_t H = x.size(-1), N = H > 0 ? x.numel() / H : 0;
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == H, "rms_norm: weight ", weight.sizes(),
              " does not match hidden size ", H);
  at::Tensor y = at::empty_like(x), rstd = at::empty({N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  float* rp = rstd.data_ptr<float>();
  at::parallel_for(0, N, 32, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const float* row = xp + n * H;
      float ss = 0.f;
      for (int64_t j = 0; j < H; ++j) ss += row[j] * row[j];
      const float r = 1.f / std::sqrt(ss / static_cast<float>(H) + static_cast<float>(eps));
      rp[n] = r;
      for (int64_t j = 0; j < H; ++j) yp[n * H + j] = w[j] * (row[j] * r);
    }
  });
  return {y, rstd};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& dy, const at::Tensor& x,
                                                     const at::Tensor& weight,
                                                     const at::Tensor& rstd) {
  check_float_cpu(dy, "dy");
  check_float_cpu(x, "x");
  check_float_cpu(weight, "norm weight");
  check_float_cpu(rstd, "rstd");
  const int64_t H = x.size(-1), N = H > 0 ? x.numel() / H : 0;
  TORCH_CHECK(dy.sizes() == x.sizes(), "rms_norm backward: dy ", dy.sizes(), " != x ",
              x.sizes());
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == H && rstd.numel() == N,
              "rms_norm backward: weight ", weight.sizes(), " / rstd ", rstd.sizes(),
              " do not match x ", x.sizes());
  at::Tensor dx = at::empty_like(x);
  // dweight = sum over rows of dy * x * r: one partial row per thread, summed at the end
  at::Tensor partial = at::zeros({at::get_num_threads(), H}, x.options());
  const float *g = dy.data_ptr<float>(), *xp = x.data_ptr<float>();
  const float *w = weight.data_ptr<float>(), *rp = rstd.data_ptr<float>();
  float* dxp = dx.data_ptr<float>();
  float* pp = partial.data_ptr<float>();
  at::parallel_for(0, N, 32, [&](int64_t begin, int64_t end) {
    float* dw = pp + at::get_thread_num() * H;
    for (int64_t n = begin; n < end; ++n) {
      const float *gr = g + n * H, *xr = xp + n * H;
      const float r = rp[n];
      // x_hat = x * r; d x_hat = dy * w; dx = r * (d x_hat - x_hat * mean(d x_hat * x_hat))
      float dot = 0.f;
      for (int64_t j = 0; j < H; ++j) {
        dot += gr[j] * w[j] * xr[j] * r;
        dw[j] += gr[j] * xr[j] * r;
      }
      const float c = dot / static_cast<float>(H);
      for (int64_t j = 0; j < H; ++j) dxp[n * H + j] = r * (gr[j] * w[j] - xr[j] * r * c);
    }
  });
  return {dx, partial.sum(0)};
}

std::vector<at::Tensor> attention_forward(const at::Tensor& a, const at::Tensor& qkv_weight,
                                          const at::Tensor& o_weight, const at::Tensor& cos,
                                          const at::Tensor& sin,
                                          const std::optional<at::Tensor>& mask,
                                          int64_t q_per_group) {
  for (const auto& [t, name] : {std::pair{a, "input"}, {qkv_weight, "qkv weight"},
                                {o_weight, "o weight"}, {cos, "cos"}, {sin, "sin"}})
    check_float_cpu(t, name);
  const AttentionShape s = attention_shape(a, qkv_weight, cos, q_per_group);
  const int64_t B = s.batch, S = s.seq, D = s.head_dim, G = s.groups, Q = q_per_group;
  TORCH_CHECK(sin.sizes() == cos.sizes(), "attention: sin ", sin.sizes(), " != cos ",
              cos.sizes());
  TORCH_CHECK(o_weight.dim() == 2 && o_weight.size(1) == G * Q * D,
              "attention: o weight ", o_weight.sizes(), " expects ", G * Q * D, " inputs");
  if (mask) {
    TORCH_CHECK(mask->scalar_type() == at::kBool && mask->is_contiguous() &&
                    mask->sizes() == at::IntArrayRef({B, 1, S, S}),
                "attention: mask must be a contiguous bool [B, 1, S, S] = [", B, ", 1, ", S,
                ", ", S, "], got ", mask->toString(), " ", mask->sizes());
  }
  const int64_t N = s.tokens(), BG = s.batch_groups();
  const at::Tensor qkv = at::mm(a.view({N, s.hidden_in}), qkv_weight.t());  // [N, G*(Q+2)*D]
  at::Tensor q = at::empty({B, G, Q, S, D}, a.options());
  at::Tensor k = at::empty({B, G, S, D}, a.options());
  at::Tensor v = at::empty({B, G, S, D}, a.options());
  const float *src = qkv.data_ptr<float>(), *cp = cos.data_ptr<float>(),
              *sp = sin.data_ptr<float>();
  float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const int64_t b = n / S, i = n % S;
      const float *c = cp + n * D, *sn = sp + n * D;
      for (int64_t g = 0; g < G; ++g) {
        const float* row = src + n * s.row_width() + g * (Q + 2) * D;
        for (int64_t j = 0; j < Q; ++j)
          rope_row(row + j * D, c, sn, D, qp + (((b * G + g) * Q + j) * S + i) * D);
        rope_row(row + Q * D, c, sn, D, kp + ((b * G + g) * S + i) * D);
        std::copy(row + (Q + 1) * D, row + (Q + 2) * D, vp + ((b * G + g) * S + i) * D);
      }
    }
  });
  at::Tensor probs = at::bmm(q.view({BG, Q * S, D}), k.view({BG, S, D}).transpose(1, 2));
  masked_softmax_(probs, mask, s, 1.f / std::sqrt(static_cast<float>(D)));
  const at::Tensor heads = at::bmm(probs, v.view({BG, S, D}));  // [B, G, Q, S, D]
  at::Tensor attn = heads.view({B, G, Q, S, D}).permute({0, 3, 1, 2, 4}).reshape({N, G * Q * D});
  at::Tensor y = at::mm(attn, o_weight.t()).view({B, S, o_weight.size(0)});
  return {y, q, k, v, probs, attn};
}

std::vector<at::Tensor> attention_backward(const at::Tensor& dy, const at::Tensor& a,
                                           const at::Tensor& qkv_weight,
                                           const at::Tensor& o_weight, const at::Tensor& cos,
                                           const at::Tensor& sin,
                                           const std::vector<at::Tensor>& saved) {
  TORCH_CHECK(saved.size() == 5, "attention backward: expected 5 saved tensors, got ",
              saved.size());
  const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &probs = saved[3],
                   &attn = saved[4];
  const int64_t Q = q.size(2);
  const AttentionShape s = attention_shape(a, qkv_weight, cos, Q);
  const int64_t B = s.batch, S = s.seq, D = s.head_dim, G = s.groups, N = s.tokens(),
                BG = s.batch_groups();
  const at::Tensor dy_flat = dy.contiguous().view({N, o_weight.size(0)});
  at::Tensor d_o_weight = at::mm(dy_flat.t(), attn);
  const at::Tensor d_heads = at::mm(dy_flat, o_weight)
                                 .view({B, S, G, Q, D})
                                 .permute({0, 2, 3, 1, 4})
                                 .contiguous()
                                 .view({BG, Q * S, D});
  const at::Tensor dv = at::bmm(probs.transpose(1, 2), d_heads);       // [BG, S, D]
  at::Tensor ds = at::bmm(d_heads, v.view({BG, S, D}).transpose(1, 2));  // dprobs
  // softmax backward, with the 1/sqrt(D) of the scores: ds = p * (dp - sum(dp * p)) / sqrt(D)
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  float* dsp = ds.data_ptr<float>();
  const float* pp = probs.data_ptr<float>();
  at::parallel_for(0, BG * Q * S, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* row = dsp + r * S;
      const float* p = pp + r * S;
      float dot = 0.f;
      for (int64_t j = 0; j < S; ++j) dot += row[j] * p[j];
      for (int64_t j = 0; j < S; ++j) row[j] = p[j] * (row[j] - dot) * scale;
    }
  });
  const at::Tensor dq = at::bmm(ds, k.view({BG, S, D}));                        // [BG, Q*S, D]
  const at::Tensor dk = at::bmm(ds.transpose(1, 2), q.view({BG, Q * S, D}));    // [BG, S, D]
  at::Tensor dqkv = at::empty({N, s.row_width()}, a.options());
  const float *dqp = dq.data_ptr<float>(), *dkp = dk.data_ptr<float>(),
              *dvp = dv.data_ptr<float>(), *cp = cos.data_ptr<float>(),
              *sp = sin.data_ptr<float>();
  float* out = dqkv.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const int64_t b = n / S, i = n % S;
      const float *c = cp + n * D, *sn = sp + n * D;
      for (int64_t g = 0; g < G; ++g) {
        float* row = out + n * s.row_width() + g * (Q + 2) * D;
        for (int64_t j = 0; j < Q; ++j)
          rope_backward(dqp + (((b * G + g) * Q + j) * S + i) * D, c, sn, D, row + j * D);
        rope_backward(dkp + ((b * G + g) * S + i) * D, c, sn, D, row + Q * D);
        const float* dvr = dvp + ((b * G + g) * S + i) * D;
        std::copy(dvr, dvr + D, row + (Q + 1) * D);
      }
    }
  });
  const at::Tensor a_flat = a.view({N, s.hidden_in});
  return {at::mm(dqkv, qkv_weight).view(a.sizes()), at::mm(dqkv.t(), a_flat), d_o_weight};
}

std::vector<at::Tensor> mlp_forward(const at::Tensor& b, const at::Tensor& gate_up_weight,
                                    const at::Tensor& down_weight) {
  check_float_cpu(b, "input");
  check_float_cpu(gate_up_weight, "gate_up weight");
  check_float_cpu(down_weight, "down weight");
  const int64_t H = b.size(-1), N = b.numel() / H, F = gate_up_weight.size(0) / 2;
  TORCH_CHECK(gate_up_weight.dim() == 2 && gate_up_weight.size(1) == H &&
                  gate_up_weight.size(0) % 2 == 0,
              "mlp: gate_up weight ", gate_up_weight.sizes(), " does not fit input ",
              b.sizes());
  TORCH_CHECK(down_weight.dim() == 2 && down_weight.size(1) == F, "mlp: down weight ",
              down_weight.sizes(), " expects ", F, " inputs");
  const at::Tensor gate_up = at::mm(b.view({N, H}), gate_up_weight.t());  // [N, 2F]
  // sigmoid(gate) by ATen's vectorised kernel on a contiguous copy of the gate columns (a
  // scalar exp per element costs more than the copy); backward reuses it
  at::Tensor sig = gate_up.view({N, F, 2}).select(2, 0).contiguous().sigmoid_();  // [N, F]
  at::Tensor act = at::empty({N, F}, b.options());
  const float *gu = gate_up.data_ptr<float>(), *sg = sig.data_ptr<float>();
  float* ap = act.data_ptr<float>();
  at::parallel_for(0, N * F, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) ap[i] = gu[2 * i] * sg[i] * gu[2 * i + 1];
  });
  std::vector<int64_t> out_shape(b.sizes().begin(), b.sizes().end());
  out_shape.back() = down_weight.size(0);
  return {at::mm(act, down_weight.t()).view(out_shape), gate_up, sig, act};
}

std::vector<at::Tensor> mlp_backward(const at::Tensor& dz, const at::Tensor& b,
                                     const at::Tensor& gate_up_weight,
                                     const at::Tensor& down_weight, const at::Tensor& gate_up,
                                     const at::Tensor& sig, const at::Tensor& act) {
  const int64_t H = b.size(-1), N = b.numel() / H, F = act.size(1);
  const at::Tensor dz_flat = dz.contiguous().view({N, down_weight.size(0)});
  at::Tensor d_down = at::mm(dz_flat.t(), act);
  const at::Tensor d_act = at::mm(dz_flat, down_weight);  // [N, F]
  at::Tensor d_gate_up = at::empty({N, 2 * F}, b.options());
  const float *da = d_act.data_ptr<float>(), *gu = gate_up.data_ptr<float>(),
              *sg = sig.data_ptr<float>();
  float* out = d_gate_up.data_ptr<float>();
  at::parallel_for(0, N * F, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float g = gu[2 * i], u = gu[2 * i + 1], s = sg[i];
      out[2 * i] = da[i] * u * s * (1.f + g * (1.f - s));  // d silu(g) = s (1 + g (1 - s))
      out[2 * i + 1] = da[i] * g * s;
    }
  });
  return {at::mm(d_gate_up, gate_up_weight).view(b.sizes()),
          at::mm(d_gate_up.t(), b.view({N, H})), d_down};
}

}  // namespace hybridflow
