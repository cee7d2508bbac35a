// Decode-time matrix-vector products (M <= 8 activation rows): the driver every instruction-set level shares.
// At decode each weight is read once per token, so speed is memory bandwidth: every weight row is streamed once for
// all M rows and rows are split over torch's intra-op threads. One call can take several weights that share the
// input (q/k/v, gate/up, ...): one thread split, one pass over x, fewer calls per token. The inner kernels are the
// level's: gemv_avx512bf16.h with AVX-512 BF16 and VNNI, gemv_simd.h otherwise.
//
// Weight formats (qwenrt/quant.py holds the stored layouts):
//   bf16  W [N, K]
//   int8  q [N, K] int8, s [N]: W = q·s
//   int4  q [N, K/2] uint8 (byte j of a group: column j low nibble, column j + G/2 high), s, z [N, K/G]:
//         W = (q - 8)·s + z
#include <ATen/core/Tensor.h>
#include "kernels.h"
#include "parallel.h"
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
#include "gemv_avx512bf16.h"
#else
#include "gemv_simd.h"
#endif

namespace {

using namespace qwenrt::gemv;
using namespace qwenrt::simd;

// ---- the driver -------------------------------------------------------------------------------------------------

template <typename Fn>
void dispatch_m(int64_t M, Fn&& f) {
  switch (M) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    default: f(std::integral_constant<int, 8>{}); break;
  }
}

// Row blocks of the listed segments in one list, so the threads split the total work of the call.
struct BlockList {
  std::vector<int64_t> seg, start;  // per block of kGrain rows
  static constexpr int64_t kGrain = 16;
  explicit BlockList(const std::vector<Segment>& segs) {
    for (size_t i = 0; i < segs.size(); ++i)
      for (int64_t n = 0; n < segs[i].N; n += kGrain) { seg.push_back(i); start.push_back(n); }
  }
};

void check_x(const at::Tensor& x, int64_t K) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= kMaxRows && x.size(1) == K && x.is_contiguous(),
              "gemv: x must be contiguous [M <= 8, K]");
}

// torch's float -> bf16: round to nearest even, NaN -> 0x7FC0 (written without branches, so loops of it vectorise)
inline uint16_t bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const uint16_t rounded = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  return f != f ? uint16_t{0x7FC0} : rounded;
}

inline float bf16_round(float f) { return bf16_to_float(bf16_bits(f)); }

// What the caller gets from a call's fp32 sums (one [M, N_i] slice per weight):
//   "fp32": the sums; "bf16": each rounded to bf16 once; "bf16_fp32": the same values held in fp32 (logits);
//   "swiglu": pairs of weights (gate, up) -> silu(gate)·up [M, N] per pair, rounded as torch's bf16 ops round (gate,
//   up, silu(gate) and the product each to bf16). Several pairs: an MoE token's experts in one call.
// Each thread finishes the rows it summed while they are in its cache, so no pass over the outputs is left for one
// thread at the end (the 0.8B's LM head alone is 248K of them).
struct Outputs {
  enum class Mode { kFp32, kBf16, kBf16Fp32, kSwiglu };
  Mode mode;
  int64_t M;
  std::vector<Segment> segs;       // out: the results' memory (fp32 modes) or `sums` (the others)
  std::vector<at::Tensor> results;
  std::unique_ptr<float[]> sums;   // bf16 and swiglu: the unrounded sums; every one is written once, so no zero fill

  Outputs(const at::Tensor& x, const std::vector<at::Tensor>& ws, const std::string& name) : M(x.size(0)) {
    if (name == "fp32") mode = Mode::kFp32;
    else if (name == "bf16") mode = Mode::kBf16;
    else if (name == "bf16_fp32") mode = Mode::kBf16Fp32;
    else if (name == "swiglu") mode = Mode::kSwiglu;
    else TORCH_CHECK(false, "gemv: output mode fp32, bf16, bf16_fp32 or swiglu");
    if (mode == Mode::kSwiglu) {
      TORCH_CHECK(ws.size() % 2 == 0, "gemv: swiglu takes pairs of weights (gate, up)");
      for (size_t i = 0; i < ws.size(); i += 2)
        TORCH_CHECK(ws[i].size(0) == ws[i + 1].size(0), "gemv: swiglu takes a gate and an up weight of the same rows");
    }
    const bool in_place = mode == Mode::kFp32 || mode == Mode::kBf16Fp32;
    int64_t total = 0;
    for (const auto& w : ws) {
      TORCH_CHECK(w.is_contiguous() && w.dim() == 2, "gemv: weights must be contiguous 2-D");
      total += M * w.size(0);
    }
    if (!in_place) sums.reset(new float[total]);
    int64_t offset = 0;
    for (const auto& w : ws) {
      float* out = in_place ? nullptr : sums.get() + offset;
      if (in_place) {
        results.push_back(at::empty({M, w.size(0)}, x.options().dtype(at::kFloat)));
        out = results.back().data_ptr<float>();
      } else if (mode == Mode::kBf16 || segs.size() % 2 == 0) {  // swiglu: one result per pair, made at its gate
        results.push_back(at::empty({M, w.size(0)}, x.options().dtype(at::kBFloat16)));
      }
      segs.push_back({static_cast<const uint8_t*>(w.data_ptr()), nullptr, nullptr, w.size(0), out});
      offset += M * w.size(0);
    }
  }

  // The segments whose row blocks the threads share: for swiglu each pair's gate, each block then summed through
  // both weights of the pair.
  std::vector<Segment> listed() const {
    if (mode != Mode::kSwiglu) return segs;
    std::vector<Segment> gates;
    for (size_t i = 0; i < segs.size(); i += 2) gates.push_back(segs[i]);
    return gates;
  }

  // The segment of listed segment i's rows (for swiglu, its pair's first: the gate)
  size_t segment(size_t i) const { return mode == Mode::kSwiglu ? 2 * i : i; }

  // Rows [n0, n1) of listed segment i are summed (for swiglu, through both weights of its pair): finish them.
  void finish_rows(size_t i, int64_t n0, int64_t n1) const {
    const Segment& s = segs[segment(i)];
    for (int64_t m = 0; m < M; ++m) {
      const int64_t a = m * s.N + n0, b = m * s.N + n1;
      if (mode == Mode::kBf16Fp32) {
        for (int64_t j = a; j < b; ++j) s.out[j] = bf16_round(s.out[j]);
      } else if (mode == Mode::kBf16) {
        auto* y = reinterpret_cast<uint16_t*>(results[i].data_ptr<at::BFloat16>());
        for (int64_t j = a; j < b; ++j) y[j] = bf16_bits(s.out[j]);
      } else if (mode == Mode::kSwiglu) {
        auto* y = reinterpret_cast<uint16_t*>(results[i].data_ptr<at::BFloat16>());
        const float *G = segs[2 * i].out, *U = segs[2 * i + 1].out;
        int64_t j = a;
        for (; kFma && j + kLanes <= b; j += kLanes) {
          const F g = round_bf16(load(G + j));
          store_bf16(y + j, mul(round_bf16(silu(g)), round_bf16(load(U + j))));
        }
        for (; j < b; ++j) {
          const float g = bf16_round(G[j]);
          const float act = bf16_round(g / (1.0f + std::exp(-g)));
          y[j] = bf16_bits(act * bf16_round(U[j]));
        }
      }
    }
  }
};

// Sum the row blocks of the call's listed segments over the threads, each range finished by the thread that summed
// it. rows_fn(segment, n0, n1) sums rows [n0, n1) of one weight; row_work: the multiply-adds of one weight row
// (K·M), a small call staying on the calling thread.
template <typename RowFn>
void run_blocks(const Outputs& outs, int64_t row_work, RowFn&& rows_fn) {
  const std::vector<Segment> listed = outs.listed();
  const bool pair = outs.mode == Outputs::Mode::kSwiglu;
  BlockList bl(listed);
  const int64_t total = static_cast<int64_t>(bl.seg.size());
  qwenrt::parallel_for_work(0, total, BlockList::kGrain * row_work * (pair ? 2 : 1), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1;) {  // merge consecutive blocks of one segment into one row range
      const int64_t i = bl.seg[b], n0 = bl.start[b];
      int64_t e = b + 1;
      while (e < b1 && bl.seg[e] == i) ++e;
      const int64_t n1 = std::min(listed[i].N, bl.start[e - 1] + BlockList::kGrain);
      rows_fn(outs.segs[outs.segment(i)], n0, n1);
      if (pair) rows_fn(outs.segs[outs.segment(i) + 1], n0, n1);
      outs.finish_rows(i, n0, n1);
      b = e;
    }
  });
}

}  // namespace

// x [M, K] bf16 · each w [N_i, K] bf16 -> [M, N_i] per weight (see Outputs for `mode`)
std::vector<at::Tensor> gemv_bf16(at::Tensor x, std::vector<at::Tensor> ws, std::string mode) {
  TORCH_CHECK(!ws.empty(), "gemv_bf16: no weights");
  const int64_t K = ws[0].size(1);
  check_x(x, K);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "gemv_bf16: bf16 input");
  for (const auto& w : ws) TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.size(1) == K, "gemv_bf16: weights");
  Outputs outs(x, ws, mode);
  const auto in = bf16_input(x);
  dispatch_m(x.size(0), [&](auto m) {
    run_blocks(outs, K * m, [&](const Segment& s, int64_t n0, int64_t n1) { bf16_rows<decltype(m)::value>(in, s, K, n0, n1); });
  });
  return outs.results;
}

// x [M, K] bf16 · int8 q_i [N_i, K] with bf16 row scales s_i [N_i]
std::vector<at::Tensor> gemv_q8(at::Tensor x, std::vector<at::Tensor> qs, std::vector<at::Tensor> scales,
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
  const FixedPoint in = to_fixed_point(x, kQ8Block);
  dispatch_m(x.size(0), [&](auto m) {
    run_blocks(outs, K * m, [&](const Segment& s, int64_t n0, int64_t n1) { q8_rows<decltype(m)::value>(in, s, K, n0, n1); });
  });
  return outs.results;
}

namespace {

// Point each segment at its weight's scales and zeros [N_i, K/G], checked: bf16 ones (`scales`, `zeros`) or fp32
// ones (`fscales`, `fzeros`: GGUF blocks; zeros optional for int8).
void set_groups(std::vector<Segment>& segs, const std::vector<at::Tensor>& scales,
                const std::vector<at::Tensor>& zeros, int64_t K, int64_t G, bool fp32, const char* what) {
  TORCH_CHECK(scales.size() == segs.size() && (zeros.empty() || zeros.size() == segs.size()), what,
              ": scales (and zeros) per weight");
  const auto dtype = fp32 ? at::kFloat : at::kBFloat16;
  for (size_t i = 0; i < segs.size(); ++i) {
    std::vector<const at::Tensor*> pieces{&scales[i]};
    if (!zeros.empty()) pieces.push_back(&zeros[i]);
    for (const auto* t : pieces)
      TORCH_CHECK(t->scalar_type() == dtype && t->is_contiguous() && t->numel() == segs[i].N * (K / G), what,
                  fp32 ? ": fp32" : ": bf16", " scales and zeros [N, K/G]");
    if (fp32) {
      segs[i].fscales = scales[i].data_ptr<float>();
      segs[i].fzeros = zeros.empty() ? nullptr : zeros[i].data_ptr<float>();
    } else {
      segs[i].scales = reinterpret_cast<const uint16_t*>(scales[i].data_ptr<at::BFloat16>());
      segs[i].zeros = reinterpret_cast<const uint16_t*>(zeros[i].data_ptr<at::BFloat16>());
    }
  }
}

// block headers per weight (Q4_K's or Q4_0's, Segment::q4k, q40)
void set_headers(std::vector<Segment>& segs, const std::vector<at::Tensor>& headers, int64_t K) {
  TORCH_CHECK(headers.size() == segs.size(), "gemv_q4k: block headers per weight");
  for (size_t i = 0; i < segs.size(); ++i) set_block_headers(segs[i], headers[i], segs[i].N, K, "gemv_q4k");
}

// bf16: qwenrt's int4; fp32: GGUF's 4-bit blocks with fp32 scales and zeros; q4k: GGUF block headers (`scales`)
enum class Q4Scales { kBf16, kFp32, kQ4k };

std::vector<at::Tensor> q4_call(const at::Tensor& x, const std::vector<at::Tensor>& qs,
                                const std::vector<at::Tensor>& scales, const std::vector<at::Tensor>& zeros, int64_t G,
                                const std::string& mode, Q4Scales kind) {
  const char* what = kind == Q4Scales::kBf16 ? "gemv_q4" : kind == Q4Scales::kFp32 ? "gemv_q4g" : "gemv_q4k";
  TORCH_CHECK(!qs.empty() && (kind == Q4Scales::kQ4k || zeros.size() == qs.size()), what, ": pieces per weight");
  const int64_t K = 2 * qs[0].size(1);
  check_x(x, K);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, what, ": bf16 input");
  TORCH_CHECK((G == 32 || G == 64 || G == 128) && K % G == 0, what, ": group size / K");
  for (const auto& q : qs)
    TORCH_CHECK(q.scalar_type() == at::kByte && 2 * q.size(1) == K, what, ": uint8 weights [N, K/2]");
  Outputs outs(x, qs, mode);
  if (kind == Q4Scales::kQ4k) {
    set_headers(outs.segs, scales, K);
  } else {
    set_groups(outs.segs, scales, zeros, K, G, kind == Q4Scales::kFp32, what);
  }
  const Q4Input in = q4_input(x, G);
  dispatch_m(x.size(0), [&](auto m) {
    run_blocks(outs, K * m, [&](const Segment& s, int64_t n0, int64_t n1) {
      q4_rows<decltype(m)::value>(in, s, K, G, n0, n1);
    });
  });
  return outs.results;
}

}  // namespace

// x [M, K] bf16 · int4 q_i [N_i, K/2] with bf16 scales/zeros [N_i, K/G] (qwenrt's stored layout); K % G == 0
std::vector<at::Tensor> gemv_q4(at::Tensor x, std::vector<at::Tensor> qs, std::vector<at::Tensor> scales,
                                std::vector<at::Tensor> zeros, int64_t G, std::string mode) {
  return q4_call(x, qs, scales, zeros, G, mode, Q4Scales::kBf16);
}

// x [M, K] bf16 · int4 q_i [N_i, K/2] with fp32 scales and zeros [N_i, K/32]: W = q·s + z (GGUF's 4-bit blocks)
std::vector<at::Tensor> gemv_q4g(at::Tensor x, std::vector<at::Tensor> qs, std::vector<at::Tensor> scales,
                                 std::vector<at::Tensor> zeros, std::string mode) {
  return q4_call(x, qs, scales, zeros, 32, mode, Q4Scales::kFp32);
}

// x [M, K] bf16 · int4 q_i [N_i, K/2] (qwenrt's layout, groups of 32) whose scales and zeros are GGUF block headers:
// Q4_K's [N_i, K/256, 16] (fp16 d, dmin; 6-bit scale and min per 32: W = q·d·sc - dmin·m) or Q4_0's fp16 d
// [N_i, K/32] (W = (q - 8)·d): the format held in its file's size
std::vector<at::Tensor> gemv_q4k(at::Tensor x, std::vector<at::Tensor> qs, std::vector<at::Tensor> headers,
                                 std::string mode) {
  return q4_call(x, qs, headers, {}, 32, mode, Q4Scales::kQ4k);
}

// x [M, K] bf16 · int8 q_i [N_i, K] with fp32 scales (and zeros, or none) [N_i, K/G], G = 16 or 32: W = q·s + z
// (GGUF's 8-, 6- and 5-bit blocks); K % 32 == 0
std::vector<at::Tensor> gemv_q8g(at::Tensor x, std::vector<at::Tensor> qs, std::vector<at::Tensor> scales,
                                 std::vector<at::Tensor> zeros, int64_t G, std::string mode) {
  TORCH_CHECK(!qs.empty(), "gemv_q8g: no weights");
  const int64_t K = qs[0].size(1);
  check_x(x, K);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "gemv_q8g: bf16 input");
  TORCH_CHECK((G == 16 || G == 32) && K % 32 == 0, "gemv_q8g: group size 16 or 32, K a multiple of 32");
  for (const auto& q : qs) TORCH_CHECK(q.scalar_type() == at::kChar && q.size(1) == K, "gemv_q8g: int8 weights [N, K]");
  Outputs outs(x, qs, mode);
  set_groups(outs.segs, scales, zeros, K, G, true, "gemv_q8g");
  const FixedPoint in = to_fixed_point(x, kQ8Block);
  const std::vector<float> xsums = zeros.empty() ? std::vector<float>() : group_sums(x, G);
  dispatch_m(x.size(0), [&](auto m) {
    run_blocks(outs, K * m, [&](const Segment& s, int64_t n0, int64_t n1) {
      q8g_rows<decltype(m)::value>(in, xsums.data(), s, K, G, n0, n1);
    });
  });
  return outs.results;
}

namespace {

// row n of an int4 weight (stored layout, K columns in groups of G) dequantized into row [K] fp32
void q4_row(const uint8_t* Q, const uint16_t* S, const uint16_t* Z, int64_t n, int64_t K, int64_t G, float* row) {
  const int64_t groups = K / G;
  for (int64_t g = 0; g < groups; ++g) {
    const float sc = bf16_to_float(S[n * groups + g]), z = bf16_to_float(Z[n * groups + g]);
    const uint8_t* bytes = Q + n * (K / 2) + g * (G / 2);
    for (int64_t o = 0; o < G / 2; ++o) {
      row[g * G + o] = (static_cast<float>(bytes[o] & 15) - 8.f) * sc + z;
      row[g * G + G / 2 + o] = (static_cast<float>(bytes[o] >> 4) - 8.f) * sc + z;
    }
  }
}

// row [K] fp32 into row n of out [*, K] (fp32, or bf16 rounded once)
void store_row(const float* row, const at::Tensor& out, int64_t n, int64_t K) {
  if (out.scalar_type() == at::kFloat) {
    std::memcpy(out.data_ptr<float>() + n * K, row, K * sizeof(float));
  } else {
    at::BFloat16* o = out.data_ptr<at::BFloat16>() + n * K;
    for (int64_t k = 0; k < K; ++k) o[k] = static_cast<at::BFloat16>(row[k]);
  }
}

void check_out(const at::Tensor& out, int64_t N, int64_t K, const char* what) {
  const auto dtype = out.scalar_type();
  TORCH_CHECK((dtype == at::kBFloat16 || dtype == at::kFloat) && out.dim() == 2 && out.size(0) == N &&
              out.size(1) == K && out.is_contiguous(), what, ": out is a contiguous bf16 or fp32 [N, K]");
}

}  // namespace

// int4 stored layout -> W [N, K] written into out (bf16 or fp32), returned: prefill multiplies by it with torch's
// GEMM (fp32 slices into one reused buffer, qwenrt/ops/linear.py).
at::Tensor dequantize_q4(at::Tensor q, at::Tensor scales, at::Tensor zeros, int64_t G, at::Tensor out) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kByte && q.is_contiguous(), "dequantize_q4: uint8 [N, K/2]");
  const int64_t N = q.size(0), K = 2 * q.size(1), groups = K / G;
  TORCH_CHECK(K % G == 0 && scales.numel() == N * groups && zeros.numel() == N * groups &&
              scales.scalar_type() == at::kBFloat16 && zeros.scalar_type() == at::kBFloat16 &&
              scales.is_contiguous() && zeros.is_contiguous(), "dequantize_q4: bf16 scales/zeros [N, K/G]");
  check_out(out, N, K, "dequantize_q4");
  const uint8_t* Q = q.data_ptr<uint8_t>();
  const auto* S = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::BFloat16>());
  const auto* Z = reinterpret_cast<const uint16_t*>(zeros.data_ptr<at::BFloat16>());
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    std::vector<float> row(K);
    for (int64_t n = n0; n < n1; ++n) {
      q4_row(Q, S, Z, n, K, G, row.data());
      store_row(row.data(), out, n, K);
    }
  });
  return out;
}

// Rows `ids` of an int8 weight (zeros None) or an int4 one (stored layout, groups of G), dequantized into out [N, K]
// (bf16 or fp32), returned: a tied model's token lookup in its quantized head, each value as dequantize_q4 gives it.
at::Tensor dequantize_rows(at::Tensor ids, at::Tensor q, at::Tensor scales, c10::optional<at::Tensor> zeros,
                           int64_t G, at::Tensor out) {
  const bool q4 = zeros.has_value();
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong && ids.is_contiguous(), "dequantize_rows: int64 ids [N]");
  TORCH_CHECK(q.dim() == 2 && q.is_contiguous() && q.scalar_type() == (q4 ? at::kByte : at::kChar),
              "dequantize_rows: int8 [V, K] or uint8 [V, K/2] weights");
  const int64_t N = ids.size(0), V = q.size(0), K = q4 ? 2 * q.size(1) : q.size(1), groups = q4 ? K / G : 1;
  for (const auto* t : {&scales, q4 ? &*zeros : &scales})
    TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->is_contiguous() && t->numel() == V * groups &&
                (!q4 || K % G == 0), "dequantize_rows: bf16 scales (and zeros) [V] or [V, K/G]");
  check_out(out, N, K, "dequantize_rows");
  const int64_t* I = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < N; ++i)
    TORCH_CHECK(I[i] >= 0 && I[i] < V, "dequantize_rows: id ", I[i], " outside the table's ", V, " rows");
  const auto* S = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::BFloat16>());
  qwenrt::parallel_for_work(0, N, K, [&](int64_t i0, int64_t i1) {
    std::vector<float> row(K);
    for (int64_t i = i0; i < i1; ++i) {
      if (q4) {
        q4_row(q.data_ptr<uint8_t>(), S, reinterpret_cast<const uint16_t*>(zeros->data_ptr<at::BFloat16>()), I[i], K,
               G, row.data());
      } else {
        const int8_t* qi = q.data_ptr<int8_t>() + I[i] * K;
        const float sc = bf16_to_float(S[I[i]]);
        for (int64_t k = 0; k < K; ++k) row[k] = static_cast<float>(qi[k]) * sc;
      }
      store_row(row.data(), out, i, K);
    }
  });
  return out;
}

// Rows `ids` of a weight in fp32-scaled groups (GGUF blocks held exactly): int8 q [V, K] (G = 16 or 32) or int4
// q [V, K/2] (G = 32), fp32 scales and zeros (none: 0) [V, K/G] or, for int4, block headers (Q4_K's uint8
// [V, K/256, 16], Q4_0's fp16 [V, K/32]) as `scales`; W = q·s + z, into out [N, K] (bf16 or fp32): the token lookup of a table held so, and exact fp32 slices.
at::Tensor dequantize_group_rows(at::Tensor ids, at::Tensor q, at::Tensor scales, c10::optional<at::Tensor> zeros,
                                 int64_t G, at::Tensor out) {
  const bool q4 = q.scalar_type() == at::kByte;
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong && ids.is_contiguous(),
              "dequantize_group_rows: int64 ids [N]");
  TORCH_CHECK(q.dim() == 2 && q.is_contiguous() && (q4 || q.scalar_type() == at::kChar) && (G == 16 || G == 32) &&
              (!q4 || G == 32), "dequantize_group_rows: int8 [V, K] or uint8 [V, K/2] weights, groups of 16 or 32");
  const int64_t N = ids.size(0), V = q.size(0), K = q4 ? 2 * q.size(1) : q.size(1), groups = K / G;
  const bool headers = scales.scalar_type() == at::kByte || scales.scalar_type() == at::kHalf;  // Q4_K's, Q4_0's
  Segment blocks{};
  if (headers) {
    TORCH_CHECK(q4, "dequantize_group_rows: block headers are int4's");
    set_block_headers(blocks, scales, V, K, "dequantize_group_rows");
  } else {
    for (const at::Tensor* t : {&scales, zeros ? &*zeros : &scales})
      TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == V * groups && K % G == 0,
                  "dequantize_group_rows: fp32 scales (and zeros) [V, K/G]");
  }
  check_out(out, N, K, "dequantize_group_rows");
  const int64_t* I = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < N; ++i)
    TORCH_CHECK(I[i] >= 0 && I[i] < V, "dequantize_group_rows: id ", I[i], " outside the table's ", V, " rows");
  const std::vector<float> no_zeros(groups, 0.f);
  qwenrt::parallel_for_work(0, N, K, [&](int64_t i0, int64_t i1) {
    std::vector<float> row(K), expanded(2 * groups);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t v = I[i];
      const float *S = expanded.data(), *Z = expanded.data() + groups;  // row v's scales and zeros
      if (headers) {
        fp32_groups(blocks, v, K, groups, expanded);
      } else {
        S = scales.data_ptr<float>() + v * groups;
        Z = zeros ? zeros->data_ptr<float>() + v * groups : no_zeros.data();
      }
      for (int64_t g = 0; g < groups; ++g) {
        const float sc = S[g], z = Z[g];
        float* r = row.data() + g * G;
        if (q4) {
          const uint8_t* bytes = q.data_ptr<uint8_t>() + v * (K / 2) + g * (G / 2);
          for (int64_t o = 0; o < G / 2; ++o) {
            r[o] = static_cast<float>(bytes[o] & 15) * sc + z;
            r[o + G / 2] = static_cast<float>(bytes[o] >> 4) * sc + z;
          }
        } else {
          const int8_t* codes = q.data_ptr<int8_t>() + v * K + g * G;
          for (int64_t o = 0; o < G; ++o) r[o] = static_cast<float>(codes[o]) * sc + z;
        }
      }
      store_row(row.data(), out, i, K);
    }
  });
  return out;
}
