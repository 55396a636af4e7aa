// Key preparation: what a training step pulls, computed while the previous
// step trains.
//
// For a batch and a map feature -> table: per table, the unique keys of all
// its features, grouped by parameter-server shard (the engine's ShardOf), and
// per feature the inverse index of every value into its table's uniques.
//
//   feature "genres" (table item_attr): values [7, 9, 7, 3]
//   feature "tags"   (table item_attr): values [9, 4]
//   -> item_attr uniques, by shard: [9, 3 | 7, 4]   shard_offsets [0, 2, 4]
//      genres inverse [2, 0, 2, 1], tags inverse [0, 3]
//
// Pure function of its inputs; safe to call from several threads at once
// (scratch memory is thread-local).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace wuliang::reader {

struct FeatureKeys {
  int table;               // index into the output tables
  const uint64_t* values;  // (n,)
  size_t n;
  int32_t* inverse;  // (n,) written: position of each value in its table's uniques
};

struct TableKeys {
  std::vector<uint64_t> uniques;       // grouped by shard, first-seen order within a shard
  std::vector<int64_t> shard_offsets;  // (num_shards + 1,)
};

// Throws std::invalid_argument for a table index out of [0, num_tables) or a
// table with 2^31 or more values.
void PrepareKeys(FeatureKeys* features, size_t num_features, int num_tables, uint32_t num_shards,
                 std::vector<TableKeys>* tables);

// out[i] = base + j where b[j] == a[i] (b without repeats), else -1: where
// the previous batch's push writes each of its rows into the next batch's
// pulled rows (the rows both batches have).
void IndexIn(const uint64_t* a, size_t na,  // (na,)
             const uint64_t* b, size_t nb,  // (nb,)
             int32_t base, int32_t* out);   // (na,)

// out[index[i]] += values[i] for i < n, rows of dim floats: the gradient of
// each unique row, summed over the values looked up from it (the inverse of
// a gather). Sequential, so the sums are deterministic. Throws
// std::out_of_range naming the first index outside [0, out_rows).
void ScatterAddRows(float* out, size_t out_rows, size_t dim,  // (out_rows, dim)
                    const int32_t* index, size_t n,           // (n,)
                    const float* values);                     // (n, dim)

}  // namespace wuliang::reader
