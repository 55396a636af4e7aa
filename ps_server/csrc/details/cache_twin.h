// The GPU hot cache's CPU twin: what its CUDA kernels do, on host arrays
// (numpy, bound as _engine.cache_*), for a cache without a GPU and for the
// tests. The index functions run the same code as the kernels
// (details/cache_index.h); the row update runs the engine's own push
// arithmetic, so cached rows come out bit for bit as the engine's.
#pragma once

#include <cstddef>
#include <cstdint>

#include "details/cache_index.h"
#include "wuliang/ps/table_spec.h"

namespace wuliang::ps::details {

// The regions of a cache's index (one per cached table), by region id.
struct CacheRegions {
  const int64_t* entry_base;  // first entry
  const int64_t* ghost_base;  // first ghost entry
  const int64_t* sets;
  const int32_t* ways;  // ways per set (as many ghosts with "stats")
};

// The index's arrays (see cache_index.h).
struct CacheIndex {
  uint64_t* keys;
  double* scores;
  int64_t* epochs;
  uint64_t* ghost_keys;  // null without ghosts ("lru")
  double* ghost_scores;
};

// wl_lookup: each key's entry or -1; with observe, hits are scored and
// stamped with epoch.
void CacheLookup(const CacheRegions& regions, const CacheIndex& index, const uint64_t* keys,
                 const int32_t* region, const float* counts, size_t n, bool observe, int64_t epoch,
                 int policy, double weight, double clock, int64_t* out);

// wl_score_misses: each miss's set (its first entry) and score.
void CacheScoreMisses(const CacheRegions& regions, const CacheIndex& index, const uint64_t* keys,
                      const int32_t* region, const float* counts, size_t m, int policy,
                      double weight, int64_t* set_out, double* score_out);

// wl_populate: misses sorted by (set, score descending), each set's in
// order; way_out gets the entry taken (-1: none).
void CachePopulate(const CacheRegions& regions, const CacheIndex& index, const uint64_t* keys,
                   const int32_t* region, const int64_t* sets, const double* scores,
                   const uint8_t* allowed, size_t m, int64_t epoch, int policy, double clock,
                   double weight, int64_t* way_out, uint8_t* how, uint64_t* victim);

// A cache's rows by slot, on the host.
struct CacheRows {
  int dim = 0;
  int state_dim = 0;
  float* weights = nullptr;  // (slots, dim)
  float* state = nullptr;    // (slots, state_dim)
  uint32_t* counts = nullptr;
  uint64_t* steps = nullptr;
  uint32_t* times = nullptr;
  float* shows = nullptr;
  float* clicks = nullptr;
  uint8_t* dirty = nullptr;         // set for each row applied
  uint64_t* admitted_at = nullptr;  // cleared for each row applied
};

// One push of summed gradients to the rows at distinct slots, as the
// engine's push applies it to a row: a non-finite gradient row is dropped
// (applied[i] = 0), else the optimizer with clipping, the statistics
// decayed to `step` then increased, count + 1, step and time stamped, the
// row marked dirty and its admission mark cleared. Returns the rows applied.
size_t CacheApply(const OptimizerSpec& opt, const CacheRows& rows, const int64_t* slots,
                  const float* grads,      // (n, dim)
                  const float* add_shows,  // (n,) or null
                  const float* add_clicks, size_t n, uint64_t step, uint32_t now, double half_life,
                  uint8_t* applied);

// Whole rows into distinct slots (a swap-in): every column of row i into
// slot slots[i], the row marked clean, its admission mark set.
struct CacheRowValues {
  const float* weights;         // (n, dim)
  const float* state;           // (n, state_dim)
  const uint32_t* counts;       // (n,)
  const uint64_t* steps;        // (n,)
  const uint32_t* times;        // (n,)
  const float* shows;           // (n,)
  const float* clicks;          // (n,)
  const uint64_t* admitted_at;  // (n,)
};
void CachePut(const CacheRows& rows, const int64_t* slots, size_t n, const CacheRowValues& values);

}  // namespace wuliang::ps::details
