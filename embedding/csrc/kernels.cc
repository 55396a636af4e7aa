#include "wuliang/embedding/kernels.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "wuliang/ps/hash.h"
#include "wuliang/reader/dedup_table.h"

namespace wuliang::embedding {
namespace {

// Per-thread scratch memory, reached through the reference a non-inlined
// call returns: in a shared library GCC re-derives a thread_local's address
// (a __tls_get_addr call) inside loops rather than keep it in a register.
struct Scratch {
  reader::DedupTable set;
  std::vector<uint64_t> hashes;
};

[[gnu::noinline]] Scratch& ThreadScratch() {
  thread_local Scratch scratch;
  return scratch;
}

}  // namespace

void IndexIn(const uint64_t* a, size_t na, const uint64_t* b, size_t nb, int32_t base,
             int32_t* out) {
  Scratch& s = ThreadScratch();
  reader::DedupTable& set = s.set;
  std::vector<uint64_t>& hashes = s.hashes;
  constexpr size_t kAhead = 16;  // prefetch distance into the set
  set.Reset(nb);
  hashes.resize(std::max(na, nb));
  for (size_t j = 0; j < nb; ++j) hashes[j] = ps::Mix64(b[j]);
  bool inserted;
  for (size_t j = 0; j < nb; ++j) {
    if (j + kAhead < nb) set.Prefetch(hashes[j + kAhead]);
    set.Insert(b[j], hashes[j], static_cast<uint32_t>(j), &inserted);
  }
  for (size_t i = 0; i < na; ++i) hashes[i] = ps::Mix64(a[i]);
  for (size_t i = 0; i < na; ++i) {
    if (i + kAhead < na) set.Prefetch(hashes[i + kAhead]);
    const int64_t j = set.Find(a[i], hashes[i]);
    out[i] = j < 0 ? -1 : base + static_cast<int32_t>(j);
  }
}

void ScatterAddRows(float* out, size_t out_rows, size_t dim, const int32_t* index, size_t n,
                    const float* values) {
  for (size_t i = 0; i < n; ++i) {
    if (index[i] < 0 || static_cast<size_t>(index[i]) >= out_rows) {
      throw std::out_of_range("index " + std::to_string(index[i]) + " at position " +
                              std::to_string(i) + " is outside the " + std::to_string(out_rows) +
                              " rows");
    }
  }
  for (size_t i = 0; i < n; ++i) {
    float* __restrict dst = out + static_cast<size_t>(index[i]) * dim;
    const float* __restrict src = values + i * dim;
    for (size_t j = 0; j < dim; ++j) dst[j] += src[j];
  }
}

}  // namespace wuliang::embedding
