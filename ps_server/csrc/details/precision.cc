#include "details/precision.h"

#include <cmath>

namespace wuliang::ps::details {

void EncodeHalf(const float* src, int n, uint16_t* dst) {
#if WL_HAVE_F16C
  EncodeHalfF16c(src, n, dst);
#elif WL_HAVE_FLOAT16 && !defined(__x86_64__) && !defined(__i386__)
  for (int j = 0; j < n; ++j) dst[j] = HalfFromFloatNative(src[j]);
#else
  for (int j = 0; j < n; ++j) dst[j] = HalfFromFloatPortable(src[j]);
#endif
}

void EncodeHalfStochastic(const float* src, int n, uint16_t* dst, uint64_t random) {
  EncodeHalf(src, n, dst);
  for (int j = 0; j < n; ++j) {
    const float x = src[j];
    const uint16_t h = dst[j];
    const float near = FloatFromHalfPortable(h);
    if (near == x || !std::isfinite(near) || !std::isfinite(x)) continue;
    const float above = std::fabs(near) > std::fabs(x) ? 1.0f : -1.0f;  // near's side, in size
    if (above < 0 && (h & 0x7FFFu) == kHalfMaxBits) continue;           // saturated: no half beyond
    const auto other = static_cast<uint16_t>(above > 0 ? h - 1 : h + 1);  // the other side
    const float far = FloatFromHalfPortable(other);
    random += 0x9E3779B97F4A7C15ull;  // splitmix64
    uint64_t z = random;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    const double u = static_cast<double>(z >> 40) * 0x1.0p-24;  // [0, 1)
    const double gap = std::fabs(static_cast<double>(far) - near);
    if (u * gap < std::fabs(static_cast<double>(x) - near)) dst[j] = other;
  }
}

void EncodeInt8(const float* src, int n, char* hot) {
  float m = 0.0f;
  for (int j = 0; j < n; ++j) {
    const float a = std::fabs(src[j]);
    if (a > m && std::isfinite(a)) m = a;
  }
  const float scale = m / 127.0f;
  std::memcpy(hot, &scale, sizeof(scale));
  auto* q = reinterpret_cast<int8_t*>(hot + sizeof(float));
  for (int j = 0; j < n; ++j) {
    const float w = src[j];
    if (std::isnan(w)) {
      q[j] = kInt8Nan;
    } else if (scale == 0.0f) {  // a zero row (or zeros and infinities)
      q[j] = 0;
    } else {
      // w / scale as the definition says (not w * (1 / scale): another
      // rounding); +-inf clamp to +-127.
      const float r = std::fmin(std::fmax(w / scale, -127.0f), 127.0f);
      q[j] = static_cast<int8_t>(std::nearbyint(r));  // ties to even
    }
  }
}

void EncodeRow(Precision precision, const float* src, int dim, char* hot) {
  switch (precision) {
    case Precision::kFp32:
      std::memcpy(hot, src, sizeof(float) * dim);
      return;
    case Precision::kFp16:
      EncodeHalf(src, dim, reinterpret_cast<uint16_t*>(hot));
      return;
    case Precision::kInt8:
      EncodeInt8(src, dim, hot);
      return;
  }
}

void DecodeRow(Precision precision, const char* hot, int dim, float* dst) {
  switch (precision) {
    case Precision::kFp32:
      std::memcpy(dst, hot, sizeof(float) * dim);
      return;
    case Precision::kFp16:
      DecodeHalf(reinterpret_cast<const uint16_t*>(hot), dim, dst);
      return;
    case Precision::kInt8:
      DecodeInt8(hot, dim, dst);
      return;
  }
}

}  // namespace wuliang::ps::details
