// The CPU kernels' entry points, as registered under torch.ops.helexa_cpu: declared here so that
// C++ callers (helexa_kernels/decoder/cpu_decoder_stack.cpp) call them straight, without the dispatcher.
// Each is defined, with its checks and its contract, in its own helexa_kernels/<op>/cpu_*.cpp.

#pragma once

#include <ATen/ATen.h>
#include <c10/util/Optional.h>

namespace helexa_cpu {

void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, double eps, bool unit_offset);
void fused_add_rms_norm(at::Tensor out, const at::Tensor& x, at::Tensor residual, const at::Tensor& weight,
                        double eps, bool unit_offset);
void rotary_(at::Tensor q, at::Tensor k, const at::Tensor& positions, const at::Tensor& cos_sin_cache);
void kv_store(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache,
              const at::Tensor& slot_mapping);
void silu_and_mul(at::Tensor out, const at::Tensor& x);
void bf16_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& packed,
                 const c10::optional<at::Tensor>& bias);
void paged_decode_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, const at::Tensor& token_rows,
                            const at::Tensor& seq_rows, double scale);

}  // namespace helexa_cpu
