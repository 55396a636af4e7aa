// Initial row values as a pure function of (spec, table seed, key): the same
// key gets the same vector on any shard count, process or machine. The file
// is built without floating-point contraction and writes its FMAs out, so
// vector widths and -march do not change a bit.
#pragma once

#include <cstddef>
#include <cstdint>

#include "wuliang/ps/table_spec.h"

namespace wuliang::ps::details {

void InitializeWeights(const InitSpec& spec, uint64_t seed, uint64_t key, int dim,
                       float* out);  // (dim,)

// The same for n rows: out[i] = the initial vector of keys[i]. Rows done in
// one loop overlap their long chains of dependent vector operations (and
// share the constants' setup): ~40 instead of ~65 ns a row for a truncated
// normal of dim 16, same values.
void InitializeRows(const InitSpec& spec, uint64_t seed, const uint64_t* keys, float* const* out,
                    size_t n, int dim);

}  // namespace wuliang::ps::details
