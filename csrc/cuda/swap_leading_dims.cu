// CUDA path of the stacked <-> logical copy: dst[j, i, :] = src[i, j, :] for src [D0, D1, L].
// Compiled into hybridflow_comm._C only when the installed torch has CUDA (see setup.py).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>

namespace hybridflow {
namespace {

__global__ void swap_leading_dims_kernel(const uint8_t* src, uint8_t* dst, int64_t d0,
                                         int64_t d1, int64_t row_bytes) {
  const int64_t row = blockIdx.x;  // destination row r = j * d0 + i
  const int64_t j = row / d0, i = row % d0;
  const uint8_t* s = src + (i * d1 + j) * row_bytes;
  uint8_t* d = dst + row * row_bytes;
  for (int64_t k = threadIdx.x; k < row_bytes; k += blockDim.x) d[k] = s[k];
}

}  // namespace

void swap_leading_dims_cuda(const at::Tensor& src, at::Tensor& dst) {
  TORCH_CHECK(src.is_cuda() && dst.is_cuda() && src.is_contiguous() && dst.is_contiguous(),
              "swap_leading_dims_cuda needs contiguous CUDA tensors");
  TORCH_CHECK(src.dim() == 3 && dst.dim() == 3 && src.size(0) == dst.size(1) &&
                  src.size(1) == dst.size(0) && src.size(2) == dst.size(2),
              "shapes ", src.sizes(), " and ", dst.sizes(), " are not [D0, D1, L], [D1, D0, L]");
  const int64_t rows = src.size(0) * src.size(1);
  if (rows == 0) return;
  const int64_t row_bytes = src.size(2) * static_cast<int64_t>(src.element_size());
  swap_leading_dims_kernel<<<static_cast<unsigned>(rows), 256, 0,
                             at::cuda::getCurrentCUDAStream()>>>(
      static_cast<const uint8_t*>(src.const_data_ptr()), static_cast<uint8_t*>(dst.data_ptr()),
      src.size(0), src.size(1), row_bytes);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace hybridflow
