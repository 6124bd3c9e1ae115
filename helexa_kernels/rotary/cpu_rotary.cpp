// Rotate-half RoPE on CPU, in place, q and k in one call (fp32 math, one rounding per element).
//
// The PyTorch form is about six ATen calls per layer (an fp32 copy, a concatenation, a
// multiply-add, a cast back); in a decode step their fixed cost is most of the work. The first
// rotary_dim = cos_sin_cache.size(1) dims of every head turn by the angles of the token's
// position; the rest pass through. Registered as torch.ops.helexa_cpu.rotary_; helexa_kernels/cpu.py
// builds it.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "../cpu_vec.h"
#include "../cpu_ops.h"

namespace {

template <typename scalar_t>
void rotate_heads(at::Tensor& x, const int64_t* positions, const float* table, int64_t table_row, int64_t half) {
  const int64_t tokens = x.size(0), heads = x.size(1);
  scalar_t* base = x.data_ptr<scalar_t>();
  const int64_t token_stride = x.stride(0), head_stride = x.stride(1);
  at::parallel_for(0, tokens, helexa_cpu::rows_per_task(heads * half * 2), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* cos = table + positions[t] * table_row;
      const float* sin = cos + half;
      for (int64_t h = 0; h < heads; ++h) {
        scalar_t* row = base + t * token_stride + h * head_stride;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = static_cast<float>(row[i]), x2 = static_cast<float>(row[i + half]);
          row[i] = static_cast<scalar_t>(x1 * cos[i] - x2 * sin[i]);
          row[i + half] = static_cast<scalar_t>(x2 * cos[i] + x1 * sin[i]);
        }
      }
    }
  });
}

void rotate(at::Tensor& x, const int64_t* positions, const float* table, int64_t table_row, int64_t half) {
  switch (x.scalar_type()) {
    case at::kFloat: return rotate_heads<float>(x, positions, table, table_row, half);
    case at::kBFloat16: return rotate_heads<c10::BFloat16>(x, positions, table, table_row, half);
    case at::kHalf: return rotate_heads<c10::Half>(x, positions, table, table_row, half);
    default: TORCH_CHECK(false, "rotary_: float32, bfloat16 or float16, got ", x.scalar_type());
  }
}

}  // namespace

namespace helexa_cpu {

void rotary_(at::Tensor q, at::Tensor k, const at::Tensor& positions, const at::Tensor& cos_sin_cache) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu(), "rotary_ runs on CPU tensors");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.stride(2) == 1 && k.stride(2) == 1,
              "q and k are [num_tokens, heads, head_dim] with a contiguous head_dim");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.dim() == 1 &&
              positions.size(0) == q.size(0) && positions.size(0) == k.size(0), "positions: int64 [num_tokens]");
  TORCH_CHECK(cos_sin_cache.scalar_type() == at::kFloat && cos_sin_cache.is_contiguous() && cos_sin_cache.dim() == 2,
              "cos_sin_cache: contiguous float32 [max_position, rotary_dim]");
  const int64_t rotary_dim = cos_sin_cache.size(1), half = rotary_dim / 2;
  TORCH_CHECK(rotary_dim % 2 == 0 && rotary_dim <= q.size(2) && rotary_dim <= k.size(2),
              "rotary_dim ", rotary_dim, " must be even and at most head_dim");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < positions.size(0); ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos_sin_cache.size(0), "position ", pos[t], " outside the rotary table");
  }
  const float* table = cos_sin_cache.data_ptr<float>();
  rotate(q, pos, table, rotary_dim, half);
  rotate(k, pos, table, rotary_dim, half);
}

}  // namespace helexa_cpu

TORCH_LIBRARY_FRAGMENT(helexa_cpu, m) {
  m.def("rotary_(Tensor(a!) q, Tensor(b!) k, Tensor positions, Tensor cos_sin_cache) -> ()");
}

TORCH_LIBRARY_IMPL(helexa_cpu, CPU, m) {
  m.impl("rotary_", &helexa_cpu::rotary_);
}
