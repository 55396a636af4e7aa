#include "details/row_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <random>
#include <stdexcept>
#include <system_error>

namespace wuliang::ps::details {
namespace {

char* AlignedAlloc(size_t bytes) {
  void* p = std::aligned_alloc(RowFile::kBlockBytes, bytes);
  if (p == nullptr) throw std::bad_alloc();
  std::memset(p, 0, bytes);
  return static_cast<char*>(p);
}

// Opens path read-write, O_DIRECT when *direct and the file system allows it
// (clears *direct otherwise). Returns the fd, or -1 with errno set.
int OpenFile(const std::string& path, int flags, bool* direct) {
  if (*direct) {
    const int fd = ::open(path.c_str(), flags | O_DIRECT, 0644);
    if (fd >= 0 || errno != EINVAL) return fd;
    *direct = false;
  }
  return ::open(path.c_str(), flags, 0644);
}

}  // namespace

// -- IoPool --------------------------------------------------------------------

struct IoPool::Job {
  const std::function<void(size_t)>* fn;
  size_t n;
  std::atomic<size_t> next{0};
  std::atomic<size_t> done{0};
  std::atomic<bool> failed{false};  // the items after a failure are skipped
  std::mutex error_mutex;
  std::exception_ptr error;  // the first one, rethrown to the caller
};

IoPool::IoPool(int threads) {
  threads_.reserve(static_cast<size_t>(std::max(threads, 0)));
  for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { Loop(); });
}

IoPool::~IoPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  for (std::thread& t : threads_) t.join();
}

void IoPool::Work(Job* job) {
  size_t finished = 0;
  for (size_t i = job->next.fetch_add(1); i < job->n; i = job->next.fetch_add(1)) {
    ++finished;
    if (job->failed.load(std::memory_order_relaxed)) continue;
    try {
      (*job->fn)(i);
    } catch (...) {
      const std::lock_guard<std::mutex> lock(job->error_mutex);
      if (!job->failed.exchange(true)) job->error = std::current_exception();
    }
  }
  if (finished != 0 && job->done.fetch_add(finished) + finished == job->n) job->done.notify_all();
}

void IoPool::Loop() {
  for (;;) {
    std::shared_ptr<Job> job;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [this] { return stop_ || !jobs_.empty(); });
      if (jobs_.empty()) return;  // stopping
      job = jobs_.front();
      if (job->next.load() >= job->n) {  // every item taken: the job leaves the queue
        jobs_.pop_front();
        continue;
      }
    }
    Work(job.get());
  }
}

void IoPool::ParallelFor(size_t n, const std::function<void(size_t)>& fn) {
  if (n == 0) return;
  auto job = std::make_shared<Job>();
  job->fn = &fn;
  job->n = n;
  if (n > 1 && !threads_.empty()) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      jobs_.push_back(job);
    }
    if (n >= threads_.size()) {
      wake_.notify_all();
    } else {
      for (size_t i = 0; i + 1 < n; ++i) wake_.notify_one();
    }
  }
  Work(job.get());
  for (size_t done = job->done.load(); done != n; done = job->done.load()) job->done.wait(done);
  if (n > 1 && !threads_.empty()) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = std::find(jobs_.begin(), jobs_.end(), job);
    if (it != jobs_.end()) jobs_.erase(it);
  }
  if (job->error) std::rethrow_exception(job->error);
}

// -- RowFile -------------------------------------------------------------------

RowFile::RowFile(std::string dir, size_t record_bytes, IoPool* pool, size_t file_bytes)
    : dir_(std::move(dir)), record_bytes_(record_bytes), pool_(pool) {
  if (record_bytes_ == 0 || record_bytes_ > kBlockBytes) {
    throw std::invalid_argument("row file records must be 1 to 4096 bytes, got " +
                                std::to_string(record_bytes_));
  }
  per_block_ = kBlockBytes / record_bytes_;
  const size_t blocks =
      std::max<size_t>(file_bytes / kBufferBytes, 1) * (kBufferBytes / kBlockBytes);
  file_bytes_ = blocks * kBlockBytes;
  records_per_file_ = static_cast<uint32_t>(blocks * per_block_);
  std::error_code error;
  std::filesystem::create_directories(dir_, error);
  if (error) throw std::runtime_error("disk tier: cannot create " + dir_ + ": " + error.message());
  for (const auto& entry : std::filesystem::directory_iterator(dir_, error)) {
    if (entry.path().extension() == ".rows") std::filesystem::remove(entry.path(), error);
  }
  if (error) throw std::runtime_error("disk tier: cannot empty " + dir_ + ": " + error.message());
  buffer_ = AlignedAlloc(kBufferBytes);
}

RowFile::~RowFile() {
  for (uint32_t f = 0; f < files_.size(); ++f) {
    if (files_[f].fd >= 0) {
      ::close(files_[f].fd);
      ::unlink(PathOf(f).c_str());
    }
  }
  std::free(buffer_);
}

std::string RowFile::PathOf(uint32_t f) const {
  char name[32];
  std::snprintf(name, sizeof(name), "/%08u.rows", f);
  return dir_ + name;
}

void RowFile::Fail(const std::string& what, int error) const {
  throw std::runtime_error("disk tier " + dir_ + ": " + what + ": " +
                           std::generic_category().message(error) +
                           (error == ENOSPC ? " (the disk is full)" : ""));
}

void RowFile::OpenNextFile() {
  uint32_t f;
  if (!free_.empty()) {
    f = *std::min_element(free_.begin(), free_.end());
    free_.erase(std::find(free_.begin(), free_.end(), f));
  } else {
    if ((files_.size() + 1) * uint64_t{records_per_file_} >= kNoLocator) {
      throw std::runtime_error("disk tier " + dir_ + ": out of locators (" +
                               std::to_string(files_.size()) + " files of " +
                               std::to_string(records_per_file_) + " records)");
    }
    f = static_cast<uint32_t>(files_.size());
    files_.emplace_back();
  }
  const int fd = OpenFile(PathOf(f), O_RDWR | O_CREAT | O_TRUNC, &direct_);
  if (fd < 0) {
    free_.push_back(f);
    Fail("cannot create " + PathOf(f), errno);
  }
  files_[f] = File{fd, 0, 0};
  current_ = f;
  next_slot_ = 0;
  buffer_start_ = 0;
  std::memset(buffer_, 0, kBufferBytes);
}

void RowFile::FlushBuffer() {
  const File& file = files_[static_cast<size_t>(current_)];
  size_t off = 0;
  while (off < kBufferBytes) {
    const ssize_t n = ::pwrite(file.fd, buffer_ + off, kBufferBytes - off,
                               static_cast<off_t>(buffer_start_ + off));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0)
      Fail("cannot write " + PathOf(static_cast<uint32_t>(current_)), n < 0 ? errno : ENOSPC);
    off += static_cast<size_t>(n);
  }
  bytes_written_ += kBufferBytes;
}

uint32_t RowFile::Append(const char* record) {
  if (current_ < 0 || next_slot_ == records_per_file_) {
    if (current_ >= 0) FlushBuffer();  // the file's last buffer
    OpenNextFile();
  }
  size_t offset = OffsetOf(next_slot_);
  if (offset + record_bytes_ > buffer_start_ + kBufferBytes) {  // the buffer is full
    FlushBuffer();  // throws before anything changed: the record was not appended
    buffer_start_ += kBufferBytes;
    std::memset(buffer_, 0, kBufferBytes);
  }
  std::memcpy(buffer_ + (offset - buffer_start_), record, record_bytes_);
  File& file = files_[static_cast<size_t>(current_)];
  ++file.written;
  ++file.live;
  return static_cast<uint32_t>(current_) * records_per_file_ + next_slot_++;
}

void RowFile::ReadAt(int fd, size_t offset, char* out) const {
  alignas(kBlockBytes) char scratch[2 * kBlockBytes];
  for (;;) {
    const size_t align = align_.load(std::memory_order_relaxed);
    const size_t start = offset & ~(align - 1);
    const size_t end = (offset + record_bytes_ + align - 1) & ~(align - 1);
    const ssize_t n = ::pread(fd, scratch, end - start, static_cast<off_t>(start));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == EINVAL && direct_ && align < kBlockBytes) {
      align_.store(kBlockBytes, std::memory_order_relaxed);  // the device's sectors are larger
      continue;
    }
    if (n < static_cast<ssize_t>(offset + record_bytes_ - start)) {
      Fail("cannot read a record at offset " + std::to_string(offset), n < 0 ? errno : EIO);
    }
    std::memcpy(out, scratch + (offset - start), record_bytes_);
    return;
  }
}

void RowFile::Read(uint32_t loc, char* out) const {
  const uint32_t f = loc / records_per_file_;
  const size_t offset = OffsetOf(loc % records_per_file_);
  if (static_cast<int64_t>(f) == current_ && offset >= buffer_start_) {
    std::memcpy(out, buffer_ + (offset - buffer_start_), record_bytes_);
  } else {
    ReadAt(files_[f].fd, offset, out);
  }
  records_read_.fetch_add(1, std::memory_order_relaxed);
}

bool RowFile::Detach(uint32_t loc, char* out, Place* place) {
  const uint32_t f = loc / records_per_file_;
  const size_t offset = OffsetOf(loc % records_per_file_);
  if (static_cast<int64_t>(f) == current_ && offset >= buffer_start_) {
    std::memcpy(out, buffer_ + (offset - buffer_start_), record_bytes_);
    records_read_.fetch_add(1, std::memory_order_relaxed);
    return false;
  }
  *place = Place{files_[f].fd, offset};
  ++detached_;
  return true;
}

void RowFile::ReadDetached(const Place& place, char* out) const {
  ReadAt(place.fd, place.offset, out);
  records_read_.fetch_add(1, std::memory_order_relaxed);
}

void RowFile::ReadMany(const uint32_t* locs, size_t n, char* out) const {
  UringReader* ring = n >= 2 ? UringReader::ForThisThread() : nullptr;
  if (ring != nullptr) {
    thread_local std::vector<RecordRead> reads;
    reads.clear();
    for (size_t i = 0; i < n; ++i) {
      const uint32_t f = locs[i] / records_per_file_;
      const size_t offset = OffsetOf(locs[i] % records_per_file_);
      if (static_cast<int64_t>(f) == current_ && offset >= buffer_start_) {
        Read(locs[i], out + i * record_bytes_);  // in the write buffer
      } else {
        reads.push_back(ReadOf(Place{files_[f].fd, offset}, out + i * record_bytes_));
      }
    }
    ring->ReadAll(reads.data(), reads.size(),
                  [&](size_t r) { ReadAt(reads[r].fd, reads[r].offset, reads[r].out); });
    CountReads(reads.size());  // the ones in the write buffer counted by Read
    return;
  }
  if (pool_ == nullptr || n < 2) {
    for (size_t i = 0; i < n; ++i) Read(locs[i], out + i * record_bytes_);
    return;
  }
  pool_->ParallelFor(n, [&](size_t i) { Read(locs[i], out + i * record_bytes_); });
}

void RowFile::Release(uint32_t loc) {
  File& file = files_[loc / records_per_file_];
  if (file.live > 0) --file.live;
}

int64_t RowFile::CompactionCandidate() const {
  int64_t best = -1;
  uint32_t most = 0;
  for (uint32_t f = 0; f < files_.size(); ++f) {
    const File& file = files_[f];
    if (file.fd < 0 || static_cast<int64_t>(f) == current_) continue;
    const uint32_t stale = file.written - file.live;
    if (stale * 3 >= file.written && stale > most) {
      best = f;
      most = stale;
    }
  }
  return best;
}

uint32_t RowFile::ReadFile(uint32_t f, uint32_t first,
                           const std::function<bool(uint32_t, const char*)>& fn) const {
  const File& file = files_[f];
  const uint32_t written = file.written;
  const int fd = file.fd;
  const uint32_t records_per_chunk =
      static_cast<uint32_t>((kBufferBytes / kBlockBytes) * per_block_);
  std::unique_ptr<char, decltype(&std::free)> chunk(AlignedAlloc(kBufferBytes), &std::free);
  uint32_t slot = first;
  while (slot < written) {
    const uint32_t chunk_first = slot - slot % records_per_chunk;
    const size_t start = OffsetOf(chunk_first);
    size_t got = 0;
    while (got < kBufferBytes) {
      const ssize_t n =
          ::pread(fd, chunk.get() + got, kBufferBytes - got, static_cast<off_t>(start + got));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) Fail("cannot read " + PathOf(f), errno);
      if (n == 0) break;
      got += static_cast<size_t>(n);
    }
    if (static_cast<int64_t>(f) == current_ && start == buffer_start_) {
      std::memcpy(chunk.get(), buffer_, kBufferBytes);  // the tail, not written yet
    }
    const uint32_t last = std::min<uint32_t>(written, chunk_first + records_per_chunk);
    for (; slot < last; ++slot) {
      if (!fn(f * records_per_file_ + slot, chunk.get() + (OffsetOf(slot) - start))) return slot;
    }
  }
  return slot;
}

void RowFile::DropFile(uint32_t f) {
  File& file = files_[f];
  if (file.fd < 0) return;
  ::close(file.fd);
  ::unlink(PathOf(f).c_str());
  file = File{};
  free_.push_back(f);
  ++files_compacted_;
  if (static_cast<int64_t>(f) == current_) current_ = -1;
}

RowFileStats RowFile::Stats() const {
  RowFileStats s;
  for (const File& file : files_) {
    if (file.fd < 0) continue;
    ++s.files;
    s.live += file.live;
    s.stale += file.written - file.live;
    s.bytes_on_disk += (OffsetOf(file.written) + kBlockBytes - 1) / kBlockBytes * kBlockBytes;
  }
  s.bytes_written = bytes_written_;
  s.records_read = records_read_.load();
  s.files_compacted = files_compacted_;
  s.direct = direct_;
  return s;
}

// -- the disk's own rate ---------------------------------------------------------

double MeasureRandomReads(const std::string& dir, size_t file_bytes, size_t read_bytes, int depth,
                          double seconds, bool* direct) {
  if (read_bytes == 0 || read_bytes % 512 != 0 || depth < 1 || file_bytes < read_bytes) {
    throw std::invalid_argument("MeasureRandomReads: read_bytes a multiple of 512, depth >= 1");
  }
  std::error_code error;
  std::filesystem::create_directories(dir, error);
  const std::string path = dir + "/wuliang-disk-probe.bin";
  *direct = true;
  const int fd = OpenFile(path, O_RDWR | O_CREAT | O_TRUNC, direct);
  if (fd < 0) throw std::runtime_error("cannot create " + path + ": " + std::strerror(errno));
  char* chunk = AlignedAlloc(RowFile::kBufferBytes);
  std::mt19937_64 fill(7);
  for (size_t i = 0; i < RowFile::kBufferBytes / 8; ++i)
    reinterpret_cast<uint64_t*>(chunk)[i] = fill();
  file_bytes = file_bytes / RowFile::kBufferBytes * RowFile::kBufferBytes;
  for (size_t off = 0; off < file_bytes; off += RowFile::kBufferBytes) {
    if (::pwrite(fd, chunk, RowFile::kBufferBytes, static_cast<off_t>(off)) !=
        static_cast<ssize_t>(RowFile::kBufferBytes)) {
      const int e = errno;
      std::free(chunk);
      ::close(fd);
      ::unlink(path.c_str());
      throw std::runtime_error("cannot write " + path + ": " + std::strerror(e));
    }
  }
  ::fsync(fd);
  if (!*direct) posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  std::free(chunk);
  const size_t positions = file_bytes / read_bytes;
  UringReader* ring = depth > 1 && read_bytes <= 4096 ? UringReader::ForThisThread() : nullptr;
  if (ring != nullptr) {
    // As the tier reads: through this thread's ring, its depth in flight.
    std::vector<RecordRead> batch(4096);
    std::vector<char> out(read_bytes);
    std::mt19937_64 rng(1);
    uint64_t done = 0;
    const auto start = std::chrono::steady_clock::now();
    double took = 0;
    while (took < seconds) {
      for (RecordRead& r : batch) {
        r = RecordRead{fd, (rng() % positions) * read_bytes, read_bytes, 512, out.data()};
      }
      size_t failed = 0;
      ring->ReadAll(batch.data(), batch.size(), [&](size_t) { ++failed; });
      done += batch.size() - failed;
      took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    }
    ::close(fd);
    ::unlink(path.c_str());
    return static_cast<double>(done) / took;
  }
  std::atomic<uint64_t> reads{0};
  std::atomic<bool> stop{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < depth; ++t) {
    threads.emplace_back([&, t] {
      char* buf = AlignedAlloc(std::max(read_bytes, RowFile::kBlockBytes));
      std::mt19937_64 rng(static_cast<uint64_t>(t) + 1);
      uint64_t mine = 0;
      while (!stop.load(std::memory_order_relaxed)) {
        const off_t at = static_cast<off_t>((rng() % positions) * read_bytes);
        if (::pread(fd, buf, read_bytes, at) == static_cast<ssize_t>(read_bytes)) ++mine;
      }
      reads.fetch_add(mine);
      std::free(buf);
    });
  }
  const auto start = std::chrono::steady_clock::now();
  std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  stop = true;
  for (std::thread& t : threads) t.join();
  const double took =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ::close(fd);
  ::unlink(path.c_str());
  return static_cast<double>(reads.load()) / took;
}

}  // namespace wuliang::ps::details
