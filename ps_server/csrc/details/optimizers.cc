#include "details/optimizers.h"

#include <algorithm>
#include <cmath>

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

float ClipScale(const OptimizerSpec& opt, const float* grad, int dim) {
  if (opt.clip_norm <= 0.0f) return 1.0f;
  float sq = 0.0f;
  for (int j = 0; j < dim; ++j) sq += grad[j] * grad[j];
  const float norm = std::sqrt(sq);
  return norm > opt.clip_norm ? opt.clip_norm / norm : 1.0f;
}

bool AllFinite(const float* values, int n) {
  float probe = 0.0f;  // stays 0 unless some value is inf or nan
  for (int j = 0; j < n; ++j) probe += values[j] * 0.0f;
  return probe == 0.0f;
}

namespace {

void Sgd(const OptimizerSpec& o, int dim, float* __restrict w, const float* __restrict g,
         float scale) {
  const float lr = o.learning_rate * scale;
  for (int j = 0; j < dim; ++j) w[j] -= lr * g[j];
}

// acc += g^2; w -= lr * g / (sqrt(acc) + eps)
void Adagrad(const OptimizerSpec& o, int dim, float* __restrict w, float* __restrict acc,
             const float* __restrict g, float scale) {
  const float lr = o.learning_rate;
  const float eps = o.epsilon;
  for (int j = 0; j < dim; ++j) {
    const float gj = g[j] * scale;
    acc[j] += gj * gj;
    w[j] -= lr * gj / (std::sqrt(acc[j]) + eps);
  }
}

// Lazy Adam: t counts this row's updates, so bias correction is per row.
void Adam(const OptimizerSpec& o, int dim, float* __restrict w, float* __restrict state,
          const float* __restrict g, float scale) {
  float* __restrict m = state;
  float* __restrict v = state + dim;
  float& t = state[2 * dim];
  t += 1.0f;
  const double td = t;
  const float lr_t = static_cast<float>(o.learning_rate * std::sqrt(1.0 - std::pow(o.beta2, td)) /
                                        (1.0 - std::pow(o.beta1, td)));
  const float b1 = o.beta1, b2 = o.beta2, eps = o.epsilon;
  for (int j = 0; j < dim; ++j) {
    const float gj = g[j] * scale;
    m[j] = b1 * m[j] + (1.0f - b1) * gj;
    v[j] = b2 * v[j] + (1.0f - b2) * gj * gj;
    w[j] -= lr_t * m[j] / (std::sqrt(v[j]) + eps);
  }
}

// FTRL-Proximal, per coordinate (McMahan et al. 2013, Algorithm 1):
//   sigma = (sqrt(n + g^2) - sqrt(n)) / alpha;  z += g - sigma * w;  n += g^2
//   w = |z| <= l1 ? 0 : -(z - sign(z) * l1) / ((beta + sqrt(n)) / alpha + l2)
void Ftrl(const OptimizerSpec& o, int dim, float* __restrict w, float* __restrict state,
          const float* __restrict g, float scale) {
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
    if (std::fabs(zj) <= o.l1) {
      w[j] = 0.0f;
    } else {
      const float shrunk = zj - std::copysign(o.l1, zj);
      w[j] = -shrunk / ((o.beta + sqrt_new) * inv_alpha + o.l2);
    }
  }
}

}  // namespace

void ApplyUpdate(const OptimizerSpec& opt, int dim, float* weights, float* state, const float* grad,
                 float scale) {
  switch (opt.kind) {
    case OptimizerKind::kSgd:
      Sgd(opt, dim, weights, grad, scale);
      break;
    case OptimizerKind::kAdagrad:
      Adagrad(opt, dim, weights, state, grad, scale);
      break;
    case OptimizerKind::kAdam:
      Adam(opt, dim, weights, state, grad, scale);
      break;
    case OptimizerKind::kFtrl:
      Ftrl(opt, dim, weights, state, grad, scale);
      break;
  }
}

}  // namespace wuliang::ps::details
