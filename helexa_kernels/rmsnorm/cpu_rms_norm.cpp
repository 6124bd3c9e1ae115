// RMSNorm on CPU in one call: x / rms(x) * w with fp32 statistics, and the residual add before it.
//
// torch's own rms_norm on CPU is several ATen calls (pow, mean, rsqrt, mul, a cast of the weight
// and of the result); a decode step norms twice per layer, so their fixed cost adds up. Each row is
// read, summed and written in fp32 and rounded once to the output dtype, as the reference does.
// Registered as torch.ops.helexa_cpu.rms_norm / fused_add_rms_norm; helexa_kernels/cpu.py builds it.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "../cpu_vec.h"
#include "../cpu_ops.h"

namespace {

using helexa_cpu::Vec;

void check_norm_rows(const at::Tensor& t, const at::Tensor& like, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 2 && t.stride(1) == 1, name, ": 2-D CPU rows, contiguous within a row");
  TORCH_CHECK(t.sizes() == like.sizes(), name, ": shape ", t.sizes(), " differs from ", like.sizes());
}

// out = norm(x) * w per row (w already fp32, with any unit offset); with `stream`, stream += x
// first (rounded to the stream's dtype) and the norm is of the stream as stored.
template <typename x_t, typename r_t>
void norm_rows(at::Tensor& out, const at::Tensor& x, at::Tensor* stream, const std::vector<float>& w, float eps) {
  const int64_t rows = x.size(0), hidden = x.size(1);
  const x_t* x_ptr = x.data_ptr<x_t>();
  x_t* out_ptr = out.data_ptr<x_t>();
  r_t* r_ptr = stream != nullptr ? stream->data_ptr<r_t>() : nullptr;
  const int64_t x_row = x.stride(0), out_row = out.stride(0), r_row = stream != nullptr ? stream->stride(0) : 0;
  // Small batches run inline (see rows_per_task).
  at::parallel_for(0, rows, helexa_cpu::rows_per_task(hidden), [&](int64_t begin, int64_t end) {
    std::vector<float> row(hidden), add(hidden);
    for (int64_t r = begin; r < end; ++r) {
      helexa_cpu::widen(x_ptr + r * x_row, row.data(), hidden);
      if (r_ptr != nullptr) {
        r_t* stream_row = r_ptr + r * r_row;
        helexa_cpu::widen(stream_row, add.data(), hidden);
        int64_t i = 0;
        for (; i + Vec::size() <= hidden; i += Vec::size()) {
          (Vec::loadu(add.data() + i) + Vec::loadu(row.data() + i)).store(add.data() + i);
        }
        for (; i < hidden; ++i) add[i] += row[i];
        helexa_cpu::narrow(add.data(), stream_row, hidden);
        helexa_cpu::widen(stream_row, row.data(), hidden);  // the norm reads the stream as stored
      }
      const float mean_square = helexa_cpu::dot(row.data(), row.data(), hidden) / static_cast<float>(hidden);
      const float scale = 1.f / std::sqrt(mean_square + eps);
      const Vec vscale(scale);
      int64_t i = 0;
      for (; i + Vec::size() <= hidden; i += Vec::size()) {
        (Vec::loadu(row.data() + i) * vscale * Vec::loadu(w.data() + i)).store(row.data() + i);
      }
      for (; i < hidden; ++i) row[i] = (row[i] * scale) * w[i];
      helexa_cpu::narrow(row.data(), out_ptr + r * out_row, hidden);
    }
  });
}

template <typename x_t>
void norm_rows_for(at::Tensor& out, const at::Tensor& x, at::Tensor* stream, const std::vector<float>& w, float eps) {
  if (stream == nullptr) return norm_rows<x_t, x_t>(out, x, nullptr, w, eps);
  switch (stream->scalar_type()) {
    case at::kFloat: return norm_rows<x_t, float>(out, x, stream, w, eps);
    case at::kBFloat16: return norm_rows<x_t, c10::BFloat16>(out, x, stream, w, eps);
    case at::kHalf: return norm_rows<x_t, c10::Half>(out, x, stream, w, eps);
    default: TORCH_CHECK(false, "rms_norm: a float32, bfloat16 or float16 residual, got ", stream->scalar_type());
  }
}

void norm(at::Tensor& out, const at::Tensor& x, at::Tensor* stream, const at::Tensor& weight, double eps,
          bool unit_offset) {
  check_norm_rows(out, x, "out");
  check_norm_rows(x, x, "x");
  if (stream != nullptr) check_norm_rows(*stream, x, "residual");
  TORCH_CHECK(out.scalar_type() == x.scalar_type(), "out and x must share a dtype");
  const int64_t hidden = x.size(1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == hidden, "weight: [", hidden, "]");
  TORCH_CHECK(weight.stride(0) == 1, "weight: contiguous");
  // Widened here rather than through weight.to(float): a bf16 model's weight would be copied by
  // two ATen calls on every norm, twice a layer.
  std::vector<float> w(hidden);
  switch (weight.scalar_type()) {
    case at::kFloat: helexa_cpu::widen(weight.data_ptr<float>(), w.data(), hidden); break;
    case at::kBFloat16: helexa_cpu::widen(weight.data_ptr<c10::BFloat16>(), w.data(), hidden); break;
    case at::kHalf: helexa_cpu::widen(weight.data_ptr<c10::Half>(), w.data(), hidden); break;
    default: TORCH_CHECK(false, "rms_norm: a float32, bfloat16 or float16 weight, got ", weight.scalar_type());
  }
  if (unit_offset) {
    for (float& value : w) value += 1.f;
  }
  const float feps = static_cast<float>(eps);
  switch (x.scalar_type()) {
    case at::kFloat: return norm_rows_for<float>(out, x, stream, w, feps);
    case at::kBFloat16: return norm_rows_for<c10::BFloat16>(out, x, stream, w, feps);
    case at::kHalf: return norm_rows_for<c10::Half>(out, x, stream, w, feps);
    default: TORCH_CHECK(false, "rms_norm: float32, bfloat16 or float16, got ", x.scalar_type());
  }
}

}  // namespace

namespace helexa_cpu {

void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, double eps, bool unit_offset) {
  norm(out, x, nullptr, weight, eps, unit_offset);
}

void fused_add_rms_norm(at::Tensor out, const at::Tensor& x, at::Tensor residual, const at::Tensor& weight,
                        double eps, bool unit_offset) {
  norm(out, x, &residual, weight, eps, unit_offset);
}

}  // namespace helexa_cpu

TORCH_LIBRARY_FRAGMENT(helexa_cpu, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps, bool unit_offset) -> ()");
  m.def("fused_add_rms_norm(Tensor(a!) out, Tensor x, Tensor(b!) residual, Tensor weight, float eps, "
        "bool unit_offset) -> ()");
}

TORCH_LIBRARY_IMPL(helexa_cpu, CPU, m) {
  m.impl("rms_norm", &helexa_cpu::rms_norm);
  m.impl("fused_add_rms_norm", &helexa_cpu::fused_add_rms_norm);
}
