// A gated full-attention layer's decode step after its projections, in one call: q/k RMSNorm, partial RoPE, the new
// key/value written into the cache, softmax attention of one query per sequence over the cached keys (grouped-query)
// and the sigmoid output gate. torch's CPU attention copies every cached key (the prefix of a cache row is not
// contiguous across heads) and took ~14 ms per layer at 8K keys; this reads each cached key and value once. A row's
// keys are split into units of kSplit over the threads (a 0.8B layer has 2 KV heads: without the split a long
// context's decode ran on 2 cores), their partial softmaxes merged in key order. Products in fp32 at every level;
// with AVX-512 BF16, bf16 queries and a bf16 cache both are vdpbf16ps (the scores' 16 horizontal sums at once, the
// probabilities rounded to bf16 for P·V as in the tiled prefill), which halves the instructions per key: at 64K
// keys the fp32 products, not the memory, were the bound.
#include <ATen/core/Tensor.h>
#include "kernels.h"
#include "parallel.h"
#include <algorithm>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <type_traits>
#include <vector>

#include "kv_int8.h"
#include "simd.h"

namespace {

using namespace qwenrt::simd;

constexpr int64_t kMaxGroup = 16;  // query heads per key/value head
constexpr int kKeyBlock = kRegisters / 8;  // keys scored together (KB·GB accumulators + GB queries in registers)
constexpr int kValueChunks = kRegisters / 8;  // output vectors per head held in registers while summing values

inline F load_row(const float* p) { return load(p); }
inline F load_row(const at::BFloat16* p) { return load_bf16(reinterpret_cast<const uint16_t*>(p)); }
inline F load_row(const int8_t* p) { return load_i8(p); }  // an 8-bit row's values, its scale applied by the caller

constexpr int64_t kAhead = 16384;  // bytes of the key and value streams prefetched ahead of their use

// Scores of query heads [g0, g0 + GB) against keys [s0, s0 + KB): KB·GB dot products over D, each key read once.
// Key s is the row k + s·ld (ld = D, or D + 4 in an 8-bit store).
template <int GB, int KB, typename T>
inline void score_block(const float* q, const T* k, int64_t D, int64_t ld, int64_t S, int64_t s0, int64_t g0,
                        float* p) {
  const auto* ahead = reinterpret_cast<const char*>(k + s0 * ld) + kAhead;  // the keys are one stream: 16 KB on
  for (int64_t b = 0; b < static_cast<int64_t>(KB * ld * sizeof(T)); b += 64) __builtin_prefetch(ahead + b, 0, 3);
  F acc[KB][GB];
  for (int j = 0; j < KB; ++j)
    for (int g = 0; g < GB; ++g) acc[j][g] = zero();
  for (int64_t d = 0; d < D; d += kLanes) {
    F qv[GB];
    for (int g = 0; g < GB; ++g) qv[g] = load(q + (g0 + g) * D + d);
    for (int j = 0; j < KB; ++j) {
      const F kv = load_row(k + (s0 + j) * ld + d);
      for (int g = 0; g < GB; ++g) acc[j][g] = fmadd(qv[g], kv, acc[j][g]);
    }
  }
  for (int j = 0; j < KB; ++j)
    for (int g = 0; g < GB; ++g) p[(g0 + g) * S + s0 + j] = reduce_add(acc[j][g]);
}

template <int GB, typename T>
void scores(const float* q, const T* k, int64_t D, int64_t ld, int64_t S, int64_t g0, float* p) {
  int64_t s = 0;
  for (; s + kKeyBlock <= S; s += kKeyBlock) score_block<GB, kKeyBlock>(q, k, D, ld, S, s, g0, p);
  for (; s < S; ++s) score_block<GB, 1>(q, k, D, ld, S, s, g0, p);
}

// out[g][d0, d0 + C·kLanes) += Σ_{s in [s0, s1)} p[g][s]·v[s] for heads [g0, g0 + GB): C output vectors per head in
// registers (a compile-time count: with a run-time one the compiler kept them in memory, a load and a store per FMA).
template <int GB, int C, typename T>
inline void value_chunks(const float* p, const T* v, int64_t D, int64_t ld, int64_t S, int64_t s0, int64_t s1,
                         int64_t d0, int64_t g0, float* out) {
  F acc[GB][C];
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < C; ++c) acc[g][c] = load(out + (g0 + g) * D + d0 + kLanes * c);
  for (int64_t s = s0; s < s1; ++s) {
    F vv[C];
    for (int c = 0; c < C; ++c) vv[c] = load_row(v + s * ld + d0 + kLanes * c);
    for (int g = 0; g < GB; ++g) {
      const F pg = set1(p[(g0 + g) * S + s]);
      for (int c = 0; c < C; ++c) acc[g][c] = fmadd(pg, vv[c], acc[g][c]);
    }
  }
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < C; ++c) store(out + (g0 + g) * D + d0 + kLanes * c, acc[g][c]);
}

// value_chunks with C = chunks (≤ C): the last, partial pass over a head whose D is not a multiple of
// kValueChunks·kLanes.
template <int GB, int C, typename T>
inline void value_chunks_upto(int chunks, const float* p, const T* v, int64_t D, int64_t ld, int64_t S, int64_t s0,
                              int64_t s1, int64_t d0, int64_t g0, float* out) {
  if constexpr (C > 1) {
    if (chunks < C) return value_chunks_upto<GB, C - 1>(chunks, p, v, D, ld, S, s0, s1, d0, g0, out);
  }
  value_chunks<GB, C>(p, v, D, ld, S, s0, s1, d0, g0, out);
}

// out[g] = Σ_s p[g][s]·v[s] for heads [g0, g0 + GB): keys in blocks that stay in cache, kValueChunks vectors of
// output dims at a time held in registers; the next block's values are prefetched while one is summed.
template <int GB, typename T>
void weighted_values(const float* p, const T* v, int64_t D, int64_t ld, int64_t S, int64_t g0, float* out) {
  constexpr int64_t kKeys = 64;
  constexpr int64_t kWidth = kValueChunks * kLanes;
  const int64_t block_bytes = kKeys * ld * static_cast<int64_t>(sizeof(T)), passes = (D + kWidth - 1) / kWidth;
  const int64_t lines_per_pass = (block_bytes / 64 + passes - 1) / passes;
  for (int64_t s0 = 0; s0 < S; s0 += kKeys) {
    const int64_t s1 = std::min(S, s0 + kKeys);
    const auto* next = reinterpret_cast<const char*>(v + s1 * ld);
    for (int64_t d0 = 0, pass = 0; d0 < D; d0 += kWidth, ++pass) {
      for (int64_t l = pass * lines_per_pass; l < (pass + 1) * lines_per_pass; ++l)
        __builtin_prefetch(next + 64 * l, 0, 3);
      value_chunks_upto<GB, kValueChunks>(static_cast<int>(std::min<int64_t>(kValueChunks, (D - d0) / kLanes)), p,
                                          v, D, ld, S, s0, s1, d0, g0, out);
    }
  }
}

template <typename Fn>
void by_head_block(int64_t G, Fn&& f) {  // f(GB, g0) over head blocks of up to 4
  for (int64_t g0 = 0; g0 < G; g0 += 4) {
    switch (std::min<int64_t>(4, G - g0)) {
      case 1: f(std::integral_constant<int, 1>{}, g0); break;
      case 2: f(std::integral_constant<int, 2>{}, g0); break;
      case 3: f(std::integral_constant<int, 3>{}, g0); break;
      default: f(std::integral_constant<int, 4>{}, g0); break;
    }
  }
}

// One work unit's partial attention: G query heads over keys [s0, s1) of one KV head. Per head the largest score
// m, the sum of e^(score - m) and the values weighted by e^(score - m) (unnormalised): `merge` combines a row's
// units.
struct Partial {
  float* max;  // [G]
  float* sum;  // [G]
  float* out;  // [G][D]
};

// The fp32-product partial (every level): queries q [G][D] fp32, already scaled; k, v the unit's first rows of
// stores of C (ld apart), n keys; p the thread's scratch.
template <typename C>
void partial_fp32(const float* q, const C* k, const C* v, int64_t G, int64_t D, int64_t ld, int64_t n,
                  std::vector<float>& p, Partial r) {
  constexpr bool kInt8 = std::is_same_v<C, int8_t>;
  p.resize(G * n);
  by_head_block(G, [&](auto gb, int64_t g0) { scores<decltype(gb)::value>(q, k, D, ld, n, g0, p.data()); });
  if constexpr (kInt8) {
    for (int64_t s = 0; s < n; ++s) {
      const float ks = qwenrt::row_scale(k + s * ld, D);
      for (int64_t g = 0; g < G; ++g) p[g * n + s] *= ks;
    }
  }
  for (int64_t g = 0; g < G; ++g) {  // e^(score - max) over the n keys
    float* pg = p.data() + g * n;
    float mx = -INFINITY;
    for (int64_t s = 0; s < n; ++s) mx = std::max(mx, pg[s]);
    F sum = zero();
    int64_t s = 0;
    for (; s + kLanes <= n; s += kLanes) {
      const F e = qwenrt::simd::exp(sub(load(pg + s), set1(mx)));
      store(pg + s, e);
      sum = add(sum, e);
    }
    float total = reduce_add(sum);
    if (s < n) {  // the last n % kLanes scores, through the same vector exp
      alignas(64) float tail[kLanes] = {};
      std::copy(pg + s, pg + n, tail);
      store(tail, qwenrt::simd::exp(sub(load(tail), set1(mx))));
      for (int64_t t = s; t < n; ++t) total += (pg[t] = tail[t - s]);
    }
    if constexpr (kInt8) {
      for (int64_t t = 0; t < n; ++t) pg[t] *= qwenrt::row_scale(v + t * ld, D);
    }
    r.max[g] = mx;
    r.sum[g] = total;
  }
  std::fill(r.out, r.out + G * D, 0.f);
  by_head_block(G, [&](auto gb, int64_t g0) {
    weighted_values<decltype(gb)::value>(p.data(), v, D, ld, n, g0, r.out);
  });
}

#if defined(__AVX512BF16__)
// r[4q + k] = the sum of a[4k + q]'s lanes: 16 horizontal sums in 15 adds and 30 shuffles.
inline __m512 sum16(const __m512 (&a)[16]) {
  __m512 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)  // lanes 0-7: a[2i]'s partial sums, 8-15: a[2i + 1]'s
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // quarter q: a[4i + q]'s 4 partial sums
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)  // quarter q: a[8i + q]'s 2, then a[8i + 4 + q]'s 2
    d[i] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD));
}

// Scores of query heads [g0, g0 + GB) against keys [j0, j0 + KB) into p [G][n] (unscaled): the KB·GB dot products
// over D as vdpbf16ps sums of (d, d + 1) pairs of q and k (bf16 rows [.][D], D a multiple of 32), then sum16.
template <int GB, int KB>
inline void score_block_bf16(const uint16_t* q, const uint16_t* k, int64_t D, int64_t n, int64_t j0, int64_t g0,
                             float* p) {
  __m512 acc[16];  // acc[4j + g]: key j0 + j, head g0 + g
  for (auto& a : acc) a = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 32) {
    __m512bh qv[GB];
    for (int g = 0; g < GB; ++g) qv[g] = (__m512bh)_mm512_loadu_si512(q + (g0 + g) * D + d);
    for (int j = 0; j < KB; ++j) {
      const __m512bh kv = (__m512bh)_mm512_loadu_si512(k + (j0 + j) * D + d);
      for (int g = 0; g < GB; ++g) acc[4 * j + g] = _mm512_dpbf16_ps(acc[4 * j + g], kv, qv[g]);
    }
  }
  alignas(64) float r[16];  // r[4g + j]
  _mm512_store_ps(r, sum16(acc));
  for (int g = 0; g < GB; ++g) std::copy(r + 4 * g, r + 4 * g + KB, p + (g0 + g) * n + j0);
}

// Scores of all G query heads against keys [0, n) into p [G][n]: 4 keys at a time, every head block over them while
// they are in L1 (a KV head's keys are read from memory once, whatever G).
inline void scores_bf16(const uint16_t* q, const uint16_t* k, int64_t G, int64_t D, int64_t n, float* p) {
  const auto* ahead = reinterpret_cast<const char*>(k) + kAhead;
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    for (int64_t b = 0; b < 4 * D * 2; b += 64) __builtin_prefetch(ahead + j * D * 2 + b, 0, 3);
    by_head_block(G, [&](auto gb, int64_t g0) { score_block_bf16<decltype(gb)::value, 4>(q, k, D, n, j, g0, p); });
  }
  by_head_block(G, [&](auto gb, int64_t g0) {
    constexpr int GB = decltype(gb)::value;
    switch (n - j) {
      case 1: score_block_bf16<GB, 1>(q, k, D, n, j, g0, p); break;
      case 2: score_block_bf16<GB, 2>(q, k, D, n, j, g0, p); break;
      case 3: score_block_bf16<GB, 3>(q, k, D, n, j, g0, p); break;
      default: break;
    }
  });
}

// acc[g][d0, d0 + 32·NC) += Σ over key pairs [j0, j1) of (p[g][2j], p[g][2j + 1])·(v[2j], v[2j + 1]) for heads
// [g0, g0 + GB): the two rows' bf16 interleaved by unpacklo/hi_epi16 and summed by vdpbf16ps, so each block of 32
// dims is two accumulators in the unpack's order (`natural_order` undoes it). With `alone` the last pair's second
// key is past the unit (its probability 0): a zero row stands in for it.
template <int GB, int NC, bool alone>
inline void value_pairs_bf16(const uint32_t* p, int64_t pairs, const uint16_t* v, int64_t D, int64_t j0, int64_t j1,
                             int64_t d0, int64_t g0, float* acc) {
  __m512 o[GB][2 * NC];
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < 2 * NC; ++c) o[g][c] = _mm512_loadu_ps(acc + (g0 + g) * D + d0 + 16 * c);
  for (int64_t j = j0; j < j1; ++j) {
    __m512i lo[NC], hi[NC];
    for (int c = 0; c < NC; ++c) {
      const __m512i a = _mm512_loadu_si512(v + 2 * j * D + d0 + 32 * c);
      const __m512i b = alone ? _mm512_setzero_si512() : _mm512_loadu_si512(v + (2 * j + 1) * D + d0 + 32 * c);
      lo[c] = _mm512_unpacklo_epi16(a, b);
      hi[c] = _mm512_unpackhi_epi16(a, b);
    }
    for (int g = 0; g < GB; ++g) {
      const __m512bh pg = (__m512bh)_mm512_set1_epi32(static_cast<int>(p[(g0 + g) * pairs + j]));
      for (int c = 0; c < NC; ++c) {
        o[g][2 * c] = _mm512_dpbf16_ps(o[g][2 * c], (__m512bh)lo[c], pg);
        o[g][2 * c + 1] = _mm512_dpbf16_ps(o[g][2 * c + 1], (__m512bh)hi[c], pg);
      }
    }
  }
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < 2 * NC; ++c) _mm512_storeu_ps(acc + (g0 + g) * D + d0 + 16 * c, o[g][c]);
}

// acc [G][D] in value_pairs_bf16's order -> natural order: in each block of 32 dims, lane 4L + i of the first
// accumulator is dim 8L + i, of the second dim 8L + 4 + i.
inline void natural_order(float* acc, int64_t G, int64_t D) {
  alignas(64) static constexpr int32_t first[16] = {0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23};
  alignas(64) static constexpr int32_t second[16] = {8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31};
  const __m512i i0 = _mm512_load_si512(first), i1 = _mm512_load_si512(second);
  for (int64_t x = 0; x < G * D; x += 32) {
    const __m512 lo = _mm512_loadu_ps(acc + x), hi = _mm512_loadu_ps(acc + x + 16);
    _mm512_storeu_ps(acc + x, _mm512_permutex2var_ps(lo, i0, hi));
    _mm512_storeu_ps(acc + x + 16, _mm512_permutex2var_ps(lo, i1, hi));
  }
}

struct ScratchBf16 {
  std::vector<float> st;    // [G][n] scores
  std::vector<uint16_t> p;  // [G][pad] probabilities, bf16, zero past n (pad: n rounded up to 32)
};

// The bf16-product partial (AVX-512 BF16, bf16 queries over a bf16 store, D a multiple of 32): q [G][D] bf16
// unscaled, k, v the unit's first rows, n keys; scores vdpbf16ps products of the bf16 query and key (exact, fp32
// sums) times `scale`; the probabilities e^(score - max) rounded to bf16 for P·V, as torch's bf16 attention rounds
// them, their sum kept in fp32.
void partial_bf16(const uint16_t* q, const uint16_t* k, const uint16_t* v, int64_t G, int64_t D, int64_t n,
                  float scale, ScratchBf16& w, Partial r) {
  const int64_t pad = (n + 31) / 32 * 32, pairs = pad / 2;
  w.st.resize(G * n);
  w.p.resize(G * pad);
  scores_bf16(q, k, G, D, n, w.st.data());
  const __m512 vscale = _mm512_set1_ps(scale);
  auto valid = [&](int64_t s) {  // lanes of [s, s + 16) below n
    return static_cast<__mmask16>(n - s >= 16 ? 0xFFFF : n > s ? (1u << (n - s)) - 1 : 0);
  };
  for (int64_t g = 0; g < G; ++g) {
    const float* sg = w.st.data() + g * n;
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int64_t s = 0; s < n; s += 16)
      top = _mm512_mask_max_ps(top, valid(s), top, _mm512_mul_ps(_mm512_maskz_loadu_ps(valid(s), sg + s), vscale));
    const float mx = _mm512_reduce_max_ps(top);
    const __m512 shift = _mm512_set1_ps(mx);
    __m512 total = _mm512_setzero_ps();
    auto prob = [&](int64_t s) {
      const __mmask16 in = valid(s);
      const __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(in, sg + s), vscale);
      const __m512 e = _mm512_maskz_mov_ps(in, qwenrt::simd::exp(_mm512_sub_ps(x, shift)));
      total = _mm512_add_ps(total, e);
      return e;
    };
    for (int64_t s = 0; s < pad; s += 32) {
      const __m512 e0 = prob(s), e1 = prob(s + 16);
      _mm512_storeu_si512(w.p.data() + g * pad + s, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
    }
    r.max[g] = mx;
    r.sum[g] = _mm512_reduce_add_ps(total);
  }
  std::fill(r.out, r.out + G * D, 0.f);
  const auto* p32 = reinterpret_cast<const uint32_t*>(w.p.data());
  // blocks of kPairs key pairs (16 KB of a 0.8B head's values), every head block and pass of 64 dims over a block
  // while it is in L1, the next block prefetched a part per pass
  constexpr int64_t kPairs = 16;
  const int64_t full = n / 2;  // pairs with both keys in the unit
  const int64_t passes = (D + 63) / 64, lines = (2 * kPairs * D * 2 / 64 + passes - 1) / passes;
  auto sum_pairs = [&](int64_t j0, int64_t j1, auto alone) {
    const auto* next = reinterpret_cast<const char*>(v + 2 * j1 * D);
    for (int64_t d0 = 0, pass = 0; d0 < D; d0 += 64, ++pass) {
      for (int64_t l = pass * lines; l < (pass + 1) * lines; ++l) __builtin_prefetch(next + 64 * l, 0, 3);
      by_head_block(G, [&](auto gb, int64_t g0) {
        constexpr int GB = decltype(gb)::value;
        if (D - d0 >= 64)
          value_pairs_bf16<GB, 2, decltype(alone)::value>(p32, pairs, v, D, j0, j1, d0, g0, r.out);
        else
          value_pairs_bf16<GB, 1, decltype(alone)::value>(p32, pairs, v, D, j0, j1, d0, g0, r.out);
      });
    }
  };
  for (int64_t j0 = 0; j0 < full; j0 += kPairs) sum_pairs(j0, std::min(full, j0 + kPairs), std::false_type{});
  if (n % 2) sum_pairs(full, full + 1, std::true_type{});
  natural_order(r.out, G, D);
}
#endif

constexpr int64_t kSplit = 4096;  // keys per work unit: a long row's keys are split over the threads

// Queries Q [B, H, D] over stores Kc, Vc [B or 1, Hkv, cap, ld] of C: T itself (ld = D), or int8 rows with their
// scale (ld = D + 4): a key's scale multiplies its scores, a value's its probabilities. Work units: (row, KV head,
// kSplit keys); a row's units are merged in key order, so the result depends on neither the threads nor the batch.
template <typename T, typename C>
void attend(const T* Q, const C* Kc, const C* Vc, const int64_t* valid, T* O, int64_t B, int64_t H, int64_t Hkv,
            int64_t cap, int64_t D, bool shared, float scale) {
  constexpr bool kInt8 = std::is_same_v<C, int8_t>;
  const int64_t G = H / Hkv, ld = kInt8 ? D + qwenrt::kScaleBytes : D;
  std::vector<int64_t> first(B * Hkv + 1, 0);  // first[i]: (row, KV head) i's first unit
  for (int64_t i = 0; i < B * Hkv; ++i) first[i + 1] = first[i] + (valid[i / Hkv] + kSplit - 1) / kSplit;
  const int64_t units = first.back();
  std::vector<float> mx(units * G), sum(units * G), out(units * G * D);
#if defined(__AVX512BF16__)
  constexpr bool kBf16Products = std::is_same_v<T, at::BFloat16> && std::is_same_v<C, at::BFloat16>;
#else
  constexpr bool kBf16Products = false;
#endif
  qwenrt::parallel_for_work(0, units, 2 * G * D * std::min(kSplit, valid[0]), [&](int64_t u0, int64_t u1) {
    std::vector<float> q(G * D), p;
#if defined(__AVX512BF16__)
    ScratchBf16 w;
#endif
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t i = std::upper_bound(first.begin(), first.end(), u) - first.begin() - 1;
      const int64_t b = i / Hkv, hk = i % Hkv, kv = shared ? hk : i;
      const int64_t s0 = (u - first[i]) * kSplit, n = std::min(kSplit, valid[b] - s0);
      const C* k = Kc + (kv * cap + s0) * ld;
      const C* v = Vc + (kv * cap + s0) * ld;
      const T* qh = Q + (b * H + hk * G) * D;  // the G query heads of KV head hk
      const Partial r{mx.data() + u * G, sum.data() + u * G, out.data() + u * G * D};
#if defined(__AVX512BF16__)
      if (kBf16Products && D % 32 == 0) {
        partial_bf16(reinterpret_cast<const uint16_t*>(qh), reinterpret_cast<const uint16_t*>(k),
                     reinterpret_cast<const uint16_t*>(v), G, D, n, scale, w, r);
        continue;
      }
#endif
      for (int64_t x = 0; x < G * D; ++x) q[x] = static_cast<float>(qh[x]) * scale;
      partial_fp32(q.data(), k, v, G, D, ld, n, p, r);
    }
  });
  // merge: per head, the units' sums and outputs rescaled to the row's largest score
  qwenrt::parallel_for_work(0, B * Hkv, (first[1] - first[0]) * G * D, [&](int64_t i0, int64_t i1) {
    std::vector<float> acc(D);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / Hkv, hk = i % Hkv;
      for (int64_t g = 0; g < G; ++g) {
        float top = -INFINITY, total = 0.f;
        for (int64_t u = first[i]; u < first[i + 1]; ++u) top = std::max(top, mx[u * G + g]);
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t u = first[i]; u < first[i + 1]; ++u) {
          const float f = first[i + 1] - first[i] == 1 ? 1.f : std::exp(mx[u * G + g] - top);
          total += f * sum[u * G + g];
          const float* o = out.data() + (u * G + g) * D;
          for (int64_t d = 0; d < D; ++d) acc[d] += f * o[d];
        }
        const float inv = 1.0f / total;
        T* dst = O + (b * H + hk * G + g) * D;
        for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(acc[d] * inv);
      }
    }
  });
}

template <typename T>
inline float rd(float x) { return static_cast<float>(static_cast<T>(x)); }  // round to T, as torch ops do

// Zero-centred RMSNorm of one head, then partial NeoX RoPE over its first R channels, at the reference's rounding
// points (qwenrt/model.py: norm rounded once; rot·cos, rotated·sin and their sum each rounded to T).
template <typename T>
void norm_rope(const T* x, const float* w, const T* cos, const T* sin, int64_t D, int64_t R, float eps, T* out) {
  float ss = 0.f;
  for (int64_t d = 0; d < D; ++d) { const float v = static_cast<float>(x[d]); ss += v * v; }
  const float inv = 1.0f / std::sqrt(ss / D + eps);
  float normed[512];
  for (int64_t d = 0; d < D; ++d) normed[d] = rd<T>(static_cast<float>(x[d]) * inv * (1.0f + w[d]));
  const int64_t half = R / 2;
  for (int64_t d = 0; d < R; ++d) {
    const float rotated = d < half ? -normed[d + half] : normed[d - half];
    out[d] = static_cast<T>(rd<T>(normed[d] * static_cast<float>(cos[d])) +
                            rd<T>(rotated * static_cast<float>(sin[d])));
  }
  for (int64_t d = R; d < D; ++d) out[d] = static_cast<T>(normed[d]);
}

template <typename T, typename C>
void attention_step(const T* QG, const T* Kn, const T* Vn, const float* QW, const float* KW, const T* COS,
                    const T* SIN, C* Kc, C* Vc, const int64_t* lengths, T* out, int64_t B, int64_t H, int64_t Hkv,
                    int64_t cap, int64_t D, int64_t R, bool shared, float eps, bool gated) {
  constexpr bool kInt8 = std::is_same_v<C, int8_t>;
  const int64_t QS = gated ? 2 * D : D;  // a head's stride in QG: query | gate, or the query alone
  const int64_t ld = kInt8 ? D + qwenrt::kScaleBytes : D;
  // new keys (normed, rotated) and values into the stores at each row's next position; all are written before any
  // row attends, so rows sharing one sequence's store see each other's keys up to their own position
  qwenrt::parallel_for_work(0, B * Hkv, 4 * D, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / Hkv, pos = lengths[b], kv = shared ? i % Hkv : i;
      C* key = Kc + (kv * cap + pos) * ld;
      C* value = Vc + (kv * cap + pos) * ld;
      if constexpr (kInt8) {  // the key rounded to T as a T store holds it, then quantized
        T rounded[512];
        norm_rope(Kn + i * D, KW, COS + b * R, SIN + b * R, D, R, eps, rounded);
        qwenrt::quantize_row(rounded, D, key);
        qwenrt::quantize_row(Vn + i * D, D, value);
      } else {
        norm_rope(Kn + i * D, KW, COS + b * R, SIN + b * R, D, R, eps, key);
        std::copy(Vn + i * D, Vn + (i + 1) * D, value);
      }
    }
  });
  std::vector<T> q(B * H * D);
  std::vector<int64_t> valid(B);
  for (int64_t b = 0; b < B; ++b) valid[b] = lengths[b] + 1;
  qwenrt::parallel_for_work(0, B * H, 4 * D, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / H;
      norm_rope(QG + i * QS, QW, COS + b * R, SIN + b * R, D, R, eps, q.data() + i * D);
    }
  });
  std::vector<T> o(B * H * D);
  attend(q.data(), Kc, Vc, valid.data(), o.data(), B, H, Hkv, cap, D, shared,
         1.0f / std::sqrt(static_cast<float>(D)));
  if (!gated) {
    std::copy(o.begin(), o.end(), out);
    return;
  }
  for (int64_t i = 0; i < B * H; ++i)  // sigmoid output gate, rounded as torch.sigmoid and the product are
    for (int64_t d = 0; d < D; ++d) {
      const float g = static_cast<float>(QG[i * 2 * D + D + d]);
      out[i * D + d] = static_cast<T>(static_cast<float>(o[i * D + d]) * rd<T>(1.0f / (1.0f + std::exp(-g))));
    }
}

}  // namespace

// One decode step of a full-attention layer after its projections. qg [B, H, 2·Dh] (query | gate per head; gated
// false: [B, H, Dh], the query alone and no output gate, Qwen3-VL),
// k, v [B, Hkv, Dh], q_norm_w, k_norm_w [Dh] fp32 (stored w; the norm scales by 1 + w), cos, sin [B, R],
// keys, values [B, Hkv, cap, Dh] (the cache stores, written at position lengths[b]; or 8-bit stores
// [B, Hkv, cap, Dh + 4] int8, kv_int8.h), lengths [B] int64. With stores [1, Hkv, cap, ..] and B > 1 the rows are
// successive tokens of one sequence (lengths[b] = lengths[0] + b): each attends causally to the tokens before it,
// the earlier rows' included.
// Returns the (gated) attention output [B, H·Dh], ready for o_proj.
at::Tensor attention_decode_step(at::Tensor qg, at::Tensor k, at::Tensor v, at::Tensor q_norm_w,
                                    at::Tensor k_norm_w, at::Tensor cos, at::Tensor sin, at::Tensor keys,
                                    at::Tensor values, at::Tensor lengths, double eps, bool gated) {
  for (auto* t : {&qg, &k, &v, &q_norm_w, &k_norm_w, &cos, &sin, &keys, &values, &lengths})
    TORCH_CHECK(t->is_contiguous(), "attention_decode_step: contiguous inputs only");
  const auto T = qg.scalar_type();
  const bool int8 = keys.scalar_type() == at::kChar;
  TORCH_CHECK((T == at::kBFloat16 || T == at::kFloat) && k.scalar_type() == T && v.scalar_type() == T &&
              cos.scalar_type() == T && sin.scalar_type() == T && (keys.scalar_type() == T || int8) &&
              values.scalar_type() == keys.scalar_type() && q_norm_w.scalar_type() == at::kFloat &&
              k_norm_w.scalar_type() == at::kFloat && lengths.scalar_type() == at::kLong,
              "attention_decode_step: dtypes");
  const int64_t B = qg.size(0), H = qg.size(1), D = gated ? qg.size(2) / 2 : qg.size(2), Hkv = keys.size(1);
  const int64_t cap = keys.size(2);
  const int64_t R = cos.size(-1);
  TORCH_CHECK(k.numel() == B * Hkv * D && v.numel() == B * Hkv * D &&
              keys.size(3) == D + (int8 ? qwenrt::kScaleBytes : 0) && H % Hkv == 0 &&
              H / Hkv <= kMaxGroup && D % 16 == 0 && D <= 512 && R <= D && R % 2 == 0 && cos.numel() == B * R &&
              sin.numel() == B * R && lengths.numel() == B && q_norm_w.numel() == D && k_norm_w.numel() == D &&
              (keys.size(0) == B || keys.size(0) == 1) && values.sizes() == keys.sizes(),
              "attention_decode_step: shapes");
  const bool shared = keys.size(0) == 1 && B > 1;
  const int64_t* len = lengths.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(len[b] >= 0 && len[b] < cap && (!shared || len[b] == len[0] + b),
                "attention_decode_step: cache is full, or shared-store rows not at successive positions");
  auto out = at::empty({B, H * D}, qg.options());
  auto run = [&](auto* qg_, auto* cache) {
    using E = std::remove_pointer_t<decltype(qg_)>;
    using C = std::remove_pointer_t<decltype(cache)>;
    attention_step(qg_, k.data_ptr<E>(), v.data_ptr<E>(), q_norm_w.data_ptr<float>(), k_norm_w.data_ptr<float>(),
                   cos.data_ptr<E>(), sin.data_ptr<E>(), keys.data_ptr<C>(), values.data_ptr<C>(), len,
                   out.data_ptr<E>(), B, H, Hkv, cap, D, R, shared, static_cast<float>(eps), gated);
  };
  if (T == at::kBFloat16) {
    auto* q = qg.data_ptr<at::BFloat16>();
    int8 ? run(q, keys.data_ptr<int8_t>()) : run(q, keys.data_ptr<at::BFloat16>());
  } else {
    auto* q = qg.data_ptr<float>();
    int8 ? run(q, keys.data_ptr<int8_t>()) : run(q, keys.data_ptr<float>());
  }
  return out;
}
