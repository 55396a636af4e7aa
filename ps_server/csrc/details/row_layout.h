// Row layout. A row is split in two parts kept in the same pool chunk (see
// memory_pool.h):
//
//   hot:  weights float[dim]                          read by every pull
//   cold: RowMeta (24 B) | state float[state_dim]     touched by updates only
//
// A row is named by its hot pointer (what the hash map stores); rows do not
// store their key, iteration walks the hash map slots.
#pragma once

#include <cstddef>
#include <cstdint>

namespace wuliang::ps::details {

struct RowMeta {
  // Global step of the last update (steps are below 2^63). The top bit marks
  // a row that a training pull admitted and no push has updated since: a
  // push of an earlier step must leave it alone (its key had no row then).
  uint64_t update_step;
  uint64_t version;      // engine version of the last modification
  uint32_t update_time;  // unix seconds of the last update
  uint32_t count;        // updates + sightings before admission, saturating

  static constexpr uint64_t kAdmittedBit = uint64_t{1} << 63;
  uint64_t step() const { return update_step & ~kAdmittedBit; }
  bool admitted_unpushed() const { return (update_step & kAdmittedBit) != 0; }
};
static_assert(sizeof(RowMeta) == 24);

struct RowLayout {
  int dim = 0;
  int state_dim = 0;
  size_t hot_stride = 0;   // weights bytes, padded so a vector spans as few lines as possible
  size_t cold_stride = 0;  // meta + state bytes, a multiple of 8

  RowLayout() = default;
  RowLayout(int dim, int state_dim)
      : dim(dim),
        state_dim(state_dim),
        hot_stride(HotStride(sizeof(float) * dim)),
        cold_stride((sizeof(RowMeta) + sizeof(float) * state_dim + 31) / 32 * 32) {}

  // Up to a line: the next power of two (never straddles); beyond: whole
  // 32-byte units (straddles at most one extra line).
  static size_t HotStride(size_t bytes) {
    if (bytes > 64) return (bytes + 31) / 32 * 32;
    size_t stride = 4;
    while (stride < bytes) stride *= 2;
    return stride;
  }

  static float* Weights(char* hot) { return reinterpret_cast<float*>(hot); }
  static RowMeta* Meta(char* cold) { return reinterpret_cast<RowMeta*>(cold); }
  static float* State(char* cold) { return reinterpret_cast<float*>(cold + sizeof(RowMeta)); }
};

inline void BumpCount(RowMeta* meta) {
  if (meta->count != UINT32_MAX) ++meta->count;
}

}  // namespace wuliang::ps::details
