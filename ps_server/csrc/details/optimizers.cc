#include "details/optimizers.h"

#include <algorithm>

namespace wuliang::ps::details {

void InitState(const OptimizerSpec& opt, int dim, float* state) {
  switch (opt.kind) {
    case OptimizerKind::kSgd:
      break;
    case OptimizerKind::kAdagrad:
      std::fill(state, state + dim, opt.initial_accumulator);
      break;
    case OptimizerKind::kAdam:  // m, v, t
      std::fill(state, state + 2 * dim + 1, 0.0f);
      break;
    case OptimizerKind::kFtrl:  // z, n
      std::fill(state, state + dim, 0.0f);
      std::fill(state + dim, state + 2 * dim, opt.initial_accumulator);
      break;
  }
}

}  // namespace wuliang::ps::details
