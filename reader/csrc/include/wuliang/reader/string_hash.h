// Stable 64-bit hashes of strings, for turning categorical values into keys:
// key = HashString(value, FieldSeed(field)). Part of the data format: keys
// written by a converter must not change between versions ("v1").
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace wuliang::reader {

uint64_t HashBytes(const char* data, size_t size, uint64_t seed);

inline uint64_t FieldSeed(std::string_view field) {
  return HashBytes(field.data(), field.size(), 0);
}

// keys[i] = HashBytes(data[offsets[i], offsets[i+1]), seed): an Arrow string array.
template <class Offset>
void HashStrings(const Offset* offsets,  // (n + 1,)
                 const char* data, size_t n, uint64_t seed,
                 uint64_t* keys);  // (n,)

// keys[i] = Mix64(values[i] ^ seed'): integer ids salted by their field.
void HashInts(const int64_t* values, size_t n, uint64_t seed, uint64_t* keys);

}  // namespace wuliang::reader
