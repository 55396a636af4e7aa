// Python bindings of the training bridge's host kernels: type conversion
// only; the GIL is released while they run. Public surface:
// wuliang.embedding.kernels.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

#include "wuliang/embedding/kernels.h"

namespace py = pybind11;
using namespace pybind11::literals;
using namespace wuliang::embedding;

namespace {

// A 1-D C-contiguous array of 8-byte integers (int64 or uint64), read in place.
const uint64_t* Keys(const py::array& a, const std::string& what) {
  const py::dtype dt = a.dtype();
  if (dt.itemsize() != 8 || (dt.kind() != 'i' && dt.kind() != 'u') || a.ndim() != 1 ||
      !(a.flags() & py::array::c_style)) {
    throw py::type_error(what + " must be a 1-D contiguous int64 or uint64 array, got " +
                         std::string(py::str(dt)) + " with " + std::to_string(a.ndim()) +
                         " dimensions");
  }
  return static_cast<const uint64_t*>(a.data());
}

py::array_t<int32_t> IndexInArray(const py::array& a, const py::array& b, int32_t base) {
  const uint64_t* pa = Keys(a, "a");
  const uint64_t* pb = Keys(b, "b");
  if (b.shape(0) + static_cast<int64_t>(base) > INT32_MAX) {
    throw py::value_error("index_in: base + len(b) must fit in int32");
  }
  py::array_t<int32_t> out(a.shape(0));
  int32_t* dst = out.mutable_data();
  py::gil_scoped_release release;
  IndexIn(pa, a.shape(0), pb, b.shape(0), base, dst);
  return out;
}

// Converted to C-contiguous int32 / float32 when they are not already.
using IndexArray = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;
using ValueArray = py::array_t<float, py::array::c_style | py::array::forcecast>;

void ScatterAddRowsArray(py::array out, const IndexArray& index, const ValueArray& values) {
  if (!py::isinstance<py::array_t<float>>(out) || out.ndim() != 2 ||
      !(out.flags() & py::array::c_style) || !out.writeable()) {
    throw py::type_error("out must be a writable C-contiguous float32 [rows, dim] array");
  }
  const size_t dim = out.shape(1);
  const size_t n = index.ndim() == 1 ? index.shape(0) : 0;
  if (index.ndim() != 1 || values.ndim() != 2 || static_cast<size_t>(values.shape(0)) != n ||
      static_cast<size_t>(values.shape(1)) != dim) {
    throw py::value_error("index must be [n] and values [n, " + std::to_string(dim) +
                          "] (out's dim)");
  }
  float* dst = static_cast<float*>(out.mutable_data());
  const size_t rows = out.shape(0);
  py::gil_scoped_release release;
  ScatterAddRows(dst, rows, dim, index.data(), n, values.data());
}

}  // namespace

PYBIND11_MODULE(_embedding, m) {
  m.doc() = "wuliang training-bridge kernels (C++): index_in, scatter_add_rows";
  m.def("index_in", &IndexInArray, "a"_a, "b"_a, "base"_a = 0,
        "int32 [len(a)]: base + the position of each of a's keys in b (no repeats), or -1");
  m.def("scatter_add_rows", &ScatterAddRowsArray, "out"_a, "index"_a, "values"_a,
        "out[index[i]] += values[i]: per-row sums of looked-up values' gradients");
}
