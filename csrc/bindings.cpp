// Python bindings of the C++ core: hybridflow_comm._C
#include <torch/extension.h>

#include "flat_buffer.h"
#include "protocol_plans.h"

namespace py = pybind11;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "hybridflow C++ core: flat parameter buffers, pack/unpack, rank plans";
  m.def("page_size", &hybridflow::page_size);
  m.def("alloc_paged", &hybridflow::alloc_paged, py::arg("nbytes"),
        "1-D uint8 tensor on its own page-aligned anonymous mapping");
  m.def("release_pages", &hybridflow::release_pages, py::arg("buffer"), py::arg("offset"),
        py::arg("nbytes"), "Drop the whole pages inside a byte range; returns bytes released");
  m.def("resident_bytes", &hybridflow::resident_bytes, py::arg("buffer"), py::arg("offset"),
        py::arg("nbytes"));
  m.def("plan_offsets", &hybridflow::plan_offsets, py::arg("nbytes"), py::arg("align"));
  m.def("pack_into", &hybridflow::pack_into, py::arg("tensors"), py::arg("flat"),
        py::arg("offsets"), py::call_guard<py::gil_scoped_release>());
  m.def("unpack_from", &hybridflow::unpack_from, py::arg("flat"), py::arg("tensors"),
        py::arg("offsets"), py::call_guard<py::gil_scoped_release>());
  m.def("copy_bytes", &hybridflow::copy_bytes, py::arg("src"), py::arg("dst"),
        py::arg("src_offsets"), py::arg("dst_offsets"), py::arg("lengths"),
        py::call_guard<py::gil_scoped_release>());
  m.def("checksum", &hybridflow::checksum, py::arg("tensor"),
        py::call_guard<py::gil_scoped_release>());
  py::class_<hybridflow::StridedBucket>(m, "StridedBucket")
      .def_readonly("start", &hybridflow::StridedBucket::start)
      .def_readonly("count", &hybridflow::StridedBucket::count)
      .def_readonly("stride", &hybridflow::StridedBucket::stride)
      .def("__repr__", [](const hybridflow::StridedBucket& b) {
        return "StridedBucket(start=" + std::to_string(b.start) + ", count=" +
               std::to_string(b.count) + ", stride=" + std::to_string(b.stride) + ")";
      });
  m.def("plan_strided_buckets", &hybridflow::plan_strided_buckets, py::arg("kinds"),
        py::arg("offsets"), py::arg("nbytes"), py::arg("bucket_bytes"));
  m.def("unstack_to_logical", &hybridflow::unstack_to_logical, py::arg("stacked"),
        py::arg("out"), py::call_guard<py::gil_scoped_release>());
  m.def("stack_from_logical", &hybridflow::stack_from_logical, py::arg("logical"),
        py::arg("stacked"), py::call_guard<py::gil_scoped_release>());
  register_protocol_plans(m);
}
