// Causal attention of a prefill chunk against one sequence's KV store, flash-style: keys and values are read in tiles
// of kTile, each row keeps a running max and sum of its exponentials (online softmax, fp32) and its output in fp32,
// so the memory per call is O(rows × kTile + kTile × Dh) per thread whatever the context. torch's SDPA with a [T, S]
// mask held the mask and (on its math path) the [H, T, S] scores.
// Work: (KV head, block of ~kQueries / G tokens); each block's G·tokens query rows share every key tile, packed once
// into fp32 (keys transposed) and multiplied by an fp32 register-tiled product (both Q·Kᵀ and P·V have its form).
// With AVX-512 BF16 and bf16 stores the scores are vdpbf16ps products instead (exact products, fp32 sums).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "parallel.h"
#include "simd.h"

namespace {

using namespace qwenrt::simd;

constexpr int64_t kTile = 64;      // keys per tile (a multiple of 2·kLanes at every level)
constexpr int64_t kQueries = 64;   // query rows per work unit: tokens × the G query heads of one KV head
constexpr int kRows = std::min(8, (kRegisters - 3) / 2);  // rows per register tile: 2·kRows accumulators
constexpr int64_t kMaxD = 512;

// C[r][0, NV·kLanes) (+)= Σ_k A[r][k]·B[k][0, NV·kLanes) for r < R: R·NV sums in registers, each B vector read once
// for all R rows.
template <int R, int NV, bool Acc>
inline void micro(const float* A, int64_t lda, const float* B, int64_t ldb, int64_t K, float* C, int64_t ldc) {
  F acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = Acc ? load(C + r * ldc + v * kLanes) : zero();
  for (int64_t k = 0; k < K; ++k) {
    F b[NV];
    for (int v = 0; v < NV; ++v) b[v] = load(B + k * ldb + v * kLanes);
    for (int r = 0; r < R; ++r) {
      const F a = set1(A[r * lda + k]);
      for (int v = 0; v < NV; ++v) acc[r][v] = fmadd(a, b[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) store(C + r * ldc + v * kLanes, acc[r][v]);
}

template <int R, int NV, bool Acc>
inline void micro_upto(int rows, const float* A, int64_t lda, const float* B, int64_t ldb, int64_t K, float* C,
                       int64_t ldc) {
  if constexpr (R > 1) {
    if (rows < R) return micro_upto<R - 1, NV, Acc>(rows, A, lda, B, ldb, K, C, ldc);
  }
  micro<R, NV, Acc>(A, lda, B, ldb, K, C, ldc);
}

// C [M, N] (+)= A [M, K] · B [K, N], all fp32 row-major, N a multiple of kLanes: column panels of 2·kLanes (B's
// panel stays in L1 while every row block passes over it).
template <bool Acc>
void gemm(const float* A, int64_t lda, const float* B, int64_t ldb, float* C, int64_t ldc, int64_t M, int64_t N,
          int64_t K) {
  for (int64_t n = 0; n < N; n += 2 * kLanes) {
    const bool two = N - n >= 2 * kLanes;
    for (int64_t m = 0; m < M; m += kRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kRows, M - m));
      if (two)
        micro_upto<kRows, 2, Acc>(rows, A + m * lda, lda, B + n, ldb, K, C + m * ldc + n, ldc);
      else
        micro_upto<kRows, 1, Acc>(rows, A + m * lda, lda, B + n, ldb, K, C + m * ldc + n, ldc);
    }
  }
}

#if defined(__AVX512BF16__)
// s [M, kTile] = q [M, D] (bf16 pairs, as int32) · keys packed [D/2][kTile][2] bf16: vdpbf16ps sums a pair of exact
// bf16 products into fp32 per lane, 16 keys per vector; rows of 8 × 2 vectors of keys in registers.
template <int R>
inline void scores_bf16_rows(const uint32_t* q, int64_t D, const uint16_t* kt, float* s) {
  for (int64_t n = 0; n < kTile; n += 32) {
    __m512 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t p = 0; p < D / 2; ++p) {
      const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kt + (p * kTile + n) * 2);
      const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kt + (p * kTile + n + 16) * 2);
      for (int r = 0; r < R; ++r) {
        const __m512bh qp = (__m512bh)_mm512_set1_epi32(static_cast<int>(q[r * D / 2 + p]));
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], k0, qp);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], k1, qp);
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm512_storeu_ps(s + r * kTile + n, acc[r][0]);
      _mm512_storeu_ps(s + r * kTile + n + 16, acc[r][1]);
    }
  }
}

template <int R>
inline void scores_bf16_upto(int rows, const uint32_t* q, int64_t D, const uint16_t* kt, float* s) {
  if constexpr (R > 1) {
    if (rows < R) return scores_bf16_upto<R - 1>(rows, q, D, kt, s);
  }
  scores_bf16_rows<R>(q, D, kt, s);
}
constexpr bool kDotBf16 = true;
#else
constexpr bool kDotBf16 = false;
#endif

// One thread's scratch: query rows and their outputs, a tile of scores, the key tile (transposed) and value tile.
struct Scratch {
  std::vector<float> q, o, s, kt, vt, mx, sum;
  std::vector<uint16_t> qb, ktb;  // the bf16-product path's query rows and key pairs
  explicit Scratch(int64_t D)
      : q(kQueries * D), o(kQueries * D), s(kQueries * kTile), kt(D * kTile), vt(kTile * D), mx(kQueries),
        sum(kQueries), qb(kQueries * D), ktb(D * kTile) {}
};

// Rows of the block: m = (t - t0)·G + g is query head hk·G + g of token t, which sees keys [0, start + t].
template <typename T>
void attend_block(const T* Q, const T* K, const T* V, T* O, int64_t H, int64_t G, int64_t cap, int64_t D,
                  int64_t start, int64_t t0, int64_t t1, int64_t hk, float scale, Scratch& w) {
  constexpr bool dot_bf16 = kDotBf16 && std::is_same_v<T, at::BFloat16>;
  const int64_t M = (t1 - t0) * G, end = start + t1;
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t g = 0; g < G; ++g) {
      const T* src = Q + (t * H + hk * G + g) * D;
      const int64_t m = (t - t0) * G + g;
      if constexpr (dot_bf16) std::copy(reinterpret_cast<const uint16_t*>(src),
                                        reinterpret_cast<const uint16_t*>(src) + D, w.qb.data() + m * D);
      else for (int64_t d = 0; d < D; ++d) w.q[m * D + d] = static_cast<float>(src[d]) * scale;
    }
  std::fill(w.o.begin(), w.o.begin() + M * D, 0.f);
  std::fill(w.mx.begin(), w.mx.end(), -INFINITY);
  std::fill(w.sum.begin(), w.sum.end(), 0.f);
  const T* k = K + hk * cap * D;
  const T* v = V + hk * cap * D;
  for (int64_t s0 = 0; s0 < end; s0 += kTile) {
    const int64_t n = std::min(kTile, end - s0);
    if constexpr (dot_bf16) {
#if defined(__AVX512BF16__)
      const auto* kb = reinterpret_cast<const uint16_t*>(k + s0 * D);
      if (n < kTile) std::fill(w.ktb.begin(), w.ktb.end(), 0);
      for (int64_t j = 0; j < n; ++j)
        for (int64_t p = 0; p < D / 2; ++p) {
          w.ktb[(p * kTile + j) * 2] = kb[j * D + 2 * p];
          w.ktb[(p * kTile + j) * 2 + 1] = kb[j * D + 2 * p + 1];
        }
      const auto* qp = reinterpret_cast<const uint32_t*>(w.qb.data());
      for (int64_t m = 0; m < M; m += kRows)
        scores_bf16_upto<kRows>(static_cast<int>(std::min<int64_t>(kRows, M - m)), qp + m * D / 2, D,
                                w.ktb.data(), w.s.data() + m * kTile);
#endif
    } else {
      if (n < kTile) std::fill(w.kt.begin(), w.kt.end(), 0.f);
      for (int64_t j = 0; j < n; ++j)
        for (int64_t d = 0; d < D; ++d) w.kt[d * kTile + j] = static_cast<float>(k[(s0 + j) * D + d]);
      gemm<false>(w.q.data(), D, w.kt.data(), kTile, w.s.data(), kTile, M, kTile, D);
    }
    const float* vb;
    if constexpr (std::is_same_v<T, float>) {
      vb = v + s0 * D;
    } else {
      for (int64_t i = 0; i < n * D; ++i) w.vt[i] = static_cast<float>(v[s0 * D + i]);
      vb = w.vt.data();
    }
    for (int64_t m = 0; m < M; ++m) {  // online softmax: p = e^(s - new max), earlier sums and outputs rescaled
      float* p = w.s.data() + m * kTile;
      const int64_t valid = std::clamp<int64_t>(start + t0 + m / G + 1 - s0, 0, n);
      if (dot_bf16)
        for (int64_t j = 0; j < valid; ++j) p[j] *= scale;
      float top = w.mx[m];
      for (int64_t j = 0; j < valid; ++j) top = std::max(top, p[j]);
      const F shift = set1(top);
      for (int64_t j = 0; j < kTile; j += kLanes) store(p + j, qwenrt::simd::exp(sub(load(p + j), shift)));
      std::fill(p + valid, p + kTile, 0.f);
      if (valid == 0) continue;
      float total = 0.f;
      for (int64_t j = 0; j < valid; ++j) total += p[j];
      const float alpha = std::exp(w.mx[m] - top);  // 0 at the first tile (max -inf)
      w.sum[m] = w.sum[m] * alpha + total;
      w.mx[m] = top;
      if (alpha != 1.f) {
        float* o = w.o.data() + m * D;
        const F a = set1(alpha);
        for (int64_t d = 0; d < D; d += kLanes) store(o + d, mul(load(o + d), a));
      }
    }
    gemm<true>(w.s.data(), kTile, vb, D, w.o.data(), D, M, D, n);
  }
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t m = (t - t0) * G + g;
      const float inv = 1.0f / w.sum[m];
      T* dst = O + (t * H + hk * G + g) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(w.o[m * D + d] * inv);
    }
}

template <typename T>
void attend(const T* Q, const T* K, const T* V, T* O, int64_t Tq, int64_t H, int64_t Hkv, int64_t cap, int64_t D,
            int64_t start) {
  const int64_t G = H / Hkv, tokens = std::max<int64_t>(1, kQueries / G), blocks = (Tq + tokens - 1) / tokens;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  // units (block, KV head), blocks ordered first, last, second, second last, ...: a thread's run of units mixes
  // the short early rows with the long late ones
  const int64_t work = 2 * std::min(kQueries, Tq * G) * D * (start + (Tq + 1) / 2);
  qwenrt::parallel_for_work(0, blocks * Hkv, work, [&](int64_t u0, int64_t u1) {
    Scratch w(D);
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t i = u / Hkv, hk = u % Hkv, b = i % 2 == 0 ? i / 2 : blocks - 1 - i / 2;
      attend_block(Q, K, V, O, H, G, cap, D, start, b * tokens, std::min(Tq, (b + 1) * tokens), hk, scale, w);
    }
  });
}

}  // namespace

// Causal attention of q [T, H, Dh] (tokens start..start+T-1 of a sequence, normed and rotated) over the sequence's
// stores keys, values [1, Hkv, cap, Dh] (or [Hkv, cap, Dh]) holding its first start + T tokens; row t sees keys
// 0..start+t. Grouped-query (head h reads KV head h / (H / Hkv)), scale Dh^-0.5, softmax in fp32.
// bf16 or fp32, all one dtype. Returns [T, H, Dh].
at::Tensor attention_prefill(at::Tensor q, at::Tensor keys, at::Tensor values, int64_t start) {
  for (auto* t : {&q, &keys, &values})
    TORCH_CHECK(t->is_contiguous(), "attention_prefill: contiguous inputs only");
  const auto T = q.scalar_type();
  TORCH_CHECK((T == at::kBFloat16 || T == at::kFloat) && keys.scalar_type() == T && values.scalar_type() == T,
              "attention_prefill: q, keys and values must be one dtype, bf16 or fp32");
  TORCH_CHECK(q.dim() == 3 && (keys.dim() == 3 || (keys.dim() == 4 && keys.size(0) == 1)) &&
              values.sizes() == keys.sizes(), "attention_prefill: shapes");
  const int64_t Tq = q.size(0), H = q.size(1), D = q.size(2), Hkv = keys.size(-3), cap = keys.size(-2);
  TORCH_CHECK(keys.size(-1) == D && Hkv > 0 && H % Hkv == 0 && D % 16 == 0 && D <= kMaxD &&
              start >= 0 && start + Tq <= cap,
              "attention_prefill: q [T, H, Dh], keys [Hkv, cap, Dh] with H % Hkv == 0, Dh a multiple of 16, "
              "start + T <= cap");
  auto out = at::empty({Tq, H, D}, q.options());
  if (Tq == 0) return out;
  if (T == at::kBFloat16) {
    using E = at::BFloat16;
    attend(q.data_ptr<E>(), keys.data_ptr<E>(), values.data_ptr<E>(), out.data_ptr<E>(), Tq, H, Hkv, cap, D, start);
  } else {
    attend(q.data_ptr<float>(), keys.data_ptr<float>(), values.data_ptr<float>(), out.data_ptr<float>(), Tq, H, Hkv,
           cap, D, start);
  }
  return out;
}
