// Key hashing shared by the engine, the reader's key preparation and clients.
//
// One 64-bit mixer decides both where a key lives and where it sits:
//   shard  = high 32 bits of Mix64(key), scaled to [0, num_shards)
//   bucket = low bits of Mix64(key) & (capacity - 1)
// Using disjoint bits keeps the bucket distribution inside a shard uniform.
#pragma once

#include <cstddef>
#include <cstdint>

namespace wuliang::ps {

// Stafford's "Mix13" finalizer (as in splitmix64): a bijection on uint64 with
// full avalanche, so sequential ids spread over shards and buckets.
constexpr uint64_t Mix64(uint64_t x) noexcept {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

// Shard of a key whose Mix64 is `hash`; multiply-shift instead of modulo.
constexpr uint32_t ShardOfHash(uint64_t hash, uint32_t num_shards) noexcept {
  return static_cast<uint32_t>(((hash >> 32) * num_shards) >> 32);
}

constexpr uint32_t ShardOf(uint64_t key, uint32_t num_shards) noexcept {
  return ShardOfHash(Mix64(key), num_shards);
}

// Writes the shard of each key: shards[i] = ShardOf(keys[i], num_shards).
void ShardOfBatch(const uint64_t* keys,  // (n,)
                  size_t n, uint32_t num_shards,
                  uint32_t* shards);  // (n,)

}  // namespace wuliang::ps
