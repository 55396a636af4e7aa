#include "details/os_memory.h"

#include <sys/mman.h>

#include <cstdint>
#include <new>

namespace wuliang::ps::details {

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
  return p;
}

void UnmapPages(void* p, size_t bytes) noexcept {
  if (p != nullptr) munmap(p, bytes);
}

}  // namespace wuliang::ps::details
