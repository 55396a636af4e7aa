// The CPU twin of a push to cached rows: the engine's own row arithmetic,
// compiled as the engine is (its floating-point contraction included).
#include <cstring>

#include "details/cache_twin.h"
#include "details/optimizers.h"
#include "details/row_layout.h"

namespace wuliang::ps::details {

size_t CacheApply(const OptimizerSpec& spec, const CacheRows& rows, const int64_t* slots,
                  const float* grads, const float* add_shows, const float* add_clicks, size_t n,
                  uint64_t step, uint32_t now, double half_life, uint8_t* applied) {
  const RowOptimizer opt(spec);
  const int dim = rows.dim;
  size_t done = 0;
  const auto prefetch = [&](int64_t s) {
    __builtin_prefetch(rows.weights + s * dim, 1);
    if (rows.state_dim) __builtin_prefetch(rows.state + s * rows.state_dim, 1);
    __builtin_prefetch(rows.counts + s, 1);
    __builtin_prefetch(rows.steps + s, 1);
    __builtin_prefetch(rows.times + s, 1);
    __builtin_prefetch(rows.shows + s, 1);
    __builtin_prefetch(rows.clicks + s, 1);
    __builtin_prefetch(rows.dirty + s, 1);
    __builtin_prefetch(rows.admitted_at + s, 1);
  };
  constexpr size_t kAhead = 8;
  for (size_t i = 0; i < n && i < kAhead; ++i) prefetch(slots[i]);
  WithOptimizer(spec.kind, [&](auto kind) {
    for (size_t i = 0; i < n; ++i) {
      if (i + kAhead < n) prefetch(slots[i + kAhead]);
      const float* g = grads + i * dim;
      if (!AllFinite(g, dim)) {
        applied[i] = 0;
        continue;
      }
      const int64_t s = slots[i];
      UpdateRow<decltype(kind)::value>(opt, dim, rows.weights + s * dim,
                                       rows.state + s * rows.state_dim, g, ClipScale(opt, g, dim));
      float& shows = rows.shows[s];
      float& clicks = rows.clicks[s];
      if (shows != 0 || clicks != 0) {
        const double f = StatsDecay(rows.steps[s], step, half_life);
        if (f != 1.0) {
          shows = static_cast<float>(shows * f);
          clicks = static_cast<float>(clicks * f);
        }
      }
      shows += add_shows != nullptr ? add_shows[i] : 0.0f;
      clicks += add_clicks != nullptr ? add_clicks[i] : 0.0f;
      rows.steps[s] = step;
      rows.times[s] = now;
      if (rows.counts[s] != UINT32_MAX) ++rows.counts[s];
      rows.dirty[s] = 1;
      rows.admitted_at[s] = 0;
      applied[i] = 1;
      ++done;
    }
  });
  return done;
}

void CachePut(const CacheRows& rows, const int64_t* slots, size_t n, const CacheRowValues& values) {
  const int dim = rows.dim;
  const int sdim = rows.state_dim;
  constexpr size_t kAhead = 8;
  for (size_t i = 0; i < n; ++i) {
    if (i + kAhead < n) {
      const int64_t a = slots[i + kAhead];
      __builtin_prefetch(rows.weights + a * dim, 1);
      if (sdim) __builtin_prefetch(rows.state + a * sdim, 1);
    }
    const int64_t s = slots[i];
    std::memcpy(rows.weights + s * dim, values.weights + i * dim, sizeof(float) * dim);
    if (sdim) std::memcpy(rows.state + s * sdim, values.state + i * sdim, sizeof(float) * sdim);
    rows.counts[s] = values.counts[i];
    rows.steps[s] = values.steps[i];
    rows.times[s] = values.times[i];
    rows.shows[s] = values.shows[i];
    rows.clicks[s] = values.clicks[i];
    rows.dirty[s] = 0;
    rows.admitted_at[s] = values.admitted_at[i];
  }
}

}  // namespace wuliang::ps::details
