#include "details/initializer.h"

#include <algorithm>
#include <cmath>

#include "wuliang/ps/hash.h"

namespace wuliang::ps::details {
namespace {

constexpr uint64_t kGolden = 0x9e3779b97f4a7c15ULL;

// Marsaglia & Tsang's ziggurat (2000) for the standard normal: 128 layers,
// one table lookup and a compare for ~99% of draws, no transcendental
// functions on the fast path. The tables are computed once.
struct Ziggurat {
  static constexpr double kR = 3.442619855899;  // start of the tail
  uint32_t k[128];
  float w[128];
  float f[128];

  Ziggurat() {
    const double m1 = 2147483648.0;
    const double vn = 9.91256303526217e-3;
    double dn = kR, tn = kR;
    const double q = vn / std::exp(-0.5 * dn * dn);
    k[0] = static_cast<uint32_t>((dn / q) * m1);
    k[1] = 0;
    w[0] = static_cast<float>(q / m1);
    w[127] = static_cast<float>(dn / m1);
    f[0] = 1.0f;
    f[127] = static_cast<float>(std::exp(-0.5 * dn * dn));
    for (int i = 126; i >= 1; --i) {
      dn = std::sqrt(-2.0 * std::log(vn / dn + std::exp(-0.5 * dn * dn)));
      k[i + 1] = static_cast<uint32_t>((dn / tn) * m1);
      tn = dn;
      f[i] = static_cast<float>(std::exp(-0.5 * dn * dn));
      w[i] = static_cast<float>(dn / m1);
    }
  }
};

const Ziggurat& Tables() {
  static const Ziggurat tables;
  return tables;
}

// Counter-based stream of random numbers keyed by (seed, key).
class KeyStream {
 public:
  KeyStream(uint64_t seed, uint64_t key) : base_(Mix64(Mix64(seed + kGolden) ^ key)) {}

  uint64_t Bits() { return Mix64(base_ + (++counter_) * kGolden); }

  // 32 random bits: the two halves of one Bits() in turn.
  uint32_t Bits32() {
    if (have_half_) {
      have_half_ = false;
      return half_;
    }
    const uint64_t bits = Bits();
    half_ = static_cast<uint32_t>(bits >> 32);
    have_half_ = true;
    return static_cast<uint32_t>(bits);
  }

  // Uniform in the open interval (0, 1).
  double Uniform() { return (static_cast<double>(Bits() >> 11) + 0.5) * 0x1.0p-53; }

  // Standard normal (ziggurat).
  double Normal() {
    const Ziggurat& z = Tables();
    for (;;) {
      const auto hz = static_cast<int32_t>(Bits32());
      const uint32_t iz = static_cast<uint32_t>(hz) & 127;
      const uint32_t magnitude =
          hz < 0 ? static_cast<uint32_t>(-static_cast<int64_t>(hz)) : static_cast<uint32_t>(hz);
      const double x = hz * static_cast<double>(z.w[iz]);
      if (magnitude < z.k[iz]) return x;
      if (iz == 0) {  // the tail beyond kR
        double tx, ty;
        do {
          tx = -std::log(Uniform()) / Ziggurat::kR;
          ty = -std::log(Uniform());
        } while (ty + ty < tx * tx);
        return hz > 0 ? Ziggurat::kR + tx : -Ziggurat::kR - tx;
      }
      // A wedge: accept under the density, else draw again.
      if (z.f[iz] + Uniform() * (z.f[iz - 1] - z.f[iz]) < std::exp(-0.5 * x * x)) return x;
    }
  }

 private:
  uint64_t base_;
  uint64_t counter_ = 0;
  uint32_t half_ = 0;
  bool have_half_ = false;
};

}  // namespace

void InitializeWeights(const InitSpec& spec, uint64_t seed, uint64_t key, int dim, float* out) {
  KeyStream stream(seed, key);
  switch (spec.kind) {
    case InitKind::kZeros:
      std::fill(out, out + dim, 0.0f);
      return;
    case InitKind::kConstant:
      std::fill(out, out + dim, spec.value);
      return;
    case InitKind::kUniform:
      for (int j = 0; j < dim; ++j) {
        out[j] = static_cast<float>(spec.minval + (spec.maxval - spec.minval) * stream.Uniform());
      }
      return;
    case InitKind::kNormal:
      for (int j = 0; j < dim; ++j) {
        out[j] = static_cast<float>(spec.mean + spec.stddev * stream.Normal());
      }
      return;
    case InitKind::kTruncatedNormal:
      for (int j = 0; j < dim; ++j) {
        double z = stream.Normal();
        while (std::fabs(z) > 2.0) z = stream.Normal();  // redraw beyond 2 stddev
        out[j] = static_cast<float>(spec.mean + spec.stddev * z);
      }
      return;
  }
}

}  // namespace wuliang::ps::details
