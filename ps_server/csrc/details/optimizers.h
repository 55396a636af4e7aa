// Row updates applied on the engine. UpdateRow<K> updates one row in place
// from one (already summed) gradient row; `scale` multiplies the gradient
// (norm clipping). Inline and templated on the optimizer so a batch
// dispatches once, not per row. Formulas: ps_server/spec.py; numpy
// references: tests/test_optimizers.py.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "wuliang/ps/table_spec.h"

namespace wuliang::ps::details {

// Optimizer state of a new row.
void InitState(const OptimizerSpec& opt, int dim, float* state);  // (state_dim,)

// The factor that clips grad to opt.clip_norm (1 when disabled).
inline float ClipScale(const OptimizerSpec& opt, const float* grad, int dim) {
  if (opt.clip_norm <= 0.0f) return 1.0f;
  float sq = 0.0f;
  for (int j = 0; j < dim; ++j) sq += grad[j] * grad[j];
  const float norm = std::sqrt(sq);
  return norm > opt.clip_norm ? opt.clip_norm / norm : 1.0f;
}

// True when every value is finite: no magnitude's bits reach the infinity
// pattern (an integer max, which vectorizes; a float sum would not).
inline bool AllFinite(const float* values, int n) {
  uint32_t largest = 0;
  for (int j = 0; j < n; ++j) {
    uint32_t bits;
    std::memcpy(&bits, values + j, sizeof bits);
    largest = std::max(largest, bits & 0x7fffffffu);
  }
  return largest < 0x7f800000u;
}

// An optimizer's spec with what every row update of a batch shares, worked
// out once per batch (Adam's log2 betas: beta^t as exp2(t log2 beta) costs
// a third of pow).
struct RowOptimizer : OptimizerSpec {
  double log2_beta1 = 0.0;
  double log2_beta2 = 0.0;

  explicit RowOptimizer(const OptimizerSpec& spec) : OptimizerSpec(spec) {
    if (spec.kind == OptimizerKind::kAdam) {
      log2_beta1 = std::log2(static_cast<double>(spec.beta1));
      log2_beta2 = std::log2(static_cast<double>(spec.beta2));
    }
  }
};

template <OptimizerKind K>
inline void UpdateRow(const RowOptimizer& o, int dim,
                      float* __restrict w,        // (dim,)
                      float* __restrict state,    // (state_dim,)
                      const float* __restrict g,  // (dim,)
                      float scale) {
  if constexpr (K == OptimizerKind::kSgd) {
    // w -= lr * g
    const float lr = o.learning_rate * scale;
    for (int j = 0; j < dim; ++j) w[j] -= lr * g[j];
  } else if constexpr (K == OptimizerKind::kAdagrad) {
    // acc += g^2; w -= lr * g / (sqrt(acc) + eps)
    float* __restrict acc = state;
    for (int j = 0; j < dim; ++j) {
      const float gj = g[j] * scale;
      acc[j] += gj * gj;
      w[j] -= o.learning_rate * gj / (std::sqrt(acc[j]) + o.epsilon);
    }
  } else if constexpr (K == OptimizerKind::kAdam) {
    // Lazy Adam: t counts this row's updates, so bias correction is per row.
    float* __restrict m = state;
    float* __restrict v = state + dim;
    float& t = state[2 * dim];
    t += 1.0f;
    const double td = t;
    const auto lr_t =
        static_cast<float>(o.learning_rate * std::sqrt(1.0 - std::exp2(td * o.log2_beta2)) /
                           (1.0 - std::exp2(td * o.log2_beta1)));
    const float b1 = o.beta1, b2 = o.beta2, eps = o.epsilon;
    for (int j = 0; j < dim; ++j) {
      const float gj = g[j] * scale;
      m[j] = b1 * m[j] + (1.0f - b1) * gj;
      v[j] = b2 * v[j] + (1.0f - b2) * gj * gj;
      w[j] -= lr_t * m[j] / (std::sqrt(v[j]) + eps);
    }
  } else {
    // FTRL-Proximal, per coordinate (McMahan et al. 2013, Algorithm 1):
    //   sigma = (sqrt(n + g^2) - sqrt(n)) / alpha;  z += g - sigma * w;  n += g^2
    //   w = |z| <= l1 ? 0 : -(z - sign(z) * l1) / ((beta + sqrt(n)) / alpha + l2)
    float* __restrict z = state;
    float* __restrict n = state + dim;
    const float inv_alpha = 1.0f / o.learning_rate;
    for (int j = 0; j < dim; ++j) {
      const float gj = g[j] * scale;
      const float n_new = n[j] + gj * gj;
      const float sqrt_new = std::sqrt(n_new);
      const float sigma = (sqrt_new - std::sqrt(n[j])) * inv_alpha;
      z[j] += gj - sigma * w[j];
      n[j] = n_new;
      const float zj = z[j];
      const float shrunk = zj - std::copysign(o.l1, zj);
      const float solved = -shrunk / ((o.beta + sqrt_new) * inv_alpha + o.l2);
      w[j] = std::fabs(zj) <= o.l1 ? 0.0f : solved;
    }
  }
}

// Calls fn(std::integral_constant<OptimizerKind, kind>{}): one dispatch per batch.
template <class Fn>
inline void WithOptimizer(OptimizerKind kind, Fn&& fn) {
  switch (kind) {
    case OptimizerKind::kSgd:
      return fn(std::integral_constant<OptimizerKind, OptimizerKind::kSgd>{});
    case OptimizerKind::kAdagrad:
      return fn(std::integral_constant<OptimizerKind, OptimizerKind::kAdagrad>{});
    case OptimizerKind::kAdam:
      return fn(std::integral_constant<OptimizerKind, OptimizerKind::kAdam>{});
    case OptimizerKind::kFtrl:
      return fn(std::integral_constant<OptimizerKind, OptimizerKind::kFtrl>{});
  }
}

// Runtime-dispatched UpdateRow, for callers that update one row at a time.
inline void ApplyUpdate(const OptimizerSpec& opt, int dim, float* weights, float* state,
                        const float* grad, float scale) {
  const RowOptimizer row_opt(opt);
  WithOptimizer(opt.kind, [&](auto kind) {
    UpdateRow<decltype(kind)::value>(row_opt, dim, weights, state, grad, scale);
  });
}

}  // namespace wuliang::ps::details
