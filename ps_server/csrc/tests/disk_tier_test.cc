// C++ tests of the disk tier's parts: the cold index against a reference
// map (and its bytes per key), row files (append, read back one by one and
// many at once, stale records, compaction's reads, reuse of dropped files'
// numbers, a refused write). Built and run under the sanitizers by `make test`.
#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "check.h"
#include "details/cold_index.h"
#include "details/row_file.h"
#include "details/uring_reader.h"
#include "wuliang/ps/engine.h"
#include "wuliang/ps/hash.h"

using namespace wuliang::ps;
using details::ColdIndex;
using details::IoPool;
using details::RowFile;

namespace {

std::string TempDir(const char* name) {
  const char* base = std::getenv("TMPDIR");
  std::string dir = std::string(base != nullptr ? base : "/tmp") + "/wuliang-" + name + "-" +
                    std::to_string(::getpid());
  std::filesystem::remove_all(dir);
  return dir;
}

void TestColdIndexMatchesReference() {
  ColdIndex index;
  std::unordered_map<uint64_t, uint32_t> ref;
  std::mt19937_64 rng(3);
  for (int i = 0; i < 300000; ++i) {
    const uint64_t key = rng() % 20000;  // small key space: many erases hit
    const uint64_t hash = Mix64(key);
    const int op = static_cast<int>(rng() % 3);
    if (op == 0) {
      const uint32_t loc = static_cast<uint32_t>(rng() % ColdIndex::kEmpty);
      auto it = ref.find(key);
      CHECK(index.Set(key, hash, loc) == (it == ref.end() ? ColdIndex::kEmpty : it->second));
      ref[key] = loc;
    } else if (op == 1) {
      auto it = ref.find(key);
      CHECK(index.Erase(key, hash) == (it == ref.end() ? ColdIndex::kEmpty : it->second));
      if (it != ref.end()) ref.erase(it);
    } else {
      auto it = ref.find(key);
      CHECK(index.Find(key, hash) == (it == ref.end() ? ColdIndex::kEmpty : it->second));
    }
    CHECK(index.size() == ref.size());
  }
  size_t seen = 0;
  index.ForEach([&](uint64_t key, uint32_t& loc) {
    CHECK(ref.at(key) == loc);
    ++seen;
  });
  CHECK(seen == ref.size());
  index.Clear();
  CHECK(index.size() == 0 && index.Find(1, Mix64(1)) == ColdIndex::kEmpty);
}

// Bytes per key stay near 12 / (0.9 ln 2) = 19.2 at every size, never
// swinging with a doubling (a single doubling table would reach 27).
void TestColdIndexBytesPerKeyStayFlat() {
  ColdIndex index;
  uint64_t key = 0;
  double worst = 0;
  for (size_t n = 1 << 16; n <= (size_t{1} << 21); n = n * 5 / 4) {
    while (index.size() < n) {
      ++key;
      index.Set(key * 0x9E3779B97F4A7C15ULL, Mix64(key * 0x9E3779B97F4A7C15ULL),
                static_cast<uint32_t>(key));
    }
    const double per_key = static_cast<double>(index.bytes()) / static_cast<double>(n);
    worst = std::max(worst, per_key);
  }
  std::printf("cold index: at most %.1f bytes per key from 65K to 2M keys\n", worst);
  CHECK(worst <= 22.0);
}

std::vector<char> RecordOf(uint64_t key, size_t bytes) {
  std::vector<char> record(bytes);
  for (size_t i = 0; i < bytes; ++i) record[i] = static_cast<char>(Mix64(key + i) & 0xFF);
  std::memcpy(record.data(), &key, sizeof(key));
  return record;
}

void TestRowFileRoundTrip() {
  const std::string dir = TempDir("rowfile");
  IoPool pool(8);
  {
    constexpr size_t kBytes = 168;                      // dim 16 with Adagrad
    RowFile file(dir, kBytes, &pool, size_t{2} << 20);  // small files: several of them
    CHECK(file.records_per_file() == (size_t{2} << 20) / 4096 * (4096 / kBytes));
    const size_t n = 3 * file.records_per_file() + 1000;  // the last file partly in the buffer
    std::vector<uint32_t> locs(n);
    for (size_t k = 0; k < n; ++k) locs[k] = file.Append(RecordOf(k, kBytes).data());
    std::vector<char> out(kBytes);
    for (size_t k = 0; k < n; k += 97) {
      file.Read(locs[k], out.data());
      CHECK(out == RecordOf(k, kBytes));
    }
    for (bool ring : {true, false}) {  // io_uring where the kernel allows it, and the pool
      const bool was = details::SetUringEnabled(ring);
      std::vector<char> many(n * kBytes);
      file.ReadMany(locs.data(), n, many.data());
      for (size_t k = 0; k < n; ++k) {
        CHECK(std::memcmp(many.data() + k * kBytes, RecordOf(k, kBytes).data(), kBytes) == 0);
      }
      details::SetUringEnabled(was);
    }
    // Reads done away from the owner: one on disk, one still in the buffer.
    RowFile::Place place{};
    CHECK(file.Detach(locs[5], out.data(), &place) && file.detached() == 1);
    std::vector<char> away(kBytes);
    file.ReadDetached(place, away.data());
    CHECK(away == RecordOf(5, kBytes));
    CHECK(!file.Detach(locs[n - 1], out.data(), &place) && out == RecordOf(n - 1, kBytes));
    file.Reattach(1);
    CHECK(file.detached() == 0);
    details::RowFileStats stats = file.Stats();
    CHECK(stats.files == 4 && stats.live == n && stats.stale == 0);
    CHECK(file.CompactionCandidate() == -1);
    // A third of file 1 goes stale: it is the candidate; its records come back in order.
    const uint32_t per = file.records_per_file();
    for (uint32_t s = 0; s < per / 3 + 1; ++s) file.Release(locs[per + s]);
    CHECK(file.CompactionCandidate() == 1);
    uint32_t visited = 0;
    CHECK(file.ReadFile(1, 0, [&](uint32_t loc, const char* record) {
      CHECK(loc == locs[per + visited]);
      CHECK(std::memcmp(record, RecordOf(per + visited, kBytes).data(), kBytes) == 0);
      return ++visited < per / 2;  // stops half-way
    }) == per / 2 - 1);
    CHECK(file.ReadFile(1, per / 2 - 1, [&](uint32_t loc, const char*) {
      CHECK(loc == locs[per + visited - 1]);
      ++visited;
      return true;
    }) == per);  // resumed where it stopped
    CHECK(visited == per + 1 && file.records_in(1) == per);
    // The current file's tail is read from the buffer.
    uint32_t tail = 0;
    file.ReadFile(3, 0, [&](uint32_t, const char* record) {
      CHECK(std::memcmp(record, RecordOf(3 * per + tail, kBytes).data(), kBytes) == 0);
      ++tail;
      return true;
    });
    CHECK(tail == 1000);
    file.DropFile(1);
    stats = file.Stats();
    CHECK(stats.files == 3 && stats.files_compacted == 1);
    CHECK(!std::filesystem::exists(dir + "/00000001.rows") && !file.has_file(1));
    CHECK(file.file_numbers() == 4 && file.has_file(3));
    // Appends fill the current file, then reuse number 1.
    std::vector<uint32_t> more;
    for (size_t k = 0; k < per; ++k) more.push_back(file.Append(RecordOf(n + k, kBytes).data()));
    CHECK(more.back() / per == 1);
    file.Read(more.back(), out.data());
    CHECK(out == RecordOf(n + per - 1, kBytes));
    std::printf("row files: O_DIRECT %s\n", stats.direct ? "yes" : "no (buffered)");
  }
  CHECK(std::filesystem::is_empty(dir));  // files deleted on close
  std::filesystem::remove_all(dir);
}

// A write the disk refuses (here: past the file size limit) raises naming
// the directory, and what was written before reads back intact.
void TestRowFileRefusedWrite() {
  const std::string dir = TempDir("rowfile-full");
  std::signal(SIGXFSZ, SIG_IGN);
  rlimit old{};
  getrlimit(RLIMIT_FSIZE, &old);
  rlimit small = old;
  small.rlim_cur = size_t{2} << 20;
  CHECK(setrlimit(RLIMIT_FSIZE, &small) == 0);
  bool threw = false;
  {
    RowFile file(dir, 100, nullptr, size_t{4} << 20);
    std::vector<uint32_t> locs;
    try {
      for (uint64_t k = 0; k < 100000; ++k) locs.push_back(file.Append(RecordOf(k, 100).data()));
    } catch (const std::runtime_error& e) {
      threw = std::string(e.what()).find(dir) != std::string::npos;
      std::printf("refused write: %s\n", e.what());
    }
    std::vector<char> out(100);
    for (size_t k = 0; k < locs.size(); k += 101) {
      file.Read(locs[k], out.data());
      CHECK(out == RecordOf(k, 100));
    }
  }
  setrlimit(RLIMIT_FSIZE, &old);
  std::signal(SIGXFSZ, SIG_DFL);
  CHECK(threw);
  std::filesystem::remove_all(dir);
}

void TestIoPoolRunsEveryItemOnce() {
  IoPool pool(4);
  for (size_t n : {0, 1, 3, 1000}) {
    std::vector<std::atomic<int>> hits(n);
    pool.ParallelFor(n, [&](size_t i) { hits[i].fetch_add(1); });
    for (auto& h : hits) CHECK(h.load() == 1);
  }
  std::vector<std::thread> callers;  // several callers at once
  std::atomic<int> total{0};
  for (int c = 0; c < 4; ++c) {
    callers.emplace_back([&] {
      for (int r = 0; r < 50; ++r) pool.ParallelFor(64, [&](size_t) { total.fetch_add(1); });
    });
  }
  for (auto& t : callers) t.join();
  CHECK(total.load() == 4 * 50 * 64);
}

// An engine whose rows mostly live on disk, under concurrent calls: a
// trainer's prefetches and pulls on one thread (the prefetch's reads on it
// while the workers run), its pushes on another; then every row is there.
void TestEngineTierUnderConcurrentCalls() {
  const std::string dir = TempDir("engine-tier");
  {
    EngineOptions options;
    options.num_shards = 2;
    options.disk_dir = dir;
    options.memory_bytes = 64 << 10;
    options.io_threads = 8;
    Engine engine(options);
    TableSpec spec;
    spec.name = "t";
    spec.dim = 4;
    spec.optimizer.kind = OptimizerKind::kAdagrad;
    const int table = engine.CreateTable(spec);
    constexpr int kSteps = 60;
    constexpr size_t kKeys = 2000;
    std::vector<std::vector<uint64_t>> batches(kSteps);
    std::mt19937_64 rng(5);
    for (auto& b : batches) {
      for (size_t i = 0; i < kKeys; ++i) b.push_back(rng() % 30000);
      std::sort(b.begin(), b.end());
      b.erase(std::unique(b.begin(), b.end()), b.end());
    }
    std::atomic<int> pulled{-1};
    std::thread pusher([&] {
      std::vector<float> grads(kKeys * 4, 0.01f);
      for (int step = 0; step < kSteps; ++step) {
        while (pulled.load() < step) std::this_thread::yield();
        Engine::TablePart part;
        part.table = table;
        part.keys = batches[step].data();
        part.n = batches[step].size();
        part.grads = grads.data();
        engine.PushMany({part}, true, Engine::Only::kAll, step);
      }
    });
    std::vector<float> out(kKeys * 4);
    for (int step = 0; step < kSteps; ++step) {
      Engine::TablePart part;
      part.table = table;
      part.keys = batches[step].data();
      part.n = batches[step].size();
      engine.PrefetchMany({part});
      part.out = out.data();
      engine.PullMany({part}, true, step);
      pulled.store(step);
    }
    pusher.join();
    std::vector<uint64_t> all;
    for (const auto& b : batches) all.insert(all.end(), b.begin(), b.end());
    std::sort(all.begin(), all.end());
    all.erase(std::unique(all.begin(), all.end()), all.end());
    const TableStats stats = engine.Stats(table);
    std::printf("engine tier: %llu rows, %llu on disk, %llu prefetched, %llu read in calls\n",
                static_cast<unsigned long long>(stats.rows),
                static_cast<unsigned long long>(stats.cold_rows),
                static_cast<unsigned long long>(stats.cold_prefetched),
                static_cast<unsigned long long>(stats.cold_reads));
    CHECK(stats.rows == all.size() && stats.cold_rows > all.size() / 2);
    CHECK(stats.cold_prefetched > 0 && stats.disk_error.empty());
  }
  std::filesystem::remove_all(dir);
}

// Calls that leave a shard a little over its budget return before its rows
// are demoted: the worker demotes between calls. Tables dropped, re-created
// and an engine destroyed while that work is pending or running (the
// sanitizer builds check the lifetimes), and the rows stay exact.
void TestDemotionBetweenCallsAgainstDropAndClose() {
  const std::string dir = TempDir("idle-demotion");
  TableSpec spec;
  spec.name = "t";
  spec.dim = 4;
  spec.optimizer.kind = OptimizerKind::kSgd;
  constexpr size_t kKeys = 1000;
  std::vector<uint64_t> keys(kKeys);
  for (size_t i = 0; i < kKeys; ++i) keys[i] = i + 1;
  std::vector<float> out(kKeys * 4), first(kKeys * 4);
  for (int round = 0; round < 3; ++round) {
    EngineOptions options;
    options.num_shards = 2;
    options.disk_dir = dir;
    options.memory_bytes = 48 * 830;  // 48 bytes a row: the last calls end 20% over
    Engine engine(options);
    uint64_t between = 0;
    for (int again = 0; again < 20; ++again) {
      const int table = engine.CreateTable(spec);
      for (size_t lo = 0; lo < kKeys; lo += 100) {  // each call a little over
        Engine::TablePart part;
        part.table = table;
        part.keys = keys.data() + lo;
        part.n = 100;
        part.out = first.data() + lo * 4;
        engine.PullMany({part}, true, again);
      }
      Engine::TablePart all;
      all.table = table;
      all.keys = keys.data();
      all.n = kKeys;
      all.out = out.data();
      engine.PullMany({all}, false, again);  // every row read back, from RAM or disk
      CHECK(out == first);                   // as created, wherever they are
      between += engine.Stats(table).demoted_between_calls;
      engine.DropTable("t");  // demotion pending or running on the workers
    }
    if (round == 0)
      std::printf("demotion between calls: %llu rows\n", static_cast<unsigned long long>(between));
    CHECK(between > 0);
    engine.CreateTable(spec);
    Engine::TablePart part;
    part.table = engine.TableId("t");
    part.keys = keys.data();
    part.n = kKeys;
    part.out = out.data();
    engine.PullMany({part}, true, 0);
  }  // destroyed with demotion pending
  std::filesystem::remove_all(dir);
}

}  // namespace

// A batch of reads through the ring: every record lands where asked, and a
// read the kernel fails (a closed descriptor) goes to retry, once, after.
void TestUringReaderReadsAndRetries() {
  details::UringReader* ring = details::UringReader::ForThisThread();
  if (ring == nullptr) {
    std::printf("disk_tier_test: io_uring unavailable here, its test skipped\n");
    return;
  }
  const std::string dir = TempDir("uring");
  std::filesystem::create_directories(dir);
  const std::string path = dir + "/blocks";
  constexpr size_t kSize = 64 * 4096;
  std::vector<char> content(kSize);
  for (size_t i = 0; i < kSize; ++i) content[i] = static_cast<char>(i * 7 + i / 4096);
  FILE* f = std::fopen(path.c_str(), "wb");
  CHECK(f != nullptr && std::fwrite(content.data(), 1, kSize, f) == kSize);
  std::fclose(f);
  const int fd = ::open(path.c_str(), O_RDONLY);
  CHECK(fd >= 0);
  constexpr size_t kBytes = 168, kReads = 1000;  // more than the ring's depth
  std::mt19937_64 rng(3);
  std::vector<details::RecordRead> reads;
  std::vector<std::vector<char>> outs(kReads + 1, std::vector<char>(kBytes));
  for (size_t i = 0; i < kReads; ++i) {
    const size_t block = rng() % 64, slot = rng() % (4096 / kBytes);
    reads.push_back({fd, block * 4096 + slot * kBytes, kBytes, 512, outs[i].data()});
  }
  reads.push_back({-1, 0, kBytes, 512, outs[kReads].data()});  // fails: EBADF
  std::vector<size_t> retried;
  ring->ReadAll(reads.data(), reads.size(), [&](size_t i) { retried.push_back(i); });
  CHECK(retried.size() == 1 && retried[0] == kReads);
  for (size_t i = 0; i < kReads; ++i) {
    CHECK(std::memcmp(outs[i].data(), content.data() + reads[i].offset, kBytes) == 0);
  }
  ::close(fd);
  std::filesystem::remove_all(dir);
}

int main() {
  TestColdIndexMatchesReference();
  TestColdIndexBytesPerKeyStayFlat();
  TestIoPoolRunsEveryItemOnce();
  TestUringReaderReadsAndRetries();
  TestRowFileRoundTrip();
  TestRowFileRefusedWrite();
  TestEngineTierUnderConcurrentCalls();
  TestDemotionBetweenCallsAgainstDropAndClose();
  std::printf("disk_tier_test: ok\n");
  return 0;
}
