// Python bindings of the generation engine's CPU kernels: engine._decode
#include <torch/extension.h>

#include "decode_layer.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "CPU float32 kernels of the decode step: one Llama layer in two calls";
  m.def("decode_attention", &hybridflow::decode_attention, py::arg("x"), py::arg("norm_weight"),
        py::arg("eps"), py::arg("qkv_weight"), py::arg("o_weight"), py::arg("cos"),
        py::arg("sin"), py::arg("k_cache"), py::arg("v_cache"), py::arg("pos"),
        py::arg("key_mask"), py::arg("q_per_group"), py::call_guard<py::gil_scoped_release>());
  m.def("decode_mlp", &hybridflow::decode_mlp, py::arg("x"), py::arg("norm_weight"),
        py::arg("eps"), py::arg("gate_up_weight"), py::arg("down_weight"),
        py::call_guard<py::gil_scoped_release>());
  m.def("decode_layers", &hybridflow::decode_layers, py::arg("x"), py::arg("layer_weights"),
        py::arg("eps"), py::arg("cos"), py::arg("sin"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("pos"), py::arg("key_mask"), py::arg("q_per_group"),
        py::call_guard<py::gil_scoped_release>());
}
