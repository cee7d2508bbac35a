// Vectorised fp32 math shared by the kernels (AVX-512F).
#pragma once
#include <immintrin.h>

namespace qwenrt {

// e^x: x = n·ln2 + r, |r| <= ln2/2, e^r by its degree-6 Taylor polynomial (relative error < 2e-7, a few fp32 ulp),
// 2^n applied with vscalefps. x is clamped to [-87, 88] (e^x under/overflows fp32 just beyond).
inline __m512 exp_ps(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.90465430e-9f),  // ln 2 in two parts: r = x - n·ln 2
                                    _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x));
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// x / (1 + e^-x)
inline __m512 silu_ps(__m512 x) {
  return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), x))));
}

// Round each lane to bfloat16 (to nearest even, as torch casts) and back to fp32.
inline __m512 round_bf16_ps(__m512 x) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x)), 16));
}

}  // namespace qwenrt
