// Fixed-size row allocator of one table shard (owner thread only).
//
// A row has two parts that live in the same 2 MiB chunk (huge-page aligned,
// straight from mmap):
//
//   chunk: | header 64 B | hot[0] hot[1] ... hot[R-1] | cold[0] ... cold[R-1] |
//
// The hot part (the weights: all a pull reads) has a stride that keeps a
// 64-byte vector in exactly one cache line; the cold part (meta and optimizer
// state) is only touched by updates. A row is named by its hot pointer; the
// cold part is found from it. Each chunk keeps its own free list, so a chunk
// whose rows are all freed goes back to the OS at once. After evictions leave
// chunks sparsely used, a compaction (driven by the owner of the row
// pointers, see TableShard::Compact) moves the rows of the emptiest chunks
// into holes elsewhere and releases them. Reserve() maps chunks ahead of
// need; the pool then keeps at least that many, emptied or not.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace wuliang::ps::details {

class MemoryPool {
 public:
  static constexpr size_t kChunkBytes = size_t{2} << 20;
  static constexpr size_t kHeaderBytes = 64;

  MemoryPool(size_t hot_stride, size_t cold_stride);
  ~MemoryPool();
  MemoryPool(const MemoryPool&) = delete;
  MemoryPool& operator=(const MemoryPool&) = delete;

  // Maps (and faults in) the chunks for `rows` rows now, and keeps at least
  // that many chunks from then on. Throws std::bad_alloc.
  void Reserve(size_t rows);
  char* Allocate();  // a row's uninitialised hot part; throws std::bad_alloc
  void Free(char* hot);
  char* Cold(const char* hot) const {
    const auto base = reinterpret_cast<uintptr_t>(hot) & ~(kChunkBytes - 1);
    return reinterpret_cast<char*>(base + cold_offset_ + IndexOf(hot, base) * cold_stride_);
  }

  size_t rows() const { return live_rows_; }
  size_t chunks() const { return chunks_.size(); }
  size_t bytes() const { return chunks_.size() * kChunkBytes; }
  size_t rows_per_chunk() const { return rows_per_chunk_; }
  uint64_t chunks_released() const { return chunks_released_; }

  // Compaction: BeginCompaction picks the emptiest chunks whose rows fit in
  // the holes of the others and stops allocating from them; the caller then
  // relocates every row for which IsDraining() is true (Relocate) and calls
  // EndCompaction. Returns false when compaction would not free a chunk.
  bool BeginCompaction(double max_occupancy);
  bool IsDraining(const char* hot) const;
  char* Relocate(char* hot);  // copy to a new place, free the old one
  void EndCompaction();

 private:
  struct Chunk;
  static Chunk* ChunkOf(const char* hot);
  // Row index of hot in the chunk at base. The offset is an exact multiple of
  // the stride, so dividing is a shift and a multiply by the inverse of the
  // stride's odd part (mod 2^64): no division instruction on the hot path.
  size_t IndexOf(const char* hot, uintptr_t base) const {
    const size_t offset = reinterpret_cast<uintptr_t>(hot) - base - kHeaderBytes;
    return (offset >> hot_shift_) * hot_inverse_;
  }
  char* HotAt(Chunk* chunk, size_t index) const;
  char* ColdAt(Chunk* chunk, size_t index) const;
  Chunk* NewChunk();
  void ReleaseChunk(Chunk* chunk);
  void AddPartial(Chunk* chunk);
  void RemovePartial(Chunk* chunk);
  bool CanRelease() const { return chunks_.size() > reserved_chunks_; }

  size_t hot_stride_;
  size_t cold_stride_;
  int hot_shift_;         // trailing zero bits of hot_stride_
  uint64_t hot_inverse_;  // inverse of hot_stride_ >> hot_shift_, mod 2^64
  size_t rows_per_chunk_;
  size_t cold_offset_;  // of the cold region from the chunk start
  size_t live_rows_ = 0;
  size_t reserved_chunks_ = 0;   // never released below this many
  std::vector<Chunk*> chunks_;   // all chunks; Chunk::index is the position
  std::vector<Chunk*> partial_;  // chunks with free rows, except current_
  Chunk* current_ = nullptr;     // allocation happens here first
  uint64_t chunks_released_ = 0;
};

}  // namespace wuliang::ps::details
