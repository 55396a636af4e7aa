// Python bindings of the benchmark-only naive engine (module wuliang_bench,
// built with WULIANG_BENCH=ON; see naive_engine.h): type conversion only, the
// GIL is released while it runs. Keys are read in place, as by the engine.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

#include "naive_engine.h"
#include "wuliang/ps/table_spec.h"

namespace py = pybind11;
using namespace pybind11::literals;
using wuliang::bench::NaiveEngine;

namespace {

// A 1-D C-contiguous array of 8-byte integers (int64 or uint64).
const uint64_t* Keys(const py::array& keys) {
  const py::dtype dt = keys.dtype();
  if (dt.itemsize() != 8 || (dt.kind() != 'i' && dt.kind() != 'u') || keys.ndim() != 1 ||
      !(keys.flags() & py::array::c_style)) {
    throw py::type_error("keys must be a 1-D C-contiguous int64 or uint64 array, got " +
                         std::string(py::str(dt)));
  }
  return static_cast<const uint64_t*>(keys.data());
}

// A C-contiguous float32 array of exactly n * dim values (never converted).
float* Floats(const py::object& obj, size_t n, int dim, const char* name) {
  if (!py::isinstance<py::array>(obj))
    throw py::type_error(std::string(name) + " must be an array");
  const auto arr = py::reinterpret_borrow<py::array>(obj);
  if (arr.dtype().num() != py::dtype::of<float>().num() || !(arr.flags() & py::array::c_style) ||
      static_cast<size_t>(arr.size()) != n * dim) {
    throw py::type_error(std::string(name) + " must be a C-contiguous float32 array of " +
                         std::to_string(n * dim) + " values");
  }
  return const_cast<float*>(static_cast<const float*>(arr.data()));
}

}  // namespace

PYBIND11_MODULE(wuliang_bench, m) {
  m.doc() = "wuliang benchmark baselines (C++): the naive parameter-server engine";
  // TableSpec is bound by the engine's extension: NaiveEngine takes its type.
  py::module_::import("wuliang.ps_server._engine");
  py::class_<NaiveEngine>(m, "NaiveEngine")
      .def(py::init<const wuliang::ps::TableSpec&>(), "spec"_a)
      .def(
          "pull",
          [](NaiveEngine& e, const py::array& keys, bool train, const py::object& out) {
            const uint64_t* k = Keys(keys);
            const size_t n = keys.shape(0);
            py::array_t<float> result;
            if (out.is_none()) {
              result = py::array_t<float>({n, static_cast<size_t>(e.dim())});
            } else {
              Floats(out, n, e.dim(), "out");
              result = py::reinterpret_borrow<py::array_t<float>>(out);
              if (!result.writeable()) throw py::value_error("out must be writeable");
            }
            float* dst = result.mutable_data();
            py::gil_scoped_release release;
            e.Pull(k, n, dst, train);
            return result;
          },
          "keys"_a, "train"_a = true, "out"_a = py::none())
      .def(
          "push",
          [](NaiveEngine& e, const py::array& keys, const py::object& grads) {
            const uint64_t* k = Keys(keys);
            const size_t n = keys.shape(0);
            const float* g = Floats(grads, n, e.dim(), "grads");
            py::gil_scoped_release release;
            e.Push(k, n, g);
          },
          "keys"_a, "grads"_a)
      .def_property_readonly("dim", &NaiveEngine::dim)
      .def("rows", &NaiveEngine::rows)
      .def("bytes", &NaiveEngine::bytes);
}
