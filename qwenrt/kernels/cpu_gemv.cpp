// Decode-time matrix-vector products (M <= 4 activation rows) for x86-64 CPUs with AVX-512 BF16 and VNNI.
// At decode each weight is read once per token, so speed is memory bandwidth: every weight row is streamed once for
// all M rows, with software prefetch 16 KB ahead of the stream (the hardware prefetchers stop at 4 KB pages: with
// them alone the bf16 product read 32-38 GB/s, with this 42-44 of the 41-48 a plain streaming read reaches on these
// machines), and rows are split over torch's intra-op threads. One call can take several
// weights that share the input (q/k/v, gate/up, ...): one thread split, one pass over x, fewer calls per token.
//
// Weight formats (qwenrt/quant.py holds the stored layouts):
//   bf16  W [N, K]; products exact in fp32 (vdpbf16ps), fp32 sums.
//   int8  q [N, K] int8, s [N]: W = q·s. bf16 x is put in 16-bit fixed point per block of 256 columns with a
//         power-of-two scale: exact for every element within 2^8 of its block's largest (8 significant bits fit in
//         15), the smaller ones off by at most 2^-16 of that largest; then int16 x int8 products are summed
//         exactly in int32 (vpdpwssd) and each block's sum scaled in fp32.
//   int4  q [N, K/2] uint8 (byte j of a group: column j low nibble, column j + G/2 high), s, z [N, K/G]:
//         W = (q - 8)·s + z. A nibble n becomes the bf16 number 128 + n (its byte next to 128's exponent byte), so
//         products with bf16 x are exact in fp32; Σ (128 + n)·x·s then loses its offset through a per-group term.
//         (~32 GB/s: bound by the nibble unpacking and vdpbf16ps issue rate, not memory; a VNNI variant with x in
//         16-bit fixed point measured no faster.)
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

namespace {

constexpr int64_t kPrefetch = 16384;  // bytes ahead of the weight stream (bf16: 4 KB 38, 8 KB 42.6, 16 KB 43.5 GB/s)
constexpr int64_t kQ8Block = 256;    // int8: columns per activation scale

struct Segment {  // one weight matrix of a call and where its rows go
  const uint8_t* w;
  const uint16_t* scales;  // bf16 scales: int8 [N]; int4 [N, K/G]
  const uint16_t* zeros;   // int4 [N, K/G]
  int64_t N;
  float* out;  // [M, N] fp32 (rounded to bf16 afterwards when asked)
};

inline void prefetch_ahead(const uint8_t* p, int64_t bytes) {
  for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetch + i), _MM_HINT_T0);
}

inline float bf16_to_float(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

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
inline void store_rows(__m512 (&acc)[M][R], int rows, float* out, int64_t N, int64_t n, const float* row_scale) {
  for (int m = 0; m < M; ++m) {
    float sums[4];
    for (int r0 = 0; r0 < R; r0 += 4) {
      _mm_storeu_ps(sums, reduce4(acc[m][r0], acc[m][r0 + 1 < R ? r0 + 1 : r0], acc[m][r0 + 2 < R ? r0 + 2 : r0],
                                  acc[m][r0 + 3 < R ? r0 + 3 : r0]));
      for (int r = r0; r < std::min(R, r0 + 4); ++r)
        if (r < rows) out[m * N + n + r] = row_scale ? sums[r - r0] * row_scale[r] : sums[r - r0];
    }
  }
}

// ---- bf16 -------------------------------------------------------------------------------------------------------

inline __m512bh load_bf16(const uint16_t* p, int64_t remaining) {
  if (remaining >= 32) return (__m512bh)_mm512_loadu_si512(p);
  return (__m512bh)_mm512_maskz_loadu_epi16((__mmask32)((1ull << remaining) - 1), p);
}

template <int M>
void bf16_rows(const uint16_t* X, const Segment& s, int64_t K, int64_t n0, int64_t n1) {
  constexpr int R = 4;
  const auto* W = reinterpret_cast<const uint16_t*>(s.w);
  for (int64_t n = n0; n < n1; n += R) {
    const int rows = static_cast<int>(std::min<int64_t>(R, n1 - n));
    __m512 acc[M][R];
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
    const uint8_t* block = s.w + n * K * 2;
    for (int64_t k = 0, step = 0; k < K; k += 32, ++step) {
      prefetch_ahead(block + step * rows * 64, rows * 64);
      __m512bh xv[M];
      for (int m = 0; m < M; ++m) xv[m] = load_bf16(X + m * K + k, K - k);
      for (int r = 0; r < rows; ++r) {
        const __m512bh wv = load_bf16(W + (n + r) * K + k, K - k);
        for (int m = 0; m < M; ++m) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], wv, xv[m]);
      }
    }
    store_rows<M, R>(acc, rows, s.out, s.N, n, nullptr);
  }
}

// ---- int8 -------------------------------------------------------------------------------------------------------

struct Q8Input {  // x in 16-bit fixed point per block of kQ8Block columns, zero padded to whole blocks
  std::vector<int16_t> q;     // [M, Kp]
  std::vector<float> scale;   // [M, Kp / kQ8Block]
  int64_t Kp;
};

Q8Input quantize_q8_input(const torch::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1);
  const int64_t Kp = (K + kQ8Block - 1) / kQ8Block * kQ8Block, blocks = Kp / kQ8Block;
  auto xf = x.to(torch::kFloat32).contiguous();
  const float* X = xf.data_ptr<float>();
  Q8Input in{std::vector<int16_t>(M * Kp, 0), std::vector<float>(M * blocks), Kp};
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < blocks; ++b) {
      const float* xb = X + m * K + b * kQ8Block;
      const int64_t width = std::min(kQ8Block, K - b * kQ8Block);
      float amax = 0.f;
      for (int64_t i = 0; i < width; ++i) amax = std::max(amax, std::fabs(xb[i]));
      int e = 0;
      std::frexp(amax, &e);  // amax = f·2^e, f in [0.5, 1): |x| / 2^(e-15) < 2^15
      in.scale[m * blocks + b] = amax > 0.f ? std::ldexp(1.0f, e - 15) : 0.f;
      const float inv = amax > 0.f ? std::ldexp(1.0f, 15 - e) : 0.f;
      int16_t* qb = in.q.data() + m * Kp + b * kQ8Block;
      for (int64_t i = 0; i < width; ++i)
        qb[i] = static_cast<int16_t>(std::max(-32767.f, std::min(32767.f, std::nearbyint(xb[i] * inv))));
    }
  return in;
}

inline __m512i load_q8x32(const int8_t* p, int64_t remaining) {  // 32 int8 -> 32 int16 (zeros past the row)
  const __m256i raw = remaining >= 32 ? _mm256_loadu_si256((const __m256i*)p)
                                      : _mm256_maskz_loadu_epi8((__mmask32)((1ull << remaining) - 1), p);
  return _mm512_cvtepi8_epi16(raw);
}

template <int M>
void q8_rows(const Q8Input& in, const Segment& s, int64_t K, int64_t n0, int64_t n1) {
  constexpr int R = M <= 2 ? 4 : 2;  // 2·M·R accumulators + M inputs within the 32 vector registers
  const int64_t blocks = in.Kp / kQ8Block;
  const auto* Q = reinterpret_cast<const int8_t*>(s.w);
  for (int64_t n = n0; n < n1; n += R) {
    const int rows = static_cast<int>(std::min<int64_t>(R, n1 - n));
    __m512 acc[M][R];
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
    const uint8_t* block_start = s.w + n * K;
    for (int64_t b = 0; b < blocks; ++b) {
      __m512i iacc[M][R];
      for (int m = 0; m < M; ++m)
        for (int r = 0; r < R; ++r) iacc[m][r] = _mm512_setzero_si512();
      const int64_t end = std::min(K, (b + 1) * kQ8Block);
      for (int64_t k = b * kQ8Block; k < end; k += 32) {
        if (k % 64 == 0) prefetch_ahead(block_start + (k / 64) * rows * 64, rows * 64);
        __m512i xv[M];
        for (int m = 0; m < M; ++m) xv[m] = _mm512_loadu_si512(in.q.data() + m * in.Kp + k);
        for (int r = 0; r < rows; ++r) {
          const __m512i wv = load_q8x32(Q + (n + r) * K + k, K - k);
          for (int m = 0; m < M; ++m) iacc[m][r] = _mm512_dpwssd_epi32(iacc[m][r], wv, xv[m]);
        }
      }
      for (int m = 0; m < M; ++m) {
        const __m512 xs = _mm512_set1_ps(in.scale[m * blocks + b]);
        for (int r = 0; r < R; ++r) acc[m][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[m][r]), xs, acc[m][r]);
      }
    }
    float row_scale[R];
    for (int r = 0; r < R; ++r) row_scale[r] = r < rows ? bf16_to_float(s.scales[n + r]) : 0.f;
    store_rows<M, R>(acc, rows, s.out, s.N, n, row_scale);
  }
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
Q4Input arrange_q4_input(const torch::Tensor& x, int64_t G) {
  const int64_t M = x.size(0), K = x.size(1), groups = K / G;
  const int64_t Kp = (K + kQ4Unit - 1) / kQ4Unit * kQ4Unit;
  const auto* X = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
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
  constexpr int R = M <= 2 ? 4 : 2;
  const int64_t groups = K / G, units = in.Kp / kQ4Unit, row_bytes = K / 2;
  const __m512i low4 = _mm512_set1_epi8(0x0F), exp128 = _mm512_set1_epi8(0x43);  // 0x43nn: bf16 128 + n
  // lane j of a product vector sums 2 words of 16-byte lane j/4: group offset (j/4)·32/G within the unit
  alignas(64) int32_t lane_group[16];
  for (int j = 0; j < 16; ++j) lane_group[j] = static_cast<int32_t>((j / 4) * 32 / G);
  const __m512i group_index = _mm512_load_si512(lane_group);
  std::vector<float> sc(R * groups + 16);  // fp32 scales of the block's rows (+16: whole-vector reads)
  for (int64_t n = n0; n < n1; n += R) {
    const int rows = static_cast<int>(std::min<int64_t>(R, n1 - n));
    __m512 acc[M][R];
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
    // per-group offsets: Σ_g (z - 136·s)·Σx, since each weight enters as (128 + n)·s; and the fp32 scales
    for (int r = 0; r < rows; ++r) {
      const uint16_t* sr = s.scales + (n + r) * groups;
      const uint16_t* zr = s.zeros + (n + r) * groups;
      for (int64_t g = 0; g < groups; g += 16) {
        const __mmask16 mask = static_cast<__mmask16>(groups - g >= 16 ? 0xFFFF : (1u << (groups - g)) - 1);
        const __m512 sv = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, sr + g)), 16));
        const __m512 zv = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, zr + g)), 16));
        _mm512_mask_storeu_ps(sc.data() + r * groups + g, mask, sv);
        const __m512 coef = _mm512_fnmadd_ps(sv, _mm512_set1_ps(136.f), zv);
        for (int m = 0; m < M; ++m)
          acc[m][r] = _mm512_fmadd_ps(coef, _mm512_maskz_loadu_ps(mask, in.sums.data() + m * groups + g), acc[m][r]);
      }
    }
    const uint8_t* block_start = s.w + n * row_bytes;
    for (int64_t u = 0; u < units; ++u) {
      prefetch_ahead(block_start + u * rows * 64, rows * 64);
      const int64_t left = row_bytes - 64 * u;  // the last unit of a row may be half (K % 128 == 64)
      const __mmask64 bytes_mask = left >= 64 ? ~0ull : (1ull << left) - 1;
      for (int r = 0; r < rows; ++r) {
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
    store_rows<M, R>(acc, rows, s.out, s.N, n, nullptr);
  }
}

// ---- the driver -------------------------------------------------------------------------------------------------

template <typename F>
void dispatch_m(int64_t M, F&& f) {
  switch (M) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    default: f(std::integral_constant<int, 4>{}); break;
  }
}

// Row blocks of all segments in one list, so the threads split the total work of the call.
struct BlockList {
  std::vector<int64_t> seg, start;  // per block of kGrain rows
  static constexpr int64_t kGrain = 16;
  explicit BlockList(const std::vector<Segment>& segs) {
    for (size_t i = 0; i < segs.size(); ++i)
      for (int64_t n = 0; n < segs[i].N; n += kGrain) { seg.push_back(i); start.push_back(n); }
  }
};

template <typename RowFn>
void run_blocks(const std::vector<Segment>& segs, RowFn&& rows_fn) {
  BlockList bl(segs);
  const int64_t total = static_cast<int64_t>(bl.seg.size());
  at::parallel_for(0, total, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1;) {  // merge consecutive blocks of one segment into one row range
      const int64_t i = bl.seg[b], n0 = bl.start[b];
      int64_t e = b + 1;
      while (e < b1 && bl.seg[e] == i) ++e;
      const int64_t n1 = std::min(segs[i].N, bl.start[e - 1] + BlockList::kGrain);
      rows_fn(segs[i], n0, n1);
      b = e;
    }
  });
}

void check_x(const torch::Tensor& x, int64_t K) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= 4 && x.size(1) == K && x.is_contiguous(),
              "gemv: x must be contiguous [M <= 4, K]");
}

// The fp32 sums of a call (one [M, N_i] slice per weight) and what the caller gets from them:
//   "fp32": the sums; "bf16": each rounded to bf16 once; "swiglu": two weights (gate, up) -> silu(gate)·up [M, N]
//   rounded as torch's bf16 ops round (gate, up, silu(gate) and the product each to bf16).
struct Outputs {
  std::vector<float> sums;
  std::vector<Segment> segs;
  Outputs(const torch::Tensor& x, const std::vector<torch::Tensor>& ws, const std::string& mode) {
    TORCH_CHECK(mode == "fp32" || mode == "bf16" || mode == "swiglu", "gemv: output mode fp32, bf16 or swiglu");
    TORCH_CHECK(mode != "swiglu" || (ws.size() == 2 && ws[0].size(0) == ws[1].size(0)),
                "gemv: swiglu takes two weights (gate, up) of the same rows");
    int64_t total = 0;
    for (const auto& w : ws) {
      TORCH_CHECK(w.is_contiguous() && w.dim() == 2, "gemv: weights must be contiguous 2-D");
      total += x.size(0) * w.size(0);
    }
    sums.resize(total);
    int64_t offset = 0;
    for (const auto& w : ws) {
      segs.push_back({static_cast<const uint8_t*>(w.data_ptr()), nullptr, nullptr, w.size(0), sums.data() + offset});
      offset += x.size(0) * w.size(0);
    }
  }
  std::vector<torch::Tensor> finish(const torch::Tensor& x, const std::string& mode) const {
    const int64_t M = x.size(0);
    std::vector<torch::Tensor> out;
    if (mode == "swiglu") {
      const int64_t N = segs[0].N;
      auto y = torch::empty({M, N}, x.options().dtype(at::kBFloat16));
      at::BFloat16* Y = y.data_ptr<at::BFloat16>();
      for (int64_t i = 0; i < M * N; ++i) {
        const float g = static_cast<float>(static_cast<at::BFloat16>(segs[0].out[i]));
        const float u = static_cast<float>(static_cast<at::BFloat16>(segs[1].out[i]));
        const float act = static_cast<float>(static_cast<at::BFloat16>(g / (1.0f + std::exp(-g))));
        Y[i] = static_cast<at::BFloat16>(act * u);
      }
      return {y};
    }
    for (const auto& s : segs) {
      auto y = torch::empty({M, s.N}, x.options().dtype(mode == "fp32" ? at::kFloat : at::kBFloat16));
      if (mode == "fp32") {
        std::memcpy(y.data_ptr<float>(), s.out, M * s.N * sizeof(float));
      } else {
        at::BFloat16* Y = y.data_ptr<at::BFloat16>();
        for (int64_t i = 0; i < M * s.N; ++i) Y[i] = static_cast<at::BFloat16>(s.out[i]);
      }
      out.push_back(y);
    }
    return out;
  }
};

}  // namespace

// x [M, K] bf16 · each w [N_i, K] bf16 -> [M, N_i] per weight (see Outputs for `mode`)
std::vector<torch::Tensor> gemv_bf16(torch::Tensor x, std::vector<torch::Tensor> ws, std::string mode) {
  TORCH_CHECK(!ws.empty(), "gemv_bf16: no weights");
  const int64_t K = ws[0].size(1);
  check_x(x, K);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "gemv_bf16: bf16 input");
  for (const auto& w : ws) TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.size(1) == K, "gemv_bf16: weights");
  Outputs outs(x, ws, mode);
  const auto& segs = outs.segs;
  const auto* X = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  dispatch_m(x.size(0), [&](auto m) {
    run_blocks(segs, [&](const Segment& s, int64_t n0, int64_t n1) { bf16_rows<decltype(m)::value>(X, s, K, n0, n1); });
  });
  return outs.finish(x, mode);
}

// x [M, K] bf16 · int8 q_i [N_i, K] with bf16 row scales s_i [N_i]
std::vector<torch::Tensor> gemv_q8(torch::Tensor x, std::vector<torch::Tensor> qs, std::vector<torch::Tensor> scales,
                                   std::string mode) {
  TORCH_CHECK(!qs.empty() && qs.size() == scales.size(), "gemv_q8: one scale tensor per weight");
  const int64_t K = qs[0].size(1);
  check_x(x, K);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "gemv_q8: bf16 input");
  Outputs outs(x, qs, mode);
  auto& segs = outs.segs;
  for (size_t i = 0; i < qs.size(); ++i) {
    TORCH_CHECK(qs[i].scalar_type() == at::kChar && qs[i].size(1) == K, "gemv_q8: int8 weights [N, K]");
    TORCH_CHECK(scales[i].scalar_type() == at::kBFloat16 && scales[i].is_contiguous() &&
                scales[i].numel() == qs[i].size(0), "gemv_q8: bf16 scales [N]");
    segs[i].scales = reinterpret_cast<const uint16_t*>(scales[i].data_ptr<at::BFloat16>());
  }
  const Q8Input in = quantize_q8_input(x);
  dispatch_m(x.size(0), [&](auto m) {
    run_blocks(segs, [&](const Segment& s, int64_t n0, int64_t n1) { q8_rows<decltype(m)::value>(in, s, K, n0, n1); });
  });
  return outs.finish(x, mode);
}

// x [M, K] bf16 · int4 q_i [N_i, K/2] with bf16 scales/zeros [N_i, K/G] (qwenrt's stored layout); K % G == 0
std::vector<torch::Tensor> gemv_q4(torch::Tensor x, std::vector<torch::Tensor> qs, std::vector<torch::Tensor> scales,
                                   std::vector<torch::Tensor> zeros, int64_t G, std::string mode) {
  TORCH_CHECK(!qs.empty() && qs.size() == scales.size() && qs.size() == zeros.size(), "gemv_q4: pieces per weight");
  const int64_t K = 2 * qs[0].size(1);
  check_x(x, K);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "gemv_q4: bf16 input");
  TORCH_CHECK((G == 32 || G == 64 || G == 128) && K % G == 0, "gemv_q4: group size / K");
  Outputs outs(x, qs, mode);
  auto& segs = outs.segs;
  for (size_t i = 0; i < qs.size(); ++i) {
    const int64_t N = qs[i].size(0);
    TORCH_CHECK(qs[i].scalar_type() == at::kByte && 2 * qs[i].size(1) == K, "gemv_q4: uint8 weights [N, K/2]");
    for (const auto* t : {&scales[i], &zeros[i]})
      TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->is_contiguous() && t->numel() == N * (K / G),
                  "gemv_q4: bf16 scales and zeros [N, K/G]");
    segs[i].scales = reinterpret_cast<const uint16_t*>(scales[i].data_ptr<at::BFloat16>());
    segs[i].zeros = reinterpret_cast<const uint16_t*>(zeros[i].data_ptr<at::BFloat16>());
  }
  const Q4Input in = arrange_q4_input(x, G);
  dispatch_m(x.size(0), [&](auto m) {
    run_blocks(segs, [&](const Segment& s, int64_t n0, int64_t n1) {
      q4_rows<decltype(m)::value>(in, s, K, G, n0, n1);
    });
  });
  return outs.finish(x, mode);
}

// int4 stored layout -> W [N, K] in `dtype` (bf16 or fp32): prefill multiplies by it with torch's GEMM.
torch::Tensor dequantize_q4(torch::Tensor q, torch::Tensor scales, torch::Tensor zeros, int64_t G,
                            c10::ScalarType dtype) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kByte && q.is_contiguous(), "dequantize_q4: uint8 [N, K/2]");
  const int64_t N = q.size(0), K = 2 * q.size(1), groups = K / G;
  TORCH_CHECK(K % G == 0 && scales.numel() == N * groups && zeros.numel() == N * groups &&
              scales.scalar_type() == at::kBFloat16 && zeros.scalar_type() == at::kBFloat16 &&
              scales.is_contiguous() && zeros.is_contiguous(), "dequantize_q4: bf16 scales/zeros [N, K/G]");
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, "dequantize_q4: bf16 or fp32 output");
  auto out = torch::empty({N, K}, q.options().dtype(dtype));
  const uint8_t* Q = q.data_ptr<uint8_t>();
  const auto* S = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::BFloat16>());
  const auto* Z = reinterpret_cast<const uint16_t*>(zeros.data_ptr<at::BFloat16>());
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    std::vector<float> row(K);
    for (int64_t n = n0; n < n1; ++n) {
      for (int64_t g = 0; g < groups; ++g) {
        const float sc = bf16_to_float(S[n * groups + g]), z = bf16_to_float(Z[n * groups + g]);
        const uint8_t* bytes = Q + n * (K / 2) + g * (G / 2);
        for (int64_t o = 0; o < G / 2; ++o) {
          row[g * G + o] = (static_cast<float>(bytes[o] & 15) - 8.f) * sc + z;
          row[g * G + G / 2 + o] = (static_cast<float>(bytes[o] >> 4) - 8.f) * sc + z;
        }
      }
      if (dtype == at::kFloat) {
        std::memcpy(out.data_ptr<float>() + n * K, row.data(), K * sizeof(float));
      } else {
        at::BFloat16* o = out.data_ptr<at::BFloat16>() + n * K;
        for (int64_t k = 0; k < K; ++k) o[k] = static_cast<at::BFloat16>(row[k]);
      }
    }
  });
  return out;
}
