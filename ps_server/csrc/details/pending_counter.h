// Sighting counts of keys waiting for admission, in bounded memory.
//
// Exact while fewer than `capacity` keys are pending. At capacity every count
// is halved and keys that reach zero are forgotten (one-off keys go first,
// keys seen often keep most of their count); if that frees too little, all
// pending counts are forgotten. Forgotten keys are counted.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "details/hash_map.h"

namespace wuliang::ps::details {

class PendingCounter {
 public:
  explicit PendingCounter(size_t capacity) : capacity_(capacity < 1 ? 1 : capacity) {}

  // Counts one sighting of key; returns its count including this one.
  uint32_t Observe(uint64_t key, uint64_t hash);
  void Forget(uint64_t key, uint64_t hash) { map_.Erase(key, hash); }
  // Sets a key's count (a checkpoint's); 0 forgets the key.
  void Set(uint64_t key, uint64_t hash, uint32_t count);
  // Appends every (key, count).
  void Counts(std::vector<std::pair<uint64_t, uint32_t>>* out) const;

  size_t size() const { return map_.size(); }
  size_t bytes() const { return map_.bytes(); }
  uint64_t forgotten() const { return forgotten_; }

 private:
  void Decay();

  size_t capacity_;
  OpenHashMap<uint32_t> map_;
  uint64_t forgotten_ = 0;
};

}  // namespace wuliang::ps::details
