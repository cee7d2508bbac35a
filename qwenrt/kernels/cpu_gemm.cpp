// Prefill products (M rows of x at once) on CPUs without native bf16 arithmetic, for the bf16, int8 and int4
// weight formats. Each weight is packed a panel of kNR rows at a time into the layout the tile loop reads (one
// vector: kLanes rows at one column, × 2 columns for int16, × 4 for 8-bit codes), a broadcast element (pair, quad)
// of x multiplies it, and a tile of x rows × kNR outputs stays in registers for the whole of K; outputs are rounded
// once to bf16.
// bf16  the weight widened to fp32 panels, fp32 FMAs summed in fp32: torch's bf16 GEMM's products and sums, without
//       its emulated bf16 arithmetic, and without widening whole matrices for torch's fp32 GEMM (which ran at 53-70
//       GMAC/s on 2 Zen 3 cores, 55-70% of their FMA peak, at the 0.8B's prefill shapes).
// int8  x in 16-bit fixed point per block of kQ8Block columns, as the GEMV takes it (gemv_common.h); the weight
//       widened to int16; vpmaddwd multiplies a pair of columns, 2·kLanes exact products summed into int32 per
//       instruction; per block Σ q·x_q times x's block scale, summed in fp32, times the row scale s at the end.
// int4  x in 8 bits per row and group of G columns (to_int8: q = round(127·x/amax), as llama.cpp's Q8_0 blocks for
//       its Q4_0 products), the weight's unsigned 4-bit codes c as bytes; vpmaddubsw multiplies a quad of columns,
//       4·kLanes exact products per instruction (twice vpmaddwd's): 0.8B shapes at 512 rows 110 -> 157 GMAC/s,
//       AVX2 EPYC, 2 threads. W = (c - 8)·s + z per row and group: Σ c·x_q times s·d, plus (z - 8·s)·d·Σx_q. The
//       error against the bf16 x is that of x's 8-bit rounding, at most Σ|W|·d/2 per output (tests/test_kernels.py).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#include "gemv_common.h"
#include "kernels.h"
#include "simd.h"

namespace {

using namespace qwenrt::gemv;
using namespace qwenrt::simd;

constexpr int kMR = 4;           // x rows per int16 tile: 2·kMR int32 accumulators, 2 weight vectors, a broadcast
constexpr int kMRf = std::min(8, (kRegisters - 3) / 2);  // x rows per fp32 tile (6 with 16 registers)
constexpr int kNR = 2 * kLanes;  // weight rows (output columns) per panel

// A panel: int16 [pairs][kNR][2], the weight rows n0 + j of column pair p at (p·kNR + j)·2, zero past N and K.
// `row(n, codes)` writes row n's K int16 values into codes.
template <typename Row>
void pack(int64_t N, int64_t K, int64_t pairs, int64_t n0, int16_t* panel, std::vector<int16_t>& codes, Row&& row) {
  for (int j = 0; j < kNR; ++j) {
    std::fill(codes.begin(), codes.end(), 0);  // [2·pairs]: zero past K
    if (n0 + j < N) row(n0 + j, codes.data());
    int16_t* d = panel + 2 * j;
    for (int64_t p = 0; p < pairs; ++p) std::memcpy(d + p * 2 * kNR, codes.data() + 2 * p, 4);
  }
}

// The int32 sums of kMR (or fewer: rows) x rows with the panel's kNR rows over column pairs [p0, p1), handed to
// `fold(m, sums over rows 0..kLanes-1, sums over kLanes..kNR-1)`.
template <int Rows, typename Fold>
inline void tile_sums(const int16_t* const* x, const int16_t* panel, int64_t p0, int64_t p1, Fold&& fold) {
  I lo[Rows], hi[Rows];
  for (int m = 0; m < Rows; ++m) lo[m] = hi[m] = zero_i();
  for (int64_t p = p0; p < p1; ++p) {
    const I w0 = load_i(panel + p * 2 * kNR), w1 = load_i(panel + p * 2 * kNR + 2 * kLanes);
    for (int m = 0; m < Rows; ++m) {
      int32_t pair;
      std::memcpy(&pair, x[m] + 2 * p, 4);
      const I xb = set1_i32(pair);
      lo[m] = add_i32(lo[m], madd_i16(w0, xb));
      hi[m] = add_i32(hi[m], madd_i16(w1, xb));
    }
  }
  for (int m = 0; m < Rows; ++m) fold(m, lo[m], hi[m]);
}

// x rows per 8-bit tile: 4 accumulators each (3 on AVX2; 2 and 4 measured slower there)
constexpr int kMR8 = std::min(6, (kRegisters - 3) / 4);
constexpr int64_t kFlushQuads = 8;  // int16 sums of 8 column quads stay below 2^15: 8 · 2 · 15 · 127 = 30480

// An 8-bit panel: [K/4][kNR][4] bytes, the codes of weight row n0 + j at columns 4p..4p+3 at (p·kNR + j)·4.
// The int32 sums of Rows x rows (8-bit) with it over column quads [p0, p1) (a multiple of kFlushQuads), handed to
// `fold(m, sums over rows 0..kLanes-1, over kLanes..kNR-1)`: vpmaddubsw sums 2 products into int16 (unsigned
// codes times signed x), 8 quads add up in int16, vpmaddwd by ones widens them to int32.
template <int Rows, typename Fold>
inline void tile_sums_u8(const int8_t* const* x, const uint8_t* panel, int64_t p0, int64_t p1, Fold&& fold) {
  I lo[Rows], hi[Rows];
  for (int m = 0; m < Rows; ++m) lo[m] = hi[m] = zero_i();
  const I ones = set1_i16(1);
  for (int64_t f = p0; f < p1; f += kFlushQuads) {
    I lo16[Rows], hi16[Rows];
    for (int m = 0; m < Rows; ++m) lo16[m] = hi16[m] = zero_i();
    for (int64_t p = f; p < f + kFlushQuads; ++p) {
      const I w0 = load_i(panel + p * 4 * kNR), w1 = load_i(panel + p * 4 * kNR + 4 * kLanes);
      for (int m = 0; m < Rows; ++m) {
        int32_t quad;
        std::memcpy(&quad, x[m] + 4 * p, 4);
        const I xb = set1_i32(quad);
        lo16[m] = add_i16(lo16[m], maddubs_i8(w0, xb));
        hi16[m] = add_i16(hi16[m], maddubs_i8(w1, xb));
      }
    }
    for (int m = 0; m < Rows; ++m) {
      lo[m] = add_i32(lo[m], madd_i16(lo16[m], ones));
      hi[m] = add_i32(hi[m], madd_i16(hi16[m], ones));
    }
  }
  for (int m = 0; m < Rows; ++m) fold(m, lo[m], hi[m]);
}

// An fp32 panel: [K][kNR], weight row n0 + j of column k at k·kNR + j, zero past N.
void pack_bf16(const uint16_t* W, int64_t N, int64_t K, int64_t n0, float* panel) {
  const int64_t rows = std::min<int64_t>(kNR, N - n0);
  for (int64_t k = 0; k < K; ++k) {
    float* d = panel + k * kNR;
    for (int64_t j = 0; j < rows; ++j) d[j] = bf16_to_float(W[(n0 + j) * K + k]);
    for (int64_t j = rows; j < kNR; ++j) d[j] = 0.f;
  }
}

// The fp32 sums of Rows x rows with the panel's kNR rows over all K columns, into acc [Rows][kNR].
template <int Rows>
inline void tile_f32(const float* const* x, const float* panel, int64_t K, float* acc) {
  F lo[Rows], hi[Rows];
  for (int m = 0; m < Rows; ++m) lo[m] = hi[m] = zero();
  for (int64_t k = 0; k < K; ++k) {
    const F w0 = load(panel + k * kNR), w1 = load(panel + k * kNR + kLanes);
    for (int m = 0; m < Rows; ++m) {
      const F xb = set1(x[m][k]);
      lo[m] = fmadd(w0, xb, lo[m]);
      hi[m] = fmadd(w1, xb, hi[m]);
    }
  }
  for (int m = 0; m < Rows; ++m) {
    store(acc + m * kNR, lo[m]);
    store(acc + m * kNR + kLanes, hi[m]);
  }
}

// f(std::integral_constant<int, rows>) for rows in 1..MR (rows == MR for a whole tile).
template <int MR, typename Fn>
void dispatch_rows(int64_t rows, Fn&& f) {
  if constexpr (MR > 1) {
    if (rows < MR) return dispatch_rows<MR - 1>(rows, f);
  }
  f(std::integral_constant<int, MR>{});
}

// The driver: N in slices of panels (at most kSliceBytes packed), each slice's panels split over the threads, each
// thread packing its own (`pack_panel(n0, panel, scratch)`, scratch: one row's worth) once; then x a block of rows
// at a time (kept in the core's L2 while every panel of the thread passes by), a tile of MR rows per call of
// `tile(rows, m0, n0, panel, acc)`, which leaves the fp32 results [rows][kNR] in acc, rounded once to bf16 here.
// panel_size: packed elements per panel; x_row_bytes: the bytes of one row of x as the tiles read it.
constexpr int64_t kSliceBytes = int64_t{8} << 20;

template <typename Packed, int MR, typename PackPanel, typename Tile>
at::Tensor run_panels(const at::Tensor& x, int64_t N, int64_t panel_size, int64_t x_row_bytes,
                      PackPanel&& pack_panel, Tile&& tile) {
  const int64_t M = x.size(0), panels = (N + kNR - 1) / kNR;
  const int64_t block_rows = std::max<int64_t>(MR, (int64_t{1} << 18) / x_row_bytes / MR * MR);  // x: 256 KB
  const int64_t slice = std::max<int64_t>(1, kSliceBytes / (int64_t{sizeof(Packed)} * panel_size));  // panels
  auto y = at::empty({M, N}, x.options());
  at::BFloat16* Y = y.data_ptr<at::BFloat16>();
  // the packed slice, in a buffer kept per calling thread: a fresh one per matrix costs its page faults each time
  static thread_local std::vector<Packed> buffer;
  if (buffer.size() < static_cast<size_t>(std::min(slice, panels) * panel_size))
    buffer.resize(std::min(slice, panels) * panel_size);
  Packed* packed = buffer.data();
  for (int64_t first = 0; first < panels; first += slice)
    at::parallel_for(first, std::min(panels, first + slice), 1, [&](int64_t t0, int64_t t1) {
      std::vector<Packed> scratch(panel_size / kNR);
      for (int64_t t = t0; t < t1; ++t) pack_panel(t * kNR, packed + (t - first) * panel_size, scratch);
      float acc[MR * kNR];
      for (int64_t b0 = 0; b0 < M; b0 += block_rows)
        for (int64_t t = t0; t < t1; ++t) {
          const int64_t n0 = t * kNR, width = std::min<int64_t>(kNR, N - n0);
          for (int64_t m0 = b0; m0 < std::min(M, b0 + block_rows); m0 += MR) {
            const int64_t rows = std::min<int64_t>(MR, M - m0);
            tile(rows, m0, n0, packed + (t - first) * panel_size, acc);
            for (int64_t m = 0; m < rows; ++m)
              for (int64_t j = 0; j < width; ++j)
                Y[(m0 + m) * N + n0 + j] = static_cast<at::BFloat16>(acc[m * kNR + j]);
          }
        }
    });
  return y;
}

void check_x(const at::Tensor& x, int64_t K, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && x.is_contiguous() && x.scalar_type() == at::kBFloat16,
              name, ": x must be contiguous bf16 [M, K]");
  TORCH_CHECK(K > 0, name, ": K must be positive");
}

}  // namespace

// x [M, K] bf16 · bf16 w [N, K] -> [M, N] bf16, fp32 products and sums
at::Tensor gemm_bf16(at::Tensor x, at::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.is_contiguous(), "gemm_bf16: bf16 weights [N, K]");
  const int64_t N = w.size(0), K = w.size(1), M = x.size(0);
  check_x(x, K, "gemm_bf16");
  // x in fp32 [M, K], in a buffer kept per calling thread like the panels' (the workers see it through x32 only)
  static thread_local std::vector<float> buffer;
  if (buffer.size() < static_cast<size_t>(M * K)) buffer.resize(M * K);
  float* x32 = buffer.data();
  const auto* X = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  at::parallel_for(0, M * K, 1 << 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) x32[i] = bf16_to_float(X[i]);
  });
  const auto* W = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  return run_panels<float, kMRf>(
      x, N, K * kNR, 4 * K, [&](int64_t n0, float* panel, std::vector<float>&) { pack_bf16(W, N, K, n0, panel); },
      [&](int64_t rows, int64_t m0, int64_t, const float* panel, float* acc) {
        dispatch_rows<kMRf>(rows, [&](auto r) {
          constexpr int Rows = decltype(r)::value;
          const float* xr[Rows];
          for (int m = 0; m < Rows; ++m) xr[m] = x32 + (m0 + m) * K;
          tile_f32<Rows>(xr, panel, K, acc);
        });
      });
}

// x [M, K] bf16 · int8 q [N, K] with bf16 row scales s [N] -> [M, N] bf16
at::Tensor gemm_q8(at::Tensor x, at::Tensor q, at::Tensor scales) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar && q.is_contiguous(), "gemm_q8: int8 weights [N, K]");
  const int64_t N = q.size(0), K = q.size(1);
  check_x(x, K, "gemm_q8");
  TORCH_CHECK(scales.scalar_type() == at::kBFloat16 && scales.is_contiguous() && scales.numel() == N,
              "gemm_q8: bf16 scales [N]");
  const FixedPoint in = to_fixed_point(x, kQ8Block);
  const int64_t blocks = in.Kp / kQ8Block, pairs = in.Kp / 2;
  const int8_t* Q = q.data_ptr<int8_t>();
  const auto* S = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::BFloat16>());
  return run_panels<int16_t, kMR>(
      x, N, pairs * 2 * kNR, 4 * pairs,
      [&](int64_t n0, int16_t* panel, std::vector<int16_t>& codes) {
        pack(N, K, pairs, n0, panel, codes, [&](int64_t n, int16_t* row) {
          for (int64_t k = 0; k < K; ++k) row[k] = Q[n * K + k];
        });
      },
      [&](int64_t rows, int64_t m0, int64_t n0, const int16_t* panel, float* acc) {
        dispatch_rows<kMR>(rows, [&](auto r) {
          constexpr int Rows = decltype(r)::value;
          const int16_t* xr[Rows];
          for (int m = 0; m < Rows; ++m) xr[m] = in.q.data() + (m0 + m) * in.Kp;
          std::fill(acc, acc + Rows * kNR, 0.f);  // fp32 sums in memory: the registers hold the int32 ones
          for (int64_t b = 0; b < blocks; ++b)
            tile_sums<Rows>(xr, panel, b * kQ8Block / 2, (b + 1) * kQ8Block / 2, [&](int m, I l, I h) {
              const F xs = set1(in.scale[(m0 + m) * blocks + b]);
              store(acc + m * kNR, fmadd(to_float(l), xs, load(acc + m * kNR)));
              store(acc + m * kNR + kLanes, fmadd(to_float(h), xs, load(acc + m * kNR + kLanes)));
            });
          float s[kNR];
          for (int j = 0; j < kNR; ++j) s[j] = n0 + j < N ? bf16_to_float(S[n0 + j]) : 0.f;
          for (int m = 0; m < Rows; ++m)
            for (int v = 0; v < kNR; v += kLanes) store(acc + m * kNR + v, mul(load(acc + m * kNR + v), load(s + v)));
        });
      });
}

// x [M, K] bf16 · int8 q [N, K] in fp32-scaled groups of G = 16 or 32 (GGUF's 8-, 6- and 5-bit blocks), zeros
// [N, K/G] or none -> [M, N] bf16: gemm_q8's fixed-point x and int32 sums, folded per group with its scale times
// x's block scale; zeros through Σ_g z·Σx per group.
at::Tensor gemm_q8g(at::Tensor x, at::Tensor q, at::Tensor scales, c10::optional<at::Tensor> zeros, int64_t G) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar && q.is_contiguous(), "gemm_q8g: int8 weights [N, K]");
  const int64_t N = q.size(0), K = q.size(1);
  check_x(x, K, "gemm_q8g");
  TORCH_CHECK((G == 16 || G == 32) && K % G == 0, "gemm_q8g: groups of 16 or 32 columns");
  const int64_t groups = K / G;
  for (const at::Tensor* t : {&scales, zeros ? &*zeros : &scales})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == N * groups,
                "gemm_q8g: fp32 scales (and zeros) [N, K/G]");
  const FixedPoint in = to_fixed_point(x, kQ8Block);
  const std::vector<float> xsums = zeros ? group_sums(x, G) : std::vector<float>();
  const int64_t blocks = in.Kp / kQ8Block, pairs = in.Kp / 2, panels = (N + kNR - 1) / kNR;
  const int8_t* Q = q.data_ptr<int8_t>();
  const float *S = scales.data_ptr<float>(), *Z = zeros ? zeros->data_ptr<float>() : nullptr;
  std::vector<float> panel_s(panels * groups * kNR, 0.f), panel_z(Z ? panels * groups * kNR : 0, 0.f);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t at = (n / kNR * groups + g) * kNR + n % kNR;
      panel_s[at] = S[n * groups + g];
      if (Z) panel_z[at] = Z[n * groups + g];
    }
  return run_panels<int16_t, kMR>(
      x, N, pairs * 2 * kNR, 4 * pairs,
      [&](int64_t n0, int16_t* panel, std::vector<int16_t>& codes) {
        pack(N, K, pairs, n0, panel, codes, [&](int64_t n, int16_t* row) {
          for (int64_t k = 0; k < K; ++k) row[k] = Q[n * K + k];
        });
      },
      [&](int64_t rows, int64_t m0, int64_t n0, const int16_t* panel, float* acc) {
        const float* ps = panel_s.data() + n0 / kNR * groups * kNR;
        const float* pz = Z ? panel_z.data() + n0 / kNR * groups * kNR : nullptr;
        dispatch_rows<kMR>(rows, [&](auto r) {
          constexpr int Rows = decltype(r)::value;
          const int16_t* xr[Rows];
          for (int m = 0; m < Rows; ++m) xr[m] = in.q.data() + (m0 + m) * in.Kp;
          std::fill(acc, acc + Rows * kNR, 0.f);
          for (int64_t g = 0; g < groups; ++g)
            tile_sums<Rows>(xr, panel, g * G / 2, (g + 1) * G / 2, [&](int m, I l, I h) {
              const F xs = set1(in.scale[(m0 + m) * blocks + g * G / kQ8Block]);
              const I parts[2] = {l, h};
              for (int v = 0; v < 2; ++v) {
                float* a = acc + m * kNR + v * kLanes;
                F sum = fmadd(to_float(parts[v]), mul(load(ps + g * kNR + v * kLanes), xs), load(a));
                if (pz) sum = fmadd(load(pz + g * kNR + v * kLanes), set1(xsums[(m0 + m) * groups + g]), sum);
                store(a, sum);
              }
            });
        });
      });
}

// A row of the int4 stored layout (byte b of group g: column g·G + b in the low nibble, g·G + G/2 + b in the high)
// -> its K codes in column order. Arguments by value and restrict: byte stores may alias anything, and through a
// lambda's captured references the compiler reloaded every bound after each one (4x slower packing).
inline void unpack_q4_row(const uint8_t* __restrict bytes, int64_t K, int64_t G, uint8_t* __restrict row) {
  const int64_t half = G / 2;
  for (int64_t g = 0; g < K / G; ++g)
    for (int64_t b = 0; b < half; ++b) {
      row[g * G + b] = bytes[g * half + b] & 15;
      row[g * G + half + b] = bytes[g * half + b] >> 4;
    }
}

namespace {

// x [M, K] bf16 · int4 q [N, K/2] (stored layout, groups of G) -> [M, N] bf16, x in 8 bits per row and group
// (to_int8); scale_zero(n, g, s, z) gives row n's group g scale s and z - c0·s (c0: the code whose value is z).
template <typename ScaleZero>
at::Tensor q4_gemm(const at::Tensor& x, const at::Tensor& q, int64_t G, ScaleZero&& scale_zero) {
  const int64_t N = q.size(0), K = 2 * q.size(1), groups = K / G;
  const Int8Rows in = to_int8(x, G);
  const uint8_t* Q = q.data_ptr<uint8_t>();
  // per panel, its rows' scales and zero terms by group: [panels][groups][kNR] fp32 (zero past N)
  const int64_t panels = (N + kNR - 1) / kNR;
  std::vector<float> panel_s(panels * groups * kNR, 0.f), panel_z(panels * groups * kNR, 0.f);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t at = (n / kNR * groups + g) * kNR + n % kNR;
      scale_zero(n, g, panel_s[at], panel_z[at]);
    }
  return run_panels<uint8_t, kMR8>(
      x, N, K * kNR, K,
      [&](int64_t n0, uint8_t* panel, std::vector<uint8_t>& codes) {  // codes: one row's K codes
        for (int j = 0; j < kNR; ++j) {
          const int64_t n = n0 + j;
          uint8_t* row = codes.data();
          if (n < N) {
            unpack_q4_row(Q + n * (K / 2), K, G, row);
          } else {
            std::memset(row, 0, K);
          }
          for (int64_t p = 0; p < K / 4; ++p) std::memcpy(panel + (p * kNR + j) * 4, row + 4 * p, 4);
        }
      },
      [&](int64_t rows, int64_t m0, int64_t n0, const uint8_t* panel, float* acc) {
        const float* ps = panel_s.data() + n0 / kNR * groups * kNR;
        const float* pz = panel_z.data() + n0 / kNR * groups * kNR;
        dispatch_rows<kMR8>(rows, [&](auto r) {
          constexpr int Rows = decltype(r)::value;
          const int8_t* xr[Rows];
          for (int m = 0; m < Rows; ++m) xr[m] = in.q.data() + (m0 + m) * K;
          std::fill(acc, acc + Rows * kNR, 0.f);
          for (int64_t g = 0; g < groups; ++g)
            tile_sums_u8<Rows>(xr, panel, g * G / 4, (g + 1) * G / 4, [&](int m, I l, I h) {
              const F xs = set1(in.scale[(m0 + m) * groups + g]), sx = set1(in.sums[(m0 + m) * groups + g]);
              const I parts[2] = {l, h};
              for (int v = 0; v < 2; ++v) {
                float* a = acc + m * kNR + v * kLanes;
                const F s = load(ps + g * kNR + v * kLanes), z = load(pz + g * kNR + v * kLanes);
                store(a, fmadd(to_float(parts[v]), mul(s, xs), fmadd(z, sx, load(a))));
              }
            });
        });
      });
}

void check_q4(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales, const at::Tensor& zeros, int64_t G,
              at::ScalarType dtype, const char* name) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kByte && q.is_contiguous(), name, ": uint8 weights [N, K/2]");
  const int64_t N = q.size(0), K = 2 * q.size(1);
  check_x(x, K, name);
  TORCH_CHECK((G == 32 || G == 64 || G == 128) && K % G == 0, name, ": group size / K");
  for (const auto* t : {&scales, &zeros})
    TORCH_CHECK(t->scalar_type() == dtype && t->is_contiguous() && t->numel() == N * (K / G), name,
                dtype == at::kFloat ? ": fp32" : ": bf16", " scales and zeros [N, K/G]");
}

}  // namespace

// x [M, K] bf16 · int4 q [N, K/2] (stored layout, groups of G) with bf16 scales/zeros [N, K/G] -> [M, N] bf16,
// x in 8 bits per row and group (to_int8). W = (code - 8)·s + z.
at::Tensor gemm_q4(at::Tensor x, at::Tensor q, at::Tensor scales, at::Tensor zeros, int64_t G) {
  check_q4(x, q, scales, zeros, G, at::kBFloat16, "gemm_q4");
  const int64_t groups = 2 * q.size(1) / G;
  const auto* S = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::BFloat16>());
  const auto* Z = reinterpret_cast<const uint16_t*>(zeros.data_ptr<at::BFloat16>());
  return q4_gemm(x, q, G, [&](int64_t n, int64_t g, float& s, float& z) {
    s = bf16_to_float(S[n * groups + g]);
    z = bf16_to_float(Z[n * groups + g]) - 8.f * s;
  });
}

// The same with GGUF block headers for the scales and zeros (Q4_K's uint8 [N, K/256, 16], Q4_0's fp16 [N, K/32]).
at::Tensor gemm_q4k(at::Tensor x, at::Tensor q, at::Tensor headers) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kByte && q.is_contiguous(), "gemm_q4k: uint8 weights [N, K/2]");
  const int64_t N = q.size(0), K = 2 * q.size(1), groups = K / 32;
  check_x(x, K, "gemm_q4k");
  Segment blocks{};
  set_block_headers(blocks, headers, N, K, "gemm_q4k");
  std::vector<float> expanded(2 * groups);  // row `last`'s scales and zeros: the panels ask row by row
  Fp32Groups row{};
  int64_t last = -1;
  return q4_gemm(x, q, 32, [&](int64_t n, int64_t g, float& s, float& z) {
    if (n != last) row = fp32_groups(blocks, last = n, K, groups, expanded);
    s = row.scale[g];
    z = row.zero[g];
  });
}

// The same for fp32 scales and zeros [N, K/32] (GGUF's 4-bit blocks): W = code·s + z.
at::Tensor gemm_q4g(at::Tensor x, at::Tensor q, at::Tensor scales, at::Tensor zeros) {
  check_q4(x, q, scales, zeros, 32, at::kFloat, "gemm_q4g");
  const int64_t groups = 2 * q.size(1) / 32;
  const float *S = scales.data_ptr<float>(), *Z = zeros.data_ptr<float>();
  return q4_gemm(x, q, 32, [&](int64_t n, int64_t g, float& s, float& z) {
    s = S[n * groups + g];
    z = Z[n * groups + g];
  });
}
