// The GPU hot cache's key -> slot index and its policy, written once for
// both of its builds: the CUDA kernels (this file is read by cupy and
// compiled with NVRTC at run time; WL_CUDA below) and the CPU twin (g++,
// details/cache_twin.cc, bound as _engine.cache_*), so the two take the
// same decisions by construction. Plain C++ that both compilers accept: no
// standard headers, no templates that NVRTC lacks.
//
// Layout. Every cached table of a cache owns a region of one flat index:
// `sets` sets of `ways` entries (ways = min(32, slots)), entries
// [entry_base, entry_base + sets * ways). A key's set is the multiply-high
// of its mixed bits by `sets`. An entry is a cache slot: its table-local
// slot is entry - entry_base. Per entry:
//   keys    u64    the key held
//   scores  f64    "stats": the key's decayed count (scaled, see below);
//                  "lru": the batch that saw it last
//   epochs  i64    the last training pull that used it; -1: empty
// With the "stats" policy each set also keeps `ways` ghost entries
// (ghost_keys, ghost_scores; score < 0: empty): keys seen lately that are
// not cached, with their decayed counts, so that a key that keeps coming
// back gets in and a key seen once does not displace one seen often.
//
// Scores. A batch adds each key's count times `weight` = 2^(clock /
// half_life) (the host rescales every score when the weight grows large),
// so scores compare without a decay pass.
//
// Locks. A pull of epoch e (the cache's count of training pulls) stamps
// every entry it uses with e; an entry stamped e - 1 or e is in use (the
// previous step's push has not landed before this pull: the pipeline pulls
// step i + 1 while step i trains and waits for step i - 1's push) and is
// never a victim.
#pragma once

#if defined(__CUDACC_RTC__) || defined(__CUDACC__)
#define WL_CUDA 1
#define WL_HD __host__ __device__ inline
#else
#define WL_HD inline
#endif

// a * b + c with the product rounded first, on both builds (the CPU twin's
// index code is compiled with -ffp-contract=off), so that both twins score
// keys alike to the last bit.
#if defined(__CUDA_ARCH__)
#define WL_MUL_ADD(a, b, c) __dadd_rn(__dmul_rn((a), (b)), (c))
#else
#define WL_MUL_ADD(a, b, c) ((a) * (b) + (c))
#endif

typedef unsigned long long wl_u64;
typedef long long wl_i64;

#define WL_POLICY_STATS 0
#define WL_POLICY_LRU 1

// Outcome of a miss in wl_populate_set (`how`).
#define WL_NOT_ADMITTED 0
#define WL_INTO_EMPTY 1   // took an empty entry
#define WL_OVER_VICTIM 2  // took the entry of a victim (victim key reported)
#define WL_REPEAT 3       // a repeat of a key admitted earlier in the batch

// murmur3's 64-bit finalizer.
WL_HD wl_u64 wl_mix(wl_u64 x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return x;
}

// The set (0 <= set < sets) of a key within its region.
WL_HD wl_i64 wl_set_of(wl_u64 key, wl_i64 sets) {
#if defined(__CUDA_ARCH__)
  return (wl_i64)__umul64hi(wl_mix(key), (wl_u64)sets);
#else
  return (wl_i64)(((unsigned __int128)wl_mix(key) * (wl_u64)sets) >> 64);
#endif
}

// The way of `key` among a set's `ways` entries, or -1.
WL_HD int wl_find(const wl_u64* keys, const wl_i64* epochs, int ways, wl_u64 key) {
  for (int w = 0; w < ways; ++w) {
    if (keys[w] == key && epochs[w] >= 0) return w;  // the keys' lines first
  }
  return -1;
}

WL_HD int wl_find_ghost(const wl_u64* gkeys, const double* gscores, int ghosts, wl_u64 key) {
  for (int g = 0; g < ghosts; ++g) {
    if (gscores[g] >= 0.0 && gkeys[g] == key) return g;
  }
  return -1;
}

// A ghost entry for a key: its own, else an empty one, else the one with
// the lowest score (first of equals).
WL_HD int wl_ghost_for(const wl_u64* gkeys, const double* gscores, int ghosts, wl_u64 key) {
  const int own = wl_find_ghost(gkeys, gscores, ghosts, key);
  if (own >= 0) return own;
  int low = -1;
  for (int g = 0; g < ghosts; ++g) {
    if (gscores[g] < 0.0) return g;
    if (low < 0 || gscores[g] < gscores[low]) low = g;
  }
  return low;
}

WL_HD void wl_ghost_note(wl_u64* gkeys, double* gscores, int ghosts, wl_u64 key, double score) {
  if (ghosts <= 0) return;
  const int g = wl_ghost_for(gkeys, gscores, ghosts, key);
  gkeys[g] = key;
  gscores[g] = score;
}

// A candidate's score: "stats": its ghost's decayed count (if any) plus
// count * weight; "lru": its count (misses come in most frequent first).
WL_HD double wl_candidate_score(const wl_u64* gkeys, const double* gscores, int ghosts, wl_u64 key,
                                double count, double weight, int policy) {
  if (policy != WL_POLICY_STATS) return count;
  const int g = wl_find_ghost(gkeys, gscores, ghosts, key);
  return WL_MUL_ADD(count, weight, g >= 0 ? gscores[g] : 0.0);
}

// One set's misses of a batch, best first (score descending). Each takes
// an empty entry, else the victim: the unlocked entry (epoch < epoch - 1)
// with the lowest score (first of equals), "stats" only when its score
// beats the victim's and the key was seen before (its score, taken before
// the batch, above one sighting's `weight`: a ghost's count, or another
// sighting in this batch), so a key seen once never displaces another and
// a key's repeats in a batch are decided alike. Victims join the ghosts ("stats"),
// candidates that stay out are noted there. Outputs per candidate: `way`
// (-1: not admitted), `how` (WL_*), `victim` (the key that left,
// WL_OVER_VICTIM).
WL_HD void wl_populate_set(wl_u64* keys, double* scores, wl_i64* epochs, int ways, wl_u64* gkeys,
                           double* gscores, int ghosts, const wl_u64* cand_keys,
                           const double* cand_scores, const unsigned char* allowed, int count,
                           wl_i64 epoch, int policy, double clock, double weight, wl_i64* way,
                           unsigned char* how, wl_u64* victim) {
  const bool stats = policy == WL_POLICY_STATS;
  for (int c = 0; c < count; ++c) {
    const wl_u64 key = cand_keys[c];
    const double score = cand_scores[c];
    way[c] = -1;
    how[c] = WL_NOT_ADMITTED;
    const int again = wl_find(keys, epochs, ways, key);
    if (again >= 0) {  // admitted by an earlier occurrence in this batch
      way[c] = again;
      how[c] = WL_REPEAT;
      continue;
    }
    int v = -1;
    if (allowed[c]) {
      for (int w = 0; w < ways; ++w) {
        if (epochs[w] < 0) {
          v = w;
          break;
        }
      }
    }
    const bool empty = v >= 0;
    if (allowed[c] && !empty) {
      for (int w = 0; w < ways; ++w) {
        if (epochs[w] < epoch - 1 && (v < 0 || scores[w] < scores[v])) v = w;
      }
    }
    // seen before: a ghost's count (scored before this batch) or another
    // sighting in this batch lifts the score above one sighting's weight
    const bool once = stats && !empty && !(score > weight);
    if (v < 0 || once || (stats && !empty && !(score > scores[v]))) {
      if (stats) wl_ghost_note(gkeys, gscores, ghosts, key, score);
      continue;
    }
    if (empty) {
      how[c] = WL_INTO_EMPTY;
      if (stats) {
        const int g = wl_find_ghost(gkeys, gscores, ghosts, key);
        if (g >= 0) gscores[g] = -1.0;
      }
    } else {
      how[c] = WL_OVER_VICTIM;
      victim[c] = keys[v];
      if (stats) {  // the victim takes the candidate's ghost, or another
        const int g = wl_ghost_for(gkeys, gscores, ghosts, key);
        gkeys[g] = keys[v];
        gscores[g] = scores[v];
      }
    }
    keys[v] = key;
    scores[v] = stats ? score : clock;
    epochs[v] = epoch;
    way[c] = v;
  }
}

#if defined(WL_CUDA)
// ---- the CUDA kernels (cupy RawModule) --------------------------------------
// Regions are given per key by `region` (int32) with per-region arrays
// entry_base, ghost_base (i64), sets (i64), ways (int32).

// One warp per key: lane w compares way w. Writes the key's entry (-1:
// absent). observe: a hit adds count * weight to its score ("stats") or
// stamps clock ("lru"), and stamps epoch.
extern "C" __global__ void wl_lookup(const wl_u64* __restrict__ qkeys,
                                     const int* __restrict__ region,
                                     const float* __restrict__ counts, long long n,
                                     const wl_i64* __restrict__ entry_base,
                                     const wl_i64* __restrict__ sets, const int* __restrict__ ways,
                                     wl_u64* keys, double* scores, wl_i64* epochs, int observe,
                                     wl_i64 epoch, int policy, double weight, double clock,
                                     wl_i64* __restrict__ out) {
  const long long warp = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (warp >= n) return;
  const wl_u64 key = qkeys[warp];
  const int r = region[warp];
  const int nw = ways[r];
  const wl_i64 start = entry_base[r] + wl_set_of(key, sets[r]) * nw;
  const bool match = lane < nw && epochs[start + lane] >= 0 && keys[start + lane] == key;
  const unsigned ballot = __ballot_sync(0xffffffffu, match);
  if (lane != 0) return;
  if (ballot == 0) {
    out[warp] = -1;
    return;
  }
  const wl_i64 e = start + (__ffs(ballot) - 1);
  out[warp] = e;
  if (observe) {
    epochs[e] = epoch;
    if (policy == WL_POLICY_STATS) {
      scores[e] = WL_MUL_ADD((double)(counts != 0 ? counts[warp] : 1.0f), weight, scores[e]);
    } else {
      scores[e] = clock;
    }
  }
}

// Each miss's set (global: entry index of its first way) and score.
extern "C" __global__ void wl_score_misses(
    const wl_u64* __restrict__ mkeys, const int* __restrict__ region,
    const float* __restrict__ counts, long long m, const wl_i64* __restrict__ entry_base,
    const wl_i64* __restrict__ ghost_base, const wl_i64* __restrict__ sets,
    const int* __restrict__ ways, const wl_u64* gkeys, const double* gscores, int ghosts_on,
    int policy, double weight, wl_i64* __restrict__ set_out, double* __restrict__ score_out) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= m) return;
  const wl_u64 key = mkeys[i];
  const int r = region[i];
  const wl_i64 set = wl_set_of(key, sets[r]);
  const int nw = ways[r];
  const int ng = ghosts_on ? nw : 0;
  set_out[i] = entry_base[r] + set * nw;
  const wl_i64 g0 = ghost_base[r] + set * nw;
  score_out[i] = wl_candidate_score(gkeys + g0, gscores + g0, ng, key,
                                    (double)(counts != 0 ? counts[i] : 1.0f), weight, policy);
}

// Misses sorted by (set, score descending): the thread of each set's first
// miss admits that set's misses in order (wl_populate_set).
extern "C" __global__ void wl_populate(
    const wl_u64* __restrict__ mkeys, const int* __restrict__ region,
    const wl_i64* __restrict__ mset, const double* __restrict__ mscore,
    const unsigned char* __restrict__ allowed, long long m, const wl_i64* __restrict__ entry_base,
    const wl_i64* __restrict__ ghost_base, const int* __restrict__ ways, wl_u64* keys,
    double* scores, wl_i64* epochs, wl_u64* gkeys, double* gscores, int ghosts_on, wl_i64 epoch,
    int policy, double clock, double weight, wl_i64* __restrict__ way_out,
    unsigned char* __restrict__ how, wl_u64* __restrict__ victim) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= m || (i > 0 && mset[i - 1] == mset[i])) return;
  long long end = i + 1;
  while (end < m && mset[end] == mset[i]) ++end;
  const int r = region[i];
  const int nw = ways[r];
  const wl_i64 start = mset[i];
  const wl_i64 g0 = ghost_base[r] + (start - entry_base[r]);
  wl_populate_set(keys + start, scores + start, epochs + start, nw, gkeys + g0, gscores + g0,
                  ghosts_on ? nw : 0, mkeys + i, mscore + i, allowed + i, (int)(end - i), epoch,
                  policy, clock, weight, way_out + i, how + i, victim + i);
  for (long long j = i; j < end; ++j) {
    if (way_out[j] >= 0) way_out[j] += start;
  }
}
#endif  // WL_CUDA
