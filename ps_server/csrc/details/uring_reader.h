// Batches of reads through io_uring (the kernel's submission and completion
// rings, used through its three system calls, no library).
//
// A thread pool of blocking preads (IoPool) costs a thread wake-up and two
// context switches per read; here one io_uring_enter submits up to kDepth
// reads and waits for completions, so a batch of thousands of reads costs a
// few dozen system calls on the calling thread. Each thread has its own ring
// (made on first use, freed when the thread ends): rings are not shared.
// Where the kernel refuses io_uring (before 5.6, a seccomp filter, the
// io_uring_disabled sysctl), ForThisThread() is null and callers use the
// pool; SetUringEnabled(false) makes it null too (benchmarks compare both).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

namespace wuliang::ps::details {

// One record to read: `bytes` at `offset` of `fd` into `out`. The read
// covers [offset, offset + bytes) rounded out to multiples of `align` (a
// power of two: O_DIRECT's sector size), which must fit in 8 KiB.
struct RecordRead {
  int fd;
  size_t offset;
  size_t bytes;
  size_t align;
  char* out;
};

class UringReader {
 public:
  static constexpr unsigned kDepth = 64;  // reads in flight

  // This thread's ring, or null where io_uring cannot be used.
  static UringReader* ForThisThread();

  ~UringReader();
  UringReader(const UringReader&) = delete;
  UringReader& operator=(const UringReader&) = delete;

  // Reads every record. A read the kernel fails or cuts short is handed to
  // retry(i) once all others are done (no read is in flight then, so retry
  // may throw: a blocking read that reports the file's error).
  void ReadAll(const RecordRead* reads, size_t n, const std::function<void(size_t)>& retry);

 private:
  UringReader() = default;
  bool Setup();
  unsigned Reap(const RecordRead* reads, std::vector<size_t>* failed, unsigned wait);

  int fd_ = -1;
  void* sq_map_ = nullptr;
  size_t sq_map_bytes_ = 0;
  void* cq_map_ = nullptr;  // == sq_map_ with a single mapping
  size_t cq_map_bytes_ = 0;
  void* sqes_ = nullptr;
  size_t sqes_bytes_ = 0;
  // Pointers into the rings.
  unsigned* sq_head_ = nullptr;
  unsigned* sq_tail_ = nullptr;
  unsigned* sq_mask_ = nullptr;
  unsigned* sq_array_ = nullptr;
  unsigned* cq_head_ = nullptr;
  unsigned* cq_tail_ = nullptr;
  unsigned* cq_mask_ = nullptr;
  void* cqes_ = nullptr;
  char* buffers_ = nullptr;      // kDepth aligned buffers of kBufferBytes
  std::vector<unsigned> free_;   // buffer slots not in flight
  std::vector<size_t> slot_of_;  // read index of each slot in flight
};

// Off: ForThisThread() returns null from now on (and back on when true).
// Returns the previous setting.
bool SetUringEnabled(bool enabled);

}  // namespace wuliang::ps::details
