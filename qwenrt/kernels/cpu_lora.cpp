// LoRA adapters' products at decode (qwenrt/served_adapters.py): per row, t = A·x then y += scale·B·t in fp32 and
// one rounding of y to bf16. A row at a time with sums in a fixed order: a row's result does not depend on the batch.
// r·(K + N) multiply-adds a row (rank 16 on a 1024 x 6144 projection: 0.1 M), on the calling thread.
#include <ATen/core/Tensor.h>

#include <vector>

#include "kernels.h"
#include "simd.h"

using namespace qwenrt::simd;

void lora_add_rows(at::Tensor x, at::Tensor y, at::Tensor A, at::Tensor Bt, double scale, at::Tensor rows) {
  const int64_t K = x.size(1), N = y.size(1), r = A.size(0);
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0) && x.scalar_type() == at::kBFloat16 &&
              y.scalar_type() == at::kBFloat16 && x.is_contiguous() && y.stride(1) == 1,
              "lora_add_rows: x [M, K] contiguous and y [M, N] (rows contiguous) bf16");
  TORCH_CHECK(A.dim() == 2 && A.size(1) == K && Bt.dim() == 2 && Bt.size(0) == r && Bt.size(1) == N &&
              A.scalar_type() == at::kFloat && Bt.scalar_type() == at::kFloat && A.is_contiguous() &&
              Bt.is_contiguous(), "lora_add_rows: A [r, K] and Bt [r, N] contiguous fp32");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1, "lora_add_rows: rows int64 [n]");
  const auto* X = reinterpret_cast<const uint16_t*>(x.data_ptr());
  auto* Y = reinterpret_cast<uint16_t*>(y.data_ptr());
  const float* a = A.data_ptr<float>();
  const float* bt = Bt.data_ptr<float>();
  const float s = static_cast<float>(scale);
  std::vector<float> t(r);
  for (const int64_t m : std::vector<int64_t>(rows.data_ptr<int64_t>(), rows.data_ptr<int64_t>() + rows.numel())) {
    TORCH_CHECK(0 <= m && m < x.size(0), "lora_add_rows: row ", m, " out of range");
    const uint16_t* xm = X + m * K;
    for (int64_t j = 0; j < r; ++j) {  // t = A·x
      const float* aj = a + j * K;
      F acc = zero();
      int64_t k = 0;
      for (; k + kLanes <= K; k += kLanes) acc = fmadd(load(aj + k), load_bf16(xm + k), acc);
      float sum = reduce_add(acc);
      for (; k < K; ++k) {
        uint32_t bits = static_cast<uint32_t>(xm[k]) << 16;
        float v;
        std::memcpy(&v, &bits, sizeof v);
        sum += aj[k] * v;
      }
      t[j] = sum;
    }
    uint16_t* ym = Y + m * y.stride(0);
    int64_t n = 0;
    for (; n + kLanes <= N; n += kLanes) {  // y = bf16(y + scale·Bᵀt)
      F d = zero();
      for (int64_t j = 0; j < r; ++j) d = fmadd(load(bt + j * N + n), set1(t[j]), d);
      store_bf16(ym + n, add(load_bf16(ym + n), mul(d, set1(s))));
    }
    for (; n < N; ++n) {
      float d = 0.f;
      for (int64_t j = 0; j < r; ++j) d += bt[j * N + n] * t[j];
      uint32_t bits = static_cast<uint32_t>(ym[n]) << 16;
      float v;
      std::memcpy(&v, &bits, sizeof v);
      ym[n] = c10::BFloat16(v + d * s).x;
    }
  }
}
