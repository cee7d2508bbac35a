// One decode step of a Gated DeltaNet layer, fused: causal conv update + SiLU, q/k L2 norm, the gated delta rule
// on the fp32 state (updated in place), and the gated RMSNorm of the output. Mirrors qwenrt/deltanet.py, whose
// torch path is the reference (tests/test_kernels.py holds the two together).
#include <ATen/core/Tensor.h>
#include "kernels.h"
#include "parallel.h"
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace {

inline float round_bf16(float x) {  // round-to-nearest-even to bfloat16, as torch casts
  return static_cast<float>(c10::BFloat16(x));
}
inline float silu(float x) { return x / (1.0f + std::exp(-x)); }
inline float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }

struct Floats {  // read-only fp32 view of a bf16 or fp32 tensor
  const void* p;
  bool bf16;
  explicit Floats(const at::Tensor& t) : p(t.data_ptr()), bf16(t.scalar_type() == at::kBFloat16) {}
  float operator[](int64_t i) const {
    return bf16 ? static_cast<float>(static_cast<const at::BFloat16*>(p)[i]) : static_cast<const float*>(p)[i];
  }
};


// The gated delta rule for one head on its state s [Dk, Dv]: S ← decay·S; u = Sᵀk; δ = β(v − u); S ← S + kδᵀ;
// o = Sᵀq. Columns are independent: NV vectors of them at a time, u and o held in registers (s, v, o point at the
// first column; rows of s are Dv apart).
template <int NV>
void delta_rule_columns(float* s, const float* k, const float* q, const float* v, float decay, float beta,
                        int64_t Dk, int64_t Dv, float* o) {
  using namespace qwenrt::simd;
  F acc[NV];
  const F dec = set1(decay);
  for (int c = 0; c < NV; ++c) acc[c] = zero();
  for (int64_t i = 0; i < Dk; ++i) {  // decay the state; u = Sᵀk
    float* si = s + i * Dv;
    const F ki = set1(k[i]);
    for (int c = 0; c < NV; ++c) {
      const F sv = mul(load(si + kLanes * c), dec);
      store(si + kLanes * c, sv);
      acc[c] = fmadd(sv, ki, acc[c]);
    }
  }
  F delta[NV];
  for (int c = 0; c < NV; ++c) delta[c] = mul(set1(beta), sub(load(v + kLanes * c), acc[c]));
  for (int c = 0; c < NV; ++c) acc[c] = zero();
  for (int64_t i = 0; i < Dk; ++i) {  // S += k·δᵀ; o = Sᵀq
    float* si = s + i * Dv;
    const F ki = set1(k[i]), qi = set1(q[i]);
    for (int c = 0; c < NV; ++c) {
      const F sv = fmadd(ki, delta[c], load(si + kLanes * c));
      store(si + kLanes * c, sv);
      acc[c] = fmadd(sv, qi, acc[c]);
    }
  }
  for (int c = 0; c < NV; ++c) store(o + kLanes * c, acc[c]);
}

// The same for the last Dv % kLanes columns [j0, Dv), in plain loops; u is scratch [Dv].
void delta_rule_tail(float* s, const float* k, const float* q, const float* v, float decay, float beta, int64_t Dk,
                     int64_t Dv, int64_t j0, float* u, float* o) {
  std::fill(u + j0, u + Dv, 0.f);
  for (int64_t i = 0; i < Dk; ++i) {
    float* si = s + i * Dv;
    for (int64_t j = j0; j < Dv; ++j) { si[j] *= decay; u[j] += si[j] * k[i]; }
  }
  for (int64_t j = j0; j < Dv; ++j) u[j] = beta * (v[j] - u[j]);
  std::fill(o + j0, o + Dv, 0.f);
  for (int64_t i = 0; i < Dk; ++i) {
    float* si = s + i * Dv;
    for (int64_t j = j0; j < Dv; ++j) { si[j] += k[i] * u[j]; o[j] += si[j] * q[i]; }
  }
}

void delta_rule_step(float* s, const float* k, const float* q, const float* v, float decay, float beta, int64_t Dk,
                     int64_t Dv, float* u, float* o) {
  using qwenrt::simd::kLanes;
  constexpr int kBlock = qwenrt::simd::kRegisters / 4;  // u and δ (2·kBlock vectors) stay in registers
  int64_t j = 0;
  for (; j + kBlock * kLanes <= Dv; j += kBlock * kLanes)
    delta_rule_columns<kBlock>(s + j, k, q, v + j, decay, beta, Dk, Dv, o + j);
  for (; j + kLanes <= Dv; j += kLanes) delta_rule_columns<1>(s + j, k, q, v + j, decay, beta, Dk, Dv, o + j);
  if (j < Dv) delta_rule_tail(s, k, q, v, decay, beta, Dk, Dv, j, u, o);
}

}  // namespace

// mixed [B, C] (in_proj_qkv output), conv_state [B, C, K-1] fp32 (in place), conv_w [C, K] fp32, a, b [B, Hv],
// A_log, dt_bias [Hv] fp32, state [B, Hv, Dk, Dv] fp32 (in place), z [B, Hv, Dv], norm_w [Dv] fp32
// -> out [B, Hv·Dv] (gated RMSNorm applied). The projections mixed, a, b, z come in the compute dtype, bf16 or
// fp32, and so does the output; with bf16 the step rounds where the bf16 reference does.
// save_state: where a copy of the updated state goes as well (null: nowhere), written by each head as it finishes,
// while its state is in cache (a verification keeps the state after each token: 1 MB a 0.8B layer).
static at::Tensor gdn_step(at::Tensor mixed, at::Tensor conv_state, at::Tensor conv_w, at::Tensor a, at::Tensor b,
                           at::Tensor A_log, at::Tensor dt_bias, at::Tensor state, at::Tensor z, at::Tensor norm_w,
                           int64_t num_k_heads, double eps, bool bf16, float* save_state) {
  for (auto* t : {&conv_state, &conv_w, &A_log, &dt_bias, &state, &norm_w}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(), "gdn_decode_step: contiguous fp32 state/weights");
  }
  const auto dtype = bf16 ? at::kBFloat16 : at::kFloat;
  for (auto* t : {&mixed, &a, &b, &z}) {
    TORCH_CHECK(t->scalar_type() == dtype && t->is_contiguous(), "gdn_decode_step: projections in the compute dtype");
  }
  const int64_t B = mixed.size(0), C = mixed.size(1), K = conv_w.size(1);
  const int64_t Hv = state.size(1), Dk = state.size(2), Dv = state.size(3), Hk = num_k_heads;
  TORCH_CHECK(C == 2 * Hk * Dk + Hv * Dv && conv_state.size(2) == K - 1, "gdn_decode_step: shape mismatch");
  const int64_t r = Hv / Hk;
  auto conv_out = at::empty({B, C}, conv_state.options());
  auto out = at::empty({B, Hv * Dv}, mixed.options());
  std::vector<float> o_buf(B * Hv * Dv);
  auto rd = [bf16](float x) { return bf16 ? round_bf16(x) : x; };

  float* CS = conv_state.data_ptr<float>();
  const float* CW = conv_w.data_ptr<float>();
  float* Y = conv_out.data_ptr<float>();
  // 1. conv over the window [state | x], SiLU; shift the state. Qwen3.5's 4 taps are a compile-time count, and so
  // is the dtype: with both known the loop has no inner loops or branches (a 0.8B layer's step, hot: 98 vs 113-123 us)
  auto conv = [&](auto taps, auto bf16_tag) {
    constexpr int64_t kTaps = decltype(taps)::value;  // 0: K at run time
    constexpr bool kBf16 = decltype(bf16_tag)::value;
    const int64_t KK = kTaps ? kTaps : K;
    const auto* Xb = static_cast<const at::BFloat16*>(mixed.data_ptr());
    const auto* Xf = static_cast<const float*>(mixed.data_ptr());
    auto round = [](float v) { return kBf16 ? round_bf16(v) : v; };
    at::parallel_for(0, B * C, 1024, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0, c = i0 % C; i < i1; ++i, c = c + 1 == C ? 0 : c + 1) {  // c = i % C
        float* s = CS + i * (KK - 1);
        const float* w = CW + c * KK;
        const float x = kBf16 ? static_cast<float>(Xb[i]) : Xf[i];
        float acc = w[KK - 1] * x;
        for (int64_t j = 0; j < KK - 1; ++j) acc += w[j] * s[j];
        Y[i] = round(acc);
        for (int64_t j = 0; j + 1 < KK - 1; ++j) s[j] = s[j + 1];
        if (KK > 1) s[KK - 2] = round(x);
      }
      int64_t i = i0;  // SiLU, rounded where the reference rounds
      for (; i + qwenrt::simd::kLanes <= i1; i += qwenrt::simd::kLanes) {
        const auto y = qwenrt::simd::silu(qwenrt::simd::load(Y + i));
        qwenrt::simd::store(Y + i, kBf16 ? qwenrt::simd::round_bf16(y) : y);
      }
      for (; i < i1; ++i) Y[i] = round(silu(Y[i]));
    });
  };
  using Four = std::integral_constant<int64_t, 4>;
  using Any = std::integral_constant<int64_t, 0>;
  if (bf16) {
    K == 4 ? conv(Four{}, std::true_type{}) : conv(Any{}, std::true_type{});
  } else {
    K == 4 ? conv(Four{}, std::false_type{}) : conv(Any{}, std::false_type{});
  }

  const Floats A(a), Bt(b), Z(z);
  const float* AL = A_log.data_ptr<float>();
  const float* DT = dt_bias.data_ptr<float>();
  float* S = state.data_ptr<float>();
  const float* NW = norm_w.data_ptr<float>();
  float* O = o_buf.data();
  const float q_scale = 1.0f / std::sqrt(static_cast<float>(Dk));
  // 2. per value head: normalised q/k of its key head, then the delta rule and the gated norm
  qwenrt::parallel_for_work(0, B * Hv, 3 * Dk * Dv, [&](int64_t h0, int64_t h1) {  // the delta rule: ~3 per state element
    std::vector<float> q(Dk), k(Dk), u(Dv), gate(Dv);
    for (int64_t bh = h0; bh < h1; ++bh) {
      const int64_t bi = bh / Hv, h = bh % Hv, hk = h / r;
      const float* row = Y + bi * C;
      const float* qs = row + hk * Dk;
      const float* ks = row + Hk * Dk + hk * Dk;
      const float* v = row + 2 * Hk * Dk + h * Dv;
      float qq = 0.f, kk = 0.f;
      for (int64_t i = 0; i < Dk; ++i) { qq += qs[i] * qs[i]; kk += ks[i] * ks[i]; }
      const float qn = 1.0f / std::sqrt(qq + 1e-6f), kn = 1.0f / std::sqrt(kk + 1e-6f);
      for (int64_t i = 0; i < Dk; ++i) { q[i] = qs[i] * qn * q_scale; k[i] = ks[i] * kn; }
      const float g = -std::exp(AL[h]) * softplus(A[bh] + DT[h]);
      const float decay = std::exp(g);
      const float beta = rd(1.0f / (1.0f + std::exp(-Bt[bh])));
      float* s = S + bh * Dk * Dv;
      float* o = O + bh * Dv;
      delta_rule_step(s, k.data(), q.data(), v, decay, beta, Dk, Dv, u.data(), o);
      if (save_state != nullptr) std::memcpy(save_state + bh * Dk * Dv, s, Dk * Dv * sizeof(float));
      // gated RMSNorm: w · round(o·rsqrt(mean(o²)+eps)) · silu(z)
      float ms = 0.f;
      for (int64_t j = 0; j < Dv; ++j) { const float oj = rd(o[j]); ms += oj * oj; }
      const float inv = 1.0f / std::sqrt(ms / Dv + static_cast<float>(eps));
      for (int64_t j = 0; j < Dv; ++j) gate[j] = Z[bh * Dv + j];
      int64_t j = 0;
      for (; qwenrt::simd::kFma && j + qwenrt::simd::kLanes <= Dv; j += qwenrt::simd::kLanes)
        qwenrt::simd::store(gate.data() + j, qwenrt::simd::silu(qwenrt::simd::load(gate.data() + j)));
      for (; j < Dv; ++j) gate[j] = silu(gate[j]);
      for (j = 0; j < Dv; ++j) o[j] = rd(NW[j] * rd(rd(o[j]) * inv) * gate[j]);
    }
  });
  if (bf16) {
    at::BFloat16* dst = out.data_ptr<at::BFloat16>();
    for (int64_t i = 0; i < B * Hv * Dv; ++i) dst[i] = static_cast<at::BFloat16>(O[i]);
  } else {
    std::copy(O, O + B * Hv * Dv, out.data_ptr<float>());
  }
  return out;
}

at::Tensor gdn_decode_step(at::Tensor mixed, at::Tensor conv_state, at::Tensor conv_w, at::Tensor a,
                              at::Tensor b, at::Tensor A_log, at::Tensor dt_bias, at::Tensor state,
                              at::Tensor z, at::Tensor norm_w, int64_t num_k_heads, double eps, bool bf16) {
  return gdn_step(mixed, conv_state, conv_w, a, b, A_log, dt_bias, state, z, norm_w, num_k_heads, eps, bf16, nullptr);
}

// T successive tokens of one sequence (a speculative verification): the step above on each row in turn, the state
// [1, ...] carried from row to row; after every row but the last, copies of the conv and recurrent state go to
// saved_conv [T-1, C, K-1] and saved_state [T-1, Hv, Dk, Dv] (the state a rejection after that row commits).
at::Tensor gdn_decode_steps(at::Tensor mixed, at::Tensor conv_state, at::Tensor conv_w, at::Tensor a, at::Tensor b,
                            at::Tensor A_log, at::Tensor dt_bias, at::Tensor state, at::Tensor z, at::Tensor norm_w,
                            int64_t num_k_heads, double eps, bool bf16, at::Tensor saved_conv,
                            at::Tensor saved_state) {
  const int64_t T = mixed.size(0);
  TORCH_CHECK(T >= 1 && conv_state.size(0) == 1 && state.size(0) == 1 && saved_conv.is_contiguous() &&
              saved_state.is_contiguous() && saved_conv.scalar_type() == at::kFloat &&
              saved_state.scalar_type() == at::kFloat && saved_conv.size(0) == T - 1 &&
              saved_state.size(0) == T - 1 && saved_conv.numel() == (T - 1) * conv_state.numel() &&
              saved_state.numel() == (T - 1) * state.numel(),
              "gdn_decode_steps: one sequence's state, saved [T-1, ...] fp32 buffers of its shape");
  auto out = at::empty({T, z.size(1) * z.size(2)}, mixed.options());
  const int64_t row_bytes = out.size(1) * out.element_size();
  for (int64_t t = 0; t < T; ++t) {
    float* save = t + 1 < T ? saved_state.data_ptr<float>() + t * state.numel() : nullptr;
    const auto o = gdn_step(mixed.narrow(0, t, 1), conv_state, conv_w, a.narrow(0, t, 1), b.narrow(0, t, 1), A_log,
                            dt_bias, state, z.narrow(0, t, 1), norm_w, num_k_heads, eps, bf16, save);
    std::memcpy(static_cast<char*>(out.data_ptr()) + t * row_bytes, o.data_ptr(), row_bytes);
    if (t + 1 < T)
      std::memcpy(saved_conv.data_ptr<float>() + t * conv_state.numel(), conv_state.data_ptr<float>(),
                  conv_state.numel() * sizeof(float));
  }
  return out;
}

// The DeltaNet short convolution and its SiLU over a prefill chunk, token-major (no transposes): x [B, T, C]
// (in_proj_qkv output), conv_state [B, C, K-1] fp32 (the K-1 inputs before x; updated in place to the last K-1),
// conv_w [C, K] fp32 -> silu(conv(x)) [B, T, C] in x's dtype, rounded where the reference rounds: the conv's fp32
// sums once (as conv1d), then the SiLU (as torch.silu on that). One vectorized pass: the scalar conv followed by
// torch's bf16 SiLU took 56 ms a layer for the 0.8B's 2,048 x 6,144, this 28 (2 threads, AVX2 EPYC).
namespace {

template <typename T>
inline float silu_rounded(float conv) {  // silu(round(conv)), rounded
  const float c = static_cast<float>(static_cast<T>(conv));
  return static_cast<float>(static_cast<T>(silu(c)));
}

template <typename T>
void conv_silu_chunk(const T* X, float* CS, const float* W, T* Y, int64_t B, int64_t Tn, int64_t C, int64_t K) {
  using namespace qwenrt::simd;
  constexpr bool kBf16 = std::is_same_v<T, at::BFloat16>;
  std::vector<float> WT(K * C);  // [K, C]: unit stride over channels in the inner loop
  for (int64_t c = 0; c < C; ++c)
    for (int64_t j = 0; j < K; ++j) WT[j * C + c] = W[c * K + j];
  auto load_x = [](const T* p) {
    if constexpr (kBf16) return load_bf16(reinterpret_cast<const uint16_t*>(p));
    else return load(p);
  };
  at::parallel_for(0, C, 256, [&](int64_t c0, int64_t c1) {
    const int64_t width = c1 - c0;
    std::vector<float> past((K - 1) * width), tail((K - 1) * width);  // [K-1, width] inputs at t = -(K-1)..-1
    for (int64_t b = 0; b < B; ++b) {
      const T* xb = X + b * Tn * C;
      float* sb = CS + b * C * (K - 1);
      for (int64_t j = 0; j < K - 1; ++j)
        for (int64_t c = c0; c < c1; ++c) past[j * width + c - c0] = sb[c * (K - 1) + j];
      auto input = [&](int64_t t, int64_t c) -> float {  // input at time t (negative: from the state)
        return t >= 0 ? static_cast<float>(xb[t * C + c]) : past[(K - 1 + t) * width + c - c0];
      };
      for (int64_t t = 0; t < std::min(Tn, K - 1); ++t)  // the first K-1 outputs reach into the state
        for (int64_t c = c0; c < c1; ++c) {
          float acc = 0.f;
          for (int64_t j = 0; j < K; ++j) acc = std::fma(WT[j * C + c], input(t - (K - 1) + j, c), acc);
          Y[(b * Tn + t) * C + c] = static_cast<T>(silu_rounded<T>(acc));
        }
      for (int64_t t = K - 1; t < Tn; ++t) {
        T* yt = Y + (b * Tn + t) * C;
        const T* x0 = xb + (t - (K - 1)) * C;
        int64_t c = c0;
        for (; c + kLanes <= c1; c += kLanes) {
          F acc = zero();
          for (int64_t j = 0; j < K; ++j) acc = fmadd(load(WT.data() + j * C + c), load_x(x0 + j * C + c), acc);
          const F y = qwenrt::simd::silu(kBf16 ? qwenrt::simd::round_bf16(acc) : acc);
          if constexpr (kBf16) {
            qwenrt::simd::store_bf16(reinterpret_cast<uint16_t*>(yt + c), y);
          } else {
            store(reinterpret_cast<float*>(yt + c), y);
          }
        }
        for (; c < c1; ++c) {
          float acc = 0.f;
          for (int64_t j = 0; j < K; ++j) acc = std::fma(WT[j * C + c], static_cast<float>(x0[j * C + c]), acc);
          yt[c] = static_cast<T>(silu_rounded<T>(acc));
        }
      }
      for (int64_t j = 0; j < K - 1; ++j)  // the new state: the last K-1 inputs
        for (int64_t c = c0; c < c1; ++c) tail[j * width + c - c0] = input(Tn - (K - 1) + j, c);
      for (int64_t j = 0; j < K - 1; ++j)
        for (int64_t c = c0; c < c1; ++c) sb[c * (K - 1) + j] = tail[j * width + c - c0];
    }
  });
}

}  // namespace

at::Tensor causal_conv1d_silu(at::Tensor x, at::Tensor conv_state, at::Tensor conv_w) {
  TORCH_CHECK(x.dim() == 3 && x.is_contiguous() && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "causal_conv1d_silu: x must be contiguous [B, T, C] bf16 or fp32");
  TORCH_CHECK(conv_state.scalar_type() == at::kFloat && conv_state.is_contiguous() &&
              conv_w.scalar_type() == at::kFloat && conv_w.is_contiguous(), "causal_conv1d_silu: fp32 state and weight");
  const int64_t B = x.size(0), T = x.size(1), C = x.size(2), K = conv_w.size(1);
  TORCH_CHECK(conv_w.size(0) == C && conv_state.size(0) == B && conv_state.size(1) == C &&
              conv_state.size(2) == K - 1, "causal_conv1d_silu: shapes");
  auto y = at::empty_like(x);
  if (x.scalar_type() == at::kBFloat16) {
    conv_silu_chunk(x.data_ptr<at::BFloat16>(), conv_state.data_ptr<float>(), conv_w.data_ptr<float>(),
                    y.data_ptr<at::BFloat16>(), B, T, C, K);
  } else {
    conv_silu_chunk(x.data_ptr<float>(), conv_state.data_ptr<float>(), conv_w.data_ptr<float>(), y.data_ptr<float>(),
                    B, T, C, K);
  }
  return y;
}
