// Open-addressing key -> id map for deduplicating batches of keys, reused
// across calls. Slots are valid only when their epoch is the current one, so
// starting over (Reset) costs nothing. The caller passes Mix64(key)
// (wuliang/ps/hash.h), computed once per key. Used by key preparation and by
// the training bridge's index_in (wuliang/embedding/kernels.h); one table per
// thread.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace wuliang::reader {

class DedupTable {
 public:
  // Empties the table, sized for `expected` keys (load at most 1/2).
  void Reset(size_t expected) {
    size_t capacity = 64;
    while (capacity < 2 * expected) capacity <<= 1;
    if (capacity > slots_.size() || ++epoch_ == 0) {
      slots_.assign(std::max(capacity, slots_.size()), Slot{0, 0, 0});
      epoch_ = 1;
    }
    mask_ = capacity - 1;
  }

  void Prefetch(uint64_t hash) const { __builtin_prefetch(&slots_[hash & mask_]); }

  bool Contains(uint64_t key, uint64_t hash) const {
    for (size_t i = hash & mask_;; i = (i + 1) & mask_) {
      const Slot& s = slots_[i];
      if (s.epoch != epoch_) return false;
      if (s.key == key) return true;
    }
  }

  // The id of key, or -1.
  int64_t Find(uint64_t key, uint64_t hash) const {
    for (size_t i = hash & mask_;; i = (i + 1) & mask_) {
      const Slot& s = slots_[i];
      if (s.epoch != epoch_) return -1;
      if (s.key == key) return s.id;
    }
  }

  // Returns the id of key, assigning next_id when it is new.
  uint32_t Insert(uint64_t key, uint64_t hash, uint32_t next_id, bool* inserted) {
    for (size_t i = hash & mask_;; i = (i + 1) & mask_) {
      Slot& s = slots_[i];
      if (s.epoch != epoch_) {
        s = Slot{key, next_id, epoch_};
        *inserted = true;
        return next_id;
      }
      if (s.key == key) {
        *inserted = false;
        return s.id;
      }
    }
  }

 private:
  struct Slot {
    uint64_t key;
    uint32_t id;
    uint32_t epoch;
  };
  std::vector<Slot> slots_;
  size_t mask_ = 0;
  uint32_t epoch_ = 0;
};

}  // namespace wuliang::reader
