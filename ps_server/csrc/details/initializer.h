// Initial row values as a pure function of (spec, table seed, key): the same
// key gets the same vector on any shard count, process or machine. The file
// is built without floating-point contraction and writes its FMAs out, so
// vector widths and -march do not change a bit.
#pragma once

#include <cstdint>

#include "wuliang/ps/table_spec.h"

namespace wuliang::ps::details {

void InitializeWeights(const InitSpec& spec, uint64_t seed, uint64_t key, int dim,
                       float* out);  // (dim,)

}  // namespace wuliang::ps::details
