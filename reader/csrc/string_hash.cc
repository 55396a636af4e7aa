#include "wuliang/reader/string_hash.h"

#include <cstring>

#include "wuliang/ps/hash.h"

namespace wuliang::reader {

using ps::Mix64;

uint64_t HashBytes(const char* data, size_t size, uint64_t seed) {
  constexpr uint64_t kMul = 0x9e3779b97f4a7c15ULL;
  uint64_t h = Mix64(seed ^ (size * kMul));
  size_t i = 0;
  for (; i + 8 <= size; i += 8) {
    uint64_t chunk;
    std::memcpy(&chunk, data + i, 8);
    h = (h ^ Mix64(chunk)) * kMul;
  }
  if (i < size) {
    uint64_t tail = 0;
    std::memcpy(&tail, data + i, size - i);
    h = (h ^ Mix64(tail ^ 0xff51afd7ed558ccdULL)) * kMul;
  }
  return Mix64(h);
}

template <class Offset>
void HashStrings(const Offset* offsets, const char* data, size_t n, uint64_t seed, uint64_t* keys) {
  for (size_t i = 0; i < n; ++i) {
    keys[i] = HashBytes(data + offsets[i], static_cast<size_t>(offsets[i + 1] - offsets[i]), seed);
  }
}

template void HashStrings<int32_t>(const int32_t*, const char*, size_t, uint64_t, uint64_t*);
template void HashStrings<int64_t>(const int64_t*, const char*, size_t, uint64_t, uint64_t*);

void HashInts(const int64_t* values, size_t n, uint64_t seed, uint64_t* keys) {
  const uint64_t salt = Mix64(seed ^ 0x5bd1e9955bd1e995ULL);
  for (size_t i = 0; i < n; ++i) keys[i] = Mix64(static_cast<uint64_t>(values[i]) ^ salt);
}

}  // namespace wuliang::reader
