// Python bindings of the layout rank maths and the protocol plans (hybridflow_comm._C.Layout,
// hybridflow_comm._C.protocol_plan & co).
// Kept apart from protocol_plans.cpp so that the CMake library builds without Python.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <tuple>

#include "protocol_plans.h"

namespace py = pybind11;

void register_protocol_plans(py::module_& m) {
  using namespace hybridflow;
  py::class_<Layout>(m, "Layout",
                     "Coordinate maths of a training layout pp x tp x dp with the generation "
                     "layout pp_g x tp_g on its ranks (wrapped by hybridflow_comm.layout)")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, int64_t>(), py::arg("pp"),
           py::arg("tp"), py::arg("dp"), py::arg("pp_g") = 1, py::arg("tp_g") = 1)
      .def(
          "train_coords",
          [](const Layout& l, int64_t rank) {
            const TrainCoords c = l.train_coords(rank);
            return std::make_tuple(c.pp, c.tp, c.dp);
          },
          py::arg("rank"), "(pp, tp, dp) of a rank")
      .def(
          "train_rank",
          [](const Layout& l, int64_t pp, int64_t tp, int64_t dp) {
            return l.train_rank(TrainCoords{pp, tp, dp});
          },
          py::arg("pp"), py::arg("tp"), py::arg("dp"), "rank at training coordinates")
      .def(
          "gen_coords",
          [](const Layout& l, int64_t rank) {
            const GenCoords g = l.gen_coords(rank);
            return std::make_tuple(g.pp_g, g.tp_g, g.micro_dp, g.dp, g.dp_g);
          },
          py::arg("rank"), "(pp_g, tp_g, micro_dp, dp, dp_g) of a rank")
      .def("gen_rank", &Layout::gen_rank, py::arg("pp_g"), py::arg("tp_g"), py::arg("micro_dp"),
           py::arg("dp"), "rank at generation coordinates");
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
  m.def("protocol_plan",
        py::overload_cast<const std::string&, int64_t, int64_t, int64_t, int64_t, int64_t>(
            &protocol_plan),
        py::arg("name"), py::arg("pp"), py::arg("tp"), py::arg("dp"), py::arg("pp_g"),
        py::arg("tp_g"),
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
