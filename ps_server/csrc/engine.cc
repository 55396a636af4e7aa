#include "wuliang/ps/engine.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <ctime>
#include <exception>
#include <filesystem>
#include <latch>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "details/grace_period.h"
#include "details/shard_worker.h"
#include "details/table_shard.h"
#include "details/uring_reader.h"
#include "wuliang/ps/hash.h"

namespace wuliang::ps {

using details::Clock;
using details::GracePeriod;
using details::Plan;
using details::ShardBatch;
using details::TableDef;
using details::TableShard;

namespace {

// Batches that SplitBlocks splits: enough shards that each scanning the
// whole batch would cost more than a round of its own, enough keys.
constexpr uint32_t kSplitMinShards = 4;
constexpr size_t kSplitMinKeys = 16384;

// The keys of block b of n keys split in num_blocks: [BlockBegin(b), BlockBegin(b + 1)).
size_t BlockBegin(size_t n, size_t b, size_t num_blocks) { return n * b / num_blocks; }

}  // namespace

namespace details {

// How a batch's keys split over shards.
struct Plan {
  const uint64_t* keys = nullptr;
  size_t n = 0;
  bool filter = false;                  // each shard selects its own keys
  bool split = false;                   // the shards split the keys in blocks (SplitBlocks)
  bool check_shards = false;            // keys came grouped by the caller: verify
  const uint32_t* order = nullptr;      // else: positions grouped by shard (null = identity)
  std::vector<uint32_t> order_storage;  // what order points into when the plan split the keys
  std::vector<size_t> offsets;          // (S + 1,) shard s owns order[offsets[s], offsets[s+1])
  // split: (S, S + 1); block b's keys of shard s are order[b * (S + 1) + s, ... + s + 1)
  std::vector<size_t> block_offsets;

  ShardBatch For(int s) const {
    const auto num_shards = static_cast<uint32_t>(offsets.size() - 1);
    return ShardBatch{keys,           n,
                      order,          offsets[s],
                      offsets[s + 1], filter,
                      check_shards,   static_cast<uint32_t>(s),
                      num_shards,     split ? block_offsets.data() : nullptr};
  }
};

namespace {

struct FnTask : Task {
  const std::function<void(int)>* fn = nullptr;
  int shard = 0;
  std::latch* latch = nullptr;
  std::exception_ptr* error = nullptr;
};

void RunFnTask(Task* task) {
  auto* t = static_cast<FnTask*>(task);
  try {
    (*t->fn)(t->shard);
  } catch (...) {
    *t->error = std::current_exception();
  }
  t->latch->count_down();  // t may be gone after this
}

}  // namespace
}  // namespace details

TableStats& TableStats::operator+=(const TableStats& o) {
  rows += o.rows;
  row_bytes += o.row_bytes;
  index_bytes += o.index_bytes;
  pending_keys += o.pending_keys;
  pending_bytes += o.pending_bytes;
  removed_log += o.removed_log;
  change_log += o.change_log;
  removed_floor = std::max(removed_floor, o.removed_floor);
  change_floor = std::max(change_floor, o.change_floor);
  pulled_keys += o.pulled_keys;
  pull_misses += o.pull_misses;
  pushed_keys += o.pushed_keys;
  inserted += o.inserted;
  admitted += o.admitted;
  dropped_pending += o.dropped_pending;
  dropped_nan += o.dropped_nan;
  pending_forgotten += o.pending_forgotten;
  erased += o.erased;
  evicted_ttl += o.evicted_ttl;
  evicted_min_count += o.evicted_min_count;
  evicted_lfu += o.evicted_lfu;
  grown += o.grown;
  shrunk += o.shrunk;
  rows_moved += o.rows_moved;
  chunks_released += o.chunks_released;
  cold_rows += o.cold_rows;
  cold_index_bytes += o.cold_index_bytes;
  disk_bytes += o.disk_bytes;
  cold_reads += o.cold_reads;
  cold_prefetched += o.cold_prefetched;
  demoted += o.demoted;
  demoted_written += o.demoted_written;
  demoted_between_calls += o.demoted_between_calls;
  files_compacted += o.files_compacted;
  if (disk_error.empty()) disk_error = o.disk_error;
  return *this;
}

const char* PrecisionName(Precision precision) {
  switch (precision) {
    case Precision::kFp32:
      return "fp32";
    case Precision::kFp16:
      return "fp16";
    case Precision::kInt8:
      return "int8";
  }
  return "unknown";
}

int StateDim(OptimizerKind kind, int dim) {
  switch (kind) {
    case OptimizerKind::kSgd:
      return 0;
    case OptimizerKind::kAdagrad:
      return dim;
    case OptimizerKind::kAdam:
      return 2 * dim + 1;  // m, v, per-row step
    case OptimizerKind::kFtrl:
      return 2 * dim;  // z, n
  }
  return 0;
}

namespace {

void Require(bool ok, const TableSpec& spec, const std::string& what) {
  if (!ok) throw std::invalid_argument("table '" + spec.name + "': " + what);
}

bool Finite(float x) { return std::isfinite(x); }

// Training calls need float32 or float16 weights: an int8 table only serves.
void RequireTrainable(const TableDef& def) {
  if (def.spec.precision != Precision::kInt8) return;
  throw std::invalid_argument("table '" + def.spec.name +
                              "' has precision 'int8' (for serving): training calls (pull with "
                              "train=true, push) need precision 'fp32' or 'fp16'");
}

// A reserve is faulted in at once: refuse one larger than the machine's
// memory rather than let the kernel's OOM killer answer.
void CheckReserve(const TableSpec& spec, const details::RowLayout& layout) {
  if (spec.reserve_rows == 0) return;
  // Row, index slot at 3/4 load, change log (two keys).
  const double per_row =
      static_cast<double>(layout.hot_stride + layout.cold_stride) + 16 * 4 / 3.0 + 16;
  const double need = per_row * static_cast<double>(spec.reserve_rows);
  const double have = static_cast<double>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGESIZE);
  if (have <= 0 || need < have) return;
  constexpr double kGiB = 1 << 30;
  std::ostringstream msg;
  msg.precision(3);
  msg << "reserve_rows " << spec.reserve_rows << " needs about " << need / kGiB
      << " GiB, more than this machine's " << have / kGiB << " GiB";
  Require(false, spec, msg.str());
}

}  // namespace

void ValidateSpec(const TableSpec& spec) {
  if (spec.name.empty()) throw std::invalid_argument("table name must not be empty");
  Require(spec.dim >= 1 && spec.dim <= 65536, spec,
          "dim must be in [1, 65536], got " + std::to_string(spec.dim));
  const OptimizerSpec& o = spec.optimizer;
  Require(Finite(o.learning_rate) && o.learning_rate > 0, spec, "learning_rate must be > 0");
  Require(Finite(o.initial_accumulator) && o.initial_accumulator >= 0, spec,
          "initial_accumulator must be >= 0");
  Require(Finite(o.epsilon) && o.epsilon >= 0, spec, "epsilon must be >= 0");
  Require(o.beta1 >= 0 && o.beta1 < 1, spec, "beta1 must be in [0, 1)");
  Require(o.beta2 >= 0 && o.beta2 < 1, spec, "beta2 must be in [0, 1)");
  Require(Finite(o.beta) && o.beta >= 0, spec, "beta must be >= 0");
  Require(Finite(o.l1) && o.l1 >= 0, spec, "l1 must be >= 0");
  Require(Finite(o.l2) && o.l2 >= 0, spec, "l2 must be >= 0");
  Require(Finite(o.clip_norm) && o.clip_norm >= 0, spec, "clip_norm must be >= 0");
  if (o.kind == OptimizerKind::kAdagrad) {
    Require(o.initial_accumulator > 0 || o.epsilon > 0, spec,
            "adagrad needs initial_accumulator > 0 or epsilon > 0");
  }
  const InitSpec& i = spec.initializer;
  Require(Finite(i.mean), spec, "initializer mean must be finite");
  Require(Finite(i.stddev) && i.stddev >= 0, spec, "initializer stddev must be >= 0");
  Require(Finite(i.minval) && Finite(i.maxval), spec,
          "initializer minval and maxval must be finite");
  Require(i.minval <= i.maxval, spec, "initializer minval must be <= maxval");
  Require(Finite(i.value), spec, "initializer value must be finite");
  Require(spec.admission.min_count >= 1, spec, "admission min_count must be >= 1");
  Require(spec.admission.pending_capacity >= 1, spec, "admission pending_capacity must be >= 1");
  Require(spec.precision == Precision::kFp32 || spec.precision == Precision::kFp16 ||
              spec.precision == Precision::kInt8,
          spec,
          "precision must be fp32, fp16 or int8, got " +
              std::to_string(static_cast<int>(spec.precision)));
  Require(std::isfinite(spec.stats_half_life) && spec.stats_half_life >= 0, spec,
          "stats_half_life must be >= 0");
  if (!spec.grow_base.empty()) {
    Require(spec.grow_base != spec.name, spec, "grow_base must be another table");
    Require(std::isfinite(spec.grow_promote) && std::isfinite(spec.grow_demote) &&
                spec.grow_demote >= 0 && spec.grow_demote <= spec.grow_promote,
            spec, "grow thresholds need 0 <= demote <= promote");
    Require(std::isfinite(spec.grow_click_weight) && spec.grow_click_weight >= 0, spec,
            "grow_click_weight must be >= 0");
  }
}

void ShardOfBatch(const uint64_t* keys, size_t n, uint32_t num_shards, uint32_t* shards) {
  for (size_t i = 0; i < n; ++i) shards[i] = ShardOf(keys[i], num_shards);
}

void ServerOfBatch(const uint64_t* keys, size_t n, uint32_t num_servers, uint32_t* servers) {
  for (size_t i = 0; i < n; ++i) servers[i] = ServerOf(keys[i], num_servers);
}

namespace {

// Frees a table that no call can reach any more (unpublished, grace period
// over): shards first, they refer to the def's spec and layout.
void FreeTable(TableDef* def) {
  if (def->owns_shards) {
    for (TableShard* shard : def->shards) delete shard;
  }
  delete def;
}

// A table's definition and its shards, built on the calling thread (nothing
// reserved: no memory to fault in on the owners).
std::unique_ptr<TableDef> NewDef(const TableSpec& spec, int num_shards,
                                 const details::TierConfig& tier = {}) {
  auto def = std::make_unique<TableDef>();
  def->spec = spec;
  def->layout =
      details::RowLayout(spec.dim, StateDim(spec.optimizer.kind, spec.dim), spec.precision);
  def->tier = tier;
  def->shards.assign(num_shards, nullptr);
  try {
    for (int s = 0; s < num_shards; ++s) def->shards[s] = new TableShard(*def, 0, s);
  } catch (...) {
    for (TableShard*& shard : def->shards) delete std::exchange(shard, nullptr);
    throw;
  }
  return def;
}

}  // namespace

namespace details {

// A version being staged (Engine::BeginApply).
struct Staging {
  int table = -1;  // the live table's id, or -1: a new table
  bool full = false;
  std::unique_ptr<TableDef> def;               // full: the new table; delta: the overlay's rows
  std::vector<std::vector<uint64_t>> removed;  // per shard (delta)
  ~Staging() {
    if (def) FreeTable(def.release());
  }
};

}  // namespace details

Engine::Engine(const EngineOptions& options)
    : num_shards_(options.num_shards), grace_(std::make_unique<GracePeriod>()) {
  if (num_shards_ < 1 || num_shards_ > 1024) {
    throw std::invalid_argument("num_shards must be in [1, 1024], got " +
                                std::to_string(num_shards_));
  }
  workers_.reserve(num_shards_);
  for (int s = 0; s < num_shards_; ++s) {
    std::function<bool()> idle;  // a disk tier's demotion between calls
    if (!options.disk_dir.empty()) idle = [this, s] { return IdleWork(s); };
    workers_.push_back(std::make_unique<details::ShardWorker>(std::move(idle)));
  }
  if (!options.disk_dir.empty()) OpenDiskTier(options);
}

Engine::~Engine() {
  workers_.clear();  // joins; no call is in flight (nothing may call a dying engine)
  for (int slot = 0; slot < num_slots_.load(); ++slot) {
    if (TableDef* def = tables_[slot].load()) FreeTable(def);
  }
  if (!disk_dir_.empty()) {
    std::error_code ignored;
    std::filesystem::remove_all(disk_dir_, ignored);
  }
}

// The engine's folder of row files: <disk_dir>/wuliang-rows-<pid>-<n>, made
// afresh; folders that processes no longer running left behind go first.
void Engine::OpenDiskTier(const EngineOptions& options) {
  namespace fs = std::filesystem;
  const fs::path base(options.disk_dir);
  std::error_code error;
  fs::create_directories(base, error);
  if (error) {
    throw std::invalid_argument("disk_dir " + options.disk_dir +
                                " cannot be made: " + error.message());
  }
  for (const auto& entry : fs::directory_iterator(base, error)) {
    const std::string name = entry.path().filename().string();
    const std::string prefix = "wuliang-rows-";
    if (name.rfind(prefix, 0) != 0) continue;
    const long pid = std::strtol(name.c_str() + prefix.size(), nullptr, 10);
    if (pid > 0 && pid != static_cast<long>(::getpid()) &&
        ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) {
      fs::remove_all(entry.path(), error);
    }
  }
  static std::atomic<uint64_t> engines{0};
  disk_dir_ = (base / ("wuliang-rows-" + std::to_string(::getpid()) + "-" +
                       std::to_string(engines.fetch_add(1))))
                  .string();
  fs::remove_all(disk_dir_, error);
  fs::create_directories(disk_dir_, error);
  if (error) throw std::invalid_argument("disk_dir " + disk_dir_ + ": " + error.message());
  io_ = std::make_unique<details::IoPool>(std::max(options.io_threads - 1, 0));
  row_file_bytes_ = options.row_file_bytes;
  details::ArmTierCrash();
  const uint64_t total = options.memory_bytes != 0 ? options.memory_bytes : uint64_t{1} << 30;
  for (int s = 0; s < num_shards_; ++s) {
    budgets_.push_back(std::make_unique<details::ShardBudget>());
    budgets_.back()->limit = total / static_cast<uint64_t>(num_shards_);
  }
}

details::TierConfig Engine::TierOf(const TableSpec& spec) {
  details::TierConfig tier;
  if (disk_dir_.empty()) return tier;
  std::string name;
  for (char c : spec.name) name += std::isalnum(static_cast<unsigned char>(c)) ? c : '_';
  tier.dir = disk_dir_ + "/" + std::to_string(tier_tables_.fetch_add(1)) + "-" + name.substr(0, 64);
  tier.io = io_.get();
  tier.file_bytes = row_file_bytes_;
  for (auto& budget : budgets_) tier.budgets.push_back(budget.get());
  return tier;
}

void Engine::RunOnShards(const std::function<void(int)>& fn, const Plan* plan) {
  std::vector<int> active;
  for (int s = 0; s < num_shards_; ++s) {
    if (plan == nullptr || plan->filter || plan->split || plan->offsets[s + 1] > plan->offsets[s]) {
      active.push_back(s);
    }
  }
  RunOn(active, fn);
}

void Engine::RunOn(const std::vector<int>& active, const std::function<void(int)>& fn,
                   bool urgent) {
  if (active.empty()) return;
  std::vector<details::FnTask> tasks(active.size());
  std::vector<std::exception_ptr> errors(active.size());
  std::latch latch(static_cast<std::ptrdiff_t>(active.size()));
  for (size_t i = 0; i < active.size(); ++i) {
    details::FnTask& t = tasks[i];
    t.run = details::RunFnTask;
    t.fn = &fn;
    t.shard = active[i];
    t.latch = &latch;
    t.error = &errors[i];
    if (urgent) {
      workers_[active[i]]->EnqueueUrgent(&t);
    } else {
      workers_[active[i]]->Enqueue(&t);
    }
  }
  latch.wait();
  for (const std::exception_ptr& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

void Engine::PlanPartitioned(const uint64_t* keys, size_t n, const int64_t* shard_offsets,
                             Plan* plan) const {
  plan->keys = keys;
  plan->n = n;
  bool ok = shard_offsets[0] == 0 && shard_offsets[num_shards_] == static_cast<int64_t>(n);
  for (int s = 0; ok && s < num_shards_; ++s) ok = shard_offsets[s] <= shard_offsets[s + 1];
  if (!ok) {
    throw std::invalid_argument("shard_offsets must rise from 0 to the number of keys (" +
                                std::to_string(n) + ") in " + std::to_string(num_shards_ + 1) +
                                " entries");
  }
  plan->offsets.assign(shard_offsets, shard_offsets + num_shards_ + 1);
  plan->check_shards = true;
}

void Engine::PlanBatch(const uint64_t* keys, size_t n, Plan* plan) const {
  if (n > UINT32_MAX)
    throw std::invalid_argument("batch of " + std::to_string(n) + " keys is too large");
  const auto shards = static_cast<uint32_t>(num_shards_);
  plan->keys = keys;
  plan->n = n;
  plan->offsets.assign(shards + 1, 0);
  if (shards == 1 || n == 0) {
    std::fill(plan->offsets.begin() + 1, plan->offsets.end(), n);
    return;
  }
  // The shards split the batch in parallel rather than one caller thread
  // sorting it: each splits one block of it, in a round of its own
  // (SplitBlocks). Below kSplitMinShards, each shard scans the whole batch
  // for its keys instead (filter), without that round: cheaper while the
  // scans are few. A small batch for many shards is sorted here.
  if (shards >= kSplitMinShards && n >= kSplitMinKeys) {
    plan->split = true;
    plan->order_storage.resize(n);
    plan->order = plan->order_storage.data();
    plan->block_offsets.assign(size_t{shards} * (shards + 1), 0);
    return;
  }
  if (shards <= 2 * std::max(1u, std::thread::hardware_concurrency())) {
    plan->filter = true;
    return;
  }
  std::vector<uint32_t>& order = plan->order_storage;
  thread_local std::vector<uint16_t> shard_of;
  order.resize(n);
  shard_of.resize(n);
  std::vector<size_t>& offsets = plan->offsets;
  for (size_t i = 0; i < n; ++i) {
    const uint32_t s = ShardOf(keys[i], shards);
    shard_of[i] = static_cast<uint16_t>(s);
    ++offsets[s + 1];
  }
  for (uint32_t s = 0; s < shards; ++s) offsets[s + 1] += offsets[s];
  std::vector<size_t> next(offsets.begin(), offsets.end() - 1);
  for (size_t i = 0; i < n; ++i) order[next[shard_of[i]]++] = static_cast<uint32_t>(i);
  plan->order = order.data();
}

TableDef* Engine::Def(int table) const {
  if (table >= 0) {
    // seq_cst: this load must not pass the read scope's increment (the
    // store-load order GracePeriod relies on).
    TableDef* def = tables_[table & (kMaxTables - 1)].load(std::memory_order_seq_cst);
    if (def != nullptr && def->id == table) return def;  // else dropped, slot maybe reused
  }
  throw UnknownTableError("no table with id " + std::to_string(table) +
                          " (never created, or dropped)");
}

TableDef* Engine::WritableDef(int table) const {
  TableDef* def = Def(table);
  if (def->layered()) {
    throw std::runtime_error("table '" + def->spec.name +
                             "' is switching to a new version (apply); retry when it is done");
  }
  return def;
}

TableDef* Engine::MutableDef(int table) const {
  TableDef* def = WritableDef(table);
  if (def->spec.serving) {
    throw std::invalid_argument("table '" + def->spec.name +
                                "' is a serving table: only a version apply changes it");
  }
  return def;
}

TableDef* Engine::FindDef(const std::string& name) const {
  const int n = num_slots_.load(std::memory_order_acquire);
  for (int slot = 0; slot < n; ++slot) {
    TableDef* def = tables_[slot].load(std::memory_order_seq_cst);
    if (def != nullptr && def->spec.name == name) return def;
  }
  return nullptr;
}

std::vector<std::string> Engine::TableNamesInScope() const {
  std::vector<std::string> names;
  const int n = num_slots_.load(std::memory_order_acquire);
  for (int slot = 0; slot < n; ++slot) {
    const TableDef* def = tables_[slot].load(std::memory_order_seq_cst);
    if (def != nullptr) names.push_back(def->spec.name);
  }
  return names;
}

namespace {

std::string UnknownName(const std::string& name, const std::vector<std::string>& names) {
  std::ostringstream msg;
  msg << "unknown table '" << name << "' (tables:";
  for (size_t i = 0; i < names.size(); ++i) msg << (i ? ", " : " ") << names[i];
  if (names.empty()) msg << " none";
  msg << ")";
  return msg.str();
}

// `seconds`: the engine's clock (Engine::SetClock); 0: the wall clock.
Clock Now(uint64_t step, uint64_t version, uint32_t seconds) {
  if (seconds == 0) seconds = static_cast<uint32_t>(std::time(nullptr));
  return Clock{step, seconds, version};
}

// Per-key records (a checkpoint's removals or admission counts) grouped by
// shard, in their order.
template <class V>
struct ShardRecords {
  std::vector<std::vector<uint64_t>> keys;
  std::vector<std::vector<V>> values;
};

template <class V>
ShardRecords<V> SplitByShard(const uint64_t* keys, const V* values, size_t n, int num_shards) {
  ShardRecords<V> out{std::vector<std::vector<uint64_t>>(num_shards),
                      std::vector<std::vector<V>>(num_shards)};
  for (size_t i = 0; i < n; ++i) {
    const uint32_t s = ShardOf(keys[i], num_shards);
    out.keys[s].push_back(keys[i]);
    out.values[s].push_back(values[i]);
  }
  return out;
}

}  // namespace

std::vector<int64_t> Engine::WorkerThreadIds() {
  std::vector<int64_t> ids(num_shards_);
  RunOnShards([&](int s) { ids[s] = gettid(); });
  return ids;
}

int Engine::CreateTable(const TableSpec& spec) {
  ValidateSpec(spec);
  std::lock_guard<std::mutex> lock(create_mutex_);  // no def is freed meanwhile
  if (FindDef(spec.name) != nullptr) {
    throw std::invalid_argument("table '" + spec.name + "' already exists");
  }
  const TableDef* base = nullptr;
  if (!spec.grow_base.empty() && !spec.serving) {
    base = FindDef(spec.grow_base);
    if (base == nullptr || !base->spec.grow_base.empty() || base->layered()) {
      throw std::invalid_argument("table '" + spec.name + "': grow_base '" + spec.grow_base +
                                  "' must be a table of this engine without a grow_base, "
                                  "created first");
    }
  }
  std::unique_ptr<TableDef> def;
  if (spec.reserve_rows == 0) {
    // Nothing to fault in: the shards are built here, without a hand-off
    // to the workers (whose tasks reach them only after the publication).
    def = NewDef(spec, num_shards_, TierOf(spec));
  } else {
    def = std::make_unique<TableDef>();
    def->spec = spec;
    def->layout =
        details::RowLayout(spec.dim, StateDim(spec.optimizer.kind, spec.dim), spec.precision);
    def->tier = TierOf(spec);
    CheckReserve(spec, def->layout);
    def->shards.assign(num_shards_, nullptr);
    try {
      // Each owner thread builds its shard and faults in its reserved memory.
      const uint64_t shard_reserve = (spec.reserve_rows + num_shards_ - 1) / num_shards_;
      RunOnShards([&](int s) { def->shards[s] = new TableShard(*def, shard_reserve, s); });
    } catch (...) {
      for (TableShard*& shard : def->shards) delete std::exchange(shard, nullptr);
      throw;
    }
  }
  if (base != nullptr) {
    for (int s = 0; s < num_shards_; ++s) def->shards[s]->SetGrowBase(base->shards[s]);
  }
  return Publish(std::move(def));
}

bool Engine::IdleWork(int shard) {
  // Within a read scope, like a call: a table dropped meanwhile is freed
  // only after this piece.
  const GracePeriod::ReadScope scope(*grace_);
  bool more = false;
  for (int slot = 0; slot < num_slots_.load(std::memory_order_acquire); ++slot) {
    TableDef* def = tables_[slot].load(std::memory_order_seq_cst);
    if (def == nullptr || def->layered() || def->tier.dir.empty()) continue;
    more = def->shards[shard]->IdleWork() || more;
  }
  return more;
}

int Engine::Publish(std::unique_ptr<TableDef> def) {
  if (!def->spec.serving) {  // a training table's shards demote between calls
    for (TableShard* shard : def->shards) shard->SetDeferDemotion(true);
  }
  const int used = num_slots_.load(std::memory_order_relaxed);
  int slot = -1;
  if (!free_slots_.empty()) {
    slot = free_slots_.back();
  } else if (used < kMaxTables) {
    slot = used;
  } else {
    const size_t live = TableNamesInScope().size();
    throw std::length_error("cannot create table '" + def->spec.name +
                            "': " + std::to_string(live) + " tables live, at most " +
                            std::to_string(kMaxTables) + " (and " +
                            std::to_string(kMaxTables - live) + " ids retired after " +
                            std::to_string(kGenerations) + " creates each)");
  }
  def->id = slot < used ? next_id_[slot] : slot;  // a new slot starts at generation 0
  const int id = def->id;
  tables_[slot].store(def.release(), std::memory_order_release);
  if (slot < used) {
    free_slots_.pop_back();
  } else {
    next_id_.push_back(slot);
    num_slots_.store(used + 1, std::memory_order_release);
  }
  return id;
}

void Engine::DropTable(const std::string& name) {
  std::lock_guard<std::mutex> lock(create_mutex_);  // no def is freed meanwhile
  TableDef* def = FindDef(name);
  if (def == nullptr) throw UnknownTableError(UnknownName(name, TableNamesInScope()));
  for (int other = 0; other < num_slots_.load(std::memory_order_acquire); ++other) {
    const TableDef* d = tables_[other].load(std::memory_order_acquire);
    if (d != nullptr && d != def && d->spec.grow_base == name && !d->spec.serving) {
      throw std::invalid_argument("cannot drop table '" + name + "': table '" + d->spec.name +
                                  "' grows from it (drop that one first)");
    }
  }
  const int slot = def->id & (kMaxTables - 1);
  tables_[slot].store(nullptr, std::memory_order_seq_cst);
  // The calls that found the table run to their end; later ones throw.
  grace_->Wait();
  // Freed here, off the shard workers: calls on other tables do not wait
  // while the memory is unmapped.
  const int generation = (def->id >> kSlotBits) + 1;
  FreeTable(def);
  if (generation < kGenerations) {
    next_id_[slot] = (generation << kSlotBits) | slot;
    free_slots_.push_back(slot);
  }  // else the slot is retired: none of its ids is issued again
}

int Engine::TableId(const std::string& name) const {
  const GracePeriod::ReadScope scope(*grace_);
  if (const TableDef* def = FindDef(name)) return def->id;
  throw UnknownTableError(UnknownName(name, TableNamesInScope()));
}

TableSpec Engine::Spec(int table) const {
  const GracePeriod::ReadScope scope(*grace_);
  return Def(table)->spec;
}

int Engine::Dim(int table) const {
  const GracePeriod::ReadScope scope(*grace_);
  return Def(table)->spec.dim;
}

std::vector<std::string> Engine::TableNames() const {
  const GracePeriod::ReadScope scope(*grace_);
  return TableNamesInScope();
}

namespace {

Engine::TablePart Part(int table, const uint64_t* keys, size_t n, const int64_t* shard_offsets) {
  Engine::TablePart part;
  part.table = table;
  part.keys = keys;
  part.n = n;
  part.shard_offsets = shard_offsets;
  return part;
}

}  // namespace

void Engine::PlanKeys(const uint64_t* keys, size_t n, Plan* plan) {
  PlanBatch(keys, n, plan);
  if (plan->split) SplitBlocks({plan});
}

void Engine::SplitBlocks(const std::vector<Plan*>& plans) {
  if (plans.empty()) return;
  const auto shards = static_cast<uint32_t>(num_shards_);
  RunOnShards([&](int b) {
    thread_local std::vector<uint16_t> shard_of;
    for (Plan* plan : plans) {
      const size_t begin = BlockBegin(plan->n, b, shards);
      const size_t end = BlockBegin(plan->n, b + 1, shards);
      size_t* offsets = plan->block_offsets.data() + size_t{shards + 1} * b;
      shard_of.resize(end - begin);
      for (size_t i = begin; i < end; ++i) {
        const uint32_t s = ShardOfHash(Mix64(plan->keys[i]), shards);
        shard_of[i - begin] = static_cast<uint16_t>(s);
        ++offsets[s + 1];
      }
      offsets[0] = begin;
      for (uint32_t s = 0; s < shards; ++s) offsets[s + 1] += offsets[s];
      std::vector<size_t> next(offsets, offsets + shards);
      for (size_t i = begin; i < end; ++i) {
        plan->order_storage[next[shard_of[i - begin]]++] = static_cast<uint32_t>(i);
      }
    }
  });
}

std::vector<int> Engine::PlanParts(const std::vector<TablePart>& parts, std::vector<Plan>* plans) {
  plans->resize(parts.size());
  std::vector<bool> has_keys(num_shards_, false);
  for (size_t i = 0; i < parts.size(); ++i) {
    const TablePart& p = parts[i];
    Plan& plan = (*plans)[i];
    if (p.shard_offsets != nullptr) {
      PlanPartitioned(p.keys, p.n, p.shard_offsets, &plan);
    } else {
      PlanBatch(p.keys, p.n, &plan);
    }
    for (int s = 0; s < num_shards_; ++s) {
      if (plan.filter || plan.split ? p.n > 0 : plan.offsets[s + 1] > plan.offsets[s]) {
        has_keys[s] = true;
      }
    }
  }
  std::vector<Plan*> to_split;
  for (Plan& plan : *plans) {
    if (plan.split) to_split.push_back(&plan);
  }
  SplitBlocks(to_split);
  std::vector<int> active;
  for (int s = 0; s < num_shards_; ++s) {
    if (has_keys[s]) active.push_back(s);
  }
  return active;
}

void Engine::Pull(int table, const uint64_t* keys, size_t n, float* out, bool train,
                  const int64_t* shard_offsets) {
  TablePart part = Part(table, keys, n, shard_offsets);
  part.out = out;
  PullMany({part}, train);
}

Clock Engine::ClockAt(uint64_t step) const {
  if (step == kCurrentStep) return Now(this->step(), version(), this->clock());
  Clock clock = Now(step, version(), this->clock());
  clock.step_given = true;
  return clock;
}

void Engine::PullMany(const std::vector<TablePart>& parts, bool train, uint64_t step) {
  const GracePeriod::ReadScope scope(*grace_);
  std::vector<TableDef*> defs;
  defs.reserve(parts.size());
  for (const TablePart& p : parts) {
    defs.push_back(train ? MutableDef(p.table) : Def(p.table));
    if (train) RequireTrainable(*defs.back());
  }
  std::vector<Plan> plans;
  const std::vector<int> active = PlanParts(parts, &plans);
  const Clock clock = ClockAt(step);
  RunOn(active, [&](int s) {
    for (size_t i = 0; i < parts.size(); ++i) {
      if (parts[i].n == 0) continue;
      if (defs[i]->layered()) {  // a lookup while a version switches in
        if (parts[i].out_stride != 0 && parts[i].out_stride != defs[i]->layout.dim) {
          throw std::invalid_argument("table '" + defs[i]->spec.name +
                                      "' is switching versions: its pulls take whole rows");
        }
        defs[i]->shards[s]->Lookup(plans[i].For(s), parts[i].out, nullptr, true,
                                   &defs[i]->overlays[s]);
      } else {
        defs[i]->shards[s]->Pull(plans[i].For(s), parts[i].out, train, clock, parts[i].out_stride);
      }
    }
  });
}

uint64_t Engine::PrefetchMany(const std::vector<TablePart>& parts) {
  if (disk_dir_.empty()) return 0;
  const GracePeriod::ReadScope scope(*grace_);
  std::vector<TableDef*> defs;
  defs.reserve(parts.size());
  for (const TablePart& p : parts) defs.push_back(Def(p.table));
  std::vector<Plan> plans;
  const std::vector<int> active = PlanParts(parts, &plans);
  // Each shard plans its reads; this thread reads them all (32 in flight)
  // while the workers go on with other calls; each shard installs its own.
  using Reads = details::TableShard::PrefetchReads;
  std::vector<std::vector<Reads>> reads(num_shards_, std::vector<Reads>(parts.size()));
  // Planning and installing go ahead of the calls queued on the shards
  // (pushes, mostly): the rows come in the same whichever goes first, as an
  // install skips the rows a call brought in or changed meanwhile.
  RunOn(
      active,
      [&](int s) {
        for (size_t i = 0; i < parts.size(); ++i) {
          if (parts[i].n != 0 && !defs[i]->layered()) {
            defs[i]->shards[s]->PlanPrefetch(plans[i].For(s), &reads[s][i]);
          }
        }
      },
      /*urgent=*/true);
  std::vector<std::pair<Reads*, size_t>> work;
  for (auto& shard : reads) {
    for (Reads& r : shard) {
      for (size_t j = 0; j < r.places.size(); ++j) work.emplace_back(&r, j);
    }
  }
  std::exception_ptr failed;  // rethrown once every shard has its files back
  try {
    details::UringReader* ring = details::UringReader::ForThisThread();
    if (ring != nullptr) {
      std::vector<details::RecordRead> batch;
      batch.reserve(work.size());
      for (auto& [r, j] : work) batch.push_back(r->ReadOf(j));
      std::vector<bool> again(work.size(), false);  // read blocking, and counted, by Read
      ring->ReadAll(batch.data(), batch.size(), [&](size_t w) {
        again[w] = true;
        work[w].first->Read(work[w].second);
      });
      for (size_t w = 0; w < work.size(); ++w) {
        if (!again[w]) work[w].first->file->CountReads(1);
      }
    } else {
      io_->ParallelFor(work.size(), [&](size_t w) { work[w].first->Read(work[w].second); });
    }
  } catch (...) {
    failed = std::current_exception();
  }
  std::vector<uint64_t> installed(num_shards_, 0);
  RunOn(
      active,
      [&](int s) {
        for (size_t i = 0; i < parts.size(); ++i) {
          if (parts[i].n == 0 || defs[i]->layered()) continue;
          if (failed) reads[s][i].keys.clear();  // nothing installed: the pulls read themselves
          installed[s] += defs[i]->shards[s]->FinishPrefetch(&reads[s][i]);
        }
      },
      /*urgent=*/true);
  if (failed) std::rethrow_exception(failed);
  uint64_t total = 0;
  for (uint64_t r : installed) total += r;
  return total;
}

void Engine::CheckFinite(const TableDef& def, const TablePart& part) const {
  if (def.spec.nan_policy != NanPolicy::kRaise) return;
  const int dim = def.spec.dim;
  for (size_t i = 0; i < part.n; ++i) {
    for (int j = 0; j < dim; ++j) {
      if (!std::isfinite(part.grads[i * dim + j])) {
        throw std::invalid_argument("table '" + def.spec.name + "': gradient row " +
                                    std::to_string(i) + " (key " + std::to_string(part.keys[i]) +
                                    ") is not finite");
      }
    }
  }
}

PushResult Engine::Push(int table, const uint64_t* keys, size_t n, const float* grads,
                        bool keys_unique, const int64_t* shard_offsets, float* updated,
                        const int32_t* updated_rows) {
  TablePart part = Part(table, keys, n, shard_offsets);
  part.grads = grads;
  part.updated = updated;
  part.updated_rows = updated_rows;
  return PushMany({part}, keys_unique);
}

PushResult Engine::PushMany(const std::vector<TablePart>& parts, bool keys_unique, Only only,
                            uint64_t step) {
  const GracePeriod::ReadScope scope(*grace_);
  if (only != Only::kAll && !keys_unique) {
    throw std::invalid_argument("a push split by updated_rows needs unique keys");
  }
  std::vector<TableDef*> defs;
  defs.reserve(parts.size());
  for (const TablePart& p : parts) {
    defs.push_back(MutableDef(p.table));
    RequireTrainable(*defs.back());
    CheckFinite(*defs.back(), p);
  }
  std::vector<Plan> plans;
  const std::vector<int> active = PlanParts(parts, &plans);
  const Clock clock = ClockAt(step);
  std::vector<PushResult> results(num_shards_);
  RunOn(active, [&](int s) {
    for (size_t i = 0; i < parts.size(); ++i) {
      const TablePart& p = parts[i];
      if (p.n == 0) continue;
      defs[i]->shards[s]->Push(plans[i].For(s), p.grads, keys_unique, clock, &results[s], p.updated,
                               p.updated_rows, static_cast<int>(only), p.shows, p.clicks,
                               p.grads_stride, p.updated_stride);
    }
  });
  PushResult total;
  for (const PushResult& r : results) {
    total.applied += r.applied;
    total.dropped_nan += r.dropped_nan;
    total.dropped_pending += r.dropped_pending;
    total.duplicates += r.duplicates;
  }
  return total;
}

uint64_t Engine::Erase(int table, const uint64_t* keys, size_t n, uint64_t step) {
  const GracePeriod::ReadScope scope(*grace_);
  TableDef* def = MutableDef(table);
  Plan plan;
  PlanKeys(keys, n, &plan);
  const Clock clock = ClockAt(step);
  std::vector<uint64_t> erased(num_shards_, 0);
  RunOnShards([&](int s) { erased[s] = def->shards[s]->Erase(plan.For(s), clock); }, &plan);
  uint64_t total = 0;
  for (uint64_t e : erased) total += e;
  return total;
}

void Engine::Contains(int table, const uint64_t* keys, size_t n, uint8_t* out) {
  const GracePeriod::ReadScope scope(*grace_);
  TableDef* def = Def(table);
  Plan plan;
  PlanKeys(keys, n, &plan);
  RunOnShards(
      [&](int s) {
        def->shards[s]->Contains(plan.For(s), out, def->layered() ? &def->overlays[s] : nullptr);
      },
      &plan);
}

namespace {

// Moves row `from` of every column of out to row `to` (to < from).
void MoveRow(const RowColumns& out, size_t dim, size_t state_dim, size_t from, size_t to) {
  if (out.keys != nullptr) out.keys[to] = out.keys[from];
  if (out.weights != nullptr) std::copy_n(out.weights + from * dim, dim, out.weights + to * dim);
  if (out.state != nullptr)
    std::copy_n(out.state + from * state_dim, state_dim, out.state + to * state_dim);
  if (out.counts != nullptr) out.counts[to] = out.counts[from];
  if (out.steps != nullptr) out.steps[to] = out.steps[from];
  if (out.times != nullptr) out.times[to] = out.times[from];
  if (out.versions != nullptr) out.versions[to] = out.versions[from];
  if (out.shows != nullptr) out.shows[to] = out.shows[from];
  if (out.clicks != nullptr) out.clicks[to] = out.clicks[from];
}

}  // namespace

size_t Engine::ReadRows(int table, const uint64_t* keys, size_t n, const RowColumns& out,
                        uint8_t* found) {
  const GracePeriod::ReadScope scope(*grace_);
  TableDef* def = WritableDef(table);
  Plan plan;
  PlanKeys(keys, n, &plan);
  // Each shard writes its keys' rows at their positions; the rows of the
  // keys found are then moved up over the gaps, in order.
  RunOnShards([&](int s) { def->shards[s]->ReadRows(plan.For(s), out, found); }, &plan);
  const auto dim = static_cast<size_t>(def->layout.dim);
  const auto state_dim = static_cast<size_t>(def->layout.state_dim);
  size_t m = 0;
  for (size_t i = 0; i < n; ++i) {
    if (found[i] == 0) continue;
    if (m != i) MoveRow(out, dim, state_dim, i, m);
    ++m;
  }
  return m;
}

void Engine::Load(int table, size_t n, const RowColumns& rows, uint64_t step) {
  const GracePeriod::ReadScope scope(*grace_);
  TableDef* def = MutableDef(table);
  if (n > 0 && (rows.keys == nullptr || rows.weights == nullptr)) {
    throw std::invalid_argument("load into '" + def->spec.name + "' needs keys and weights");
  }
  Plan plan;
  PlanKeys(rows.keys, n, &plan);
  const Clock clock = ClockAt(step);
  RunOnShards([&](int s) { def->shards[s]->Load(plan.For(s), rows, clock); }, &plan);
}

std::vector<size_t> Engine::ExchangeMany(const std::vector<ExchangePart>& parts, uint64_t step) {
  const GracePeriod::ReadScope scope(*grace_);
  std::vector<TableDef*> defs;
  std::vector<TablePart> planned;  // per part: its back, its keys, its in_keys
  defs.reserve(parts.size());
  planned.reserve(3 * parts.size());
  for (const ExchangePart& p : parts) {
    defs.push_back(MutableDef(p.table));
    RequireTrainable(*defs.back());
    if (p.n_back > 0 && (p.back.keys == nullptr || p.back.weights == nullptr)) {
      throw std::invalid_argument("exchange with '" + defs.back()->spec.name +
                                  "': rows given back need keys and weights");
    }
    if (p.merge && p.n_back > 0 && defs.back()->layout.precision != Precision::kFp32) {
      throw std::invalid_argument("exchange with '" + defs.back()->spec.name +
                                  "': changes merge into fp32 tables only");
    }
    if (p.n > 0 && p.out == nullptr) {
      throw std::invalid_argument("exchange with '" + defs.back()->spec.name + "': no out");
    }
  }
  // Where every incoming key is among the misses (a cache's pull), one
  // pass over the misses pulls them and reads the incoming rows at their
  // last occurrence (TableShard::PullWhole); else (a seed: no misses) the
  // incoming keys are checked, the misses pulled, then the rows read.
  std::vector<std::vector<int32_t>> in_of(parts.size());
  std::vector<std::vector<uint8_t>> in_last(parts.size());
  for (size_t i = 0; i < parts.size(); ++i) {
    const ExchangePart& p = parts[i];
    if (p.n_in == 0 || p.n == 0) continue;
    // An open-addressing table of the incoming keys (Mix64 is a bijection:
    // equal hashes are equal keys): slot -> index + 1, 0 empty.
    size_t capacity = 16;
    while (capacity < 2 * p.n_in) capacity <<= 1;
    const size_t mask = capacity - 1;
    std::vector<uint64_t> hashes(capacity);
    std::vector<int32_t> slots(capacity, 0);
    bool repeated = false;
    for (size_t k = 0; k < p.n_in; ++k) {
      const uint64_t h = Mix64(p.in_keys[k]);
      for (size_t j = h & mask;; j = (j + 1) & mask) {
        if (slots[j] == 0) {
          hashes[j] = h;
          slots[j] = static_cast<int32_t>(k + 1);
          break;
        }
        if (hashes[j] == h) {
          repeated = true;
          break;
        }
      }
    }
    std::vector<int64_t> last(p.n_in, -1);
    std::vector<int32_t>& of = in_of[i];
    of.assign(p.n, -1);
    for (size_t pos = 0; pos < p.n; ++pos) {
      const uint64_t h = Mix64(p.keys[pos]);
      for (size_t j = h & mask; slots[j] != 0; j = (j + 1) & mask) {
        if (hashes[j] == h) {
          of[pos] = slots[j] - 1;
          last[slots[j] - 1] = static_cast<int64_t>(pos);
          break;
        }
      }
    }
    if (repeated || std::find(last.begin(), last.end(), -1) != last.end()) {
      of.clear();  // an incoming key not among the misses, or given twice
      continue;
    }
    in_last[i].assign(p.n, 0);
    for (const int64_t pos : last) in_last[i][static_cast<size_t>(pos)] = 1;
    std::fill(p.in_created, p.in_created + p.n_in, 0);
    std::fill(p.in_found, p.in_found + p.n_in, 0);
  }
  for (size_t i = 0; i < parts.size(); ++i) {  // a fused part's incoming keys need no plan
    const ExchangePart& p = parts[i];
    planned.push_back(Part(p.table, p.back.keys, p.n_back, nullptr));
    planned.push_back(Part(p.table, p.keys, p.n, p.shard_offsets));
    planned.push_back(Part(p.table, p.in_keys, in_of[i].empty() ? p.n_in : 0, nullptr));
  }
  std::vector<Plan> plans;
  const std::vector<int> active = PlanParts(planned, &plans);
  const Clock clock = ClockAt(step);
  RunOn(active, [&](int s) {
    for (size_t i = 0; i < parts.size(); ++i) {
      const ExchangePart& p = parts[i];
      details::TableShard& shard = *defs[i]->shards[s];
      if (p.n_back > 0 && p.merge) {
        shard.MergeRows(plans[3 * i].For(s), p.back, clock);
      } else if (p.n_back > 0) {
        shard.Load(plans[3 * i].For(s), p.back, clock);
      }
      if (!in_of[i].empty()) {
        shard.PullWhole(plans[3 * i + 1].For(s), p.out, in_of[i].data(), in_last[i].data(),
                        p.in_rows, p.in_found, p.in_created, clock);
        continue;
      }
      if (p.n_in > 0) shard.Contains(plans[3 * i + 2].For(s), p.in_created);  // before the pull
      if (p.n > 0) shard.Pull(plans[3 * i + 1].For(s), p.out, true, clock);
      if (p.n_in > 0) shard.ReadRows(plans[3 * i + 2].For(s), p.in_rows, p.in_found);
    }
  });
  std::vector<size_t> read(parts.size(), 0);
  for (size_t i = 0; i < parts.size(); ++i) {
    const ExchangePart& p = parts[i];
    const auto dim = static_cast<size_t>(defs[i]->layout.dim);
    const auto state_dim = static_cast<size_t>(defs[i]->layout.state_dim);
    size_t m = 0;
    const bool fused = !in_of[i].empty();  // in_created says created; else: had a row before
    for (size_t k = 0; k < p.n_in; ++k) {
      if (!fused) p.in_created[k] = p.in_found[k] != 0 && p.in_created[k] == 0 ? 1 : 0;
      if (p.in_found[k] == 0) continue;
      if (m != k) MoveRow(p.in_rows, dim, state_dim, k, m);
      ++m;
    }
    read[i] = m;
  }
  return read;
}

EvictResult Engine::Evict(int table, uint64_t step) {
  const GracePeriod::ReadScope scope(*grace_);
  if (table >= 0) return EvictTable(MutableDef(table), step);
  EvictResult total;
  for (int slot = 0; slot < num_slots_.load(std::memory_order_acquire); ++slot) {
    TableDef* def = tables_[slot].load(std::memory_order_seq_cst);
    if (def == nullptr || def->layered()) continue;  // a table switching versions: not now
    const EvictResult r = EvictTable(def, step);
    total.ttl += r.ttl;
    total.min_count += r.min_count;
    total.lfu += r.lfu;
    total.shrunk += r.shrunk;
  }
  return total;
}

namespace {

EvictResult Sum(const std::vector<EvictResult>& parts) {
  EvictResult total;
  for (const EvictResult& r : parts) {
    total.ttl += r.ttl;
    total.min_count += r.min_count;
    total.lfu += r.lfu;
    total.shrunk += r.shrunk;
  }
  return total;
}

}  // namespace

EvictResult Engine::EvictTable(TableDef* def, uint64_t step) {
  const Clock clock = ClockAt(step);
  std::vector<EvictResult> per_shard(num_shards_);
  RunOnShards([&](int s) { def->shards[s]->EvictByAge(clock, &per_shard[s]); });

  const uint64_t max_rows = def->spec.eviction.max_rows;
  if (max_rows > 0) {
    std::vector<std::vector<uint64_t>> hist(num_shards_);
    RunOnShards([&](int s) {
      hist[s].assign(details::kHistogramBuckets, 0);
      def->shards[s]->CountHistogram(&hist[s]);
    });
    std::vector<uint64_t> merged(details::kHistogramBuckets, 0);
    uint64_t rows = 0;
    for (const auto& h : hist) {
      for (size_t c = 0; c < h.size(); ++c) merged[c] += h[c];
    }
    for (uint64_t m : merged) rows += m;
    if (rows > max_rows) {
      // Evict every count below `threshold`, and `need` rows at it.
      const uint64_t excess = rows - max_rows;
      uint32_t threshold = 0;
      uint64_t below = 0;
      while (below + merged[threshold] < excess) below += merged[threshold++];
      const uint64_t need_at_threshold = excess - below;
      // Among rows at the threshold the oldest go first: find the update
      // step of the need-th oldest, then split the ties at it over shards.
      std::vector<std::vector<uint64_t>> steps(num_shards_);
      RunOnShards([&](int s) { def->shards[s]->StepsAtCount(threshold, &steps[s]); });
      std::vector<uint64_t> all;
      for (const auto& v : steps) all.insert(all.end(), v.begin(), v.end());
      // Training may change counts between the phases: the cut then uses
      // what this phase saw.
      const uint64_t need = std::min<uint64_t>(need_at_threshold, all.size());
      if (need > 0) {
        std::nth_element(all.begin(), all.begin() + (need - 1), all.end());
        const uint64_t cutoff = all[need - 1];
        uint64_t before_cutoff = 0;
        for (uint64_t step : all) before_cutoff += step < cutoff;
        const std::vector<uint64_t> quota = SplitTies(steps, cutoff, need - before_cutoff);
        RunOnShards([&](int s) {
          def->shards[s]->EvictLeastFrequent(threshold, cutoff, quota[s], clock, &per_shard[s]);
        });
      }
    }
  }
  RunOnShards([&](int s) { def->shards[s]->Compact(); });
  return Sum(per_shard);
}

std::vector<uint64_t> Engine::SplitTies(const std::vector<std::vector<uint64_t>>& steps,
                                        uint64_t cutoff, uint64_t ties) const {
  std::vector<uint64_t> quota(steps.size(), 0);
  for (size_t s = 0; s < steps.size() && ties > 0; ++s) {
    const auto at = static_cast<uint64_t>(std::count(steps[s].begin(), steps[s].end(), cutoff));
    quota[s] = std::min(at, ties);
    ties -= quota[s];
  }
  return quota;
}

EvictResult Engine::EvictByAge(int table, uint64_t step) {
  const GracePeriod::ReadScope scope(*grace_);
  TableDef* def = MutableDef(table);
  const Clock clock = ClockAt(step);
  std::vector<EvictResult> per_shard(num_shards_);
  RunOnShards([&](int s) { def->shards[s]->EvictByAge(clock, &per_shard[s]); });
  return Sum(per_shard);
}

std::vector<uint64_t> Engine::CountHistogram(int table) {
  const GracePeriod::ReadScope scope(*grace_);
  TableDef* def = Def(table);
  std::vector<std::vector<uint64_t>> hist(num_shards_);
  RunOnShards([&](int s) {
    hist[s].assign(details::kHistogramBuckets, 0);
    def->shards[s]->CountHistogram(&hist[s]);
  });
  std::vector<uint64_t> merged(details::kHistogramBuckets, 0);
  for (const auto& h : hist) {
    for (size_t c = 0; c < h.size(); ++c) merged[c] += h[c];
  }
  return merged;
}

std::vector<uint64_t> Engine::StepsAtCount(int table, uint32_t count) {
  const GracePeriod::ReadScope scope(*grace_);
  TableDef* def = Def(table);
  if (count >= details::kHistogramBuckets) {
    throw std::invalid_argument("count bucket " + std::to_string(count) + " is not below " +
                                std::to_string(details::kHistogramBuckets));
  }
  std::vector<std::vector<uint64_t>> steps(num_shards_);
  RunOnShards([&](int s) { def->shards[s]->StepsAtCount(count, &steps[s]); });
  std::vector<uint64_t> all;
  for (const auto& v : steps) all.insert(all.end(), v.begin(), v.end());
  return all;
}

EvictResult Engine::EvictLeastFrequent(int table, uint32_t threshold, uint64_t cutoff,
                                       uint64_t quota, uint64_t step) {
  const GracePeriod::ReadScope scope(*grace_);
  TableDef* def = MutableDef(table);
  if (threshold >= details::kHistogramBuckets) {
    throw std::invalid_argument("count bucket " + std::to_string(threshold) + " is not below " +
                                std::to_string(details::kHistogramBuckets));
  }
  const Clock clock = ClockAt(step);
  std::vector<std::vector<uint64_t>> steps(num_shards_);
  RunOnShards([&](int s) { def->shards[s]->StepsAtCount(threshold, &steps[s]); });
  const std::vector<uint64_t> quotas = SplitTies(steps, cutoff, quota);
  std::vector<EvictResult> per_shard(num_shards_);
  RunOnShards([&](int s) {
    def->shards[s]->EvictLeastFrequent(threshold, cutoff, quotas[s], clock, &per_shard[s]);
  });
  RunOnShards([&](int s) { def->shards[s]->Compact(); });
  return Sum(per_shard);
}

TableStats Engine::Stats(int table) {
  const GracePeriod::ReadScope scope(*grace_);
  TableDef* def = Def(table);
  std::vector<TableStats> per_shard(num_shards_);
  RunOnShards([&](int s) { per_shard[s] = def->shards[s]->Snapshot(); });
  TableStats total;
  for (const TableStats& t : per_shard) total += t;
  return total;
}

size_t Engine::Export(int table, uint64_t since, size_t max_rows, ExportCursor* cursor,
                      const RowColumns& out) {
  const GracePeriod::ReadScope scope(*grace_);
  TableDef* def = WritableDef(table);
  size_t written = 0;
  while (!cursor->done && written < max_rows) {
    const int s = cursor->shard;
    bool shard_done = false;
    RunOn({s}, [&](int) {
      TableShard* t = def->shards[s];
      if (!cursor->started) {
        t->BeginExport(since, cursor);
        cursor->started = true;
      } else if (!cursor->by_key && t->generation() != cursor->generation) {
        throw std::runtime_error("table '" + def->spec.name + "' shard " + std::to_string(s) +
                                 " changed during export (rows removed or index resized); "
                                 "pause training while exporting");
      }
      written += t->Export(since, max_rows - written, cursor, out, written, &shard_done);
    });
    if (shard_done) {
      cursor->started = false;
      cursor->keys = {};
      if (++cursor->shard == num_shards_) cursor->done = true;
    }
  }
  return written;
}

std::vector<std::pair<uint64_t, uint64_t>> Engine::RemovedLog(int table, uint64_t since) {
  const GracePeriod::ReadScope scope(*grace_);
  TableDef* def = Def(table);
  std::vector<std::vector<std::pair<uint64_t, uint64_t>>> per_shard(num_shards_);
  RunOnShards([&](int s) { def->shards[s]->RemovedSince(since, &per_shard[s]); });
  std::vector<std::pair<uint64_t, uint64_t>> records;
  for (const auto& r : per_shard) records.insert(records.end(), r.begin(), r.end());
  std::stable_sort(records.begin(), records.end(),
                   [](const auto& a, const auto& b) { return a.second < b.second; });
  return records;
}

void Engine::TrimRemoved(int table, uint64_t upto) {
  const GracePeriod::ReadScope scope(*grace_);
  TableDef* def = MutableDef(table);
  RunOnShards([&](int s) { def->shards[s]->TrimRemoved(upto); });
}

void Engine::LoadRemoved(int table, const uint64_t* keys, const uint64_t* versions, size_t n,
                         uint64_t floor) {
  for (size_t i = 1; i < n; ++i) {
    if (versions[i] < versions[i - 1])
      throw std::invalid_argument("removal records must be sorted by version");
  }
  const GracePeriod::ReadScope scope(*grace_);
  TableDef* def = MutableDef(table);
  const auto split = SplitByShard(keys, versions, n, num_shards_);
  RunOnShards([&](int s) {
    def->shards[s]->LoadRemoved(split.keys[s].data(), split.values[s].data(), split.keys[s].size(),
                                floor);
  });
}

std::vector<std::pair<uint64_t, uint32_t>> Engine::PendingCounts(int table) {
  const GracePeriod::ReadScope scope(*grace_);
  TableDef* def = Def(table);
  std::vector<std::vector<std::pair<uint64_t, uint32_t>>> per_shard(num_shards_);
  RunOnShards([&](int s) { def->shards[s]->PendingCounts(&per_shard[s]); });
  std::vector<std::pair<uint64_t, uint32_t>> counts;
  for (const auto& c : per_shard) counts.insert(counts.end(), c.begin(), c.end());
  std::sort(counts.begin(), counts.end());
  return counts;
}

void Engine::LoadPending(int table, const uint64_t* keys, const uint32_t* counts, size_t n) {
  const GracePeriod::ReadScope scope(*grace_);
  TableDef* def = MutableDef(table);
  const auto split = SplitByShard(keys, counts, n, num_shards_);
  RunOnShards([&](int s) {
    def->shards[s]->LoadPending(split.keys[s].data(), split.values[s].data(), split.keys[s].size());
  });
}

uint64_t Engine::Lookup(int table, const uint64_t* keys, size_t n, float* out, uint8_t* found,
                        bool init_missing) {
  const GracePeriod::ReadScope scope(*grace_);
  TableDef* def = Def(table);
  const uint64_t label = def->label;
  if (def->spec.serving && !def->layered()) {
    // Only a version switch writes a serving table's shards, and never
    // while a reader can hold its unlayered def (see CommitApply): read on
    // this thread, no hand-off to the owners.
    LookupInline(*def, keys, n, out, found, init_missing);
    return label;
  }
  Plan plan;
  PlanKeys(keys, n, &plan);
  RunOnShards(
      [&](int s) {
        def->shards[s]->Lookup(plan.For(s), out, found, init_missing,
                               def->layered() ? &def->overlays[s] : nullptr);
      },
      &plan);
  return label;
}

void Engine::LookupInline(const TableDef& def, const uint64_t* keys, size_t n, float* out,
                          uint8_t* found, bool init_missing) const {
  // Two prefetch stages: a key's index slot kSlotAhead keys before it is
  // read, then (the slot cached by then) its row's weights kRowAhead before.
  constexpr size_t kSlotAhead = 16;
  constexpr size_t kRowAhead = 8;
  thread_local std::vector<uint64_t> hashes;
  hashes.resize(n);
  for (size_t i = 0; i < n; ++i) hashes[i] = Mix64(keys[i]);
  const auto shards = static_cast<uint32_t>(num_shards_);
  const int dim = def.spec.dim;
  for (size_t i = 0; i < n; ++i) {
    if (i + kSlotAhead < n) {
      const uint64_t h = hashes[i + kSlotAhead];
      def.shards[ShardOfHash(h, shards)]->PrefetchSlot(h);
    }
    if (i + kRowAhead < n) {
      const uint64_t h = hashes[i + kRowAhead];
      def.shards[ShardOfHash(h, shards)]->PrefetchRow(keys[i + kRowAhead], h);
    }
    const uint64_t h = hashes[i];
    const bool hit =
        def.shards[ShardOfHash(h, shards)]->ReadRow(keys[i], h, out + i * dim, init_missing);
    if (found != nullptr) found[i] = hit ? 1 : 0;
  }
}

int Engine::BeginApply(const TableSpec& spec, int table, bool full, uint64_t label) {
  ValidateSpec(spec);
  auto staging = std::make_unique<details::Staging>();
  staging->table = table;
  staging->full = full;
  TableSpec own = spec;
  own.reserve_rows = 0;
  if (table >= 0) {
    const GracePeriod::ReadScope scope(*grace_);
    const TableDef* live = Def(table);
    if (live->spec.dim != spec.dim || StateDim(live->spec.optimizer.kind, live->spec.dim) !=
                                          StateDim(spec.optimizer.kind, spec.dim)) {
      throw std::invalid_argument("a version of table '" + live->spec.name +
                                  "' must keep its dim and optimizer state");
    }
    own = live->spec;  // the live table's settings (and its reserve, for a full version)
    if (!full) own.reserve_rows = 0;
  } else if (!full) {
    throw std::invalid_argument("table '" + spec.name +
                                "' does not exist: its first version must be full");
  }
  // A full version becomes the table: with a disk tier, its rows beyond the
  // budget go to disk as they are staged. A delta's overlay stays in RAM.
  staging->def = NewDef(own, num_shards_, full ? TierOf(own) : details::TierConfig{});
  staging->def->label = label;
  staging->removed.resize(num_shards_);
  std::lock_guard<std::mutex> lock(staging_mutex_);
  const int handle = next_staging_++;
  staging_.emplace_back(handle, std::move(staging));
  return handle;
}

details::Staging& Engine::StagingOf(int staging) {
  std::lock_guard<std::mutex> lock(staging_mutex_);
  for (auto& [handle, s] : staging_) {
    if (handle == staging) return *s;
  }
  throw std::invalid_argument("no staged version " + std::to_string(staging));
}

std::unique_ptr<details::Staging> Engine::TakeStaging(int staging) {
  std::lock_guard<std::mutex> lock(staging_mutex_);
  for (auto it = staging_.begin(); it != staging_.end(); ++it) {
    if (it->first == staging) {
      std::unique_ptr<details::Staging> taken = std::move(it->second);
      staging_.erase(it);
      return taken;
    }
  }
  throw std::invalid_argument("no staged version " + std::to_string(staging));
}

TableSpec Engine::StagedSpec(int staging) { return StagingOf(staging).def->spec; }

void Engine::StageRows(int staging, size_t n, const RowColumns& rows) {
  details::Staging& st = StagingOf(staging);
  if (n > 0 && (rows.keys == nullptr || rows.weights == nullptr)) {
    throw std::invalid_argument("a staged version of '" + st.def->spec.name +
                                "' needs keys and weights");
  }
  Plan plan;
  PlanKeys(rows.keys, n, &plan);
  const Clock clock = Now(step(), version(), this->clock());
  TableDef* def = st.def.get();
  RunOnShards([&](int s) { def->shards[s]->Load(plan.For(s), rows, clock); }, &plan);
}

void Engine::StageRemoved(int staging, const uint64_t* keys, size_t n) {
  details::Staging& st = StagingOf(staging);
  if (st.full) {
    throw std::invalid_argument("a full version of '" + st.def->spec.name + "' removes no keys");
  }
  for (size_t i = 0; i < n; ++i) st.removed[ShardOf(keys[i], num_shards_)].push_back(keys[i]);
}

void Engine::AbortApply(int staging) { TakeStaging(staging); }

int Engine::CommitApply(int staging) {
  std::unique_ptr<details::Staging> st = TakeStaging(staging);
  std::lock_guard<std::mutex> lock(create_mutex_);  // no create, drop or other commit meanwhile
  if (st->table < 0) {                              // a new table
    if (FindDef(st->def->spec.name) != nullptr) {
      throw std::invalid_argument("table '" + st->def->spec.name +
                                  "' was created while its version staged");
    }
    return Publish(std::move(st->def));
  }
  TableDef* live = Def(st->table);  // UnknownTableError if dropped meanwhile
  const int slot = live->id & (kMaxTables - 1);
  if (st->full) {
    std::unique_ptr<TableDef> next = std::move(st->def);
    next->id = live->id;
    TableDef* const now = next.get();
    if (!now->spec.serving) {  // as Publish: a training table demotes between calls
      for (TableShard* shard : now->shards) shard->SetDeferDemotion(true);
    }
    if (!live->spec.grow_base.empty() && live->shards[0]->grow_base() != nullptr) {
      for (int s = 0; s < num_shards_; ++s)
        now->shards[s]->SetGrowBase(live->shards[s]->grow_base());
    }
    tables_[slot].store(next.release(), std::memory_order_seq_cst);
    grace_->Wait();  // every call that found the old table has returned
    // Extension blocks of this table read the new shards from now on (set
    // on their workers: no call of theirs is reading the old ones then).
    std::vector<TableDef*> grown;
    for (int other = 0; other < num_slots_.load(std::memory_order_acquire); ++other) {
      TableDef* d = tables_[other].load(std::memory_order_acquire);
      if (d != nullptr && d != now && d->spec.grow_base == now->spec.name && !d->spec.serving) {
        grown.push_back(d);
      }
    }
    if (!grown.empty()) {
      RunOnShards([&](int s) {
        for (TableDef* d : grown) d->shards[s]->SetGrowBase(now->shards[s]);
      });
    }
    FreeTable(live);
    return st->table;
  }
  auto layered = std::make_unique<TableDef>();
  layered->spec = live->spec;
  layered->layout = live->layout;
  layered->id = live->id;
  layered->shards = live->shards;
  layered->owns_shards = false;
  layered->label = st->def->label;
  layered->overlays.resize(num_shards_);
  for (int s = 0; s < num_shards_; ++s) {
    std::vector<uint64_t>& removed = st->removed[s];
    std::sort(removed.begin(), removed.end());
    removed.erase(std::unique(removed.begin(), removed.end()), removed.end());
    layered->overlays[s].rows = st->def->shards[s];
    layered->overlays[s].removed = std::move(removed);
  }
  tables_[slot].store(layered.get(), std::memory_order_seq_cst);
  grace_->Wait();                // no call sees the live rows alone any more
  live->label = layered->label;  // unpublished: no reader holds it
  const Clock clock = Now(step(), version(), this->clock());
  RunOnShards([&](int s) { live->shards[s]->Merge(layered->overlays[s], clock); });
  tables_[slot].store(live, std::memory_order_seq_cst);
  grace_->Wait();    // no call sees the layered def any more
  return st->table;  // the overlay's rows go with st
}

}  // namespace wuliang::ps
