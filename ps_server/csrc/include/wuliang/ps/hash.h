// Key hashing shared by the engine, the reader's key preparation and clients.
//
// One 64-bit mixer decides where a key lives and where it sits:
//   shard  = high 32 bits of Mix64(key), scaled to [0, num_shards)
//   bucket = low bits of Mix64(key) & (capacity - 1)
//   server = high 32 bits of Mix64(key + kServerSalt), scaled to [0, num_servers)
// Disjoint bits keep the bucket distribution inside a shard uniform, and the
// server's hash is independent of both (see ServerOf), so a server's keys
// spread over all of its shards and buckets.
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

// Shard of a key whose Mix64 is `hash`: multiply-shift ("fastrange") of its
// high 32 bits, floor(high32 * num_shards / 2^32), instead of a modulo.
constexpr uint32_t ShardOfHash(uint64_t hash, uint32_t num_shards) noexcept {
  return static_cast<uint32_t>(((hash >> 32) * num_shards) >> 32);
}

// Checkpoints and the reader's key preparation depend on these values:
// never change them.
constexpr uint32_t ShardOf(uint64_t key, uint32_t num_shards) noexcept {
  return ShardOfHash(Mix64(key), num_shards);
}

// splitmix64's increment (2^64 / golden ratio, odd).
inline constexpr uint64_t kServerSalt = 0x9e3779b97f4a7c15ULL;

// Parameter server of a key among num_servers; inside it the key lives in
// shard ShardOf(key, S). The server must not be read from Mix64(key): the
// servers would split its high bits into bands, and ShardOf maps one band to
// only about S / num_servers shards, leaving the others empty on every server.
// Mix64(key) and Mix64(key + kServerSalt) are two consecutive outputs of the
// splitmix64 generator at state `key` (each step adds kServerSalt), and
// consecutive splitmix64 outputs behave as independent (the generator passes
// BigCrush), so (server, shard, bucket) is uniform over all combinations, for
// random keys and sequential ids alike (tests/test_routing.py checks every
// (server, shard) cell).
constexpr uint32_t ServerOf(uint64_t key, uint32_t num_servers) noexcept {
  return ShardOfHash(Mix64(key + kServerSalt), num_servers);
}

// Writes the shard of each key: shards[i] = ShardOf(keys[i], num_shards).
void ShardOfBatch(const uint64_t* keys,  // (n,)
                  size_t n, uint32_t num_shards,
                  uint32_t* shards);  // (n,)

// Writes the server of each key: servers[i] = ServerOf(keys[i], num_servers).
void ServerOfBatch(const uint64_t* keys,  // (n,)
                   size_t n, uint32_t num_servers,
                   uint32_t* servers);  // (n,)

}  // namespace wuliang::ps
