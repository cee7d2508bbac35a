// Splitting a kernel's work over torch's threads only where it pays: waking the other thread and meeting it at the
// end costs microseconds, more than half of a small kernel's work (qwenrt-tiny's projections, a few rows' norms,
// one sequence's attention heads), and on a shared machine a descheduled thread stalls the other. Work is counted
// in multiply-adds (or elements touched, for elementwise loops). qwenrt-tiny, 2 threads, same process: a batch of
// 2 decodes 1.08-1.15x faster, batch 1 and the 0.8B within the noise (AVX2 EPYC).
#pragma once
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>

namespace qwenrt {

constexpr int64_t kMinTaskWork = 1 << 18;  // ~10 us of one core: a call with no more runs on the calling thread

// at::parallel_for over [begin, end), each item costing about `work`: split over the threads only when all of it is
// more than kMinTaskWork (then in even runs, as at::parallel_for splits).
template <typename F>
void parallel_for_work(int64_t begin, int64_t end, int64_t work, const F& f) {
  at::parallel_for(begin, end, std::max<int64_t>(1, kMinTaskWork / std::max<int64_t>(1, work)), f);
}

}  // namespace qwenrt
