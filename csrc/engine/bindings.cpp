// Python bindings of the engine's CPU float32 kernels: engine._kernels
#include <torch/extension.h>

#include "decode_layer.h"
#include "greedy_decode.h"
#include "greedy_head.h"
#include "onednn_matmul.h"
#include "qkv_heads.h"
#include "rms_norm.h"
#include "sampling_noise.h"
#include "small_gemm.h"
#include "swiglu.h"
#include "vocab_rows.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() =
      "CPU float32 kernels of the engine: the decode step (a Llama layer in one or two calls) "
      "and RMSNorm with a hand-written backward pass";
  m.def("decode_attention", &hybridflow::decode_attention, py::arg("x"), py::arg("norm_weight"),
        py::arg("eps"), py::arg("qkv_weight"), py::arg("o_weight"), py::arg("cos"),
        py::arg("sin"), py::arg("k_cache"), py::arg("v_cache"), py::arg("pos"),
        py::arg("key_mask"), py::arg("q_per_group"), py::arg("qkv_bias") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  m.def("decode_mlp", &hybridflow::decode_mlp, py::arg("x"), py::arg("norm_weight"),
        py::arg("eps"), py::arg("gate_up_weight"), py::arg("down_weight"),
        py::call_guard<py::gil_scoped_release>());
  m.def(
      "small_linear",
      [](const at::Tensor& x, const at::Tensor& w, bool row_lanes) {
        at::Tensor y = at::empty({x.size(0), w.size(0)}, x.options());
        hybridflow::small_linear_out(x, w, y, false, row_lanes);
        return y;
      },
      py::arg("x"), py::arg("weight"), py::arg("row_lanes") = false,
      "x [M, K] @ weight[N, K].T by the decode-step kernel (row_lanes: its row-lane form)",
      py::call_guard<py::gil_scoped_release>());
  m.def(
      "onednn_mm",
      [](const at::Tensor& a, const at::Tensor& b) {
        TORCH_CHECK(a.dim() >= 2 && b.dim() >= 2, "onednn_mm_out: 2-D or 3-D operands, got ",
                    a.sizes(), " @ ", b.sizes());
        std::vector<int64_t> size(a.sizes().begin(), a.sizes().end());
        size.back() = b.size(-1);
        at::Tensor out = at::empty(size, a.options());
        hybridflow::onednn_mm_out(a, b, out, false);
        return out;
      },
      py::arg("a"), py::arg("b"),
      "a [(g,) n, k] @ b [(g,) k, m] on oneDNN, float32; either operand may be a transposed "
      "view",
      py::call_guard<py::gil_scoped_release>());
  m.attr("small_gemm_max_rows") = hybridflow::kSmallGemmMaxRows;
  m.attr("row_lanes_supported") = hybridflow::row_lanes_supported();
  m.def("use_small_gemm", &hybridflow::use_small_gemm, py::arg("enabled"),
        "decode-step matrix products by the in-place small-M kernel (True, default) or BLAS");
  m.def("decode_layers", &hybridflow::decode_layers, py::arg("x"), py::arg("layer_weights"),
        py::arg("eps"), py::arg("cos"), py::arg("sin"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("pos"), py::arg("key_mask"), py::arg("q_per_group"),
        py::arg("qkv_biases") = std::vector<std::optional<at::Tensor>>{},
        py::arg("row_lanes") = false, py::call_guard<py::gil_scoped_release>());
  // RMSNorm (rms_norm.h), training and the final norm; the GIL is released like the decode
  // kernels'.
  m.def("rms_norm_forward", &hybridflow::rms_norm_forward, py::arg("x"), py::arg("weight"),
        py::arg("eps"), py::call_guard<py::gil_scoped_release>());
  // the greedy choice and log-normaliser of next-token logits (vocab_rows.h)
  m.def("argmax_logsumexp", &hybridflow::argmax_logsumexp, py::arg("z"), py::arg("banned"),
        py::call_guard<py::gil_scoped_release>());
  // final norm, LM head and greedy choice of a decode step in one call (greedy_head.h)
  m.def("greedy_head", &hybridflow::greedy_head, py::arg("x"), py::arg("norm_weight"),
        py::arg("eps"), py::arg("head"), py::arg("banned"), py::arg("row_lanes") = false,
        py::call_guard<py::gil_scoped_release>());
  // greedy decode steps of rows that all run to the end, no Python between (greedy_decode.h)
  m.def("greedy_decode", &hybridflow::greedy_decode, py::arg("first_tokens"), py::arg("steps"),
        py::arg("embed"), py::arg("layer_weights"), py::arg("eps"), py::arg("cos"),
        py::arg("sin"), py::arg("k_cache"), py::arg("v_cache"), py::arg("start_pos"),
        py::arg("key_mask"), py::arg("q_per_group"), py::arg("qkv_biases"),
        py::arg("norm_weight"), py::arg("norm_eps"), py::arg("head"), py::arg("banned"),
        py::arg("row_lanes") = false, py::call_guard<py::gil_scoped_release>());
  m.def("counter_uniforms", &hybridflow::counter_uniforms, py::arg("seed"), py::arg("row_ids"),
        py::arg("cols"), "uniforms in (0, 1] from splitmix64 of (seed, row id, column)",
        py::call_guard<py::gil_scoped_release>());
  // SwiGLU of the interleaved gate/up layout (swiglu.h), training and prefill
  m.def("swiglu_forward", &hybridflow::swiglu_forward, py::arg("gu"),
        py::call_guard<py::gil_scoped_release>());
  m.def("swiglu_backward", &hybridflow::swiglu_backward, py::arg("gu"), py::arg("dy"),
        py::call_guard<py::gil_scoped_release>());
  // the attention inputs of a training layer from its fused q/k/v projection (qkv_heads.h)
  m.def("qkv_heads_forward", &hybridflow::qkv_heads_forward, py::arg("qkv"), py::arg("bias"),
        py::arg("cos"), py::arg("sin"), py::arg("q_per_group"), py::arg("scale"),
        py::call_guard<py::gil_scoped_release>());
  m.def("qkv_heads_backward", &hybridflow::qkv_heads_backward, py::arg("grad_q"),
        py::arg("grad_k"), py::arg("grad_v"), py::arg("cos"), py::arg("sin"),
        py::arg("q_per_group"), py::arg("scale"), py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm_backward", &hybridflow::rms_norm_backward, py::arg("dy"), py::arg("x"),
        py::arg("weight"), py::arg("rstd"), py::call_guard<py::gil_scoped_release>());
}
