// Zero-centred RMSNorm, y = x·rsqrt(mean(x²) + eps)·(1 + w), computed in fp32 and rounded to x's dtype once,
// optionally fused with the residual add that precedes it (x ← x + h, rounded to x's dtype, as torch adds).
#include <ATen/core/Tensor.h>
#include "kernels.h"
#include "parallel.h"
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>
#include <cmath>

namespace {

// With H: S = X + H (rounded to T) is what gets normalised; without, X itself.
template <typename T>
void norm_rows(const T* X, const T* H, T* S, const float* W, T* Y, int64_t rows, int64_t D, float eps) {
  qwenrt::parallel_for_work(0, rows, D, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* x = X + r * D;
      if (H != nullptr) {
        const T* h = H + r * D;
        T* s = S + r * D;
        for (int64_t i = 0; i < D; ++i) s[i] = static_cast<T>(static_cast<float>(x[i]) + static_cast<float>(h[i]));
        x = s;
      }
      double ss = 0.0;  // a double sum: as accurate as torch's blocked fp32 reduction, whatever D
      for (int64_t i = 0; i < D; ++i) { const double v = static_cast<float>(x[i]); ss += v * v; }
      const float inv = 1.0f / std::sqrt(static_cast<float>(ss / D) + eps);
      T* y = Y + r * D;
      for (int64_t i = 0; i < D; ++i) y[i] = static_cast<T>(static_cast<float>(x[i]) * inv * (1.0f + W[i]));
    }
  });
}

}  // namespace

// x [rows, D] bf16 or fp32, w [D] fp32. With `residual` h: returns (x + h, norm(x + h)); else (x, norm(x)).
std::vector<at::Tensor> rms_norm(at::Tensor x, c10::optional<at::Tensor> residual, at::Tensor w,
                                    double eps) {
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && w.scalar_type() == at::kFloat, "rms_norm: bad inputs");
  const int64_t D = x.size(-1), rows = x.numel() / D;
  TORCH_CHECK(w.numel() == D, "rms_norm: weight size");
  auto y = at::empty_like(x);
  auto sum = x;
  const void* h = nullptr;
  if (residual.has_value()) {
    TORCH_CHECK(residual->is_contiguous() && residual->scalar_type() == x.scalar_type() &&
                residual->numel() == x.numel(), "rms_norm: residual must match x");
    h = residual->data_ptr();
    sum = at::empty_like(x);
  }
  if (x.scalar_type() == at::kBFloat16) {
    using T = at::BFloat16;
    norm_rows(x.data_ptr<T>(), static_cast<const T*>(h), sum.data_ptr<T>(), w.data_ptr<float>(), y.data_ptr<T>(),
              rows, D, static_cast<float>(eps));
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "rms_norm: bf16 or fp32 only");
    norm_rows(x.data_ptr<float>(), static_cast<const float*>(h), sum.data_ptr<float>(), w.data_ptr<float>(),
              y.data_ptr<float>(), rows, D, static_cast<float>(eps));
  }
  return {sum, y};
}
