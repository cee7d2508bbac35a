// Causal attention of a prefill chunk against one sequence's KV store, flash-style: keys and values are read in tiles
// of kTile, each row keeps a running max and sum of its exponentials (online softmax, fp32) and its output in fp32,
// so the memory per call is O(rows × kTile + kTile × Dh) per thread whatever the context. torch's SDPA with a [T, S]
// mask held the mask (and, on its math path, the [H, T, S] scores).
// Work: (KV head, block of ~kQueries / G tokens). A block's G·tokens query rows, packed once, share each key tile;
// scores are computed transposed, [keys][rows] (the keys the broadcast operand: no tile is transposed, bf16 ones
// only widened), the online softmax runs a vector of rows at a time, and P·V is a register-tiled product over the
// value tile. fp32 FMAs at every level; with AVX-512 BF16 and bf16 queries both products are vdpbf16ps (exact
// products, fp32 sums; the probabilities rounded to bf16 for P·V, as torch's bf16 attention rounds them). 8-bit
// stores (kv_int8.h) are dequantized a tile at a time: to bf16 for the vdpbf16ps path, to fp32 otherwise.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "kv_int8.h"
#include "parallel.h"
#include "simd.h"

namespace {

using namespace qwenrt::simd;

constexpr int64_t kTile = 64;      // keys per tile (a multiple of 2·kLanes at every level)
constexpr int64_t kQueries = 128;  // query rows per work unit: tokens × the G query heads of one KV head
constexpr int kRows = std::min(8, (kRegisters - 3) / 2);  // rows per register tile: 2·kRows accumulators
constexpr int64_t kMaxD = 512;

// C[r][0, NV·kLanes) (+)= Σ_k A(r, k)·B[k][0, NV·kLanes) for r < R, A(r, k) = A[r·ar + k·ak]: R·NV sums in
// registers, each B vector read once for all R rows.
template <int R, int NV, bool Acc>
inline void micro(const float* A, int64_t ar, int64_t ak, const float* B, int64_t ldb, int64_t K, float* C,
                  int64_t ldc) {
  F acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = Acc ? load(C + r * ldc + v * kLanes) : zero();
  for (int64_t k = 0; k < K; ++k) {
    F b[NV];
    for (int v = 0; v < NV; ++v) b[v] = load(B + k * ldb + v * kLanes);
    for (int r = 0; r < R; ++r) {
      const F a = set1(A[r * ar + k * ak]);
      for (int v = 0; v < NV; ++v) acc[r][v] = fmadd(a, b[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) store(C + r * ldc + v * kLanes, acc[r][v]);
}

template <int R, int NV, bool Acc>
inline void micro_upto(int rows, const float* A, int64_t ar, int64_t ak, const float* B, int64_t ldb, int64_t K,
                       float* C, int64_t ldc) {
  if constexpr (R > 1) {
    if (rows < R) return micro_upto<R - 1, NV, Acc>(rows, A, ar, ak, B, ldb, K, C, ldc);
  }
  micro<R, NV, Acc>(A, ar, ak, B, ldb, K, C, ldc);
}

// C [M, N] (+)= A [M, K] · B [K, N], fp32, A strided as micro's, N a multiple of kLanes: column panels of 2·kLanes
// (B's panel stays in L1 while every row block passes over it).
template <bool Acc>
void gemm(const float* A, int64_t ar, int64_t ak, const float* B, int64_t ldb, float* C, int64_t ldc, int64_t M,
          int64_t N, int64_t K) {
  for (int64_t n = 0; n < N; n += 2 * kLanes) {
    const bool two = N - n >= 2 * kLanes;
    for (int64_t m = 0; m < M; m += kRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kRows, M - m));
      if (two)
        micro_upto<kRows, 2, Acc>(rows, A + m * ar, ar, ak, B + n, ldb, K, C + m * ldc + n, ldc);
      else
        micro_upto<kRows, 1, Acc>(rows, A + m * ar, ar, ak, B + n, ldb, K, C + m * ldc + n, ldc);
    }
  }
}

// Rows [s0, s0 + n) of one KV head's store X [cap][ld] as fp32 [n][D]: fp32 read in place, bf16 widened by vector
// loads into `out`, 8-bit rows (ld = D + 4, kv_int8.h) times their scale, rounded to T (the queries' dtype) as the
// torch path dequantizes them.
template <typename T>
inline const float* tile_fp32(const float* X, int64_t s0, int64_t, int64_t D, std::vector<float>&) {
  return X + s0 * D;
}
template <typename T>
inline const float* tile_fp32(const at::BFloat16* X, int64_t s0, int64_t n, int64_t D, std::vector<float>& out) {
  const auto* bits = reinterpret_cast<const uint16_t*>(X + s0 * D);
  for (int64_t i = 0; i < n * D; i += kLanes) store(out.data() + i, load_bf16(bits + i));
  return out.data();
}
template <typename T>
inline const float* tile_fp32(const int8_t* X, int64_t s0, int64_t n, int64_t D, std::vector<float>& out) {
  const int64_t ld = D + qwenrt::kScaleBytes;
  for (int64_t r = 0; r < n; ++r) {
    const int8_t* row = X + (s0 + r) * ld;
    const F scale = set1(qwenrt::row_scale(row, D));
    for (int64_t d = 0; d < D; d += kLanes) {
      const F x = mul(load_i8(row + d), scale);
      store(out.data() + r * D + d, std::is_same_v<T, at::BFloat16> ? round_bf16(x) : x);
    }
  }
  return out.data();
}

// One thread's scratch for the fp32-product path: query rows scaled and transposed [Dh][Mp] (Mp = rows rounded up
// to kLanes), scores and then probabilities transposed [kTile][Mp], the key and value tiles as fp32, outputs
// [Mp][Dh], per row its last visible key, running max, sum and rescale factor.
struct Scratch {
  std::vector<float> q, st, k, v, o, last, mx, sum, alpha;
  explicit Scratch(int64_t D)
      : q(kQueries * D), st(kTile * kQueries), k(kTile * D), v(kTile * D), o(kQueries * D), last(kQueries),
        mx(kQueries), sum(kQueries), alpha(kQueries) {}
};

// Rows of the block: m = (t - t0)·G + g is query head hk·G + g of token t, which sees keys [0, start + t]. Scores
// are computed transposed (keys the broadcast operand, the block's query rows the vector one), so that the online
// softmax runs kLanes rows per vector and no key tile is transposed.
// K, V: the stores [Hkv][cap][ld] of C (T, or 8-bit rows).
template <typename T, typename C>
void attend_block(const T* Q, const C* K, const C* V, T* O, int64_t H, int64_t G, int64_t cap, int64_t D,
                  int64_t start, int64_t t0, int64_t t1, int64_t hk, float scale, Scratch& w) {
  const int64_t ld = std::is_same_v<C, int8_t> ? D + qwenrt::kScaleBytes : D;
  const int64_t M = (t1 - t0) * G, Mp = (M + kLanes - 1) / kLanes * kLanes, end = start + t1;
  for (int64_t m = 0; m < Mp; ++m) {
    const int64_t t = std::min(t0 + m / G, t1 - 1), g = m % G;  // rows past M: copies of real ones, never output
    const T* src = Q + (t * H + hk * G + g) * D;
    for (int64_t d = 0; d < D; ++d) w.q[d * Mp + m] = static_cast<float>(src[d]) * scale;
    w.last[m] = static_cast<float>(start + t);
  }
  std::fill(w.o.begin(), w.o.begin() + Mp * D, 0.f);
  std::fill(w.mx.begin(), w.mx.end(), -INFINITY);
  std::fill(w.sum.begin(), w.sum.end(), 0.f);
  const F neg_inf = set1(-INFINITY), lowest = set1(std::numeric_limits<float>::lowest());
  for (int64_t s0 = 0; s0 < end; s0 += kTile) {
    const int64_t n = std::min(kTile, end - s0);
    const float* kf = tile_fp32<T>(K + hk * cap * ld, s0, n, D, w.k);
    const float* vf = tile_fp32<T>(V + hk * cap * ld, s0, n, D, w.v);
    gemm<false>(kf, D, 1, w.q.data(), Mp, w.st.data(), Mp, n, Mp, D);  // st [n][Mp] = keys · q
    for (int64_t c = 0; c < Mp; c += kLanes) {  // kLanes rows: mask, max; e^(s - max), sums; rescale factors
      const F last = load(w.last.data() + c), old = load(w.mx.data() + c);
      F top = old;
      for (int64_t j = 0; j < n; ++j) {
        float* x = w.st.data() + j * Mp + c;
        const F masked = select_above(set1(static_cast<float>(s0 + j)), last, load(x), neg_inf);
        store(x, masked);
        top = max(top, masked);
      }
      const F shift = select_above(lowest, top, top, zero());  // rows that see no key yet: p = 0 anyway
      F total = zero();
      for (int64_t j = 0; j < n; ++j) {
        float* x = w.st.data() + j * Mp + c;
        const F e = select_above(set1(static_cast<float>(s0 + j)), last, qwenrt::simd::exp(sub(load(x), shift)),
                                 zero());
        store(x, e);
        total = add(total, e);
      }
      const F alpha = qwenrt::simd::exp(sub(old, shift));  // e^-87 where old is -inf: times a zero sum and output
      store(w.sum.data() + c, fmadd(load(w.sum.data() + c), alpha, total));
      store(w.mx.data() + c, top);
      store(w.alpha.data() + c, alpha);
    }
    for (int64_t m = 0; m < M; ++m) {
      if (w.alpha[m] == 1.f) continue;
      float* o = w.o.data() + m * D;
      for (int64_t d = 0; d < D; d += kLanes) store(o + d, mul(load(o + d), set1(w.alpha[m])));
    }
    gemm<true>(w.st.data(), 1, Mp, vf, D, w.o.data(), D, M, D, n);  // o [M][Dh] += p [M][n] · values [n][Dh]
  }
  for (int64_t m = 0; m < M; ++m) {
    const float inv = 1.0f / w.sum[m];
    T* dst = O + ((t0 + m / G) * H + hk * G + m % G) * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(w.o[m * D + d] * inv);
  }
}

#if defined(__AVX512BF16__)
// C[r][0, 16·NV) (+)= Σ_k A(r, k)·B[k][0, 16·NV) for r < R: A(r, k) = A[r·ar + k·ak] a pair of bf16 (one uint32),
// B's row k 16·NV pairs [16·NV][2] bf16; vdpbf16ps adds each lane's two exact products in fp32.
template <int R, int NV, bool Acc>
inline void micro_bf16(const uint32_t* A, int64_t ar, int64_t ak, const uint16_t* B, int64_t ldb, int64_t K,
                       float* C, int64_t ldc) {
  __m512 acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = Acc ? _mm512_loadu_ps(C + r * ldc + 16 * v) : _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512bh b[NV];
    for (int v = 0; v < NV; ++v) b[v] = (__m512bh)_mm512_loadu_si512(B + (k * ldb + 16 * v) * 2);
    for (int r = 0; r < R; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(A[r * ar + k * ak]));
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], b[v], a);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(C + r * ldc + 16 * v, acc[r][v]);
}

template <int R, int NV, bool Acc>
inline void micro_bf16_upto(int rows, const uint32_t* A, int64_t ar, int64_t ak, const uint16_t* B, int64_t ldb,
                            int64_t K, float* C, int64_t ldc) {
  if constexpr (R > 1) {
    if (rows < R) return micro_bf16_upto<R - 1, NV, Acc>(rows, A, ar, ak, B, ldb, K, C, ldc);
  }
  micro_bf16<R, NV, Acc>(A, ar, ak, B, ldb, K, C, ldc);
}

// C [M, N] (+)= A [M, K pairs] · B [K pairs, N] (A strided as micro_bf16's), N a multiple of 16.
template <bool Acc>
void gemm_bf16(const uint32_t* A, int64_t ar, int64_t ak, const uint16_t* B, int64_t ldb, float* C, int64_t ldc,
               int64_t M, int64_t N, int64_t K) {
  for (int64_t n = 0; n < N; n += 32) {
    const bool two = N - n >= 32;
    for (int64_t m = 0; m < M; m += kRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kRows, M - m));
      if (two)
        micro_bf16_upto<kRows, 2, Acc>(rows, A + m * ar, ar, ak, B + 2 * n, ldb, K, C + m * ldc + n, ldc);
      else
        micro_bf16_upto<kRows, 1, Acc>(rows, A + m * ar, ar, ak, B + 2 * n, ldb, K, C + m * ldc + n, ldc);
    }
  }
}

// 16 lanes of x and of y (fp32) rounded to bf16 and interleaved: (x[i], y[i]) pairs, 32 bf16.
inline __m512i pairs_bf16(__m512 x, __m512 y) {
  alignas(64) static constexpr uint16_t idx[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                   8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  return _mm512_permutexvar_epi16(_mm512_load_si512(idx), (__m512i)_mm512_cvtne2ps_pbh(y, x));
}

// rows a, b [D] bf16 -> out [D][2]: the (a[d], b[d]) pairs, 32 columns per pair of vpermt2w.
inline void interleave_rows(const uint16_t* a, const uint16_t* b, int64_t D, uint16_t* out) {
  alignas(64) static constexpr uint16_t lo_idx[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                      8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i lo = _mm512_load_si512(lo_idx), hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  for (int64_t d = 0; d < D; d += 32) {  // D a multiple of 16: the last 16 columns through masked loads
    const __mmask32 in = D - d >= 32 ? ~__mmask32{0} : __mmask32{0xFFFF};
    const __m512i x = _mm512_maskz_loadu_epi16(in, a + d), y = _mm512_maskz_loadu_epi16(in, b + d);
    _mm512_storeu_si512(out + 2 * d, _mm512_permutex2var_epi16(x, lo, y));
    if (D - d >= 32) _mm512_storeu_si512(out + 2 * d + 32, _mm512_permutex2var_epi16(x, hi, y));
  }
}

// The bf16-product path's scratch: query rows as [Dh/2][Mp][2] (Mp = rows rounded up to 16), scores transposed
// [kTile][Mp], probabilities as [kTile/2][Mp][2], the value tile as [kTile/2][Dh][2], outputs [Mp][Dh] fp32, per row
// its last visible key, running max, sum and rescale factor.
struct ScratchBf16 {
  std::vector<uint16_t> q, p, v, zeros, k_rows, v_rows;
  std::vector<float> st, o, last, mx, sum, alpha;
  explicit ScratchBf16(int64_t D)
      : q(kQueries * D), p(kTile * kQueries), v(kTile * D), zeros(D), k_rows(kTile * D), v_rows(kTile * D),
        st(kTile * kQueries), o(kQueries * D), last(kQueries), mx(kQueries), sum(kQueries), alpha(kQueries) {}
};

// Rows [s0, s0 + n) of one KV head's store X [cap][ld] as bf16 rows [n][D]: a bf16 store in place, 8-bit rows
// (kv_int8.h) times their scale, rounded to bf16 (to nearest even, as torch's .to(bfloat16)) into `out`.
inline const uint16_t* tile_bf16(const uint16_t* X, int64_t s0, int64_t, int64_t D, std::vector<uint16_t>&) {
  return X + s0 * D;
}
inline const uint16_t* tile_bf16(const int8_t* X, int64_t s0, int64_t n, int64_t D, std::vector<uint16_t>& out) {
  const int64_t ld = D + qwenrt::kScaleBytes;
  for (int64_t r = 0; r < n; ++r) {
    const int8_t* row = X + (s0 + r) * ld;
    const __m512 scale = _mm512_set1_ps(qwenrt::row_scale(row, D));
    for (int64_t d = 0; d < D; d += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.data() + r * D + d),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(load_i8(row + d), scale)));
  }
  return out.data();
}

// attend_block with vdpbf16ps products, the softmax 16 rows at a time: scores are computed transposed (keys as
// the broadcast operand, read in place from a bf16 store as (d, d + 1) pairs; the query rows, packed once per
// block, as the vector operand), so no key tile is repacked; the probabilities are rounded to bf16 for P·V, as
// torch's bf16 attention rounds them.
// K, V: the stores [Hkv][cap][ld] of C (bf16 bits, or 8-bit rows).
template <typename C>
void attend_block_bf16(const uint16_t* Q, const C* K, const C* V, at::BFloat16* O, int64_t H, int64_t G,
                       int64_t cap, int64_t D, int64_t start, int64_t t0, int64_t t1, int64_t hk, float scale,
                       ScratchBf16& w) {
  const int64_t M = (t1 - t0) * G, Mp = (M + 15) / 16 * 16, end = start + t1;
  auto* q32 = reinterpret_cast<uint32_t*>(w.q.data());
  for (int64_t m = 0; m < Mp; ++m) {
    const int64_t t = std::min(t0 + m / G, t1 - 1), g = m % G;  // rows past M: copies of real ones, never output
    const auto* src = reinterpret_cast<const uint32_t*>(Q + (t * H + hk * G + g) * D);
    for (int64_t p = 0; p < D / 2; ++p) q32[p * Mp + m] = src[p];
    w.last[m] = static_cast<float>(start + t);
  }
  std::fill(w.o.begin(), w.o.begin() + Mp * D, 0.f);
  std::fill(w.mx.begin(), w.mx.end(), -INFINITY);
  std::fill(w.sum.begin(), w.sum.end(), 0.f);
  const int64_t ld = std::is_same_v<C, int8_t> ? D + qwenrt::kScaleBytes : D;
  const C* k = K + hk * cap * ld;
  const C* v = V + hk * cap * ld;
  const __m512 neg_inf = _mm512_set1_ps(-INFINITY), vscale = _mm512_set1_ps(scale);
  for (int64_t s0 = 0; s0 < end; s0 += kTile) {
    const int64_t n = std::min(kTile, end - s0), pairs = (n + 1) / 2;
    const uint16_t* kt = tile_bf16(k, s0, n, D, w.k_rows);  // [n][Dh]
    const uint16_t* vt = tile_bf16(v, s0, n, D, w.v_rows);
    // st [n][Mp] = keys [n][Dh] · q
    gemm_bf16<false>(reinterpret_cast<const uint32_t*>(kt), D / 2, 1, w.q.data(), Mp, w.st.data(), Mp, n, Mp,
                     D / 2);
    for (int64_t j = 0; j < pairs; ++j)
      interleave_rows(vt + 2 * j * D, 2 * j + 1 < n ? vt + (2 * j + 1) * D : w.zeros.data(), D,
                      w.v.data() + 2 * j * D);
    for (int64_t c = 0; c < Mp; c += 16) {  // 16 rows: scale, mask, max; e^(s - max), sums; rescale factors
      const __m512 last = _mm512_loadu_ps(w.last.data() + c), old = _mm512_loadu_ps(w.mx.data() + c);
      __m512 top = old;
      for (int64_t j = 0; j < n; ++j) {
        const __mmask16 seen = _mm512_cmp_ps_mask(_mm512_set1_ps(static_cast<float>(s0 + j)), last, _CMP_LE_OQ);
        const __m512 x = _mm512_mask_blend_ps(seen, neg_inf, _mm512_mul_ps(_mm512_loadu_ps(w.st.data() + j * Mp + c),
                                                                          vscale));
        _mm512_storeu_ps(w.st.data() + j * Mp + c, x);
        top = _mm512_max_ps(top, x);
      }
      const __m512 shift = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(top, neg_inf, _CMP_EQ_OQ), top,
                                                _mm512_setzero_ps());  // rows that see no key yet: p = 0 anyway
      __m512 total = _mm512_setzero_ps();
      auto prob = [&](int64_t j) {
        if (j >= n) return _mm512_setzero_ps();
        const __m512 x = _mm512_loadu_ps(w.st.data() + j * Mp + c);
        const __m512 e = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, neg_inf, _CMP_NEQ_OQ),
                                             qwenrt::simd::exp(_mm512_sub_ps(x, shift)));
        total = _mm512_add_ps(total, e);
        return e;
      };
      for (int64_t j = 0; j < pairs; ++j) {
        const __m512 e0 = prob(2 * j), e1 = prob(2 * j + 1);
        _mm512_storeu_si512(w.p.data() + (j * Mp + c) * 2, pairs_bf16(e0, e1));
      }
      const __m512 alpha = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(old, neg_inf, _CMP_NEQ_OQ),
                                               qwenrt::simd::exp(_mm512_sub_ps(old, shift)));
      _mm512_storeu_ps(w.sum.data() + c, _mm512_fmadd_ps(_mm512_loadu_ps(w.sum.data() + c), alpha, total));
      _mm512_storeu_ps(w.mx.data() + c, top);
      _mm512_storeu_ps(w.alpha.data() + c, alpha);
    }
    for (int64_t m = 0; m < M; ++m) {
      if (w.alpha[m] == 1.f) continue;
      float* o = w.o.data() + m * D;
      const __m512 a = _mm512_set1_ps(w.alpha[m]);
      for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(o + d, _mm512_mul_ps(_mm512_loadu_ps(o + d), a));
    }
    // o [M][Dh] += p [M][n] · values [n][Dh]
    gemm_bf16<true>(reinterpret_cast<const uint32_t*>(w.p.data()), 1, Mp, w.v.data(), D, w.o.data(), D, M, D,
                    pairs);
  }
  for (int64_t m = 0; m < M; ++m) {
    const float inv = 1.0f / w.sum[m];
    at::BFloat16* dst = O + ((t0 + m / G) * H + hk * G + m % G) * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<at::BFloat16>(w.o[m * D + d] * inv);
  }
}
#endif

template <typename T, typename C>
void attend(const T* Q, const C* K, const C* V, T* O, int64_t Tq, int64_t H, int64_t Hkv, int64_t cap, int64_t D,
            int64_t start) {
  const int64_t G = H / Hkv, tokens = std::max<int64_t>(1, kQueries / G), blocks = (Tq + tokens - 1) / tokens;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  // units (block, KV head), blocks ordered first, last, second, second last, ...: a thread's run of units mixes
  // the short early rows with the long late ones
  const int64_t work = 2 * std::min(kQueries, Tq * G) * D * (start + (Tq + 1) / 2);
  qwenrt::parallel_for_work(0, blocks * Hkv, work, [&](int64_t u0, int64_t u1) {
    auto unit = [&](int64_t u, auto&& run) {
      const int64_t i = u / Hkv, hk = u % Hkv, b = i % 2 == 0 ? i / 2 : blocks - 1 - i / 2;
      run(b * tokens, std::min(Tq, (b + 1) * tokens), hk);
    };
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<T, at::BFloat16>) {  // bf16 or 8-bit stores
      ScratchBf16 w(D);
      using Rows = std::conditional_t<std::is_same_v<C, int8_t>, int8_t, uint16_t>;
      const auto* q = reinterpret_cast<const uint16_t*>(Q);
      const auto* k = reinterpret_cast<const Rows*>(K);
      const auto* v = reinterpret_cast<const Rows*>(V);
      for (int64_t u = u0; u < u1; ++u)
        unit(u, [&](int64_t t0, int64_t t1, int64_t hk) {
          attend_block_bf16(q, k, v, O, H, G, cap, D, start, t0, t1, hk, scale, w);
        });
      return;
    }
#endif
    Scratch w(D);
    for (int64_t u = u0; u < u1; ++u)
      unit(u, [&](int64_t t0, int64_t t1, int64_t hk) {
        attend_block(Q, K, V, O, H, G, cap, D, start, t0, t1, hk, scale, w);
      });
  });
}

}  // namespace

// Causal attention of q [T, H, Dh] (tokens start..start+T-1 of a sequence, normed and rotated) over the sequence's
// stores keys, values [1, Hkv, cap, Dh] (or [Hkv, cap, Dh]) holding its first start + T tokens; row t sees keys
// 0..start+t. Grouped-query (head h reads KV head h / (H / Hkv)), scale Dh^-0.5, softmax in fp32.
// bf16 or fp32, the stores q's dtype or 8-bit ([.., cap, Dh + 4] int8, kv_int8.h). Returns [T, H, Dh].
at::Tensor attention_prefill(at::Tensor q, at::Tensor keys, at::Tensor values, int64_t start) {
  for (auto* t : {&q, &keys, &values})
    TORCH_CHECK(t->is_contiguous(), "attention_prefill: contiguous inputs only");
  const auto T = q.scalar_type();
  const bool int8 = keys.scalar_type() == at::kChar;
  TORCH_CHECK((T == at::kBFloat16 || T == at::kFloat) && (keys.scalar_type() == T || int8) &&
              values.scalar_type() == keys.scalar_type(),
              "attention_prefill: q bf16 or fp32, keys and values q's dtype or int8");
  TORCH_CHECK(q.dim() == 3 && (keys.dim() == 3 || (keys.dim() == 4 && keys.size(0) == 1)) &&
              values.sizes() == keys.sizes(), "attention_prefill: shapes");
  const int64_t Tq = q.size(0), H = q.size(1), D = q.size(2), Hkv = keys.size(-3), cap = keys.size(-2);
  TORCH_CHECK(keys.size(-1) == D + (int8 ? qwenrt::kScaleBytes : 0) && Hkv > 0 && H % Hkv == 0 &&
              H / Hkv <= kQueries && D % 16 == 0 && D <= kMaxD && start >= 0 && start + Tq <= cap,
              "attention_prefill: q [T, H, Dh], keys [Hkv, cap, Dh] (Dh + 4 int8) with H % Hkv == 0, H / Hkv <= 64, "
              "Dh a multiple of 16, start + T <= cap");
  auto out = at::empty({Tq, H, D}, q.options());
  if (Tq == 0) return out;
  auto run = [&](auto* q_, auto* k) {
    using E = std::remove_pointer_t<decltype(q_)>;
    using C = std::remove_pointer_t<decltype(k)>;
    attend(q_, k, values.data_ptr<C>(), out.data_ptr<E>(), Tq, H, Hkv, cap, D, start);
  };
  if (T == at::kBFloat16) {
    auto* q_ = q.data_ptr<at::BFloat16>();
    int8 ? run(q_, keys.data_ptr<int8_t>()) : run(q_, keys.data_ptr<at::BFloat16>());
  } else {
    auto* q_ = q.data_ptr<float>();
    int8 ? run(q_, keys.data_ptr<int8_t>()) : run(q_, keys.data_ptr<float>());
  }
  return out;
}
