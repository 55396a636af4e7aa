// Python bindings of the engine: type conversion only. Every batch call
// releases the GIL; keys are read in place from contiguous int64/uint64
// arrays. Argument checking with friendly messages happens in
// wuliang/ps_server/engine.py; the checks here only keep memory safe.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "details/cache_twin.h"
#include "details/cold_index.h"
#include "details/hash_map.h"
#include "details/os_memory.h"
#include "details/row_file.h"
#include "details/uring_reader.h"
#include "wuliang/ps/engine.h"
#include "wuliang/ps/hash.h"

namespace py = pybind11;
using namespace pybind11::literals;
using namespace wuliang::ps;

namespace {

struct KeyArray {
  const uint64_t* data;
  size_t size;
};

KeyArray Keys(const py::array& keys, const char* what = "keys") {
  const py::dtype dt = keys.dtype();
  if (dt.itemsize() != 8 || (dt.kind() != 'i' && dt.kind() != 'u')) {
    throw py::type_error(std::string(what) + " must be int64 or uint64, got " +
                         std::string(py::str(dt)));
  }
  if (keys.ndim() != 1) throw py::value_error(std::string(what) + " must be 1-D");
  if (!(keys.flags() & py::array::c_style)) {
    throw py::value_error(std::string(what) + " must be C-contiguous");
  }
  return {static_cast<const uint64_t*>(keys.data()), static_cast<size_t>(keys.shape(0))};
}

// updated_rows of a push: each in [-1, n_rows), no row twice (two shards
// would write it at once).
void CheckDistinctRows(const int32_t* rows, size_t n, size_t n_rows) {
  std::vector<uint8_t> seen(n_rows, 0);
  for (size_t i = 0; i < n; ++i) {
    const int32_t r = rows[i];
    if (r == -1) continue;
    if (r < 0 || static_cast<size_t>(r) >= n_rows) {
      throw py::value_error("updated_rows[" + std::to_string(i) + "] = " + std::to_string(r) +
                            " is outside [-1, " + std::to_string(n_rows) + ")");
    }
    if (seen[r]++ != 0) {
      throw py::value_error("updated_rows names row " + std::to_string(r) + " twice");
    }
  }
}

// A data call's step: the caller's, or the engine's current one.
uint64_t StepOr(const std::optional<uint64_t>& step) {
  if (step && *step == Engine::kCurrentStep) throw py::value_error("step is too large");
  return step.value_or(Engine::kCurrentStep);
}

// A column argument: None, or a C-contiguous array of exactly dtype T with
// rows * width values. Never converts, so the pointer stays valid while the
// caller holds obj.
template <class T>
T* Column(const py::object& obj, size_t rows, size_t width, const char* name) {
  if (obj.is_none()) return nullptr;
  if (!py::isinstance<py::array>(obj))
    throw py::type_error(std::string(name) + " must be a numpy array");
  const auto arr = py::reinterpret_borrow<py::array>(obj);
  const py::dtype want = py::dtype::of<T>();
  if (arr.dtype().num() != want.num() || !(arr.flags() & py::array::c_style)) {
    throw py::type_error(std::string(name) + " must be a C-contiguous " +
                         std::string(py::str(want)) + " array, got " +
                         std::string(py::str(arr.dtype())));
  }
  if (static_cast<size_t>(arr.size()) != rows * width) {
    throw py::value_error(std::string(name) + " has " + std::to_string(arr.size()) +
                          " values, expected " + std::to_string(rows * width));
  }
  return const_cast<T*>(static_cast<const T*>(arr.data()));
}

// The columns of rows of a table (Load, StageRows), checked against its spec.
RowColumns Columns(const TableSpec& spec, const KeyArray& keys, const py::object& weights,
                   const py::object& state, const py::object& counts, const py::object& steps,
                   const py::object& times, const py::object& versions, const py::object& shows,
                   const py::object& clicks) {
  const size_t n = keys.size;
  RowColumns rows;
  rows.keys = const_cast<uint64_t*>(keys.data);
  rows.weights = Column<float>(weights, n, spec.dim, "weights");
  rows.state = Column<float>(state, n, StateDim(spec.optimizer.kind, spec.dim), "state");
  rows.counts = Column<uint32_t>(counts, n, 1, "counts");
  rows.steps = Column<uint64_t>(steps, n, 1, "steps");
  rows.times = Column<uint32_t>(times, n, 1, "times");
  rows.versions = Column<uint64_t>(versions, n, 1, "versions");
  rows.shows = Column<float>(shows, n, 1, "shows");
  rows.clicks = Column<float>(clicks, n, 1, "clicks");
  return rows;
}

py::dict StatsDict(const TableStats& t) {
  return py::dict("rows"_a = t.rows, "bytes"_a = t.bytes(), "row_bytes"_a = t.row_bytes,
                  "index_bytes"_a = t.index_bytes, "pending_keys"_a = t.pending_keys,
                  "pending_bytes"_a = t.pending_bytes, "removed_log"_a = t.removed_log,
                  "removed_floor"_a = t.removed_floor, "change_log"_a = t.change_log,
                  "change_floor"_a = t.change_floor, "pulled_keys"_a = t.pulled_keys,
                  "pull_misses"_a = t.pull_misses, "pushed_keys"_a = t.pushed_keys,
                  "inserted"_a = t.inserted, "admitted"_a = t.admitted,
                  "dropped_pending"_a = t.dropped_pending, "dropped_nan"_a = t.dropped_nan,
                  "pending_forgotten"_a = t.pending_forgotten, "erased"_a = t.erased,
                  "evicted_ttl"_a = t.evicted_ttl, "evicted_min_count"_a = t.evicted_min_count,
                  "evicted_lfu"_a = t.evicted_lfu, "grown"_a = t.grown, "shrunk"_a = t.shrunk,
                  "rows_moved"_a = t.rows_moved, "chunks_released"_a = t.chunks_released,
                  "cold_rows"_a = t.cold_rows, "cold_index_bytes"_a = t.cold_index_bytes,
                  "disk_bytes"_a = t.disk_bytes, "cold_reads"_a = t.cold_reads,
                  "cold_prefetched"_a = t.cold_prefetched, "demoted"_a = t.demoted,
                  "demoted_between_calls"_a = t.demoted_between_calls,
                  "demoted_written"_a = t.demoted_written, "files_compacted"_a = t.files_compacted,
                  "disk_error"_a = t.disk_error);
}

// Rows of float32 [n, dim] that may be columns of a wider array: each row
// contiguous, rows `*stride` floats apart (>= dim). Never converts.
float* StridedRows(const py::object& obj, size_t n, int dim, const char* name, size_t* stride,
                   bool writes) {
  *stride = 0;
  if (obj.is_none()) return nullptr;
  if (!py::isinstance<py::array>(obj))
    throw py::type_error(std::string(name) + " must be a numpy array");
  const auto arr = py::reinterpret_borrow<py::array>(obj);
  if (arr.dtype().num() != py::dtype::of<float>().num() || arr.ndim() != 2 ||
      static_cast<size_t>(arr.shape(0)) != n || arr.shape(1) != dim) {
    throw py::value_error(std::string(name) + " must be float32 [" + std::to_string(n) + ", " +
                          std::to_string(dim) + "]");
  }
  if (writes && !arr.writeable()) throw py::value_error(std::string(name) + " must be writeable");
  if (arr.flags() & py::array::c_style) {  // whole rows one after the other (or none)
    *stride = static_cast<size_t>(dim);
    return const_cast<float*>(static_cast<const float*>(arr.data()));
  }
  const auto row_bytes = static_cast<size_t>(arr.strides(0));
  if ((dim > 1 && arr.strides(1) != static_cast<py::ssize_t>(sizeof(float))) ||
      (n > 1 && (arr.strides(0) <= 0 || row_bytes % sizeof(float) != 0 ||
                 row_bytes < sizeof(float) * static_cast<size_t>(dim)))) {
    throw py::value_error(std::string(name) +
                          " must have contiguous rows (C-contiguous, or columns of a wider "
                          "C-contiguous array)");
  }
  *stride = n > 1 ? row_bytes / sizeof(float) : static_cast<size_t>(dim);
  return const_cast<float*>(static_cast<const float*>(arr.data()));
}

py::array_t<float> PullInto(int dim, size_t n, const py::object& out) {
  if (out.is_none()) return py::array_t<float>({n, static_cast<size_t>(dim)});
  Column<float>(out, n, dim, "out");
  auto arr = py::reinterpret_borrow<py::array_t<float>>(out);
  if (!arr.writeable()) throw py::value_error("out must be writeable");
  return arr;
}

// Element i of a parts tuple as an array (never converted: the tuple keeps
// it alive while its data pointer is in use).
py::array ArrayIn(const py::tuple& t, size_t i, const char* what) {
  if (!py::isinstance<py::array>(t[i])) {
    throw py::type_error(std::string(what) + " must be a numpy array");
  }
  return py::reinterpret_borrow<py::array>(t[i]);
}

// A multi-table call's part: (table, keys, _, shard_offsets, ...) of `size`
// entries; sets table, keys, n, shard_offsets and the table's dim.
Engine::TablePart PartOf(const Engine& e, const py::tuple& t, size_t size, const char* call,
                         int* dim) {
  if (t.size() != size) {
    throw py::value_error(std::string(call) + ": parts are " + std::to_string(size) + "-tuples");
  }
  Engine::TablePart p;
  p.table = t[0].cast<int>();
  const KeyArray k = Keys(ArrayIn(t, 1, "keys"));
  p.keys = k.data;
  p.n = k.size;
  *dim = e.Dim(p.table);
  p.shard_offsets = Column<int64_t>(py::reinterpret_borrow<py::object>(t[3]), e.num_shards() + 1, 1,
                                    "shard_offsets");
  return p;
}

// A multi-table call's list of parts: each parsed by PartOf, then by
// fill(tuple, dim, part) for the call's own fields.
template <class Fill>
std::vector<Engine::TablePart> PartsOf(const Engine& e, const py::list& parts, size_t size,
                                       const char* call, Fill&& fill) {
  std::vector<Engine::TablePart> many;
  many.reserve(parts.size());
  for (const py::handle& item : parts) {
    const auto t = item.cast<py::tuple>();
    int dim = 0;
    Engine::TablePart p = PartOf(e, t, size, call, &dim);
    fill(t, dim, p);
    many.push_back(p);
  }
  return many;
}

// The `updated` array of a push: (n, dim), or any rows with updated_rows
// (checked unless `writes` is false: the rest of a split push writes no
// rows, its updated_rows only select keys).
// stride (optional): the array may be columns of a wider one (its rows
// contiguous, StridedRows); set to the floats from one row to the next.
float* UpdatedRows(const py::object& updated, size_t n, int dim, const int32_t* rows,
                   bool writes = true, size_t* stride = nullptr) {
  const bool columns = stride != nullptr && py::isinstance<py::array>(updated) &&
                       !(py::reinterpret_borrow<py::array>(updated).flags() & py::array::c_style);
  const auto take = [&](size_t count) {
    if (columns) return StridedRows(updated, count, dim, "updated", stride, /*writes=*/true);
    if (stride != nullptr) *stride = 0;
    return Column<float>(updated, count, dim, "updated");
  };
  float* out = nullptr;
  if (rows == nullptr) {
    out = take(n);
  } else {
    if (updated.is_none()) throw py::value_error("updated_rows needs updated");
    const auto arr = py::reinterpret_borrow<py::array>(updated);
    const size_t n_rows = arr.ndim() == 2 ? static_cast<size_t>(arr.shape(0)) : 0;
    out = take(n_rows);
    if (writes) CheckDistinctRows(rows, n, n_rows);
  }
  if (out != nullptr && !py::reinterpret_borrow<py::array>(updated).writeable())
    throw py::value_error("updated must be writeable");
  return out;
}

py::dict PushDict(const PushResult& r) {
  return py::dict("applied"_a = r.applied, "dropped_nan"_a = r.dropped_nan,
                  "dropped_pending"_a = r.dropped_pending, "duplicates"_a = r.duplicates);
}

void BindSpecs(py::module_& m) {
  py::enum_<OptimizerKind>(m, "OptimizerKind")
      .value("SGD", OptimizerKind::kSgd)
      .value("ADAGRAD", OptimizerKind::kAdagrad)
      .value("ADAM", OptimizerKind::kAdam)
      .value("FTRL", OptimizerKind::kFtrl);
  py::enum_<InitKind>(m, "InitKind")
      .value("NORMAL", InitKind::kNormal)
      .value("TRUNCATED_NORMAL", InitKind::kTruncatedNormal)
      .value("UNIFORM", InitKind::kUniform)
      .value("ZEROS", InitKind::kZeros)
      .value("CONSTANT", InitKind::kConstant);
  py::enum_<NanPolicy>(m, "NanPolicy")
      .value("DROP", NanPolicy::kDrop)
      .value("RAISE", NanPolicy::kRaise);
  py::enum_<Precision>(m, "Precision")
      .value("FP32", Precision::kFp32)
      .value("FP16", Precision::kFp16)
      .value("INT8", Precision::kInt8);

  py::class_<OptimizerSpec>(m, "OptimizerSpec")
      .def(py::init<>())
      .def_readwrite("kind", &OptimizerSpec::kind)
      .def_readwrite("learning_rate", &OptimizerSpec::learning_rate)
      .def_readwrite("initial_accumulator", &OptimizerSpec::initial_accumulator)
      .def_readwrite("epsilon", &OptimizerSpec::epsilon)
      .def_readwrite("beta1", &OptimizerSpec::beta1)
      .def_readwrite("beta2", &OptimizerSpec::beta2)
      .def_readwrite("beta", &OptimizerSpec::beta)
      .def_readwrite("l1", &OptimizerSpec::l1)
      .def_readwrite("l2", &OptimizerSpec::l2)
      .def_readwrite("clip_norm", &OptimizerSpec::clip_norm);
  py::class_<InitSpec>(m, "InitSpec")
      .def(py::init<>())
      .def_readwrite("kind", &InitSpec::kind)
      .def_readwrite("mean", &InitSpec::mean)
      .def_readwrite("stddev", &InitSpec::stddev)
      .def_readwrite("minval", &InitSpec::minval)
      .def_readwrite("maxval", &InitSpec::maxval)
      .def_readwrite("value", &InitSpec::value);
  py::class_<AdmissionSpec>(m, "AdmissionSpec")
      .def(py::init<>())
      .def_readwrite("min_count", &AdmissionSpec::min_count)
      .def_readwrite("pending_capacity", &AdmissionSpec::pending_capacity);
  py::class_<EvictionSpec>(m, "EvictionSpec")
      .def(py::init<>())
      .def_readwrite("ttl_steps", &EvictionSpec::ttl_steps)
      .def_readwrite("ttl_seconds", &EvictionSpec::ttl_seconds)
      .def_readwrite("min_count", &EvictionSpec::min_count)
      .def_readwrite("max_rows", &EvictionSpec::max_rows);
  py::class_<TableSpec>(m, "TableSpec")
      .def(py::init<>())
      .def_readwrite("name", &TableSpec::name)
      .def_readwrite("dim", &TableSpec::dim)
      .def_readwrite("optimizer", &TableSpec::optimizer)
      .def_readwrite("initializer", &TableSpec::initializer)
      .def_readwrite("seed", &TableSpec::seed)
      .def_readwrite("admission", &TableSpec::admission)
      .def_readwrite("eviction", &TableSpec::eviction)
      .def_readwrite("nan_policy", &TableSpec::nan_policy)
      .def_readwrite("reserve_rows", &TableSpec::reserve_rows)
      .def_readwrite("serving", &TableSpec::serving)
      .def_readwrite("precision", &TableSpec::precision)
      .def_readwrite("stats_half_life", &TableSpec::stats_half_life)
      .def_readwrite("grow_base", &TableSpec::grow_base)
      .def_readwrite("grow_promote", &TableSpec::grow_promote)
      .def_readwrite("grow_demote", &TableSpec::grow_demote)
      .def_readwrite("grow_click_weight", &TableSpec::grow_click_weight);
  m.def("state_dim", &StateDim, "kind"_a, "dim"_a);
}

// Column arrays for up to `n` whole rows of a table (what export and
// read_rows fill): RowColumns over them, then the first rows as a dict.
struct RowArrays {
  py::array_t<uint64_t> keys;
  py::array_t<float> weights, state;
  py::array_t<uint32_t> counts, times;
  py::array_t<uint64_t> steps, versions;
  py::array_t<float> shows, clicks;

  RowArrays(const TableSpec& spec, size_t n)
      : keys(n),
        weights({n, static_cast<size_t>(spec.dim)}),
        state({n, static_cast<size_t>(StateDim(spec.optimizer.kind, spec.dim))}),
        counts(n),
        times(n),
        steps(n),
        versions(n),
        shows(n),
        clicks(n) {}

  RowColumns columns() {
    return RowColumns{keys.mutable_data(),     weights.mutable_data(), state.mutable_data(),
                      counts.mutable_data(),   steps.mutable_data(),   times.mutable_data(),
                      versions.mutable_data(), shows.mutable_data(),   clicks.mutable_data()};
  }

  py::dict Head(size_t n) const {
    const py::slice head(0, static_cast<py::ssize_t>(n), 1);
    return py::dict("keys"_a = keys[head], "weights"_a = weights[head], "state"_a = state[head],
                    "counts"_a = counts[head], "steps"_a = steps[head], "times"_a = times[head],
                    "versions"_a = versions[head], "shows"_a = shows[head],
                    "clicks"_a = clicks[head]);
  }
};

void BindEngine(py::module_& m) {
  // A KeyError whose str() is its message (KeyError's would quote it).
  auto& unknown = py::register_exception<UnknownTableError>(m, "UnknownTableError", PyExc_KeyError);
  unknown.attr("__doc__") =
      "A table name or id that names no live table: never created, or dropped (before the call, "
      "or while it was starting).";
  unknown.attr("__str__") = py::cpp_function(
      [](const py::object& self) -> py::str {
        const py::tuple args = self.attr("args");
        return args.empty() ? py::str("") : py::str(args[0]);
      },
      py::is_method(unknown));
  py::class_<ExportCursor>(m, "ExportCursor")
      .def(py::init<>())
      .def_readonly("shard", &ExportCursor::shard)
      .def_readonly("slot", &ExportCursor::slot)
      .def_readonly("done", &ExportCursor::done);

  using Release = py::call_guard<py::gil_scoped_release>;
  py::class_<Engine>(m, "Engine")
      .def(py::init([](int num_shards, const std::string& disk_dir, uint64_t memory_bytes,
                       uint64_t row_file_bytes) {
             EngineOptions options;
             options.num_shards = num_shards;
             options.disk_dir = disk_dir;
             options.memory_bytes = memory_bytes;
             if (row_file_bytes != 0) options.row_file_bytes = row_file_bytes;
             return std::make_unique<Engine>(options);
           }),
           "num_shards"_a, "disk_dir"_a = "", "memory_bytes"_a = 0, "row_file_bytes"_a = 0)
      .def_property_readonly("num_shards", &Engine::num_shards)
      .def("worker_thread_ids", &Engine::WorkerThreadIds, Release())
      .def("create_table", &Engine::CreateTable, "spec"_a, Release())
      .def("drop_table", &Engine::DropTable, "name"_a, Release())
      .def("table_id", &Engine::TableId, "name"_a)
      .def("spec", &Engine::Spec, "table"_a, py::return_value_policy::copy)
      .def("table_names", &Engine::TableNames)
      .def(
          "pull",
          [](Engine& e, int table, const py::array& keys, bool train, const py::object& out,
             const py::object& shard_offsets) {
            const KeyArray k = Keys(keys);
            py::array_t<float> result = PullInto(e.Dim(table), k.size, out);
            float* dst = result.mutable_data();
            const int64_t* offsets =
                Column<int64_t>(shard_offsets, e.num_shards() + 1, 1, "shard_offsets");
            py::gil_scoped_release release;
            e.Pull(table, k.data, k.size, dst, train, offsets);
            return result;
          },
          "table"_a, "keys"_a, "train"_a = true, "out"_a = py::none(),
          "shard_offsets"_a = py::none())
      .def(
          "push",
          [](Engine& e, int table, const py::array& keys, const py::object& grads, bool unique,
             const py::object& shard_offsets, const py::object& updated,
             const py::object& updated_rows) {
            const KeyArray k = Keys(keys);
            const int dim = e.Dim(table);
            const float* g = Column<float>(grads, k.size, dim, "grads");
            const int64_t* offsets =
                Column<int64_t>(shard_offsets, e.num_shards() + 1, 1, "shard_offsets");
            const int32_t* rows = Column<int32_t>(updated_rows, k.size, 1, "updated_rows");
            float* out = UpdatedRows(updated, k.size, dim, rows);
            py::gil_scoped_release release;
            const PushResult r = e.Push(table, k.data, k.size, g, unique, offsets, out, rows);
            py::gil_scoped_acquire acquire;
            return PushDict(r);
          },
          "table"_a, "keys"_a, "grads"_a, "unique"_a = false, "shard_offsets"_a = py::none(),
          "updated"_a = py::none(), "updated_rows"_a = py::none())
      .def(
          "pull_many",
          [](Engine& e, const py::list& parts, bool train, std::optional<uint64_t> step) {
            // parts: [(table, keys, out, shard_offsets)]; out must be given.
            // out may be columns of a wider array (its rows contiguous).
            const auto many = PartsOf(e, parts, 4, "pull_many", [&](auto& t, int dim, auto& p) {
              if (t[2].is_none()) throw py::value_error("pull_many: out must be given");
              p.out = StridedRows(py::reinterpret_borrow<py::object>(t[2]), p.n, dim, "out",
                                  &p.out_stride, /*writes=*/true);
            });
            py::gil_scoped_release release;
            e.PullMany(many, train, StepOr(step));
          },
          "parts"_a, "train"_a = true, "step"_a = py::none())
      .def(
          "exchange_many",
          [](Engine& e, const py::list& parts, std::optional<uint64_t> step) {
            // parts: [(table, keys, out, shard_offsets, back, in_keys, merge)];
            // back: None or a dict of the given rows' columns (keys, weights,
            // state, counts, steps, times, versions, shows, clicks; None:
            // absent); merge: back holds changes to add.
            std::vector<Engine::ExchangePart> many;
            std::vector<RowArrays> incoming;
            std::vector<py::array_t<bool>> found, created;
            many.reserve(parts.size());
            incoming.reserve(parts.size());
            found.reserve(parts.size());
            created.reserve(parts.size());
            for (const py::handle& item : parts) {
              const auto t = item.cast<py::tuple>();
              int dim = 0;
              const Engine::TablePart p = PartOf(e, t, 7, "exchange_many", &dim);
              Engine::ExchangePart x;
              x.table = p.table;
              x.keys = p.keys;
              x.n = p.n;
              x.shard_offsets = p.shard_offsets;
              x.out = PullInto(dim, p.n, py::reinterpret_borrow<py::object>(t[2])).mutable_data();
              if (!t[4].is_none()) {
                const auto back = t[4].cast<py::dict>();
                const auto get = [&](const char* name) -> py::object {
                  return back.contains(name) ? py::reinterpret_borrow<py::object>(back[name])
                                             : py::none();
                };
                const py::object back_keys = get("keys");
                if (!py::isinstance<py::array>(back_keys)) {
                  throw py::type_error("exchange_many: back keys must be a numpy array");
                }
                const KeyArray k = Keys(py::reinterpret_borrow<py::array>(back_keys), "back keys");
                x.n_back = k.size;
                x.back = Columns(e.Spec(p.table), k, get("weights"), get("state"), get("counts"),
                                 get("steps"), get("times"), get("versions"), get("shows"),
                                 get("clicks"));
              }
              x.merge = t[6].cast<bool>();
              const KeyArray in = Keys(ArrayIn(t, 5, "in_keys"));
              x.in_keys = in.data;
              x.n_in = in.size;
              incoming.emplace_back(e.Spec(p.table), in.size);
              found.emplace_back(in.size);
              created.emplace_back(in.size);
              x.in_rows = incoming.back().columns();
              x.in_found = reinterpret_cast<uint8_t*>(found.back().mutable_data());
              x.in_created = reinterpret_cast<uint8_t*>(created.back().mutable_data());
              many.push_back(x);
            }
            std::vector<size_t> read;
            {
              py::gil_scoped_release release;
              read = e.ExchangeMany(many, StepOr(step));
            }
            py::list out;
            for (size_t i = 0; i < many.size(); ++i) {
              out.append(py::make_tuple(incoming[i].Head(read[i]), found[i], created[i]));
            }
            return out;
          },
          "parts"_a, "step"_a = py::none())
      .def(
          "prefetch_many",
          [](Engine& e, const py::list& parts) {
            // parts: [(table, keys, _, shard_offsets)], as pull_many's.
            const auto many = PartsOf(e, parts, 4, "prefetch_many", [](auto&, int, auto&) {});
            py::gil_scoped_release release;
            return e.PrefetchMany(many);
          },
          "parts"_a)
      .def(
          "push_many",
          [](Engine& e, const py::list& parts, bool unique, int only,
             std::optional<uint64_t> step) {
            if (only < 0 || only > 2) throw py::value_error("push_many: only must be 0, 1 or 2");
            // parts: [(table, keys, grads, shard_offsets, updated, updated_rows,
            //          shows, clicks)].
            // grads and updated may be columns of wider arrays (rows contiguous).
            const auto many = PartsOf(e, parts, 8, "push_many", [&](auto& t, int dim, auto& p) {
              p.grads = StridedRows(py::reinterpret_borrow<py::object>(t[2]), p.n, dim, "grads",
                                    &p.grads_stride, /*writes=*/false);
              if (p.grads == nullptr) throw py::value_error("push_many: grads must be given");
              const auto updated = py::reinterpret_borrow<py::object>(t[4]);
              p.updated_rows =
                  Column<int32_t>(py::reinterpret_borrow<py::object>(t[5]), p.n, 1, "updated_rows");
              p.updated = UpdatedRows(updated, p.n, dim, p.updated_rows, /*writes=*/only != 2,
                                      &p.updated_stride);
              p.shows = Column<float>(py::reinterpret_borrow<py::object>(t[6]), p.n, 1, "shows");
              p.clicks = Column<float>(py::reinterpret_borrow<py::object>(t[7]), p.n, 1, "clicks");
            });
            py::gil_scoped_release release;
            const PushResult r =
                e.PushMany(many, unique, static_cast<Engine::Only>(only), StepOr(step));
            py::gil_scoped_acquire acquire;
            return PushDict(r);
          },
          "parts"_a, "unique"_a = false, "only"_a = 0, "step"_a = py::none())
      .def(
          "erase",
          [](Engine& e, int table, const py::array& keys) {
            const KeyArray k = Keys(keys);
            py::gil_scoped_release release;
            return e.Erase(table, k.data, k.size);
          },
          "table"_a, "keys"_a)
      .def(
          "contains",
          [](Engine& e, int table, const py::array& keys) {
            const KeyArray k = Keys(keys);
            py::array_t<bool> out(k.size);
            auto* dst = reinterpret_cast<uint8_t*>(out.mutable_data());
            py::gil_scoped_release release;
            e.Contains(table, k.data, k.size, dst);
            return out;
          },
          "table"_a, "keys"_a)
      .def(
          "read_rows",
          [](Engine& e, int table, const py::array& keys) {
            const KeyArray k = Keys(keys);
            const size_t n = k.size;
            RowArrays rows(e.Spec(table), n);
            py::array_t<bool> found(n);
            auto* found_out = reinterpret_cast<uint8_t*>(found.mutable_data());
            const RowColumns out = rows.columns();
            size_t m;
            {
              py::gil_scoped_release release;
              m = e.ReadRows(table, k.data, n, out, found_out);
            }
            return py::make_tuple(rows.Head(m), found);
          },
          "table"_a, "keys"_a)
      .def(
          "evict",
          [](Engine& e, int table, const std::optional<uint64_t>& step) {
            EvictResult r;
            {
              py::gil_scoped_release release;
              r = e.Evict(table, StepOr(step));
            }
            return py::dict("ttl"_a = r.ttl, "min_count"_a = r.min_count, "lfu"_a = r.lfu,
                            "shrunk"_a = r.shrunk, "total"_a = r.total());
          },
          "table"_a, "step"_a = py::none())
      .def(
          "evict_by_age",
          [](Engine& e, int table, const std::optional<uint64_t>& step) {
            EvictResult r;
            {
              py::gil_scoped_release release;
              r = e.EvictByAge(table, StepOr(step));
            }
            return py::dict("ttl"_a = r.ttl, "min_count"_a = r.min_count, "lfu"_a = r.lfu,
                            "shrunk"_a = r.shrunk, "total"_a = r.total());
          },
          "table"_a, "step"_a = py::none())
      .def(
          "count_histogram",
          [](Engine& e, int table) {
            std::vector<uint64_t> hist;
            {
              py::gil_scoped_release release;
              hist = e.CountHistogram(table);
            }
            py::array_t<uint64_t> out(hist.size());
            std::copy(hist.begin(), hist.end(), out.mutable_data());
            return out;
          },
          "table"_a)
      .def(
          "steps_at_count",
          [](Engine& e, int table, uint32_t count) {
            std::vector<uint64_t> steps;
            {
              py::gil_scoped_release release;
              steps = e.StepsAtCount(table, count);
            }
            py::array_t<uint64_t> out(steps.size());
            std::copy(steps.begin(), steps.end(), out.mutable_data());
            return out;
          },
          "table"_a, "count"_a)
      .def(
          "evict_least_frequent",
          [](Engine& e, int table, uint32_t threshold, uint64_t cutoff, uint64_t quota,
             const std::optional<uint64_t>& step) {
            EvictResult r;
            {
              py::gil_scoped_release release;
              r = e.EvictLeastFrequent(table, threshold, cutoff, quota, StepOr(step));
            }
            return py::dict("ttl"_a = r.ttl, "min_count"_a = r.min_count, "lfu"_a = r.lfu,
                            "shrunk"_a = r.shrunk, "total"_a = r.total());
          },
          "table"_a, "threshold"_a, "cutoff"_a, "quota"_a, "step"_a = py::none())
      .def(
          "stats",
          [](Engine& e, int table) {
            TableStats t;
            {
              py::gil_scoped_release release;
              t = e.Stats(table);
            }
            return StatsDict(t);
          },
          "table"_a)
      .def(
          "export_chunk",
          [](Engine& e, int table, uint64_t since, size_t max_rows, ExportCursor& cursor) {
            RowArrays rows(e.Spec(table), max_rows);
            const RowColumns out = rows.columns();
            size_t n;
            {
              py::gil_scoped_release release;
              n = e.Export(table, since, max_rows, &cursor, out);
            }
            return rows.Head(n);
          },
          "table"_a, "since"_a, "max_rows"_a, "cursor"_a)
      .def(
          "removed_log",
          [](Engine& e, int table, uint64_t since) {
            std::vector<std::pair<uint64_t, uint64_t>> records;
            {
              py::gil_scoped_release release;
              records = e.RemovedLog(table, since);
            }
            py::array_t<uint64_t> keys(records.size()), versions(records.size());
            uint64_t* k = keys.mutable_data();
            uint64_t* v = versions.mutable_data();
            for (size_t i = 0; i < records.size(); ++i) std::tie(k[i], v[i]) = records[i];
            return py::make_tuple(keys, versions);
          },
          "table"_a, "since"_a)
      .def(
          "load_removed",
          [](Engine& e, int table, const py::array& keys, const py::object& versions,
             uint64_t floor) {
            const KeyArray k = Keys(keys);
            const uint64_t* v = Column<uint64_t>(versions, k.size, 1, "versions");
            py::gil_scoped_release release;
            e.LoadRemoved(table, k.data, v, k.size, floor);
          },
          "table"_a, "keys"_a, "versions"_a, "floor"_a)
      .def("trim_removed", &Engine::TrimRemoved, "table"_a, "upto"_a, Release())
      .def(
          "pending_counts",
          [](Engine& e, int table) {
            std::vector<std::pair<uint64_t, uint32_t>> pending;
            {
              py::gil_scoped_release release;
              pending = e.PendingCounts(table);
            }
            py::array_t<uint64_t> keys(pending.size());
            py::array_t<uint32_t> counts(pending.size());
            uint64_t* k = keys.mutable_data();
            uint32_t* c = counts.mutable_data();
            for (size_t i = 0; i < pending.size(); ++i) std::tie(k[i], c[i]) = pending[i];
            return py::make_tuple(keys, counts);
          },
          "table"_a)
      .def(
          "load_pending",
          [](Engine& e, int table, const py::array& keys, const py::object& counts) {
            const KeyArray k = Keys(keys);
            const uint32_t* c = Column<uint32_t>(counts, k.size, 1, "counts");
            if (c == nullptr) throw py::type_error("counts must be a numpy array, not None");
            py::gil_scoped_release release;
            e.LoadPending(table, k.data, c, k.size);
          },
          "table"_a, "keys"_a, "counts"_a)
      .def(
          "load",
          [](Engine& e, int table, const py::array& keys, const py::object& weights,
             const py::object& state, const py::object& counts, const py::object& steps,
             const py::object& times, const py::object& versions, const py::object& shows,
             const py::object& clicks, const std::optional<uint64_t>& step) {
            const KeyArray k = Keys(keys);
            const RowColumns rows = Columns(e.Spec(table), k, weights, state, counts, steps, times,
                                            versions, shows, clicks);
            py::gil_scoped_release release;
            e.Load(table, k.size, rows, StepOr(step));
          },
          "table"_a, "keys"_a, "weights"_a, "state"_a = py::none(), "counts"_a = py::none(),
          "steps"_a = py::none(), "times"_a = py::none(), "versions"_a = py::none(),
          "shows"_a = py::none(), "clicks"_a = py::none(), "step"_a = py::none())
      .def(
          "lookup",
          [](Engine& e, int table, const py::array& keys, const py::object& out,
             const py::object& found, bool init_missing) {
            const KeyArray k = Keys(keys);
            float* dst = Column<float>(out, k.size, e.Dim(table), "out");
            uint8_t* hit = Column<uint8_t>(found, k.size, 1, "found");
            if (dst == nullptr || hit == nullptr)
              throw py::type_error("out and found are required");
            py::gil_scoped_release release;
            return e.Lookup(table, k.data, k.size, dst, hit, init_missing);
          },
          "table"_a, "keys"_a, "out"_a, "found"_a, "init_missing"_a = false)
      .def(
          "begin_apply",
          [](Engine& e, const TableSpec& spec, int table, bool full, uint64_t label) {
            py::gil_scoped_release release;
            return e.BeginApply(spec, table, full, label);
          },
          "spec"_a, "table"_a, "full"_a, "label"_a = 0)
      .def(
          "stage_rows",
          [](Engine& e, int staging, const py::array& keys, const py::object& weights,
             const py::object& state, const py::object& counts, const py::object& steps,
             const py::object& times, const py::object& versions, const py::object& shows,
             const py::object& clicks) {
            const KeyArray k = Keys(keys);
            const RowColumns rows = Columns(e.StagedSpec(staging), k, weights, state, counts, steps,
                                            times, versions, shows, clicks);
            py::gil_scoped_release release;
            e.StageRows(staging, k.size, rows);
          },
          "staging"_a, "keys"_a, "weights"_a, "state"_a = py::none(), "counts"_a = py::none(),
          "steps"_a = py::none(), "times"_a = py::none(), "versions"_a = py::none(),
          "shows"_a = py::none(), "clicks"_a = py::none())
      .def(
          "stage_removed",
          [](Engine& e, int staging, const py::array& keys) {
            const KeyArray k = Keys(keys);
            py::gil_scoped_release release;
            e.StageRemoved(staging, k.data, k.size);
          },
          "staging"_a, "keys"_a)
      .def(
          "commit_apply",
          [](Engine& e, int staging) {
            py::gil_scoped_release release;
            return e.CommitApply(staging);
          },
          "staging"_a)
      .def("abort_apply", &Engine::AbortApply, "staging"_a)
      .def_property("step", &Engine::step, &Engine::SetStep)
      .def_property("clock", &Engine::clock, &Engine::SetClock)  // unix seconds; 0: wall clock
      .def_property_readonly("version", &Engine::version)
      .def("advance_version", &Engine::AdvanceVersion)
      .def("restore_version", &Engine::RestoreVersion, "version"_a);
}

// ---- the GPU hot cache's CPU twin (details/cache_twin.h) ---------------------

// A C-contiguous array's data as T*, checked: dtype (kind, size) and at
// least `n` elements (n < 0: any).
template <class T>
T* Data(const py::array& a, const char* what, py::ssize_t n = -1) {
  const py::dtype want = py::dtype::of<T>();
  const py::dtype dt = a.dtype();
  if (dt.kind() != want.kind() || dt.itemsize() != want.itemsize()) {
    throw py::type_error(std::string(what) + " must be " + std::string(py::str(want)) + ", got " +
                         std::string(py::str(dt)));
  }
  if (!(a.flags() & py::array::c_style)) {
    throw py::value_error(std::string(what) + " must be C-contiguous");
  }
  if (n >= 0 && a.size() < n) {
    throw py::value_error(std::string(what) + " has " + std::to_string(a.size()) +
                          " elements, needs " + std::to_string(n));
  }
  return static_cast<T*>(const_cast<void*>(a.data()));
}

template <class T>
T* OptionalData(const py::object& a, const char* what, py::ssize_t n) {
  return a.is_none() ? nullptr : Data<T>(a.cast<py::array>(), what, n);
}

// (entry_base, ghost_base, sets, ways): the index's regions.
details::CacheRegions Regions(const py::tuple& t) {
  if (t.size() != 4) throw py::value_error("regions must be (entry_base, ghost_base, sets, ways)");
  return {Data<int64_t>(t[0].cast<py::array>(), "entry_base"),
          Data<int64_t>(t[1].cast<py::array>(), "ghost_base"),
          Data<int64_t>(t[2].cast<py::array>(), "sets"),
          Data<int32_t>(t[3].cast<py::array>(), "ways")};
}

// (keys, scores, epochs, ghost_keys or None, ghost_scores or None).
details::CacheIndex Index(const py::tuple& t) {
  if (t.size() != 5) {
    throw py::value_error("index must be (keys, scores, epochs, ghost_keys, ghost_scores)");
  }
  const py::ssize_t n = t[0].cast<py::array>().size();
  return {Data<uint64_t>(t[0].cast<py::array>(), "keys"),
          Data<double>(t[1].cast<py::array>(), "scores", n),
          Data<int64_t>(t[2].cast<py::array>(), "epochs", n),
          OptionalData<uint64_t>(t[3], "ghost_keys", n),
          OptionalData<double>(t[4], "ghost_scores", n)};
}

// The region id of every key: each below the number of regions.
const int32_t* RegionOfKeys(const py::array& region, py::ssize_t n, const py::tuple& regions) {
  const int32_t* r = Data<int32_t>(region, "region", n);
  const py::ssize_t count = regions[3].cast<py::array>().size();
  for (py::ssize_t i = 0; i < n; ++i) {
    if (r[i] < 0 || r[i] >= count) {
      throw py::value_error("region[" + std::to_string(i) + "] = " + std::to_string(r[i]) +
                            " is not a region");
    }
  }
  return r;
}

// (weights, state, counts, steps, times, shows, clicks, dirty, admitted_at):
// a cache's rows by slot, each column checked against the slot count.
details::CacheRows Rows(const py::tuple& t) {
  if (t.size() != 9) {
    throw py::value_error(
        "rows must be (weights, state, counts, steps, times, shows, clicks, dirty, admitted_at)");
  }
  const py::array weights = t[0].cast<py::array>();
  const py::array state = t[1].cast<py::array>();
  if (weights.ndim() != 2 || state.ndim() != 2 || state.shape(0) != weights.shape(0)) {
    throw py::value_error("weights and state must be 2-D with a row per slot");
  }
  const py::ssize_t rows = weights.shape(0);
  details::CacheRows r;
  r.dim = static_cast<int>(weights.shape(1));
  r.state_dim = static_cast<int>(state.shape(1));
  r.weights = Data<float>(weights, "weights");
  r.state = Data<float>(state, "state");
  r.counts = Data<uint32_t>(t[2].cast<py::array>(), "counts", rows);
  r.steps = Data<uint64_t>(t[3].cast<py::array>(), "steps", rows);
  r.times = Data<uint32_t>(t[4].cast<py::array>(), "times", rows);
  r.shows = Data<float>(t[5].cast<py::array>(), "shows", rows);
  r.clicks = Data<float>(t[6].cast<py::array>(), "clicks", rows);
  const py::array dirty = t[7].cast<py::array>();
  if (dirty.dtype().itemsize() != 1 || dirty.dtype().kind() != 'b' ||
      !(dirty.flags() & py::array::c_style) || dirty.size() < rows) {
    throw py::value_error("dirty must be a C-contiguous bool flag per slot");
  }
  r.dirty = static_cast<uint8_t*>(const_cast<void*>(dirty.data()));
  r.admitted_at = Data<uint64_t>(t[8].cast<py::array>(), "admitted_at", rows);
  return r;
}

py::ssize_t RowsOf(const py::tuple& rows) { return rows[0].cast<py::array>().shape(0); }

// Slots, each inside [0, rows).
const int64_t* Slots(const py::array& slots, py::ssize_t rows) {
  const int64_t* s = Data<int64_t>(slots, "slots");
  for (py::ssize_t i = 0; i < slots.size(); ++i) {
    if (s[i] < 0 || s[i] >= rows) {
      throw py::value_error("slots[" + std::to_string(i) + "] = " + std::to_string(s[i]) +
                            " is outside the rows");
    }
  }
  return s;
}

// What the index twin's batch calls share: keys with their regions and
// counts, and the index they read.
struct CacheBatch {
  KeyArray keys;
  py::ssize_t n;
  const int32_t* region;
  const float* counts;
  details::CacheRegions regions;
  details::CacheIndex index;

  CacheBatch(const py::tuple& regions_, const py::tuple& index_, const py::array& keys_,
             const py::array& region_, const py::object& counts_)
      : keys(Keys(keys_)),
        n(static_cast<py::ssize_t>(keys.size)),
        region(RegionOfKeys(region_, n, regions_)),
        counts(OptionalData<float>(counts_, "counts", n)),
        regions(Regions(regions_)),
        index(Index(index_)) {}
};
}  // namespace

// Where each key goes among `count` shards or servers, by `batch`.
py::array_t<uint32_t> Route(const py::array& keys, uint32_t count, const char* what,
                            void (*batch)(const uint64_t*, size_t, uint32_t, uint32_t*)) {
  const KeyArray k = Keys(keys);
  if (count == 0) throw py::value_error(std::string(what) + " must be >= 1");
  py::array_t<uint32_t> out(k.size);
  uint32_t* dst = out.mutable_data();
  py::gil_scoped_release release;
  batch(k.data, k.size, count, dst);
  return out;
}

// uint64 key -> int64 id for batches of keys: the GPU hot cache's key ->
// slot index (ps_server/cache/policy.py), on the engine's OpenHashMap
// (ids stored + 1: a zero value marks an empty slot). Not thread-safe: the
// caller serializes (the cache holds its lock).
class KeyIndex {
 public:
  using Keys = py::array_t<uint64_t, py::array::c_style | py::array::forcecast>;
  using Ids = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;
  using Map = details::OpenHashMap<int64_t>;

  explicit KeyIndex(size_t expected) : map_(std::make_unique<Map>()) { map_->Reserve(expected); }

  py::array_t<int64_t> Lookup(const Keys& keys) const {
    const size_t n = Length(keys);
    py::array_t<int64_t> ids(n);
    const uint64_t* k = keys.data();
    int64_t* out = ids.mutable_data();
    {
      py::gil_scoped_release release;
      constexpr size_t kAhead = 8;
      for (size_t i = 0; i < n; ++i) {
        if (i + kAhead < n) map_->Prefetch(Mix64(k[i + kAhead]));
        const int64_t* v = map_->Find(k[i], Mix64(k[i]));
        out[i] = v != nullptr ? *v - 1 : -1;
      }
    }
    return ids;
  }

  void Insert(const Keys& keys, const Ids& ids) {
    const size_t n = Length(keys);
    if (ids.ndim() != 1 || static_cast<size_t>(ids.shape(0)) != n) {
      throw py::value_error("ids must be 1-D with one id per key (" + std::to_string(n) + ")");
    }
    const uint64_t* k = keys.data();
    const int64_t* v = ids.data();
    for (size_t i = 0; i < n; ++i) {
      if (v[i] < 0) throw py::value_error("ids must be >= 0, got " + std::to_string(v[i]));
    }
    py::gil_scoped_release release;
    map_->Reserve(map_->size() + n);
    for (size_t i = 0; i < n; ++i) {
      const uint64_t h = Mix64(k[i]);
      int64_t* slot = map_->Find(k[i], h);
      if (slot == nullptr) slot = map_->InsertNew(k[i], h);
      *slot = v[i] + 1;
    }
  }

  py::array_t<int64_t> Delete(const Keys& keys) {
    const size_t n = Length(keys);
    py::array_t<int64_t> ids(n);
    const uint64_t* k = keys.data();
    int64_t* out = ids.mutable_data();
    {
      py::gil_scoped_release release;
      for (size_t i = 0; i < n; ++i) out[i] = map_->Erase(k[i], Mix64(k[i])) - 1;
    }
    return ids;
  }

  size_t Size() const { return map_->size(); }
  void Clear() { map_ = std::make_unique<Map>(); }

 private:
  static size_t Length(const Keys& keys) {
    if (keys.ndim() != 1) throw py::value_error("keys must be 1-D");
    return static_cast<size_t>(keys.shape(0));
  }

  std::unique_ptr<Map> map_;
};

PYBIND11_MODULE(_engine, m) {
  m.doc() = "wuliang parameter-server engine (C++)";
  BindSpecs(m);
  BindEngine(m);
  py::class_<KeyIndex>(m, "KeyIndex")
      .def(py::init<size_t>(), "expected"_a = 0)
      .def("lookup", &KeyIndex::Lookup, "keys"_a, "Each key's id (int64), -1 where absent.")
      .def("insert", &KeyIndex::Insert, "keys"_a, "ids"_a,
           "Sets each key's id (ids >= 0); a key already there takes the new id.")
      .def("delete", &KeyIndex::Delete, "keys"_a,
           "Removes keys; returns the ids they had (-1 where absent).")
      .def("clear", &KeyIndex::Clear)
      .def_property_readonly("size", &KeyIndex::Size);
  m.def(
      "cache_lookup",
      [](const py::tuple& regions, const py::tuple& index, const py::array& keys,
         const py::array& region, const py::object& counts, bool observe, int64_t epoch, int policy,
         double weight, double clock) {
        const CacheBatch b(regions, index, keys, region, counts);
        py::array_t<int64_t> out(b.n);
        int64_t* o = out.mutable_data();
        py::gil_scoped_release release;
        details::CacheLookup(b.regions, b.index, b.keys.data, b.region, b.counts, b.keys.size,
                             observe, epoch, policy, weight, clock, o);
        return out;
      },
      "regions"_a, "index"_a, "keys"_a, "region"_a, "counts"_a, "observe"_a, "epoch"_a, "policy"_a,
      "weight"_a, "clock"_a,
      "The GPU cache's lookup on the CPU (details/cache_twin.h): each key's entry, -1 if absent.");
  m.def(
      "cache_score_misses",
      [](const py::tuple& regions, const py::tuple& index, const py::array& keys,
         const py::array& region, const py::object& counts, int policy, double weight) {
        const CacheBatch b(regions, index, keys, region, counts);
        py::array_t<int64_t> sets(b.n);
        py::array_t<double> scores(b.n);
        int64_t* s = sets.mutable_data();
        double* sc = scores.mutable_data();
        {
          py::gil_scoped_release release;
          details::CacheScoreMisses(b.regions, b.index, b.keys.data, b.region, b.counts,
                                    b.keys.size, policy, weight, s, sc);
        }
        return py::make_tuple(sets, scores);
      },
      "regions"_a, "index"_a, "keys"_a, "region"_a, "counts"_a, "policy"_a, "weight"_a,
      "Each miss's set (first entry) and candidate score (details/cache_twin.h).");
  m.def(
      "cache_populate",
      [](const py::tuple& regions, const py::tuple& index, const py::array& keys,
         const py::array& region, const py::array& sets, const py::array& scores,
         const py::array& allowed, int64_t epoch, int policy, double clock, double weight) {
        const CacheBatch b(regions, index, keys, region, py::none());
        const py::ssize_t n = b.n;
        const int32_t* r = b.region;
        const int64_t* s = Data<int64_t>(sets, "sets", n);
        const double* sc = Data<double>(scores, "scores", n);
        const uint8_t* a = Data<uint8_t>(allowed, "allowed", n);
        const details::CacheRegions& reg = b.regions;
        const py::ssize_t entries = index[0].cast<py::array>().size();
        for (py::ssize_t i = 0; i < n; ++i) {
          const int32_t ways = reg.ways[r[i]];
          if (s[i] < reg.entry_base[r[i]] || s[i] + ways > entries || (i > 0 && s[i] < s[i - 1])) {
            throw py::value_error("sets must be sorted first entries of the keys' sets");
          }
        }
        py::array_t<int64_t> way(n);
        py::array_t<uint8_t> how(n);
        py::array_t<uint64_t> victim(n);
        int64_t* w = way.mutable_data();
        uint8_t* h = how.mutable_data();
        uint64_t* v = victim.mutable_data();
        {
          py::gil_scoped_release release;
          details::CachePopulate(reg, b.index, b.keys.data, r, s, sc, a, b.keys.size, epoch, policy,
                                 clock, weight, w, h, v);
        }
        return py::make_tuple(way, how, victim);
      },
      "regions"_a, "index"_a, "keys"_a, "region"_a, "sets"_a, "scores"_a, "allowed"_a, "epoch"_a,
      "policy"_a, "clock"_a, "weight"_a,
      "Admits misses sorted by (set, score descending) (details/cache_twin.h): each one's "
      "entry (-1: none), how (0 not admitted, 1 empty entry, 2 over a victim, 3 a repeat) "
      "and the victim's key.");
  m.def(
      "cache_apply",
      [](const OptimizerSpec& opt, const py::tuple& rows, const py::array& slots,
         const py::array& grads, const py::object& add_shows, const py::object& add_clicks,
         uint64_t step, uint32_t now, double half_life) {
        const details::CacheRows r = Rows(rows);
        const py::ssize_t n = slots.size();
        if (r.state_dim != StateDim(opt.kind, r.dim) || grads.ndim() != 2 || grads.shape(0) != n ||
            grads.shape(1) != r.dim) {
          throw py::value_error("state, grads and slots do not agree with the rows in shape");
        }
        const int64_t* s = Slots(slots, RowsOf(rows));
        const float* g = Data<float>(grads, "grads");
        const float* as = OptionalData<float>(add_shows, "add_shows", n);
        const float* ac = OptionalData<float>(add_clicks, "add_clicks", n);
        py::array_t<uint8_t> applied(n);
        uint8_t* a = applied.mutable_data();
        {
          py::gil_scoped_release release;
          details::CacheApply(opt, r, s, g, as, ac, static_cast<size_t>(n), step, now, half_life,
                              a);
        }
        return applied;
      },
      "optimizer"_a, "rows"_a, "slots"_a, "grads"_a, "add_shows"_a, "add_clicks"_a, "step"_a,
      "now"_a, "half_life"_a,
      "The engine's push arithmetic on a cache's rows (weights, state, counts, steps, times, "
      "shows, clicks, dirty, admitted_at) at distinct slots (details/cache_twin.h); per row 1 "
      "applied, 0 dropped (non-finite).");
  m.def(
      "cache_put",
      [](const py::tuple& rows, const py::array& slots, const py::tuple& values) {
        const details::CacheRows r = Rows(rows);
        const py::ssize_t n = slots.size();
        const int64_t* s = Slots(slots, RowsOf(rows));
        if (values.size() != 8) {
          throw py::value_error(
              "values must be (weights, state, counts, steps, times, shows, clicks, admitted_at)");
        }
        const py::array w = values[0].cast<py::array>();
        const py::array st = values[1].cast<py::array>();
        if (w.ndim() != 2 || w.shape(0) != n || w.shape(1) != r.dim || st.ndim() != 2 ||
            st.shape(0) != n || st.shape(1) != r.state_dim) {
          throw py::value_error("the rows' weights and state do not agree with the slots");
        }
        const details::CacheRowValues v{
            Data<float>(w, "weights"),
            Data<float>(st, "state"),
            Data<uint32_t>(values[2].cast<py::array>(), "counts", n),
            Data<uint64_t>(values[3].cast<py::array>(), "steps", n),
            Data<uint32_t>(values[4].cast<py::array>(), "times", n),
            Data<float>(values[5].cast<py::array>(), "shows", n),
            Data<float>(values[6].cast<py::array>(), "clicks", n),
            Data<uint64_t>(values[7].cast<py::array>(), "admitted_at", n)};
        py::gil_scoped_release release;
        details::CachePut(r, s, static_cast<size_t>(n), v);
      },
      "rows"_a, "slots"_a, "values"_a,
      "Whole rows into distinct slots of a cache's rows (details/cache_twin.h), marked clean.");
  m.def(
      "shard_of",
      [](const py::array& keys, uint32_t num_shards) {
        return Route(keys, num_shards, "num_shards", ShardOfBatch);
      },
      "keys"_a, "num_shards"_a,
      "Shard of each key in an engine of num_shards shards (uint32): ShardOf in "
      "wuliang/ps/hash.h.");
  m.def(
      "server_of",
      [](const py::array& keys, uint32_t num_servers) {
        return Route(keys, num_servers, "num_servers", ServerOfBatch);
      },
      "keys"_a, "num_servers"_a,
      "Parameter server of each key among num_servers (uint32): ServerOf in "
      "wuliang/ps/hash.h, independent of the shard.");
  m.def(
      "disk_random_reads",
      [](const std::string& dir, size_t file_bytes, size_t read_bytes, int depth, double seconds) {
        bool direct = false;
        double rate;
        {
          py::gil_scoped_release release;
          rate = details::MeasureRandomReads(dir, file_bytes, read_bytes, depth, seconds, &direct);
        }
        return std::make_tuple(rate, direct);
      },
      "dir"_a, "file_bytes"_a, "read_bytes"_a, "depth"_a, "seconds"_a,
      "The disk's random-read rate as fio measures it: (reads/s, O_DIRECT used), reads of "
      "read_bytes at random aligned offsets of a file of file_bytes in dir (written first, "
      "deleted after), through io_uring at the tier's depth where the kernel allows it, "
      "else depth threads of preads.");
  m.def(
      "set_io_uring", [](bool enabled) { return details::SetUringEnabled(enabled); }, "enabled"_a,
      "Whether the disk tier reads through io_uring where the kernel allows it (the "
      "default) or on its thread pool of preads; returns the previous setting. For "
      "benchmarks comparing the two.");
  m.def(
      "memory_random_reads",
      [](size_t bytes, size_t reads, size_t ahead) {
        py::gil_scoped_release release;
        return details::MeasureMemoryReads(bytes, reads, ahead);
      },
      "bytes"_a, "reads"_a, "ahead"_a,
      "Random 64-byte reads/s of one thread from `bytes` of memory mapped as the engine "
      "maps its pool (huge pages asked for), each prefetched `ahead` reads before (0: none): "
      "what the memory system gives the engine's access pattern at that size.");
  m.attr("IO_URING_DEPTH") = details::UringReader::kDepth;  // reads in flight in one ring
  m.def(
      "io_uring_available",
      [] {
        py::gil_scoped_release release;
        return details::UringReader::ForThisThread() != nullptr;
      },
      "Whether this thread can read through io_uring (the kernel allows it, and "
      "set_io_uring has not turned it off).");
  m.def(
      "row_file_reads",
      [](const std::string& dir, size_t record_bytes, size_t records, size_t reads, int depth,
         size_t batch) {
        py::gil_scoped_release release;
        details::IoPool pool(depth - 1);  // and the caller: depth reads in flight
        details::RowFile file(dir, record_bytes, &pool);
        std::vector<char> record(record_bytes, 1);
        std::vector<uint32_t> locs(records);
        for (size_t i = 0; i < records; ++i) locs[i] = file.Append(record.data());
        std::mt19937_64 rng(11);
        std::vector<uint32_t> wanted(batch);
        std::vector<char> out(batch * record_bytes);
        const auto start = std::chrono::steady_clock::now();
        size_t done = 0;
        for (; done < reads; done += batch) {
          for (uint32_t& loc : wanted) loc = locs[rng() % records];
          file.ReadMany(wanted.data(), batch, out.data());
        }
        const double took =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        const details::RowFileStats stats = file.Stats();
        return std::make_tuple(static_cast<double>(done) / took, stats.direct,
                               static_cast<double>(stats.bytes_on_disk) / records);
      },
      "dir"_a, "record_bytes"_a, "records"_a, "reads"_a, "depth"_a, "batch"_a,
      "Random record reads through the disk tier's row files (details/row_file.h): "
      "(records/s, O_DIRECT used, disk bytes per record), records appended first, then read "
      "in batches of batch with depth reads in flight.");
  m.def(
      "cold_index_bytes_per_key",
      [](size_t keys) {
        details::ColdIndex index;
        for (uint64_t k = 1; k <= keys; ++k) {
          const uint64_t key = k * 0x9E3779B97F4A7C15ULL;
          index.Set(key, Mix64(key), static_cast<uint32_t>(k));
        }
        return static_cast<double>(index.bytes()) / static_cast<double>(keys);
      },
      "keys"_a, "RAM of the disk tier's cold index per key, holding keys keys.");
}
