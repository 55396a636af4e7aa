// Row updates applied on the engine. Each function updates one row in place
// from one (already summed) gradient row; `scale` multiplies the gradient
// (norm clipping). Formulas are in docs/ps_engine.md and mirrored by the numpy
// references in tests/test_optimizers.py.
#pragma once

#include "details/row_layout.h"
#include "wuliang/ps/table_spec.h"

namespace wuliang::ps::details {

// Optimizer state of a new row.
void InitState(const OptimizerSpec& opt, int dim, float* state);  // (state_dim,)

// Returns the factor that clips grad to opt.clip_norm (1 when disabled).
float ClipScale(const OptimizerSpec& opt, const float* grad, int dim);

// True when every value is finite.
bool AllFinite(const float* values, int n);

void ApplyUpdate(const OptimizerSpec& opt, int dim,
                 float* weights,     // (dim,)
                 float* state,       // (state_dim,)
                 const float* grad,  // (dim,)
                 float scale);

}  // namespace wuliang::ps::details
