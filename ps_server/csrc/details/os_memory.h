// Page-level memory straight from the OS: aligned, zero-filled, huge-page
// advised, and really returned on release (malloc may keep freed memory).
#pragma once

#include <cstddef>

namespace wuliang::ps::details {

// Returns `bytes` of zeroed memory aligned to `align` (a power of two that is
// a multiple of the page size). Throws std::bad_alloc.
void* MapPages(size_t bytes, size_t align);
void UnmapPages(void* p, size_t bytes) noexcept;

}  // namespace wuliang::ps::details
