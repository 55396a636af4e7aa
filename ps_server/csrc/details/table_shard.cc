#include "details/table_shard.h"

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>

#include "details/initializer.h"
#include "details/optimizers.h"
#include "details/precision.h"
#include "wuliang/ps/hash.h"

namespace wuliang::ps::details {
namespace {

#ifndef WL_SLOTS_AHEAD
#define WL_SLOTS_AHEAD 32
#define WL_ROWS_AHEAD 16
#endif
constexpr size_t kSlotsAhead = WL_SLOTS_AHEAD;  // prefetch distance of index probes
constexpr size_t kRowsAhead = WL_ROWS_AHEAD;    // prefetch distance of row reads
constexpr size_t kAheadOfVisit = 8;             // of a push's scattered inputs and outputs
// From this many shards on, a shard's keys are far enough apart in the batch
// that its rows of the caller's arrays (a pull's output, a push's gradients)
// are prefetched ahead; with fewer, the hardware prefetcher follows them and
// the prefetches cost CPU (pull +7%, Zipf pull +9% at 2 shards).
constexpr uint32_t kScatteredShards = 4;
constexpr size_t kMinLog = 1 << 13;  // change/removal log entries always kept
constexpr size_t kScanBlock = 16;    // slots an export scan visits in a row

// The slot an export scan visits p-th: blocks of kScanBlock slots in a
// pseudo-random order (a bijection on the block numbers). Rows exported in
// plain slot order and loaded into a smaller index (a restore: the index
// grows as they come) would all land in one end of it and form one long
// probe run, which makes the load quadratic; in this order they spread.
inline size_t ScanSlot(size_t p, size_t capacity) {
  if (capacity <= kScanBlock) return p;
  const uint64_t blocks = capacity / kScanBlock;  // a power of two
  const uint64_t mask = blocks - 1;
  const int shift = (std::countr_zero(blocks) + 1) / 2;
  uint64_t b = p / kScanBlock;
  b = (b * 0x9E3779B97F4A7C15ULL) & mask;  // odd multipliers and xor-shifts:
  b ^= b >> shift;                         // each step is a bijection
  b = (b * 0xBF58476D1CE4E5B9ULL) & mask;
  b ^= b >> shift;
  return b * kScanBlock + p % kScanBlock;
}

// Copies n floats. Whole 64-byte blocks are fixed-size moves (inlined); a
// plain loop would be turned into a libc memmove call per row.
inline void CopyFloats(float* __restrict dst, const float* __restrict src, int n) {
  int j = 0;
  for (; j + 16 <= n; j += 16) std::memcpy(dst + j, src + j, 64);
  for (; j + 4 <= n; j += 4) std::memcpy(dst + j, src + j, 16);
  for (; j < n; ++j) dst[j] = src[j];
}

// Prefetches each cache line of [p, p + bytes) once, to read or to write.
// Always inlined: GCC deems an outlined function made of prefetches pure and
// deletes the calls.
template <bool kWrite>
[[gnu::always_inline]] inline void PrefetchBytes(const char* p, size_t bytes) {
  const auto first = reinterpret_cast<uintptr_t>(p) & ~uintptr_t{63};
  const auto last = reinterpret_cast<uintptr_t>(p + bytes - 1) & ~uintptr_t{63};
  for (uintptr_t line = first; line <= last; line += 64) {
    __builtin_prefetch(reinterpret_cast<const void*>(line), kWrite);
  }
}

// A row's weights as float32: dst (dim,) from the hot part. Always inlined
// into the per-precision instances of a lookup's visit; fp32 is the plain
// copy it always was.
template <Precision kPrecision>
[[gnu::always_inline]] inline void ReadWeights(const char* hot, int dim, float* dst) {
  if constexpr (kPrecision == Precision::kFp32) {
    CopyFloats(dst, reinterpret_cast<const float*>(hot), dim);
  } else if constexpr (kPrecision == Precision::kFp16) {
    DecodeHalf(reinterpret_cast<const uint16_t*>(hot), dim, dst);
  } else {
    DecodeInt8(hot, dim, dst);
  }
}

// fn(std::integral_constant<Precision, p>) for the table's precision p: a
// loop over rows is compiled once per precision, no branch per row.
template <class Fn>
void WithPrecision(Precision precision, Fn&& fn) {
  switch (precision) {
    case Precision::kFp32:
      return fn(std::integral_constant<Precision, Precision::kFp32>{});
    case Precision::kFp16:
      return fn(std::integral_constant<Precision, Precision::kFp16>{});
    case Precision::kInt8:
      return fn(std::integral_constant<Precision, Precision::kInt8>{});
  }
}

}  // namespace

TableShard::TableShard(const TableDef& def, size_t reserve_rows, int shard)
    : spec_(def.spec),
      layout_(def.layout),
      pool_(def.layout.hot_stride, def.layout.cold_stride),
      pending_(def.spec.admission.pending_capacity) {
  if (!def.tier.dir.empty()) {
    tier_ = std::make_unique<Tier>();
    tier_->file = std::make_unique<RowFile>(def.tier.dir + "/" + std::to_string(shard),
                                            RecordBytes(), def.tier.io, def.tier.file_bytes);
    tier_->budget = def.tier.budgets[static_cast<size_t>(shard)];
  }
  if (reserve_rows > 0) {
    // With a disk tier, RAM holds at most the budget's rows: reserving (and
    // keeping) more would hold memory the budget gave to the disk.
    const size_t in_ram =
        tier_ ? std::min<size_t>(reserve_rows, tier_->budget->limit / RowBytes()) : reserve_rows;
    pool_.Reserve(in_ram);
    index_.Reserve(in_ram);
    changes_.Reserve(2 * (reserve_rows + kMinLog));  // its bound (BoundLog)
  }
}

TableShard::~TableShard() {
  if (tier_ && tier_->budget != nullptr) tier_->budget->used -= tier_->accounted;
}

Slice TableShard::Select(const ShardBatch& b) {
  if (b.split != nullptr) {
    size_t m = 0;
    for (uint32_t block = 0; block < b.num_shards; ++block) {
      const size_t* offsets = b.split + size_t{b.num_shards + 1} * block;
      m += offsets[b.shard + 1] - offsets[b.shard];
    }
    order_.resize(m);
    hashes_.resize(m);
    size_t k = 0;
    for (uint32_t block = 0; block < b.num_shards; ++block) {
      const size_t* offsets = b.split + size_t{b.num_shards + 1} * block;
      for (size_t i = offsets[b.shard]; i < offsets[b.shard + 1]; ++i, ++k) {
        order_[k] = b.order[i];
        hashes_[k] = Mix64(b.keys[order_[k]]);
      }
    }
    return Slice{b.keys, order_.data(), 0, m};
  }
  if (!b.filter) {
    const Slice s{b.keys, b.order, b.begin, b.end};
    hashes_.resize(s.size());
    for (size_t k = 0; k < s.size(); ++k) hashes_[k] = Mix64(s.key(k));
    if (b.check_shard) {
      for (size_t k = 0; k < s.size(); ++k) {
        const uint32_t owner = ShardOfHash(hashes_[k], b.num_shards);
        if (owner != b.shard) {
          throw std::invalid_argument("key " + std::to_string(s.key(k)) + " at position " +
                                      std::to_string(s.pos(k)) + " belongs to shard " +
                                      std::to_string(owner) + ", not " + std::to_string(b.shard) +
                                      ": keys are not grouped as shard_offsets say");
        }
      }
    }
    return s;
  }
  hashes_.resize(b.n);
  order_.resize(b.n);
  size_t m = 0;
  for (size_t i = 0; i < b.n; ++i) {
    const uint64_t h = Mix64(b.keys[i]);
    hashes_[m] = h;
    order_[m] = static_cast<uint32_t>(i);
    m += ShardOfHash(h, b.num_shards) == b.shard;
  }
  hashes_.resize(m);
  return Slice{b.keys, order_.data(), 0, m};
}

char* TableShard::CreateRow(uint64_t key, uint64_t hash, const Clock& clock, uint32_t count,
                            bool blank) {
  if (!blank) RequireTrainable("a new row's initial weights");
  char* row = pool_.Allocate();
  char* cold = pool_.Cold(row);
  RowMeta* meta = RowLayout::Meta(cold);
  meta->update_step = clock.step;
  meta->version = blank ? 0 : clock.version;
  meta->update_time = clock.now;
  meta->count = count;
  meta->shows = 0.0f;
  meta->clicks = 0.0f;
  if (!blank) InitState(spec_.optimizer, layout_.dim, RowLayout::State(cold));
  try {
    *index_.InsertNew(key, hash) = row;
  } catch (...) {
    pool_.Free(row);
    throw;
  }
  if (HasCold(key, hash)) ++tier_->both;  // its record on disk is now stale
  ++counters_.inserted;
  if (blank) return row;
  if (layout_.precision != Precision::kFp32) {  // encoded now, rounded to nearest
    scratch_.resize(layout_.dim);
    InitializeWeights(spec_.initializer, spec_.seed, key, layout_.dim, scratch_.data());
    EncodeRow(layout_.precision, scratch_.data(), layout_.dim, row);
  } else if (defer_init_) {  // weights in the next FlushInit
    pending_keys_[num_pending_init_] = key;
    pending_weights_[num_pending_init_++] = RowLayout::Weights(row);
    if (num_pending_init_ == kInitBatch) FlushInit();
  } else {
    InitializeWeights(spec_.initializer, spec_.seed, key, layout_.dim, RowLayout::Weights(row));
  }
  LogChange(key, clock.version);
  return row;
}

// Logs stay within about twice the live rows (+ a floor for small tables):
// past that the oldest versions are dropped, and delta exports reaching back
// to them scan the index instead.
void TableShard::LogChange(uint64_t key, uint64_t version) {
  changes_.Record(key, version);
  BoundLog(&changes_);
}

void TableShard::BoundLog(ChangeLog* log) const {
  const size_t keep = index_.size() + kMinLog;
  if (log->size() > 2 * keep) log->DropOldest(keep);
}

// A new row's count is the sightings before this one; the push of this
// batch adds the current one.
double TableShard::ScoreAt(uint64_t key, uint64_t hash, uint64_t step, double click_weight) const {
  char* const* row = index_.Find(key, hash);
  RowMeta on_disk;
  const RowMeta* m = nullptr;
  if (row != nullptr) {
    m = RowLayout::Meta(pool_.Cold(*row));
  } else {
    const uint32_t loc = tier_ ? tier_->cold.Find(key, hash) : ColdIndex::kEmpty;
    if (loc == ColdIndex::kEmpty) return kNoRow;
    // A base row on disk only (rare: a trainer's pull keeps its rows in
    // RAM until their push): its record's meta.
    std::vector<char> record(RecordBytes());
    tier_->file->Read(loc, record.data());
    std::memcpy(&on_disk, record.data() + sizeof(uint64_t) + layout_.hot_bytes, sizeof(RowMeta));
    m = &on_disk;
  }
  const double f = StatsDecay(m->step(), step, spec_.stats_half_life);
  return f * (static_cast<double>(m->shows) + click_weight * static_cast<double>(m->clicks));
}

char* TableShard::Grow(uint64_t key, uint64_t hash, const Clock& clock) {
  if (grow_base_ == nullptr) return nullptr;  // a serving copy: no rule applies
  const double score = grow_base_->ScoreAt(key, hash, clock.step, spec_.grow_click_weight);
  if (score < spec_.grow_promote) return nullptr;
  ++counters_.grown;
  return CreateRow(key, hash, clock, 0);
}

char* TableShard::Admit(uint64_t key, uint64_t hash, const Clock& clock) {
  if (!spec_.grow_base.empty()) return Grow(key, hash, clock);
  const uint32_t min_count = spec_.admission.min_count;
  if (min_count <= 1) return CreateRow(key, hash, clock, 0);
  const uint32_t seen = pending_.Observe(key, hash);
  if (seen < min_count) return nullptr;
  pending_.Forget(key, hash);
  ++counters_.admitted;
  char* row = CreateRow(key, hash, clock, seen - 1);
  RowLayout::Meta(pool_.Cold(row))->update_step |= RowMeta::kAdmittedBit;
  return row;
}

bool TableShard::RemoveRow(uint64_t key, uint64_t hash, const Clock& clock) {
  char* row = index_.Erase(key, hash);
  bool had = row != nullptr;
  if (row != nullptr) pool_.Free(row);
  if (tier_) {
    const uint32_t loc = tier_->cold.Erase(key, hash);
    if (loc != ColdIndex::kEmpty) {
      tier_->file->Release(loc);
      if (had) --tier_->both;
      had = true;
    }
  }
  if (!had) return false;
  removed_.Record(key, clock.version);
  BoundLog(&removed_);
  BoundLog(&changes_);
  return true;
}

char* TableShard::ResolveMissing(const Slice& s, size_t k, Create create, const Clock& clock) {
  switch (create) {
    case Create::kNever:
      return nullptr;
    case Create::kAdmit:
      return Admit(s.key(k), hashes_[k], clock);
    case Create::kAlways:
      return CreateRow(s.key(k), hashes_[k], clock, 0);
    case Create::kBlank:
      return CreateRow(s.key(k), hashes_[k], clock, 0, /*blank=*/true);
  }
  return nullptr;
}

// A two-stage software pipeline over the slice: index slots are prefetched
// kSlotsAhead + kRowsAhead keys ahead, rows are resolved (found or created)
// and prefetched kRowsAhead keys ahead, and visit(k, row) runs last.
template <bool kCold, class Visit, class OnCreate>
void TableShard::Pipeline(const Slice& s, Create create, const Clock& clock, Visit&& visit,
                          OnCreate&& on_create) {
  // Always inlined, like PrefetchBytes: an outlined lambda made only of
  // prefetches is deemed pure by GCC and its calls are deleted.
  const auto prefetch = [&](char* row) __attribute__((always_inline)) {
    if (row == nullptr) return;
    if constexpr (kCold) {  // an update: hot and cold parts are written
      PrefetchBytes<true>(row, layout_.hot_stride);
      PrefetchBytes<true>(pool_.Cold(row), layout_.cold_stride);
    } else {
      PrefetchBytes<false>(row, layout_.hot_stride);
    }
  };
  const size_t n = s.size();
  // New rows are initialized in batches of kInitBatch (FlushInit), their
  // chains of vector operations overlapping, instead of one by one between
  // index probes; a row still waiting is flushed before its visit (it was
  // created at pending_from or later), and whatever waits at the end, or on
  // an exception, is flushed on the way out.
  struct Deferred {
    TableShard* shard;
    explicit Deferred(TableShard* t) : shard(t) { shard->defer_init_ = true; }
    ~Deferred() {
      shard->FlushInit();
      shard->defer_init_ = false;
    }
  } deferred(this);
  size_t pending_from = n;  // the first key whose row waits for its weights
  const auto resolve = [&](size_t k) {
    char** found = index_.Find(s.key(k), hashes_[k]);
    if (found != nullptr) return *found;
    char* row = ResolveMissing(s, k, create, clock);
    if (row != nullptr) on_create(k);
    if (num_pending_init_ == 0) {
      pending_from = n;
    } else if (pending_from == n) {
      pending_from = k;
    }
    return row;
  };
  constexpr size_t kAhead = kSlotsAhead + kRowsAhead;
  for (size_t k = 0; k < std::min(n, kAhead); ++k) index_.Prefetch(hashes_[k]);
  char* ring[kRowsAhead];
  for (size_t k = 0; k < std::min(n, kRowsAhead); ++k) {
    ring[k] = resolve(k);
    prefetch(ring[k]);
  }
  for (size_t k = 0; k < n; ++k) {
    if (k + kAhead < n) index_.Prefetch(hashes_[k + kAhead]);
    char* row = ring[k % kRowsAhead];
    if (k + kRowsAhead < n) {
      char* ahead = resolve(k + kRowsAhead);
      prefetch(ahead);
      ring[k % kRowsAhead] = ahead;
    }
    if (pending_from <= k) {
      FlushInit();
      pending_from = n;
    }
    visit(k, row);
  }
}

void TableShard::FlushInit() {
  InitializeRows(spec_.initializer, spec_.seed, pending_keys_, pending_weights_, num_pending_init_,
                 layout_.dim);
  num_pending_init_ = 0;
}

void TableShard::RequireFp32(const char* what) const {
  if (layout_.precision == Precision::kFp32) return;
  throw std::invalid_argument("table '" + spec_.name + "' has precision '" +
                              PrecisionName(layout_.precision) + "': " + what +
                              " needs float32 weights");
}

void TableShard::RequireTrainable(const char* what) const {
  if (layout_.precision != Precision::kInt8) return;
  throw std::invalid_argument("table '" + spec_.name + "' has precision 'int8' (for serving): " +
                              what + " needs 'fp32' or 'fp16' weights");
}

void TableShard::Pull(const ShardBatch& batch, float* out, bool train, const Clock& clock,
                      size_t out_stride) {
  const Slice s = Select(batch);
  Promote(s);
  const int dim = layout_.dim;
  const size_t stride = out_stride != 0 ? out_stride : static_cast<size_t>(dim);
  uint64_t misses = 0;
  // Read-only for existing rows (counts advance on push), so pulled rows
  // stay clean in cache and cost no write-back.
  if (train) RequireTrainable("a training pull");
  const bool scattered = batch.num_shards >= kScatteredShards;
  if (train && tier_) {
    std::vector<uint64_t>& pinned = tier_->pinned[tier_->pin_turn ^= 1];
    pinned.resize(s.size());
    for (size_t k = 0; k < s.size(); ++k) pinned[k] = s.key(k);
  }
  WithPrecision(layout_.precision, [&](auto precision) {
    Pipeline</*kCold=*/false>(
        s, train ? TrainingPullCreate() : Create::kNever, clock, [&](size_t k, char* row) {
          if (scattered && k + kAheadOfVisit < s.size()) {  // as a push's gradients
            PrefetchBytes<true>(
                reinterpret_cast<const char*>(out + s.pos(k + kAheadOfVisit) * stride),
                dim * sizeof(float));
          }
          float* dst = out + s.pos(k) * stride;
          if (row != nullptr) {
            ReadWeights<decltype(precision)::value>(row, dim, dst);
          } else {
            InitializeWeights(spec_.initializer, spec_.seed, s.key(k), dim, dst);
            ++misses;
          }
        });
  });
  counters_.pulled_keys += s.size();
  counters_.pull_misses += misses;
  AfterCall(clock.step);
}

void TableShard::PullWhole(const ShardBatch& batch, float* out, const int32_t* in_of,
                           const uint8_t* in_last, const RowColumns& in_rows, uint8_t* in_found,
                           uint8_t* in_created, const Clock& clock) {
  const Slice s = Select(batch);
  Promote(s);
  const int dim = layout_.dim;
  uint64_t misses = 0;
  RequireFp32("a training pull");
  if (tier_) {
    std::vector<uint64_t>& pinned = tier_->pinned[tier_->pin_turn ^= 1];
    pinned.resize(s.size());
    for (size_t k = 0; k < s.size(); ++k) pinned[k] = s.key(k);
  }
  Pipeline</*kCold=*/true>(
      s, TrainingPullCreate(), clock,
      [&](size_t k, char* row) {
        const size_t pos = s.pos(k);
        float* dst = out + pos * dim;
        if (row != nullptr) {
          ReadWeights<Precision::kFp32>(row, dim, dst);
        } else {
          InitializeWeights(spec_.initializer, spec_.seed, s.key(k), dim, dst);
          ++misses;
        }
        const int32_t in = in_of[pos];
        if (in >= 0 && in_last[pos] != 0) {
          in_found[in] = row != nullptr ? 1 : 0;
          if (row != nullptr) WriteRow(s.key(k), row, in_rows, static_cast<size_t>(in));
        }
      },
      [&](size_t k) {
        const int32_t in = in_of[s.pos(k)];
        if (in >= 0) in_created[in] = 1;
      });
  counters_.pulled_keys += s.size();
  counters_.pull_misses += misses;
  AfterCall(clock.step);
}

const std::vector<int32_t>& TableShard::GroupDuplicates(const Slice& s, const float* grads,
                                                        size_t grads_stride, uint64_t* duplicates,
                                                        const float* shows, const float* clicks) {
  groups_.clear();
  const size_t n = s.size();
  if (n < 2) return groups_;
  size_t capacity = 1;
  while (capacity < 2 * n) capacity <<= 1;
  const size_t mask = capacity - 1;
  dedup_.assign(capacity, 0);                          // k + 1 of the first occurrence, 0 = empty
  std::vector<std::pair<uint32_t, uint32_t>> repeats;  // (k, first k)
  for (size_t k = 0; k < n; ++k) {
    const uint64_t h = hashes_[k];  // Mix64 is a bijection: equal hash <=> equal key
    for (size_t i = h & mask;; i = (i + 1) & mask) {
      const uint32_t e = dedup_[i];
      if (e == 0) {
        dedup_[i] = static_cast<uint32_t>(k + 1);
        break;
      }
      if (hashes_[e - 1] == h) {
        repeats.emplace_back(static_cast<uint32_t>(k), e - 1);
        break;
      }
    }
  }
  if (repeats.empty()) return groups_;
  *duplicates += repeats.size();
  const int dim = layout_.dim;
  groups_.assign(n, -1);
  sums_.clear();
  stat_sums_.clear();
  const bool stats = shows != nullptr || clicks != nullptr;
  const auto stat = [](const float* v, size_t pos) { return v != nullptr ? v[pos] : 0.0f; };
  for (const auto& [k, first] : repeats) {
    int32_t& group = groups_[first];
    if (group < 0) {
      group = static_cast<int32_t>(sums_.size() / dim);
      const float* g = grads + s.pos(first) * grads_stride;
      sums_.insert(sums_.end(), g, g + dim);
      if (stats) {
        stat_sums_.push_back(stat(shows, s.pos(first)));
        stat_sums_.push_back(stat(clicks, s.pos(first)));
      }
    }
    groups_[k] = -2;
    const float* g = grads + s.pos(k) * grads_stride;
    float* sum = sums_.data() + static_cast<size_t>(group) * dim;
    for (int j = 0; j < dim; ++j) sum[j] += g[j];
    if (stats) {
      stat_sums_[2 * group] += stat(shows, s.pos(k));
      stat_sums_[2 * group + 1] += stat(clicks, s.pos(k));
    }
  }
  return groups_;
}

void TableShard::Push(const ShardBatch& batch, const float* grads, bool unique, const Clock& clock,
                      PushResult* result, float* updated, const int32_t* updated_rows, int only,
                      const float* shows, const float* clicks, size_t grads_stride,
                      size_t updated_stride) {
  RequireTrainable("a push");
  const int dim = layout_.dim;
  const size_t gstride = grads_stride != 0 ? grads_stride : static_cast<size_t>(dim);
  const size_t ustride = updated_stride != 0 ? updated_stride : static_cast<size_t>(dim);
  Slice s = Select(batch);
  Promote(s);
  if (only != 0) {  // keep the keys asked for (hashes_ compacted alike)
    only_.resize(s.size());
    size_t m = 0;
    for (size_t k = 0; k < s.size(); ++k) {
      const size_t pos = s.pos(k);
      const bool has_row = updated_rows != nullptr && updated_rows[pos] >= 0;
      if (has_row == (only == 1)) {
        only_[m] = static_cast<uint32_t>(pos);
        hashes_[m++] = hashes_[k];
      }
    }
    hashes_.resize(m);
    s = Slice{s.keys, only_.data(), 0, m};
  }
  const std::vector<int32_t>* groups = nullptr;
  if (!unique) {
    const auto& g = GroupDuplicates(s, grads, gstride, &result->duplicates, shows, clicks);
    if (!g.empty()) groups = &g;
  }
  const RowOptimizer opt(spec_.optimizer);
  const double half_life = spec_.stats_half_life;
  const Create create = spec_.admission.min_count <= 1 ? Create::kAdmit : Create::kNever;
  const bool half = layout_.precision == Precision::kFp16;
  const bool scattered = batch.num_shards >= kScatteredShards;
  scratch_.resize(dim);
  // A row that a pull of a later step admitted did not exist at this push's
  // step (rows merely updated at later steps, e.g. by another worker, did).
  const bool skip_later_rows = clock.step_given && spec_.admission.min_count > 1;
  // Counted locally: `result` shares a cache line with other shards' results.
  uint64_t applied = 0, dropped_nan = 0, dropped_pending = 0;
  const size_t n = s.size();
  // One instance per optimizer and weight precision: the fp32 loop stays as
  // it was without fp16 tables.
  WithOptimizer(opt.kind, [&](auto kind) {
    const auto rows = [&](auto fp16) {
      constexpr bool kHalf = decltype(fp16)::value;
      Pipeline</*kCold=*/true>(s, create, clock, [&](size_t k, char* row) {
        // The gradients and rows of `updated` that keys a few visits ahead
        // use: a shard's keys are scattered over the batch (every S-th
        // position or so), and no hardware prefetcher sees them coming.
        if ((scattered || updated_rows != nullptr) && k + kAheadOfVisit < n) {
          const size_t ahead = s.pos(k + kAheadOfVisit);
          PrefetchBytes<false>(reinterpret_cast<const char*>(grads + ahead * gstride),
                               dim * sizeof(float));
          if (updated != nullptr && updated_rows != nullptr && updated_rows[ahead] >= 0) {
            PrefetchBytes<true>(reinterpret_cast<const char*>(
                                    updated + static_cast<size_t>(updated_rows[ahead]) * ustride),
                                dim * sizeof(float));
          }
        }
        // What a pull (train=false) after this push returns: the row as left,
        // or the initial vector of a key without one.
        float* out = nullptr;
        if (updated != nullptr) {
          const size_t pos = s.pos(k);
          if (updated_rows == nullptr) {
            out = updated + pos * ustride;
          } else if (updated_rows[pos] >= 0) {
            out = updated + static_cast<size_t>(updated_rows[pos]) * ustride;
          }
        }
        const auto report = [&] {
          if (out == nullptr) return;
          if (row == nullptr) {
            InitializeWeights(spec_.initializer, spec_.seed, s.key(k), dim, out);
          } else if constexpr (kHalf) {
            DecodeRow(Precision::kFp16, row, dim, out);
          } else {
            CopyFloats(out, RowLayout::Weights(row), dim);
          }
        };
        if (row == nullptr ||
            (skip_later_rows && RowLayout::Meta(pool_.Cold(row))->admitted_unpushed() &&
             RowLayout::Meta(pool_.Cold(row))->step() > clock.step)) {
          ++dropped_pending;
          report();
          return;
        }
        const size_t pos = s.pos(k);
        const float* g = grads + pos * gstride;
        float add_shows = shows != nullptr ? shows[pos] : 0.0f;
        float add_clicks = clicks != nullptr ? clicks[pos] : 0.0f;
        if (groups != nullptr) {
          const int32_t group = (*groups)[k];
          if (group == -2) {  // a repeat: its first occurrence was updated before
            report();
            return;
          }
          if (group >= 0) {
            g = sums_.data() + static_cast<size_t>(group) * dim;
            if (!stat_sums_.empty()) {
              add_shows = stat_sums_[2 * group];
              add_clicks = stat_sums_[2 * group + 1];
            }
          }
        }
        if (!AllFinite(g, dim)) {
          ++dropped_nan;
          report();
          return;
        }
        char* cold = pool_.Cold(row);
        RowMeta* meta = RowLayout::Meta(cold);
        if constexpr (kHalf) {  // fp16 weights: updated in float32, stored rounded stochastically
          DecodeRow(Precision::kFp16, row, dim, scratch_.data());
          UpdateRow<decltype(kind)::value>(opt, dim, scratch_.data(), RowLayout::State(cold), g,
                                           ClipScale(opt, g, dim));
          const uint64_t random = s.key(k) ^ (clock.step * 0xD1B54A32D192ED03ull) ^
                                  (uint64_t{meta->count} << 40) ^ spec_.seed;
          EncodeHalfStochastic(scratch_.data(), dim, reinterpret_cast<uint16_t*>(row), random);
        } else {
          UpdateRow<decltype(kind)::value>(opt, dim, RowLayout::Weights(row),
                                           RowLayout::State(cold), g, ClipScale(opt, g, dim));
        }
        DecayStats(meta, clock.step, half_life);
        meta->shows += add_shows;
        meta->clicks += add_clicks;
        meta->update_step = clock.step;
        meta->update_time = clock.now;
        if (meta->version != clock.version) {  // a backed row's differs too: it changes now
          if (meta->real_version() != clock.version) LogChange(s.key(k), clock.version);
          meta->version = clock.version;
        }
        BumpCount(meta);
        ++applied;
        report();
      });
    };
    if (half) {
      rows(std::true_type{});
    } else {
      rows(std::false_type{});
    }
  });
  result->applied += applied;
  result->dropped_nan += dropped_nan;
  result->dropped_pending += dropped_pending;
  counters_.pushed_keys += s.size();
  counters_.dropped_pending += dropped_pending;
  counters_.dropped_nan += dropped_nan;
  AfterCall(clock.step);
}

uint64_t TableShard::Erase(const ShardBatch& batch, const Clock& clock) {
  const Slice s = Select(batch);
  uint64_t erased = 0;
  for (size_t k = 0; k < s.size(); ++k) {
    erased += RemoveRow(s.key(k), hashes_[k], clock) ? 1 : 0;
    if (spec_.admission.min_count > 1) pending_.Forget(s.key(k), hashes_[k]);
  }
  counters_.erased += erased;
  return erased;
}

void TableShard::Contains(const ShardBatch& batch, uint8_t* out, const Overlay* overlay) {
  const Slice s = Select(batch);
  for (size_t k = 0; k < s.size(); ++k) {
    const uint64_t key = s.key(k);
    bool found;
    if (overlay != nullptr && overlay->rows->index_.Find(key, hashes_[k]) != nullptr) {
      found = true;
    } else if (overlay != nullptr && overlay->Removes(key)) {
      found = false;
    } else {
      found = index_.Find(key, hashes_[k]) != nullptr || HasCold(key, hashes_[k]);
    }
    out[s.pos(k)] = found ? 1 : 0;
  }
}

void TableShard::Lookup(const ShardBatch& batch, float* out, uint8_t* found, bool init_missing,
                        const Overlay* overlay) {
  const Slice s = Select(batch);
  Promote(s);
  const int dim = layout_.dim;
  const auto missing = [&](size_t k, float* dst) {
    if (init_missing) {
      InitializeWeights(spec_.initializer, spec_.seed, s.key(k), dim, dst);
    } else {
      std::fill(dst, dst + dim, 0.0f);
    }
    if (found != nullptr) found[s.pos(k)] = 0;
  };
  WithPrecision(layout_.precision, [&](auto precision) {
    constexpr Precision kPrecision = decltype(precision)::value;
    if (overlay == nullptr) {
      Pipeline</*kCold=*/false>(s, Create::kNever, Clock{}, [&](size_t k, char* row) {
        float* dst = out + s.pos(k) * dim;
        if (row == nullptr) return missing(k, dst);
        ReadWeights<kPrecision>(row, dim, dst);
        if (found != nullptr) found[s.pos(k)] = 1;
      });
      return;
    }
    // Only while a version is applied: no prefetching pipeline.
    for (size_t k = 0; k < s.size(); ++k) {
      float* dst = out + s.pos(k) * dim;
      char* const* row = overlay->rows->index_.Find(s.key(k), hashes_[k]);
      if (row == nullptr && !overlay->Removes(s.key(k))) row = index_.Find(s.key(k), hashes_[k]);
      if (row == nullptr) {
        missing(k, dst);
        continue;
      }
      ReadWeights<kPrecision>(*row, dim, dst);
      if (found != nullptr) found[s.pos(k)] = 1;
    }
  });
  AfterCall(0);
}

bool TableShard::ReadRow(uint64_t key, uint64_t hash, float* dst, bool init_missing) const {
  const int dim = layout_.dim;
  const auto decode = [&](const char* hot) {
    WithPrecision(layout_.precision,
                  [&](auto precision) { ReadWeights<decltype(precision)::value>(hot, dim, dst); });
  };
  char* const* row = index_.Find(key, hash);
  if (row != nullptr) {
    decode(*row);
    return true;
  }
  if (tier_ && tier_->cold.size() != 0) {
    // A serving table's cold row, read on the caller's thread: between
    // version switches nothing writes the cold index or the row files.
    const uint32_t loc = tier_->cold.Find(key, hash);
    if (loc != ColdIndex::kEmpty) {
      thread_local std::vector<char> record;
      record.resize(RecordBytes());
      tier_->file->Read(loc, record.data());
      decode(record.data() + sizeof(uint64_t));  // the record: key | hot | cold
      tier_->lookup_reads.fetch_add(1, std::memory_order_relaxed);
      return true;
    }
  }
  if (init_missing) {
    InitializeWeights(spec_.initializer, spec_.seed, key, dim, dst);
  } else {
    std::fill(dst, dst + dim, 0.0f);
  }
  return false;
}

void TableShard::Merge(const Overlay& overlay, const Clock& clock) {
  const int dim = layout_.dim;
  const size_t cold_bytes = layout_.cold_stride;
  const TableShard& from = *overlay.rows;
  uint64_t newest = 0;
  from.index_.ForEach([&](uint64_t key, char* const& src) {
    const uint64_t hash = Mix64(key);
    char** slot = index_.Find(key, hash);
    // (CreateRow counts a key also on disk as in both tiers: its record is
    // stale once the row, not backed, is written back.)
    char* row = slot != nullptr ? *slot : CreateRow(key, hash, clock, 0, /*blank=*/true);
    if (layout_.precision == Precision::kFp32) {
      CopyFloats(RowLayout::Weights(row), RowLayout::Weights(src), dim);
    } else {  // same precision (the overlay has the live spec): encoded as is
      std::memcpy(row, src, layout_.hot_bytes);
    }
    std::memcpy(pool_.Cold(row), from.pool_.Cold(src), cold_bytes);
    newest = std::max(newest, RowLayout::Meta(pool_.Cold(row))->version);
  });
  changes_.Forget(newest);  // as Load: rows keep their own versions
  for (uint64_t key : overlay.removed) {
    if (!from.index_.Find(key, Mix64(key))) RemoveRow(key, Mix64(key), clock);
  }
  AfterCall(clock.step);
}

void TableShard::Load(const ShardBatch& batch, const RowColumns& cols, const Clock& clock) {
  const Slice s = Select(batch);
  Promote(s);
  const int dim = layout_.dim;
  const int state_dim = layout_.state_dim;
  uint64_t newest = 0;
  Pipeline</*kCold=*/true>(s, Create::kBlank, clock, [&](size_t k, char* row) {
    const size_t p = s.pos(k);
    char* cold = pool_.Cold(row);
    if (layout_.precision == Precision::kFp32) {
      CopyFloats(RowLayout::Weights(row), cols.weights + p * dim, dim);
    } else {
      EncodeRow(layout_.precision, cols.weights + p * dim, dim, row);
    }
    if (cols.state != nullptr) {
      CopyFloats(RowLayout::State(cold), cols.state + p * state_dim, state_dim);
    } else {
      InitState(spec_.optimizer, dim, RowLayout::State(cold));
    }
    RowMeta* meta = RowLayout::Meta(cold);
    meta->count = cols.counts != nullptr ? cols.counts[p] : 0;
    meta->update_step =
        (cols.steps != nullptr ? cols.steps[p] : clock.step) & ~RowMeta::kAdmittedBit;
    meta->update_time = cols.times != nullptr ? cols.times[p] : clock.now;
    meta->shows = cols.shows != nullptr ? cols.shows[p] : 0.0f;
    meta->clicks = cols.clicks != nullptr ? cols.clicks[p] : 0.0f;
    if (cols.versions != nullptr) {
      meta->version = cols.versions[p] & ~RowMeta::kBackedBit;
      newest = std::max(newest, meta->version);
    } else if (meta->version != clock.version) {
      if (meta->real_version() != clock.version) LogChange(s.key(k), clock.version);
      meta->version = clock.version;
    }
  });
  // Rows loaded with their own (older) versions are not in the change log:
  // it no longer lists every change up to the newest of them.
  changes_.Forget(newest);
  AfterCall(clock.step);
}

void TableShard::MergeRows(const ShardBatch& batch, const RowColumns& changes, const Clock& clock) {
  const Slice s = Select(batch);
  Promote(s);
  const int dim = layout_.dim;
  const int state_dim = layout_.state_dim;
  const double half_life = spec_.stats_half_life;
  // A key without a row (evicted here since the trainer fetched it) gets
  // one as a new key does (its initial weights and state), then the change.
  Pipeline</*kCold=*/true>(s, Create::kAlways, clock, [&](size_t k, char* row) {
    const size_t p = s.pos(k);
    char* cold = pool_.Cold(row);
    float* weights = RowLayout::Weights(row);
    const float* dw = changes.weights + p * dim;
    for (int j = 0; j < dim; ++j) weights[j] += dw[j];
    if (changes.state != nullptr) {
      float* state = RowLayout::State(cold);
      const float* ds = changes.state + p * state_dim;
      for (int j = 0; j < state_dim; ++j) state[j] += ds[j];
    }
    RowMeta* meta = RowLayout::Meta(cold);
    if (changes.counts != nullptr) {
      const uint64_t count = uint64_t{meta->count} + changes.counts[p];
      meta->count = static_cast<uint32_t>(std::min<uint64_t>(count, UINT32_MAX));
    }
    const uint64_t step = changes.steps != nullptr ? changes.steps[p] : clock.step;
    DecayStats(meta, step, half_life);
    if (changes.shows != nullptr) meta->shows += changes.shows[p];
    if (changes.clicks != nullptr) meta->clicks += changes.clicks[p];
    const uint64_t newest = std::max(meta->step(), step & ~RowMeta::kAdmittedBit);
    meta->update_step = newest;
    const uint32_t time = changes.times != nullptr ? changes.times[p] : clock.now;
    meta->update_time = std::max(meta->update_time, time);
    if (meta->version != clock.version) {
      if (meta->real_version() != clock.version) LogChange(s.key(k), clock.version);
      meta->version = clock.version;
    }
  });
  AfterCall(clock.step);
}

void TableShard::EvictByAge(const Clock& clock, EvictResult* result) {
  const EvictionSpec& e = spec_.eviction;
  std::vector<uint64_t> expired, rare;
  ForEachMeta([&](uint64_t key, const RowMeta* m) {
    const bool old_by_steps =
        e.ttl_steps != 0 && clock.step > m->step() && clock.step - m->step() > e.ttl_steps;
    const bool old_by_time = e.ttl_seconds != 0 && clock.now > m->update_time &&
                             clock.now - m->update_time > e.ttl_seconds;
    if (old_by_steps || old_by_time) {
      expired.push_back(key);
    } else if (e.min_count != 0 && m->count < e.min_count && m->step() < prev_evict_step_) {
      rare.push_back(key);
    }
  });
  prev_evict_step_ = clock.step;
  // An extension block: rows whose base row scores below grow_demote, or
  // has none (evicted, erased); a base row on disk is read for its score.
  std::vector<uint64_t> shrunk;
  if (grow_base_ != nullptr) {
    ForEachMeta([&](uint64_t key, const RowMeta*) {
      const double score =
          grow_base_->ScoreAt(key, Mix64(key), clock.step, spec_.grow_click_weight);
      if (score < spec_.grow_demote) shrunk.push_back(key);
    });
  }
  for (uint64_t key : shrunk) RemoveRow(key, Mix64(key), clock);
  counters_.shrunk += shrunk.size();
  result->shrunk += shrunk.size();
  for (uint64_t key : expired) RemoveRow(key, Mix64(key), clock);
  for (uint64_t key : rare) RemoveRow(key, Mix64(key), clock);
  result->ttl += expired.size();
  result->min_count += rare.size();
  counters_.evicted_ttl += expired.size();
  counters_.evicted_min_count += rare.size();
}

void TableShard::CountHistogram(std::vector<uint64_t>* histogram) const {
  ForEachMeta([&](uint64_t, const RowMeta* m) {
    ++(*histogram)[std::min<size_t>(m->count, kHistogramBuckets - 1)];
  });
}

void TableShard::StepsAtCount(uint32_t bucket, std::vector<uint64_t>* steps) const {
  ForEachMeta([&](uint64_t, const RowMeta* m) {
    if (std::min<size_t>(m->count, kHistogramBuckets - 1) == bucket) {
      steps->push_back(m->step());
    }
  });
}

void TableShard::EvictLeastFrequent(uint32_t threshold, uint64_t cutoff, uint64_t quota,
                                    const Clock& clock, EvictResult* result) {
  std::vector<uint64_t> victims, ties;
  ForEachMeta([&](uint64_t key, const RowMeta* m) {
    const size_t bucket = std::min<size_t>(m->count, kHistogramBuckets - 1);
    if (bucket == threshold && m->step() == cutoff) {
      ties.push_back(key);
    } else if (bucket < threshold || (bucket == threshold && m->step() < cutoff)) {
      victims.push_back(key);
    }
  });
  // Ties at the cutoff: the smallest keys, whatever order the rows are in.
  const size_t take = std::min<size_t>(quota, ties.size());
  std::nth_element(ties.begin(), ties.begin() + static_cast<ptrdiff_t>(take), ties.end());
  victims.insert(victims.end(), ties.begin(), ties.begin() + static_cast<ptrdiff_t>(take));
  for (uint64_t key : victims) RemoveRow(key, Mix64(key), clock);
  result->lfu += victims.size();
  counters_.evicted_lfu += victims.size();
}

void TableShard::Compact() {
  if (pool_.BeginCompaction(0.75)) {
    index_.ForEach([&](uint64_t, char*& row) {
      if (pool_.IsDraining(row)) {
        row = pool_.Relocate(row);
        ++counters_.rows_moved;
      }
    });
    pool_.EndCompaction();
  }
  index_.MaybeShrink();
}

void TableShard::WriteParts(uint64_t key, const char* row, const char* cold_part,
                            const RowColumns& out, size_t o) const {
  const int dim = layout_.dim;
  const int state_dim = layout_.state_dim;
  char* cold = const_cast<char*>(cold_part);
  const RowMeta* meta = RowLayout::Meta(cold);
  if (out.keys != nullptr) out.keys[o] = key;
  if (out.weights != nullptr) {
    if (layout_.precision == Precision::kFp32) {
      CopyFloats(out.weights + o * dim, reinterpret_cast<const float*>(row), dim);
    } else {
      DecodeRow(layout_.precision, row, dim, out.weights + o * dim);
    }
  }
  if (out.state != nullptr)
    CopyFloats(out.state + o * state_dim, RowLayout::State(cold), state_dim);
  if (out.counts != nullptr) out.counts[o] = meta->count;
  if (out.steps != nullptr) out.steps[o] = meta->step();
  if (out.times != nullptr) out.times[o] = meta->update_time;
  if (out.versions != nullptr) out.versions[o] = meta->real_version();
  if (out.shows != nullptr) out.shows[o] = meta->shows;
  if (out.clicks != nullptr) out.clicks[o] = meta->clicks;
}

void TableShard::ReadRows(const ShardBatch& batch, const RowColumns& out, uint8_t* found) {
  const Slice s = Select(batch);
  Promote(s);
  // kCold: the cold part (state, metadata) is read too, so it is prefetched.
  Pipeline</*kCold=*/true>(s, Create::kNever, Clock{}, [&](size_t k, char* row) {
    const size_t pos = s.pos(k);
    found[pos] = row != nullptr ? 1 : 0;
    if (row != nullptr) WriteRow(s.key(k), row, out, pos);
  });
  AfterCall(0);
}

void TableShard::BeginExport(uint64_t since, ExportCursor* cursor) const {
  cursor->slot = 0;
  cursor->keys.clear();
  cursor->by_key = since > 0 && changes_.Covers(since);
  cursor->cold = false;
  cursor->cold_file = cursor->cold_slot = 0;
  if (cursor->by_key) {
    changes_.KeysSince(since, &cursor->keys);
  } else {
    cursor->generation = index_.generation();
  }
}

size_t TableShard::Export(uint64_t since, size_t max_rows, ExportCursor* cursor,
                          const RowColumns& out, size_t offset, bool* done) const {
  size_t written = 0;
  const auto emit = [&](uint64_t key, char* row) {
    if (RowLayout::Meta(pool_.Cold(row))->real_version() <= since) return;
    WriteRow(key, row, out, offset + written);
    ++written;
  };
  RecordParts parts(*this);
  const auto emit_record = [&](uint64_t key, const char* record) {
    parts.From(record);
    if (parts.meta()->real_version() <= since) return;
    WriteParts(key, parts.hot(), parts.cold(), out, offset + written);
    ++written;
  };
  size_t i = cursor->slot;
  if (cursor->by_key) {  // the keys the change log lists; removed ones are skipped
    const std::vector<uint64_t>& keys = cursor->keys;
    std::vector<char> record(tier_ ? RecordBytes() : 0);
    for (; i < keys.size() && written < max_rows; ++i) {
      if (i + kSlotsAhead < keys.size()) index_.Prefetch(Mix64(keys[i + kSlotsAhead]));
      const uint64_t hash = Mix64(keys[i]);
      char* const* found = index_.Find(keys[i], hash);
      if (found != nullptr) {
        emit(keys[i], *found);
      } else if (tier_) {
        const uint32_t loc = tier_->cold.Find(keys[i], hash);
        if (loc == ColdIndex::kEmpty) continue;
        tier_->file->Read(loc, record.data());
        emit_record(keys[i], record.data());
      }
    }
    *done = i >= keys.size();
  } else if (!cursor->cold) {
    const size_t capacity = index_.capacity();
    for (; i < capacity && written < max_rows; ++i) {
      if (i + kRowsAhead < capacity) {
        const auto& ahead = index_.slot(ScanSlot(i + kRowsAhead, capacity));
        if (index_.Occupied(ahead)) {
          PrefetchBytes<false>(ahead.value, layout_.hot_stride);
          PrefetchBytes<false>(pool_.Cold(ahead.value), layout_.cold_stride);
        }
      }
      const auto& entry = index_.slot(ScanSlot(i, capacity));
      // a row with a record on disk goes out with the records, below
      if (index_.Occupied(entry) && !HasCold(entry.key, Mix64(entry.key))) {
        emit(entry.key, entry.value);
      }
    }
    *done = i >= capacity;
    if (*done && tier_) {  // then the keys of the row files, file by file
      cursor->cold = true;
      *done = false;
    }
  }
  cursor->slot = i;
  if (cursor->cold) {
    const RowFile& file = *tier_->file;
    while (written < max_rows && cursor->cold_file < file.file_numbers()) {
      const auto f = static_cast<uint32_t>(cursor->cold_file);
      if (file.has_file(f)) {
        cursor->cold_slot = file.ReadFile(f, static_cast<uint32_t>(cursor->cold_slot),
                                          [&](uint32_t loc, const char* record) {
                                            if (written == max_rows) return false;
                                            uint64_t key;
                                            std::memcpy(&key, record, sizeof(key));
                                            const uint64_t hash = Mix64(key);
                                            if (tier_->cold.Find(key, hash) != loc)
                                              return true;  // stale
                                            char* const* row = index_.Find(key, hash);
                                            if (row != nullptr) {
                                              emit(key, *row);  // the row in RAM is the newest
                                            } else {
                                              emit_record(key, record);
                                            }
                                            return true;
                                          });
        if (cursor->cold_slot < file.records_in(f)) break;
      }
      ++cursor->cold_file;
      cursor->cold_slot = 0;
    }
    *done = cursor->cold_file >= file.file_numbers();
  }
  return written;
}

void TableShard::RemovedSince(uint64_t since,
                              std::vector<std::pair<uint64_t, uint64_t>>* records) const {
  removed_.RecordsSince(since, records);
}

void TableShard::LoadRemoved(const uint64_t* keys, const uint64_t* versions, size_t n,
                             uint64_t floor) {
  removed_.Forget(floor);
  for (size_t i = 0; i < n; ++i) removed_.Record(keys[i], versions[i]);
}

void TableShard::LoadPending(const uint64_t* keys, const uint32_t* counts, size_t n) {
  if (spec_.admission.min_count <= 1) return;  // every key is admitted at once
  for (size_t i = 0; i < n; ++i) {
    const uint64_t hash = Mix64(keys[i]);
    if (index_.Find(keys[i], hash) == nullptr && !HasCold(keys[i], hash)) {
      pending_.Set(keys[i], hash, counts[i]);
    }
  }
}

TableStats TableShard::Snapshot() const {
  TableStats t = counters_;
  t.rows = rows();
  t.row_bytes = pool_.bytes();
  if (tier_) {
    const RowFileStats f = tier_->file->Stats();
    t.cold_rows = ColdOnlyRows();
    t.cold_index_bytes = tier_->cold.bytes();
    t.disk_bytes = f.bytes_on_disk;
    t.cold_reads = tier_->reads + tier_->lookup_reads.load(std::memory_order_relaxed);
    t.cold_prefetched = tier_->prefetched_reads;
    t.demoted = tier_->demoted;
    t.demoted_written = tier_->demoted_written;
    t.demoted_between_calls = tier_->demoted_idle;
    t.files_compacted = f.files_compacted;
    t.disk_error = tier_->error;
  }
  t.index_bytes = index_.bytes();
  t.pending_keys = pending_.size();
  t.pending_bytes = pending_.bytes();
  t.removed_log = removed_.size();
  t.removed_floor = removed_.floor();
  t.change_log = changes_.size();
  t.change_floor = changes_.floor();
  t.pending_forgotten = pending_.forgotten();
  t.chunks_released = pool_.chunks_released();
  return t;
}

// -- the disk tier -------------------------------------------------------------

namespace {
std::mutex crash_mutex;
std::atomic<bool> crash_armed{false};
std::string crash_point_name;  // written once, before crash_armed
uint64_t crash_point_hit = 0;
std::atomic<uint64_t> crash_point_hits{0};
}  // namespace

void ArmTierCrash() {
  const std::lock_guard<std::mutex> lock(crash_mutex);
  const char* value = std::getenv("WULIANG_TEST_CRASH_AT");
  if (crash_armed.load() || value == nullptr) return;  // the first engine that sees it
  const std::string text(value);
  const std::string point = text.substr(0, text.find(':'));
  if (point.rfind("tier-", 0) != 0) return;
  crash_point_name = point;
  crash_point_hit = text.find(':') == std::string::npos
                        ? 1
                        : std::strtoull(text.c_str() + text.find(':') + 1, nullptr, 10);
  crash_armed.store(true);
}

void TierCrashPoint(const char* point) {
  if (!crash_armed.load(std::memory_order_acquire) || crash_point_name != point) return;
  const uint64_t hit = crash_point_hits.fetch_add(1) + 1;
  if (hit != crash_point_hit) return;
  std::printf("WULIANG_TEST_CRASH_AT reached %s:%llu\n", point,
              static_cast<unsigned long long>(hit));
  std::fflush(stdout);
  std::this_thread::sleep_for(std::chrono::seconds(600));  // the test SIGKILLs us here
  std::_Exit(70);                                          // never go on after a crash point
}

void TableShard::PlanPrefetch(const ShardBatch& batch, PrefetchReads* reads) {
  if (!tier_) return;
  Tier& t = *tier_;
  const Slice s = Select(batch);
  // Kept in RAM once they are there, like the last two prefetches' keys: a
  // pipeline reading ahead prefetches a batch before the pull of the one
  // before it.
  std::vector<uint64_t>& kept = t.prefetched[t.prefetch_turn ^= 1];
  kept.resize(s.size());
  for (size_t k = 0; k < s.size(); ++k) kept[k] = s.key(k);
  if (t.cold.size() == t.both) return;  // nothing on disk only
  const size_t bytes = RecordBytes();
  reads->file = t.file.get();
  reads->record_bytes = bytes;
  for (size_t k = 0; k < s.size(); ++k) {
    if (index_.Find(s.key(k), hashes_[k]) != nullptr) continue;
    const uint32_t loc = t.cold.Find(s.key(k), hashes_[k]);
    if (loc == ColdIndex::kEmpty) continue;
    reads->keys.push_back(s.key(k));
    reads->locs.push_back(loc);
  }
  reads->records.resize(reads->keys.size() * bytes);
  for (size_t i = 0; i < reads->keys.size(); ++i) {
    RowFile::Place place;
    if (t.file->Detach(reads->locs[i], reads->records.data() + i * bytes, &place)) {
      reads->places.push_back(place);
      reads->away.push_back(static_cast<uint32_t>(i));
    }
  }
}

uint64_t TableShard::FinishPrefetch(PrefetchReads* reads) {
  if (!tier_) return 0;
  Tier& t = *tier_;
  t.file->Reattach(reads->places.size());
  uint64_t installed = 0;
  for (size_t i = 0; i < reads->keys.size(); ++i) {
    const uint64_t key = reads->keys[i];
    const uint64_t hash = Mix64(key);
    // Since the plan, a call may have read it in, or it moved or went.
    if (index_.Find(key, hash) != nullptr || t.cold.Find(key, hash) != reads->locs[i]) continue;
    Install(key, hash, reads->records.data() + i * reads->record_bytes);
    ++installed;
  }
  t.prefetched_reads += installed;
  AfterCall(0);
  return installed;
}

size_t TableShard::Promote(const Slice& s) {
  if (!tier_ || tier_->cold.size() == tier_->both) return 0;  // nothing on disk only
  Tier& t = *tier_;
  t.locs.clear();
  t.wanted.clear();
  for (size_t k = 0; k < s.size(); ++k) {
    if (index_.Find(s.key(k), hashes_[k]) != nullptr) continue;
    const uint32_t loc = t.cold.Find(s.key(k), hashes_[k]);
    if (loc == ColdIndex::kEmpty) continue;
    t.locs.push_back(loc);
    t.wanted.push_back(static_cast<uint32_t>(k));
  }
  if (t.locs.empty()) return 0;
  const size_t bytes = RecordBytes();
  t.scratch.resize(t.locs.size() * bytes);
  t.file->ReadMany(t.locs.data(), t.locs.size(), t.scratch.data());  // throws before any change
  TierCrashPoint("tier-promote");
  for (size_t i = 0; i < t.wanted.size(); ++i) {
    const size_t k = t.wanted[i];
    if (index_.Find(s.key(k), hashes_[k]) != nullptr) continue;  // a repeated key
    Install(s.key(k), hashes_[k], t.scratch.data() + i * bytes);
  }
  t.reads += t.locs.size();
  return t.locs.size();
}

void TableShard::Install(uint64_t key, uint64_t hash, const char* record) {
  char* row = pool_.Allocate();
  std::memcpy(row, record + sizeof(uint64_t), layout_.hot_bytes);
  char* cold = pool_.Cold(row);
  std::memcpy(cold, record + sizeof(uint64_t) + layout_.hot_bytes,
              sizeof(RowMeta) + sizeof(float) * static_cast<size_t>(layout_.state_dim));
  RowLayout::Meta(cold)->version |= RowMeta::kBackedBit;
  try {
    *index_.InsertNew(key, hash) = row;
  } catch (...) {
    pool_.Free(row);
    throw;
  }
  ++tier_->both;
}

int64_t TableShard::SyncBudget() {
  Tier& t = *tier_;
  const auto mine = static_cast<int64_t>(pool_.rows() * RowBytes());
  t.budget->used += mine - t.accounted;
  t.accounted = mine;
  return t.budget->used.load();
}

void TableShard::AfterCall(uint64_t step) {
  if (!tier_) return;
  Tier& t = *tier_;
  const auto limit = static_cast<int64_t>(t.budget->limit);
  const int64_t used = SyncBudget();
  if (used > limit) {  // down to 90% of the budget: headroom for the next calls
    // Between calls, unless far over: a quarter of the budget past it
    // (the calls outrun the idle time), then in this call as before.
    if (defer_demotion_ && used <= limit + limit / 4) {
      t.demote_due = true;  // IdleWork takes the excess as it is then
      t.demote_step = step;
      return;
    }
    t.demote_due = false;
    const int64_t excess = used - limit / 10 * 9;
    Demote(std::min<size_t>(static_cast<size_t>(excess) / RowBytes() + 1, pool_.rows()), step);
    SyncBudget();
  }
  CompactSome(size_t{1} << 14);
}

bool TableShard::IdleWork() {
  if (!tier_ || !tier_->demote_due) return false;
  Tier& t = *tier_;
  // What the budget asks now (calls since may have added or removed rows),
  // a piece at a time: a task waits for at most one piece.
  const auto limit = static_cast<int64_t>(t.budget->limit);
  const int64_t excess = SyncBudget() - limit / 10 * 9;
  constexpr size_t kPiece = 4096;
  const size_t rows =
      excess <= 0 ? 0
                  : std::min({static_cast<size_t>(excess) / RowBytes() + 1, kPiece, pool_.rows()});
  if (rows == 0) {
    t.demote_due = false;
    CompactSome(size_t{1} << 14);
    return false;
  }
  TierCrashPoint("tier-demote-idle");
  const uint64_t before = t.demoted;
  Demote(rows, t.demote_step);
  const uint64_t done = t.demoted - before;
  t.demoted_idle += done;
  SyncBudget();
  if (done == 0) {  // every candidate is held (pinned by the pulls in flight): the next call
    t.demote_due = false;
    return false;
  }
  return true;
}

void TableShard::Demote(size_t want, uint64_t step) {
  Tier& t = *tier_;
  const size_t capacity = index_.capacity();
  if (want == 0 || capacity == 0) return;
  struct Candidate {
    float shows;  // decayed to `step`
    uint32_t count;
    uint64_t step;
    uint32_t tie;  // hash bits the index's slots do not use: ties go at random
    uint64_t key;
    char* row;
  };
  // A sample of the rows from where the last one ended, the least shown
  // (then least counted, then oldest) of it demoted: approximately the
  // least shown of all, at a cost that follows what is demoted.
  const size_t goal = std::min(index_.size(), std::max<size_t>(4 * want, 4096));
  std::vector<Candidate> sample;
  sample.reserve(goal);
  const double half_life = spec_.stats_half_life;
  size_t i = t.demote_cursor % capacity;
  for (size_t visited = 0; sample.size() < goal && visited < capacity; ++visited) {
    const auto& slot = index_.slot(i);
    if (index_.Occupied(slot)) {
      const RowMeta* m = RowLayout::Meta(pool_.Cold(slot.value));
      const auto shows = static_cast<float>(m->shows * StatsDecay(m->step(), step, half_life));
      const auto tie = static_cast<uint32_t>(Mix64(slot.key) >> 16);
      sample.push_back({shows, m->count, m->step(), tie, slot.key, slot.value});
    }
    i = i + 1 == capacity ? 0 : i + 1;
  }
  t.demote_cursor = i;
  const auto less = [](const Candidate& a, const Candidate& b) {
    if (a.shows != b.shows) return a.shows < b.shows;
    if (a.count != b.count) return a.count < b.count;
    if (a.step != b.step) return a.step < b.step;
    // Not the sample's order (the index's slot order): demoting a run of
    // slots would leave the rest of the index packed into long runs.
    return a.tie < b.tie;
  };
  // Twice as many candidates as rows wanted (the least shown of the
  // sample): the rows of the last two training pulls among them stay
  // (their pushes are coming).
  const size_t candidates = std::min(2 * want, sample.size());
  std::nth_element(sample.begin(), sample.begin() + static_cast<ptrdiff_t>(candidates),
                   sample.end(), less);
  // Best first: what nth_element leaves before the cut is near the sample's
  // order, and demoting a prefix of that is demoting a run of slots.
  std::sort(sample.begin(), sample.begin() + static_cast<ptrdiff_t>(candidates), less);
  // Kept between calls (mapping and faulting in a fresh one each time cost
  // more than the lookups), emptied key by key after.
  OpenHashMap<uint32_t>& position = t.candidates;
  position.Reserve(candidates);
  for (size_t v = 0; v < candidates; ++v) {
    *position.InsertNew(sample[v].key, Mix64(sample[v].key)) = static_cast<uint32_t>(v + 1);
  }
  std::vector<bool> keep(candidates, false);
  for (const std::vector<uint64_t>* pinned :
       {&t.pinned[0], &t.pinned[1], &t.prefetched[0], &t.prefetched[1]}) {
    for (uint64_t key : *pinned) {
      if (const uint32_t* v = position.Find(key, Mix64(key))) keep[*v - 1] = true;
    }
  }
  for (size_t v = 0; v < candidates; ++v) position.Erase(sample[v].key, Mix64(sample[v].key));
  const size_t bytes = RecordBytes();
  t.scratch.resize(bytes);
  size_t demoted = 0;
  for (size_t v = 0; v < candidates && demoted < want; ++v) {
    if (keep[v]) continue;
    ++demoted;
    const Candidate& c = sample[v];
    const uint64_t hash = Mix64(c.key);
    char* cold = pool_.Cold(c.row);
    if (RowLayout::Meta(cold)->backed()) {
      --t.both;  // unchanged since it came from disk: its record stands
    } else {
      char* record = t.scratch.data();
      std::memcpy(record, &c.key, sizeof(c.key));
      std::memcpy(record + sizeof(uint64_t), c.row, layout_.hot_bytes);
      std::memcpy(record + sizeof(uint64_t) + layout_.hot_bytes, cold,
                  bytes - sizeof(uint64_t) - layout_.hot_bytes);
      uint32_t loc;
      try {
        loc = t.file->Append(record);
      } catch (const std::exception& e) {  // the rows stay in RAM, over budget
        t.error = e.what();
        return;
      }
      TierCrashPoint("tier-demote");
      const uint32_t old = t.cold.Set(c.key, hash, loc);
      if (old != ColdIndex::kEmpty) {
        t.file->Release(old);
        --t.both;
      }
      ++t.demoted_written;
    }
    index_.Erase(c.key, hash);
    pool_.Free(c.row);
    ++t.demoted;
  }
  t.error.clear();
}

void TableShard::CompactSome(size_t records) {
  Tier& t = *tier_;
  if (t.compact_file < 0) {
    t.compact_file = t.file->CompactionCandidate();
    t.compact_slot = 0;
    if (t.compact_file < 0) return;
  }
  const auto f = static_cast<uint32_t>(t.compact_file);
  const size_t bytes = RecordBytes();
  std::vector<char> live;  // appended after the read: appends may open files
  std::vector<uint32_t> old;
  size_t visited = 0;
  try {
    t.compact_slot = t.file->ReadFile(f, t.compact_slot, [&](uint32_t loc, const char* record) {
      if (visited == records) return false;
      ++visited;
      uint64_t key;
      std::memcpy(&key, record, sizeof(key));
      if (t.cold.Find(key, Mix64(key)) == loc) {
        live.insert(live.end(), record, record + bytes);
        old.push_back(loc);
      }
      return true;
    });
    for (size_t r = 0; r < old.size(); ++r) {
      const char* record = live.data() + r * bytes;
      uint64_t key;
      std::memcpy(&key, record, sizeof(key));
      t.cold.Set(key, Mix64(key), t.file->Append(record));
    }
  } catch (const std::exception& e) {  // records not moved keep their old places
    t.error = e.what();
    return;
  }
  if (!old.empty()) TierCrashPoint("tier-compact");
  if (t.compact_slot >= t.file->records_in(f) && t.file->detached() == 0) {
    t.file->DropFile(f);  // not while reads of it may be in flight (a prefetch)
    t.compact_file = -1;
  }
}

template <class Fn>
void TableShard::ForEachMeta(Fn&& fn) const {
  index_.ForEach([&](uint64_t key, char* row) { fn(key, RowLayout::Meta(pool_.Cold(row))); });
  if (!tier_ || tier_->cold.size() == tier_->both) return;  // nothing on disk only
  const Tier& t = *tier_;
  RowMeta meta;  // copied out of the record: aligned
  const size_t at = sizeof(uint64_t) + layout_.hot_bytes;
  for (uint32_t f = 0; f < t.file->file_numbers(); ++f) {
    if (!t.file->has_file(f)) continue;
    t.file->ReadFile(f, 0, [&](uint32_t loc, const char* record) {
      uint64_t key;
      std::memcpy(&key, record, sizeof(key));
      const uint64_t hash = Mix64(key);
      if (t.cold.Find(key, hash) == loc && index_.Find(key, hash) == nullptr) {
        std::memcpy(&meta, record + at, sizeof(meta));
        fn(key, static_cast<const RowMeta*>(&meta));
      }
      return true;
    });
  }
}

}  // namespace wuliang::ps::details
