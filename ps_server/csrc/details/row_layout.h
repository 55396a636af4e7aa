// Row layout. A row is split in two parts kept in the same pool chunk (see
// memory_pool.h):
//
//   hot:  weights, encoded per the table's precision  read by every pull
//           fp32: float[dim]   fp16: uint16[dim]   int8: float scale | int8[dim]
//           (details/precision.h)
//   cold: RowMeta (32 B) | state float[state_dim]     touched by updates only
//
// A row is named by its hot pointer (what the hash map stores); rows do not
// store their key, iteration walks the hash map slots.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "details/precision.h"
#include "wuliang/ps/table_spec.h"

namespace wuliang::ps::details {

struct RowMeta {
  // Global step of the last update (steps are below 2^63). The top bit marks
  // a row that a training pull admitted and no push has updated since: a
  // push of an earlier step must leave it alone (its key had no row then).
  uint64_t update_step;
  uint64_t version;      // engine version of the last modification
  uint32_t update_time;  // unix seconds of the last update
  uint32_t count;        // updates + sightings before admission, saturating
  // Shows and clicks fed with pushes, as of step(): decayed by the table's
  // stats_half_life lazily, when the row is next updated (DecayStats) or read.
  float shows;
  float clicks;

  static constexpr uint64_t kAdmittedBit = uint64_t{1} << 63;
  uint64_t step() const { return update_step & ~kAdmittedBit; }
  bool admitted_unpushed() const { return (update_step & kAdmittedBit) != 0; }
  // The top bit of version marks a row of a disk-tiered table that is
  // identical to its record on disk (promoted, unchanged since). Every
  // change assigns version, which clears it (docs/disk_tier.md).
  static constexpr uint64_t kBackedBit = uint64_t{1} << 63;
  uint64_t real_version() const { return version & ~kBackedBit; }
  bool backed() const { return (version & kBackedBit) != 0; }
};
static_assert(sizeof(RowMeta) == 32);

struct RowLayout {
  int dim = 0;
  int state_dim = 0;
  Precision precision = Precision::kFp32;
  size_t hot_bytes = 0;    // encoded weights (EncodedBytes)
  size_t hot_stride = 0;   // hot_bytes padded so a row spans as few lines as possible
  size_t cold_stride = 0;  // meta + state bytes, a multiple of 32

  RowLayout() = default;
  RowLayout(int dim, int state_dim, Precision precision = Precision::kFp32)
      : dim(dim),
        state_dim(state_dim),
        precision(precision),
        hot_bytes(EncodedBytes(precision, dim)),
        hot_stride(precision == Precision::kFp32 ? HotStride(hot_bytes)
                                                 : PackedHotStride(hot_bytes)),
        cold_stride((sizeof(RowMeta) + sizeof(float) * state_dim + 31) / 32 * 32) {}

  // float32 rows. Up to a line: the next power of two (never straddles);
  // beyond: whole 32-byte units (straddles at most one extra line).
  static size_t HotStride(size_t bytes) {
    if (bytes > 64) return (bytes + 31) / 32 * 32;
    size_t stride = 4;
    while (stride < bytes) stride *= 2;
    return stride;
  }
  // Compressed rows: whole lines plus a power-of-two tail of at least 4
  // bytes (up to a line, as HotStride). Row offsets within a line are then
  // multiples of the tail, so a row of 64q + r bytes (0 < r <= 64) always
  // spans exactly q + 1 lines, the fewest it can, with less padding than
  // 32-byte units (int8 dim 64: 68 bytes, not 96). Strides stay multiples
  // of 4: an int8 row's float scale is aligned. (float32 rows keep
  // HotStride, so their layout is as before.)
  static size_t PackedHotStride(size_t bytes) {
    const size_t lines = bytes > 64 ? (bytes - 1) / 64 : 0;
    size_t tail = 4;
    while (tail < bytes - 64 * lines) tail *= 2;
    return 64 * lines + tail;
  }

  static float* Weights(char* hot) { return reinterpret_cast<float*>(hot); }
  static RowMeta* Meta(char* cold) { return reinterpret_cast<RowMeta*>(cold); }
  static float* State(char* cold) { return reinterpret_cast<float*>(cold + sizeof(RowMeta)); }
};

inline void BumpCount(RowMeta* meta) {
  if (meta->count != UINT32_MAX) ++meta->count;
}

// The factor that takes statistics stamped at step `from` to step `to`:
// 0.5 ** ((to - from) / half_life); 1 without decay (half_life 0) or when
// `to` is not later.
inline double StatsDecay(uint64_t from, uint64_t to, double half_life) {
  if (half_life <= 0 || to <= from) return 1.0;
  return std::exp2(-static_cast<double>(to - from) / half_life);
}

// Brings a row's shows and clicks to `step` (before it is stamped with it).
inline void DecayStats(RowMeta* meta, uint64_t step, double half_life) {
  if (meta->shows == 0 && meta->clicks == 0) return;
  const double f = StatsDecay(meta->step(), step, half_life);
  if (f == 1.0) return;
  meta->shows = static_cast<float>(meta->shows * f);
  meta->clicks = static_cast<float>(meta->clicks * f);
}

}  // namespace wuliang::ps::details
