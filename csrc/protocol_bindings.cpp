// Python bindings of the protocol plans (hybridflow_comm._C.protocol_plan & co).
// Kept apart from protocol_plans.cpp so that the CMake library builds without Python.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "protocol_plans.h"

namespace py = pybind11;

void register_protocol_plans(py::module_& m) {
  using namespace hybridflow;
  py::class_<ProtocolPlan>(m, "ProtocolPlan")
      .def_readonly("name", &ProtocolPlan::name)
      .def_property_readonly("distribute",
                             [](const ProtocolPlan& p) { return static_cast<int>(p.distribute); })
      .def_readonly("num_chunks", &ProtocolPlan::num_chunks)
      .def_readonly("chunk_of_rank", &ProtocolPlan::chunk_of_rank)
      .def_readonly("collect_ranks", &ProtocolPlan::collect_ranks)
      .def_property_readonly("collect",
                             [](const ProtocolPlan& p) { return static_cast<int>(p.collect); });
  m.def("builtin_protocols", &builtin_protocols);
  m.def("protocol_plan", &protocol_plan, py::arg("name"), py::arg("pp"), py::arg("tp"),
        py::arg("dp"), py::arg("pp_g"), py::arg("tp_g"),
        "Rank plan of a built-in transfer protocol for a layout");
  m.def("chunk_offsets", &chunk_offsets, py::arg("n"), py::arg("k"),
        "k + 1 row offsets of k equal chunks of n rows after padding");
  m.def(
      "transfer_segments",
      [](const std::vector<int64_t>& counts, int64_t n_valid, int64_t start, int64_t end) {
        std::vector<std::tuple<int64_t, int64_t, int64_t>> out;
        for (const auto& s : transfer_segments(counts, n_valid, start, end))
          out.emplace_back(s.src, s.src_start, s.src_end);
        return out;
      },
      py::arg("src_counts"), py::arg("n_valid"), py::arg("start"), py::arg("end"),
      "(source, start, end) pieces of rows [start, end) of a padded batch");
}
