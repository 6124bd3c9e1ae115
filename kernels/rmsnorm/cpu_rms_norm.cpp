// RMSNorm on CPU in one call: x / rms(x) * w with fp32 statistics, and the residual add before it.
//
// torch's own rms_norm on CPU is several ATen calls (pow, mean, rsqrt, mul, a cast of the weight
// and of the result); a decode step norms twice per layer, so their fixed cost adds up. Each row is
// read, summed and written in fp32 and rounded once to the output dtype, as the reference does.
// Registered as torch.ops.helexa_cpu.rms_norm / fused_add_rms_norm; kernels/cpu.py builds it.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

namespace {

void to_float(const at::Tensor& t, int64_t row, float* dst) {
  const int64_t n = t.size(-1);
  switch (t.scalar_type()) {
    case at::kFloat: {
      const float* src = t.data_ptr<float>() + row * t.stride(0);
      for (int64_t i = 0; i < n; ++i) dst[i] = src[i];
      return;
    }
    case at::kBFloat16: {
      const c10::BFloat16* src = t.data_ptr<c10::BFloat16>() + row * t.stride(0);
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
      return;
    }
    case at::kHalf: {
      const c10::Half* src = t.data_ptr<c10::Half>() + row * t.stride(0);
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
      return;
    }
    default:
      TORCH_CHECK(false, "rms_norm: float32, bfloat16 or float16, got ", t.scalar_type());
  }
}

void from_float(const float* src, at::Tensor& t, int64_t row) {
  const int64_t n = t.size(-1);
  switch (t.scalar_type()) {
    case at::kFloat: {
      float* dst = t.data_ptr<float>() + row * t.stride(0);
      for (int64_t i = 0; i < n; ++i) dst[i] = src[i];
      return;
    }
    case at::kBFloat16: {
      c10::BFloat16* dst = t.data_ptr<c10::BFloat16>() + row * t.stride(0);
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<c10::BFloat16>(src[i]);
      return;
    }
    case at::kHalf: {
      c10::Half* dst = t.data_ptr<c10::Half>() + row * t.stride(0);
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<c10::Half>(src[i]);
      return;
    }
    default:
      TORCH_CHECK(false, "rms_norm: float32, bfloat16 or float16, got ", t.scalar_type());
  }
}

void check_rows(const at::Tensor& t, const at::Tensor& like, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 2 && t.stride(1) == 1, name, ": 2-D CPU rows, contiguous within a row");
  TORCH_CHECK(t.sizes() == like.sizes(), name, ": shape ", t.sizes(), " differs from ", like.sizes());
}

// out = norm(src) * (w [+ 1]) per row; with `residual`, residual += src first and the norm is of it.
void norm_rows(at::Tensor out, const at::Tensor& src, const c10::optional<at::Tensor>& residual,
               const at::Tensor& weight, double eps, bool unit_offset) {
  check_rows(out, src, "out");
  check_rows(src, src, "x");
  if (residual.has_value()) check_rows(*residual, src, "residual");
  const int64_t rows = src.size(0), hidden = src.size(1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == hidden, "weight: [", hidden, "]");
  std::vector<float> w(hidden);
  to_float(weight.view({1, hidden}).contiguous(), 0, w.data());
  if (unit_offset) {
    for (float& value : w) value += 1.f;
  }
  const float feps = static_cast<float>(eps);
  // Small batches run inline: a fork of the thread pool costs more than a few rows.
  at::parallel_for(0, rows, std::max<int64_t>(1, 32768 / std::max<int64_t>(hidden, 1)), [&](int64_t begin, int64_t end) {
    std::vector<float> row(hidden), add(hidden);
    for (int64_t r = begin; r < end; ++r) {
      to_float(src, r, row.data());
      if (residual.has_value()) {
        at::Tensor stream = *residual;
        to_float(stream, r, add.data());
        for (int64_t i = 0; i < hidden; ++i) add[i] += row[i];
        from_float(add.data(), stream, r);
        to_float(stream, r, row.data());  // the norm reads the stream as stored (rounded)
      }
      float squares = 0.f;
      for (int64_t i = 0; i < hidden; ++i) squares += row[i] * row[i];
      const float scale = 1.f / std::sqrt(squares / static_cast<float>(hidden) + feps);
      for (int64_t i = 0; i < hidden; ++i) row[i] = (row[i] * scale) * w[i];
      from_float(row.data(), out, r);
    }
  });
}

void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, double eps, bool unit_offset) {
  norm_rows(out, x, c10::nullopt, weight, eps, unit_offset);
}

void fused_add_rms_norm(at::Tensor out, const at::Tensor& x, at::Tensor residual, const at::Tensor& weight,
                        double eps, bool unit_offset) {
  norm_rows(out, x, residual, weight, eps, unit_offset);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(helexa_cpu, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps, bool unit_offset) -> ()");
  m.def("fused_add_rms_norm(Tensor(a!) out, Tensor x, Tensor(b!) residual, Tensor weight, float eps, "
        "bool unit_offset) -> ()");
}

TORCH_LIBRARY_IMPL(helexa_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
}
