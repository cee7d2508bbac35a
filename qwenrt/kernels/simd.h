// The fp32 / int vector operations the kernels are written in, one backend per instruction-set level, chosen by the
// compiler flags of the build (qwenrt/kernels/__init__.py builds each level separately):
//   AVX-512F+BW  16 lanes;   AVX2+FMA  8 lanes;   portable  8 lanes of plain C++ loops (the compiler vectorises them
//   for SSE2, NEON, ...).
// F holds kLanes floats; I the same bits as kLanes int32, 2·kLanes int16 or 4·kLanes bytes.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__FMA__)
#define QWENRT_SIMD_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
#define QWENRT_SIMD_AVX2 1
#include <immintrin.h>
#else
#define QWENRT_SIMD_PORTABLE 1
#endif

namespace qwenrt::simd {

#if defined(QWENRT_SIMD_AVX512)

constexpr int kLanes = 16;
constexpr int kRegisters = 32;
constexpr const char* kName = "avx512";
constexpr bool kFma = true;  // exp() below is within an ulp: vector SiLU rounds to bf16 as torch does
using F = __m512;
using I = __m512i;

inline F zero() { return _mm512_setzero_ps(); }
inline F set1(float v) { return _mm512_set1_ps(v); }
inline F load(const float* p) { return _mm512_loadu_ps(p); }
inline void store(float* p, F v) { _mm512_storeu_ps(p, v); }
inline F add(F a, F b) { return _mm512_add_ps(a, b); }
inline F sub(F a, F b) { return _mm512_sub_ps(a, b); }
inline F mul(F a, F b) { return _mm512_mul_ps(a, b); }
inline F div(F a, F b) { return _mm512_div_ps(a, b); }
inline F min(F a, F b) { return _mm512_min_ps(a, b); }
inline F max(F a, F b) { return _mm512_max_ps(a, b); }
inline F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }   // a·b + c
inline F fnmadd(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a·b
inline float reduce_add(F v) { return _mm512_reduce_add_ps(v); }
inline F round_nearest(F v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT); }
inline F load_i8(const int8_t* p) {  // kLanes int8 -> fp32
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
inline F load_bf16(const uint16_t* p) {  // kLanes bf16 -> fp32 (a 16-bit shift)
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
inline F permute(F table, I index) { return _mm512_permutexvar_ps(index, table); }  // lane j <- table[index[j]]

inline I load_i(const void* p) { return _mm512_loadu_si512(p); }
inline I set1_i32(int32_t v) { return _mm512_set1_epi32(v); }
inline I set1_i16(int16_t v) { return _mm512_set1_epi16(v); }
inline I zero_i() { return _mm512_setzero_si512(); }
inline I and_i(I a, I b) { return _mm512_and_si512(a, b); }
inline I add_i32(I a, I b) { return _mm512_add_epi32(a, b); }
template <int n> inline I srli_i16(I a) { return _mm512_srli_epi16(a, n); }
template <int n> inline I slli_i32(I a) { return _mm512_slli_epi32(a, n); }
template <int n> inline I srli_i32(I a) { return _mm512_srli_epi32(a, n); }
inline I madd_i16(I a, I b) { return _mm512_madd_epi16(a, b); }  // int32 lane j = a[2j]·b[2j] + a[2j+1]·b[2j+1]
// int16 lane j = u[2j]·s[2j] + u[2j+1]·s[2j+1], u's bytes unsigned, s's signed (saturating: callers stay below)
inline I maddubs_i8(I u, I s) { return _mm512_maddubs_epi16(u, s); }
inline I add_i16(I a, I b) { return _mm512_add_epi16(a, b); }
inline I widen_i8(const int8_t* p) { return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)p)); }
inline F to_float(I a) { return _mm512_cvtepi32_ps(a); }
inline I to_int(F a) { return _mm512_cvtps_epi32(a); }  // round to nearest
inline F as_float(I a) { return _mm512_castsi512_ps(a); }
inline I as_int(F a) { return _mm512_castps_si512(a); }
inline F select_nan(F v, F if_nan) {  // if_nan where v is NaN, else v
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), v, if_nan);
}
inline F select_above(F x, F limit, F v, F if_above) {  // if_above where x > limit, else v
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, limit, _CMP_GT_OQ), v, if_above);
}

#elif defined(QWENRT_SIMD_AVX2)

constexpr int kLanes = 8;
constexpr int kRegisters = 16;
constexpr const char* kName = "avx2";
constexpr bool kFma = true;
using F = __m256;
using I = __m256i;

inline F zero() { return _mm256_setzero_ps(); }
inline F set1(float v) { return _mm256_set1_ps(v); }
inline F load(const float* p) { return _mm256_loadu_ps(p); }
inline void store(float* p, F v) { _mm256_storeu_ps(p, v); }
inline F add(F a, F b) { return _mm256_add_ps(a, b); }
inline F sub(F a, F b) { return _mm256_sub_ps(a, b); }
inline F mul(F a, F b) { return _mm256_mul_ps(a, b); }
inline F div(F a, F b) { return _mm256_div_ps(a, b); }
inline F min(F a, F b) { return _mm256_min_ps(a, b); }
inline F max(F a, F b) { return _mm256_max_ps(a, b); }
inline F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
inline F fnmadd(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }
inline float reduce_add(F v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline F round_nearest(F v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline F load_bf16(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
inline F load_i8(const int8_t* p) {  // kLanes int8 -> fp32
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
inline F permute(F table, I index) { return _mm256_permutevar8x32_ps(table, index); }

inline I load_i(const void* p) { return _mm256_loadu_si256((const __m256i*)p); }
inline I set1_i32(int32_t v) { return _mm256_set1_epi32(v); }
inline I set1_i16(int16_t v) { return _mm256_set1_epi16(v); }
inline I zero_i() { return _mm256_setzero_si256(); }
inline I and_i(I a, I b) { return _mm256_and_si256(a, b); }
inline I add_i32(I a, I b) { return _mm256_add_epi32(a, b); }
template <int n> inline I srli_i16(I a) { return _mm256_srli_epi16(a, n); }
template <int n> inline I slli_i32(I a) { return _mm256_slli_epi32(a, n); }
template <int n> inline I srli_i32(I a) { return _mm256_srli_epi32(a, n); }
inline I madd_i16(I a, I b) { return _mm256_madd_epi16(a, b); }
inline I maddubs_i8(I u, I s) { return _mm256_maddubs_epi16(u, s); }
inline I add_i16(I a, I b) { return _mm256_add_epi16(a, b); }
inline I widen_i8(const int8_t* p) { return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)p)); }
inline F to_float(I a) { return _mm256_cvtepi32_ps(a); }
inline I to_int(F a) { return _mm256_cvtps_epi32(a); }
inline F as_float(I a) { return _mm256_castsi256_ps(a); }
inline I as_int(F a) { return _mm256_castps_si256(a); }
inline F select_nan(F v, F if_nan) { return _mm256_blendv_ps(v, if_nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q)); }
inline F select_above(F x, F limit, F v, F if_above) {  // if_above where x > limit, else v
  return _mm256_blendv_ps(v, if_above, _mm256_cmp_ps(x, limit, _CMP_GT_OQ));
}

#else  // portable: fixed-size arrays in loops the compiler vectorises

constexpr int kLanes = 8;
constexpr int kRegisters = 16;
constexpr const char* kName = "portable";
constexpr bool kFma = false;  // exp() off by up to 1.15 ulp, which can flip a bf16 rounding: std::exp instead
struct F { float v[kLanes]; };
union I {
  int32_t i32[kLanes];
  int16_t i16[2 * kLanes];
  uint16_t u16[2 * kLanes];
  uint8_t u8[4 * kLanes];
  int8_t s8[4 * kLanes];
  float f[kLanes];
};

#define QWENRT_LANES(expr) do { for (int j = 0; j < kLanes; ++j) { expr; } } while (0)
inline F zero() { F r; QWENRT_LANES(r.v[j] = 0.f); return r; }
inline F set1(float s) { F r; QWENRT_LANES(r.v[j] = s); return r; }
inline F load(const float* p) { F r; std::memcpy(r.v, p, sizeof r.v); return r; }
inline void store(float* p, F a) { std::memcpy(p, a.v, sizeof a.v); }
inline F add(F a, F b) { QWENRT_LANES(a.v[j] += b.v[j]); return a; }
inline F sub(F a, F b) { QWENRT_LANES(a.v[j] -= b.v[j]); return a; }
inline F mul(F a, F b) { QWENRT_LANES(a.v[j] *= b.v[j]); return a; }
inline F div(F a, F b) { QWENRT_LANES(a.v[j] /= b.v[j]); return a; }
inline F min(F a, F b) { QWENRT_LANES(a.v[j] = b.v[j] < a.v[j] ? b.v[j] : a.v[j]); return a; }
inline F max(F a, F b) { QWENRT_LANES(a.v[j] = b.v[j] > a.v[j] ? b.v[j] : a.v[j]); return a; }
inline F fmadd(F a, F b, F c) { QWENRT_LANES(c.v[j] += a.v[j] * b.v[j]); return c; }
inline F fnmadd(F a, F b, F c) { QWENRT_LANES(c.v[j] -= a.v[j] * b.v[j]); return c; }
inline float reduce_add(F a) {  // pairwise, as the vector backends fold
  for (int w = kLanes / 2; w > 0; w /= 2)
    for (int j = 0; j < w; ++j) a.v[j] += a.v[j + w];
  return a.v[0];
}
inline F round_nearest(F a) { QWENRT_LANES(a.v[j] = std::nearbyint(a.v[j])); return a; }
inline F load_bf16(const uint16_t* p) {
  F r;
  QWENRT_LANES(uint32_t bits = static_cast<uint32_t>(p[j]) << 16; std::memcpy(&r.v[j], &bits, 4));
  return r;
}
inline F load_i8(const int8_t* p) { F r; QWENRT_LANES(r.v[j] = static_cast<float>(p[j])); return r; }
inline F permute(F table, I index) { F r; QWENRT_LANES(r.v[j] = table.v[index.i32[j] & (kLanes - 1)]); return r; }

inline I load_i(const void* p) { I r; std::memcpy(&r, p, sizeof r); return r; }
inline I set1_i32(int32_t s) { I r; QWENRT_LANES(r.i32[j] = s); return r; }
inline I set1_i16(int16_t s) { I r; for (int j = 0; j < 2 * kLanes; ++j) r.i16[j] = s; return r; }
inline I zero_i() { return set1_i32(0); }
inline I and_i(I a, I b) { QWENRT_LANES(a.i32[j] &= b.i32[j]); return a; }
inline I add_i32(I a, I b) {
  QWENRT_LANES(a.i32[j] = static_cast<int32_t>(static_cast<uint32_t>(a.i32[j]) + static_cast<uint32_t>(b.i32[j])));
  return a;
}
template <int n> inline I srli_i16(I a) {
  for (int j = 0; j < 2 * kLanes; ++j) a.u16[j] = static_cast<uint16_t>(a.u16[j] >> n);
  return a;
}
template <int n> inline I slli_i32(I a) {
  QWENRT_LANES(a.i32[j] = static_cast<int32_t>(static_cast<uint32_t>(a.i32[j]) << n));
  return a;
}
template <int n> inline I srli_i32(I a) {
  QWENRT_LANES(a.i32[j] = static_cast<int32_t>(static_cast<uint32_t>(a.i32[j]) >> n));
  return a;
}
inline I madd_i16(I a, I b) {
  I r;
  QWENRT_LANES(r.i32[j] = int32_t{a.i16[2 * j]} * b.i16[2 * j] + int32_t{a.i16[2 * j + 1]} * b.i16[2 * j + 1]);
  return r;
}
inline I maddubs_i8(I u, I s) {
  I r;
  for (int j = 0; j < 2 * kLanes; ++j) {
    const int32_t v = int32_t{u.u8[2 * j]} * s.s8[2 * j] + int32_t{u.u8[2 * j + 1]} * s.s8[2 * j + 1];
    r.i16[j] = static_cast<int16_t>(std::max(-32768, std::min(32767, v)));
  }
  return r;
}
inline I add_i16(I a, I b) {
  for (int j = 0; j < 2 * kLanes; ++j) a.u16[j] = static_cast<uint16_t>(a.u16[j] + b.u16[j]);
  return a;
}
inline I widen_i8(const int8_t* p) { I r; for (int j = 0; j < 2 * kLanes; ++j) r.i16[j] = p[j]; return r; }
inline F to_float(I a) { F r; QWENRT_LANES(r.v[j] = static_cast<float>(a.i32[j])); return r; }
inline I to_int(F a) { I r; QWENRT_LANES(r.i32[j] = static_cast<int32_t>(std::nearbyint(a.v[j]))); return r; }
inline F as_float(I a) { F r; std::memcpy(r.v, a.f, sizeof r.v); return r; }
inline I as_int(F a) { I r; std::memcpy(r.f, a.v, sizeof r.f); return r; }
inline F select_nan(F a, F if_nan) { QWENRT_LANES(if (std::isnan(a.v[j])) a.v[j] = if_nan.v[j]); return a; }
inline F select_above(F x, F limit, F v, F if_above) { QWENRT_LANES(if (x.v[j] > limit.v[j]) v.v[j] = if_above.v[j]); return v; }
#undef QWENRT_LANES

#endif

// ---- built on the operations above -------------------------------------------------------------------------------

// The low and high bf16 of each 32-bit lane as fp32: an even/odd split of 2·kLanes bf16 weights with no shuffles.
inline F bf16_low(I pairs) { return as_float(slli_i32<16>(pairs)); }
inline F bf16_high(I pairs) { return as_float(and_i(pairs, set1_i32(static_cast<int32_t>(0xFFFF0000u)))); }

// e^x: x = n·ln2 + r, |r| <= ln2/2 (ln 2 in two parts, the first with trailing zero bits so that n·part is exact),
// e^r by its degree-7 Taylor polynomial (truncation < 6e-9), times 2^n built in the exponent bits: within one fp32
// ulp of e^x with FMA (AVX2, [-87, 88.7] in steps of 7e-4: at most 0.88 ulp). 2^n is applied as two normal powers
// of 2. Beyond fp32's largest e^x (x > 88.72) it is +inf, as std::exp's (silu(x) of a very negative x is then -0, as
// torch's); below -87, e^-87 (~1.6e-38, where std::exp gives a denormal or 0).
inline F exp(F x) {
  const F overflow = set1(88.7228394f), given = x;
  x = min(max(x, set1(-87.0f)), overflow);
  const F n = round_nearest(mul(x, set1(1.44269504f)));
  const F r = fnmadd(n, set1(1.42860677e-6f), fnmadd(n, set1(0.693145752f), x));  // ln 2 in two parts
  F p = set1(1.0f / 5040);
  p = fmadd(p, r, set1(1.0f / 720));
  p = fmadd(p, r, set1(1.0f / 120));
  p = fmadd(p, r, set1(1.0f / 24));
  p = fmadd(p, r, set1(1.0f / 6));
  p = fmadd(p, r, set1(0.5f));
  p = fmadd(p, r, set1(1.0f));
  p = fmadd(p, r, set1(1.0f));
  auto pow2 = [](F k) { return as_float(slli_i32<23>(add_i32(to_int(k), set1_i32(127)))); };  // k in [-126, 127]
  const F half = round_nearest(mul(n, set1(0.5f)));  // n in [-126, 128]: both parts in [-63, 64]
  const F e = mul(mul(p, pow2(half)), pow2(sub(n, half)));
  return select_above(given, overflow, e, set1(std::numeric_limits<float>::infinity()));
}

// x / (1 + e^-x)
inline F silu(F x) { return div(x, add(set1(1.0f), exp(sub(zero(), x)))); }

// Round each lane to bfloat16 (to nearest even, as torch casts; NaN stays NaN) and back to fp32.
inline F round_bf16(F x) {
#if defined(__AVX512BF16__)
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x)), 16));
#else
  const I bits = as_int(x);
  const I lsb = and_i(srli_i32<16>(bits), set1_i32(1));  // bits + 0x7FFF + lsb, then the low half cleared
  const I rounded = and_i(add_i32(add_i32(bits, set1_i32(0x7FFF)), lsb), set1_i32(static_cast<int32_t>(0xFFFF0000u)));
  return select_nan(as_float(rounded), set1(std::numeric_limits<float>::quiet_NaN()));
#endif
}

// Each lane rounded to bfloat16 (as round_bf16) and stored as kLanes bf16: the high half of each rounded fp32.
inline void store_bf16(uint16_t* p, F x) {
  uint32_t bits[kLanes];
  const F rounded = round_bf16(x);
  std::memcpy(bits, &rounded, sizeof bits);
  for (int l = 0; l < kLanes; ++l) p[l] = static_cast<uint16_t>(bits[l] >> 16);
}

}  // namespace qwenrt::simd
