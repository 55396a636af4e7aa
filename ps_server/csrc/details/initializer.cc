#include "details/initializer.h"

#include <algorithm>
#include <cmath>
#include <cstring>

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

  // dim normals by ziggurat: the fast path (~99% of draws) is a table lookup, a multiply
  // and a compare on 32 random bits; random bits come in blocks of 8 x 64
  // from consecutive counters (independent mixes, so they vectorize).
  void Normals(int dim, double mean, double stddev, float* out) {
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

// Natural log for y in [2^-126, 1], branch-free so loops over it vectorize:
// y = 2^e * m with m in [sqrt(1/2), sqrt(2)), log m = 2 atanh(t) with
// t = (m - 1) / (m + 1), |t| < 0.172, by its series to t^9 (error < 4e-10).
inline float LogUnit(float y) {
  uint32_t bits;
  std::memcpy(&bits, &y, sizeof bits);
  // Shift by sqrt(1/2)'s mantissa so m lands in [sqrt(1/2), sqrt(2)).
  const uint32_t shifted = bits + (0x3f800000u - 0x3f3504f3u);
  const int exponent = static_cast<int>(shifted >> 23) - 127;
  const uint32_t mantissa_bits = (shifted & 0x007fffffu) + 0x3f3504f3u;
  float m;
  std::memcpy(&m, &mantissa_bits, sizeof m);
  const float t = (m - 1.0f) / (m + 1.0f);
  const float t2 = t * t;
  float series = std::fma(2.0f / 9, t2, 2.0f / 7);
  series = std::fma(series, t2, 2.0f / 5);
  series = std::fma(series, t2, 2.0f / 3);
  series = std::fma(series, t2, 2.0f);
  return std::fma(static_cast<float>(exponent), 0.693147181f, t * series);
}

// Truncated normal on [-2, 2] by inverting its CDF: a uniform u maps to
// sqrt(2) erfinv(u erf(sqrt 2)), with |u erf(sqrt 2)| <= 0.9545, where
// Giles' single-precision erfinv ("Approximating the erfinv function", 2010)
// needs only its central polynomial (w < 2.43 < 5). No redraws and no
// branches: 16 values at a time from 8 counter-based mixes, ~4 ns a value.
void TruncatedNormals(uint64_t seed, uint64_t key, int dim, float mean, float stddev, float* out) {
  constexpr int kBlock = 16;
  constexpr float kErfSqrt2 = 0.954499736f;  // erf(2 / sqrt(2)): the mass within 2 stddev
  const uint64_t base = Mix64(Mix64(seed + kGolden) ^ key);
  for (int j0 = 0; j0 < dim; j0 += kBlock) {
    uint64_t mixes[kBlock / 2];
    for (int b = 0; b < kBlock / 2; ++b) mixes[b] = Mix64(base + (j0 / 2 + b + 1) * kGolden);
    uint32_t halves[kBlock];
    std::memcpy(halves, mixes, sizeof halves);
    float values[kBlock];
    for (int h = 0; h < kBlock; ++h) {
      // Uniform in (-1, 1) from the top 24 bits, never 0 or +-1.
      const float u =
          static_cast<float>(static_cast<int32_t>(halves[h] >> 8) * 2 - 0xffffff) * 0x1.0p-24f;
      const float p = u * kErfSqrt2;
      const float w = -LogUnit((1.0f - p) * (1.0f + p)) - 2.5f;
      float q = 2.81022636e-08f;
      q = std::fma(q, w, 3.43273939e-07f);
      q = std::fma(q, w, -3.5233877e-06f);
      q = std::fma(q, w, -4.39150654e-06f);
      q = std::fma(q, w, 0.00021858087f);
      q = std::fma(q, w, -0.00125372503f);
      q = std::fma(q, w, -0.00417768164f);
      q = std::fma(q, w, 0.246640727f);
      q = std::fma(q, w, 1.50140941f);
      const float x = std::clamp(1.41421356f * q * p, -2.0f, 2.0f);
      values[h] = std::fma(stddev, x, mean);
    }
    if (dim - j0 >= kBlock) {
      std::memcpy(out + j0, values, sizeof values);  // one vector store
    } else {
      std::memcpy(out + j0, values, sizeof(float) * (dim - j0));
    }
  }
}

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
      stream.Normals(dim, spec.mean, spec.stddev, out);
      return;
    case InitKind::kTruncatedNormal:
      TruncatedNormals(seed, key, dim, spec.mean, spec.stddev, out);
      return;
  }
}

void InitializeRows(const InitSpec& spec, uint64_t seed, const uint64_t* keys, float* const* out,
                    size_t n, int dim) {
  if (spec.kind == InitKind::kTruncatedNormal) {
    for (size_t i = 0; i < n; ++i) {
      TruncatedNormals(seed, keys[i], dim, spec.mean, spec.stddev, out[i]);
    }
    return;
  }
  for (size_t i = 0; i < n; ++i) InitializeWeights(spec, seed, keys[i], dim, out[i]);
}

}  // namespace wuliang::ps::details
