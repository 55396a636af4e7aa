// One table's rows on one shard: hash index + memory pool + admission
// counters + removal log. Owner thread only (see engine.h); nothing here is
// synchronised.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "details/change_log.h"
#include "details/cold_index.h"
#include "details/hash_map.h"
#include "details/memory_pool.h"
#include "details/pending_counter.h"
#include "details/row_file.h"
#include "details/row_layout.h"
#include "wuliang/ps/engine.h"
#include "wuliang/ps/table_spec.h"

namespace wuliang::ps::details {

// The keys of a batch that belong to one shard: positions order[begin, end)
// of keys (or begin..end themselves when order is null).
struct Slice {
  const uint64_t* keys;
  const uint32_t* order;
  size_t begin;
  size_t end;

  size_t size() const { return end - begin; }
  size_t pos(size_t k) const { return order != nullptr ? order[begin + k] : begin + k; }
  uint64_t key(size_t k) const { return keys[pos(k)]; }
};

// A batch as the engine hands it to one shard. Either the caller split the
// keys (order grouped by shard, this shard owns order[begin, end); order null
// means keys[begin, end)), or `filter` asks the shard to scan all n keys and
// keep its own, which parallelises the split when shards <= cores, or the
// shards split blocks of the batch in a round before (`split`: this shard's
// keys of block b are order[split[b * (S + 1) + shard], ... + shard + 1)).
struct ShardBatch {
  const uint64_t* keys;
  size_t n;
  const uint32_t* order;
  size_t begin;
  size_t end;
  bool filter;
  bool check_shard;  // verify every key of [begin, end) belongs to this shard
  uint32_t shard;
  uint32_t num_shards;
  const size_t* split = nullptr;
};

// When a batch happens.
struct Clock {
  uint64_t step;
  uint32_t now;  // unix seconds
  uint64_t version;
  bool step_given = false;  // the caller's batch step, not the engine's
};

class TableShard;

// What a version being applied holds for one shard (Engine::CommitApply):
// its rows (a shard of the staging table) and the keys it removes. While it
// is published, lookups read it before the shard's own rows; Merge then
// folds it into them.
struct Overlay {
  TableShard* rows = nullptr;
  std::vector<uint64_t> removed;  // sorted, unique
  bool Removes(uint64_t key) const {
    return std::binary_search(removed.begin(), removed.end(), key);
  }
};

// One shard's memory budget for the rows of its disk-tiered tables
// (docs/disk_tier.md); `used` changes on the shard's worker, and when a
// table is freed.
struct ShardBudget {
  uint64_t limit = 0;
  std::atomic<int64_t> used{0};
};

// A table's disk tier: where its shards keep their row files, their reads
// in flight and each shard's budget (none when tier_dir is empty).
struct TierConfig {
  std::string dir;  // <disk_dir>/<n>-<table>; shard s under <dir>/<s>
  IoPool* io = nullptr;
  std::vector<ShardBudget*> budgets;
  uint64_t file_bytes = uint64_t{64} << 20;
};

// Test-only crash points of the disk tier (WULIANG_TEST_CRASH_AT=<point>[:n],
// as wuliang.ps_server.storage.crash): the n-th time a tier reaches the
// point it prints "WULIANG_TEST_CRASH_AT reached <point>:<n>" and blocks
// for the test to SIGKILL it. ArmTierCrash reads the variable (an engine
// with a disk tier, when it starts).
void ArmTierCrash();
void TierCrashPoint(const char* point);

struct TableDef {
  TableSpec spec;
  RowLayout layout;
  TierConfig tier;
  int id = -1;
  std::vector<TableShard*> shards;  // (S,) built at creation, freed with the def
  // A layered def (a delta being switched in): reads overlays[s] before
  // shards[s], which the live def owns (owns_shards false).
  std::vector<Overlay> overlays;
  bool owns_shards = true;
  uint64_t label = 0;  // the version applied last (Engine::CommitApply), for Lookup
  bool layered() const { return !overlays.empty(); }
};

// Rows with count == kHistogramBuckets - 1 stand for all larger counts.
constexpr size_t kHistogramBuckets = 1 << 16;

// Aligned to (and padded to whole) 128-byte blocks: the shards of a table
// may be allocated one after the other by one thread (CreateTable), and two
// workers writing their shard's fields must not share a cache line, nor a
// pair of lines that the adjacent-line prefetcher moves together.
class alignas(128) TableShard {
 public:
  // reserve_rows: this shard's part of the table's reserve_rows; shard:
  // which one this is (its disk tier's folder and budget).
  TableShard(const TableDef& def, size_t reserve_rows, int shard = 0);
  ~TableShard();
  TableShard(const TableShard&) = delete;
  TableShard& operator=(const TableShard&) = delete;

  // Rows are read as float32 whatever the precision. Training (train,
  // Push, rows created with initial weights) needs Precision::kFp32: the
  // engine refuses it on compressed tables first; here it throws too.
  // out_stride: floats from one row of out to the next (0: dim).
  void Pull(const ShardBatch& batch, float* out, bool train, const Clock& clock,
            size_t out_stride = 0);
  // A hot cache's misses in one pass: a training Pull of the batch into
  // out, and for the keys coming into the cache (in_of[pos] >= 0: their
  // index in in_rows), their whole row as ReadRows writes it at their last
  // occurrence (in_last[pos]), in_found, and in_created = the pass created
  // their row (they had none before it).
  void PullWhole(const ShardBatch& batch, float* out, const int32_t* in_of, const uint8_t* in_last,
                 const RowColumns& in_rows, uint8_t* in_found, uint8_t* in_created,
                 const Clock& clock);
  // The disk tier, ahead of a pull, in three steps so that the worker is
  // free while the disk works (Engine::PrefetchMany): PlanPrefetch (owner)
  // finds the batch's keys on disk only and where their records are;
  // anyone reads them (PrefetchReads::Read); FinishPrefetch (owner)
  // installs those whose records are still current, keeps the batch's rows
  // in RAM until two more training pulls, and returns the rows installed.
  struct PrefetchReads {
    std::vector<uint64_t> keys;
    std::vector<uint32_t> locs;
    std::vector<RowFile::Place> places;  // of the records read away
    std::vector<uint32_t> away;          // positions in keys of those
    std::vector<char> records;           // keys.size() records
    const RowFile* file = nullptr;
    size_t record_bytes = 0;
    void Read(size_t i) { file->ReadDetached(places[i], records.data() + away[i] * record_bytes); }
    RecordRead ReadOf(size_t i) {
      return file->ReadOf(places[i], records.data() + away[i] * record_bytes);
    }
  };
  void PlanPrefetch(const ShardBatch& batch, PrefetchReads* reads);
  uint64_t FinishPrefetch(PrefetchReads* reads);
  // updated (optional): each key's weights after the push, at row pos, or
  // at row updated_rows[pos] when given (none where -1). only (Engine::Only):
  // 0 all keys, 1 those with updated_rows[pos] >= 0, 2 the others.
  // shows, clicks (optional, at pos): increments of the rows' statistics.
  void Push(const ShardBatch& batch, const float* grads, bool unique, const Clock& clock,
            PushResult* result, float* updated = nullptr, const int32_t* updated_rows = nullptr,
            int only = 0, const float* shows = nullptr, const float* clicks = nullptr,
            size_t grads_stride = 0, size_t updated_stride = 0);
  uint64_t Erase(const ShardBatch& batch, const Clock& clock);
  // With an overlay, as Lookup's found.
  void Contains(const ShardBatch& batch, uint8_t* out, const Overlay* overlay = nullptr);
  // Every column of the rows of the batch's keys, as Export writes them
  // (raw stored values, weights decoded to float32), at each key's position
  // in out, and found[pos] = 1; a key without a row gets found[pos] = 0 and
  // nothing written. Changes nothing: no count, sighting, row or counter.
  void ReadRows(const ShardBatch& batch, const RowColumns& out, uint8_t* found);
  // A pure lookup, no counter touched: a key's weights and found = 1, or for
  // a key without a row its initial vector (init_missing) or zeros and
  // found = 0. With an overlay, its rows come first and its removed keys
  // read as missing. found may be null.
  void Lookup(const ShardBatch& batch,
              float* out,      // (n, dim)
              uint8_t* found,  // (n,)
              bool init_missing, const Overlay* overlay);
  // One key of a lookup from any thread (a serving table, whose rows no
  // other thread changes meanwhile): its weights into dst, true; or its
  // initial vector (init_missing) or zeros, false.
  bool ReadRow(uint64_t key, uint64_t hash, float* dst, bool init_missing) const;
  void PrefetchSlot(uint64_t hash) const { index_.Prefetch(hash); }
  // Prefetches the weights of key's row, found through its index slot (best
  // prefetched some keys before): a lookup's second prefetch stage.
  void PrefetchRow(uint64_t key, uint64_t hash) const {
    char* const* row = index_.Find(key, hash);
    if (row == nullptr) return;
    for (size_t line = 0; line < layout_.hot_bytes && line < 512; line += 64)
      __builtin_prefetch(*row + line);
  }
  // Folds an overlay in: its rows replace or join this shard's (every
  // column), then its removed keys go (logged with clock's version).
  void Merge(const Overlay& overlay, const Clock& clock);
  void Load(const ShardBatch& batch, const RowColumns& rows, const Clock& clock);
  // Adds each key's change to its row (Geo-SGD: a trainer's change since
  // it fetched the row): weights and optimizer state added, counts added
  // (saturating), shows and clicks added after the row's decay to the
  // change's step, step and time the later of the two; the row is stamped
  // with clock's version. A key without a row gets a new one first.
  void MergeRows(const ShardBatch& batch, const RowColumns& changes, const Clock& clock);

  // Eviction: TTL and min-count first, then the engine-wide LFU cut: rows
  // with count below `threshold`, rows with count == threshold updated before
  // step `cutoff`, and `quota` of those updated at `cutoff`. Counts are
  // bucketed by min(count, kHistogramBuckets - 1). Compact() then gives
  // memory back.
  void EvictByAge(const Clock& clock, EvictResult* result);
  void CountHistogram(std::vector<uint64_t>* histogram) const;  // += counts
  void StepsAtCount(uint32_t bucket, std::vector<uint64_t>* steps) const;
  void EvictLeastFrequent(uint32_t threshold, uint64_t cutoff, uint64_t quota, const Clock& clock,
                          EvictResult* result);
  void Compact();

  // Chunked export of the rows with version > since. BeginExport picks the
  // way: the change log's keys when it covers `since` (cost follows the rows
  // changed), else a scan of the index (raises in Export if the index is
  // rehashed or loses rows meanwhile). Export returns rows written from
  // `offset` on and sets *done at the shard's end.
  void BeginExport(uint64_t since, ExportCursor* cursor) const;
  size_t Export(uint64_t since, size_t max_rows, ExportCursor* cursor, const RowColumns& out,
                size_t offset, bool* done) const;
  uint64_t generation() const { return index_.generation(); }
  // Removal records (key, version) with version > since, oldest first.
  void RemovedSince(uint64_t since, std::vector<std::pair<uint64_t, uint64_t>>* records) const;
  void TrimRemoved(uint64_t upto) { removed_.Forget(upto); }
  // Appends removal records (sorted by version), incomplete up to `floor`.
  void LoadRemoved(const uint64_t* keys, const uint64_t* versions, size_t n, uint64_t floor);
  // Sighting counts of keys waiting for admission; LoadPending sets them.
  void PendingCounts(std::vector<std::pair<uint64_t, uint32_t>>* out) const {
    pending_.Counts(out);
  }
  void LoadPending(const uint64_t* keys, const uint32_t* counts, size_t n);

  // An extension block (TableSpec::grow_base): the base table's shard of
  // the same index (same worker), set by the engine after creation.
  void SetGrowBase(const TableShard* base) { grow_base_ = base; }
  const TableShard* grow_base() const { return grow_base_; }

  TableStats Snapshot() const;
  size_t rows() const { return index_.size() + ColdOnlyRows(); }

  // The disk tier's demotion off the calls (docs/disk_tier.md): once a
  // published table's shard is allowed to (SetDeferDemotion), a call that
  // leaves it over its budget only notes the rows to demote, and the
  // worker demotes them between calls, a piece at a time (IdleWork, on the
  // owner thread, returns whether more remains); a shard far over budget
  // still demotes inside the call.
  void SetDeferDemotion(bool defer) { defer_demotion_ = defer && tier_ != nullptr; }
  bool IdleWork();

 private:
  // Writes every column of one row (key, its hot part `row`) at index o of
  // out (null columns skipped): what Export and ReadRows give of a row.
  void WriteRow(uint64_t key, char* row, const RowColumns& out, size_t o) const {
    WriteParts(key, row, pool_.Cold(row), out, o);
  }
  void WriteParts(uint64_t key, const char* hot, const char* cold, const RowColumns& out,
                  size_t o) const;

  // -- the disk tier (docs/disk_tier.md); all no-ops without one --
  struct Tier {
    ColdIndex cold;                 // keys with a record on disk
    std::unique_ptr<RowFile> file;  // the records
    ShardBudget* budget = nullptr;
    int64_t accounted = 0;      // bytes of rows this shard counts in budget->used
    uint64_t both = 0;          // keys in the index and in cold
    size_t demote_cursor = 0;   // where the next demotion's sample starts
    int64_t compact_file = -1;  // the file being compacted, and its next record
    uint32_t compact_slot = 0;
    uint64_t reads = 0, demoted = 0, demoted_written = 0;
    std::atomic<uint64_t> lookup_reads{0};  // a serving table's, on the callers' threads
    std::string error;                      // the disk's last refusal
    std::vector<char> scratch;              // records in and out
    OpenHashMap<uint32_t> candidates;       // Demote's: key -> position + 1, emptied after
    std::vector<uint32_t> locs;
    std::vector<uint32_t> wanted;  // slice positions of the keys read
    // The keys of the last two training pulls: their pushes will need the
    // rows, so they are not demoted meanwhile.
    std::vector<uint64_t> pinned[2];
    int pin_turn = 0;
    std::vector<uint64_t> prefetched[2];  // the keys of the last two Prefetches, kept too
    int prefetch_turn = 0;
    uint64_t prefetched_reads = 0;
    bool demote_due = false;    // over budget: demote between calls
    uint64_t demote_step = 0;   // the step their shows decay to
    uint64_t demoted_idle = 0;  // rows demoted between calls
  };
  size_t RowBytes() const { return layout_.hot_stride + layout_.cold_stride; }
  size_t RecordBytes() const {
    return sizeof(uint64_t) + layout_.hot_bytes + sizeof(RowMeta) +
           sizeof(float) * static_cast<size_t>(layout_.state_dim);
  }
  uint64_t ColdOnlyRows() const { return tier_ ? tier_->cold.size() - tier_->both : 0; }
  bool HasCold(uint64_t key, uint64_t hash) const {
    return tier_ && tier_->cold.Find(key, hash) != ColdIndex::kEmpty;
  }
  // The slice's keys that are on disk only become rows in RAM (backed).
  // Returns the rows read.
  size_t Promote(const Slice& s);
  // A record read back: a row in RAM, identical to it (backed).
  void Install(uint64_t key, uint64_t hash, const char* record);
  // After a call: the budget learns this shard's rows; over budget, the
  // least shown rows go to disk, and a row file is compacted a little.
  void AfterCall(uint64_t step);
  // The budget learns this shard's rows of the table; returns its use now.
  int64_t SyncBudget();
  void Demote(size_t rows, uint64_t step);
  void CompactSome(size_t records);
  // fn(key, const RowMeta*) for every row: those in RAM, then those on disk
  // only (the row files read in order).
  template <class Fn>
  void ForEachMeta(Fn&& fn) const;
  std::unique_ptr<Tier> tier_;
  // A record's parts (key | hot | meta and state), copied where they are
  // aligned.
  class RecordParts {
   public:
    explicit RecordParts(const TableShard& t)
        : hot_bytes_(t.layout_.hot_bytes),
          cold_bytes_(sizeof(RowMeta) + sizeof(float) * static_cast<size_t>(t.layout_.state_dim)),
          hot_((hot_bytes_ + 7) / 8),
          cold_((cold_bytes_ + 7) / 8) {}
    void From(const char* record) {
      std::memcpy(hot_.data(), record + sizeof(uint64_t), hot_bytes_);
      std::memcpy(cold_.data(), record + sizeof(uint64_t) + hot_bytes_, cold_bytes_);
    }
    const char* hot() const { return reinterpret_cast<const char*>(hot_.data()); }
    const char* cold() const { return reinterpret_cast<const char*>(cold_.data()); }
    const RowMeta* meta() const { return reinterpret_cast<const RowMeta*>(cold_.data()); }

   private:
    size_t hot_bytes_, cold_bytes_;
    std::vector<uint64_t> hot_, cold_;
  };
  // Throws std::invalid_argument unless the table stores float32 weights.
  void RequireFp32(const char* what) const;
  // int8 tables serve only; fp32 and fp16 ones train (fp16: stochastic rounding).
  void RequireTrainable(const char* what) const;
  char* CreateRow(uint64_t key, uint64_t hash, const Clock& clock, uint32_t count,
                  bool blank = false);
  // Records a change in the change log, keeping the log bounded.
  void LogChange(uint64_t key, uint64_t version);
  void BoundLog(ChangeLog* log) const;
  char* Admit(uint64_t key, uint64_t hash, const Clock& clock);
  // An extension block's admission: a row while the key's base row scores
  // at least grow_promote (null otherwise).
  char* Grow(uint64_t key, uint64_t hash, const Clock& clock);
  // The key's row's score at `step` (decayed shows + click_weight * decayed
  // clicks; a row on disk only: its record's), kNoRow without a row.
  static constexpr double kNoRow = -1.0;
  double ScoreAt(uint64_t key, uint64_t hash, uint64_t step, double click_weight) const;
  // Removes the key's row from RAM and disk; false if it had none.
  bool RemoveRow(uint64_t key, uint64_t hash, const Clock& clock);
  // This shard's keys of the batch; fills hashes_ (and order_ if filtering).
  Slice Select(const ShardBatch& batch);
  // kBlank: a row for Load to fill (no initializer, not logged).
  enum class Create { kNever, kAdmit, kAlways, kBlank };
  // A training pull admits keys; an extension block's grow at pushes only
  // (after the same call's base part fed the score: the same rows for the
  // same steps whatever the pipeline's timing).
  Create TrainingPullCreate() const {
    return spec_.grow_base.empty() ? Create::kAdmit : Create::kNever;
  }
  // Key k of the slice has no row: create it as `create` says, or null.
  [[gnu::noinline]] char* ResolveMissing(const Slice& s, size_t k, Create create,
                                         const Clock& clock);
  // kCold: the visit also touches the cold part (prefetched too). Rows it
  // creates get their initial weights in batches (see FlushInit), always
  // before their visit.
  // on_create(k): key k's row was created by this pass (before its visit).
  template <bool kCold, class Visit, class OnCreate = void (*)(size_t)>
  void Pipeline(
      const Slice& s, Create create, const Clock& clock, Visit&& visit,
      OnCreate&& on_create = [](size_t) {});
  // Initializes the weights of the rows created since the last flush.
  void FlushInit();
  // Finds repeated keys; returns per-key group (-1 plain, -2 repeat, >= 0
  // index of the summed gradient in sums_, and of the summed show and
  // click increments in stat_sums_ (2 per group) when shows or clicks are
  // given), empty when there are none.
  const std::vector<int32_t>& GroupDuplicates(const Slice& s, const float* grads,
                                              size_t grads_stride, uint64_t* duplicates,
                                              const float* shows = nullptr,
                                              const float* clicks = nullptr);

  const TableSpec& spec_;
  const RowLayout& layout_;
  const TableShard* grow_base_ = nullptr;
  bool defer_demotion_ = false;
  OpenHashMap<char*> index_;
  MemoryPool pool_;
  PendingCounter pending_;
  ChangeLog changes_;  // keys of modified rows, for delta export
  ChangeLog removed_;  // keys erased or evicted, for delta export
  uint64_t prev_evict_step_ = 0;
  TableStats counters_;  // only the counter fields are used

  // Per-batch scratch, reused.
  std::vector<uint64_t> hashes_;  // Mix64 of the slice's keys, by k
  std::vector<uint32_t> order_;   // positions kept by a filtering Select
  std::vector<uint32_t> only_;    // positions kept by a push's `only`
  std::vector<uint32_t> dedup_;
  std::vector<int32_t> groups_;
  std::vector<float> sums_;
  std::vector<float> scratch_;    // a row's float32 weights (fp16 tables' updates, creation)
  std::vector<float> stat_sums_;  // (groups, 2) shows, clicks
  // New rows waiting for their initial weights (only inside Pipeline).
  static constexpr size_t kInitBatch = 8;
  bool defer_init_ = false;
  size_t num_pending_init_ = 0;
  uint64_t pending_keys_[kInitBatch];
  float* pending_weights_[kInitBatch];
};

}  // namespace wuliang::ps::details
