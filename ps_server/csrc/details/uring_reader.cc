#include "details/uring_reader.h"

#include <linux/io_uring.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <memory>

namespace wuliang::ps::details {
namespace {

constexpr size_t kBufferBytes = 8192;  // a record's aligned span: two 4 KiB blocks at most

std::atomic<bool> enabled{true};
std::atomic<bool> unavailable{false};  // the kernel said no once: it will again

int Setup(unsigned entries, io_uring_params* params) {
  return static_cast<int>(::syscall(__NR_io_uring_setup, entries, params));
}

int Enter(int fd, unsigned to_submit, unsigned min_complete, unsigned flags) {
  return static_cast<int>(
      ::syscall(__NR_io_uring_enter, fd, to_submit, min_complete, flags, nullptr, 0));
}

void* MapRing(int fd, size_t bytes, off_t what) {
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, what);
  return p == MAP_FAILED ? nullptr : p;
}

template <class T>
T* At(void* base, uint32_t offset) {
  return reinterpret_cast<T*>(static_cast<char*>(base) + offset);
}

}  // namespace

bool SetUringEnabled(bool on) { return enabled.exchange(on); }

UringReader* UringReader::ForThisThread() {
  if (!enabled.load(std::memory_order_relaxed) || unavailable.load(std::memory_order_relaxed)) {
    return nullptr;
  }
  thread_local std::unique_ptr<UringReader> reader;
  thread_local bool tried = false;
  if (!tried) {
    tried = true;
    std::unique_ptr<UringReader> made(new UringReader());
    if (made->Setup()) {
      reader = std::move(made);
    } else {
      unavailable.store(true, std::memory_order_relaxed);
    }
  }
  return reader.get();
}

bool UringReader::Setup() {
  io_uring_params params;
  std::memset(&params, 0, sizeof(params));
  fd_ = details::Setup(kDepth, &params);
  if (fd_ < 0) return false;
  sq_map_bytes_ = params.sq_off.array + params.sq_entries * sizeof(unsigned);
  cq_map_bytes_ = params.cq_off.cqes + params.cq_entries * sizeof(io_uring_cqe);
  const bool single = (params.features & IORING_FEAT_SINGLE_MMAP) != 0;
  if (single) sq_map_bytes_ = cq_map_bytes_ = std::max(sq_map_bytes_, cq_map_bytes_);
  sq_map_ = MapRing(fd_, sq_map_bytes_, IORING_OFF_SQ_RING);
  cq_map_ = single ? sq_map_ : MapRing(fd_, cq_map_bytes_, IORING_OFF_CQ_RING);
  sqes_bytes_ = params.sq_entries * sizeof(io_uring_sqe);
  sqes_ = MapRing(fd_, sqes_bytes_, IORING_OFF_SQES);
  buffers_ = static_cast<char*>(std::aligned_alloc(4096, size_t{kDepth} * kBufferBytes));
  if (sq_map_ == nullptr || cq_map_ == nullptr || sqes_ == nullptr || buffers_ == nullptr) {
    return false;  // the destructor unmaps what was mapped
  }
  sq_head_ = At<unsigned>(sq_map_, params.sq_off.head);
  sq_tail_ = At<unsigned>(sq_map_, params.sq_off.tail);
  sq_mask_ = At<unsigned>(sq_map_, params.sq_off.ring_mask);
  sq_array_ = At<unsigned>(sq_map_, params.sq_off.array);
  cq_head_ = At<unsigned>(cq_map_, params.cq_off.head);
  cq_tail_ = At<unsigned>(cq_map_, params.cq_off.tail);
  cq_mask_ = At<unsigned>(cq_map_, params.cq_off.ring_mask);
  cqes_ = At<void>(cq_map_, params.cq_off.cqes);
  slot_of_.assign(kDepth, 0);
  return true;
}

UringReader::~UringReader() {
  if (sqes_ != nullptr) ::munmap(sqes_, sqes_bytes_);
  if (cq_map_ != nullptr && cq_map_ != sq_map_) ::munmap(cq_map_, cq_map_bytes_);
  if (sq_map_ != nullptr) ::munmap(sq_map_, sq_map_bytes_);
  if (fd_ >= 0) ::close(fd_);
  std::free(buffers_);
}

unsigned UringReader::Reap(const RecordRead* reads, std::vector<size_t>* failed, unsigned wait) {
  if (wait > 0) {
    while (Enter(fd_, 0, wait, IORING_ENTER_GETEVENTS) < 0 && errno == EINTR) {
    }
  }
  unsigned head = *cq_head_;  // this thread is the only consumer
  const unsigned tail = __atomic_load_n(cq_tail_, __ATOMIC_ACQUIRE);
  const auto* cqes = static_cast<const io_uring_cqe*>(cqes_);
  unsigned done = 0;
  for (; head != tail; ++head, ++done) {
    const io_uring_cqe& cqe = cqes[head & *cq_mask_];
    const auto slot = static_cast<unsigned>(cqe.user_data);
    const size_t i = slot_of_[slot];
    const RecordRead& r = reads[i];
    const size_t start = r.offset & ~(r.align - 1);
    if (cqe.res < static_cast<int>(r.offset + r.bytes - start)) {
      failed->push_back(i);  // an error or a short read: read again, blocking
    } else {
      std::memcpy(r.out, buffers_ + size_t{slot} * kBufferBytes + (r.offset - start), r.bytes);
    }
    free_.push_back(slot);
  }
  __atomic_store_n(cq_head_, head, __ATOMIC_RELEASE);
  return done;
}

void UringReader::ReadAll(const RecordRead* reads, size_t n,
                          const std::function<void(size_t)>& retry) {
  std::vector<size_t> failed;
  free_.clear();
  for (unsigned s = 0; s < kDepth; ++s) free_.push_back(kDepth - 1 - s);
  auto* sqes = static_cast<io_uring_sqe*>(sqes_);
  size_t next = 0;
  unsigned in_flight = 0;
  while (next < n || in_flight > 0) {
    unsigned tail = *sq_tail_;  // this thread is the only producer
    unsigned queued = 0;
    for (; next < n && !free_.empty(); ++next) {
      const RecordRead& r = reads[next];
      const size_t start = r.offset & ~(r.align - 1);
      const size_t end = (r.offset + r.bytes + r.align - 1) & ~(r.align - 1);
      if (end - start > kBufferBytes) {
        failed.push_back(next);
        continue;
      }
      const unsigned slot = free_.back();
      free_.pop_back();
      slot_of_[slot] = next;
      const unsigned at = tail & *sq_mask_;
      io_uring_sqe& sqe = sqes[at];
      std::memset(&sqe, 0, sizeof(sqe));
      sqe.opcode = IORING_OP_READ;
      sqe.fd = r.fd;
      sqe.off = start;
      sqe.addr = reinterpret_cast<uint64_t>(buffers_ + size_t{slot} * kBufferBytes);
      sqe.len = static_cast<uint32_t>(end - start);
      sqe.user_data = slot;
      sq_array_[at] = at;
      ++tail;
      ++queued;
    }
    if (queued > 0) {
      __atomic_store_n(sq_tail_, tail, __ATOMIC_RELEASE);
      // Submits them, and waits for one completion when nothing more can go
      // in flight (every buffer taken, or every read queued).
      const unsigned wait = (free_.empty() || next >= n) ? 1 : 0;
      int submitted;
      while ((submitted = Enter(fd_, queued, wait, wait != 0 ? IORING_ENTER_GETEVENTS : 0)) < 0 &&
             (errno == EINTR || errno == EAGAIN || errno == EBUSY)) {
      }
      if (submitted < 0) submitted = 0;
      if (static_cast<unsigned>(submitted) < queued) {
        // The kernel took only the first ones: the rest leave the ring and
        // are read again, blocking, with those that failed.
        const unsigned left = queued - static_cast<unsigned>(submitted);
        __atomic_store_n(sq_tail_, tail - left, __ATOMIC_RELEASE);
        for (unsigned k = 0; k < left; ++k) {
          const unsigned at = (tail - left + k) & *sq_mask_;
          const auto slot = static_cast<unsigned>(sqes[at].user_data);
          failed.push_back(slot_of_[slot]);
          free_.push_back(slot);
        }
      }
      in_flight += static_cast<unsigned>(submitted);
      in_flight -= Reap(reads, &failed, 0);
    } else if (in_flight > 0) {
      in_flight -= Reap(reads, &failed, 1);
    }
  }
  std::sort(failed.begin(), failed.end());
  for (size_t i : failed) retry(i);
}

}  // namespace wuliang::ps::details
