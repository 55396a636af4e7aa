#include "wuliang/reader/prepare.h"

#include <stdexcept>
#include <string>

#include "wuliang/ps/hash.h"
#include "wuliang/reader/dedup_table.h"

namespace wuliang::reader {
namespace {

// Per-thread scratch memory, reached through the reference a non-inlined
// call returns: in a shared library GCC re-derives a thread_local's address
// (a __tls_get_addr call) inside loops rather than keep it in a register.
struct Scratch {
  DedupTable dedup;
  std::vector<uint64_t> value_hashes;  // of one feature's values
  std::vector<uint64_t> hashes;        // of uniques, by provisional id
  std::vector<uint32_t> shard;         // of uniques, by provisional id
  std::vector<int32_t> local;          // position within its shard
};

[[gnu::noinline]] Scratch& ThreadScratch() {
  thread_local Scratch scratch;
  return scratch;
}

}  // namespace

void PrepareKeys(FeatureKeys* features, size_t num_features, int num_tables, uint32_t num_shards,
                 uint32_t num_servers, std::vector<TableKeys>* tables) {
  if (num_shards == 0) throw std::invalid_argument("num_shards must be >= 1");
  if (num_servers == 0) throw std::invalid_argument("num_servers must be >= 1");
  std::vector<size_t> values_per_table(num_tables, 0);
  for (size_t f = 0; f < num_features; ++f) {
    const int t = features[f].table;
    if (t < 0 || t >= num_tables) {
      throw std::invalid_argument("feature " + std::to_string(f) + " maps to table index " +
                                  std::to_string(t) + ", expected [0, " +
                                  std::to_string(num_tables) + ")");
    }
    values_per_table[t] += features[f].n;
  }
  tables->assign(num_tables, TableKeys{});
  constexpr size_t kAhead = 16;  // prefetch distance into the dedup table
  Scratch& s = ThreadScratch();
  DedupTable& dedup = s.dedup;
  std::vector<uint64_t>& value_hashes = s.value_hashes;
  std::vector<uint64_t>& hashes = s.hashes;
  std::vector<uint32_t>& shard = s.shard;
  std::vector<int32_t>& local = s.local;
  for (int t = 0; t < num_tables; ++t) {
    const size_t n = values_per_table[t];
    if (n >= (size_t{1} << 31)) {
      throw std::invalid_argument("table index " + std::to_string(t) + " has 2^31 or more values");
    }
    TableKeys& out = (*tables)[t];
    dedup.Reset(n);
    hashes.clear();
    std::vector<uint64_t> provisional;
    provisional.reserve(n);
    // 1. Deduplicate in first-seen order; inverse holds provisional ids.
    for (size_t f = 0; f < num_features; ++f) {
      FeatureKeys& fk = features[f];
      if (fk.table != t) continue;
      value_hashes.resize(fk.n);
      for (size_t i = 0; i < fk.n; ++i) value_hashes[i] = ps::Mix64(fk.values[i]);
      for (size_t i = 0; i < fk.n; ++i) {
        if (i + kAhead < fk.n) dedup.Prefetch(value_hashes[i + kAhead]);
        const uint64_t key = fk.values[i];
        const uint64_t hash = value_hashes[i];
        bool inserted;
        const auto next = static_cast<uint32_t>(provisional.size());
        const uint32_t id = dedup.Insert(key, hash, next, &inserted);
        if (inserted) {
          provisional.push_back(key);
          hashes.push_back(hash);
        }
        fk.inverse[i] = static_cast<int32_t>(id);
      }
    }
    const size_t u = provisional.size();
    const uint32_t cells = num_servers * num_shards;
    out.shard_offsets.assign(cells + 1, 0);
    if (cells == 1) {
      out.shard_offsets[1] = static_cast<int64_t>(u);
      out.uniques = std::move(provisional);
      continue;
    }
    // 2. Group uniques by shard (stable counting sort).
    shard.resize(u);
    local.resize(u);
    for (size_t k = 0; k < u; ++k) {
      shard[k] = ps::ShardOfHash(hashes[k], num_shards);
      if (num_servers > 1) shard[k] += ps::ServerOf(provisional[k], num_servers) * num_shards;
      local[k] = static_cast<int32_t>(out.shard_offsets[shard[k] + 1]++);
    }
    for (uint32_t s = 0; s < cells; ++s) out.shard_offsets[s + 1] += out.shard_offsets[s];
    out.uniques.resize(u);
    for (size_t k = 0; k < u; ++k) {
      local[k] += static_cast<int32_t>(out.shard_offsets[shard[k]]);  // now the final position
      out.uniques[local[k]] = provisional[k];
    }
    // 3. Point the inverses at the final positions.
    for (size_t f = 0; f < num_features; ++f) {
      FeatureKeys& fk = features[f];
      if (fk.table != t) continue;
      for (size_t i = 0; i < fk.n; ++i) fk.inverse[i] = local[fk.inverse[i]];
    }
  }
}

}  // namespace wuliang::reader
