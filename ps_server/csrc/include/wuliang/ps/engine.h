// The embedding engine: tables of uint64 key -> [meta | weights | state] rows.
//
// Concurrency contract
// --------------------
// * An engine has S shards. Key k lives in shard ShardOf(k, S), and shard s's
//   data (hash map, memory pool, counters) is only ever touched by worker
//   thread s. Nothing on the pull/push path takes a mutex.
// * Every public method may be called from any number of threads at once.
//   A batch call splits its keys by shard, enqueues one task per shard on a
//   lock-free queue and waits on a latch; the calling thread does no table
//   work itself. Tasks of one shard run in the order they were enqueued.
// * Create/DropTable are serialised among themselves by a mutex (never taken
//   on the data path); tables are published in an array of atomic pointers.
// * Table ids are reused without ever naming two tables: an id is
//   (generation << kSlotBits) | slot. DropTable frees the slot, a later
//   CreateTable takes it with the next generation, and a call with the id of
//   a dropped table throws UnknownTableError, before the slot's reuse or
//   after it. No id is ever issued twice: a slot whose generations are spent
//   is retired (2^17 creates on one slot). At most kMaxTables tables live at
//   once; creates are not limited.
// * Dropped tables are freed, safely: every call that takes a table id, and
//   TableId/TableNames, runs inside a read scope of a grace period (one
//   atomic increment and one decrement on a counter of the calling thread's
//   own, no lock; details/grace_period.h). DropTable unpublishes the table,
//   waits until every call that could have found it has returned (those
//   complete on the live table), then frees its shards and definition; a call
//   that looks the id up after the unpublish throws UnknownTableError. So a
//   DropTable waits for the calls in flight on any table (a long Evict or
//   Load included), as it waited for the tasks queued before it.
// * Readers that are not the owner (stats, export) also run as tasks on the
//   owner thread, so each shard is seen at a single point in time.
//
// Versions and steps
// ------------------
// Every modification stamps the row with the engine's current `version`;
// AdvanceVersion() starts a new one. Export(since=v) yields the rows modified
// after v and RemovedLog(since=v) the keys erased or evicted after v. Each
// shard logs the keys it changes and removes per version (bounded: about
// twice its rows), so a delta costs what it contains, not the table size.
// Calls that stamp rows (PullMany, PushMany, Load, Evict's TTL) take the
// training step as an argument; kCurrentStep falls back to SetStep's value,
// for users of the engine alone. Rows also carry a time, unix seconds, from
// the engine's clock: the wall clock, or the time SetClock set (the data's
// time, for a trainer that follows time-partitioned data). TTLs in seconds
// count back from the same clock.
//
// Precision
// ---------
// Weights go in and out as float32 whatever the table's
// TableSpec::precision: Load and StageRows encode, Pull(train=false),
// Lookup and Export decode. On a compressed table (fp16, int8) the calls
// that train (Pull or PullMany with train, Push, PushMany) throw
// std::invalid_argument naming the table and its precision, before any
// part of the call runs.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "wuliang/ps/table_spec.h"

namespace wuliang::ps {

namespace details {
class IoPool;
struct ShardBudget;
struct TierConfig;
class ShardWorker;
class GracePeriod;
struct Staging;
struct TableDef;
struct Plan;
struct Clock;
}  // namespace details

// A table name or id that names no live table (never created, or dropped).
class UnknownTableError : public std::out_of_range {
 public:
  using std::out_of_range::out_of_range;
};

struct EngineOptions {
  int num_shards = 2;  // worker threads; shard count of every table
  // The disk tier (docs/disk_tier.md): with a directory, the rows of every
  // table beyond memory_bytes (all tables, split
  // evenly among the shards; 0: 1 GiB) live in row files there.
  std::string disk_dir;
  uint64_t memory_bytes = 0;
  int io_threads = 32;                           // disk reads in flight
  uint64_t row_file_bytes = uint64_t{64} << 20;  // the largest row file (small: tests)
};

// Column buffers of n rows, used by Export (written) and Load (read).
// Null pointers are skipped (Export) or take defaults (Load).
struct RowColumns {
  uint64_t* keys = nullptr;      // (n,)
  float* weights = nullptr;      // (n, dim)
  float* state = nullptr;        // (n, state_dim)
  uint32_t* counts = nullptr;    // (n,)
  uint64_t* steps = nullptr;     // (n,) last update step
  uint32_t* times = nullptr;     // (n,) last update time, unix seconds
  uint64_t* versions = nullptr;  // (n,) version of the last modification
  float* shows = nullptr;        // (n,) shows as of steps (not decayed further)
  float* clicks = nullptr;       // (n,) clicks as of steps
};

struct PushResult {
  uint64_t applied = 0;          // row updates applied
  uint64_t dropped_nan = 0;      // non-finite gradient rows dropped
  uint64_t dropped_pending = 0;  // keys not admitted yet: update dropped
  uint64_t duplicates = 0;       // keys repeated in the batch (summed)
};

struct EvictResult {
  uint64_t ttl = 0;        // rows older than the TTL
  uint64_t min_count = 0;  // rows seen fewer than min_count times
  uint64_t lfu = 0;        // rows over max_rows, least frequent first
  uint64_t shrunk = 0;     // an extension block's rows whose base row scores too little
  uint64_t total() const { return ttl + min_count + lfu + shrunk; }
};

// A snapshot of one table, summed over shards.
struct TableStats {
  uint64_t rows = 0;
  uint64_t row_bytes = 0;      // memory pool chunks
  uint64_t index_bytes = 0;    // hash map slots
  uint64_t pending_keys = 0;   // seen but not admitted yet
  uint64_t pending_bytes = 0;  // admission counters
  uint64_t removed_log = 0;    // removal records kept for delta export
  uint64_t change_log = 0;     // change records kept for delta export
  // The logs list every change with version > floor (max over shards):
  // a delta since an older version scans rows and cannot list removals.
  uint64_t removed_floor = 0;
  uint64_t change_floor = 0;
  uint64_t bytes() const { return row_bytes + index_bytes + pending_bytes; }
  // Counters since creation.
  uint64_t pulled_keys = 0;
  uint64_t pull_misses = 0;  // pulls answered with the initial vector
  uint64_t pushed_keys = 0;
  uint64_t inserted = 0;
  uint64_t admitted = 0;  // inserted after waiting for admission
  uint64_t dropped_pending = 0;
  uint64_t dropped_nan = 0;
  uint64_t pending_forgotten = 0;  // pending counts dropped to stay bounded
  uint64_t erased = 0;
  uint64_t evicted_ttl = 0;
  uint64_t evicted_min_count = 0;
  uint64_t evicted_lfu = 0;
  // An extension block (TableSpec::grow_base): keys promoted to it (rows
  // created) and demoted from it (rows removed by Evict).
  uint64_t grown = 0;
  uint64_t shrunk = 0;
  uint64_t rows_moved = 0;  // by memory compaction
  uint64_t chunks_released = 0;
  // The disk tier (zero without one): rows on disk only, RAM of their
  // locators, bytes of the row files, records read back into RAM, rows
  // demoted (and of those, written: the others were unchanged on disk),
  // row files compacted, and the last error of the disk ("" if none).
  uint64_t cold_rows = 0;
  uint64_t cold_index_bytes = 0;
  uint64_t disk_bytes = 0;
  uint64_t cold_reads = 0;       // by the calls that needed the rows
  uint64_t cold_prefetched = 0;  // by PrefetchMany, ahead of them
  uint64_t demoted = 0;
  uint64_t demoted_written = 0;
  uint64_t demoted_between_calls = 0;  // of demoted: by the worker between calls
  uint64_t files_compacted = 0;
  std::string disk_error;

  TableStats& operator+=(const TableStats& other);
};

// Position of a chunked export: shard, and slot (or position in `keys`)
// to resume from.
struct ExportCursor {
  int shard = 0;
  bool started = false;  // the current shard's export has begun
  uint64_t slot = 0;
  uint64_t generation = 0;  // of the shard's index when a scan started
  bool by_key = false;      // visiting the change log's keys, not scanning
  std::vector<uint64_t> keys;
  bool cold = false;       // the disk tier's records (after the index's rows)
  uint64_t cold_file = 0;  // row file, and record in it, to resume from
  uint64_t cold_slot = 0;
  bool done = false;
};

class Engine {
 public:
  explicit Engine(const EngineOptions& options = {});
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  int num_shards() const { return num_shards_; }
  // The OS thread id of each shard's worker (for scheduling policies, top).
  std::vector<int64_t> WorkerThreadIds();

  // Returns the table id (>= 0). Throws std::invalid_argument for a bad spec
  // or a name that is taken, std::length_error when kMaxTables tables live.
  int CreateTable(const TableSpec& spec);
  // Frees every row and the table's id (see the contract above: waits for
  // the calls in flight). Throws UnknownTableError for an unknown name.
  void DropTable(const std::string& name);
  // Throws UnknownTableError("unknown table 'x' (tables: a, b)").
  int TableId(const std::string& name) const;
  // Every method below that takes a table id throws UnknownTableError when
  // the id names no live table.
  TableSpec Spec(int table) const;
  int Dim(int table) const;
  std::vector<std::string> TableNames() const;

  // out[i] = weights of keys[i]. train=true counts the sighting and creates
  // (or admits) the row; train=false is a pure lookup. Absent keys read as
  // their initial vector. Keys already grouped by shard (the reader's key
  // preparation) may come with shard_offsets (S + 1 entries): no split is
  // needed then, and a key in the wrong group raises std::invalid_argument.
  void Pull(int table, const uint64_t* keys, size_t n,
            float* out,  // (n, dim)
            bool train, const int64_t* shard_offsets = nullptr);
  // Applies the table's optimizer. Duplicate keys have their gradients
  // summed first (skipped when keys_unique is promised). `updated`, when
  // given, receives each key's weights after the push (what a pull with
  // train=false would read next), saving that pull: key i's at row i
  // ((n, dim)), or with `updated_rows` at row updated_rows[i] (none where
  // -1; rows in range and distinct, checked by the caller). The trainer
  // writes this way the rows the next step shares straight into its input.
  PushResult Push(int table, const uint64_t* keys, size_t n,
                  const float* grads,  // (n, dim)
                  bool keys_unique = false, const int64_t* shard_offsets = nullptr,
                  float* updated = nullptr, const int32_t* updated_rows = nullptr);
  // One table's part of a multi-table call: the arguments of one Pull or
  // Push (out for a pull; grads, updated, updated_rows for a push).
  struct TablePart {
    int table = -1;
    const uint64_t* keys = nullptr;
    size_t n = 0;
    const int64_t* shard_offsets = nullptr;
    float* out = nullptr;
    const float* grads = nullptr;
    float* updated = nullptr;
    const int32_t* updated_rows = nullptr;
    // A push's show and click increments per key (null: none), added to the
    // rows' statistics after their decay to the push's step (TableSpec::
    // stats_half_life); repeated keys have theirs summed.
    const float* shows = nullptr;   // (n,)
    const float* clicks = nullptr;  // (n,)
    // Floats from one row of out / grads / updated to the next (0: the
    // table's dim): rows that are columns of a wider array (a sized table's
    // blocks side by side in one array of the widest dim).
    size_t out_stride = 0;
    size_t grads_stride = 0;
    size_t updated_stride = 0;
  };
  // Pull / Push for several tables in one round: each shard's worker does
  // its part of every table, one hand-off per shard instead of one per table
  // and shard. Same results as the calls one by one, in order.
  // `only` splits a push in two (keys_unique required): kUpdated applies the
  // keys with updated_rows[i] >= 0, kRest the others, so a trainer can hand
  // the next step its shared rows before the rest of the push is done.
  //
  // `step`: the training step of the batch (default: the engine's step()).
  // A trainer that pulls step s + 1 before pushing step s passes each call's
  // own step, and gets what running the steps one after the other gives:
  // rows created by a pull carry its step, and a push of step s leaves alone
  // the rows a pull of a later step admitted (AdmissionSpec): their keys had
  // no row yet at step s, so the update is dropped as pending.
  enum class Only { kAll, kUpdated, kRest };
  static constexpr uint64_t kCurrentStep = UINT64_MAX;
  void PullMany(const std::vector<TablePart>& parts, bool train, uint64_t step = kCurrentStep);
  // A cache's exchange with the engine, for several tables in one round
  // (each shard's worker does its part of every table): per table, first
  // `back` (the rows the cache gives back, whole) is loaded as Load does,
  // then `keys` are pulled for training into `out` as PullMany does
  // (sightings counted, rows created as admission allows), then the whole
  // rows of `in_keys` (the keys coming into the cache, a subset of `keys`)
  // are read as ReadRows does into `in_rows`, `in_found` saying which have
  // a row and `in_created` which had none before this call's pull (the rows
  // it admitted). Returns, per part, the rows read (moved up over the keys
  // without one, in order). The same rows and results as those calls one
  // by one. With `merge`, `back` holds changes added to the rows instead
  // (a trainer's since it fetched them: TableShard::MergeRows), fp32 only.
  struct ExchangePart {
    int table = -1;
    const uint64_t* keys = nullptr;  // the misses, as the batch has them
    size_t n = 0;
    const int64_t* shard_offsets = nullptr;
    float* out = nullptr;  // (n, dim)
    size_t n_back = 0;
    RowColumns back;     // keys and weights required when n_back > 0
    bool merge = false;  // back holds changes to add (TableShard::MergeRows), not rows
    const uint64_t* in_keys = nullptr;
    size_t n_in = 0;
    RowColumns in_rows;             // (n_in) rows, every column
    uint8_t* in_found = nullptr;    // (n_in,)
    uint8_t* in_created = nullptr;  // (n_in,)
  };
  std::vector<size_t> ExchangeMany(const std::vector<ExchangePart>& parts,
                                   uint64_t step = kCurrentStep);
  // The disk tier: reads the cold rows of the parts' keys into RAM now,
  // ahead of their pull, and keeps them there until that pull's push
  // (docs/disk_tier.md). Changes no row; returns the rows read (0 without
  // a disk tier).
  uint64_t PrefetchMany(const std::vector<TablePart>& parts);
  PushResult PushMany(const std::vector<TablePart>& parts, bool keys_unique = false,
                      Only only = Only::kAll, uint64_t step = kCurrentStep);
  // Removes rows; returns how many existed.
  uint64_t Erase(int table, const uint64_t* keys, size_t n, uint64_t step = kCurrentStep);
  // Writes 1 for keys that have a row, else 0.
  void Contains(int table, const uint64_t* keys, size_t n,
                uint8_t* out);  // (n,)
  // Whole rows of keys, every column as Export writes it (weights decoded
  // to float32 whatever the precision; the stored counts, steps, times,
  // versions, shows and clicks, not decayed): the rows of the keys that have
  // one go to out's rows [0, m) in the order of keys (a repeated key's row
  // as often as it is given), found[i] says whether keys[i] has one, and m
  // is returned. out holds n rows (null columns are skipped). Changes
  // nothing: no count, sighting, row, version or counter. Like Export, it
  // throws std::runtime_error while a version is being switched in.
  size_t ReadRows(int table, const uint64_t* keys, size_t n, const RowColumns& out,
                  uint8_t* found);  // (n,)
  // Applies the table's EvictionSpec now (all tables if table < 0); TTLs in
  // steps count back from `step`.
  EvictResult Evict(int table, uint64_t step = kCurrentStep);
  // Evict's phases, for one table spread over several engines (remote
  // servers), whose caller finds the table-wide cut the way Evict does:
  //   EvictByAge        the TTL and min-count criteria;
  //   CountHistogram    rows per update count (kHistogramBuckets buckets);
  //   StepsAtCount      the last-update step of every row at one count;
  //   EvictLeastFrequent  every row below count `threshold`, every row at it
  //                     updated before step `cutoff`, and `quota` of those
  //                     updated at `cutoff`; then compacts.
  EvictResult EvictByAge(int table, uint64_t step = kCurrentStep);
  std::vector<uint64_t> CountHistogram(int table);
  std::vector<uint64_t> StepsAtCount(int table, uint32_t count);
  EvictResult EvictLeastFrequent(int table, uint32_t threshold, uint64_t cutoff, uint64_t quota,
                                 uint64_t step = kCurrentStep);
  TableStats Stats(int table);

  // A pure lookup for serving: out[i] = weights of keys[i] and found[i] = 1,
  // or for a key without a row its initial vector (init_missing) or zeros
  // and found[i] = 0. Nothing is counted. found may be null. Returns the
  // label of the version the rows were read at (CommitApply's; 0 before
  // any): the rows and the label come from one snapshot of the table.
  // A serving table (TableSpec.serving) is read on the calling thread,
  // without a hand-off to the shard workers, by any number of threads.
  uint64_t Lookup(int table, const uint64_t* keys, size_t n,
                  float* out,      // (n, dim)
                  uint8_t* found,  // (n,)
                  bool init_missing);

  // Versions applied atomically for concurrent readers
  // -------------------------------------------------
  // A serving engine applies a new version (full or delta) of a table while
  // Lookup, Pull(train=false) and Contains run. They see the table wholly at
  // the old version or wholly at the new one:
  // 1. BeginApply stages, beside the live table (untouched, still writable):
  //    a full version into a new table, a delta into an overlay table plus
  //    its removed keys; StageRows / StageRemoved fill it (any number of
  //    calls, from the thread that began it).
  // 2. CommitApply switches over. Full: the new table is published in the
  //    live one's slot (same id), the old one freed after a grace period.
  //    Delta: a layered table that reads the overlay first (its removed keys
  //    as missing) and the live rows second is published; after a grace
  //    period no reader sees the live rows alone, so the overlay is merged
  //    into them on the owner threads (layered readers see the same values
  //    before and after), the live table is published again, and after a
  //    second grace period the overlay is freed. Calls that write or export
  //    the table while it is layered throw std::runtime_error naming it.
  // A delta costs memory in proportion to its rows; a full version holds
  // two copies of the table until its switch ends. AbortApply drops a
  // staging. Commits are serialised with CreateTable/DropTable.
  //
  // table: the live table's id, or -1 for a new table (created at commit,
  // full only). label: what Lookup reports once the version is in (a serving
  // process passes the export's version number). Returns a staging handle.
  int BeginApply(const TableSpec& spec, int table, bool full, uint64_t label = 0);
  // The spec a staging loads rows of (the live table's, for an existing one).
  TableSpec StagedSpec(int staging);
  // Rows with every column given (as Load; keys and weights required).
  void StageRows(int staging, size_t n, const RowColumns& rows);
  // Keys the delta removes.
  void StageRemoved(int staging, const uint64_t* keys, size_t n);
  // Returns the table's id.
  int CommitApply(int staging);
  void AbortApply(int staging);

  // Writes up to max_rows rows with version > since into `out` and advances
  // the cursor; returns the number written. A delta whose version the change
  // log still reaches visits the logged keys only; otherwise every row is
  // scanned, and a shard's index rehashed or losing rows during the scan
  // throws std::runtime_error (pause training while exporting).
  size_t Export(int table, uint64_t since, size_t max_rows, ExportCursor* cursor,
                const RowColumns& out);
  // (key, version) of the rows erased or evicted after version `since`,
  // oldest first (a key may reappear later as a row). Complete only when
  // since >= Stats().removed_floor.
  std::vector<std::pair<uint64_t, uint64_t>> RemovedLog(int table, uint64_t since);
  // Forgets removal records with version <= upto.
  void TrimRemoved(int table, uint64_t upto);
  // Restores removal records (a checkpoint's), sorted by version; the log is
  // incomplete up to `floor`.
  void LoadRemoved(int table, const uint64_t* keys, const uint64_t* versions, size_t n,
                   uint64_t floor);
  // (key, count) of the keys seen but not admitted yet (AdmissionSpec), in
  // key order.
  std::vector<std::pair<uint64_t, uint32_t>> PendingCounts(int table);
  // Sets the sighting counts of keys waiting for admission (a checkpoint's);
  // keys that have a row are skipped, a count of 0 forgets the key.
  void LoadPending(int table, const uint64_t* keys, const uint32_t* counts, size_t n);
  // Inserts or overwrites rows exactly. keys and weights are required; state
  // defaults to the optimizer's initial state, counts to 0, steps/times to
  // now and versions to the current version. `step`: the default of steps.
  void Load(int table, size_t n, const RowColumns& rows, uint64_t step = kCurrentStep);

  uint64_t step() const { return step_.load(std::memory_order_relaxed); }
  void SetStep(uint64_t step) { step_.store(step, std::memory_order_relaxed); }
  // The time (unix seconds) stamped on rows updated from now on, and that
  // TTLs in seconds count back from; 0: the wall clock (the default). A call
  // reads it once, when it starts.
  uint32_t clock() const { return clock_.load(std::memory_order_relaxed); }
  void SetClock(uint32_t seconds) { clock_.store(seconds, std::memory_order_relaxed); }
  uint64_t version() const { return version_.load(std::memory_order_acquire); }
  // Starts a new version and returns it.
  uint64_t AdvanceVersion() { return version_.fetch_add(1, std::memory_order_acq_rel) + 1; }
  // Raises the version to at least `version` (restoring a checkpoint), so
  // rows changed later carry versions above every restored row's.
  void RestoreVersion(uint64_t version) {
    uint64_t current = version_.load(std::memory_order_acquire);
    while (current < version &&
           !version_.compare_exchange_weak(current, version, std::memory_order_acq_rel)) {
    }
  }

 private:
  // An id is (generation << kSlotBits) | slot, a non-negative int.
  static constexpr int kSlotBits = 14;
  static constexpr int kMaxTables = 1 << kSlotBits;  // live at once
  static constexpr int kGenerations = 1 << (31 - kSlotBits);

  // The live table `table` names; throws UnknownTableError. The caller holds
  // a read scope of grace_ (or create_mutex_) while it uses the result.
  details::TableDef* Def(int table) const;
  // Def for a call that writes or exports: throws while a version is being
  // switched in (the table is layered).
  details::TableDef* WritableDef(int table) const;
  // Def for a call that changes rows: WritableDef, and not a serving table.
  details::TableDef* MutableDef(int table) const;
  // Lookup of a serving table on the calling thread.
  void LookupInline(const details::TableDef& def, const uint64_t* keys, size_t n, float* out,
                    uint8_t* found, bool init_missing) const;
  // Publishes a new table in a free slot (create_mutex_ held); its id.
  int Publish(std::unique_ptr<details::TableDef> def);
  std::unique_ptr<details::Staging> TakeStaging(int staging);
  details::Staging& StagingOf(int staging);
  // The live table called `name`, or null (same requirement).
  details::TableDef* FindDef(const std::string& name) const;
  std::vector<std::string> TableNamesInScope() const;
  // Splits keys by shard (counting sort); order lives in a thread-local buffer.
  void PlanBatch(const uint64_t* keys, size_t n, details::Plan* plan) const;
  // PlanBatch, then the split round the plan may need (SplitBlocks).
  void PlanKeys(const uint64_t* keys, size_t n, details::Plan* plan);
  // Each shard b splits block b of every plan's keys by shard, in parallel.
  void SplitBlocks(const std::vector<details::Plan*>& plans);
  void PlanPartitioned(const uint64_t* keys, size_t n, const int64_t* shard_offsets,
                       details::Plan* plan) const;
  // Runs fn(s) on worker s for every shard with keys in plan (every shard if
  // plan is null), waits, and rethrows the first error.
  void RunOnShards(const std::function<void(int)>& fn, const details::Plan* plan = nullptr);
  // urgent: ahead of the shards' queued calls (ShardWorker::EnqueueUrgent).
  void RunOn(const std::vector<int>& shards, const std::function<void(int)>& fn,
             bool urgent = false);
  // One plan per part; the shards that have keys in any of them.
  std::vector<int> PlanParts(const std::vector<TablePart>& parts,
                             std::vector<details::Plan>* plans);
  void CheckFinite(const details::TableDef& def, const TablePart& part) const;
  EvictResult EvictTable(details::TableDef* def, uint64_t step);
  // How many of `ties` rows updated at step `cutoff` each shard evicts.
  std::vector<uint64_t> SplitTies(const std::vector<std::vector<uint64_t>>& steps, uint64_t cutoff,
                                  uint64_t ties) const;
  // The clock of a data call: its own step, or kCurrentStep for step().
  details::Clock ClockAt(uint64_t step) const;
  void OpenDiskTier(const EngineOptions& options);
  details::TierConfig TierOf(const TableSpec& spec);

  int num_shards_;
  std::vector<std::unique_ptr<details::ShardWorker>> workers_;
  // Worker `shard`'s work between calls (the disk tier's demotions); more left?
  bool IdleWork(int shard);
  // The disk tier: its directory ("" none), reads in flight, each shard's
  // memory budget, and a counter naming the tables' row-file folders.
  std::string disk_dir_;
  std::unique_ptr<details::IoPool> io_;
  std::vector<std::unique_ptr<details::ShardBudget>> budgets_;
  std::atomic<uint64_t> tier_tables_{0};
  uint64_t row_file_bytes_ = 0;
  // Live tables by slot; they own their defs. Slots [0, num_slots_) were
  // ever used.
  std::array<std::atomic<details::TableDef*>, kMaxTables> tables_{};
  std::atomic<int> num_slots_{0};
  std::unique_ptr<details::GracePeriod> grace_;  // frees dropped defs
  mutable std::mutex create_mutex_;              // not on the data path
  // Versions being staged (BeginApply .. CommitApply / AbortApply).
  std::mutex staging_mutex_;
  std::vector<std::pair<int, std::unique_ptr<details::Staging>>> staging_;
  int next_staging_ = 0;
  // Under create_mutex_: slots free for reuse (last freed first) and the id
  // each slot issues next.
  std::vector<int> free_slots_;
  std::vector<int> next_id_;
  std::atomic<uint64_t> step_{0};
  std::atomic<uint32_t> clock_{0};  // 0: the wall clock
  std::atomic<uint64_t> version_{1};
};

}  // namespace wuliang::ps
