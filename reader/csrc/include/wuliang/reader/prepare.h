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
  std::vector<uint64_t> uniques;       // grouped by cell, first-seen order within a cell
  std::vector<int64_t> shard_offsets;  // (num_servers * num_shards + 1,)
};

// Groups by cell: with num_servers > 1 (remote servers of num_shards shards
// each), a key's cell is ServerOf(key, num_servers) * num_shards +
// ShardOf(key, num_shards), so each server's keys are one contiguous run,
// grouped by its shards; with one server the cell is the shard.
// Throws std::invalid_argument for a table index out of [0, num_tables) or a
// table with 2^31 or more values.
void PrepareKeys(FeatureKeys* features, size_t num_features, int num_tables, uint32_t num_shards,
                 uint32_t num_servers, std::vector<TableKeys>* tables);

}  // namespace wuliang::reader
