#include "details/os_memory.h"

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <new>
#include <random>
#include <vector>

namespace wuliang::ps::details {
namespace {

// Faults the pages in as writable now. Users of this memory (the index's
// rehash) read a slot before writing it: a read of an untouched page maps the
// shared zero page, and the write after it is a copy-on-write fault that
// flushes the TLB of every core running the process (an inter-processor
// interrupt, costly under virtualization, and it stalls TensorFlow's threads).
// Every page is written soon anyway, so populating up front costs nothing more.
void PopulateForWriting(void* p, size_t bytes) {
#ifdef MADV_POPULATE_WRITE
  if (madvise(p, bytes, MADV_POPULATE_WRITE) == 0) return;
  // Out of memory: fail here rather than touch pages for the OOM killer.
  if (errno == ENOMEM || errno == EFAULT) {
    munmap(p, bytes);
    throw std::bad_alloc();
  }
#endif
  auto* bytes_p = static_cast<volatile char*>(p);  // kernels before 5.14
  for (size_t off = 0; off < bytes; off += 4096) bytes_p[off] = 0;
}

}  // namespace

void* MapPages(size_t bytes, size_t align) {
  const size_t span = bytes + align;
  void* raw = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) throw std::bad_alloc();
  const auto start = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t aligned = (start + align - 1) & ~(uintptr_t{align} - 1);
  if (aligned > start) munmap(raw, aligned - start);
  const uintptr_t end = start + span;
  if (end > aligned + bytes)
    munmap(reinterpret_cast<void*>(aligned + bytes), end - aligned - bytes);
  void* p = reinterpret_cast<void*>(aligned);
#ifdef MADV_HUGEPAGE
  if (bytes >= (size_t{2} << 20)) madvise(p, bytes, MADV_HUGEPAGE);
#endif
  PopulateForWriting(p, bytes);
  return p;
}

void UnmapPages(void* p, size_t bytes) noexcept {
  if (p != nullptr) munmap(p, bytes);
}

double MeasureMemoryReads(size_t bytes, size_t reads, size_t ahead) {
  constexpr size_t kLine = 64;
  constexpr size_t kHuge = size_t{2} << 20;
  bytes = std::max(bytes / kHuge, size_t{1}) * kHuge;
  auto* base = static_cast<char*>(MapPages(bytes, kHuge));
  const size_t lines = bytes / kLine;
  std::vector<uint64_t> at(reads);
  std::mt19937_64 rng(5);
  for (uint64_t& a : at) a = (rng() % lines) * kLine;
  uint64_t sum = 0;
  const auto start = std::chrono::steady_clock::now();
  for (size_t i = 0; i < reads; ++i) {
    if (ahead != 0 && i + ahead < reads) __builtin_prefetch(base + at[i + ahead]);
    sum += *reinterpret_cast<const volatile uint64_t*>(base + at[i]);
  }
  const double took =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  UnmapPages(base, bytes);
  return sum == 1 ? 0.0 : static_cast<double>(reads) / took;  // sum is 0: the pages are zeroed
}

}  // namespace wuliang::ps::details
