// Decode-time matrix-vector kernels written in simd.h's operations: the `avx512` (AVX-512F/BW without BF16),
// `avx2` (AVX2 + FMA + F16C) and `portable` builds. No instruction here multiplies bf16 or int4 directly:
//   bf16  each 32-bit lane of a weight load holds two bf16, an even and an odd column; a shift and a mask make them
//         fp32 (no shuffles), multiplied by x's even and odd columns, split once per call. Exact products, fp32 sums.
//   int8  x in 16-bit fixed point per block of 256 columns (gemv_common.h); int8 widened to int16 and multiplied by
//         it with vpmaddwd: int32 sums, exact; each block's sum scaled in fp32.
//   int8 in fp32-scaled groups (GGUF blocks): the same int32 sums per vector, scaled per group in fp32.
//   int4  x in 8 bits per row and group (to_int8: q = round(127·x/amax), d = amax/127, as llama.cpp's Q8_0 x for
//         its Q4_0 products, and as the int4 prefill GEMM takes it). A mask and a shift give the packed bytes' low
//         and high nibbles as unsigned bytes; x is stored in the matching column order (per call). vpmaddubsw sums
//         their products exactly in int16 (0..15 x -127..127, 4 per lane), vpmaddwd by ones in int32; per group
//         the sum is scaled in fp32 by s·d, and the zero points enter through Σ (z - 8·s)·d·Σq per group. Against
//         the bf16 x the error is that of x's 8-bit rounding, at most Σ|W|·d/2 per output.
// Rows are processed R at a time with every accumulator in a register; the weight stream is prefetched 16 KB ahead.
#pragma once
#include <array>

#include "gemv_common.h"
#include "simd.h"

namespace qwenrt::gemv {

using namespace qwenrt::simd;

// Weight rows per block for M activation rows: R·M·`accumulators` + M·`inputs` (x, reused across the R rows, so
// the compiler keeps it in registers) + `temps` vectors within the registers; more spill in the inner loop.
constexpr int block_rows(int M, int inputs, int accumulators, int temps) {
  return std::max(1, std::min(8, (kRegisters - temps - inputs * M) / (accumulators * M)));
}

// ---- bf16 -------------------------------------------------------------------------------------------------------

constexpr int64_t kBf16Step = 2 * kLanes;  // weight columns per vector load

struct Bf16Input {  // x's even and odd columns in fp32, zero padded to whole steps
  std::vector<float> even, odd;  // [M, Kh]
  int64_t Kh;
};

inline Bf16Input bf16_input(const at::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1), Kh = (K + kBf16Step - 1) / kBf16Step * kLanes;
  const auto* X = reinterpret_cast<const uint16_t*>(x.data_ptr());
  Bf16Input in{std::vector<float>(M * Kh, 0.f), std::vector<float>(M * Kh, 0.f), Kh};
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) (k % 2 ? in.odd : in.even)[m * Kh + k / 2] = bf16_to_float(X[m * K + k]);
  return in;
}

// Σ over columns [full, K) of row n · x row m: the last, partial step, outside the vector loop (whose accumulators
// stay in registers only while it has no second path).
[[gnu::noinline]] inline float bf16_tail(const Bf16Input& in, const Segment& s, int64_t K, int64_t full, int64_t n,
                                         int m) {
  const auto* w = reinterpret_cast<const uint16_t*>(s.w) + n * K;
  float sum = 0.f;
  for (int64_t k = full; k < K; ++k) sum += bf16_to_float(w[k]) * (k % 2 ? in.odd : in.even)[m * in.Kh + k / 2];
  return sum;
}

template <int M>
void bf16_rows(const Bf16Input& in, const Segment& s, int64_t K, int64_t n0, int64_t n1) {
  const int64_t row_bytes = 2 * K, full = K / kBf16Step * kBf16Step;
  over_rows<block_rows(M, 2, 1, 4)>(n0, n1, [&](auto rows, int64_t n) {
    constexpr int R = decltype(rows)::value;
    F acc[M][R];
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < R; ++r) acc[m][r] = zero();
    const uint8_t* block = s.w + n * row_bytes;
    // Prefetch: where the block's R rows fit in 16 KB, the weight stream as one, 16 KB ahead (the next block);
    // where they do not, each row's own stream, a block ahead: the one stream 16 KB ahead reached the later rows'
    // lines late (the 0.8B's MLP down, rows of 7 KB: 1.15x, AVX2 EPYC)
    const bool by_row = R * row_bytes > kPrefetch;
    for (int64_t k = 0; k < full; k += kBf16Step) {
      if (by_row) {
        if (k % 32 == 0) prefetch_next_rows(block, row_bytes, R, 2 * k);
      } else {
        prefetch_ahead(block + k * 2 * R, 2 * kBf16Step * R);
      }
      for (int r = 0; r < R; ++r) {
        const I pairs = load_i(block + r * row_bytes + 2 * k);
        const F lo = bf16_low(pairs), hi = bf16_high(pairs);
        for (int m = 0; m < M; ++m) {
          acc[m][r] = fmadd(lo, load(in.even.data() + m * in.Kh + k / 2), acc[m][r]);
          acc[m][r] = fmadd(hi, load(in.odd.data() + m * in.Kh + k / 2), acc[m][r]);
        }
      }
    }
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < R; ++r) s.out[m * s.N + n + r] = reduce_add(acc[m][r]) + (full < K ? bf16_tail(in, s, K, full, n + r, m) : 0.f);
  });
}

// ---- int8 -------------------------------------------------------------------------------------------------------

constexpr int64_t kQ8Step = 2 * kLanes;  // int8 columns per widened vector

template <int M>
void q8_rows(const FixedPoint& in, const Segment& s, int64_t K, int64_t n0, int64_t n1) {
  const int64_t blocks = in.Kp / kQ8Block, full = K / kQ8Step * kQ8Step;
  over_rows<block_rows(M, 1, 2, 4)>(n0, n1, [&](auto rows, int64_t n) {
    constexpr int R = decltype(rows)::value;
    const uint8_t* block = s.w + n * K;
    F acc[M][R];
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < R; ++r) acc[m][r] = zero();
    for (int64_t b = 0; b < blocks; ++b) {
      I iacc[M][R];
      for (int m = 0; m < M; ++m)
        for (int r = 0; r < R; ++r) iacc[m][r] = zero_i();
      const int64_t end = std::min(full, (b + 1) * kQ8Block);
      for (int64_t k = b * kQ8Block; k < end; k += kQ8Step) {
        if (k % 64 == 0) prefetch_ahead(block + k * R, 64 * R);
        for (int r = 0; r < R; ++r) {
          const I w = widen_i8(reinterpret_cast<const int8_t*>(block + r * K + k));
          for (int m = 0; m < M; ++m) iacc[m][r] = add_i32(iacc[m][r], madd_i16(w, load_i(in.q.data() + m * in.Kp + k)));
        }
      }
      for (int m = 0; m < M; ++m) {
        const F xs = set1(in.scale[m * blocks + b]);
        for (int r = 0; r < R; ++r) acc[m][r] = fmadd(to_float(iacc[m][r]), xs, acc[m][r]);
      }
    }
    for (int r = 0; r < R; ++r) {
      const float row_scale = bf16_to_float(s.scales[n + r]);
      for (int m = 0; m < M; ++m)
        s.out[m * s.N + n + r] = (reduce_add(acc[m][r]) + (full < K ? q8_tail(in, s, K, full, n + r, m) : 0.f)) * row_scale;
    }
  });
}

// ---- int8 in fp32-scaled groups ---------------------------------------------------------------------------------
// As int8, with each widened vector's int32 sums (lane j: columns 2j, 2j+1) converted to fp32 and scaled lane by
// lane by their group's scale (G = 16 or 32), summed per activation block, whose scale then applies. Zeros enter as
// Σ_g z·Σx per group. K % kQ8Step == 0.

template <int M>
void q8g_rows(const FixedPoint& in, const float* xsums, const Segment& s, int64_t K, int64_t G, int64_t n0,
              int64_t n1) {
  const int64_t blocks = in.Kp / kQ8Block, groups = K / G;
  std::array<int32_t, kLanes> lanes;
  for (int j = 0; j < kLanes; ++j) lanes[j] = static_cast<int32_t>(2 * j / G);
  I lane_group;
  std::memcpy(&lane_group, lanes.data(), sizeof lane_group);
  constexpr int kRows = block_rows(M, 1, 2, 5);
  std::vector<float> sc(kRows * groups + kLanes, 0.f);  // the block's rows' scales, padded for whole-vector reads
  over_rows<kRows>(n0, n1, [&](auto rows, int64_t n) {
    constexpr int R = decltype(rows)::value;
    std::memcpy(sc.data(), s.fscales + n * groups, R * groups * sizeof(float));
    const uint8_t* block = s.w + n * K;
    F acc[M][R];
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < R; ++r) acc[m][r] = zero();
    for (int64_t b = 0; b < blocks; ++b) {
      F bacc[M][R];
      for (int m = 0; m < M; ++m)
        for (int r = 0; r < R; ++r) bacc[m][r] = zero();
      const int64_t end = std::min(K, (b + 1) * kQ8Block);
      for (int64_t k = b * kQ8Block; k < end; k += kQ8Step) {
        if (k % 64 == 0) prefetch_ahead(block + k * R, 64 * R);
        for (int r = 0; r < R; ++r) {
          const I w = widen_i8(reinterpret_cast<const int8_t*>(block + r * K + k));
          const F ws = permute(load(sc.data() + r * groups + k / G), lane_group);
          for (int m = 0; m < M; ++m)
            bacc[m][r] = fmadd(to_float(madd_i16(w, load_i(in.q.data() + m * in.Kp + k))), ws, bacc[m][r]);
        }
      }
      for (int m = 0; m < M; ++m) {
        const F xs = set1(in.scale[m * blocks + b]);
        for (int r = 0; r < R; ++r) acc[m][r] = fmadd(bacc[m][r], xs, acc[m][r]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) {
        float offset = 0.f;
        for (int64_t g = 0; s.fzeros && g < groups; ++g) offset += s.fzeros[(n + r) * groups + g] * xsums[m * groups + g];
        s.out[m * s.N + n + r] = reduce_add(acc[m][r]) + offset;
      }
  });
}

// ---- int4 -------------------------------------------------------------------------------------------------------

constexpr int64_t kQ4UnitBytes = 4 * kLanes;    // packed bytes per vector load
constexpr int64_t kQ4Unit = 2 * kQ4UnitBytes;  // their columns

struct Q4Input {
  Int8Rows q8;                      // x in 8 bits per row and group, column order: d per group, d·Σq, tails
  std::vector<int8_t> x;            // [M, units, 2, kQ4UnitBytes] q in the order the low and high nibbles unpack
  int64_t units, groups;
  std::array<int32_t, kLanes> lane_group;  // group of product lane j, relative to its period's first
};

constexpr int64_t q4_units_per_period(int64_t G) { return G > kQ4Unit ? G / kQ4Unit : 1; }

// Product lane j of a unit sums bytes 4j..4j+3 of its kQ4UnitBytes: with G/2 bytes per group, group 8j/G of the
// unit when a unit spans groups (G < kQ4Unit); otherwise one group per period of G / kQ4Unit units.
inline Q4Input q4_input(const at::Tensor& x, int64_t G) {
  const int64_t M = x.size(0), K = x.size(1), groups = K / G, row_bytes = K / 2;
  Q4Input in;
  in.q8 = to_int8(x, G);
  in.units = (row_bytes + kQ4UnitBytes - 1) / kQ4UnitBytes;
  in.groups = groups;
  for (int j = 0; j < kLanes; ++j) in.lane_group[j] = G < kQ4Unit ? static_cast<int32_t>(8 * j / G) : 0;
  const int half_shift = __builtin_ctzll(G / 2);  // G is a power of two
  in.x.assign(M * in.units * 2 * kQ4UnitBytes, 0);
  const int64_t run = std::min<int64_t>(kQ4UnitBytes, G / 2);  // bytes of one unit and one group: both powers of 2
  for (int64_t m = 0; m < M; ++m) {
    const int8_t* q = in.q8.q.data() + m * K;
    int8_t* xm = in.x.data() + m * in.units * 2 * kQ4UnitBytes;
    for (int64_t byte = 0; byte < row_bytes; byte += run) {  // a low nibble is column `low`, its high one low + G/2
      const int64_t u = byte / kQ4UnitBytes, i = byte % kQ4UnitBytes;
      const int64_t low = ((byte >> half_shift) << (half_shift + 1)) + (byte & (G / 2 - 1));
      std::memcpy(xm + 2 * u * kQ4UnitBytes + i, q + low, run);
      std::memcpy(xm + (2 * u + 1) * kQ4UnitBytes + i, q + low + G / 2, run);
    }
  }
  return in;
}

// The codes·x of row n's bytes [from, K/2) (a partial last period), scaled per group.
[[gnu::noinline]] inline float q4_tail(const Q4Input& in, const Segment& s, int64_t K, int64_t G, int64_t from,
                                       int64_t n, int m) {
  const uint8_t* row = s.w + n * (K / 2);
  const int8_t* q = in.q8.q.data() + m * K;
  float total = 0.f;
  for (int64_t g = from / (G / 2); g < in.groups; ++g) {
    int32_t sum = 0;
    for (int64_t b = std::max(g * G / 2, from); b < (g + 1) * G / 2; ++b)
      sum += int32_t{row[b] & 15} * q[g * G + b % (G / 2)] + int32_t{row[b] >> 4} * q[g * G + G / 2 + b % (G / 2)];
    std::vector<float> expanded;
    const float scale = s.fp32_scaled() ? fp32_groups(s, n, K, in.groups, expanded).scale[g]
                                        : bf16_to_float(s.scales[n * in.groups + g]);
    total += static_cast<float>(sum) * (in.q8.scale[m * in.groups + g] * scale);
  }
  return total;
}

// The int32 sums of one unit's codes (v: kQ4UnitBytes packed bytes) with x's 8-bit values there, as int16 lanes
// of 4 products each (≤ 4·15·127): vpmaddubsw multiplies the unsigned codes by the signed x, two per lane.
inline I q4_unit_sums(I v, I low4, const int8_t* xu) {
  const I lo = and_i(v, low4), hi = and_i(srli_i16<4>(v), low4);
  return add_i16(maddubs_i8(lo, load_i(xu)), maddubs_i8(hi, load_i(xu + kQ4UnitBytes)));
}

// U units per period (the units of one group when G > kQ4Unit): each period's integer sums are complete in
// registers (int16 lanes of 4·U products ≤ 4·2·15·127), widened to int32 by vpmaddwd with ones, scaled, and added to
// fp32 accumulators, so nothing but those is carried from period to period.
// OneGroup: a period lies in one group (G >= kQ4Unit), whose scale is a broadcast; else each product lane takes its
// group's. A compile-time choice: a branch on it in the loop kept the compiler from holding the accumulators in
// registers (int4 head GEMV ~25% slower, AVX2 EPYC).
template <int M, int U, bool OneGroup>
void q4_periods(const Q4Input& in, const Segment& s, int64_t K, int64_t G, int64_t n0, int64_t n1) {
  static_assert(U <= 2, "int16 sums of 4·U products of 15·127 stay below 2^15");
  const int64_t groups = in.groups, row_bytes = K / 2, groups_per_period = OneGroup ? 1 : kQ4Unit / G;
  const int64_t full_periods = row_bytes / (U * kQ4UnitBytes), tail = full_periods * U * kQ4UnitBytes;
  I lane_group;
  std::memcpy(&lane_group, in.lane_group.data(), sizeof lane_group);
  const I low4 = set1_i16(0x0F0F), ones = set1_i16(1);
  // One unit per period: each row's unit sum is scaled into its accumulator at once (x read from L1 as it is used),
  // so only the accumulators stay live across the rows. Temporaries: the nibble mask, ones, the weight vector, its
  // two nibble vectors, two x vectors, the sum and the scale.
  constexpr bool kFused = U == 1;
  constexpr int kRows = kFused ? block_rows(M, 0, 1, 9) : block_rows(M, 2 * U, 1, 8);
  // sc[(m·kRows + r)·groups + g]: the block's row r's scale of group g times x row m's scale d there, the one factor
  // an integer sum needs
  std::vector<float> sc(M * kRows * groups + kLanes, 0.f);
  std::vector<float> expanded;  // a row's scales and zeros from Q4_K headers
  const float* xscale = in.q8.scale.data();  // [M, groups]
  const float* xsums = in.q8.sums.data();    // [M, groups]
  // the scale of a period's sums: a broadcast where the period lies in one group, else each lane's group's
  auto period_scale = [&](const float* scr, int64_t p) {
    if constexpr (OneGroup) return set1(scr[p]);
    else return permute(load(scr + p * groups_per_period), lane_group);
  };
  over_rows<kRows>(n0, n1, [&](auto rows, int64_t n) {
    constexpr int R = decltype(rows)::value;
    float offset[M][R];  // Σ_g (z - 8·s)·d·Σq: each weight enters the integer sums as its code c = w/s - z/s + 8
    // bf16 scales and zeros: W = (c - 8)·s + z; fp32 ones (GGUF blocks): W = c·s + z
    const bool fp32 = s.fp32_scaled();
    const float zero_code = fp32 ? 0.f : 8.f;
    for (int r = 0; r < R; ++r) {
      const int64_t row = (n + r) * groups;
      const Fp32Groups own = fp32 ? fp32_groups(s, n + r, K, groups, expanded) : Fp32Groups{};
      F off[M];
      for (int m = 0; m < M; ++m) off[m] = zero();
      int64_t g = 0;
      for (; g + kLanes <= groups; g += kLanes) {
        const F sv = fp32 ? load(own.scale + g) : load_bf16(s.scales + row + g);
        const F coef = fnmadd(sv, set1(zero_code), fp32 ? load(own.zero + g) : load_bf16(s.zeros + row + g));
        for (int m = 0; m < M; ++m) {
          store(sc.data() + (m * kRows + r) * groups + g, mul(sv, load(xscale + m * groups + g)));
          off[m] = fmadd(coef, load(xsums + m * groups + g), off[m]);
        }
      }
      for (int m = 0; m < M; ++m) offset[m][r] = reduce_add(off[m]);
      for (; g < groups; ++g) {
        const float sv = fp32 ? own.scale[g] : bf16_to_float(s.scales[row + g]);
        const float zv = fp32 ? own.zero[g] : bf16_to_float(s.zeros[row + g]);
        for (int m = 0; m < M; ++m) {
          sc[(m * kRows + r) * groups + g] = sv * xscale[m * groups + g];
          offset[m][r] += (zv - zero_code * sv) * xsums[m * groups + g];
        }
      }
    }
    F acc[M][R];  // initialised apart from the loops above, so that the compiler keeps it in registers
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < R; ++r) acc[m][r] = zero();
    const uint8_t* block = s.w + n * row_bytes;
    const int8_t* x = in.x.data();
    for (int64_t p = 0; p < full_periods; ++p) {
      prefetch_ahead(block + p * U * kQ4UnitBytes * R, U * kQ4UnitBytes * R);
      if constexpr (kFused) {
        for (int r = 0; r < R; ++r) {
          const I v = load_i(block + r * row_bytes + p * kQ4UnitBytes);
          for (int m = 0; m < M; ++m) {
            const I sums = madd_i16(q4_unit_sums(v, low4, x + (m * in.units + p) * 2 * kQ4UnitBytes), ones);
            acc[m][r] = fmadd(to_float(sums), period_scale(sc.data() + (m * kRows + r) * groups, p), acc[m][r]);
          }
        }
        continue;
      }
      I isum[M][R];
      for (int r = 0; r < R; ++r)
        for (int u = 0; u < U; ++u) {
          const I v = load_i(block + r * row_bytes + (p * U + u) * kQ4UnitBytes);
          for (int m = 0; m < M; ++m) {
            const I part = q4_unit_sums(v, low4, x + (m * in.units + p * U + u) * 2 * kQ4UnitBytes);
            isum[m][r] = u == 0 ? part : add_i16(isum[m][r], part);
          }
        }
      for (int r = 0; r < R; ++r)
        for (int m = 0; m < M; ++m)
          acc[m][r] = fmadd(to_float(madd_i16(isum[m][r], ones)),
                            period_scale(sc.data() + (m * kRows + r) * groups, p), acc[m][r]);
    }
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < R; ++r) s.out[m * s.N + n + r] = reduce_add(acc[m][r]) + offset[m][r];
    if (tail < row_bytes)
      for (int m = 0; m < M; ++m)
        for (int r = 0; r < R; ++r) s.out[m * s.N + n + r] += q4_tail(in, s, K, G, tail, n + r, m);
  });
}

template <int M>
void q4_rows(const Q4Input& in, const Segment& s, int64_t K, int64_t G, int64_t n0, int64_t n1) {
  static_assert(128 / kQ4Unit <= 2, "groups of up to 128 columns span at most 2 units");
  if (q4_units_per_period(G) == 2) {
    q4_periods<M, 2, true>(in, s, K, G, n0, n1);
  } else if (G >= kQ4Unit) {
    q4_periods<M, 1, true>(in, s, K, G, n0, n1);
  } else {
    q4_periods<M, 1, false>(in, s, K, G, n0, n1);
  }
}

}  // namespace qwenrt::gemv
