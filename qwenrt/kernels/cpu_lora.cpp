// LoRA adapters' products at decode (qwenrt/served_adapters.py): per row, t = A·x then y += scale·B·t in fp32 and
// one rounding of y to bf16. The listed rows share each read of A and Bᵀ (an adapter's fp32 factors are as large as
// a bf16 weight's 1/40 at rank 16: read once per row they cost more than the base's GEMV); every row's sums run in
// the same order whatever the others, so a row's result does not depend on the batch.
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <vector>

#include "kernels.h"
#include "parallel.h"
#include "simd.h"

using namespace qwenrt::simd;

namespace {

constexpr int64_t kGroup = 8;  // rows whose accumulators one pass over Bᵀ keeps in registers

inline float bf16_to_float(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// t[i·r + j] = A[j]·x[rows[i]] for the n rows (A [r, K] fp32, x rows bf16 of stride K)
void shrink(const float* a, const uint16_t* X, const int64_t* rows, int64_t n, int64_t r, int64_t K, float* t) {
  qwenrt::parallel_for_work(0, r, n * K, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) {
      const float* aj = a + j * K;
      for (int64_t i = 0; i < n; ++i) {
        const uint16_t* xm = X + rows[i] * K;
        F acc = zero();
        int64_t k = 0;
        for (; k + kLanes <= K; k += kLanes) acc = fmadd(load(aj + k), load_bf16(xm + k), acc);
        float sum = reduce_add(acc);
        for (; k < K; ++k) sum += aj[k] * bf16_to_float(xm[k]);
        t[i * r + j] = sum;
      }
    }
  });
}

// y[rows[i]] = bf16(y + scale·Σ_j Bt[j]·t[i·r + j]) (Bt [r, N] fp32, y rows bf16 of stride ldy)
void expand(const float* bt, const float* t, const int64_t* rows, int64_t n, int64_t r, int64_t N, float scale,
            uint16_t* Y, int64_t ldy) {
  const int64_t blocks = N / kLanes;
  qwenrt::parallel_for_work(0, blocks, n * r * kLanes, [&](int64_t b0, int64_t b1) {
    for (int64_t g = 0; g < n; g += kGroup) {
      const int64_t m = std::min(kGroup, n - g);
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t c = b * kLanes;
        F d[kGroup];
        for (int64_t i = 0; i < m; ++i) d[i] = zero();
        for (int64_t j = 0; j < r; ++j) {
          const F w = load(bt + j * N + c);
          for (int64_t i = 0; i < m; ++i) d[i] = fmadd(w, set1(t[(g + i) * r + j]), d[i]);
        }
        for (int64_t i = 0; i < m; ++i) {
          uint16_t* ym = Y + rows[g + i] * ldy + c;
          store_bf16(ym, add(load_bf16(ym), mul(d[i], set1(scale))));
        }
      }
    }
  });
  for (int64_t c = blocks * kLanes; c < N; ++c) {  // the columns past the last whole vector
    for (int64_t i = 0; i < n; ++i) {
      float d = 0.f;
      for (int64_t j = 0; j < r; ++j) d += bt[j * N + c] * t[i * r + j];
      uint16_t* ym = Y + rows[i] * ldy + c;
      *ym = c10::BFloat16(bf16_to_float(*ym) + d * scale).x;
    }
  }
}

}  // namespace

void lora_add_rows(at::Tensor x, at::Tensor y, at::Tensor A, at::Tensor Bt, double scale, at::Tensor rows) {
  const int64_t K = x.size(1), N = y.size(1), r = A.size(0);
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0) && x.scalar_type() == at::kBFloat16 &&
              y.scalar_type() == at::kBFloat16 && x.is_contiguous() && y.stride(1) == 1,
              "lora_add_rows: x [M, K] contiguous and y [M, N] (rows contiguous) bf16");
  TORCH_CHECK(A.dim() == 2 && A.size(1) == K && Bt.dim() == 2 && Bt.size(0) == r && Bt.size(1) == N &&
              A.scalar_type() == at::kFloat && Bt.scalar_type() == at::kFloat && A.is_contiguous() &&
              Bt.is_contiguous(), "lora_add_rows: A [r, K] and Bt [r, N] contiguous fp32");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.is_contiguous(),
              "lora_add_rows: rows int64 [n]");
  const int64_t n = rows.numel();
  const int64_t* listed = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(0 <= listed[i] && listed[i] < x.size(0), "lora_add_rows: row ", listed[i], " out of range");
  std::vector<float> t(n * r);
  shrink(A.data_ptr<float>(), reinterpret_cast<const uint16_t*>(x.data_ptr()), listed, n, r, K, t.data());
  expand(Bt.data_ptr<float>(), t.data(), listed, n, r, N, static_cast<float>(scale),
         reinterpret_cast<uint16_t*>(y.data_ptr()), y.stride(0));
}
