// The CPU twin of the index kernels. Compiled with -ffp-contract=off
// (CMakeLists.txt): scores round as the CUDA kernels round them.
#include "details/cache_twin.h"

namespace wuliang::ps::details {
namespace {

constexpr size_t kAhead = 8;  // keys (or sets) whose lines are fetched ahead

// A set's 32 8-byte values: four cache lines.
template <class T>
void Prefetch(const T* values, bool write = false) {
  static_assert(sizeof(T) == 8);
  for (int line = 0; line < 4; ++line) {
    if (write) {
      __builtin_prefetch(values + 8 * line, 1);
    } else {
      __builtin_prefetch(values + 8 * line);
    }
  }
}

}  // namespace

void CacheLookup(const CacheRegions& regions, const CacheIndex& index, const uint64_t* keys,
                 const int32_t* region, const float* counts, size_t n, bool observe, int64_t epoch,
                 int policy, double weight, double clock, int64_t* out) {
  const auto start_of = [&](size_t i) {
    const int32_t r = region[i];
    return regions.entry_base[r] + wl_set_of(keys[i], regions.sets[r]) * regions.ways[r];
  };
  for (size_t i = 0; i < n && i < kAhead; ++i) Prefetch(index.keys + start_of(i));
  for (size_t i = 0; i < n; ++i) {
    if (i + kAhead < n) Prefetch(index.keys + start_of(i + kAhead));
    const int32_t r = region[i];
    const int ways = regions.ways[r];
    const int64_t start = start_of(i);
    const int w = wl_find(reinterpret_cast<const wl_u64*>(index.keys) + start,
                          reinterpret_cast<const wl_i64*>(index.epochs) + start, ways, keys[i]);
    if (w < 0) {
      out[i] = -1;
      continue;
    }
    const int64_t e = start + w;
    out[i] = e;
    if (!observe) continue;
    index.epochs[e] = epoch;
    if (policy == WL_POLICY_STATS) {
      index.scores[e] = WL_MUL_ADD(static_cast<double>(counts != nullptr ? counts[i] : 1.0f),
                                   weight, index.scores[e]);
    } else {
      index.scores[e] = clock;
    }
  }
}

void CacheScoreMisses(const CacheRegions& regions, const CacheIndex& index, const uint64_t* keys,
                      const int32_t* region, const float* counts, size_t m, int policy,
                      double weight, int64_t* set_out, double* score_out) {
  const bool ghosts = index.ghost_scores != nullptr;
  const auto ghosts_of = [&](size_t i) {
    const int32_t r = region[i];
    return regions.ghost_base[r] + wl_set_of(keys[i], regions.sets[r]) * regions.ways[r];
  };
  if (ghosts) {
    for (size_t i = 0; i < m && i < kAhead; ++i) Prefetch(index.ghost_keys + ghosts_of(i));
  }
  for (size_t i = 0; i < m; ++i) {
    if (ghosts && i + kAhead < m) Prefetch(index.ghost_keys + ghosts_of(i + kAhead));
    const int32_t r = region[i];
    const int ways = regions.ways[r];
    const int64_t set = wl_set_of(keys[i], regions.sets[r]);
    set_out[i] = regions.entry_base[r] + set * ways;
    const int64_t g0 = regions.ghost_base[r] + set * ways;
    score_out[i] = wl_candidate_score(
        ghosts ? reinterpret_cast<const wl_u64*>(index.ghost_keys) + g0 : nullptr,
        ghosts ? index.ghost_scores + g0 : nullptr, ghosts ? ways : 0, keys[i],
        static_cast<double>(counts != nullptr ? counts[i] : 1.0f), weight, policy);
  }
}

void CachePopulate(const CacheRegions& regions, const CacheIndex& index, const uint64_t* keys,
                   const int32_t* region, const int64_t* sets, const double* scores,
                   const uint8_t* allowed, size_t m, int64_t epoch, int policy, double clock,
                   double weight, int64_t* way_out, uint8_t* how, uint64_t* victim) {
  const bool ghosts = index.ghost_scores != nullptr;
  // The sets of the candidates kAhead places on (a set's first candidate
  // reads its keys, epochs and scores and its ghosts' keys and scores).
  const auto prefetch = [&](size_t j) {
    const int64_t start = sets[j];
    Prefetch(index.keys + start, true);
    Prefetch(index.epochs + start, true);
    Prefetch(index.scores + start, true);
    if (ghosts) {
      const int64_t g0 = regions.ghost_base[region[j]] + (start - regions.entry_base[region[j]]);
      Prefetch(index.ghost_keys + g0, true);
      Prefetch(index.ghost_scores + g0, true);
    }
  };
  for (size_t j = 0; j < m && j < kAhead; ++j) prefetch(j);
  size_t i = 0;
  while (i < m) {
    if (i + kAhead < m) prefetch(i + kAhead);
    size_t end = i + 1;
    while (end < m && sets[end] == sets[i]) ++end;
    const int32_t r = region[i];
    const int ways = regions.ways[r];
    const int64_t start = sets[i];
    const int64_t g0 = regions.ghost_base[r] + (start - regions.entry_base[r]);
    wl_populate_set(reinterpret_cast<wl_u64*>(index.keys) + start, index.scores + start,
                    reinterpret_cast<wl_i64*>(index.epochs) + start, ways,
                    ghosts ? reinterpret_cast<wl_u64*>(index.ghost_keys) + g0 : nullptr,
                    ghosts ? index.ghost_scores + g0 : nullptr, ghosts ? ways : 0,
                    reinterpret_cast<const wl_u64*>(keys) + i, scores + i, allowed + i,
                    static_cast<int>(end - i), epoch, policy, clock, weight,
                    reinterpret_cast<wl_i64*>(way_out) + i, how + i,
                    reinterpret_cast<wl_u64*>(victim) + i);
    for (size_t j = i; j < end; ++j) {
      if (way_out[j] >= 0) way_out[j] += start;
    }
    i = end;
  }
}

}  // namespace wuliang::ps::details
