#include "details/pending_counter.h"

#include <utility>
#include <vector>

namespace wuliang::ps::details {

uint32_t PendingCounter::Observe(uint64_t key, uint64_t hash) {
  if (uint32_t* count = map_.Find(key, hash)) {
    if (*count != UINT32_MAX) ++*count;
    return *count;
  }
  if (map_.size() >= capacity_) Decay();
  *map_.InsertNew(key, hash) = 1;
  return 1;
}

void PendingCounter::Set(uint64_t key, uint64_t hash, uint32_t count) {
  if (count == 0) {
    map_.Erase(key, hash);
    return;
  }
  if (uint32_t* found = map_.Find(key, hash)) {
    *found = count;
    return;
  }
  if (map_.size() >= capacity_) Decay();
  *map_.InsertNew(key, hash) = count;
}

void PendingCounter::Counts(std::vector<std::pair<uint64_t, uint32_t>>* out) const {
  map_.ForEach([&](uint64_t key, uint32_t count) { out->emplace_back(key, count); });
}

void PendingCounter::Decay() {
  std::vector<std::pair<uint64_t, uint32_t>> kept;
  map_.ForEach([&](uint64_t key, uint32_t count) {
    if (count / 2 > 0) kept.emplace_back(key, count / 2);
  });
  if (kept.size() * 4 > capacity_ * 3) kept.clear();
  forgotten_ += map_.size() - kept.size();
  map_.Clear();
  for (const auto& [key, count] : kept) *map_.InsertNew(key, Mix64(key)) = count;
}

}  // namespace wuliang::ps::details
