// See onednn_matmul.h.  ATen exports at::native::mkldnn_matmul (aten/src/ATen/native/mkldnn/
// Matmul.h, not shipped with the installed headers, hence the declaration below); with the
// default float32 matmul precision it computes in float32 (no bf16/tf32 down-conversion).
#include "onednn_matmul.h"

#include <ATen/Config.h>

namespace at::native {
TORCH_API void mkldnn_matmul(const at::Tensor& mat1, const at::Tensor& mat2,
                             const at::Tensor& result, float beta, float alpha);
}  // namespace at::native

namespace hybridflow {

namespace {

bool row_major_or_transposed(const at::Tensor& t) {
  return t.is_contiguous() || t.transpose(-2, -1).is_contiguous();
}

at::Tensor readable(const at::Tensor& t) {
  return row_major_or_transposed(t) ? t : t.contiguous();
}

}  // namespace

void onednn_mm_out(const at::Tensor& a, const at::Tensor& b, at::Tensor& out, bool accumulate) {
#if AT_MKLDNN_ENABLED()
  const int64_t dims = a.dim();
  TORCH_CHECK((dims == 2 || dims == 3) && b.dim() == dims && out.dim() == dims,
              "onednn_mm_out: 2-D or 3-D (batched) operands, got ", a.sizes(), " @ ",
              b.sizes(), " -> ", out.sizes());
  TORCH_CHECK(a.size(-1) == b.size(-2) && out.size(-2) == a.size(-2) &&
                  out.size(-1) == b.size(-1) &&
                  (dims == 2 || (a.size(0) == b.size(0) && out.size(0) == a.size(0))),
              "onednn_mm_out: shapes ", a.sizes(), " @ ", b.sizes(), " -> ", out.sizes());
  TORCH_CHECK(a.scalar_type() == at::kFloat && b.scalar_type() == at::kFloat &&
                  out.scalar_type() == at::kFloat,
              "onednn_mm_out: float32 only");
  TORCH_CHECK(a.device().is_cpu() && b.device().is_cpu() && out.device().is_cpu(),
              "onednn_mm_out: CPU tensors only");
  TORCH_CHECK(out.is_contiguous(), "onednn_mm_out: out must be row-major");
  if (a.size(-1) == 0) {  // oneDNN rejects an empty reduction: the product is zero
    if (!accumulate) out.zero_();
    return;
  }
  if (out.numel() == 0) return;
  at::native::mkldnn_matmul(readable(a), readable(b), out, accumulate ? 1.0f : 0.0f, 1.0f);
#else
  TORCH_CHECK(false, "onednn_mm_out: this torch was built without oneDNN (MKLDNN)");
#endif
}

}  // namespace hybridflow
