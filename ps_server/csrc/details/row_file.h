// Row files: the cold rows of one table shard on disk (docs/disk_tier.md).
//
// Fixed-size records appended to numbered files <dir>/NNNNNNNN.rows of at
// most file_bytes each. No record straddles a 4 KiB block (4096 / size
// records a block, the rest padding), so reading one costs one operation on
// the sectors that hold it. A record is named by a 32-bit locator: file *
// records_per_file + slot; a deleted file's number is reused, so locators
// stay within the files that exist.
//
// Appends go to a 1 MiB aligned buffer written whole; a record still in the
// buffer is read from it. Files are opened with O_DIRECT where the file
// system allows it (reads and writes bypass the page cache), buffered
// otherwise (direct() says which). Each file counts its live records;
// Release marks one stale, and the caller compacts a file whose third is
// stale (CompactionCandidate, ReadFile, DropFile).
//
// Owner thread only, except ReadMany's reads, which run in the owner's
// io_uring ring or on an IoPool's threads while the owner waits. The files are scratch (a
// checkpoint never refers to them): the directory is emptied when a RowFile opens it and its files
// are deleted when it closes.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "details/uring_reader.h"

namespace wuliang::ps::details {

// Threads that run blocking reads, so that many are in flight at once.
class IoPool {
 public:
  explicit IoPool(int threads);
  ~IoPool();
  IoPool(const IoPool&) = delete;
  IoPool& operator=(const IoPool&) = delete;

  int threads() const { return static_cast<int>(threads_.size()); }
  // Runs fn(i) for every i in [0, n) on the pool's threads and the caller;
  // returns when all have run. If fn throws, the items not yet started are
  // skipped and the first exception is rethrown here.
  void ParallelFor(size_t n, const std::function<void(size_t)>& fn);

 private:
  struct Job;
  void Loop();
  static void Work(Job* job);

  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::shared_ptr<Job>> jobs_;
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

struct RowFileStats {
  uint64_t files = 0;
  uint64_t live = 0;             // records that rows point to
  uint64_t stale = 0;            // records written, no longer pointed to
  uint64_t bytes_on_disk = 0;    // of the files that exist
  uint64_t bytes_written = 0;    // since opened
  uint64_t records_read = 0;     // since opened
  uint64_t files_compacted = 0;  // files dropped after compaction
  bool direct = false;           // O_DIRECT in use
};

class RowFile {
 public:
  static constexpr size_t kBlockBytes = 4096;
  static constexpr size_t kBufferBytes = size_t{1} << 20;
  static constexpr uint32_t kNoLocator = UINT32_MAX;

  // Creates dir (and its parents) or empties it. Throws std::runtime_error
  // naming dir when it cannot.
  RowFile(std::string dir, size_t record_bytes, IoPool* pool, size_t file_bytes = size_t{64} << 20);
  ~RowFile();  // deletes its files
  RowFile(const RowFile&) = delete;
  RowFile& operator=(const RowFile&) = delete;

  size_t record_bytes() const { return record_bytes_; }
  uint32_t records_per_file() const { return records_per_file_; }
  const std::string& dir() const { return dir_; }

  // Appends a record; returns its locator. Throws std::runtime_error naming
  // the directory when the disk refuses the write (full, I/O error); the
  // record is then not written and no locator is given.
  uint32_t Append(const char* record);
  // The record at loc into out (record_bytes).
  void Read(uint32_t loc, char* out) const;

  // A read done away from the owner (Engine::PrefetchMany): Detach, on the
  // owner, copies the record at once if it is still in the write buffer
  // (returns false), else gives where it is on disk (returns true) and
  // keeps every file open until Reattach; ReadDetached then reads it on
  // any thread. Files are not dropped while reads are detached.
  struct Place {
    int fd;
    size_t offset;
  };
  bool Detach(uint32_t loc, char* out, Place* place);
  void ReadDetached(const Place& place, char* out) const;
  // The read of a detached record, for a batch of reads (UringReader).
  RecordRead ReadOf(const Place& place, char* out) const {
    return RecordRead{place.fd, place.offset, record_bytes_, align_.load(), out};
  }
  void CountReads(size_t n) const { records_read_.fetch_add(n, std::memory_order_relaxed); }
  void Reattach(size_t reads) { detached_ -= reads; }
  size_t detached() const { return detached_; }
  // Records locs[i] into out + i * record_bytes, many reads in flight
  // (io_uring where the kernel allows it, else the pool).
  void ReadMany(const uint32_t* locs, size_t n, char* out) const;
  // The record at loc is no longer pointed to.
  void Release(uint32_t loc);

  // A file whose stale records are at least a third of those written and
  // which is not the one being appended to, the most stale first; -1: none.
  int64_t CompactionCandidate() const;
  // Numbers below this may name files (has_file says which).
  uint32_t file_numbers() const { return static_cast<uint32_t>(files_.size()); }
  bool has_file(uint32_t f) const { return f < files_.size() && files_[f].fd >= 0; }
  uint32_t records_in(uint32_t f) const { return files_[f].written; }
  // Calls fn(locator, record) for the records of file f from slot `first`
  // on, reading it in 1 MiB sequential chunks, until fn returns false;
  // returns the first slot not visited.
  uint32_t ReadFile(uint32_t f, uint32_t first,
                    const std::function<bool(uint32_t, const char*)>& fn) const;
  // Deletes file f (its live records were appended again); its number is
  // reused.
  void DropFile(uint32_t f);

  RowFileStats Stats() const;

 private:
  struct File {
    int fd = -1;
    uint32_t written = 0;  // records appended
    uint32_t live = 0;
  };

  size_t OffsetOf(uint32_t slot) const {
    return (slot / per_block_) * kBlockBytes + (slot % per_block_) * record_bytes_;
  }
  void OpenNextFile();
  void FlushBuffer();
  std::string PathOf(uint32_t f) const;
  [[noreturn]] void Fail(const std::string& what, int error) const;
  void ReadAt(int fd, size_t offset, char* out) const;

  std::string dir_;
  size_t record_bytes_;
  IoPool* pool_;
  size_t per_block_;
  uint32_t records_per_file_;
  size_t file_bytes_;
  bool direct_ = true;
  mutable std::atomic<size_t> align_{512};  // O_DIRECT alignment, raised on EINVAL
  std::vector<File> files_;                 // by number; fd -1: none
  std::vector<uint32_t> free_;              // numbers of dropped files
  int64_t current_ = -1;                    // the file being appended to
  uint32_t next_slot_ = 0;                  // in current_
  char* buffer_ = nullptr;                  // kBufferBytes, aligned
  size_t buffer_start_ = 0;                 // file offset of the buffer's first byte
  uint64_t bytes_written_ = 0;
  mutable std::atomic<uint64_t> records_read_{0};
  uint64_t files_compacted_ = 0;
  size_t detached_ = 0;  // reads given away and not yet reattached
};

// The disk's own random-read rate, as fio measures it: reads of
// `read_bytes` at random `read_bytes`-aligned offsets of a file of
// `file_bytes` in dir (written first, deleted after) for `seconds`, with
// O_DIRECT where allowed, as many in flight as the tier keeps: through
// io_uring at its depth (UringReader::kDepth) where the kernel allows it
// and depth > 1,
// else `depth` threads of preads. Returns reads per second.
double MeasureRandomReads(const std::string& dir, size_t file_bytes, size_t read_bytes, int depth,
                          double seconds, bool* direct);

}  // namespace wuliang::ps::details
