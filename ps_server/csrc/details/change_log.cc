#include "details/change_log.h"

#include <algorithm>

namespace wuliang::ps::details {

void ChangeLog::Forget(uint64_t version) {
  if (version <= floor_) return;
  floor_ = version;
  const size_t first = FirstAfter(version);
  const size_t cut = first < segments_.size() ? segments_[first].start : keys_.size();
  keys_.erase(keys_.begin(), keys_.begin() + static_cast<std::ptrdiff_t>(cut));
  segments_.erase(segments_.begin(), segments_.begin() + static_cast<std::ptrdiff_t>(first));
  for (Segment& s : segments_) s.start -= cut;
}

void ChangeLog::DropOldest(size_t keep) {
  size_t first = 0;
  while (first < segments_.size() && keys_.size() - segments_[first].start > keep) ++first;
  if (first > 0) Forget(segments_[first - 1].version);
}

size_t ChangeLog::FirstAfter(uint64_t since) const {
  return static_cast<size_t>(
      std::upper_bound(segments_.begin(), segments_.end(), since,
                       [](uint64_t v, const Segment& s) { return v < s.version; }) -
      segments_.begin());
}

void ChangeLog::KeysSince(uint64_t since, std::vector<uint64_t>* keys) const {
  const size_t first = FirstAfter(since);
  if (first == segments_.size()) return;
  keys->assign(keys_.begin() + static_cast<std::ptrdiff_t>(segments_[first].start), keys_.end());
  std::sort(keys->begin(), keys->end());
  keys->erase(std::unique(keys->begin(), keys->end()), keys->end());
}

void ChangeLog::RecordsSince(uint64_t since,
                             std::vector<std::pair<uint64_t, uint64_t>>* out) const {
  for (size_t s = FirstAfter(since); s < segments_.size(); ++s) {
    const size_t end = s + 1 < segments_.size() ? segments_[s + 1].start : keys_.size();
    for (size_t i = segments_[s].start; i < end; ++i)
      out->emplace_back(keys_[i], segments_[s].version);
  }
}

}  // namespace wuliang::ps::details
