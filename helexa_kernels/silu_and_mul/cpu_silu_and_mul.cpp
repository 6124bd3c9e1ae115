// The gated-MLP activation on CPU in one call: out = silu(gate) * up, in fp32, rounded once.
//
// PyTorch runs it as two calls (silu, then an in-place multiply), each rounding to the model
// dtype; here each row is widened to fp32, computed with a vectorized exp (ATen's exp_u20, what
// its own CPU softmax uses) and narrowed once, as the reference (naive.py) computes it.
// Registered as torch.ops.helexa_cpu.silu_and_mul; helexa_kernels/cpu.py builds it.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "../cpu_vec.h"
#include "../cpu_ops.h"

namespace {

using helexa_cpu::Vec;

template <typename scalar_t>
void silu_rows(at::Tensor& out, const at::Tensor& x) {
  const int64_t rows = x.size(0), d = out.size(1);
  const scalar_t* src = x.data_ptr<scalar_t>();
  scalar_t* dst = out.data_ptr<scalar_t>();
  const int64_t in_row = x.stride(0), out_row = out.stride(0);
  at::parallel_for(0, rows, helexa_cpu::rows_per_task(d * 2), [&](int64_t begin, int64_t end) {
    std::vector<float> gate(d), up(d);
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* row = src + r * in_row;
      helexa_cpu::widen(row, gate.data(), d);
      helexa_cpu::widen(row + d, up.data(), d);
      int64_t i = 0;
      const Vec one(1.f);
      for (; i + Vec::size() <= d; i += Vec::size()) {
        const Vec g = Vec::loadu(gate.data() + i);
        (g / (one + g.neg().exp_u20()) * Vec::loadu(up.data() + i)).store(gate.data() + i);
      }
      for (; i < d; ++i) gate[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
      helexa_cpu::narrow(gate.data(), dst + r * out_row, d);
    }
  });
}

}  // namespace

namespace helexa_cpu {

void silu_and_mul(at::Tensor out, const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1, "x: 2-D CPU rows, contiguous within a row");
  TORCH_CHECK(x.size(1) % 2 == 0, "x: [rows, 2 * d]");
  TORCH_CHECK(out.dim() == 2 && out.stride(1) == 1 && out.size(0) == x.size(0) && out.size(1) == x.size(1) / 2,
              "out: [rows, d]");
  TORCH_CHECK(out.scalar_type() == x.scalar_type(), "out and x must share a dtype");
  switch (x.scalar_type()) {
    case at::kFloat: return silu_rows<float>(out, x);
    case at::kBFloat16: return silu_rows<c10::BFloat16>(out, x);
    case at::kHalf: return silu_rows<c10::Half>(out, x);
    default: TORCH_CHECK(false, "silu_and_mul: float32, bfloat16 or float16, got ", x.scalar_type());
  }
}

}  // namespace helexa_cpu

TORCH_LIBRARY_FRAGMENT(helexa_cpu, m) {
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
}

TORCH_LIBRARY_IMPL(helexa_cpu, CPU, m) {
  m.impl("silu_and_mul", &helexa_cpu::silu_and_mul);
}
