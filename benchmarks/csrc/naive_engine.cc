#include "naive_engine.h"

#include <cstdlib>
#include <cstring>
#include <ctime>
#include <new>

#include "details/initializer.h"
#include "details/optimizers.h"
#include "details/row_layout.h"

namespace wuliang::bench {

namespace details = ps::details;
using details::RowLayout;

// Naive rows are one malloc each: | RowMeta | weights | state |.
namespace {
details::RowMeta* Meta(char* row) { return RowLayout::Meta(row); }
float* Weights(char* row) { return reinterpret_cast<float*>(row + sizeof(details::RowMeta)); }
}  // namespace

NaiveEngine::NaiveEngine(const ps::TableSpec& spec)
    : spec_(spec),
      state_dim_(ps::StateDim(spec.optimizer.kind, spec.dim)),
      stride_(sizeof(details::RowMeta) + sizeof(float) * (spec.dim + state_dim_)) {
  ps::ValidateSpec(spec);
}

NaiveEngine::~NaiveEngine() {
  for (auto& [key, row] : rows_) std::free(row);
}

char* NaiveEngine::FindOrCreate(uint64_t key) {
  auto it = rows_.find(key);
  if (it != rows_.end()) return it->second;
  char* row = static_cast<char*>(std::malloc(stride_));
  if (row == nullptr) throw std::bad_alloc();
  auto* meta = Meta(row);
  *meta = details::RowMeta{0, 1, static_cast<uint32_t>(std::time(nullptr)), 0, 0.0f, 0.0f};
  details::InitializeWeights(spec_.initializer, spec_.seed, key, spec_.dim, Weights(row));
  details::InitState(spec_.optimizer, spec_.dim, Weights(row) + spec_.dim);
  rows_.emplace(key, row);
  return row;
}

void NaiveEngine::Pull(const uint64_t* keys, size_t n, float* out, bool train) {
  std::lock_guard<std::mutex> lock(mutex_);
  const int dim = spec_.dim;
  for (size_t i = 0; i < n; ++i) {
    char* row = FindOrCreate(keys[i]);
    std::memcpy(out + i * dim, Weights(row), sizeof(float) * dim);
    if (train) details::BumpCount(Meta(row));
  }
}

void NaiveEngine::Push(const uint64_t* keys, size_t n, const float* grads) {
  std::lock_guard<std::mutex> lock(mutex_);
  const int dim = spec_.dim;
  for (size_t i = 0; i < n; ++i) {
    char* row = FindOrCreate(keys[i]);
    const float* g = grads + i * dim;
    float* w = Weights(row);
    details::ApplyUpdate(spec_.optimizer, dim, w, w + dim, g,
                         details::ClipScale(spec_.optimizer, g, dim));
    Meta(row)->update_step += 1;
  }
}

size_t NaiveEngine::rows() {
  std::lock_guard<std::mutex> lock(mutex_);
  return rows_.size();
}

size_t NaiveEngine::bytes() {
  std::lock_guard<std::mutex> lock(mutex_);
  // Each node holds next pointer + key + value; buckets are pointers.
  const size_t node = sizeof(void*) + sizeof(uint64_t) + sizeof(char*);
  return rows_.size() * (stride_ + node) + rows_.bucket_count() * sizeof(void*);
}

}  // namespace wuliang::bench
