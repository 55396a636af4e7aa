// Cold index: key -> 32-bit locator of a row kept on disk (docs/disk_tier.md),
// for one table shard (owner thread only).
//
// * 12-byte slots (key, locator) in open addressing with linear probing,
//   at most 90% full; a slot is empty when its locator is kEmpty, so any key
//   is allowed and a locator is below kEmpty.
// * 64 segments, chosen by hash bits 26..31 (the shard takes the high 32
//   bits, the hot index the low bits), each growing by itself (doubling).
//   Initial capacities are spread over one octave (segment i:
//   kBase * 2^(i/64)), and any capacity works (a slot's home is a
//   multiply-shift of the remixed hash), so the segments double one after
//   another as keys arrive and the index stays about 0.9 * ln 2 = 62% full
//   at every size: about 19 bytes a key, where one table that doubles
//   swings between 45% and 90% full.
// * Deletion shifts the following cluster back (no tombstones).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <new>

#include "details/os_memory.h"
#include "wuliang/ps/hash.h"

namespace wuliang::ps::details {

class ColdIndex {
 public:
  static constexpr uint32_t kEmpty = UINT32_MAX;
  static constexpr int kSegmentBits = 6;
  static constexpr size_t kSegments = size_t{1} << kSegmentBits;
  static constexpr size_t kBase = 64;

#pragma pack(push, 1)
  struct Slot {
    uint64_t key;
    uint32_t locator;
  };
#pragma pack(pop)
  static_assert(sizeof(Slot) == 12);

  ColdIndex() {
    for (size_t i = 0; i < kSegments; ++i) {
      segments_[i].initial =
          static_cast<size_t>(std::floor(kBase * std::exp2(static_cast<double>(i) / kSegments)));
    }
  }
  ~ColdIndex() { Clear(); }
  ColdIndex(const ColdIndex&) = delete;
  ColdIndex& operator=(const ColdIndex&) = delete;

  size_t size() const { return size_; }
  size_t bytes() const {
    size_t total = sizeof(*this);
    for (const Segment& s : segments_) total += s.capacity * sizeof(Slot);
    return total;
  }

  // The locator of key (hash: Mix64(key)), or kEmpty.
  uint32_t Find(uint64_t key, uint64_t hash) const {
    const Segment& seg = segments_[SegmentOf(hash)];
    if (seg.capacity == 0) return kEmpty;
    for (size_t i = Home(hash, seg.capacity);; i = Next(i, seg.capacity)) {
      const Slot& s = seg.slots[i];
      if (s.locator == kEmpty) return kEmpty;
      if (s.key == key) return s.locator;
    }
  }

  void Prefetch(uint64_t hash) const {
    const Segment& seg = segments_[SegmentOf(hash)];
    if (seg.capacity != 0) __builtin_prefetch(&seg.slots[Home(hash, seg.capacity)]);
  }

  // Sets key's locator (inserting the key if absent); returns the previous
  // locator, or kEmpty. locator < kEmpty. Throws std::bad_alloc.
  uint32_t Set(uint64_t key, uint64_t hash, uint32_t locator) {
    Segment& seg = segments_[SegmentOf(hash)];
    if ((seg.size + 1) * 10 > seg.capacity * 9) Grow(&seg);
    size_t i = Home(hash, seg.capacity);
    for (;; i = Next(i, seg.capacity)) {
      Slot& s = seg.slots[i];
      if (s.locator == kEmpty) break;
      if (s.key == key) {
        const uint32_t old = s.locator;
        s.locator = locator;
        return old;
      }
    }
    seg.slots[i] = Slot{key, locator};
    ++seg.size;
    ++size_;
    return kEmpty;
  }

  // Removes key; returns its locator, or kEmpty if it was absent.
  uint32_t Erase(uint64_t key, uint64_t hash) {
    Segment& seg = segments_[SegmentOf(hash)];
    if (seg.capacity == 0) return kEmpty;
    for (size_t i = Home(hash, seg.capacity);; i = Next(i, seg.capacity)) {
      Slot& s = seg.slots[i];
      if (s.locator == kEmpty) return kEmpty;
      if (s.key == key) {
        const uint32_t old = s.locator;
        EraseAt(&seg, i);
        return old;
      }
    }
  }

  // Calls fn(key, locator&) for every entry (fn may change the locator).
  template <class Fn>
  void ForEach(Fn&& fn) {
    for (Segment& seg : segments_) {
      for (size_t i = 0; i < seg.capacity; ++i) {
        if (seg.slots[i].locator != kEmpty) fn(seg.slots[i].key, seg.slots[i].locator);
      }
    }
  }

  void Clear() {
    for (Segment& seg : segments_) {
      Free(seg.slots, seg.capacity);
      seg.slots = nullptr;
      seg.capacity = seg.size = 0;
    }
    size_ = 0;
  }

 private:
  struct Segment {
    Slot* slots = nullptr;
    size_t capacity = 0;
    size_t size = 0;
    size_t initial = kBase;
  };

  static size_t SegmentOf(uint64_t hash) { return (hash >> 26) & (kSegments - 1); }
  // Multiply-shift of the hash remixed by an odd constant: every bit counts.
  static size_t Home(uint64_t hash, size_t capacity) {
    const uint64_t x = hash * 0x9E3779B97F4A7C15ULL;
    return static_cast<size_t>((static_cast<unsigned __int128>(x) * capacity) >> 64);
  }
  static size_t Next(size_t i, size_t capacity) { return i + 1 == capacity ? 0 : i + 1; }
  // Cyclic distance from a to b going forward.
  static size_t Distance(size_t a, size_t b, size_t capacity) {
    return b >= a ? b - a : b + capacity - a;
  }

  static Slot* Allocate(size_t capacity) {
    const size_t bytes = capacity * sizeof(Slot);
    Slot* slots;
    if (bytes >= (size_t{2} << 20)) {
      slots = static_cast<Slot*>(MapPages(bytes, size_t{2} << 20));
    } else {
      slots = static_cast<Slot*>(std::malloc(bytes));
      if (slots == nullptr) throw std::bad_alloc();
    }
    for (size_t i = 0; i < capacity; ++i) slots[i].locator = kEmpty;
    return slots;
  }
  static void Free(Slot* slots, size_t capacity) {
    if (slots == nullptr) return;
    const size_t bytes = capacity * sizeof(Slot);
    if (bytes >= (size_t{2} << 20)) {
      UnmapPages(slots, bytes);
    } else {
      std::free(slots);
    }
  }

  void Grow(Segment* seg) {
    const size_t capacity = seg->capacity == 0 ? seg->initial : seg->capacity * 2;
    Slot* slots = Allocate(capacity);
    for (size_t k = 0; k < seg->capacity; ++k) {
      const Slot& s = seg->slots[k];
      if (s.locator == kEmpty) continue;
      size_t i = Home(Mix64(s.key), capacity);
      while (slots[i].locator != kEmpty) i = Next(i, capacity);
      slots[i] = s;
    }
    Free(seg->slots, seg->capacity);
    seg->slots = slots;
    seg->capacity = capacity;
  }

  void EraseAt(Segment* seg, size_t hole) {
    const size_t cap = seg->capacity;
    for (size_t j = Next(hole, cap);; j = Next(j, cap)) {
      Slot& s = seg->slots[j];
      if (s.locator == kEmpty) break;
      const size_t home = Home(Mix64(s.key), cap);
      // s may fill the hole unless its home lies cyclically in (hole, j].
      if (Distance(home, j, cap) >= Distance(hole, j, cap)) {
        seg->slots[hole] = s;
        hole = j;
      }
    }
    seg->slots[hole].locator = kEmpty;
    --seg->size;
    --size_;
  }

  Segment segments_[kSegments];
  size_t size_ = 0;
};

}  // namespace wuliang::ps::details
