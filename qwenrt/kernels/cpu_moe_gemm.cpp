// An MoE block's int4 experts over a prefill chunk (layer_stack.h: grouped_experts_q4) in two parallel passes, not a
// GEMV call per expert and 8 rows: each expert's weights are decoded once for all of its rows. x is put in 8 bits
// per row and group once per call (gemv::to_int8, as cpu_gemm.cpp's int4 GEMM and llama.cpp's Q8_0 take it); the
// weight's unsigned 4-bit codes multiply it in integer sums (vpdpbusd with AVX512-VNNI, vpmaddubsw elsewhere).
//   pass 1  items (expert, G_down columns of its SwiGLU): kL gate and kL up rows at a time are transposed into a
//           panel (a vector per 4 columns: kL rows' codes, one row per int32 lane), then every row of the expert
//           passes by in tiles of up to kTile rows held in registers; silu(gate)·up in fp32, put in 8 bits per
//           group as x was.
//   pass 2  items (kL output columns of the down products, every expert): each token's Σ weight·down(act) in fp32,
//           its experts in the given order, rounded once to bf16.
// Work items are taken by the threads as they free up (the largest first); a row's result depends on its own
// values alone (row-independent, deterministic). Per group, the int32 sum Σc·q times s·d plus (z - 8s)·d·Σq: exact
// products of the 8-bit x, whose rounding costs at most Σ|W|·d/2 per output (tests/test_moe_native.py).
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <atomic>

#include "layer_stack.h"

namespace qwenrt {

namespace {

using namespace gemv;
using namespace simd;

constexpr int kL = kLanes;                                  // weight rows per panel: one int32 lane each
constexpr int kTile = std::min(12, (kRegisters - 6) / 2);  // x rows per tile: an int32 and an fp32 sum each
constexpr int64_t kMaxGroup = 128;  // the largest group size

// kL 4-byte words from each of kL rows (`stride` bytes apart) at `first`: v[i] lane j = row j's word i.
inline void transpose_words(const uint8_t* first, int64_t stride, I* v) {
#if defined(QWENRT_SIMD_AVX512)
  I r[16], a[16], b[16];
  for (int j = 0; j < 16; ++j) r[j] = _mm512_loadu_si512(first + j * stride);
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane l: [r0[4l], r1[4l], r0[4l+1], r1[4l+1]] and the next two
    a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // b[4i + c] lane l: word 4l + c of rows 4i..4i+3
    b[4 * i] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
    b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // word 4l + c: lane l of b[c], b[4 + c], b[8 + c], b[12 + c]
    const I u01 = _mm512_shuffle_i32x4(b[c], b[4 + c], _MM_SHUFFLE(1, 0, 1, 0));
    const I v01 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], _MM_SHUFFLE(1, 0, 1, 0));
    const I u23 = _mm512_shuffle_i32x4(b[c], b[4 + c], _MM_SHUFFLE(3, 2, 3, 2));
    const I v23 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], _MM_SHUFFLE(3, 2, 3, 2));
    v[c] = _mm512_shuffle_i32x4(u01, v01, _MM_SHUFFLE(2, 0, 2, 0));
    v[4 + c] = _mm512_shuffle_i32x4(u01, v01, _MM_SHUFFLE(3, 1, 3, 1));
    v[8 + c] = _mm512_shuffle_i32x4(u23, v23, _MM_SHUFFLE(2, 0, 2, 0));
    v[12 + c] = _mm512_shuffle_i32x4(u23, v23, _MM_SHUFFLE(3, 1, 3, 1));
  }
#elif defined(QWENRT_SIMD_AVX2)
  I r[8], a[8], b[8];
  for (int j = 0; j < 8; ++j) r[j] = load_i(first + j * stride);
  for (int i = 0; i < 4; ++i) {
    a[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    a[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    b[4 * i] = _mm256_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 1] = _mm256_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 2] = _mm256_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
    b[4 * i + 3] = _mm256_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    v[c] = _mm256_permute2x128_si256(b[c], b[4 + c], 0x20);
    v[4 + c] = _mm256_permute2x128_si256(b[c], b[4 + c], 0x31);
  }
#else
  for (int i = 0; i < kL; ++i)
    for (int j = 0; j < kL; ++j) std::memcpy(&v[i].i32[j], first + j * stride + 4 * i, 4);
#endif
}

// Rows [n0, n0 + kL) of an int4 matrix as the tiles read them: codes [K/4][kL] int32 (columns 4p..4p+3 of row
// n0 + j in lane j, one code a byte), scale s and zero term z - 8·s [K/G][kL].
struct Panel {
  std::vector<int32_t> codes;
  std::vector<float> scale, zero;
};

void pack(const Int4Matrix& w, int64_t n0, Panel& p) {
  const int64_t row_bytes = w.K / 2, words = w.G / 8, groups = w.K / w.G;  // words: a group's bytes / 2 / 4
  p.codes.resize(w.K / 4 * kL);
  p.scale.resize(groups * kL);
  p.zero.resize(groups * kL);
  const uint8_t* rows = w.q + n0 * row_bytes;
  const I low = set1_i32(0x0F0F0F0F);
  I v[kL];
  for (int64_t c = 0; c < row_bytes; c += 4 * kL) {
    for (int j = 0; j < kL; ++j) __builtin_prefetch(rows + j * row_bytes + c + 256, 0, 0);  // each row a stream
    transpose_words(rows + c, row_bytes, v);
    for (int i = 0; i < kL; ++i) {  // word q of group g: columns 4q.. of the group (low nibbles), G/2 + 4q.. (high)
      const int64_t word = c / 4 + i, quad = word / words * 2 * words + word % words;
      const I lo = and_i(v[i], low), hi = and_i(srli_i32<4>(v[i]), low);
      std::memcpy(p.codes.data() + quad * kL, &lo, sizeof lo);
      std::memcpy(p.codes.data() + (quad + words) * kL, &hi, sizeof hi);
    }
  }
  for (int j = 0; j < kL; ++j)
    for (int64_t g = 0; g < groups; ++g) {
      const float s = bf16_to_float(w.scales[(n0 + j) * groups + g]);
      p.scale[g * kL + j] = s;
      p.zero[g * kL + j] = bf16_to_float(w.zeros[(n0 + j) * groups + g]) - 8.f * s;
    }
}

// acc + Σ over 4 bytes of u (unsigned) times s (signed) per int32 lane
inline I dot_u8(I acc, I u, I s) {
#if defined(QWENRT_SIMD_AVX512) && defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(acc, u, s);
#else
  return add_i32(acc, madd_i16(maddubs_i8(u, s), set1_i16(1)));  // 2·15·127 per int16: no saturation
#endif
}

// A tile of Rows rows as the tiles read them, interleaved so that one pointer reaches them all: their 8-bit
// values by 4 columns, q [K/4][Rows] (4 bytes each), and per group d and d·Σq, [K/G][Rows] each.
struct Tile8 {
  const int32_t* q;
  const float* d;
  const float* sums;
};

// The tile's Rows rows · the panel's kL weight rows over K = groups·G columns -> out [Rows][kL] fp32
template <int Rows>
inline void tile(const Tile8& x, const Panel& p, int64_t groups, int64_t G, float* out) {
  F acc[Rows];
  for (int m = 0; m < Rows; ++m) acc[m] = zero();
  const int32_t* codes = p.codes.data();
  for (int64_t g = 0; g < groups; ++g) {
    I sum[Rows];
    for (int m = 0; m < Rows; ++m) sum[m] = zero_i();
    for (int64_t q = g * G / 4; q < (g + 1) * G / 4; ++q) {
      const I w = load_i(codes + q * kL);
      for (int m = 0; m < Rows; ++m) sum[m] = dot_u8(sum[m], w, set1_i32(x.q[q * Rows + m]));
    }
    const F s = load(p.scale.data() + g * kL), z = load(p.zero.data() + g * kL);
    for (int m = 0; m < Rows; ++m)
      acc[m] = fmadd(to_float(sum[m]), mul(s, set1(x.d[g * Rows + m])), fmadd(z, set1(x.sums[g * Rows + m]), acc[m]));
  }
  for (int m = 0; m < Rows; ++m) store(out + m * kL, acc[m]);
}

// tile<rows> for rows in 1..kTile
template <int Rows = kTile>
inline void tile_rows(int64_t rows, const Tile8& x, const Panel& p, int64_t groups, int64_t G, float* out) {
  if constexpr (Rows > 1) {
    if (rows < Rows) return tile_rows<Rows - 1>(rows, x, p, groups, G, out);
  }
  tile<Rows>(x, p, groups, G, out);
}

// n rows in near-equal tiles of at most kTile (16 rows: 8 + 8, not 12 + 4): (first row, rows) each
std::vector<std::pair<int64_t, int64_t>> tiles_of(int64_t n) {
  std::vector<std::pair<int64_t, int64_t>> tiles;
  const int64_t count = (n + kTile - 1) / kTile;
  for (int64_t t = 0, first = 0; t < count; ++t) {
    tiles.emplace_back(first, (n - first) / (count - t));
    first += tiles.back().second;
  }
  return tiles;
}

// v [G] fp32 -> q = round(v·127/amax) [G], d = amax/127 and d·Σq, as gemv::to_int8 puts a bf16 x
inline void to_int8_group(const float* v, int64_t G, int8_t* q, float& d, float& sum) {
  float amax = 0.f;
  for (int64_t k = 0; k < G; ++k) amax = std::max(amax, std::fabs(v[k]));
  const int32_t total = round_to_int8([&](int64_t k) { return load(v + k); }, G, amax, q);
  d = amax / 127.f;
  sum = static_cast<float>(total) * d;
}

// work(i, scratch) for i in [0, count), the threads taking the next item as they free up; scratch: one per thread
template <typename Scratch, typename Work>
void each_item(int64_t count, Work&& work) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    Scratch scratch;
    for (int64_t i; (i = next.fetch_add(1)) < count;) work(i, scratch);
  });
}

bool fits(const Int4Matrix& w) {
  return (w.G == 32 || w.G == 64 || w.G == 128) && w.K % (8 * kL) == 0 && w.rows % kL == 0;
}

}  // namespace

bool grouped_q4_fits(const std::vector<Int4Expert>& experts) {
  if (experts.empty()) return false;
  const Int4Expert& first = experts[0];
  for (const Int4Expert& e : experts)
    if (!fits(e.gate) || !fits(e.up) || !fits(e.down) || e.gate.K != first.gate.K || e.gate.G != first.gate.G ||
        e.up.K != e.gate.K || e.up.G != e.gate.G || e.up.rows != e.gate.rows || e.down.K != e.gate.rows ||
        e.down.G != first.down.G || e.down.rows != first.down.rows)
      return false;
  return true;
}

at::Tensor grouped_experts_q4(const at::Tensor& x, const std::vector<Int4Expert>& experts,
                              const std::vector<std::vector<int64_t>>& tokens,
                              const std::vector<std::vector<float>>& weights) {
  const int64_t N = x.size(0), K = x.size(1), J = static_cast<int64_t>(experts.size());
  const int64_t G = experts[0].gate.G, Gd = experts[0].down.G, D = experts[0].down.rows, xgroups = K / G;
  TORCH_CHECK(x.is_contiguous() && K == experts[0].gate.K, "grouped_experts_q4: x [N, K] contiguous");
  const Int8Rows in = to_int8(x, G);
  // the SwiGLU rows of every expert, one after another, in 8 bits per group of Gd: expert j's from act_at[j]
  std::vector<int64_t> act_at(J + 1, 0), scale_at(J + 1, 0);
  for (int64_t j = 0; j < J; ++j) {
    const int64_t n = static_cast<int64_t>(tokens[j].size()), I = experts[j].gate.rows;
    act_at[j + 1] = act_at[j] + n * I;
    scale_at[j + 1] = scale_at[j] + n * (I / Gd);
  }
  std::vector<int8_t> act(act_at[J]);  // 4-byte aligned: every expert's rows take I·n bytes, I a multiple of 32
  std::vector<float> act_d(scale_at[J]), act_sums(scale_at[J]);
  std::vector<std::pair<int64_t, int64_t>> items;  // (expert, group of its SwiGLU columns), the most rows first
  for (int64_t j = 0; j < J; ++j)
    for (int64_t c = 0; c < experts[j].gate.rows / Gd; ++c) items.emplace_back(j, c);
  std::stable_sort(items.begin(), items.end(),
                   [&](const auto& a, const auto& b) { return tokens[a.first].size() > tokens[b.first].size(); });
  struct SwigluScratch {
    Panel gate, up;
    std::vector<int32_t> x;      // the expert's rows of x by tile: [K/4][count] from first·K/4
    std::vector<float> xd, xs;   // [xgroups][count] from first·xgroups
    std::vector<float> act;      // [n, Gd]
    float g[kTile * kL], u[kTile * kL];
  };
  each_item<SwigluScratch>(static_cast<int64_t>(items.size()), [&](int64_t i, SwigluScratch& s) {
    const auto [j, c] = items[i];
    const Int4Expert& e = experts[j];
    const std::vector<int64_t>& rows = tokens[j];
    const int64_t n = static_cast<int64_t>(rows.size()), I = e.gate.rows, groups = I / Gd;
    const auto tiles = tiles_of(n);
    s.x.resize(n * K / 4);
    s.xd.resize(n * xgroups);
    s.xs.resize(n * xgroups);
    s.act.resize(n * Gd);
    for (const auto& [first, count] : tiles)
      for (int64_t m = 0; m < count; ++m) {
        const int64_t t = rows[first + m];
        for (int64_t q = 0; q < K / 4; ++q) std::memcpy(&s.x[first * K / 4 + q * count + m], &in.q[t * K + 4 * q], 4);
        for (int64_t g = 0; g < xgroups; ++g) {
          s.xd[first * xgroups + g * count + m] = in.scale[t * xgroups + g];
          s.xs[first * xgroups + g * count + m] = in.sums[t * xgroups + g];
        }
      }
    for (int64_t sub = 0; sub < Gd; sub += kL) {
      pack(e.gate, c * Gd + sub, s.gate);
      pack(e.up, c * Gd + sub, s.up);
      for (const auto& [first, count] : tiles) {
        const Tile8 x{s.x.data() + first * K / 4, s.xd.data() + first * xgroups, s.xs.data() + first * xgroups};
        tile_rows(count, x, s.gate, xgroups, G, s.g);
        tile_rows(count, x, s.up, xgroups, G, s.u);
        for (int64_t m = 0; m < count; ++m)
          store(s.act.data() + (first + m) * Gd + sub, mul(silu(load(s.g + m * kL)), load(s.u + m * kL)));
      }
    }
    int8_t q[kMaxGroup];
    for (const auto& [first, count] : tiles)  // into pass 2's tile layout: [I/4][count], [groups][count]
      for (int64_t m = 0; m < count; ++m) {
        const int64_t at = scale_at[j] + first * groups + c * count + m;
        to_int8_group(s.act.data() + (first + m) * Gd, Gd, q, act_d[at], act_sums[at]);
        for (int64_t k = 0; k < Gd / 4; ++k)
          std::memcpy(act.data() + act_at[j] + first * I + ((c * Gd / 4 + k) * count + m) * 4, q + 4 * k, 4);
      }
  });
  auto out = at::empty({N, D}, x.options());
  auto* Y = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  struct DownScratch {
    Panel down;
    std::vector<float> sums;  // [N, kL]: each token's weighted sum of its experts' outputs
    float y[kTile * kL];
  };
  each_item<DownScratch>(D / kL, [&](int64_t i, DownScratch& s) {
    const int64_t n0 = i * kL;
    s.sums.assign(N * kL, 0.f);
    for (int64_t j = 0; j < J; ++j) {
      const std::vector<int64_t>& rows = tokens[j];
      const int64_t I = experts[j].gate.rows, groups = I / Gd;
      if (rows.empty()) continue;
      pack(experts[j].down, n0, s.down);
      for (const auto& [first, count] : tiles_of(static_cast<int64_t>(rows.size()))) {
        const Tile8 a{reinterpret_cast<const int32_t*>(act.data() + act_at[j] + first * I),
                      act_d.data() + scale_at[j] + first * groups, act_sums.data() + scale_at[j] + first * groups};
        tile_rows(count, a, s.down, groups, Gd, s.y);
        for (int64_t m = 0; m < count; ++m) {
          float* sum = s.sums.data() + rows[first + m] * kL;
          store(sum, fmadd(set1(weights[j][first + m]), load(s.y + m * kL), load(sum)));
        }
      }
    }
    for (int64_t t = 0; t < N; ++t) store_bf16(Y + t * D + n0, load(s.sums.data() + t * kL));
  });
  return out;
}

}  // namespace qwenrt
