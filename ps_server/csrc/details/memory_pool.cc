#include "details/memory_pool.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <new>

#include "details/os_memory.h"

namespace wuliang::ps::details {

namespace {

constexpr uint32_t kNoRow = UINT32_MAX;
constexpr size_t kPrefetchRows = 8;  // fresh rows warmed ahead of allocation

size_t RoundUp(size_t x, size_t to) { return (x + to - 1) / to * to; }

// x * OddInverse(x) == 1 (mod 2^64) for odd x, by Newton's iteration.
uint64_t OddInverse(uint64_t x) {
  uint64_t inverse = x;  // correct to 3 bits; each step doubles that
  for (int i = 0; i < 5; ++i) inverse *= 2 - x * inverse;
  return inverse;
}

}  // namespace

struct alignas(64) MemoryPool::Chunk {
  uint32_t free_head;   // index of the first free row; its cold part links on
  uint32_t live;        // allocated rows
  uint32_t bump;        // rows [bump, rows_per_chunk) were never handed out
  uint32_t index;       // position in chunks_
  int32_t partial_pos;  // position in partial_, -1 if absent
  bool draining;        // being emptied by a compaction

  char* base() { return reinterpret_cast<char*>(this); }
};

MemoryPool::MemoryPool(size_t hot_stride, size_t cold_stride)
    : hot_stride_(hot_stride),
      cold_stride_(std::max(cold_stride, sizeof(uint32_t))),
      hot_shift_(std::countr_zero(hot_stride)),
      hot_inverse_(OddInverse(hot_stride >> std::countr_zero(hot_stride))) {
  static_assert(sizeof(Chunk) <= kHeaderBytes);
  const size_t per_row = hot_stride_ + cold_stride_;
  size_t rows = (kChunkBytes - 2 * kHeaderBytes) / per_row;
  while (rows > 0 &&
         RoundUp(kHeaderBytes + rows * hot_stride_, 64) + rows * cold_stride_ > kChunkBytes) {
    --rows;
  }
  if (rows == 0) throw std::bad_alloc();  // a row larger than a chunk
  rows_per_chunk_ = rows;
  cold_offset_ = RoundUp(kHeaderBytes + rows * hot_stride_, 64);
}

MemoryPool::~MemoryPool() {
  for (Chunk* c : chunks_) UnmapPages(c, kChunkBytes);
}

MemoryPool::Chunk* MemoryPool::ChunkOf(const char* hot) {
  return reinterpret_cast<Chunk*>(reinterpret_cast<uintptr_t>(hot) & ~(kChunkBytes - 1));
}

char* MemoryPool::HotAt(Chunk* c, size_t index) const {
  return c->base() + kHeaderBytes + index * hot_stride_;
}

char* MemoryPool::ColdAt(Chunk* c, size_t index) const {
  return c->base() + cold_offset_ + index * cold_stride_;
}

MemoryPool::Chunk* MemoryPool::NewChunk() {
  auto* c = static_cast<Chunk*>(MapPages(kChunkBytes, kChunkBytes));
  c->free_head = kNoRow;
  c->live = 0;
  c->bump = 0;
  c->index = static_cast<uint32_t>(chunks_.size());
  c->partial_pos = -1;
  c->draining = false;
  chunks_.push_back(c);
  return c;
}

void MemoryPool::ReleaseChunk(Chunk* c) {
  RemovePartial(c);
  if (c == current_) current_ = nullptr;
  Chunk* last = chunks_.back();
  chunks_[c->index] = last;
  last->index = c->index;
  chunks_.pop_back();
  UnmapPages(c, kChunkBytes);
  ++chunks_released_;
}

void MemoryPool::AddPartial(Chunk* c) {
  if (c->partial_pos >= 0 || c == current_ || c->draining) return;
  c->partial_pos = static_cast<int32_t>(partial_.size());
  partial_.push_back(c);
}

void MemoryPool::RemovePartial(Chunk* c) {
  if (c->partial_pos < 0) return;
  Chunk* last = partial_.back();
  partial_[c->partial_pos] = last;
  last->partial_pos = c->partial_pos;
  partial_.pop_back();
  c->partial_pos = -1;
}

void MemoryPool::Reserve(size_t rows) {
  reserved_chunks_ = std::max(reserved_chunks_, (rows + rows_per_chunk_ - 1) / rows_per_chunk_);
  chunks_.reserve(reserved_chunks_);
  partial_.reserve(reserved_chunks_);
  while (chunks_.size() < reserved_chunks_) AddPartial(NewChunk());
}

char* MemoryPool::Allocate() {
  Chunk* c = current_;
  if (c == nullptr || (c->free_head == kNoRow && c->bump == rows_per_chunk_)) {
    if (!partial_.empty()) {
      c = partial_.back();
      RemovePartial(c);
    } else {
      c = NewChunk();
    }
    current_ = c;
  }
  size_t index;
  if (c->free_head != kNoRow) {
    index = c->free_head;
    std::memcpy(&c->free_head, ColdAt(c, index), sizeof(uint32_t));
  } else {
    index = c->bump++;
    // Rows are handed out in address order: warm the lines of the ones a
    // few allocations ahead for writing (fresh memory is not in cache).
    const size_t ahead = index + kPrefetchRows;
    if (ahead < rows_per_chunk_) {
      __builtin_prefetch(HotAt(c, ahead), 1);
      __builtin_prefetch(ColdAt(c, ahead), 1);
      __builtin_prefetch(ColdAt(c, ahead) + cold_stride_ - 1, 1);
    }
  }
  ++c->live;
  ++live_rows_;
  return HotAt(c, index);
}

void MemoryPool::Free(char* hot) {
  Chunk* c = ChunkOf(hot);
  const auto index = static_cast<uint32_t>(IndexOf(hot, reinterpret_cast<uintptr_t>(c)));
  std::memcpy(ColdAt(c, index), &c->free_head, sizeof(uint32_t));
  c->free_head = index;
  --c->live;
  --live_rows_;
  if (c->live == 0 && c != current_ && CanRelease()) {
    ReleaseChunk(c);
  } else {
    AddPartial(c);
  }
}

bool MemoryPool::BeginCompaction(double max_occupancy) {
  const size_t capacity = chunks_.size() * rows_per_chunk_;
  if (chunks_.size() < 2 || !CanRelease() || live_rows_ > max_occupancy * capacity) return false;
  const size_t releasable = chunks_.size() - reserved_chunks_;
  std::vector<Chunk*> by_live(chunks_);
  std::sort(by_live.begin(), by_live.end(),
            [](const Chunk* a, const Chunk* b) { return a->live < b->live; });
  // Drain the emptiest chunks while the rest can hold their rows.
  size_t keep = by_live.size();
  size_t moved = 0;
  size_t free_in_kept = capacity - live_rows_;
  for (Chunk* c : by_live) {
    const size_t holes_in_c = rows_per_chunk_ - c->live;
    if (keep <= 1 || by_live.size() - keep == releasable ||
        moved + c->live > free_in_kept - holes_in_c) {
      break;
    }
    free_in_kept -= holes_in_c;
    moved += c->live;
    --keep;
    c->draining = true;
    RemovePartial(c);
    if (c == current_) current_ = nullptr;
  }
  return keep < by_live.size();
}

bool MemoryPool::IsDraining(const char* hot) const { return ChunkOf(hot)->draining; }

char* MemoryPool::Relocate(char* hot) {
  char* moved = Allocate();
  std::memcpy(moved, hot, hot_stride_);
  std::memcpy(Cold(moved), Cold(hot), cold_stride_);
  Free(hot);
  return moved;
}

void MemoryPool::EndCompaction() {
  // Chunks still holding rows (none if the caller relocated all) rejoin.
  for (size_t i = 0; i < chunks_.size();) {
    Chunk* c = chunks_[i];
    if (c->draining) {
      c->draining = false;
      if (c->live == 0 && CanRelease()) {
        ReleaseChunk(c);
        continue;  // chunks_[i] now holds another chunk
      }
      AddPartial(c);
    }
    ++i;
  }
}

}  // namespace wuliang::ps::details
