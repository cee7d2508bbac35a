// Decode-time matrix-vector kernels for x86-64 CPUs with AVX-512 BF16 and VNNI (the `avx512bf16` build).
// Rows go R at a time (a compile-time count, over_rows) and the inner loops read whole vectors only, a row's last
// columns apart (a scalar tail): a run-time row count, or a masked load for the tail in the loop, made the compiler
// keep the accumulators in memory, a store per multiply-add (4 rows in cache: 2x slower; one speculative cycle of
// qwenrt-tiny spent ~40% of its time there).
//   bf16  products exact in fp32 (vdpbf16ps), fp32 sums.
//   int8  x in 16-bit fixed point per block of 256 columns (gemv_common.h); int16 x int8 products summed exactly in
//         int32 (vpdpwssd) and each block's sum scaled in fp32.
//   int8 in fp32-scaled groups (GGUF blocks): the same VNNI sums per 32 columns, scaled per group in fp32.
//   int4  A nibble n becomes the bf16 number 128 + n (its byte next to 128's exponent byte), so products with bf16 x
//         are exact in fp32; Σ (128 + n)·x·s then loses its offset through a per-group term.
//         (~32 GB/s: bound by the nibble unpacking and vdpbf16ps issue rate, not memory; a VNNI variant with x in
//         16-bit fixed point measured no faster.)
// With all of AVX-512 these stream the weights at 42-44 of the 41-48 GB/s a plain streaming read reaches.
#pragma once
#include <immintrin.h>

#include "gemv_common.h"

namespace qwenrt::gemv {

// Sums of 4 vectors' lanes -> one __m128 [Σa, Σb, Σc, Σd]
inline __m128 reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
  // fold 512 -> 256 -> 128 per vector, then a 4x4 transpose-add
  auto fold = [](__m512 v) {
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  };
  const __m128 fa = fold(a), fb = fold(b), fc = fold(c), fd = fold(d);
  return _mm_hadd_ps(_mm_hadd_ps(fa, fb), _mm_hadd_ps(fc, fd));
}

template <int M, int R>
inline void store_rows(__m512 (&acc)[M][R], float* out, int64_t N, int64_t n, const float* row_scale) {
  for (int m = 0; m < M; ++m) {
    float sums[4];
    for (int r0 = 0; r0 < R; r0 += 4) {
      _mm_storeu_ps(sums, reduce4(acc[m][r0], acc[m][r0 + 1 < R ? r0 + 1 : r0], acc[m][r0 + 2 < R ? r0 + 2 : r0],
                                  acc[m][r0 + 3 < R ? r0 + 3 : r0]));
      for (int r = r0; r < std::min(R, r0 + 4); ++r)
        out[m * N + n + r] = row_scale ? sums[r - r0] * row_scale[r] : sums[r - r0];
    }
  }
}

// ---- bf16 -------------------------------------------------------------------------------------------------------

struct Bf16Input {  // used as it is
  const uint16_t* x;
};
inline Bf16Input bf16_input(const at::Tensor& x) { return {reinterpret_cast<const uint16_t*>(x.data_ptr())}; }

// Σ over columns [full, K) of row n · x row m
[[gnu::noinline]] inline float bf16_tail(const uint16_t* x, const uint16_t* w, int64_t K, int64_t full) {
  float sum = 0.f;
  for (int64_t k = full; k < K; ++k) sum += bf16_to_float(w[k]) * bf16_to_float(x[k]);
  return sum;
}

template <int M>
void bf16_rows(const Bf16Input& in, const Segment& s, int64_t K, int64_t n0, int64_t n1) {
  const uint16_t* const X = in.x;
  const auto* const W = reinterpret_cast<const uint16_t*>(s.w);
  const int64_t full = K / 32 * 32;
  over_rows<M <= 4 ? 4 : 2>(n0, n1, [&](auto rows, int64_t n) {  // M·R accumulators + M inputs in 32 registers
    constexpr int R = decltype(rows)::value;
    __m512 acc[M][R];
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
    const uint8_t* block = s.w + n * K * 2;
    for (int64_t k = 0, step = 0; k < full; k += 32, ++step) {
      prefetch_ahead(block + step * R * 64, R * 64);
      __m512bh xv[M];
      for (int m = 0; m < M; ++m) xv[m] = (__m512bh)_mm512_loadu_si512(X + m * K + k);
      for (int r = 0; r < R; ++r) {
        const __m512bh wv = (__m512bh)_mm512_loadu_si512(W + (n + r) * K + k);
        for (int m = 0; m < M; ++m) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], wv, xv[m]);
      }
    }
    store_rows<M, R>(acc, s.out, s.N, n, nullptr);
    if (full < K)
      for (int m = 0; m < M; ++m)
        for (int r = 0; r < R; ++r) s.out[m * s.N + n + r] += bf16_tail(X + m * K, W + (n + r) * K, K, full);
  });
}

// ---- int8 -------------------------------------------------------------------------------------------------------

template <int M>
void q8_rows(const FixedPoint& in, const Segment& s, int64_t K, int64_t n0, int64_t n1) {
  const int64_t blocks = in.Kp / kQ8Block, full = K / 32 * 32;
  const auto* Q = reinterpret_cast<const int8_t*>(s.w);
  // 2·M·R accumulators + M inputs within the 32 vector registers
  over_rows<M <= 2 ? 4 : (M <= 4 ? 2 : 1)>(n0, n1, [&](auto rows, int64_t n) {
    constexpr int R = decltype(rows)::value;
    __m512 acc[M][R];
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
    const uint8_t* block_start = s.w + n * K;
    for (int64_t b = 0; b < blocks; ++b) {
      __m512i iacc[M][R];
      for (int m = 0; m < M; ++m)
        for (int r = 0; r < R; ++r) iacc[m][r] = _mm512_setzero_si512();
      const int64_t end = std::min(full, (b + 1) * kQ8Block);
      for (int64_t k = b * kQ8Block; k < end; k += 32) {
        if (k % 64 == 0) prefetch_ahead(block_start + (k / 64) * R * 64, R * 64);
        __m512i xv[M];
        for (int m = 0; m < M; ++m) xv[m] = _mm512_loadu_si512(in.q.data() + m * in.Kp + k);
        for (int r = 0; r < R; ++r) {
          const __m512i wv = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(Q + (n + r) * K + k)));
          for (int m = 0; m < M; ++m) iacc[m][r] = _mm512_dpwssd_epi32(iacc[m][r], wv, xv[m]);
        }
      }
      for (int m = 0; m < M; ++m) {
        const __m512 xs = _mm512_set1_ps(in.scale[m * blocks + b]);
        for (int r = 0; r < R; ++r) acc[m][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[m][r]), xs, acc[m][r]);
      }
    }
    float row_scale[R];
    for (int r = 0; r < R; ++r) row_scale[r] = bf16_to_float(s.scales[n + r]);
    store_rows<M, R>(acc, s.out, s.N, n, row_scale);
    if (full < K)
      for (int m = 0; m < M; ++m)
        for (int r = 0; r < R; ++r) s.out[m * s.N + n + r] += q8_tail(in, s, K, full, n + r, m) * row_scale[r];
  });
}

// ---- int8 in fp32-scaled groups ---------------------------------------------------------------------------------
// Per 32 columns one VNNI sum (lane j: columns 2j, 2j+1) converted to fp32 and scaled lane by lane by its group's
// scale (G = 32: one; G = 16: lanes 0-7 and 8-15 each theirs), summed per activation block, whose power-of-two scale
// then applies. Zeros enter as Σ_g z·Σx per group. K % 32 == 0.

template <int M>
void q8g_rows(const FixedPoint& in, const float* xsums, const Segment& s, int64_t K, int64_t G, int64_t n0,
              int64_t n1) {
  const int64_t blocks = in.Kp / kQ8Block, groups = K / G;
  const auto* Q = reinterpret_cast<const int8_t*>(s.w);
  const __m512i lane_group = _mm512_maskz_set1_epi32(G == 16 ? 0xFF00 : 0, 1);  // lane j's group in the step
  const __mmask16 step_scales = G == 16 ? 0x3 : 0x1;  // the scales of a 32-column step (none past a row's last)
  over_rows<M <= 2 ? 4 : (M <= 4 ? 2 : 1)>(n0, n1, [&](auto rows, int64_t n) {
    constexpr int R = decltype(rows)::value;
    __m512 acc[M][R];
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
    const uint8_t* block_start = s.w + n * K;
    for (int64_t b = 0; b < blocks; ++b) {
      __m512 bacc[M][R];
      for (int m = 0; m < M; ++m)
        for (int r = 0; r < R; ++r) bacc[m][r] = _mm512_setzero_ps();
      const int64_t end = std::min(K, (b + 1) * kQ8Block);
      for (int64_t k = b * kQ8Block; k < end; k += 32) {
        if (k % 64 == 0) prefetch_ahead(block_start + (k / 64) * R * 64, R * 64);
        __m512i xv[M];
        for (int m = 0; m < M; ++m) xv[m] = _mm512_loadu_si512(in.q.data() + m * in.Kp + k);
        for (int r = 0; r < R; ++r) {
          const __m512i wv = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(Q + (n + r) * K + k)));
          const float* scales = s.fscales + (n + r) * groups + k / G;
          const __m512 ws = _mm512_permutexvar_ps(lane_group, _mm512_maskz_loadu_ps(step_scales, scales));
          for (int m = 0; m < M; ++m)
            bacc[m][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpwssd_epi32(_mm512_setzero_si512(), wv, xv[m])),
                                         ws, bacc[m][r]);
        }
      }
      for (int m = 0; m < M; ++m) {
        const __m512 xs = _mm512_set1_ps(in.scale[m * blocks + b]);
        for (int r = 0; r < R; ++r) acc[m][r] = _mm512_fmadd_ps(bacc[m][r], xs, acc[m][r]);
      }
    }
    store_rows<M, R>(acc, s.out, s.N, n, nullptr);
    if (s.fzeros)
      for (int r = 0; r < R; ++r)
        for (int m = 0; m < M; ++m) {
          float offset = 0.f;
          for (int64_t g = 0; g < groups; ++g) offset += s.fzeros[(n + r) * groups + g] * xsums[m * groups + g];
          s.out[m * s.N + n + r] += offset;
        }
  });
}

// ---- int4 -------------------------------------------------------------------------------------------------------
// Per 64 weight bytes (128 columns): low and high nibbles, each unpacked with the byte 0x43 into bf16 words
// 0x43nn = 128 + n. Unpacking works within 16-byte lanes, so x is stored in the matching column order (per call).

constexpr int64_t kQ4Unit = 128;  // columns per 64-byte unit

struct Q4Input {
  std::vector<uint16_t> x;   // [M, Kp] bf16 in unpacked order, Kp = K rounded up to kQ4Unit (zero padded)
  std::vector<float> sums;   // [M, K / G] Σ x per group
  int64_t Kp;
};

// Column of each unpacked word: unit u, vector v (0: low nibbles of bytes 0-7 of each 16-byte lane, 1: bytes 8-15,
// 2, 3: the same bytes' high nibbles), word 8L + i of lane L.
Q4Input q4_input(const at::Tensor& x, int64_t G) {
  const int64_t M = x.size(0), K = x.size(1), groups = K / G;
  const int64_t Kp = (K + kQ4Unit - 1) / kQ4Unit * kQ4Unit;
  const auto* X = reinterpret_cast<const uint16_t*>(x.data_ptr());
  Q4Input in{std::vector<uint16_t>(M * Kp, 0), std::vector<float>(M * groups + 16, 0.f), Kp};
  for (int64_t m = 0; m < M; ++m) {
    const uint16_t* xm = X + m * K;
    uint16_t* out = in.x.data() + m * Kp;
    for (int64_t u = 0; u < Kp / kQ4Unit; ++u)
      for (int64_t v = 0; v < 4; ++v)
        for (int64_t L = 0; L < 4; ++L)
          for (int64_t i = 0; i < 8; ++i) {
            const int64_t byte = 64 * u + 16 * L + 8 * (v & 1) + i;
            if (2 * byte >= K) continue;
            const int64_t g = byte / (G / 2), o = byte % (G / 2);
            out[kQ4Unit * u + 32 * v + 8 * L + i] = xm[g * G + (v >= 2 ? G / 2 : 0) + o];
          }
    for (int64_t g = 0; g < groups; ++g) {
      float sum = 0.f;
      for (int64_t i = 0; i < G; ++i) sum += bf16_to_float(xm[g * G + i]);
      in.sums[m * groups + g] = sum;
    }
  }
  return in;
}

template <int M>
void q4_rows(const Q4Input& in, const Segment& s, int64_t K, int64_t G, int64_t n0, int64_t n1) {
  const int64_t groups = K / G, units = in.Kp / kQ4Unit, row_bytes = K / 2;
  const __m512i low4 = _mm512_set1_epi8(0x0F), exp128 = _mm512_set1_epi8(0x43);  // 0x43nn: bf16 128 + n
  // lane j of a product vector sums 2 words of 16-byte lane j/4: group offset (j/4)·32/G within the unit
  alignas(64) int32_t lane_group[16];
  for (int j = 0; j < 16; ++j) lane_group[j] = static_cast<int32_t>((j / 4) * 32 / G);
  const __m512i group_index = _mm512_load_si512(lane_group);
  constexpr int kRows = M <= 2 ? 4 : 2;
  std::vector<float> sc(kRows * groups + 16);  // fp32 scales of the block's rows (+16: whole-vector reads)
  const bool fp32 = s.fp32_scaled();
  std::vector<float> expanded;  // a row's scales and zeros from Q4_K headers
  over_rows<kRows>(n0, n1, [&](auto rows, int64_t n) {
    constexpr int R = decltype(rows)::value;
    __m512 acc[M][R];
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
    // per-group offsets: Σ_g (z - (128 + zero code)·s)·Σx, since each weight enters as (128 + n)·s; and the fp32
    // scales. bf16 scales and zeros: W = (n - 8)·s + z; fp32 ones (GGUF blocks): W = n·s + z.
    for (int r = 0; r < R; ++r) {
      const Fp32Groups row = fp32 ? fp32_groups(s, n + r, K, groups, expanded) : Fp32Groups{};
      for (int64_t g = 0; g < groups; g += 16) {
        const __mmask16 mask = static_cast<__mmask16>(groups - g >= 16 ? 0xFFFF : (1u << (groups - g)) - 1);
        const int64_t at = (n + r) * groups + g;
        auto bf16s = [&](const uint16_t* p) {
          return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)), 16));
        };
        const __m512 sv = fp32 ? _mm512_maskz_loadu_ps(mask, row.scale + g) : bf16s(s.scales + at);
        const __m512 zv = fp32 ? _mm512_maskz_loadu_ps(mask, row.zero + g) : bf16s(s.zeros + at);
        _mm512_mask_storeu_ps(sc.data() + r * groups + g, mask, sv);
        const __m512 coef = _mm512_fnmadd_ps(sv, _mm512_set1_ps(fp32 ? 128.f : 136.f), zv);
        for (int m = 0; m < M; ++m)
          acc[m][r] = _mm512_fmadd_ps(coef, _mm512_maskz_loadu_ps(mask, in.sums.data() + m * groups + g), acc[m][r]);
      }
    }
    const uint8_t* block_start = s.w + n * row_bytes;
    for (int64_t u = 0; u < units; ++u) {
      prefetch_ahead(block_start + u * R * 64, R * 64);
      const int64_t left = row_bytes - 64 * u;  // the last unit of a row may be half (K % 128 == 64)
      const __mmask64 bytes_mask = left >= 64 ? ~0ull : (1ull << left) - 1;
      for (int r = 0; r < R; ++r) {
        const __m512i raw = _mm512_maskz_loadu_epi8(bytes_mask, s.w + (n + r) * row_bytes + 64 * u);
        const __m512i lo = _mm512_and_si512(raw, low4);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
        const __m512bh w0 = (__m512bh)_mm512_unpacklo_epi8(lo, exp128);
        const __m512bh w1 = (__m512bh)_mm512_unpackhi_epi8(lo, exp128);
        const __m512bh w2 = (__m512bh)_mm512_unpacklo_epi8(hi, exp128);
        const __m512bh w3 = (__m512bh)_mm512_unpackhi_epi8(hi, exp128);
        const __m512 scale = _mm512_permutexvar_ps(group_index,
                                                   _mm512_loadu_ps(sc.data() + r * groups + kQ4Unit * u / G));
        for (int m = 0; m < M; ++m) {
          const uint16_t* xu = in.x.data() + m * in.Kp + kQ4Unit * u;
          __m512 dot = _mm512_dpbf16_ps(_mm512_setzero_ps(), w0, (__m512bh)_mm512_loadu_si512(xu));
          dot = _mm512_dpbf16_ps(dot, w1, (__m512bh)_mm512_loadu_si512(xu + 32));
          dot = _mm512_dpbf16_ps(dot, w2, (__m512bh)_mm512_loadu_si512(xu + 64));
          dot = _mm512_dpbf16_ps(dot, w3, (__m512bh)_mm512_loadu_si512(xu + 96));
          acc[m][r] = _mm512_fmadd_ps(dot, scale, acc[m][r]);
        }
      }
    }
    store_rows<M, R>(acc, s.out, s.N, n, nullptr);
  });
}

}  // namespace qwenrt::gemv
