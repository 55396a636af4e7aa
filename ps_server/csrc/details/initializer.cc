#include "details/initializer.h"

#include <algorithm>
#include <cmath>

#include "wuliang/ps/hash.h"

namespace wuliang::ps::details {
namespace {

constexpr uint64_t kGolden = 0x9e3779b97f4a7c15ULL;

// Counter-based stream of uniforms keyed by (seed, key).
class KeyStream {
 public:
  KeyStream(uint64_t seed, uint64_t key) : base_(Mix64(Mix64(seed + kGolden) ^ key)) {}

  // Uniform in the open interval (0, 1).
  double Uniform() {
    const uint64_t bits = Mix64(base_ + (++counter_) * kGolden);
    return (static_cast<double>(bits >> 11) + 0.5) * 0x1.0p-53;
  }

  // Standard normal by Box-Muller; the second value of each pair is kept.
  double Normal() {
    if (has_spare_) {
      has_spare_ = false;
      return spare_;
    }
    const double r = std::sqrt(-2.0 * std::log(Uniform()));
    const double theta = 2.0 * M_PI * Uniform();
    spare_ = r * std::sin(theta);
    has_spare_ = true;
    return r * std::cos(theta);
  }

 private:
  uint64_t base_;
  uint64_t counter_ = 0;
  double spare_ = 0.0;
  bool has_spare_ = false;
};

}  // namespace

void InitializeWeights(const InitSpec& spec, uint64_t seed, uint64_t key, int dim, float* out) {
  switch (spec.kind) {
    case InitKind::kZeros:
      std::fill(out, out + dim, 0.0f);
      return;
    case InitKind::kConstant:
      std::fill(out, out + dim, spec.value);
      return;
    default:
      break;
  }
  KeyStream stream(seed, key);
  for (int j = 0; j < dim; ++j) {
    double v = 0.0;
    switch (spec.kind) {
      case InitKind::kUniform:
        v = spec.minval + (spec.maxval - spec.minval) * stream.Uniform();
        break;
      case InitKind::kNormal:
        v = spec.mean + spec.stddev * stream.Normal();
        break;
      case InitKind::kTruncatedNormal: {
        double z = stream.Normal();
        while (std::fabs(z) > 2.0) z = stream.Normal();
        v = spec.mean + spec.stddev * z;
        break;
      }
      default:
        break;
    }
    out[j] = static_cast<float>(v);
  }
}

}  // namespace wuliang::ps::details
