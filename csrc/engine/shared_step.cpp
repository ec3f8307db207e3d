// See shared_step.h.
#include "shared_step.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <utility>

#include "kv_attention.h"
#include "rms_norm.h"
#include "small_gemm.h"
#include "swiglu.h"

namespace hybridflow {

namespace {

// y[r, c] += add[r, c] for the columns [c0, c1) of `rows` rows (one float add each, as add_).
void add_columns(float* y, int64_t ldy, const float* add, int64_t ld_add, int64_t rows,
                 int64_t c0, int64_t c1) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = c0; c < c1; ++c) y[r * ldy + c] += add[r * ld_add + c];
}

// One product for this thread's share of the weight rows: y[:, n0:n1] = x @ w[n0:n1].T
// (+ bias) for w [N, K], or the stacked row-parallel form [m, N, K/m] summed slice by slice as
// decode_layer.cpp's row_matmul_out does.  Returns [n0, n1).
std::pair<int64_t, int64_t> product_share(const float* x, int64_t ldx, const at::Tensor& w,
                                          float* y, int64_t ldy, int64_t rows, int64_t thread,
                                          int64_t threads, bool row_lanes,
                                          const float* bias = nullptr) {
  const int64_t n = w.size(-2), k = w.size(-1), slices = w.dim() == 3 ? w.size(0) : 1;
  const auto [n0, n1] = small_gemm_share(n, thread, threads);
  const float* wp = w.data_ptr<float>();
  for (int64_t i = 0; i < slices; ++i)
    small_gemm_rows(x + i * k, ldx, wp + i * (slices > 1 ? w.stride(0) : 0), w.stride(-2), y,
                    ldy, rows, n0, n1, k, i > 0, row_lanes, i == 0 ? bias : nullptr);
  return {n0, n1};
}

// h[:, n0:n1] += x @ w[n0:n1].T, this thread's share of a product that ends in the residual
// stream: a plain weight [N, K] adds each output to h as it is stored (one float add, as
// h.add_(part)); the stacked form [m, N, K/m] sums its slices into `part` first (their sum is
// what the row-block path adds to h).
void residual_share(const float* x, int64_t ldx, const at::Tensor& w, float* h, float* part,
                    int64_t hidden, int64_t rows, int64_t thread, int64_t threads,
                    bool row_lanes) {
  if (w.dim() == 2) {
    const auto [n0, n1] = small_gemm_share(w.size(0), thread, threads);
    small_gemm_rows(x, ldx, w.data_ptr<float>(), w.stride(0), h, hidden, rows, n0, n1,
                    w.size(1), true, row_lanes);
    return;
  }
  const auto [n0, n1] = product_share(x, ldx, w, part, hidden, rows, thread, threads, row_lanes);
  add_columns(h, hidden, part, hidden, rows, n0, n1);
}

}  // namespace

bool SharedDecodeStep::applies(int64_t batch, const std::vector<at::Tensor>& layer_weights,
                               const std::vector<at::Tensor>& biases) {
  if (at::get_num_threads() < 2 || batch < 1 || batch > kSmallGemmMaxRows ||
      !small_gemm_enabled())
    return false;
  for (size_t i = 0; i < layer_weights.size(); ++i)
    if (i % 6 != 0 && i % 6 != 3 && layer_weights[i].stride(-1) != 1) return false;  // not norms
  for (const at::Tensor& b : biases)
    if (b.defined() && !b.is_contiguous()) return false;
  return true;
}

SharedDecodeStep::SharedDecodeStep(int64_t batch, int64_t hidden,
                                   const std::vector<at::Tensor>& layer_weights,
                                   const std::vector<at::Tensor>& biases, double eps,
                                   const at::Tensor& k_cache, const at::Tensor& v_cache,
                                   const at::Tensor& key_mask, int64_t q_per_group,
                                   bool row_lanes, int threads)
    : batch_(batch),
      hidden_(hidden),
      layers_(k_cache.size(0)),
      q_per_group_(q_per_group),
      n_qkv_(layer_weights[1].size(0)),
      n_attn_(k_cache.size(2) * q_per_group * k_cache.size(4)),
      n_gu_(layer_weights[4].size(0)),
      eps_(static_cast<float>(eps)),
      row_lanes_(row_lanes),
      // the MLP in the row-lane layout (small_gemm.h) where the products take the row-lane
      // form: gate/up stored as gu_t [2F, 32], the SwiGLU on it, and the down projection
      // reading act_t [F, 32] as its transposed input (no transposes in between)
      mlp_in_lanes_(row_lanes && row_lanes_supported() && layer_weights[5].dim() == 2),
      weights_(layer_weights),
      biases_(biases),
      k_cache_(k_cache),
      v_cache_(v_cache),
      key_mask_(key_mask.stride(1) == 1 ? key_mask : key_mask.contiguous()) {
  TORCH_CHECK(threads >= 1 && static_cast<int64_t>(biases.size()) == layers_,
              "SharedDecodeStep: ", threads, " threads, ", biases.size(), " biases for ",
              layers_, " layers");
  for (int64_t l = 0; l < layers_; ++l)
    for (int j : {0, 3}) norms_.push_back(layer_weights[6 * l + j].contiguous());
  const at::TensorOptions options = k_cache.options();
  const int64_t mlp_rows = mlp_in_lanes_ ? kSmallGemmMaxRows : batch;
  xn_ = at::empty({batch, hidden}, options);
  part_ = at::empty({batch, hidden}, options);
  qkv_ = at::empty({batch, n_qkv_}, options);
  attn_ = at::empty({batch, n_attn_}, options);
  gu_ = at::empty({mlp_rows, n_gu_}, options);
  act_ = at::empty({mlp_rows, n_gu_ / 2}, options);
  // a thread may take every pair (a region smaller than asked for): q_rot, scores and probs
  const int64_t pairs = batch * k_cache.size(2), max_len = v_cache.size(3);
  scratch_floats_ = pairs * q_per_group * (k_cache.size(4) + 2 * max_len);
  scratch_ = at::empty({threads, scratch_floats_}, options);
}

void SharedDecodeStep::run(int64_t t, int64_t nt, float* h, int64_t pos, const float* cos,
                           const float* sin, int64_t cos_stride, int64_t sin_stride) const {
  const int64_t groups = k_cache_.size(2), head_dim = k_cache_.size(4);
  const int64_t r0 = t * batch_ / nt, rows = (t + 1) * batch_ / nt - r0;
  const int64_t p0 = t * batch_ * groups / nt, p1 = (t + 1) * batch_ * groups / nt;  // pairs
  float *xp = xn_.data_ptr<float>(), *pp = part_.data_ptr<float>(),
        *qp = qkv_.data_ptr<float>(), *ap = attn_.data_ptr<float>(),
        *gp = gu_.data_ptr<float>(), *actp = act_.data_ptr<float>();
  float* own = scratch_.data_ptr<float>() + std::min<int64_t>(t, scratch_.size(0) - 1) * scratch_floats_;
  const int64_t n_pairs = std::max<int64_t>(p1 - p0, 0), keys = pos + 1;
  const AttentionScratch scratch{own, own + n_pairs * q_per_group_ * head_dim,
                                 own + n_pairs * q_per_group_ * (head_dim + keys)};
  for (int64_t l = 0; l < layers_; ++l) {
    const at::Tensor* w = weights_.data() + 6 * l;
    const AttentionView view{k_cache_.data_ptr<float>() + l * k_cache_.stride(0),
                             v_cache_.data_ptr<float>() + l * v_cache_.stride(0), groups,
                             k_cache_.size(3), v_cache_.size(3), head_dim, cos, sin,
                             cos_stride, sin_stride, key_mask_.data_ptr<bool>(),
                             key_mask_.stride(0)};
    rms_norm_rows(h + r0 * hidden_, norms_[2 * l].data_ptr<float>(), rows, hidden_, eps_,
                  xp + r0 * hidden_, nullptr);
#pragma omp barrier
    product_share(xp, hidden_, w[1], qp, n_qkv_, batch_, t, nt, row_lanes_,
                  biases_[l].defined() ? biases_[l].data_ptr<float>() : nullptr);
#pragma omp barrier
    attend_pairs(qp + p0 * n_qkv_ / groups, p0, p1, view, pos, q_per_group_, scratch,
                 ap + p0 * n_attn_ / groups);
#pragma omp barrier
    residual_share(ap, n_attn_, w[2], h, pp, hidden_, batch_, t, nt, row_lanes_);
#pragma omp barrier
    rms_norm_rows(h + r0 * hidden_, norms_[2 * l + 1].data_ptr<float>(), rows, hidden_, eps_,
                  xp + r0 * hidden_, nullptr);
#pragma omp barrier
    if (mlp_in_lanes_) {
      const auto [g0, g1] = small_gemm_share(n_gu_, t, nt);  // whole panels: even
      small_gemm_rows_to_lanes(xp, hidden_, batch_, w[4].data_ptr<float>(), w[4].stride(0), gp,
                               g0, g1, hidden_);
      swiglu_forward_lanes(gp, actp, kSmallGemmMaxRows, g0 / 2, g1 / 2);
    } else {
      const auto [g0, g1] = product_share(xp, hidden_, w[4], gp, n_gu_, batch_, t, nt,
                                          row_lanes_);
      swiglu_forward_rows(gp + g0, n_gu_, actp + g0 / 2, n_gu_ / 2, batch_, (g1 - g0) / 2);
    }
#pragma omp barrier
    if (mlp_in_lanes_) {
      const auto [d0, d1] = small_gemm_share(hidden_, t, nt);
      small_gemm_rows_from_lanes(actp, batch_, w[5].data_ptr<float>(), w[5].stride(0), h,
                                 hidden_, d0, d1, n_gu_ / 2, true);
    } else {
      residual_share(actp, n_gu_ / 2, w[5], h, pp, hidden_, batch_, t, nt, row_lanes_);
    }
#pragma omp barrier
  }
}

}  // namespace hybridflow
