// A step's new keys and values into the paged KV cache on CPU, both in one call.
//
// The PyTorch form is two index_copy_ calls (plus a view and a cast check each) per layer; in a
// decode step their fixed cost is most of the work for 16 rows of a few hundred bytes. Each token's
// heads are copied row by row to its flat slot (block * block_size + offset); slot -1 is skipped
// (padding rows), any other slot outside the cache is an error before anything is written.
// Registered as torch.ops.helexa_cpu.kv_store; helexa_kernels/cpu.py builds it.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstring>
#include "../cpu_ops.h"

namespace {

void check_kv_rows(const at::Tensor& x, const at::Tensor& cache, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3 && x.stride(2) == 1, name,
              ": [tokens, kv_heads, head_dim] CPU rows, contiguous within a head");
  TORCH_CHECK(x.scalar_type() == cache.scalar_type(), name, " and its cache must share a dtype");
  TORCH_CHECK(x.size(1) == cache.size(2) && x.size(2) == cache.size(3), name,
              ": heads and head_dim must match the cache's");
}

}  // namespace

namespace helexa_cpu {

void kv_store(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache,
              const at::Tensor& slot_mapping) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes(),
              "caches: contiguous [num_blocks, block_size, kv_heads, head_dim], the same shape");
  check_kv_rows(k, k_cache, "k");
  check_kv_rows(v, v_cache, "v");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 && slot_mapping.is_contiguous() &&
                  slot_mapping.size(0) == k.size(0) && v.size(0) == k.size(0),
              "slot_mapping: contiguous int64 [tokens]");
  const int64_t tokens = k.size(0), heads = k.size(1), head_dim = k.size(2);
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(slots[t] >= -1 && slots[t] < num_slots, "slot ", slots[t], " of token ", t,
                " is outside the cache's ", num_slots, " slots");
  }
  const int64_t element = k.element_size(), row_bytes = head_dim * element;
  const int64_t slot_elements = heads * head_dim;
  auto copy = [&](const at::Tensor& x, at::Tensor& cache) {
    const char* src = static_cast<const char*>(x.data_ptr());
    char* dst = static_cast<char*>(cache.data_ptr());
    for (int64_t t = 0; t < tokens; ++t) {
      if (slots[t] < 0) continue;
      char* slot = dst + slots[t] * slot_elements * element;
      const char* token = src + t * x.stride(0) * element;
      if (x.stride(1) == head_dim) {
        std::memcpy(slot, token, slot_elements * element);  // the token's heads side by side
      } else {
        for (int64_t h = 0; h < heads; ++h) std::memcpy(slot + h * row_bytes, token + h * x.stride(1) * element, row_bytes);
      }
    }
  };
  copy(k, k_cache);
  copy(v, v_cache);
}

}  // namespace helexa_cpu

TORCH_LIBRARY_FRAGMENT(helexa_cpu, m) {
  m.def("kv_store(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(helexa_cpu, CPU, m) {
  m.impl("kv_store", &helexa_cpu::kv_store);
}
