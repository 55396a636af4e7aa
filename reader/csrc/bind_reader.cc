// Python bindings of the reader's C++ helpers: type conversion only; the GIL
// is released while they run.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <utility>
#include <vector>

#include "wuliang/reader/prepare.h"
#include "wuliang/reader/string_hash.h"

namespace py = pybind11;
using namespace pybind11::literals;
using namespace wuliang::reader;

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

// Hands a vector to numpy without copying it.
template <class T>
py::array_t<T> ToArray(std::vector<T>&& v) {
  auto* owned = new std::vector<T>(std::move(v));
  py::capsule free(owned, [](void* p) { delete static_cast<std::vector<T>*>(p); });
  return py::array_t<T>(owned->size(), owned->data(), free);
}

py::tuple Prepare(const py::list& features, int num_tables, uint32_t num_shards,
                  uint32_t num_servers) {
  std::vector<FeatureKeys> fks;
  std::vector<py::array> keep;  // values stay alive while the GIL is released
  py::list inverses;
  for (size_t f = 0; f < features.size(); ++f) {
    auto item = features[f].cast<py::tuple>();
    const int table = item[0].cast<int>();
    auto values = item[1].cast<py::array>();
    const uint64_t* data = Keys(values, "values of feature " + std::to_string(f));
    py::array_t<int32_t> inverse(values.shape(0));
    fks.push_back(
        FeatureKeys{table, data, static_cast<size_t>(values.shape(0)), inverse.mutable_data()});
    keep.push_back(values);
    inverses.append(inverse);
  }
  std::vector<TableKeys> tables;
  {
    py::gil_scoped_release release;
    PrepareKeys(fks.data(), fks.size(), num_tables, num_shards, num_servers, &tables);
  }
  py::list out;
  for (TableKeys& t : tables) {
    out.append(py::make_tuple(ToArray(std::move(t.uniques)), ToArray(std::move(t.shard_offsets))));
  }
  return py::make_tuple(out, inverses);
}

template <class Offset>
py::array_t<uint64_t> HashStringArray(const py::array_t<Offset>& offsets, const py::buffer& data,
                                      uint64_t seed) {
  if (offsets.ndim() != 1 || offsets.shape(0) < 1)
    throw py::value_error("offsets must be 1-D, n + 1 long");
  const py::buffer_info bytes = data.request();
  const size_t n = offsets.shape(0) - 1;
  const Offset* off = offsets.data();
  if (off[0] < 0 || static_cast<py::ssize_t>(off[n]) > bytes.size * bytes.itemsize) {
    throw py::value_error("string offsets point outside the data buffer");
  }
  py::array_t<uint64_t> keys(n);
  uint64_t* dst = keys.mutable_data();
  const auto* chars = static_cast<const char*>(bytes.ptr);
  py::gil_scoped_release release;
  HashStrings(off, chars, n, seed, dst);
  return keys;
}

}  // namespace

PYBIND11_MODULE(_reader, m) {
  m.doc() = "wuliang reader helpers (C++): key preparation, string hashing";
  m.def("prepare_keys", &Prepare, "features"_a, "num_tables"_a, "num_shards"_a, "num_servers"_a = 1,
        "features: [(table_index, values)], returns ([(uniques, shard_offsets)], [inverse]); "
        "uniques grouped by cell: server * num_shards + shard");
  m.def("field_seed", [](const std::string& field) { return FieldSeed(field); }, "field"_a);
  m.def("hash_strings", &HashStringArray<int32_t>, "offsets"_a, "data"_a, "seed"_a);
  m.def("hash_strings", &HashStringArray<int64_t>, "offsets"_a, "data"_a, "seed"_a);
  m.def(
      "hash_ints",
      [](const py::array& values, uint64_t seed) {
        const auto* v = reinterpret_cast<const int64_t*>(Keys(values, "values"));
        const size_t n = values.shape(0);
        py::array_t<uint64_t> keys(n);
        uint64_t* dst = keys.mutable_data();
        py::gil_scoped_release release;
        HashInts(v, n, seed, dst);
        return keys;
      },
      "values"_a, "seed"_a);
}
