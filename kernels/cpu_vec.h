// What the C++ CPU kernels share: rows widened to fp32 and narrowed back, vectorized.
//
// bf16 is the top half of an fp32, so widening is a shift and narrowing a round-to-nearest-even
// of the low half; both loops vectorize. Half goes through c10's conversions.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

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
