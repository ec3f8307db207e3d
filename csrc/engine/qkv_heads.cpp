// See qkv_heads.h.  In Python this is a bias add, a split, RoPE of the queries and keys
// (two multiplies, a negation, a concatenation and an add each), the query scale and three
// permuting copies into the grouped layout, and as many passes again backward; here one read
// of each input row and one write of each output row.  Threads take blocks of (b, s) rows.
//
// RoPE (half-split, as transformers' Llama): y = x * cos + rotate_half(x) * sin with
// rotate_half(x) = (-x2, x1).  Its gradient: dx = dy * cos + rotate_half^T(dy * sin),
// rotate_half^T(u) = (u2, -u1).
#include "qkv_heads.h"

#include <ATen/Parallel.h>

#include "row_ops.h"

namespace hybridflow {
namespace {

constexpr int64_t kGrainRows = 16;

struct Sizes {
  int64_t batch, seq, groups, qpg, dim;
};

// cos/sin [B, S, D] with a unit inner stride: the row of token (b, s)
struct Tables {
  const float *cos, *sin;
  int64_t sb, ss;
  const float* c(int64_t b, int64_t s) const { return cos + b * sb + s * ss; }
  const float* s(int64_t b, int64_t s) const { return sin + b * sb + s * ss; }
};

Tables tables(const at::Tensor& cos, const at::Tensor& sin, const Sizes& z) {
  check_float_cpu(cos, "qkv_heads", "cos");
  check_float_cpu(sin, "qkv_heads", "sin");
  TORCH_CHECK(cos.dim() == 3 && cos.size(0) == z.batch && cos.size(1) == z.seq &&
                  cos.size(2) == z.dim && sin.sizes() == cos.sizes() &&
                  sin.strides() == cos.strides() && cos.stride(2) == 1,
              "qkv_heads: cos/sin must be [B, S, D] = [", z.batch, ", ", z.seq, ", ", z.dim,
              "] with equal strides and a unit inner stride, got ", cos.sizes(), " / ",
              sin.sizes());
  return {cos.data_ptr<float>(), sin.data_ptr<float>(), cos.stride(0), cos.stride(1)};
}

// out = (rope(x + bias) [* scale]); bias may be null
inline void rope_in(const float* x, const float* bias, const float* c, const float* s,
                    int64_t dim, bool scaled, float scale, float* out) {
  float t[kMaxHeadDim];
  const float* src = x;
  if (bias != nullptr) {
    for (int64_t d = 0; d < dim; ++d) t[d] = x[d] + bias[d];
    src = t;
  }
  rope_row(src, c, s, dim, out);
  if (scaled)
    for (int64_t d = 0; d < dim; ++d) out[d] = out[d] * scale;
}

// dx = g' * cos + rotate_half^T(g' * sin), g' = g [* scale]
inline void rope_grad(const float* g, const float* c, const float* s, int64_t dim, bool scaled,
                      float scale, float* dx) {
  const int64_t half = dim / 2;
  float gs[kMaxHeadDim];
  for (int64_t d = 0; d < dim; ++d) gs[d] = scaled ? g[d] * scale : g[d];
  for (int64_t d = 0; d < half; ++d) {
    dx[d] = gs[d] * c[d] + gs[d + half] * s[d + half];
    dx[d + half] = gs[d + half] * c[d + half] - gs[d] * s[d];
  }
}

// fn(row, g, bg, s, cos, sin) for every token row = b * S + s and KV group g (bg = b * h_kv + g),
// token rows split over the intra-op threads
template <typename Fn>
void for_token_groups(const Sizes& z, const Tables& tab, const Fn& fn) {
  at::parallel_for(0, z.batch * z.seq, kGrainRows, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t b = row / z.seq, s = row % z.seq;
      for (int64_t g = 0; g < z.groups; ++g)
        fn(row, g, b * z.groups + g, s, tab.c(b, s), tab.s(b, s));
    }
  });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> qkv_heads_forward(
    const at::Tensor& qkv_in, const std::optional<at::Tensor>& bias_in, const at::Tensor& cos,
    const at::Tensor& sin, int64_t q_per_group, double scale_in) {
  check_float_cpu(qkv_in, "qkv_heads", "qkv");
  TORCH_CHECK(qkv_in.dim() == 3, "qkv_heads: qkv must be [B, S, h_kv*(qpg+2)*D], got ",
              qkv_in.sizes());
  TORCH_CHECK(q_per_group >= 1, "qkv_heads: q_per_group ", q_per_group, " must be >= 1");
  const int64_t width = qkv_in.size(2), dim = cos.size(-1);
  TORCH_CHECK(dim > 0 && dim % 2 == 0 && dim <= kMaxHeadDim &&
                  width % ((q_per_group + 2) * dim) == 0,
              "qkv_heads: head dim ", dim, " must be even, <= ", kMaxHeadDim,
              " and divide qkv's width ", width, " into groups of ", q_per_group + 2, " heads");
  const Sizes z{qkv_in.size(0), qkv_in.size(1), width / ((q_per_group + 2) * dim), q_per_group,
                dim};
  const Tables tab = tables(cos, sin, z);
  const at::Tensor qkv = qkv_in.contiguous();
  at::Tensor bias;
  if (bias_in.has_value()) {
    bias = bias_in->contiguous();
    check_float_cpu(bias, "qkv_heads", "bias");
    TORCH_CHECK(bias.dim() == 1 && bias.size(0) == width, "qkv_heads: bias ", bias.sizes(),
                " must be [", width, "]");
  }
  const at::TensorOptions opt = qkv.options();
  at::Tensor q = at::empty({z.batch * z.groups, z.qpg * z.seq, dim}, opt);
  at::Tensor k = at::empty({z.batch * z.groups, z.seq, dim}, opt);
  at::Tensor v = at::empty({z.batch * z.groups, z.seq, dim}, opt);
  const float* src = qkv.data_ptr<float>();
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float scale = static_cast<float>(scale_in);
  for_token_groups(z, tab, [&](int64_t row, int64_t g, int64_t bg, int64_t s, const float* c,
                               const float* sn) {
    const int64_t head0 = g * (z.qpg + 2);  // this group's first head in the row
    const float* x = src + row * width + head0 * dim;
    const float* xb = bp ? bp + head0 * dim : nullptr;
    for (int64_t j = 0; j < z.qpg; ++j)
      rope_in(x + j * dim, xb ? xb + j * dim : nullptr, c, sn, dim, true, scale,
              qp + ((bg * z.qpg + j) * z.seq + s) * dim);
    rope_in(x + z.qpg * dim, xb ? xb + z.qpg * dim : nullptr, c, sn, dim, false, 1.f,
            kp + (bg * z.seq + s) * dim);
    const float* xv = x + (z.qpg + 1) * dim;
    float* out = vp + (bg * z.seq + s) * dim;
    for (int64_t d = 0; d < dim; ++d) out[d] = xb ? xv[d] + xb[(z.qpg + 1) * dim + d] : xv[d];
  });
  return {q, k, v};
}

at::Tensor qkv_heads_backward(const at::Tensor& grad_q_in, const at::Tensor& grad_k_in,
                              const at::Tensor& grad_v_in, const at::Tensor& cos,
                              const at::Tensor& sin, int64_t q_per_group, double scale_in) {
  for (const auto& [t, name] : {std::pair{&grad_q_in, "grad_q"}, {&grad_k_in, "grad_k"},
                                {&grad_v_in, "grad_v"}})
    check_float_cpu(*t, "qkv_heads", name);
  TORCH_CHECK(q_per_group >= 1 && grad_k_in.dim() == 3 && grad_v_in.sizes() == grad_k_in.sizes() &&
                  grad_q_in.dim() == 3 && grad_q_in.size(0) == grad_k_in.size(0) &&
                  grad_q_in.size(1) == q_per_group * grad_k_in.size(1) &&
                  grad_q_in.size(2) == grad_k_in.size(2),
              "qkv_heads backward: grad_q [G, qpg*S, D], grad_k/grad_v [G, S, D] expected, got ",
              grad_q_in.sizes(), ", ", grad_k_in.sizes(), ", ", grad_v_in.sizes());
  const int64_t batch = cos.size(0), dim = grad_k_in.size(2);
  TORCH_CHECK(batch > 0 && grad_k_in.size(0) % batch == 0 && dim % 2 == 0 && dim <= kMaxHeadDim,
              "qkv_heads backward: ", grad_k_in.size(0), " groups for a batch of ", batch,
              ", head dim ", dim);
  const Sizes z{batch, grad_k_in.size(1), grad_k_in.size(0) / batch, q_per_group, dim};
  const Tables tab = tables(cos, sin, z);
  const at::Tensor gq = grad_q_in.contiguous(), gk = grad_k_in.contiguous(),
                   gv = grad_v_in.contiguous();
  const int64_t width = z.groups * (z.qpg + 2) * dim;
  at::Tensor dqkv = at::empty({z.batch, z.seq, width}, gq.options());
  const float *qp = gq.data_ptr<float>(), *kp = gk.data_ptr<float>(), *vp = gv.data_ptr<float>();
  float* out = dqkv.data_ptr<float>();
  const float scale = static_cast<float>(scale_in);
  for_token_groups(z, tab, [&](int64_t row, int64_t g, int64_t bg, int64_t s, const float* c,
                               const float* sn) {
    float* dx = out + row * width + g * (z.qpg + 2) * dim;
    for (int64_t j = 0; j < z.qpg; ++j)
      rope_grad(qp + ((bg * z.qpg + j) * z.seq + s) * dim, c, sn, dim, true, scale,
                dx + j * dim);
    rope_grad(kp + (bg * z.seq + s) * dim, c, sn, dim, false, 1.f, dx + z.qpg * dim);
    const float* gvr = vp + (bg * z.seq + s) * dim;
    float* dv = dx + (z.qpg + 1) * dim;
    for (int64_t d = 0; d < dim; ++d) dv[d] = gvr[d];
  });
  return dqkv;
}

}  // namespace hybridflow
