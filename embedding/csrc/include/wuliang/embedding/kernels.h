// Host kernels of the training bridge (wuliang.embedding.kernels), around
// the TensorFlow step:
//
//   IndexIn         where the previous step's pushed rows sit among this
//                   step's pulled rows (the pipeline's link, staleness 0)
//   ScatterAddRows  dL/d(looked-up values) -> dL/d(unique rows) to push
//
// Pure functions of their inputs; safe to call from several threads at once
// (scratch memory is thread-local).
#pragma once

#include <cstddef>
#include <cstdint>

namespace wuliang::embedding {

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

}  // namespace wuliang::embedding
