// The 8-bit KV cache's row format (qwenrt/cache.py writes the same from torch): a store [.., cap, Dh + 4] int8 per
// KV head, row s = the Dh int8 values of token s, then their fp32 scale in the last 4 bytes; value d = q[d]·scale,
// scale = max|x| / 127 over the row (one per token and head), q = round-half-even(x / scale).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace qwenrt {

constexpr int64_t kScaleBytes = 4;

inline float row_scale(const int8_t* row, int64_t D) {
  float s;
  std::memcpy(&s, row + D, sizeof s);
  return s;
}

// x [D] -> out [D + 4]: the int8 values and the fp32 scale; IEEE division and nearbyint, as torch's x / s, round
template <typename T>
void quantize_row(const T* x, int64_t D, int8_t* out) {
  float amax = 0.f;
  for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(static_cast<float>(x[d])));
  const float scale = amax / 127.f, div = scale > 0.f ? scale : 1.f;
  for (int64_t d = 0; d < D; ++d)
    out[d] = static_cast<int8_t>(std::clamp(std::nearbyint(static_cast<float>(x[d]) / div), -127.f, 127.f));
  std::memcpy(out + D, &scale, sizeof scale);
}

}  // namespace qwenrt
