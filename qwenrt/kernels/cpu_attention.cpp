// A gated full-attention layer's decode step after its projections, in one call: q/k RMSNorm, partial RoPE, the new
// key/value written into the cache, softmax attention of one query per sequence over the cached keys (grouped-query)
// and the sigmoid output gate. torch's CPU attention copies every cached key (the prefix of a cache row is not
// contiguous across heads) and took ~14 ms per layer at 8K keys; this reads each cached key and value once, in fp32.
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

// Queries Q [B, H, D] over stores Kc, Vc [B or 1, Hkv, cap, ld] of C: T itself (ld = D), or int8 rows with their
// scale (ld = D + 4): a key's scale multiplies its scores, a value's its probabilities.
template <typename T, typename C>
void attend(const T* Q, const C* Kc, const C* Vc, const int64_t* valid, T* O, int64_t B, int64_t H, int64_t Hkv,
            int64_t cap, int64_t D, bool shared, float scale) {
  constexpr bool kInt8 = std::is_same_v<C, int8_t>;
  const int64_t G = H / Hkv, longest = *std::max_element(valid, valid + B), ld = kInt8 ? D + qwenrt::kScaleBytes : D;
  // per (row, KV head): its G queries' scores and weighted values over up to `longest` keys
  qwenrt::parallel_for_work(0, B * Hkv, 2 * G * D * longest, [&](int64_t i0, int64_t i1) {
    std::vector<float> q(G * D), acc(G * D), p;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / Hkv, hk = i % Hkv, S = valid[b], kv = shared ? hk : i;
      const C* k = Kc + kv * cap * ld;
      const C* v = Vc + kv * cap * ld;
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) q[g * D + d] = static_cast<float>(Q[(b * H + hk * G + g) * D + d]) * scale;
      p.resize(G * S);
      by_head_block(G, [&](auto gb, int64_t g0) {
        scores<decltype(gb)::value>(q.data(), k, D, ld, S, g0, p.data());
      });
      if constexpr (kInt8) {
        for (int64_t s = 0; s < S; ++s) {
          const float ks = qwenrt::row_scale(k + s * ld, D);
          for (int64_t g = 0; g < G; ++g) p[g * S + s] *= ks;
        }
      }
      for (int64_t g = 0; g < G; ++g) {  // softmax over the S keys
        float* pg = p.data() + g * S;
        float mx = -INFINITY;
        for (int64_t s = 0; s < S; ++s) mx = std::max(mx, pg[s]);
        F sum = zero();
        int64_t s = 0;
        for (; s + kLanes <= S; s += kLanes) {
          const F e = qwenrt::simd::exp(sub(load(pg + s), set1(mx)));
          store(pg + s, e);
          sum = add(sum, e);
        }
        float total = reduce_add(sum);
        if (s < S) {  // the last S % kLanes scores, through the same vector exp
          alignas(64) float tail[kLanes] = {};
          std::copy(pg + s, pg + S, tail);
          store(tail, qwenrt::simd::exp(sub(load(tail), set1(mx))));
          for (int64_t t = s; t < S; ++t) total += (pg[t] = tail[t - s]);
        }
        const float inv = 1.0f / total;
        if constexpr (kInt8) {
          for (int64_t t = 0; t < S; ++t) pg[t] *= inv * qwenrt::row_scale(v + t * ld, D);
        } else {
          for (int64_t t = 0; t < S; ++t) pg[t] *= inv;
        }
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      by_head_block(G, [&](auto gb, int64_t g0) {
        weighted_values<decltype(gb)::value>(p.data(), v, D, ld, S, g0, acc.data());
      });
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) O[(b * H + hk * G + g) * D + d] = static_cast<T>(acc[g * D + d]);
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
