// Open-addressing hash map from uint64 keys to a small trivially copyable
// value, for one shard (owner thread only).
//
// * Linear probing over 16-byte slots, power-of-two capacity, max load 3/4.
// * Any key value is allowed: a slot is empty when its value equals V{}
//   (a null row pointer, a zero count), so values stored must be non-zero.
// * Deletion shifts the following cluster back: no tombstones, probe lengths
//   stay as if the key had never been inserted.
// * The caller passes Mix64(key), computed once per key; the bucket uses its
//   low bits (the shard used the high bits).
// * generation() changes whenever entries move (rehash or erase), which is
//   what invalidates a slot-index cursor; inserts never move entries.
#pragma once

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <utility>

#include "details/os_memory.h"
#include "wuliang/ps/hash.h"

namespace wuliang::ps::details {

template <class V>
class OpenHashMap {
 public:
  struct Slot {
    uint64_t key;
    V value;
  };

  static constexpr size_t kMinCapacity = 256;
  // Capacities double up to kSmallCapacity, then jump to one huge page's
  // worth of slots: probes land at random, and on 4 KiB pages nearly every
  // one of them is a TLB miss too (a page walk, long under virtualization).
  // At that size the rows themselves fill a 2 MiB pool chunk or more.
  static constexpr size_t kHugeCapacity = (size_t{2} << 20) / sizeof(Slot);
  static constexpr size_t kSmallCapacity = kHugeCapacity / 8;
  static_assert(std::has_single_bit(kHugeCapacity), "capacities must be powers of two");
  static size_t Larger(size_t capacity) {
    const size_t doubled = std::max(kMinCapacity, capacity * 2);
    return doubled > kSmallCapacity && doubled < kHugeCapacity ? kHugeCapacity : doubled;
  }
  static size_t Smaller(size_t capacity) {
    return capacity == kHugeCapacity ? kSmallCapacity : capacity / 2;
  }

  OpenHashMap() = default;
  ~OpenHashMap() { Unmap(); }
  OpenHashMap(const OpenHashMap&) = delete;
  OpenHashMap& operator=(const OpenHashMap&) = delete;

  size_t size() const { return size_; }
  size_t capacity() const { return capacity_; }
  size_t bytes() const { return capacity_ * sizeof(Slot); }
  uint64_t generation() const { return generation_; }
  const Slot& slot(size_t i) const { return slots_[i]; }
  static bool Occupied(const Slot& s) { return !(s.value == V{}); }

  void Prefetch(uint64_t hash) const {
    if (capacity_ != 0) __builtin_prefetch(&slots_[hash & mask_]);
  }

  // The value stored for key, or nullptr.
  const V* Find(uint64_t key, uint64_t hash) const {
    return const_cast<OpenHashMap*>(this)->Find(key, hash);
  }
  V* Find(uint64_t key, uint64_t hash) {
    if (capacity_ == 0) return nullptr;
    for (size_t i = hash & mask_;; i = (i + 1) & mask_) {
      Slot& s = slots_[i];
      if (!Occupied(s)) return nullptr;
      if (s.key == key) return &s.value;
    }
  }

  // Inserts a key known to be absent; returns where to store its (non-zero)
  // value. May rehash.
  V* InsertNew(uint64_t key, uint64_t hash) {
    if ((size_ + 1) * 4 > capacity_ * 3) Rehash(Larger(capacity_));
    size_t i = hash & mask_;
    while (Occupied(slots_[i])) i = (i + 1) & mask_;
    slots_[i].key = key;
    ++size_;
    return &slots_[i].value;
  }

  // Sizes the index for n entries (at most 3/4 full) now, and never shrinks
  // it below that size.
  void Reserve(size_t n) {
    size_t cap = std::max(capacity_, kMinCapacity);
    while (n * 4 > cap * 3) cap = Larger(cap);
    reserved_capacity_ = cap;
    if (cap > capacity_) Rehash(cap);
  }

  // Removes key; returns its value, or V{} if it was absent.
  V Erase(uint64_t key, uint64_t hash) {
    if (capacity_ == 0) return V{};
    for (size_t i = hash & mask_;; i = (i + 1) & mask_) {
      Slot& s = slots_[i];
      if (!Occupied(s)) return V{};
      if (s.key == key) {
        V old = s.value;
        EraseAt(i);
        return old;
      }
    }
  }

  // Calls fn(key, value&) for every entry, in slot order.
  template <class Fn>
  void ForEach(Fn&& fn) {
    for (size_t i = 0; i < capacity_; ++i) {
      if (Occupied(slots_[i])) fn(slots_[i].key, slots_[i].value);
    }
  }
  template <class Fn>
  void ForEach(Fn&& fn) const {
    for (size_t i = 0; i < capacity_; ++i) {
      if (Occupied(slots_[i])) fn(slots_[i].key, static_cast<const V&>(slots_[i].value));
    }
  }

  // Shrinks capacity while the table would stay under 3/8 load (not below
  // the reserved size).
  void MaybeShrink() {
    size_t cap = capacity_;
    while (cap > std::max(kMinCapacity, reserved_capacity_) && size_ * 8 < Smaller(cap) * 3) {
      cap = Smaller(cap);
    }
    if (size_ == 0 && reserved_capacity_ == 0) {
      Unmap();
    } else if (cap < capacity_) {
      Rehash(cap);
    }
  }

  void Clear() {
    Unmap();
    ++generation_;
  }

 private:
  void EraseAt(size_t hole) {
    for (size_t j = (hole + 1) & mask_;; j = (j + 1) & mask_) {
      Slot& s = slots_[j];
      if (!Occupied(s)) break;
      const size_t home = Mix64(s.key) & mask_;
      // s may fill the hole unless its home lies cyclically in (hole, j].
      if (((j - home) & mask_) >= ((j - hole) & mask_)) {
        slots_[hole] = s;
        hole = j;
      }
    }
    slots_[hole] = Slot{};
    --size_;
    ++generation_;
  }

  void Rehash(size_t new_capacity) {
    Slot* old = slots_;
    const size_t old_capacity = capacity_;
    slots_ = static_cast<Slot*>(MapPages(new_capacity * sizeof(Slot), PageAlign(new_capacity)));
    capacity_ = new_capacity;
    mask_ = new_capacity - 1;
    for (size_t k = 0; k < old_capacity; ++k) {
      const Slot& s = old[k];
      if (!Occupied(s)) continue;
      size_t i = Mix64(s.key) & mask_;
      while (Occupied(slots_[i])) i = (i + 1) & mask_;
      slots_[i] = s;
    }
    if (old != nullptr) UnmapPages(old, old_capacity * sizeof(Slot));
    ++generation_;
  }

  static size_t PageAlign(size_t capacity) {
    return capacity * sizeof(Slot) >= (size_t{2} << 20) ? (size_t{2} << 20) : 4096;
  }

  void Unmap() {
    if (slots_ != nullptr) UnmapPages(slots_, bytes());
    slots_ = nullptr;
    capacity_ = mask_ = size_ = 0;
  }

  Slot* slots_ = nullptr;
  size_t reserved_capacity_ = 0;  // MaybeShrink stops here
  size_t capacity_ = 0;
  size_t mask_ = 0;
  size_t size_ = 0;
  uint64_t generation_ = 0;
};

}  // namespace wuliang::ps::details
