// What the C++ CPU kernels share: rows widened to fp32 and narrowed back, vectorized.
//
// bf16 is the top half of an fp32, so widening is a shift and narrowing a round-to-nearest-even
// of the low half; both loops vectorize. Half goes through c10's conversions.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>

namespace helexa_cpu {

using Vec = at::vec::Vectorized<float>;

inline void widen(const float* __restrict src, float* __restrict dst, int64_t n) {
  std::memcpy(dst, src, n * sizeof(float));
}

inline void widen(const c10::BFloat16* __restrict src, float* __restrict dst, int64_t n) {
  const uint16_t* __restrict bits = reinterpret_cast<const uint16_t*>(src);
  uint32_t* __restrict out = reinterpret_cast<uint32_t*>(dst);
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(bits[i]) << 16;
}

inline void widen(const c10::Half* __restrict src, float* __restrict dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

inline void narrow(const float* __restrict src, float* __restrict dst, int64_t n) {
  std::memcpy(dst, src, n * sizeof(float));
}

inline void narrow(const float* __restrict src, c10::BFloat16* __restrict dst, int64_t n) {
  const uint32_t* __restrict bits = reinterpret_cast<const uint32_t*>(src);
  uint16_t* __restrict out = reinterpret_cast<uint16_t*>(dst);
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t b = bits[i];
    const bool nan = (b & 0x7fffffffu) > 0x7f800000u;
    const uint32_t rounded = (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
    out[i] = nan ? static_cast<uint16_t>(0x7fc0u) : static_cast<uint16_t>(rounded);
  }
}

inline void narrow(const float* __restrict src, c10::Half* __restrict dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<c10::Half>(src[i]);
}

// Rows per at::parallel_for task for an op that touches `row_elements` elements a row: an op
// smaller than kInlineElements runs on the calling thread. Forking the pool costs more than such
// an op, and on a busy machine (the gateway, worker and clients share its cores) a pool thread
// that is preempted stalls the whole op for a scheduler timeslice: measured beside a loaded CPU,
// a 16-row rotary or SiLU-and-mul took ~4 ms split over two threads, an inline RMSNorm 0.1 ms.
constexpr int64_t kInlineElements = int64_t{1} << 16;

inline int64_t rows_per_task(int64_t row_elements) {
  return row_elements > 0 ? (kInlineElements + row_elements - 1) / row_elements : kInlineElements;
}

// run(t) for every task t in [0, tasks), handed out one at a time from a shared counter to the
// threads of torch's pool; each thread first builds its scratch with make_scratch() and passes it
// to every task it takes. An even split up front (at::parallel_for's) makes the whole op wait
// for its slowest half: on a machine whose cores the serving processes share, a thread that is
// preempted holds up its whole share. Here it holds up only the task it is in; the other thread
// takes the rest. Inside a parallel region, or with one task, it all runs on the calling thread.
template <typename MakeScratch, typename Run>
inline void parallel_tasks(int64_t tasks, const MakeScratch& make_scratch, const Run& run) {
  if (tasks <= 0) return;
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(tasks, at::get_num_threads());
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    auto scratch = make_scratch();
    for (int64_t t = next.fetch_add(1, std::memory_order_relaxed); t < tasks;
         t = next.fetch_add(1, std::memory_order_relaxed)) {
      run(t, scratch);
    }
  });
}

// Σ a[i]·b[i] in fp32.
inline float dot(const float* a, const float* b, int64_t n) {
  Vec acc(0.f);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) acc = at::vec::fmadd(Vec::loadu(a + i), Vec::loadu(b + i), acc);
  float total = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, acc);
  for (; i < n; ++i) total += a[i] * b[i];
  return total;
}

}  // namespace helexa_cpu
