// Page-level memory straight from the OS: aligned, zero-filled, huge-page
// advised, and really returned on release (malloc may keep freed memory).
#pragma once

#include <cstddef>

namespace wuliang::ps::details {

// Returns `bytes` of zeroed memory aligned to `align` (a power of two that is
// a multiple of the page size). Throws std::bad_alloc.
void* MapPages(size_t bytes, size_t align);
void UnmapPages(void* p, size_t bytes) noexcept;

// Random 64-byte reads per second of one thread from `bytes` mapped by
// MapPages, each prefetched `ahead` reads before (0: none): the memory
// system's own rate for the engine's access pattern at that size.
double MeasureMemoryReads(size_t bytes, size_t reads, size_t ahead);

}  // namespace wuliang::ps::details
