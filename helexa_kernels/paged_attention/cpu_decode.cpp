// Decode attention on CPU straight from the paged KV cache: one query token per sequence.
//
// Each sequence is one task for torch's own OpenMP pool (helexa_cpu::parallel_tasks). A task walks the
// sequence's block table, so no key or value is gathered into a padded copy; every query head is
// scored against each key row as that row is read (GQA: a kv head's group shares it), so each
// key and value is read once. Scores, softmax and the weighted sum of values are fp32
// whatever the cache dtype. Registered as torch.ops.helexa_cpu.paged_decode_attention; the
// Python side (helexa_kernels/cpu.py) builds and loads it.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "../cpu_vec.h"
#include "amx_decode.h"
#include "../cpu_ops.h"

namespace {

using helexa_cpu::Vec;
using helexa_cpu::dot;
using helexa_cpu::widen;

inline void axpy(float alpha, const float* x, float* y, int64_t n) {
  const Vec a(alpha);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) at::vec::fmadd(a, Vec::loadu(x + i), Vec::loadu(y + i)).store(y + i);
  for (; i < n; ++i) y[i] += alpha * x[i];
}

// scores[j] = scale * <q, key j> for the `count` keys of a block, rows `stride` floats apart.
// kChunks = head_dim / Vec::size() keeps q in registers; 0: any head_dim (a scalar tail).
template <int kChunks>
inline void block_scores(const float* q, const float* keys, int64_t stride, int64_t count, int64_t head_dim,
                         float scale, float* scores) {
  if constexpr (kChunks == 0) {
    for (int64_t j = 0; j < count; ++j) scores[j] = dot(q, keys + j * stride, head_dim) * scale;
  } else {
    Vec query[kChunks];
    for (int c = 0; c < kChunks; ++c) query[c] = Vec::loadu(q + c * Vec::size());
    for (int64_t j = 0; j < count; ++j) {
      const float* key = keys + j * stride;
      Vec acc = query[0] * Vec::loadu(key);
      for (int c = 1; c < kChunks; ++c) acc = at::vec::fmadd(query[c], Vec::loadu(key + c * Vec::size()), acc);
      scores[j] = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, acc) * scale;
    }
  }
}

// acc += Σ_j p[j] · value j, over the `count` values of a block; the sum stays in registers.
template <int kChunks>
inline void block_values(const float* p, const float* values, int64_t stride, int64_t count, int64_t head_dim,
                         float* acc) {
  if constexpr (kChunks == 0) {
    for (int64_t j = 0; j < count; ++j) axpy(p[j], values + j * stride, acc, head_dim);
  } else {
    Vec sum[kChunks];
    for (int c = 0; c < kChunks; ++c) sum[c] = Vec::loadu(acc + c * Vec::size());
    for (int64_t j = 0; j < count; ++j) {
      const Vec weight(p[j]);
      const float* value = values + j * stride;
      for (int c = 0; c < kChunks; ++c) sum[c] = at::vec::fmadd(weight, Vec::loadu(value + c * Vec::size()), sum[c]);
    }
    for (int c = 0; c < kChunks; ++c) sum[c].store(acc + c * Vec::size());
  }
}

// In place: s = softmax(s). exp_u20 is the vectorized exp PyTorch's own CPU attention uses.
inline void softmax(float* s, int64_t n) {
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < n; ++t) top = std::max(top, s[t]);
  const Vec vtop(top);
  Vec vtotal(0.f);
  int64_t t = 0;
  for (; t + Vec::size() <= n; t += Vec::size()) {
    const Vec e = (Vec::loadu(s + t) - vtop).exp_u20();
    e.store(s + t);
    vtotal = vtotal + e;
  }
  float total = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, vtotal);
  for (; t < n; ++t) {
    s[t] = std::exp(s[t] - top);
    total += s[t];
  }
  const Vec inv(1.f / total);
  t = 0;
  for (; t + Vec::size() <= n; t += Vec::size()) (Vec::loadu(s + t) * inv).store(s + t);
  for (; t < n; ++t) s[t] *= 1.f / total;
}

template <typename scalar_t, int kChunks>
void decode_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                      const at::Tensor& v_cache, const at::Tensor& block_tables,
                      const at::Tensor& seq_lens, const at::Tensor& token_rows,
                      const at::Tensor& seq_rows, double scale) {
  const int64_t block_size = k_cache.size(1);
  const int64_t num_kv_heads = k_cache.size(2);
  const int64_t head_dim = k_cache.size(3);
  const int64_t group = q.size(1) / num_kv_heads;
  const int64_t n = token_rows.size(0);
  // Strides in elements; the caches and tables are contiguous (checked by the caller).
  const int64_t q_row = q.stride(0), q_head = q.stride(1);
  const int64_t out_row = out.stride(0), out_head = out.stride(1);
  const int64_t cache_row = num_kv_heads * head_dim;  // one token's slot in a cache
  const int64_t cache_block = block_size * cache_row;
  const int64_t table_row = block_tables.stride(0);
  const scalar_t* q_ptr = q.data_ptr<scalar_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  const scalar_t* k_ptr = k_cache.data_ptr<scalar_t>();
  const scalar_t* v_ptr = v_cache.data_ptr<scalar_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t* t_rows = token_rows.data_ptr<int64_t>();
  const int64_t* s_rows = seq_rows.data_ptr<int64_t>();
  const float fscale = static_cast<float>(scale);

  const int64_t num_heads = num_kv_heads * group;
  // One task per sequence, handed out as threads come free: a token's keys for all kv heads are
  // one contiguous row of the block, so a task streams through each block once for keys and once
  // for values.
  struct Scratch {
    std::vector<float> query, block, acc, scores;
  };
  helexa_cpu::parallel_tasks(
      n, [&] { return Scratch{std::vector<float>(num_heads * head_dim), std::vector<float>(cache_block),
                              std::vector<float>(num_heads * head_dim), {}}; },
      [&](int64_t i, Scratch& s) {
        // A block's keys (then values) widened to fp32: [block_size, num_kv_heads * head_dim]
        std::vector<float>& query = s.query;
        std::vector<float>& block = s.block;
        std::vector<float>& acc = s.acc;
        std::vector<float>& scores = s.scores;
        const int64_t token = t_rows[i], seq = s_rows[i];
        const int64_t seq_len = lens[seq];
        const int32_t* table = tables + seq * table_row;
        for (int64_t h = 0; h < num_heads; ++h) {
          widen(q_ptr + token * q_row + h * q_head, query.data() + h * head_dim, head_dim);
        }
        scores.resize(num_heads * seq_len);  // [num_heads, seq_len]
        for (int64_t first = 0; first < seq_len; first += block_size) {
          const int64_t count = std::min(block_size, seq_len - first);
          widen(k_ptr + table[first / block_size] * cache_block, block.data(), count * cache_row);
          for (int64_t h = 0; h < num_heads; ++h) {
            block_scores<kChunks>(query.data() + h * head_dim, block.data() + (h / group) * head_dim, cache_row,
                                  count, head_dim, fscale, scores.data() + h * seq_len + first);
          }
        }
        for (int64_t h = 0; h < num_heads; ++h) softmax(scores.data() + h * seq_len, seq_len);
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t first = 0; first < seq_len; first += block_size) {
          const int64_t count = std::min(block_size, seq_len - first);
          widen(v_ptr + table[first / block_size] * cache_block, block.data(), count * cache_row);
          for (int64_t h = 0; h < num_heads; ++h) {
            block_values<kChunks>(scores.data() + h * seq_len + first, block.data() + (h / group) * head_dim,
                                  cache_row, count, head_dim, acc.data() + h * head_dim);
          }
        }
        for (int64_t h = 0; h < num_heads; ++h) {
          scalar_t* dst = out_ptr + token * out_row + h * out_head;
          const float* src = acc.data() + h * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<scalar_t>(src[d]);
        }
      });
}

#ifdef HELEXA_AMX
// Every row through AMX tiles (amx_decode.h), one task per row as above.
void amx_decode_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& token_rows,
                          const at::Tensor& seq_rows, double scale) {
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2), head_dim = k_cache.size(3);
  const int64_t num_heads = q.size(1);
  const auto* q_ptr = reinterpret_cast<const uint16_t*>(q.data_ptr<c10::BFloat16>());
  auto* out_ptr = reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>());
  const auto* k_ptr = reinterpret_cast<const uint16_t*>(k_cache.data_ptr<c10::BFloat16>());
  const auto* v_ptr = reinterpret_cast<const uint16_t*>(v_cache.data_ptr<c10::BFloat16>());
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t* t_rows = token_rows.data_ptr<int64_t>();
  const int64_t* s_rows = seq_rows.data_ptr<int64_t>();
  const int64_t table_row = block_tables.stride(0);
  helexa_cpu::parallel_tasks(
      token_rows.size(0), [] { return helexa_amx::DecodeScratch(); },
      [&](int64_t i, helexa_amx::DecodeScratch& s) {
        const int64_t token = t_rows[i], seq = s_rows[i];
        helexa_amx::decode_row(q_ptr + token * q.stride(0), q.stride(1), k_ptr, v_ptr, tables + seq * table_row,
                               block_size, num_kv_heads, head_dim, num_heads, lens[seq], static_cast<float>(scale),
                               out_ptr + token * out.stride(0), out.stride(1), s);
      });
}
#endif

// head_dim in whole vectors picks the register-resident form; any other head_dim the generic one.
// bf16 goes through AMX tiles where the CPU has them and the shapes fit.
template <typename scalar_t>
void decode_attention_any(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                          const at::Tensor& v_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                          const at::Tensor& token_rows, const at::Tensor& seq_rows, double scale) {
  const int64_t head_dim = q.size(2);
#ifdef HELEXA_AMX
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    if (helexa_amx::ready() && helexa_amx::decode_applies(q.size(1), head_dim, k_cache.size(1))) {
      return amx_decode_attention(out, q, k_cache, v_cache, block_tables, seq_lens, token_rows, seq_rows, scale);
    }
  }
#endif
  const int64_t chunks = head_dim % Vec::size() == 0 ? head_dim / Vec::size() : 0;
#define HELEXA_DECODE(K) decode_attention<scalar_t, K>(out, q, k_cache, v_cache, block_tables, seq_lens, \
                                                       token_rows, seq_rows, scale)
  switch (chunks) {
    case 1: return HELEXA_DECODE(1);
    case 2: return HELEXA_DECODE(2);
    case 4: return HELEXA_DECODE(4);
    case 8: return HELEXA_DECODE(8);
    case 16: return HELEXA_DECODE(16);
    default: return HELEXA_DECODE(0);
  }
#undef HELEXA_DECODE
}

}  // namespace

namespace helexa_cpu {

// out[token_rows[i]] = attention of q[token_rows[i]] over the first seq_lens[seq_rows[i]] keys of
// sequence seq_rows[i] (through block_tables[seq_rows[i]]). Rows of `out` not named are untouched.
void paged_decode_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, const at::Tensor& token_rows,
                            const at::Tensor& seq_rows, double scale) {
  TORCH_CHECK(q.device().is_cpu(), "paged_decode_attention runs on CPU tensors");
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3, "q and out are [num_tokens, num_heads, head_dim]");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "q and out need a contiguous head_dim");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.dim() == 4,
              "caches are [num_blocks, block_size, num_kv_heads, head_dim]");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(q.size(2) == k_cache.size(3), "q and the caches disagree on head_dim");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && out.scalar_type() == q.scalar_type(),
              "q, out and the caches must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.stride(1) == 1, "block_tables: int32 rows");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous(), "seq_lens: contiguous int32");
  TORCH_CHECK(token_rows.scalar_type() == at::kLong && seq_rows.scalar_type() == at::kLong &&
              token_rows.is_contiguous() && seq_rows.is_contiguous() &&
              token_rows.size(0) == seq_rows.size(0), "token_rows and seq_rows: contiguous int64, same length");
  // The kernel reads through raw pointers: every block it will read must exist.
  const int64_t* t_rows = token_rows.data_ptr<int64_t>();
  const int64_t* s_rows = seq_rows.data_ptr<int64_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t block_size = k_cache.size(1), num_blocks = k_cache.size(0);
  for (int64_t i = 0; i < token_rows.size(0); ++i) {
    TORCH_CHECK(t_rows[i] >= 0 && t_rows[i] < q.size(0) && t_rows[i] < out.size(0), "token row out of range");
    TORCH_CHECK(s_rows[i] >= 0 && s_rows[i] < seq_lens.size(0) && s_rows[i] < block_tables.size(0),
                "sequence row out of range");
    const int64_t seq_len = lens[s_rows[i]];
    TORCH_CHECK(seq_len >= 1 && seq_len <= block_tables.size(1) * block_size, "sequence length ", seq_len,
                " outside its block table");
    const int32_t* table = block_tables.data_ptr<int32_t>() + s_rows[i] * block_tables.stride(0);
    for (int64_t b = 0; b < (seq_len + block_size - 1) / block_size; ++b) {
      TORCH_CHECK(table[b] >= 0 && table[b] < num_blocks, "block id ", table[b], " outside the cache");
    }
  }
  switch (q.scalar_type()) {
    case at::kFloat:
      return decode_attention_any<float>(out, q, k_cache, v_cache, block_tables, seq_lens, token_rows, seq_rows, scale);
    case at::kBFloat16:
      return decode_attention_any<c10::BFloat16>(out, q, k_cache, v_cache, block_tables, seq_lens, token_rows,
                                             seq_rows, scale);
    case at::kHalf:
      return decode_attention_any<c10::Half>(out, q, k_cache, v_cache, block_tables, seq_lens, token_rows, seq_rows,
                                         scale);
    default:
      TORCH_CHECK(false, "paged_decode_attention: float32, bfloat16 or float16, got ", q.scalar_type());
  }
}

}  // namespace helexa_cpu

TORCH_LIBRARY_FRAGMENT(helexa_cpu, m) {
  m.def("paged_decode_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, "
        "Tensor block_tables, Tensor seq_lens, Tensor token_rows, Tensor seq_rows, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(helexa_cpu, CPU, m) {
  m.impl("paged_decode_attention", &helexa_cpu::paged_decode_attention);
}
