// Keys a shard modified (or removed), grouped by the engine version of the
// change, so a delta export visits only the rows it contains.
//
// Versions only grow, so the log is a list of keys cut into segments of one
// version each, oldest first. A key changed in several versions appears in
// each; KeysSince() sorts and dedups. Memory is bounded by the owner
// dropping the oldest segments (DropOldest); `floor` is then raised to the
// newest version dropped: the log lists every change with version > floor,
// and a caller asking for an older one (Covers() false) must scan instead.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace wuliang::ps::details {

class ChangeLog {
 public:
  // Records a change of key at version (ignored at or below the floor).
  void Record(uint64_t key, uint64_t version) {
    if (version <= floor_) return;
    if (segments_.empty() || segments_.back().version != version) {
      // Versions come in order; an older one means the log is incomplete
      // below it.
      if (!segments_.empty() && version < segments_.back().version) {
        Forget(version);
        return;
      }
      segments_.push_back({version, keys_.size()});
    }
    keys_.push_back(key);
  }

  // Allocates (and touches) room for n keys now, so that growing up to n
  // later writes no fresh memory.
  void Reserve(size_t n) {
    const size_t size = keys_.size();
    if (n <= size) return;
    keys_.resize(n);     // zero-fills: faults the pages in
    keys_.resize(size);  // keeps the capacity
  }

  // The log no longer lists every change up to `version`.
  void Forget(uint64_t version);
  // Drops the oldest segments until at most `keep` keys remain.
  void DropOldest(size_t keep);

  bool Covers(uint64_t since) const { return since >= floor_; }
  uint64_t floor() const { return floor_; }
  size_t size() const { return keys_.size(); }

  // Keys changed after version `since`, sorted, without repeats.
  void KeysSince(uint64_t since, std::vector<uint64_t>* keys) const;
  // (key, version) records after version `since`, oldest first.
  void RecordsSince(uint64_t since, std::vector<std::pair<uint64_t, uint64_t>>* out) const;

 private:
  struct Segment {
    uint64_t version;
    size_t start;  // first key of the segment in keys_
  };
  // First segment with version > since.
  size_t FirstAfter(uint64_t since) const;

  std::vector<uint64_t> keys_;
  std::vector<Segment> segments_;
  uint64_t floor_ = 0;
};

}  // namespace wuliang::ps::details
