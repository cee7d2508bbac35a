// What every level's matrix-vector kernels share: the call's weight segments, software prefetch, and activations in
// 16-bit fixed point for the integer formats.
#pragma once
#include <ATen/core/Tensor.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "parallel.h"
#include "simd.h"

namespace qwenrt::gemv {

constexpr int kMaxRows = 8;           // activation rows per call: each weight is streamed once for all of them
constexpr int64_t kPrefetch = 16384;  // bytes ahead of the weight stream (bf16, AVX-512: 4 KB 38, 8 KB 42.6, 16 KB 43.5 GB/s)
constexpr int64_t kQ8Block = 256;     // int8: columns per activation scale

struct Segment {  // one weight matrix of a call and where its rows go
  const uint8_t* w;
  const uint16_t* scales;  // bf16 scales: int8 [N]; int4 [N, K/G]
  const uint16_t* zeros;   // int4 [N, K/G]
  int64_t N;
  float* out;  // [M, N] fp32 (rounded to bf16 afterwards when asked)
  // fp32 groups (GGUF blocks held exactly): scales and zeros [N, K/G] in fp32, W = q·s + z; zeros may be absent
  // for int8 (then z = 0). Where these are set, `scales` and `zeros` are not.
  const float* fscales = nullptr;
  const float* fzeros = nullptr;
  // int4 whose scales and zeros are GGUF block headers, expanded per row to fp32 (fp32_groups) where a kernel needs
  // them: Q4_K's super-block headers [N, K/256, 16] (fp16 d, dmin; 6-bit scale and min per 32), or Q4_0's fp16
  // scales d [N, K/32] (zero -8·d). Either keeps the format at its file's size.
  const uint8_t* q4k = nullptr;
  const uint16_t* q40 = nullptr;
  bool fp32_scaled() const { return fscales != nullptr || q4k != nullptr || q40 != nullptr; }
};

constexpr int64_t kQ4kBlock = 256;  // columns per Q4_K header
constexpr int64_t kQ4kHeader = 16;  // its bytes

// The hardware prefetchers stop at 4 KB pages; the weight stream is linear, so ask for what comes 16 KB later.
inline void prefetch_ahead(const uint8_t* p, int64_t bytes) {
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(p + kPrefetch + i, 0, 3);
}

// The same bytes of the next block's rows (a block: R consecutive rows from row0): each row is a stream of its
// own, read R rows later.
inline void prefetch_next_rows(const uint8_t* row0, int64_t row_bytes, int R, int64_t offset) {
  for (int r = 0; r < R; ++r) __builtin_prefetch(row0 + (R + r) * row_bytes + offset, 0, 3);
}

// Runs block<R>(n) over [n0, n1) in blocks of R rows, the remainder one row at a time. R is a compile-time count:
// with a run-time one (a last block of fewer rows) the compiler kept the accumulators in memory, a load and a store
// around every multiply-add (the avx512bf16 kernels were 2-3x slower on weights in cache).
template <int R, typename Block>
inline void over_rows(int64_t n0, int64_t n1, Block&& block) {
  int64_t n = n0;
  for (; n + R <= n1; n += R) block(std::integral_constant<int, R>{}, n);
  for (; n < n1; ++n) block(std::integral_constant<int, 1>{}, n);
}

inline float bf16_to_float(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// An IEEE half's value (exact in fp32).
inline float fp16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu;
  if (exp == 0) {  // zero or subnormal: mant·2^-24
    const float f = std::ldexp(static_cast<float>(mant), -24);
    return sign ? -f : f;
  }
  const uint32_t bits = sign | (exp == 31 ? 0x7F800000u | (mant << 13) : ((exp + 112) << 23) | (mant << 13));
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Row n's fp32 scale d·sc and zero -dmin·m for each of its K/32 groups, from its Q4_K headers (llama.cpp's
// get_scale_min_k4): W = q·scale + zero, the value llama.cpp's dequantization gives.
inline void q4k_row(const uint8_t* headers, int64_t n, int64_t K, float* scale, float* zero) {
  const int64_t blocks = K / kQ4kBlock;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* h = headers + (n * blocks + b) * kQ4kHeader;
    const float d = fp16_to_float(static_cast<uint16_t>(h[0] | h[1] << 8));
    const float dmin = fp16_to_float(static_cast<uint16_t>(h[2] | h[3] << 8));
    const uint8_t* q = h + 4;
    for (int j = 0; j < 8; ++j) {
      const int sc = j < 4 ? q[j] & 63 : (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
      const int m = j < 4 ? q[j + 4] & 63 : (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
      scale[b * 8 + j] = d * static_cast<float>(sc);
      zero[b * 8 + j] = -(dmin * static_cast<float>(m));
    }
  }
}

// Row n's fp32 scale d and zero -8·d for each of its K/32 groups, from its Q4_0 scales (fp16 d [N, K/32]).
inline void q40_row(const uint16_t* d, int64_t n, int64_t K, float* scale, float* zero) {
  const int64_t groups = K / 32;
  int64_t g = 0;
#if defined(__F16C__)  // a row's conversions cost more than its weights' reading, one at a time
  for (; g + 8 <= groups; g += 8) {
    const __m256 s = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + n * groups + g)));
    _mm256_storeu_ps(scale + g, s);
    _mm256_storeu_ps(zero + g, _mm256_mul_ps(s, _mm256_set1_ps(-8.f)));
  }
#endif
  for (; g < groups; ++g) {
    scale[g] = fp16_to_float(d[n * groups + g]);
    zero[g] = -8.f * scale[g];
  }
}

// Row n's fp32 scales and zeros [K/G] where the segment has them in fp32: its own, or its block headers expanded
// into `buffer`.
struct Fp32Groups {
  const float* scale;
  const float* zero;
};

inline Fp32Groups fp32_groups(const Segment& s, int64_t n, int64_t K, int64_t groups, std::vector<float>& buffer) {
  if (s.q4k == nullptr && s.q40 == nullptr) return {s.fscales + n * groups, s.fzeros + n * groups};
  buffer.resize(2 * groups);
  if (s.q4k != nullptr) q4k_row(s.q4k, n, K, buffer.data(), buffer.data() + groups);
  else q40_row(s.q40, n, K, buffer.data(), buffer.data() + groups);
  return {buffer.data(), buffer.data() + groups};
}

// A segment's block headers (Segment::q4k, q40) from a tensor of N rows of K columns: Q4_K's uint8 [N, K/256, 16]
// or Q4_0's fp16 [N, K/32].
inline void set_block_headers(Segment& s, const at::Tensor& headers, int64_t N, int64_t K, const char* what) {
  TORCH_CHECK(headers.is_contiguous() && (headers.scalar_type() == at::kByte || headers.scalar_type() == at::kHalf),
              what, ": block headers: Q4_K's uint8 [N, K/256, 16] or Q4_0's fp16 scales [N, K/32]");
  if (headers.scalar_type() == at::kHalf) {
    TORCH_CHECK(K % 32 == 0 && headers.numel() == N * (K / 32), what, ": Q4_0 scales fp16 [N, K/32]");
    s.q40 = reinterpret_cast<const uint16_t*>(headers.data_ptr<at::Half>());
    return;
  }
  TORCH_CHECK(K % kQ4kBlock == 0 && headers.numel() == N * (K / kQ4kBlock) * kQ4kHeader,
              what, ": Q4_K headers uint8 [N, K/256, 16], K % 256 == 0");
  s.q4k = headers.data_ptr<uint8_t>();
}

// Σ x per row and group of G columns, in fp32: [M, K/G] (+ 16 zeros, for whole-vector reads), through which the
// zeros of a grouped format enter: Σ_g z_g·Σ_{k in g} x_k.
inline std::vector<float> group_sums(const at::Tensor& x, int64_t G) {
  const int64_t M = x.size(0), K = x.size(1), groups = K / G;
  const auto* X = reinterpret_cast<const uint16_t*>(x.data_ptr());
  std::vector<float> sums(M * groups + 16, 0.f);
  for (int64_t i = 0; i < M * groups; ++i) {
    float sum = 0.f;
    for (int64_t k = 0; k < G; ++k) sum += bf16_to_float(X[i * G + k]);
    sums[i] = sum;
  }
  return sums;
}

// The largest |x| of n bf16 values; a NaN is skipped (a NaN lane keeps the largest so far, as std::max would).
inline float abs_max_bf16(const uint16_t* x, int64_t n) {
  using namespace qwenrt::simd;
  const int64_t vec = n / kLanes * kLanes;
  F largest = zero();
  for (int64_t j = 0; j < vec; j += kLanes) {
    const F v = load_bf16(x + j);
    largest = max(max(v, sub(zero(), v)), largest);
  }
  float lanes[kLanes], amax = 0.f;
  store(lanes, largest);
  for (float v : lanes) amax = std::max(amax, v);
  for (int64_t j = vec; j < n; ++j) amax = std::max(amax, std::fabs(bf16_to_float(x[j])));
  return amax;
}

struct FixedPoint {  // x in 16-bit fixed point per block of columns, zero padded to whole blocks
  std::vector<int16_t> q;    // [M, Kp]
  std::vector<float> scale;  // [M, Kp / block]: x ≈ q·scale
  int64_t Kp;
};

// A power-of-two scale per block: exact for every element within 2^8 of its block's largest (8 significant bits
// fit in 15), the smaller ones off by at most 2^-16 of that largest. Blocks are split over the threads (a prefill
// GEMM converts hundreds of rows); NaN is skipped by the largest and becomes 32767, as std::max/min would have it.
inline FixedPoint to_fixed_point(const at::Tensor& x, int64_t block) {
  using namespace qwenrt::simd;
  const int64_t M = x.size(0), K = x.size(1);
  const int64_t Kp = (K + block - 1) / block * block, blocks = Kp / block;
  const auto* X = reinterpret_cast<const uint16_t*>(x.data_ptr());  // bf16
  FixedPoint in{std::vector<int16_t>(M * Kp, 0), std::vector<float>(M * blocks), Kp};
  qwenrt::parallel_for_work(0, M * blocks, block, [&](int64_t i0, int64_t i1) {
    std::vector<int32_t> wide(block);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t m = i / blocks, b = i % blocks;
      const uint16_t* xb = X + m * K + b * block;
      const int64_t width = std::min(block, K - b * block), vec = width / kLanes * kLanes;
      const float amax = abs_max_bf16(xb, width);
      int e = 0;
      std::frexp(amax, &e);  // amax = f·2^e, f in [0.5, 1): |x| / 2^(e-15) < 2^15
      in.scale[i] = amax > 0.f ? std::ldexp(1.0f, e - 15) : 0.f;
      const float inv = amax > 0.f ? std::ldexp(1.0f, 15 - e) : 0.f;
      for (int64_t j = 0; j < vec; j += kLanes) {  // min first: NaN -> 32767
        const F v = max(min(mul(load_bf16(xb + j), set1(inv)), set1(32767.f)), set1(-32767.f));
        const I q = to_int(v);
        std::memcpy(wide.data() + j, &q, sizeof q);
      }
      for (int64_t j = vec; j < width; ++j)
        wide[j] = static_cast<int32_t>(std::max(-32767.f, std::min(32767.f, std::nearbyint(bf16_to_float(xb[j]) * inv))));
      int16_t* qb = in.q.data() + m * Kp + b * block;
      for (int64_t j = 0; j < width; ++j) qb[j] = static_cast<int16_t>(wide[j]);
    }
  });
  return in;
}

// Columns [full, K) of int8 row n (of the segment's [N, K] weight) · x row m, unscaled by the row (they lie in the
// last block): the tail an int8 GEMV's vector loop leaves.
[[gnu::noinline]] inline float q8_tail(const FixedPoint& in, const Segment& s, int64_t K, int64_t full, int64_t n,
                                       int m) {
  const auto* q = reinterpret_cast<const int8_t*>(s.w) + n * K;
  int64_t sum = 0;
  for (int64_t k = full; k < K; ++k) sum += int64_t{q[k]} * in.q[m * in.Kp + k];
  return static_cast<float>(sum) * in.scale[m * (in.Kp / kQ8Block) + (K - 1) / kQ8Block];
}

// x in 8 bits per row and group of G columns: q = round(x / d) with d = amax / 127 (|q| <= 127), and d·Σq per
// group, through which the int4 zero points enter. NaN becomes 127, as the 16-bit fixed point has it.
struct Int8Rows {
  std::vector<int8_t> q;     // [M, K]
  std::vector<float> scale;  // [M, groups]: d
  std::vector<float> sums;   // [M, groups]: d·Σq
};

// q = round(v·127/amax) for a group's G values, `load(j)` giving values j..j + kLanes - 1 as a vector (NaN -> 127);
// returns Σq
template <typename Load>
inline int32_t round_to_int8(Load&& load, int64_t G, float amax, int8_t* q) {
  using namespace qwenrt::simd;
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  int32_t total = 0;
  for (int64_t j = 0; j < G; j += kLanes) {  // min first: NaN -> 127
    int32_t v[kLanes];
    const I r = to_int(max(min(mul(load(j), set1(inv)), set1(127.f)), set1(-127.f)));
    std::memcpy(v, &r, sizeof v);
    for (int l = 0; l < kLanes; ++l) {
      q[j + l] = static_cast<int8_t>(v[l]);
      total += v[l];
    }
  }
  return total;
}

inline Int8Rows to_int8(const at::Tensor& x, int64_t G) {
  using namespace qwenrt::simd;
  const int64_t M = x.size(0), K = x.size(1), groups = K / G;
  const auto* X = reinterpret_cast<const uint16_t*>(x.data_ptr());
  Int8Rows out{std::vector<int8_t>(M * K), std::vector<float>(M * groups), std::vector<float>(M * groups)};
  qwenrt::parallel_for_work(0, M * groups, G, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const uint16_t* xg = X + i * G;  // row i / groups, group i % groups: K = groups·G
      const float amax = abs_max_bf16(xg, G);
      const int32_t total = round_to_int8([&](int64_t j) { return load_bf16(xg + j); }, G, amax, out.q.data() + i * G);
      out.scale[i] = amax / 127.f;
      out.sums[i] = static_cast<float>(total) * out.scale[i];
    }
  });
  return out;
}

}  // namespace qwenrt::gemv
