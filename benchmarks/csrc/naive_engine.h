// Benchmark baseline: what a straightforward parameter server looks like.
// std::unordered_map<key, row*> behind one mutex, one malloc per row, the
// same row layout, initializer and optimizer code as Engine. Not for use:
// benchmark-only (benchmarks/ps_bench.py through the wuliang_bench module),
// built only with WULIANG_BENCH=ON or WULIANG_TESTS=ON, never part of
// wuliang_ps or the default wheel.
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <unordered_map>

#include "wuliang/ps/table_spec.h"

namespace wuliang::bench {

class NaiveEngine {
 public:
  explicit NaiveEngine(const ps::TableSpec& spec);
  ~NaiveEngine();
  NaiveEngine(const NaiveEngine&) = delete;
  NaiveEngine& operator=(const NaiveEngine&) = delete;

  void Pull(const uint64_t* keys, size_t n, float* out, bool train);  // out: (n, dim)
  void Push(const uint64_t* keys, size_t n, const float* grads);      // grads: (n, dim)
  int dim() const { return spec_.dim; }
  size_t rows();
  size_t bytes();  // rows, map nodes and buckets (malloc overhead excluded)

 private:
  char* FindOrCreate(uint64_t key);

  ps::TableSpec spec_;
  int state_dim_;
  size_t stride_;
  std::mutex mutex_;
  std::unordered_map<uint64_t, char*> rows_;
};

}  // namespace wuliang::bench
