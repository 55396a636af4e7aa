// Encodings of a row's weights in its hot part (TableSpec::precision).
//
//   kFp32: float[dim]
//   kFp16: uint16[dim]                 IEEE binary16 bits
//   kInt8: float scale | int8[dim]     w ~ q * scale, one contiguous hot row
//
// fp16: round to nearest, ties to even. Magnitudes beyond the largest half
// (65504) saturate to +-65504, never inf (infinities too); NaN stays NaN
// (quiet, payload not kept). Relative error <= 2^-11 for normal halves.
//
// int8, symmetric per row: m = the largest finite |w|, scale = m / 127,
// q = w / scale rounded to nearest even and clamped to [-127, 127], so
// |w - q * scale| <= scale / 2 (up to float rounding). A row with m = 0 has
// scale 0 and decodes to zeros. +-inf saturate to +-127 (+-m); NaN is stored
// as q = -128, which the symmetric range never uses, and decodes to NaN.
//
// Three implementations of the half conversions, all compiled where the
// compiler allows (the C++ tests check each against the portable one): F16C
// intrinsics (x86 with F16C: 8 values per instruction), the compiler's
// _Float16, and portable bit arithmetic. Encode/DecodeHalf use the first
// available, except that _Float16 is skipped on x86 without F16C (there GCC
// converts through a libgcc call per value, slower than the bit arithmetic).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "wuliang/ps/table_spec.h"

#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace wuliang::ps::details {

// Bytes of one row's encoded weights.
constexpr size_t EncodedBytes(Precision precision, int dim) {
  switch (precision) {
    case Precision::kFp32:
      return sizeof(float) * dim;
    case Precision::kFp16:
      return sizeof(uint16_t) * dim;
    case Precision::kInt8:
      return sizeof(float) + dim;
  }
  return 0;
}

constexpr uint16_t kHalfMaxBits = 0x7BFF;  // 65504
constexpr float kHalfMax = 65504.0f;
constexpr int8_t kInt8Nan = -128;  // the int8 code of NaN

inline uint32_t BitsOf(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return bits;
}

inline float FloatOf(uint32_t bits) {
  float x;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
}

// --- portable half conversions (bit arithmetic; Maratyszcza's FP16) -------

// Exact; NaN stays NaN.
inline float FloatFromHalfPortable(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;  // exponent and mantissa at the top
  // Normal (and inf/NaN): move the fields into place, rebias by 2^-112.
  const float normalized = FloatOf((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  // Subnormal: the mantissa as the low bits of 0.5's, minus 0.5.
  const float denormalized = FloatOf((two_w >> 17) | (126u << 23)) - 0.5f;
  const uint32_t bits = two_w < (1u << 27) ? BitsOf(denormalized) : BitsOf(normalized);
  return FloatOf(sign | bits);
}

// Round to nearest even, saturating at +-65504; NaN -> 0x7E00 (with sign).
// Relies on float arithmetic rounding to nearest (the default mode).
inline uint16_t HalfFromFloatPortable(float f) {
  const uint32_t w = BitsOf(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  // |f| * 4, or inf where |f| * 2^112 overflows (|f| >= 2^16).
  float base = (FloatOf(w & 0x7FFFFFFFu) * 0x1.0p+112f) * 0x1.0p-110f;
  // Adding 2^(e + 15), e = max(exponent of f, -14), makes the sum's ulp 4
  // times the half's ulp at e: the float addition rounds |f| * 4 to the
  // half grid (to nearest even), and the sum's low bits are the half's
  // exponent and mantissa (a mantissa carry moves into the exponent).
  uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = FloatOf((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = BitsOf(base);
  const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
  const uint32_t mantissa_bits = bits & 0x00000FFFu;
  uint32_t nonsign = exp_bits + mantissa_bits;
  if (nonsign >= 0x7C00u) nonsign = kHalfMaxBits;  // rounded to inf: saturate
  return static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

// --- the compiler's _Float16 ----------------------------------------------

#if defined(__FLT16_MAX__)
#define WL_HAVE_FLOAT16 1
inline float FloatFromHalfNative(uint16_t h) {
  _Float16 x;
  std::memcpy(&x, &h, sizeof(x));
  return static_cast<float>(x);
}

inline uint16_t HalfFromFloatNative(float f) {
  // Clamped first (NaN passes: comparisons with it are false).
  if (f > kHalfMax) f = kHalfMax;
  if (f < -kHalfMax) f = -kHalfMax;
  const auto x = static_cast<_Float16>(f);
  uint16_t h;
  std::memcpy(&h, &x, sizeof(h));
  return h;
}
#else
#define WL_HAVE_FLOAT16 0
#endif

// --- F16C -----------------------------------------------------------------

#if defined(__F16C__)
#define WL_HAVE_F16C 1
inline void DecodeHalfF16c(const uint16_t* src, int n, float* dst) {
  int j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + j));
    _mm256_storeu_ps(dst + j, _mm256_cvtph_ps(h));
  }
  if (j + 4 <= n) {
    const __m128i h = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + j));
    _mm_storeu_ps(dst + j, _mm_cvtph_ps(h));
    j += 4;
  }
  for (; j < n; ++j) dst[j] = _cvtsh_ss(src[j]);
}

inline void EncodeHalfF16c(const float* src, int n, uint16_t* dst) {
  // min/max return their second operand when either is NaN: NaN passes.
  const __m256 hi = _mm256_set1_ps(kHalfMax);
  const __m256 lo = _mm256_set1_ps(-kHalfMax);
  int j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 x = _mm256_min_ps(hi, _mm256_max_ps(lo, _mm256_loadu_ps(src + j)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + j),
                     _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
  }
  for (; j < n; ++j) {
    float f = src[j];
    if (f > kHalfMax) f = kHalfMax;
    if (f < -kHalfMax) f = -kHalfMax;
    dst[j] = _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
  }
}
#else
#define WL_HAVE_F16C 0
#endif

// --- rows -----------------------------------------------------------------

// src (n,) -> dst (n,)
inline void DecodeHalf(const uint16_t* src, int n, float* dst) {
#if WL_HAVE_F16C
  DecodeHalfF16c(src, n, dst);
#elif WL_HAVE_FLOAT16 && !defined(__x86_64__) && !defined(__i386__)
  for (int j = 0; j < n; ++j) dst[j] = FloatFromHalfNative(src[j]);
#else
  for (int j = 0; j < n; ++j) dst[j] = FloatFromHalfPortable(src[j]);
#endif
}

// src (n,) -> dst (n,)
void EncodeHalf(const float* src, int n, uint16_t* dst);

// src (n,) -> dst (n,), rounded stochastically: each value to one of the
// two halves around it, the farther one with probability (its distance's
// complement) / (the gap), so the expected half is the value itself and an
// update smaller than half a gap is not lost on average (round to nearest
// would drop every one). `random` seeds the draws (splitmix64, 24 bits per
// value). Values that are halves, NaN, and values beyond +-65504
// (saturated) are as EncodeHalf leaves them.
void EncodeHalfStochastic(const float* src, int n, uint16_t* dst, uint64_t random);

// One int8 value; NaN for the NaN code.
inline float Int8Value(int8_t q, float scale) {
  const float v = static_cast<float>(q) * scale;
  return FloatOf(BitsOf(v) | (q == kInt8Nan ? 0x7FC00000u : 0u));
}

// hot: float scale | int8[n]  ->  dst (n,)
inline void DecodeInt8(const char* hot, int n, float* dst) {
  float scale;
  std::memcpy(&scale, hot, sizeof(scale));
  const auto* q = reinterpret_cast<const int8_t*>(hot + sizeof(float));
  int j = 0;
#if defined(__AVX2__)
  const __m256 s = _mm256_set1_ps(scale);
  const __m256i nan_code = _mm256_set1_epi32(kInt8Nan);
  const __m256i nan_bits = _mm256_set1_epi32(0x7FC00000);
  for (; j + 8 <= n; j += 8) {
    const __m256i qi =
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + j)));
    const __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(qi), s);
    const __m256i nan = _mm256_and_si256(_mm256_cmpeq_epi32(qi, nan_code), nan_bits);
    _mm256_storeu_ps(dst + j, _mm256_or_ps(v, _mm256_castsi256_ps(nan)));
  }
#endif
  for (; j < n; ++j) dst[j] = Int8Value(q[j], scale);
}

// src (n,) -> hot: float scale | int8[n]
void EncodeInt8(const float* src, int n, char* hot);

// A row's weights in `precision`: src (dim,) -> hot (EncodedBytes), and back.
void EncodeRow(Precision precision, const float* src, int dim, char* hot);
void DecodeRow(Precision precision, const char* hot, int dim, float* dst);

}  // namespace wuliang::ps::details
