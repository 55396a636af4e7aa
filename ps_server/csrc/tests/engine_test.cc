// C++ tests of the engine internals and of Engine under concurrency. Built
// and run under ThreadSanitizer and AddressSanitizer by `make test`.
#include "wuliang/ps/engine.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <limits>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "check.h"
#include "details/change_log.h"
#include "details/hash_map.h"
#include "details/memory_pool.h"
#include "details/pending_counter.h"
#include "details/precision.h"
#include "details/row_layout.h"
#include "wuliang/ps/hash.h"

using namespace wuliang::ps;

namespace {

#if defined(__SANITIZE_THREAD__)  // GCC
constexpr bool kThreadSanitizer = true;
#elif defined(__has_feature)  // Clang
#if __has_feature(thread_sanitizer)
constexpr bool kThreadSanitizer = true;
#else
constexpr bool kThreadSanitizer = false;
#endif
#else
constexpr bool kThreadSanitizer = false;
#endif

TableSpec SgdSpec(const std::string& name, int dim) {
  TableSpec spec;
  spec.name = name;
  spec.dim = dim;
  spec.optimizer.kind = OptimizerKind::kSgd;
  spec.optimizer.learning_rate = 1.0f;
  spec.initializer.kind = InitKind::kZeros;
  return spec;
}

void TestHashMapMatchesReference() {
  details::OpenHashMap<uint64_t> map;
  std::unordered_map<uint64_t, uint64_t> ref;
  std::mt19937_64 rng(1);
  for (int i = 0; i < 200000; ++i) {
    const uint64_t key = rng() % 5000;  // small key space: many erases hit
    const uint64_t hash = Mix64(key);
    if (rng() % 3 == 0) {
      const uint64_t old = map.Erase(key, hash);
      auto it = ref.find(key);
      CHECK(old == (it == ref.end() ? 0 : it->second));
      if (it != ref.end()) ref.erase(it);
    } else if (uint64_t* v = map.Find(key, hash)) {
      CHECK(ref.count(key) == 1 && ref[key] == *v);
      *v += 1;
      ref[key] += 1;
    } else {
      CHECK(ref.count(key) == 0);
      *map.InsertNew(key, hash) = 1;
      ref[key] = 1;
    }
  }
  CHECK(map.size() == ref.size());
  size_t seen = 0;
  map.ForEach([&](uint64_t key, uint64_t value) {
    CHECK(ref.at(key) == value);
    ++seen;
  });
  CHECK(seen == ref.size());
  // Extreme keys are ordinary keys.
  map.Erase(0, Mix64(0));
  *map.InsertNew(0, Mix64(0)) = 7;
  *map.InsertNew(~0ULL, Mix64(~0ULL)) = 9;
  CHECK(*map.Find(0, Mix64(0)) == 7 && *map.Find(~0ULL, Mix64(~0ULL)) == 9);
  const uint64_t generation = map.generation();
  map.Erase(0, Mix64(0));
  CHECK(map.generation() != generation);
}

void TestHashMapShrinks() {
  details::OpenHashMap<uint64_t> map;
  for (uint64_t k = 1; k <= 100000; ++k) *map.InsertNew(k, Mix64(k)) = k;
  const size_t big = map.bytes();
  for (uint64_t k = 1; k <= 99000; ++k) CHECK(map.Erase(k, Mix64(k)) == k);
  map.MaybeShrink();
  CHECK(map.bytes() < big / 8);
  for (uint64_t k = 99001; k <= 100000; ++k) CHECK(*map.Find(k, Mix64(k)) == k);
}

void TestHashMapJumpsToOneHugePage() {
  using Map = details::OpenHashMap<uint64_t>;
  Map map;
  uint64_t k = 1;
  while (map.capacity() < Map::kSmallCapacity) {
    *map.InsertNew(k, Mix64(k)) = k;
    ++k;
  }
  while (map.size() * 4 < Map::kSmallCapacity * 3) {
    *map.InsertNew(k, Mix64(k)) = k;
    ++k;
  }
  *map.InsertNew(k, Mix64(k)) = k;  // past 3/4 of 16K slots: straight to 2 MiB
  CHECK(map.capacity() == Map::kHugeCapacity);
  CHECK(map.bytes() == (size_t{2} << 20));
  for (uint64_t key = 1; key <= k; ++key) CHECK(*map.Find(key, Mix64(key)) == key);
  for (uint64_t key = 1; key <= k - 5000; ++key) map.Erase(key, Mix64(key));
  map.MaybeShrink();  // 5000 rows: back to 16K slots (3/8 load at most), not 64K
  CHECK(map.capacity() == Map::kSmallCapacity);
  for (uint64_t key = k - 4999; key <= k; ++key) CHECK(*map.Find(key, Mix64(key)) == key);
}

void TestPoolReleasesChunks() {
  details::MemoryPool pool(64, 88);
  std::vector<char*> rows;
  for (int i = 0; i < 100000; ++i) {
    rows.push_back(pool.Allocate());
    std::fill(rows.back(), rows.back() + 64, static_cast<char>(i));
  }
  const size_t chunks = pool.chunks();
  CHECK(chunks == (100000 + pool.rows_per_chunk() - 1) / pool.rows_per_chunk());
  // Free every other row: nothing can be released without compaction.
  std::vector<char*> kept;
  for (size_t i = 0; i < rows.size(); ++i) {
    if (i % 2) {
      pool.Free(rows[i]);
    } else {
      kept.push_back(rows[i]);
    }
  }
  CHECK(pool.chunks() == chunks);
  CHECK(pool.BeginCompaction(0.75));
  size_t moved = 0;
  for (char*& row : kept) {
    if (pool.IsDraining(row)) {
      const char tag = row[0];
      row = pool.Relocate(row);
      CHECK(row[0] == tag && row[63] == tag);
      ++moved;
    }
  }
  pool.EndCompaction();
  CHECK(moved > 0);
  CHECK(pool.chunks() <= chunks / 2 + 1);
  CHECK(pool.rows() == kept.size());
  for (char* row : kept) pool.Free(row);
  CHECK(pool.rows() == 0 && pool.chunks() <= 1);
}

void TestReserveKeepsMemory() {
  using Map = details::OpenHashMap<uint64_t>;
  Map map;
  map.Reserve(100000);  // 3/4 of the capacity holds them: 2^18 slots
  CHECK(map.capacity() == (size_t{1} << 18) && map.size() == 0);
  for (uint64_t k = 1; k <= 100000; ++k) *map.InsertNew(k, Mix64(k)) = k;
  CHECK(map.capacity() == (size_t{1} << 18));  // no rehash on the way
  for (uint64_t k = 1; k <= 99990; ++k) map.Erase(k, Mix64(k));
  map.MaybeShrink();
  CHECK(map.capacity() == (size_t{1} << 18));
  for (uint64_t k = 99991; k <= 100000; ++k) CHECK(*map.Find(k, Mix64(k)) == k);
  for (uint64_t k = 100001; k <= 300000; ++k) *map.InsertNew(k, Mix64(k)) = k;
  CHECK(map.capacity() == (size_t{1} << 19));  // grows past the reserve

  details::MemoryPool pool(64, 88);
  const size_t per_chunk = pool.rows_per_chunk();
  pool.Reserve(3 * per_chunk + 1);
  CHECK(pool.chunks() == 4 && pool.rows() == 0);
  std::vector<char*> rows;
  for (size_t i = 0; i < 6 * per_chunk; ++i) rows.push_back(pool.Allocate());
  CHECK(pool.chunks() == 6);
  // Free all but one row per chunk, then compact: only the 2 chunks above
  // the reserve go back.
  std::vector<char*> kept;
  for (size_t i = 0; i < rows.size(); ++i) {
    if (i % per_chunk == 0) {
      kept.push_back(rows[i]);
    } else {
      pool.Free(rows[i]);
    }
  }
  CHECK(pool.chunks() == 6);
  CHECK(pool.BeginCompaction(0.75));
  for (char*& row : kept) {
    if (pool.IsDraining(row)) row = pool.Relocate(row);
  }
  pool.EndCompaction();
  CHECK(pool.chunks() == 4 && pool.rows() == kept.size());
  CHECK(!pool.BeginCompaction(0.75));  // nothing above the reserve
  for (char* row : kept) pool.Free(row);
  CHECK(pool.chunks() == 4 && pool.rows() == 0);
  for (size_t i = 0; i < 4 * per_chunk; ++i) pool.Allocate();  // the kept chunks serve
  CHECK(pool.chunks() == 4);
}

void TestPendingCounterIsBounded() {
  details::PendingCounter pending(1000);
  for (uint64_t k = 0; k < 100000; ++k) pending.Observe(k, Mix64(k));
  CHECK(pending.size() <= 1000);
  CHECK(pending.forgotten() >= 99000);
  // A key seen often survives the decay of one-off keys.
  for (int i = 0; i < 50; ++i) pending.Observe(424242, Mix64(424242));
  for (uint64_t k = 1000000; k < 1003000; ++k) pending.Observe(k, Mix64(k));
  CHECK(pending.Observe(424242, Mix64(424242)) > 1);
}

void TestPendingCounterSetAndCounts() {
  details::PendingCounter pending(8);
  for (uint64_t k = 1; k <= 3; ++k) pending.Set(k, Mix64(k), static_cast<uint32_t>(k * 2));
  pending.Set(2, Mix64(2), 0);  // forgets
  pending.Set(3, Mix64(3), 5);  // overwrites
  std::vector<std::pair<uint64_t, uint32_t>> counts;
  pending.Counts(&counts);
  std::sort(counts.begin(), counts.end());
  CHECK(counts.size() == 2 && counts[0] == std::make_pair(uint64_t{1}, uint32_t{2}) &&
        counts[1] == std::make_pair(uint64_t{3}, uint32_t{5}));
  CHECK(pending.Observe(3, Mix64(3)) == 6);  // counting goes on from the set value
  for (uint64_t k = 10; k < 30; ++k) pending.Set(k, Mix64(k), 1);  // stays bounded
  CHECK(pending.size() <= 8);
}

// Several threads push +1 gradients for overlapping keys; with SGD, lr 1 and
// zero init every row must end at exactly -(number of pushes of its key).
void TestChangeLogSegmentsAndFloor() {
  details::ChangeLog log;
  for (uint64_t v = 1; v <= 4; ++v) {
    for (uint64_t k = 0; k < 10; ++k) log.Record(k * v, v);
  }
  log.Reserve(1000);  // room only: the records stay as they are
  CHECK(log.size() == 40);
  std::vector<uint64_t> keys;
  log.KeysSince(3, &keys);  // version 4: 0, 4, ..., 36
  CHECK(keys.size() == 10 && keys.front() == 0 && keys.back() == 36);
  keys.clear();
  log.KeysSince(2, &keys);  // versions 3 and 4, deduplicated: 0 and 12, 24 twice
  CHECK(keys.size() == 17 && std::is_sorted(keys.begin(), keys.end()));
  std::vector<std::pair<uint64_t, uint64_t>> records;
  log.RecordsSince(2, &records);
  CHECK(records.size() == 20 && records.front().second == 3 && records.back().second == 4);
  CHECK(log.Covers(0) && log.floor() == 0);
  log.DropOldest(25);  // versions 1 and 2 go
  CHECK(log.size() == 20 && log.floor() == 2 && !log.Covers(1) && log.Covers(2));
  log.Record(99, 2);  // at or below the floor: ignored
  CHECK(log.size() == 20);
  log.Record(7, 3);  // an older version than the newest: the log is cut there
  CHECK(log.floor() == 3 && log.size() == 10);
  log.DropOldest(0);
  CHECK(log.size() == 0 && log.floor() == 4);
  keys.clear();
  log.KeysSince(4, &keys);
  CHECK(keys.empty());
}

void TestConcurrentPushesAreExact() {
  Engine engine(EngineOptions{3});
  const int table = engine.CreateTable(SgdSpec("t", 4));
  constexpr int kThreads = 4, kRounds = 50, kKeys = 2000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::vector<uint64_t> keys(kKeys);
      for (int i = 0; i < kKeys; ++i) keys[i] = static_cast<uint64_t>(i) * 7919;
      std::vector<float> grads(kKeys * 4, 1.0f);
      std::vector<float> out(kKeys * 4);
      for (int r = 0; r < kRounds; ++r) {
        engine.Pull(table, keys.data(), keys.size(), out.data(), true);
        engine.Push(table, keys.data(), keys.size(), grads.data(), t % 2 == 0);
        if (t == 0 && r % 10 == 0) engine.Stats(table);
      }
    });
  }
  for (auto& th : threads) th.join();
  std::vector<uint64_t> keys(kKeys);
  for (int i = 0; i < kKeys; ++i) keys[i] = static_cast<uint64_t>(i) * 7919;
  std::vector<float> out(kKeys * 4);
  engine.Pull(table, keys.data(), keys.size(), out.data(), false);
  for (float v : out) CHECK(v == -static_cast<float>(kThreads * kRounds));
  const TableStats stats = engine.Stats(table);
  CHECK(stats.rows == kKeys);
  CHECK(stats.pushed_keys == uint64_t{kThreads} * kRounds * kKeys);
}

void TestDuplicatesAreSummed() {
  Engine engine(EngineOptions{2});
  TableSpec spec = SgdSpec("t", 2);
  spec.optimizer.kind = OptimizerKind::kAdagrad;
  spec.optimizer.initial_accumulator = 0.1f;
  const int table = engine.CreateTable(spec);
  Engine single(EngineOptions{1});
  const int ref = single.CreateTable(spec);
  const uint64_t keys[] = {5, 9, 5, 5};
  const float grads[] = {1, 2, 3, 4, 5, 6, 7, 8};
  const PushResult r = engine.Push(table, keys, 4, grads);
  CHECK(r.duplicates == 2 && r.applied == 2);
  const uint64_t summed_keys[] = {5, 9};
  const float summed[] = {1 + 5 + 7, 2 + 6 + 8, 3, 4};
  single.Push(ref, summed_keys, 2, summed);
  float a[4], b[4];
  engine.Pull(table, summed_keys, 2, a, false);
  single.Pull(ref, summed_keys, 2, b, false);
  for (int i = 0; i < 4; ++i) CHECK(a[i] == b[i]);
}

// Show and click increments: summed for repeated keys, added after the
// row's decay from its last step; exported as stored, loaded back exactly.
void TestShowsAndClicksDecayLazily() {
  Engine engine(EngineOptions{2});
  TableSpec spec = SgdSpec("t", 2);
  spec.stats_half_life = 10.0;
  const int table = engine.CreateTable(spec);
  const uint64_t keys[] = {5, 9, 5};
  const float grads[6] = {};
  const float shows[] = {1, 1, 1}, clicks[] = {1, 0, 0};
  Engine::TablePart part;
  part.table = table;
  part.keys = keys;
  part.n = 3;
  part.grads = grads;
  part.shows = shows;
  part.clicks = clicks;
  engine.PushMany({part}, false, Engine::Only::kAll, 0);
  part.n = 1;  // key 5 again, ten steps later: one more show and click
  engine.PushMany({part}, false, Engine::Only::kAll, 10);
  uint64_t out_keys[2];
  float out_shows[2], out_clicks[2];
  uint32_t counts[2];
  float weights[4];
  RowColumns cols;
  cols.keys = out_keys;
  cols.weights = weights;
  cols.shows = out_shows;
  cols.clicks = out_clicks;
  cols.counts = counts;
  ExportCursor cursor;
  size_t n = 0;
  while (!cursor.done) {
    RowColumns at = cols;
    at.keys += n;
    at.weights += 2 * n;
    at.shows += n;
    at.clicks += n;
    at.counts += n;
    n += engine.Export(table, 0, 2, &cursor, at);
  }
  CHECK(n == 2);
  for (size_t i = 0; i < n; ++i) {
    if (out_keys[i] == 5) {
      CHECK(out_shows[i] == 2.0f && out_clicks[i] == 1.5f && counts[i] == 2);
    } else {
      CHECK(out_keys[i] == 9 && out_shows[i] == 1.0f && out_clicks[i] == 0.0f && counts[i] == 1);
    }
  }
  Engine other(EngineOptions{3});
  const int t2 = other.CreateTable(spec);
  other.Load(t2, n, cols, 10);
  float again_shows[2], again_clicks[2];
  uint64_t again_keys[2];
  RowColumns back;
  back.keys = again_keys;
  back.shows = again_shows;
  back.clicks = again_clicks;
  ExportCursor second;
  size_t m = 0;
  while (!second.done) {
    RowColumns at = back;
    at.keys += m;
    at.shows += m;
    at.clicks += m;
    m += other.Export(t2, 0, 2, &second, at);
  }
  CHECK(m == n);
  for (size_t i = 0; i < m; ++i) {
    const size_t j = again_keys[i] == out_keys[0] ? 0 : 1;
    CHECK(again_shows[i] == out_shows[j] && again_clicks[i] == out_clicks[j]);
  }
}

// Export while other threads pull (inserts only); evict during growth.
void TestExportLoadAndEvictUnderLoad() {
  Engine engine(EngineOptions{2});
  TableSpec spec = SgdSpec("t", 8);
  spec.eviction.max_rows = 5000;
  const int table = engine.CreateTable(spec);
  std::atomic<bool> stop{false};
  std::thread writer([&] {
    std::mt19937_64 rng(7);
    std::vector<uint64_t> keys(512);
    std::vector<float> out(512 * 8), grads(512 * 8, 0.5f);
    while (!stop.load()) {
      for (auto& k : keys) k = rng() % 20000;
      engine.Pull(table, keys.data(), keys.size(), out.data(), true);
      engine.Push(table, keys.data(), keys.size(), grads.data());
    }
  });
  for (int i = 0; i < 20; ++i) {
    engine.Evict(table);
    std::this_thread::yield();
  }
  stop.store(true);
  writer.join();
  engine.Evict(table);
  CHECK(engine.Stats(table).rows <= 5000);

  // Export everything, load into a 3-shard engine, compare pulls.
  const TableStats stats = engine.Stats(table);
  std::vector<uint64_t> keys(stats.rows);
  std::vector<float> weights(stats.rows * 8);
  std::vector<uint32_t> counts(stats.rows);
  RowColumns cols;
  cols.keys = keys.data();
  cols.weights = weights.data();
  cols.counts = counts.data();
  ExportCursor cursor;
  size_t total = 0;
  while (!cursor.done) {
    RowColumns at = cols;
    at.keys += total;
    at.weights += total * 8;
    at.counts += total;
    total += engine.Export(table, 0, 700, &cursor, at);
  }
  CHECK(total == stats.rows);
  Engine other(EngineOptions{3});
  const int t2 = other.CreateTable(spec);
  other.Load(t2, total, cols);
  std::vector<float> a(total * 8), b(total * 8);
  engine.Pull(table, keys.data(), total, a.data(), false);
  other.Pull(t2, keys.data(), total, b.data(), false);
  CHECK(a == b);
  CHECK(other.Stats(t2).rows == total);
}

void TestDropWhileOthersRun() {
  Engine engine(EngineOptions{2});
  engine.CreateTable(SgdSpec("keep", 4));
  for (int round = 0; round < 20; ++round) {
    const std::string name = "tmp" + std::to_string(round);
    const int id = engine.CreateTable(SgdSpec(name, 4));
    std::thread user([&, id] {
      std::vector<uint64_t> keys(100);
      for (int i = 0; i < 100; ++i) keys[i] = i;
      std::vector<float> out(400);
      try {
        for (int i = 0; i < 50; ++i) engine.Pull(id, keys.data(), keys.size(), out.data(), true);
      } catch (const std::exception&) {
        // the table was dropped under us: an error, never a crash
      }
    });
    engine.DropTable(name);
    user.join();
  }
  CHECK(engine.TableNames() == std::vector<std::string>{"keep"});
}

// Servers and shards from independent hashes: every (server, shard) cell of
// sequential keys gets its share within 5 binomial sigmas. Servers taken
// from the shard's bits (ShardOf(key, N)) leave most cells empty.
void TestServerAndShardAreIndependent() {
  constexpr uint32_t kKeys = 1 << 18;
  for (uint32_t servers : {2u, 3u, 8u}) {
    for (uint32_t shards : {4u, 16u}) {
      const uint32_t cells = servers * shards;
      std::vector<uint32_t> routed(cells, 0), naive(cells, 0);
      for (uint64_t key = 0; key < kKeys; ++key) {
        const uint32_t shard = ShardOf(key, shards);
        ++routed[ServerOf(key, servers) * shards + shard];
        ++naive[ShardOf(key, servers) * shards + shard];
      }
      const double p = 1.0 / cells, mean = kKeys * p, sigma = std::sqrt(kKeys * p * (1 - p));
      for (uint32_t c = 0; c < cells; ++c) CHECK(std::abs(routed[c] - mean) <= 5 * sigma);
      const auto empty = std::count(naive.begin(), naive.end(), 0u);
      CHECK(empty >= static_cast<std::ptrdiff_t>(cells - servers - shards));
    }
  }
  static_assert(ServerOf(0, 16) == 14 && ShardOf(0, 16) == 0);  // as tests/test_routing.py pins
}

// Dropped tables give their slot back: ids are reused with a new generation,
// a dropped table's id raises UnknownTableError and never reaches the table
// that took its slot.
void TestTableIdsAreReusedSafely() {
  Engine engine(EngineOptions{2});
  const int keep = engine.CreateTable(SgdSpec("keep", 2));
  std::vector<int> stale;
  const uint64_t key = 7;
  float row[4];
  for (int i = 0; i < 2000; ++i) {
    TableSpec spec = SgdSpec("t", i % 2 == 0 ? 2 : 4);
    const int id = engine.CreateTable(spec);
    CHECK((id & 0x3fff) == 1);  // the slot dropped last is taken again
    for (int old : stale) CHECK(old != id);
    engine.Push(id, &key, 1, std::vector<float>(spec.dim, -1.0f).data());
    engine.Pull(id, &key, 1, row, false);
    CHECK(row[0] == 1.0f && engine.Dim(id) == spec.dim && engine.Spec(id).name == "t");
    if (i % 100 == 0) stale.push_back(id);
    engine.DropTable("t");
    bool threw = false;
    try {
      engine.Pull(id, &key, 1, row, false);
    } catch (const UnknownTableError& e) {
      threw = std::string(e.what()).find(std::to_string(id)) != std::string::npos;
    }
    CHECK(threw);
  }
  const int last = engine.CreateTable(SgdSpec("t", 2));
  for (int id : stale) {
    bool threw = false;
    try {
      engine.Stats(id);
    } catch (const UnknownTableError&) {
      threw = true;
    }
    CHECK(threw);
  }
  CHECK(engine.TableId("t") == last && engine.TableId("keep") == keep);
  CHECK((engine.TableNames() == std::vector<std::string>{"keep", "t"}));
  bool threw = false;
  try {
    engine.DropTable("gone");
  } catch (const UnknownTableError& e) {
    threw = std::string(e.what()) == "unknown table 'gone' (tables: keep, t)";
  }
  CHECK(threw);
}

// Threads pull and push a table by name while another drops and re-creates
// it (each incarnation with its own dim and constant initial value = dim):
// every call either works on a live table, seeing only that table's values,
// or throws UnknownTableError. Run under TSan and ASan by `make cpp-test`.
void TestDropAndRecreateUnderLoad() {
  Engine engine(EngineOptions{2});
  auto spec_of = [](int dim) {
    TableSpec spec = SgdSpec("t", dim);
    spec.initializer.kind = InitKind::kConstant;
    spec.initializer.value = static_cast<float>(dim);
    return spec;
  };
  TableSpec other = spec_of(3);
  other.name = "other";
  other.initializer.value = -1.0f;
  engine.CreateTable(other);
  engine.CreateTable(spec_of(4));
  std::atomic<bool> stop{false};
  std::atomic<int64_t> ok{0}, unknown{0};
  std::vector<std::thread> users;
  for (int t = 0; t < 3; ++t) {
    users.emplace_back([&, t] {
      std::vector<uint64_t> keys(64);
      for (size_t i = 0; i < keys.size(); ++i) keys[i] = i * 31 + t;
      std::vector<float> out, zeros;
      while (!stop.load()) {
        try {
          const int id = engine.TableId("t");
          const int dim = engine.Dim(id);
          out.assign(keys.size() * dim, 0.0f);
          zeros.assign(keys.size() * dim, 0.0f);
          engine.Push(id, keys.data(), keys.size(), zeros.data());  // creates rows, keeps values
          engine.Pull(id, keys.data(), keys.size(), out.data(), t == 0);
          for (float v : out) CHECK(v == static_cast<float>(dim));
          ++ok;
        } catch (const UnknownTableError&) {
          ++unknown;
          std::this_thread::yield();  // (exceptions are slow under the sanitizers)
        }
      }
    });
  }
  for (int round = 0; round < 300; ++round) {
    engine.DropTable("t");
    engine.CreateTable(spec_of(4 + 4 * (round % 3)));
    // Let the users reach this incarnation (up to 10 ms).
    const int64_t seen = ok.load();
    for (int i = 0; i < 1000 && ok.load() == seen; ++i) {
      std::this_thread::sleep_for(std::chrono::microseconds(10));
    }
  }
  stop.store(true);
  for (auto& u : users) u.join();
  CHECK(ok.load() > 0);
  const uint64_t key = 5;
  float row[3];
  engine.Pull(engine.TableId("other"), &key, 1, row, false);
  CHECK(row[0] == -1.0f);
}

// A slot whose generations are spent is retired: no id is issued twice.
void TestSpentSlotsAreRetired() {
  Engine engine(EngineOptions{1});
  const TableSpec spec = SgdSpec("t", 1);
  for (int generation = 0; generation < (1 << 17); ++generation) {
    CHECK(engine.CreateTable(spec) == generation << 14);  // slot 0 again and again
    engine.DropTable("t");
  }
  CHECK(engine.CreateTable(spec) == 1);  // slot 0 is spent: a new slot
  engine.DropTable("t");
  CHECK(engine.CreateTable(spec) == ((1 << 14) | 1));  // slot 1, generation 1
}

// Versions applied while readers look up: version v writes the value v to
// every key (full, every 5th) or to all but one key in 16, which it removes
// (delta): a lookup must see exactly one version's state.
void TestApplyIsAtomicForReaders() {
  constexpr int kDim = 4;
  constexpr size_t kKeys = 2000;
  Engine engine(EngineOptions{3});
  TableSpec spec = SgdSpec("t", kDim);
  std::vector<uint64_t> keys(kKeys);
  for (size_t i = 0; i < kKeys; ++i) keys[i] = i * 7919 + 1;
  // A version's rows: every key (full), or all but the removed ones (delta).
  auto stage = [&](int handle, float v, bool full) {
    std::vector<uint64_t> written;
    for (size_t i = 0; i < kKeys; ++i) {
      if (full || i % 16 != 0) written.push_back(keys[i]);
    }
    std::vector<float> weights(written.size() * kDim, v);
    std::vector<uint64_t> versions(written.size(), static_cast<uint64_t>(v));
    RowColumns rows;
    rows.keys = written.data();
    rows.weights = weights.data();
    rows.versions = versions.data();
    engine.StageRows(handle, written.size(), rows);
  };
  int id = engine.CommitApply([&] {
    const int h = engine.BeginApply(spec, -1, true);
    stage(h, 1.0f, true);
    return h;
  }());
  std::atomic<bool> stop{false};
  std::atomic<int64_t> reads{0};
  std::vector<std::thread> readers;
  for (int t = 0; t < 3; ++t) {
    readers.emplace_back([&] {
      std::vector<float> out(kKeys * kDim);
      std::vector<uint8_t> found(kKeys);
      while (!stop.load()) {
        engine.Lookup(id, keys.data(), kKeys, out.data(), found.data(), false);
        const float v = out[kDim];  // key 1: never removed
        for (size_t i = 0; i < kKeys; ++i) {
          const bool removed = i % 16 == 0 && static_cast<int>(v) % 5 != 1;  // by a delta
          CHECK(found[i] == (removed ? 0 : 1));
          for (int j = 0; j < kDim; ++j) CHECK(out[i * kDim + j] == (removed ? 0.0f : v));
        }
        CHECK(v >= 1.0f);
        ++reads;
      }
    });
  }
  for (int v = 2; v <= 30; ++v) {
    const bool full = v % 5 == 1;
    const int h = engine.BeginApply(spec, id, full);
    stage(h, static_cast<float>(v), full);
    if (!full) {
      std::vector<uint64_t> gone;
      for (size_t i = 0; i < kKeys; i += 16) gone.push_back(keys[i]);
      engine.StageRemoved(h, gone.data(), gone.size());
    }
    CHECK(engine.CommitApply(h) == id);
  }
  stop.store(true);
  for (std::thread& r : readers) r.join();
  CHECK(reads.load() > 0);
}

// The value of half bits h, computed independently of the converters.
float HalfValue(uint16_t h) {
  const int exp = (h >> 10) & 0x1F;
  const int mant = h & 0x3FF;
  const float sign = (h & 0x8000) != 0 ? -1.0f : 1.0f;
  if (exp == 31) return mant == 0 ? sign * INFINITY : NAN;
  if (exp == 0) return sign * std::ldexp(static_cast<float>(mant), -24);
  return sign * std::ldexp(static_cast<float>(1024 + mant), exp - 25);
}

bool SameHalf(uint16_t a, uint16_t b) {
  const auto is_nan = [](uint16_t h) { return (h & 0x7C00) == 0x7C00 && (h & 0x3FF) != 0; };
  return is_nan(a) || is_nan(b) ? is_nan(a) && is_nan(b) : a == b;
}

bool SameFloat(float a, float b) {
  return std::isnan(a) || std::isnan(b) ? std::isnan(a) && std::isnan(b)
                                        : details::BitsOf(a) == details::BitsOf(b);
}

// Every half decodes exactly, and every converter the compiler offers
// encodes as IEEE round-to-nearest-even with saturation: each half itself,
// the midpoints between neighbours (ties to the even one) and one float
// either side of them, saturation at 65504 (infinities too), NaN.
void TestHalfConversions() {
  std::vector<uint16_t> all(1 << 16);
  for (size_t h = 0; h < all.size(); ++h) all[h] = static_cast<uint16_t>(h);
  std::vector<float> decoded(all.size());
  details::DecodeHalf(all.data(), static_cast<int>(all.size()), decoded.data());
  for (size_t h = 0; h < all.size(); ++h) {
    const float want = HalfValue(all[h]);
    CHECK(SameFloat(decoded[h], want));
    CHECK(SameFloat(details::FloatFromHalfPortable(all[h]), want));
#if WL_HAVE_FLOAT16
    CHECK(SameFloat(details::FloatFromHalfNative(all[h]), want));
#endif
    float one;  // the scalar tail of the block decoders
    details::DecodeHalf(&all[h], 1, &one);
    CHECK(SameFloat(one, want));
  }
  std::vector<float> in;
  std::vector<uint16_t> want;
  const auto add = [&](float x, uint16_t h) {
    in.push_back(x);
    want.push_back(h);
    in.push_back(-x);
    want.push_back(static_cast<uint16_t>(h ^ 0x8000));
  };
  for (uint16_t h = 0; h < 0x7BFF; ++h) {  // finite non-negative halves and the next one
    const float lo = HalfValue(h);
    const float hi = HalfValue(static_cast<uint16_t>(h + 1));
    const float mid = (lo + hi) / 2;  // 12 significant bits: exact
    add(lo, h);
    add(mid, (h & 1) == 0 ? h : static_cast<uint16_t>(h + 1));
    add(std::nextafter(mid, 0.0f), h);
    add(std::nextafter(mid, INFINITY), static_cast<uint16_t>(h + 1));
  }
  const float max = 65504.0f;
  for (float x : {max, std::nextafter(65520.0f, 0.0f), 65520.0f, 1e6f, 3.4e38f, INFINITY}) {
    add(x, details::kHalfMaxBits);
  }
  add(NAN, 0x7E00);
  in.push_back(std::numeric_limits<float>::signaling_NaN());
  want.push_back(0x7E00);
  const int n = static_cast<int>(in.size());
  std::vector<uint16_t> got(in.size());
  details::EncodeHalf(in.data(), n, got.data());  // blocks, as rows are encoded
  for (int i = 0; i < n; ++i) CHECK(SameHalf(got[i], want[i]));
  for (int i = 0; i < n; ++i) {
    uint16_t one;
    details::EncodeHalf(&in[i], 1, &one);  // the scalar tail
    CHECK(SameHalf(one, want[i]));
    CHECK(SameHalf(details::HalfFromFloatPortable(in[i]), want[i]));
#if WL_HAVE_FLOAT16
    CHECK(SameHalf(details::HalfFromFloatNative(in[i]), want[i]));
#endif
  }
  // Normal values: relative error at most 2^-11.
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> exponent(-14.0f, 15.9f);
  for (int i = 0; i < 100000; ++i) {
    const float x = std::exp2(exponent(rng)) * (rng() % 2 != 0 ? 1.0f : -1.0f);
    uint16_t h;
    details::EncodeHalf(&x, 1, &h);
    CHECK(std::fabs(HalfValue(h) - x) <= std::ldexp(std::fabs(x), -11));
  }
}

// int8: |w - decoded| <= scale / 2 (up to float rounding), zero rows decode
// to zeros, NaN stays NaN, infinities saturate to the row's largest value;
// the vector decoder matches the scalar one for every code.
void TestInt8Conversions() {
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int dim = 1; dim <= 70; ++dim) {
    for (int trial = 0; trial < 50; ++trial) {
      std::vector<float> w(dim);
      const float spread = std::exp2(static_cast<float>(static_cast<int>(rng() % 40) - 20));
      for (float& x : w) x = normal(rng) * spread;
      std::vector<char> hot(details::EncodedBytes(Precision::kInt8, dim));
      details::EncodeInt8(w.data(), dim, hot.data());
      float scale;
      std::memcpy(&scale, hot.data(), sizeof(scale));
      float m = 0.0f;
      for (float x : w) m = std::max(m, std::fabs(x));
      CHECK(scale == m / 127.0f);
      std::vector<float> back(dim);
      details::DecodeInt8(hot.data(), dim, back.data());
      for (int j = 0; j < dim; ++j) {
        const float slack = 1e-6f * scale + std::ldexp(std::fabs(w[j]), -23);
        CHECK(std::fabs(back[j] - w[j]) <= scale / 2 + slack);
        const auto q = static_cast<int8_t>(hot[sizeof(float) + j]);
        CHECK(q >= -127 && q <= 127);
        CHECK(back[j] == static_cast<float>(q) * scale);
      }
    }
  }
  std::vector<char> hot(details::EncodedBytes(Precision::kInt8, 19));
  std::vector<float> back(19);
  std::vector<float> zeros(19, 0.0f);
  zeros[3] = -0.0f;
  details::EncodeInt8(zeros.data(), 19, hot.data());
  details::DecodeInt8(hot.data(), 19, back.data());
  for (float x : back) CHECK(details::BitsOf(x) == 0);
  float scale;
  std::memcpy(&scale, hot.data(), sizeof(scale));
  CHECK(scale == 0.0f);
  std::vector<float> odd(19, 0.5f);
  odd[0] = NAN;
  odd[9] = INFINITY;
  odd[17] = -INFINITY;
  odd[18] = -2.0f;
  details::EncodeInt8(odd.data(), 19, hot.data());
  details::DecodeInt8(hot.data(), 19, back.data());
  CHECK(std::isnan(back[0]));
  CHECK(back[9] == -back[17] && back[17] == back[18]);  // 127 * scale
  CHECK(std::fabs(back[18] + 2.0f) <= 1e-6f);
  CHECK(std::fabs(back[1] - 0.5f) <= 1.0f / 127);
  // Every code, through the vector blocks and the scalar tail.
  std::vector<char> codes(sizeof(float) + 256);
  for (float s : {0.0f, 1.0f, 0.37f, 1e-30f, 1e30f}) {
    std::memcpy(codes.data(), &s, sizeof(s));
    for (int c = 0; c < 256; ++c) codes[sizeof(float) + c] = static_cast<char>(c - 128);
    std::vector<float> out(256);
    details::DecodeInt8(codes.data(), 256, out.data());
    for (int c = 0; c < 256; ++c) {
      const auto q = static_cast<int8_t>(c - 128);
      CHECK(SameFloat(out[c], details::Int8Value(q, s)));
      CHECK(q == details::kInt8Nan ? std::isnan(out[c]) : out[c] == static_cast<float>(q) * s);
    }
  }
}

// Hot strides: float32 as before; compressed rows packed, each on the
// fewest cache lines its bytes need, every stride a multiple of 4.
void TestRowStrides() {
  using details::RowLayout;
  CHECK(RowLayout(16, 0, Precision::kFp32).hot_stride == 64);
  CHECK(RowLayout(16, 0, Precision::kFp16).hot_stride == 32);
  CHECK(RowLayout(16, 0, Precision::kInt8).hot_stride == 32);  // 20 bytes
  CHECK(RowLayout(64, 0, Precision::kFp32).hot_stride == 256);
  CHECK(RowLayout(64, 0, Precision::kFp16).hot_stride == 128);
  CHECK(RowLayout(64, 0, Precision::kInt8).hot_stride == 68);
  CHECK(RowLayout(17, 0).hot_stride == 96);  // float32: 32-byte units, unchanged
  for (size_t bytes = 1; bytes <= 400; ++bytes) {
    const size_t stride = RowLayout::PackedHotStride(bytes);
    CHECK(stride >= bytes && stride % 4 == 0 && stride < bytes + 64);
    const size_t fewest = (bytes + 63) / 64;
    for (size_t i = 0; i < 64; ++i) {  // offsets repeat after 64 rows
      const size_t first = i * stride / 64;
      const size_t last = (i * stride + bytes - 1) / 64;
      CHECK(last - first + 1 == fewest);
    }
  }
}

// Stochastic rounding to halves: halves stay, NaN stays NaN, values beyond
// the largest half saturate, and a value between two halves goes to each
// with the probability that makes its mean the value.
void TestStochasticHalves() {
  using details::EncodeHalf;
  using details::EncodeHalfStochastic;
  using details::FloatFromHalfPortable;
  const float exact[] = {0.0f, 1.0f, -0.5f, 65504.0f, 1e5f, -1e5f, std::nanf("")};
  uint16_t want[7], got[7];
  EncodeHalf(exact, 7, want);
  EncodeHalfStochastic(exact, 7, got, 123);
  for (int j = 0; j < 7; ++j) CHECK(want[j] == got[j]);
  // 1 + a quarter of a half's step above 1.0 (2^-10), and a tiny negative
  // value below the smallest subnormal: each mean within 2% of the value.
  for (const float x : {1.0f + 0.25f * 0x1.0p-10f, -0x1.0p-26f}) {
    constexpr int kDraws = 20000;
    const std::vector<float> same(kDraws, x);
    std::vector<uint16_t> halves(kDraws);
    EncodeHalfStochastic(same.data(), kDraws, halves.data(), 99);
    double sum = 0;
    std::set<uint16_t> seen;
    for (const uint16_t h : halves) {
      sum += FloatFromHalfPortable(h);
      seen.insert(h);
    }
    CHECK(seen.size() == 2);
    const double mean = sum / kDraws;
    const double gap =
        std::fabs(FloatFromHalfPortable(*seen.begin()) - FloatFromHalfPortable(*seen.rbegin()));
    CHECK(std::fabs(mean - x) <= 0.02 * gap);
  }
}

// A compressed table loads and answers lookups within its precision; an
// int8 table refuses training calls, naming the table and its precision,
// and an fp16 table trains.
void TestCompressedTables() {
  Engine engine(EngineOptions{2});
  constexpr int kDim = 16;
  constexpr size_t kRows = 1000;
  std::vector<uint64_t> keys(kRows);
  std::vector<float> weights(kRows * kDim);
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 0.1f);
  for (size_t i = 0; i < kRows; ++i) keys[i] = i * 104729 + 3;
  for (float& w : weights) w = normal(rng);
  for (Precision precision : {Precision::kFp16, Precision::kInt8}) {
    TableSpec spec = SgdSpec(std::string("t_") + PrecisionName(precision), kDim);
    spec.precision = precision;
    const int id = engine.CreateTable(spec);
    RowColumns rows;
    rows.keys = keys.data();
    rows.weights = weights.data();
    engine.Load(id, kRows, rows);
    std::vector<float> out(kRows * kDim);
    std::vector<uint8_t> found(kRows);
    engine.Lookup(id, keys.data(), kRows, out.data(), found.data(), false);
    for (size_t i = 0; i < kRows * kDim; ++i) {
      CHECK(std::fabs(out[i] - weights[i]) <= (precision == Precision::kFp16 ? 1e-3f : 4e-3f));
    }
    std::vector<float> pulled(kRows * kDim);
    engine.Pull(id, keys.data(), kRows, pulled.data(), /*train=*/false);
    CHECK(pulled == out);
    const auto refused = [&](auto&& call) {
      try {
        call();
      } catch (const std::invalid_argument& e) {
        const std::string what = e.what();
        return what.find(spec.name) != std::string::npos &&
               what.find(PrecisionName(precision)) != std::string::npos;
      }
      return false;
    };
    if (precision == Precision::kInt8) {  // serves only; fp16 trains
      CHECK(refused([&] { engine.Pull(id, keys.data(), kRows, pulled.data(), true); }));
      CHECK(refused([&] { engine.Push(id, keys.data(), kRows, weights.data()); }));
      CHECK(engine.Stats(id).pushed_keys == 0 && engine.Stats(id).rows == kRows);
    } else {
      engine.Push(id, keys.data(), kRows, weights.data());  // SGD: w - w
      engine.Lookup(id, keys.data(), kRows, out.data(), found.data(), false);
      for (size_t i = 0; i < kRows * kDim; ++i) CHECK(std::fabs(out[i]) <= 1e-3f);
    }
  }
}

// ReadRows gives, for the keys that have a row, every column as Export
// writes it, in the order of the keys (repeats included), and changes
// nothing; on a compressed table too.
void TestReadRowsMatchesExport() {
  Engine engine(EngineOptions{3});
  constexpr int kDim = 4;
  for (Precision precision : {Precision::kFp32, Precision::kFp16}) {
    TableSpec spec = SgdSpec(std::string("r_") + PrecisionName(precision), kDim);
    spec.optimizer.kind = OptimizerKind::kAdam;
    spec.stats_half_life = 5.0;
    spec.precision = precision;
    const int table = engine.CreateTable(spec);
    const int state_dim = StateDim(spec.optimizer.kind, kDim);
    constexpr size_t kRows = 300;
    std::vector<uint64_t> keys(kRows);
    std::vector<float> weights(kRows * kDim), state(kRows * state_dim);
    std::vector<uint32_t> counts(kRows), times(kRows);
    std::vector<uint64_t> steps(kRows), versions(kRows);
    std::vector<float> shows(kRows), clicks(kRows);
    for (size_t i = 0; i < kRows; ++i) {
      keys[i] = i * 7919 + 11;
      for (int d = 0; d < kDim; ++d) weights[i * kDim + d] = 0.25f * static_cast<float>(d + i);
      for (int d = 0; d < state_dim; ++d) state[i * state_dim + d] = static_cast<float>(d) + 0.5f;
      counts[i] = static_cast<uint32_t>(i % 17);
      times[i] = static_cast<uint32_t>(1000 + i);
      steps[i] = 40 + i;
      versions[i] = 1;
      shows[i] = static_cast<float>(i) * 1.5f;
      clicks[i] = static_cast<float>(i % 3);
    }
    RowColumns in{keys.data(),  weights.data(),  state.data(), counts.data(), steps.data(),
                  times.data(), versions.data(), shows.data(), clicks.data()};
    engine.Load(table, kRows, in);
    // What export writes of every row, by key.
    std::vector<uint64_t> ek(kRows), es(kRows), ev(kRows);
    std::vector<float> ew(kRows * kDim), est(kRows * state_dim), esh(kRows), ecl(kRows);
    std::vector<uint32_t> ec(kRows), et(kRows);
    RowColumns exported{ek.data(), ew.data(), est.data(), ec.data(), es.data(),
                        et.data(), ev.data(), esh.data(), ecl.data()};
    ExportCursor cursor;
    CHECK(engine.Export(table, 0, kRows + 1, &cursor, exported) == kRows && cursor.done);
    std::unordered_map<uint64_t, size_t> row_of;
    for (size_t i = 0; i < kRows; ++i) row_of[ek[i]] = i;
    // Present keys in a scrambled order, absent keys, repeats.
    std::vector<uint64_t> asked;
    for (size_t i = 0; i < kRows; i += 3) asked.push_back(keys[(i * 37) % kRows]);
    asked.insert(asked.begin() + 5, 999999937);  // absent
    asked.push_back(keys[4]);
    asked.push_back(keys[4]);
    asked.push_back(3);  // absent
    asked.push_back(keys[0]);
    const size_t n = asked.size();
    std::vector<uint64_t> rk(n), rs(n), rv(n);
    std::vector<float> rw(n * kDim), rst(n * state_dim), rsh(n), rcl(n);
    std::vector<uint32_t> rc(n), rt(n);
    std::vector<uint8_t> found(n, 7);
    RowColumns out{rk.data(), rw.data(), rst.data(), rc.data(), rs.data(),
                   rt.data(), rv.data(), rsh.data(), rcl.data()};
    const TableStats before = engine.Stats(table);
    const size_t m = engine.ReadRows(table, asked.data(), n, out, found.data());
    CHECK(m == n - 2);
    size_t j = 0;
    for (size_t i = 0; i < n; ++i) {
      const auto it = row_of.find(asked[i]);
      CHECK(found[i] == (it != row_of.end() ? 1 : 0));
      if (it == row_of.end()) continue;
      const size_t e = it->second;
      CHECK(rk[j] == asked[i] && rc[j] == ec[e] && rs[j] == es[e] && rt[j] == et[e]);
      CHECK(rv[j] == ev[e] && rsh[j] == esh[e] && rcl[j] == ecl[e]);
      CHECK(std::equal(rw.begin() + j * kDim, rw.begin() + (j + 1) * kDim, ew.begin() + e * kDim));
      CHECK(std::equal(rst.begin() + j * state_dim, rst.begin() + (j + 1) * state_dim,
                       est.begin() + e * state_dim));
      ++j;
    }
    CHECK(j == m);
    const TableStats after = engine.Stats(table);
    CHECK(after.rows == before.rows && after.pulled_keys == before.pulled_keys &&
          after.pending_keys == before.pending_keys && after.inserted == before.inserted);
    CHECK(engine.ReadRows(table, asked.data(), 0, out, found.data()) == 0);
  }
  bool unknown = false;
  try {
    const uint64_t key = 1;
    uint8_t found = 0;
    engine.ReadRows(12345, &key, 1, RowColumns{}, &found);
  } catch (const UnknownTableError&) {
    unknown = true;
  }
  CHECK(unknown);
}

// The data clock: rows are stamped with SetClock's time and TTLs in seconds
// count back from it; 0 returns to the wall clock.
void TestDataClockStampsAndTtl() {
  Engine engine(EngineOptions{2});
  TableSpec spec = SgdSpec("t", 2);
  spec.eviction.ttl_seconds = 3600;
  const int table = engine.CreateTable(spec);
  const uint32_t t0 = 1'700'000'000;
  auto time_of = [&](uint64_t key) {
    uint64_t k = 0;
    uint32_t stamp = 0;
    uint8_t found = 0;
    RowColumns out;
    out.keys = &k;
    out.times = &stamp;
    CHECK(engine.ReadRows(table, &key, 1, out, &found) == 1 && found == 1);
    return stamp;
  };
  const float grads[] = {1, 1};
  CHECK(engine.clock() == 0);
  engine.SetClock(t0);
  CHECK(engine.clock() == t0);
  const uint64_t a = 1, b = 2, c = 3;
  engine.Push(table, &a, 1, grads);
  CHECK(time_of(a) == t0);
  engine.SetClock(t0 + 1800);
  CHECK(engine.Evict(table).ttl == 0);
  engine.SetClock(t0 + 7000);
  engine.Push(table, &b, 1, grads);
  engine.SetClock(t0 + 7200);
  CHECK(engine.Evict(table).ttl == 1);
  uint8_t found[2];
  const uint64_t both[] = {a, b};
  engine.Contains(table, both, 2, found);
  CHECK(found[0] == 0 && found[1] == 1);
  engine.SetClock(0);
  const uint32_t before = static_cast<uint32_t>(std::time(nullptr));
  engine.Push(table, &c, 1, grads);
  const uint32_t stamped = time_of(c);
  CHECK(stamped >= before && stamped <= before + 5);
}

}  // namespace

// Batches large enough that the shards split them in blocks among
// themselves (4 shards on 2 or more cores) give the rows one shard gives:
// pulls, pushes with duplicates, several tables per call, contains, erase.
void TestSplitBatchesMatchOneShard() {
  TableSpec spec = SgdSpec("t", 3);
  spec.optimizer.kind = OptimizerKind::kAdagrad;
  spec.initializer.kind = InitKind::kUniform;
  Engine engine(EngineOptions{4});
  Engine single(EngineOptions{1});
  const int a = engine.CreateTable(spec), ref = single.CreateTable(spec);
  spec.name = "u";
  const int b = engine.CreateTable(spec), ref_b = single.CreateTable(spec);
  std::mt19937_64 rng(7);
  constexpr size_t kKeys = 40000;
  std::vector<uint64_t> keys(kKeys);
  for (uint64_t& k : keys) k = rng() % 30000;  // duplicates too
  std::vector<float> grads(kKeys * 3), out(kKeys * 3), want(kKeys * 3), out_b(kKeys * 3);
  for (float& g : grads) g = static_cast<float>(rng() % 1000) / 1000.0f - 0.5f;
  for (int round = 0; round < 2; ++round) {
    const auto part = [&](int table, float* to) {
      Engine::TablePart p;
      p.table = table;
      p.keys = keys.data();
      p.n = kKeys;
      p.out = to;
      return p;
    };
    engine.PullMany({part(a, out.data()), part(b, out_b.data())}, true);
    single.Pull(ref, keys.data(), kKeys, want.data(), true);
    CHECK(out == want);
    single.Pull(ref_b, keys.data(), kKeys, want.data(), true);
    CHECK(out_b == want);
    const PushResult r = engine.Push(a, keys.data(), kKeys, grads.data());
    const PushResult r_ref = single.Push(ref, keys.data(), kKeys, grads.data());
    CHECK(r.applied == r_ref.applied && r.duplicates == r_ref.duplicates && r.duplicates > 0);
  }
  engine.Pull(a, keys.data(), kKeys, out.data(), false);
  single.Pull(ref, keys.data(), kKeys, want.data(), false);
  CHECK(out == want);
  std::vector<uint64_t> probe(kKeys);
  for (uint64_t& k : probe) k = rng() % 60000;
  std::vector<uint8_t> has(kKeys), has_ref(kKeys);
  engine.Contains(a, probe.data(), kKeys, has.data());
  single.Contains(ref, probe.data(), kKeys, has_ref.data());
  CHECK(has == has_ref);
  CHECK(engine.Erase(a, probe.data(), kKeys) == single.Erase(ref, probe.data(), kKeys));
  CHECK(engine.Stats(a).rows == single.Stats(ref).rows);
}

int main() {
  TestHashMapMatchesReference();
  TestHashMapShrinks();
  TestHashMapJumpsToOneHugePage();
  TestPoolReleasesChunks();
  TestReserveKeepsMemory();
  TestPendingCounterIsBounded();
  TestPendingCounterSetAndCounts();
  TestChangeLogSegmentsAndFloor();
  TestConcurrentPushesAreExact();
  TestDuplicatesAreSummed();
  TestSplitBatchesMatchOneShard();
  TestShowsAndClicksDecayLazily();
  TestExportLoadAndEvictUnderLoad();
  TestDropWhileOthersRun();
  TestServerAndShardAreIndependent();
  TestTableIdsAreReusedSafely();
  TestDropAndRecreateUnderLoad();
  if (!kThreadSanitizer) TestSpentSlotsAreRetired();  // 2^17 creates: seconds under TSan
  TestApplyIsAtomicForReaders();
  TestHalfConversions();
  TestInt8Conversions();
  TestRowStrides();
  TestStochasticHalves();
  TestCompressedTables();
  TestReadRowsMatchesExport();
  TestDataClockStampsAndTtl();
  std::puts("engine_test: all passed");
  return 0;
}
