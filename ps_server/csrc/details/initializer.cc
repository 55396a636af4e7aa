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

  // dim standard normals, |z| <= limit (0: no limit) redrawn until within.
  // Ziggurat: the fast path (~99% of draws) is a table lookup, a multiply
  // and a compare on 32 random bits; random bits come in blocks of 8 x 64
  // from consecutive counters (independent mixes, so they vectorize).
  void Normals(int dim, float limit, double mean, double stddev, float* out) {
    const Ziggurat& z = Tables();
    constexpr int kBlock = 8;
    uint64_t block[kBlock];
    int j = 0;
    while (j < dim) {
      for (int b = 0; b < kBlock; ++b) block[b] = Mix64(base_ + (counter_ + 1 + b) * kGolden);
      counter_ += kBlock;
      const auto* halves = reinterpret_cast<const int32_t*>(block);
      for (int h = 0; h < 2 * kBlock && j < dim; ++h) {
        const int32_t hz = halves[h];
        const uint32_t iz = static_cast<uint32_t>(hz) & 127;
        const uint32_t magnitude = hz < 0 ? 0u - static_cast<uint32_t>(hz) : hz;
        float x = static_cast<float>(hz) * z.w[iz];
        if (magnitude >= z.k[iz]) [[unlikely]] {
          x = static_cast<float>(Slow(z, hz, iz));
        }
        if (limit > 0 && std::fabs(x) > limit) [[unlikely]] {
          continue;  // redraw beyond the limit
        }
        out[j++] = static_cast<float>(mean + stddev * x);
      }
    }
  }

 private:
  // The ziggurat's slow path: the tail, or a wedge (more bits, maybe redraws).
  [[gnu::noinline]] double Slow(const Ziggurat& z, int32_t hz, uint32_t iz) {
    for (;;) {
      const double x = hz * static_cast<double>(z.w[iz]);
      const uint32_t magnitude = hz < 0 ? 0u - static_cast<uint32_t>(hz) : hz;
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
      hz = static_cast<int32_t>(Bits32());
      iz = static_cast<uint32_t>(hz) & 127;
    }
  }

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
      stream.Normals(dim, 0.0f, spec.mean, spec.stddev, out);
      return;
    case InitKind::kTruncatedNormal:
      stream.Normals(dim, 2.0f, spec.mean, spec.stddev, out);  // redraw beyond 2 stddev
      return;
  }
}

}  // namespace wuliang::ps::details
