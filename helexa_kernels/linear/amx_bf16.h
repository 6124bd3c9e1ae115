// The bf16 linear on AMX tiles (Intel Sapphire Rapids and later), from the same packed weight as
// the AVX512-BF16 form in cpu_bf16_linear.cpp.
//
// The packed weight [N/16, K/2, 16, 2] is already what `tdpbf16ps` takes as its B operand: 16
// consecutive K pairs of one block are a 16-row x 64-byte tile, 64 bytes apart. A task takes a
// group of up to kAmxBlocks blocks (64 output columns) and walks K 32 at a time, keeping the sums in
// fp32 C tiles. Up to 16 rows of x are one A tile, and each weight tile is loaded once and multiplied
// once: a decode step's few rows are bound by streaming the weight, which each group reads as
// kAmxBlocks sequential streams (2-core Sapphire Rapids, the default model's projections and LM head:
// 16 rows 11.4 ms, ~24 GB/s, against oneDNN's 14.6). More rows repeat the pass per 16 rows, each
// weight tile then read again from cache; a tile load waits for the multiply still reading its
// tile, so from a few tiles of rows on oneDNN's blocking does better, and `engine.cpu.cpu_linear`
// measures where that starts.
//
// Where AMX is refused (helexa_kernels/amx.h), or K is not a multiple of 32, the caller keeps the
// AVX512-BF16 form.
#pragma once

#include "../amx.h"

#ifdef HELEXA_AMX

#include <cstdint>

namespace helexa_amx {

constexpr int kAmxBlocks = 4;      // C tiles 0-3 hold a group's sums; A is tile 4, B tiles 5-7
constexpr int kPairsPerStep = 16;  // 32 values of K per multiply

// Sums of a tile pass, [kTileRows][kAmxBlocks * 16] fp32: row i's block b at i * kSumsRow + b * 16.
constexpr int kSumsRow = kAmxBlocks * kTileRows;
constexpr int64_t kSumsRowBytes = kSumsRow * sizeof(float);

// Tiles for `m` rows of x: C tiles 0-3 and A tile 4 have m rows, B tiles 5-7 sixteen K pairs.
inline void shape_for_rows(Tiles& tiles, int m) {
  const int rows[8] = {m, m, m, m, m, kTileRows, kTileRows, kTileRows};
  tiles.shape(m, rows);
}

// B tile `kB` from block `b` of the group at K pairs [p, p + 16).
#define HELEXA_AMX_LOAD_B(kB, b) _tile_loadd(kB, w + (b) * block_stride + p * 2 * kTileRows, kTileBytes)

// One tile of x times BLOCKS blocks over all K pairs, into `sums`. Each weight tile is loaded once
// and used once: for a decode step's rows the weight streams from memory once.
template <int BLOCKS>
inline void multiply(const uint16_t* x, int64_t x_row_bytes, const uint16_t* w, int64_t block_stride,
                     int64_t pairs, float* sums) {
  _tile_zero(0);
  if (BLOCKS > 1) _tile_zero(1);
  if (BLOCKS > 2) _tile_zero(2);
  if (BLOCKS > 3) _tile_zero(3);
  for (int64_t p = 0; p < pairs; p += kPairsPerStep) {
    _tile_loadd(4, x + p * 2, x_row_bytes);
    HELEXA_AMX_LOAD_B(5, 0);
    _tile_dpbf16ps(0, 4, 5);
    if (BLOCKS > 1) {
      HELEXA_AMX_LOAD_B(6, 1);
      _tile_dpbf16ps(1, 4, 6);
    }
    if (BLOCKS > 2) {
      HELEXA_AMX_LOAD_B(7, 2);
      _tile_dpbf16ps(2, 4, 7);
    }
    if (BLOCKS > 3) {
      HELEXA_AMX_LOAD_B(5, 3);
      _tile_dpbf16ps(3, 4, 5);
    }
  }
  _tile_stored(0, sums, kSumsRowBytes);
  if (BLOCKS > 1) _tile_stored(1, sums + kTileRows, kSumsRowBytes);
  if (BLOCKS > 2) _tile_stored(2, sums + 2 * kTileRows, kSumsRowBytes);
  if (BLOCKS > 3) _tile_stored(3, sums + 3 * kTileRows, kSumsRowBytes);
}

#undef HELEXA_AMX_LOAD_B

using MultiplyFn = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, int64_t, float*);

inline MultiplyFn pick(int blocks) {
  switch (blocks) {
    case 1: return &multiply<1>;
    case 2: return &multiply<2>;
    case 3: return &multiply<3>;
    default: return &multiply<4>;
  }
}

}  // namespace helexa_amx

#endif
