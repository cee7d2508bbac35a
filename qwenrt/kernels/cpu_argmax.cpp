// Greedy decoding's pick: each row's first largest logit, as torch.argmax. torch's CPU argmax along a row runs at
// ~1 ns an element, 0.27 ms for the 0.8B's 248K-token head (1.3% of an int4 step, AVX2 EPYC); this is one vector
// pass (~8x faster).
#include <ATen/core/Tensor.h>
#include "kernels.h"
#include "simd.h"
#include <ATen/ops/empty.h>
#include <cmath>
#include <limits>

namespace {

// torch's rule, element by element: the first NaN, else the first largest.
int64_t argmax_scalar(const float* row, int64_t V) {
  int64_t best = 0;
  for (int64_t i = 0; i < V; ++i) {
    if (std::isnan(row[i])) return i;
    if (row[i] > row[best]) best = i;
  }
  return best;
}

// Per lane its largest value and the first block where it appeared (a block: kLanes elements; its index held in
// fp32, exact below 2^24 blocks); then the smallest index among the lanes that hold the row's largest. A row with a
// NaN or an infinity (x - x is NaN for both) goes the scalar way.
int64_t argmax_row(const float* row, int64_t V) {
  using namespace qwenrt::simd;
  const int64_t blocks = V / kLanes;
  if (blocks == 0 || blocks >= (int64_t{1} << 24)) return argmax_scalar(row, V);
  F best = load(row), where = zero(), nonfinite = sub(best, best);
  for (int64_t b = 1; b < blocks; ++b) {
    const F v = load(row + b * kLanes);
    nonfinite = add(nonfinite, sub(v, v));
    where = select_above(v, best, where, set1(static_cast<float>(b)));
    best = max(v, best);
  }
  float lane_best[kLanes], lane_where[kLanes], check[kLanes];
  store(lane_best, best);
  store(lane_where, where);
  store(check, nonfinite);
  float top = -std::numeric_limits<float>::infinity();
  int64_t index = -1;
  for (int l = 0; l < kLanes; ++l) {
    if (std::isnan(check[l])) return argmax_scalar(row, V);
    const int64_t i = static_cast<int64_t>(lane_where[l]) * kLanes + l;
    if (lane_best[l] > top || (lane_best[l] == top && i < index)) top = lane_best[l], index = i;
  }
  for (int64_t i = blocks * kLanes; i < V; ++i) {  // the tail comes after every block: only a larger one wins
    if (std::isnan(row[i])) return argmax_scalar(row, V);
    if (row[i] > top) top = row[i], index = i;
  }
  return index;
}

}  // namespace

// x [B, V] fp32 -> [B] int64
at::Tensor argmax_rows(at::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) > 0,
              "argmax_rows: x must be contiguous fp32 [B, V > 0]");
  const int64_t B = x.size(0), V = x.size(1);
  auto out = at::empty({B}, x.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  const float* X = x.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b) o[b] = argmax_row(X + b * V, V);
  return out;
}
