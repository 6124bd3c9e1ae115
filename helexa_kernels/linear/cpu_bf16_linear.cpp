// A bf16 linear layer for the few rows of a decode step, on CPUs with AVX512-BF16.
//
// y[M, N] = x[M, K] @ W[N, K]^T (+ bias), bf16 in and out, fp32 accumulation. For a handful of
// rows the work is streaming W once: the weight is packed (helexa_kernels/cpu.py, `pack_bf16_weight`)
// into blocks of 16 output columns whose K is interleaved in pairs, [N/16, K/2, 16, 2], so one
// 64-byte load is the next two k of 16 columns, the operand of one `vdpbf16ps`. Each x pair is
// broadcast once and multiplied into up to 4 blocks (64 columns); up to 6 rows share each weight
// load, so a tile keeps 24 fp32 accumulators in registers. K runs in chunks of 8 KiB of weights:
// every row tile passes over a chunk while it sits in L1 (partial sums wait in a small buffer),
// and the later tiles prefetch the next chunk. Threads take groups of column blocks as they come
// free (helexa_cpu::parallel_tasks), each streaming its own parts of W.
//
// Measured on a 2-core Zen 4 (SmolLM2-135M's projections and LM head, bf16,
// bench/results/cpu_linear-cpu-epyc-kernel.json): 1 row 12.9 ms against oneDNN's prepacked 18.7,
// 16 rows 17.0 against 20.8, 64 rows 57.3 against 64.9; at 512 rows oneDNN is 1.25x faster.
// Which one runs for how many rows is measured at start (engine/cpu/cpu_linear.py).
//
// Where the CPU has AMX-BF16 (and K is a multiple of 32), the same packed weight goes through AMX
// tiles instead (amx_bf16.h): on a 2-core Sapphire Rapids, 16 rows 11.4 ms against oneDNN's 14.6.
//
// Registered as torch.ops.helexa_cpu.bf16_linear, .bf16_linear_available (False when the compiler
// was not given AVX512-BF16: the engine then keeps oneDNN) and .bf16_linear_amx.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../cpu_ops.h"
#include "../cpu_vec.h"
#include "amx_bf16.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define HELEXA_BF16_LINEAR 1
#endif

namespace {

#ifdef HELEXA_BF16_LINEAR

constexpr int kBlock = 16;     // output columns per packed block (one zmm of fp32)
constexpr int kMaxBlocks = 4;  // blocks a tile multiplies each broadcast into
constexpr int kMaxRows = 6;    // rows a tile shares each weight load between
constexpr int64_t kChunkPairs = 32;  // K pairs per chunk: 4 blocks x 32 pairs x 64 bytes = 8 KiB

// Partial sums of a group's columns for every row, kept between K chunks: [rows][kGroupColumns].
constexpr int kGroupColumns = kBlock * kMaxBlocks;

// 16 finished outputs (the masked ones) at `offset`: rounded to bf16 into `out`, or into `out_f32`.
inline void store(__m512 values, __mmask16 mask, uint16_t* out, float* out_f32, int64_t offset) {
  if (out_f32 != nullptr) {
    _mm512_mask_storeu_ps(out_f32 + offset, mask, values);
  } else {
    _mm256_mask_storeu_epi16(out + offset, mask, (__m256i)_mm512_cvtneps_pbh(values));
  }
}

// rows x (blocks * 16) outputs over one chunk of K pairs [p0, p1): start from zero (first chunk) or
// the partial sums, and either keep the sums or (last chunk) add bias and store: rounded to bf16
// into `out`, or as they are into `out_f32` where that is given (logits).
template <int ROWS, int BLOCKS, bool PREFETCH>
void tile(const uint32_t* __restrict x, int64_t x_row, const uint16_t* __restrict w, int64_t block_stride,
          int64_t p0, int64_t p1, float* __restrict sums, bool first, bool last, const float* __restrict bias,
          uint16_t* __restrict out, float* __restrict out_f32, int64_t out_row, int64_t columns) {
  __m512 acc[ROWS][BLOCKS];
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 4
    for (int b = 0; b < BLOCKS; ++b)
      acc[r][b] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(sums + r * kGroupColumns + b * kBlock);
  for (int64_t p = p0; p < p1; ++p) {
    __m512bh weights[BLOCKS];
#pragma GCC unroll 4
    for (int b = 0; b < BLOCKS; ++b) {
      weights[b] = (__m512bh)_mm512_loadu_si512(w + b * block_stride + p * 2 * kBlock);
      // The same line of the next chunk: it comes from memory while this chunk's tiles compute.
      if (PREFETCH) _mm_prefetch(reinterpret_cast<const char*>(w + b * block_stride + (p + kChunkPairs) * 2 * kBlock), _MM_HINT_T0);
    }
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r) {
      const __m512bh pair = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * x_row + p]));
#pragma GCC unroll 4
      for (int b = 0; b < BLOCKS; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], pair, weights[b]);
    }
  }
  if (!last) {
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 4
      for (int b = 0; b < BLOCKS; ++b) _mm512_storeu_ps(sums + r * kGroupColumns + b * kBlock, acc[r][b]);
    return;
  }
#pragma GCC unroll 4
  for (int b = 0; b < BLOCKS; ++b) {
    const int64_t valid = columns - b * kBlock;
    if (valid <= 0) break;
    const __mmask16 mask = valid >= kBlock ? __mmask16(0xFFFF) : __mmask16((1u << valid) - 1);
    const __m512 add = bias ? _mm512_maskz_loadu_ps(mask, bias + b * kBlock) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r) store(_mm512_add_ps(acc[r][b], add), mask, out, out_f32, r * out_row + b * kBlock);
  }
}

using TileFn = void (*)(const uint32_t*, int64_t, const uint16_t*, int64_t, int64_t, int64_t, float*, bool,
                       bool, const float*, uint16_t*, float*, int64_t, int64_t);

template <int ROWS, bool PREFETCH>
TileFn pick_blocks(int blocks) {
  switch (blocks) {
    case 1: return &tile<ROWS, 1, PREFETCH>;
    case 2: return &tile<ROWS, 2, PREFETCH>;
    case 3: return &tile<ROWS, 3, PREFETCH>;
    default: return &tile<ROWS, 4, PREFETCH>;
  }
}

template <bool PREFETCH>
TileFn pick_rows(int rows, int blocks) {
  switch (rows) {
    case 1: return pick_blocks<1, PREFETCH>(blocks);
    case 2: return pick_blocks<2, PREFETCH>(blocks);
    case 3: return pick_blocks<3, PREFETCH>(blocks);
    case 4: return pick_blocks<4, PREFETCH>(blocks);
    case 5: return pick_blocks<5, PREFETCH>(blocks);
    default: return pick_blocks<6, PREFETCH>(blocks);
  }
}

// The first row tile of a chunk brings its weights from memory; the later ones, which read them from
// L1, prefetch the next chunk's, so memory and arithmetic overlap (measured: 15.1 against 17.6 ms
// for the default model's projections at 16 rows, no gain at 1 row).
TileFn pick(int rows, int blocks, bool prefetch) {
  return prefetch ? pick_rows<true>(rows, blocks) : pick_rows<false>(rows, blocks);
}

#ifdef HELEXA_AMX

// A thread's sums and tiles for its share of the op.
struct AmxScratch {
  std::vector<float> sums = std::vector<float>(helexa_amx::kTileRows * helexa_amx::kSumsRow);
  helexa_amx::Tiles tiles;
};

// One group's output for `m` rows of x from their sums: bias added, stored (as `tile` does).
inline void store_rows(const float* sums, int m, int group, int64_t group_columns, const float* bias,
                       uint16_t* out, float* out_f32, int64_t out_row) {
  for (int b = 0; b < group; ++b) {
    const int64_t valid = group_columns - b * kBlock;
    if (valid <= 0) break;
    const __mmask16 mask = valid >= kBlock ? __mmask16(0xFFFF) : __mmask16((1u << valid) - 1);
    const __m512 add = bias ? _mm512_maskz_loadu_ps(mask, bias + b * kBlock) : _mm512_setzero_ps();
    for (int i = 0; i < m; ++i) {
      const __m512 sum = _mm512_loadu_ps(sums + i * helexa_amx::kSumsRow + b * kBlock);
      store(_mm512_add_ps(sum, add), mask, out, out_f32, i * out_row + b * kBlock);
    }
  }
}

void amx_linear(const uint32_t* x, int64_t rows, int64_t x_row, const uint16_t* w, int64_t pairs, int64_t blocks,
                const float* bias, uint16_t* out, float* out_f32, int64_t out_row, int64_t columns) {
  using helexa_amx::kTileRows;
  const int64_t block_elems = pairs * 2 * kBlock;
  const int64_t groups = (blocks + helexa_amx::kAmxBlocks - 1) / helexa_amx::kAmxBlocks;
  helexa_cpu::parallel_tasks(groups, [] { return AmxScratch(); }, [&](int64_t task, AmxScratch& s) {
    const int64_t first = task * helexa_amx::kAmxBlocks;
    const int group = static_cast<int>(std::min<int64_t>(helexa_amx::kAmxBlocks, blocks - first));
    const int64_t first_column = first * kBlock;
    const int64_t group_columns = std::min<int64_t>(columns - first_column, group * kBlock);
    const uint16_t* group_w = w + first * block_elems;
    const float* group_bias = bias ? bias + first_column : nullptr;
    for (int64_t r = 0; r < rows; r += kTileRows) {
      const int m = static_cast<int>(std::min<int64_t>(kTileRows, rows - r));
      helexa_amx::shape_for_rows(s.tiles, m);
      helexa_amx::pick(group)(reinterpret_cast<const uint16_t*>(x + r * x_row), x_row * 4, group_w, block_elems,
                              pairs, s.sums.data());
      store_rows(s.sums.data(), m, group, group_columns, group_bias, out ? out + r * out_row + first_column : nullptr,
                 out_f32 ? out_f32 + r * out_row + first_column : nullptr, out_row);
    }
  });
}

#endif  // HELEXA_AMX

#endif  // HELEXA_BF16_LINEAR

bool bf16_linear_available() {
#ifdef HELEXA_BF16_LINEAR
  return true;
#else
  return false;
#endif
}

// Whether the AMX forms of the kernels (this linear's, the decode attention's) are wanted: on by
// default where built; switched off to test or time the others on the same machine. Returns the
// previous setting.
bool set_amx_wanted(bool wanted) {
#ifdef HELEXA_AMX
  return helexa_amx::wanted().exchange(wanted);
#else
  return false;
#endif
}

// Whether rows whose K is a multiple of 32 go through AMX tiles (built for a CPU with AMX-BF16, and
// the process was granted the tiles).
bool bf16_linear_amx() {
#if defined(HELEXA_BF16_LINEAR) && defined(HELEXA_AMX)
  return helexa_amx::ready();
#else
  return false;
#endif
}

}  // namespace

namespace helexa_cpu {

// out [M, N] = x [M, K] @ W^T + bias, W given packed as [ceil(N/16), K/2, 16, 2]; out is bf16, or fp32
// (the LM head's logits: rounded to bf16, a near tie between two tokens becomes an exact one).
void bf16_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& packed,
                 const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(bf16_linear_available(), "bf16_linear: built without AVX512-BF16");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.stride(1) == 1,
              "x: 2-D bf16 CPU rows, contiguous within a row");
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 4 && packed.is_contiguous() &&
                  packed.size(2) == 16 && packed.size(3) == 2,
              "packed: a contiguous bf16 [N/16, K/2, 16, 2] weight");
  TORCH_CHECK(packed.size(0) > 0 && packed.size(1) > 0, "packed: an empty weight");
  TORCH_CHECK(x.size(1) == packed.size(1) * 2, "x has ", x.size(1), " features, the weight ", packed.size(1) * 2);
  TORCH_CHECK((out.scalar_type() == at::kBFloat16 || out.scalar_type() == at::kFloat) && out.dim() == 2 &&
                  out.stride(1) == 1 && out.size(0) == x.size(0) && out.size(1) <= packed.size(0) * 16 &&
                  out.size(1) > (packed.size(0) - 1) * 16,
              "out: bf16 or fp32 [rows, N] with N in the packed weight's last block");
  const int64_t columns = out.size(1);
  const float* bias_data = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == columns,
                "bias: contiguous fp32 [N]");
    bias_data = bias->data_ptr<float>();
  }
#ifdef HELEXA_BF16_LINEAR
  const int64_t rows = x.size(0), pairs = packed.size(1), blocks = packed.size(0);
  if (rows == 0 || columns == 0) return;
  const uint32_t* x_data = reinterpret_cast<const uint32_t*>(x.data_ptr<at::BFloat16>());
  const uint16_t* w_data = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  const bool fp32_out = out.scalar_type() == at::kFloat;
  uint16_t* out_data = fp32_out ? nullptr : reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  float* out_f32 = fp32_out ? out.data_ptr<float>() : nullptr;
  const int64_t x_row = x.stride(0) / 2, out_row = out.stride(0);
  TORCH_CHECK(x.stride(0) % 2 == 0, "x: row stride must be even");
  const int64_t block_elems = pairs * 2 * kBlock;
#ifdef HELEXA_AMX
  if (pairs % helexa_amx::kPairsPerStep == 0 && helexa_amx::ready()) {
    return amx_linear(x_data, rows, x_row, w_data, pairs, blocks, bias_data, out_data, out_f32, out_row, columns);
  }
#endif
  // A task is one group of up to kMaxBlocks column blocks, handed out as threads come free.
  const int64_t groups = (blocks + kMaxBlocks - 1) / kMaxBlocks;
  helexa_cpu::parallel_tasks(
      groups, [&] { return std::vector<float>(rows * kGroupColumns); },
      [&](int64_t task, std::vector<float>& sums) {
        const int64_t first = task * kMaxBlocks;
        const int group = static_cast<int>(std::min<int64_t>(kMaxBlocks, blocks - first));
        const int64_t first_column = first * kBlock;
        const int64_t group_columns = std::min<int64_t>(columns - first_column, group * kBlock);
        // K in chunks whose weights stay in L1 while every row's tiles pass over them.
        for (int64_t p0 = 0; p0 < pairs; p0 += kChunkPairs) {
          const int64_t p1 = std::min(pairs, p0 + kChunkPairs);
          for (int64_t r = 0; r < rows; r += kMaxRows) {
            const int n = static_cast<int>(std::min<int64_t>(kMaxRows, rows - r));
            pick(n, group, r > 0)(x_data + r * x_row, x_row, w_data + first * block_elems, block_elems, p0, p1,
                                  sums.data() + r * kGroupColumns, p0 == 0, p1 == pairs,
                                  bias_data ? bias_data + first_column : nullptr,
                                  out_data ? out_data + r * out_row + first_column : nullptr,
                                  out_f32 ? out_f32 + r * out_row + first_column : nullptr, out_row, group_columns);
          }
        }
      });
#endif
}

}  // namespace helexa_cpu

TORCH_LIBRARY_FRAGMENT(helexa_cpu, m) {
  m.def("bf16_linear_available() -> bool", &bf16_linear_available);
  m.def("bf16_linear_amx() -> bool", &bf16_linear_amx);
  m.def("set_amx_wanted(bool wanted) -> bool", &set_amx_wanted);
  m.def("bf16_linear(Tensor(a!) out, Tensor x, Tensor packed, Tensor? bias) -> ()");
}

TORCH_LIBRARY_IMPL(helexa_cpu, CPU, m) {
  m.impl("bf16_linear", &helexa_cpu::bf16_linear);
}
