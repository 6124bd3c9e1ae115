// One query row's paged attention on AMX tiles, bf16, for cpu_decode.cpp.
//
// Scores: the keys of 16 cache slots are one A tile as they lie in the cache (16 rows, 32 values of
// a key row each, a cache row apart), and the query, packed once per row into B tiles whose 16
// columns are the query heads (each head's values only in the chunks of its own kv head, zeros
// elsewhere), is the other operand: one tile multiply per 32 values of the key row gives 16 keys x
// 16 heads of scores in a C tile. No key is widened or transposed, and no sum reduced across lanes.
//
// One pass over the sequence, 16 slots at a time: scores, then an online softmax down the keys with
// the heads in the lanes (a running max per head; the sums so far are rescaled when it grows), then
// the weighted values of the same slots, each head's weight of a key one broadcast, a kv head's
// group of sums in registers for the tile. Keys and values of a tile are read together, and the
// next tile's are prefetched: a sequence's blocks lie anywhere in the cache, and in a real step
// they come from memory (the weights streamed between layers evicted them).
//
// Applies to bf16 caches whose blocks hold a multiple of 16 slots, with head_dim a multiple of 32
// up to 128 and at most 16 query heads (`decode_applies`); scores, softmax and sums are fp32.
#pragma once

#include "../amx.h"

#ifdef HELEXA_AMX

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

namespace helexa_amx {

using Vec = at::vec::Vectorized<float>;

constexpr int kKeysPerTile = 16;
constexpr int kValuesPerChunk = 32;  // one A tile row: 32 bf16 of a key row
constexpr int kQueryTile = kTileRows * kTileBytes / 2;  // bf16 elements of one packed query tile
constexpr int kMaxHeadDim = 128;
constexpr int64_t kPrefetchTiles = 2;  // how far ahead a tile's keys and values are asked for

inline bool decode_applies(int64_t num_heads, int64_t head_dim, int64_t block_size) {
  return num_heads <= kTileRows && head_dim % kValuesPerChunk == 0 && head_dim <= kMaxHeadDim &&
         block_size % kKeysPerTile == 0;
}

// A thread's buffers: the packed query, the sums [head][head_dim], and its tiles.
struct DecodeScratch {
  std::vector<uint16_t> query;
  std::vector<float> sums;
  Tiles tiles;
};

// The query row as B tiles: tile c holds values [32c, 32c + 32) of the key row (one kv head's
// chunk), pairs in rows, heads in columns: query[c][pair][head][2].
inline void pack_query(const uint16_t* q, int64_t q_head, int64_t num_heads, int64_t group, int64_t head_dim,
                       int64_t chunks, std::vector<uint16_t>& query) {
  query.assign(chunks * kQueryTile, 0);
  for (int64_t h = 0; h < num_heads; ++h) {
    const int64_t base = (h / group) * head_dim;  // where this head's kv head sits in a key row
    for (int64_t d = 0; d < head_dim; ++d) {
      const int64_t at = base + d, c = at / kValuesPerChunk, within = at % kValuesPerChunk;
      query[c * kQueryTile + (within / 2) * 32 + h * 2 + within % 2] = q[h * q_head + d];
    }
  }
}

// With CHUNKS <= 6 the query's B tiles are loaded once per row, into tiles 2..7, beside the C tile 0
// and the A tile 1. (The intrinsics want literal tile numbers.)
template <int CHUNKS>
inline void load_query(const uint16_t* query) {
  _tile_loadd(2, query, kTileBytes);
  if (CHUNKS > 1) _tile_loadd(3, query + kQueryTile, kTileBytes);
  if (CHUNKS > 2) _tile_loadd(4, query + 2 * kQueryTile, kTileBytes);
  if (CHUNKS > 3) _tile_loadd(5, query + 3 * kQueryTile, kTileBytes);
  if (CHUNKS > 4) _tile_loadd(6, query + 4 * kQueryTile, kTileBytes);
  if (CHUNKS > 5) _tile_loadd(7, query + 5 * kQueryTile, kTileBytes);
}

// scores[j][h] = <key j, query head h> for 16 slots from `keys`, unscaled; slots past the sequence
// hold whatever the cache does there, and are never read. CHUNKS 1-6: the query is in tiles 2..7
// (load_query); 0: any number of chunks, each query tile loaded beside its key tile.
template <int CHUNKS>
inline void score_tile(const uint16_t* keys, int64_t key_stride, int64_t chunks, const uint16_t* query,
                       float* scores) {
  _tile_zero(0);
  if constexpr (CHUNKS == 0) {
    for (int64_t c = 0; c < chunks; ++c) {
      _tile_loadd(1, keys + c * kValuesPerChunk, key_stride);
      _tile_loadd(2, query + c * kQueryTile, kTileBytes);
      _tile_dpbf16ps(0, 1, 2);
    }
  } else {
#define HELEXA_AMX_CHUNK(c, tile)                                 \
    if (CHUNKS > c) {                                             \
      _tile_loadd(1, keys + c * kValuesPerChunk, key_stride);     \
      _tile_dpbf16ps(0, 1, tile);                                 \
    }
    HELEXA_AMX_CHUNK(0, 2)
    HELEXA_AMX_CHUNK(1, 3)
    HELEXA_AMX_CHUNK(2, 4)
    HELEXA_AMX_CHUNK(3, 5)
    HELEXA_AMX_CHUNK(4, 6)
    HELEXA_AMX_CHUNK(5, 7)
#undef HELEXA_AMX_CHUNK
  }
  _tile_stored(0, scores, kTileBytes);
}

// The next tile's keys and values into L1 while this one computes.
inline void prefetch_slots(const uint16_t* keys, const uint16_t* values, int64_t bytes) {
  const char* k = reinterpret_cast<const char*>(keys);
  const char* v = reinterpret_cast<const char*>(values);
  for (int64_t at = 0; at < bytes; at += 64) {
    _mm_prefetch(k + at, _MM_HINT_T1);
    _mm_prefetch(v + at, _MM_HINT_T1);
  }
}

// sums[h][:] = sums[h][:] * rescale[h0 + h] + sum_j weights[j][h0 + h] * value_j for the GROUP
// heads h0.. of one kv head, whose values start at `values` in each of `count` slots.
template <int GROUP, int KCHUNKS>
inline void tile_values(const uint16_t* values, int64_t cache_row, int64_t count, const float* weights,
                        const float* rescale, int64_t h0, float* sums) {
  __m512 acc[GROUP][KCHUNKS];
  for (int g = 0; g < GROUP; ++g) {
    const __m512 factor = _mm512_set1_ps(rescale[h0 + g]);
    for (int c = 0; c < KCHUNKS; ++c) acc[g][c] = _mm512_mul_ps(_mm512_loadu_ps(sums + (g * KCHUNKS + c) * 16), factor);
  }
  for (int64_t j = 0; j < count; ++j) {
    const uint16_t* value = values + j * cache_row;
    __m512 v[KCHUNKS];
    for (int c = 0; c < KCHUNKS; ++c) {
      v[c] = _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(value + c * 16)));
    }
    const float* w = weights + j * kTileRows + h0;
    for (int g = 0; g < GROUP; ++g) {
      const __m512 p = _mm512_set1_ps(w[g]);
      for (int c = 0; c < KCHUNKS; ++c) acc[g][c] = _mm512_fmadd_ps(p, v[c], acc[g][c]);
    }
  }
  for (int g = 0; g < GROUP; ++g)
    for (int c = 0; c < KCHUNKS; ++c) _mm512_storeu_ps(sums + (g * KCHUNKS + c) * 16, acc[g][c]);
}

using TileValuesFn = void (*)(const uint16_t*, int64_t, int64_t, const float*, const float*, int64_t, float*);

// The form for up to `heads` heads of head_dim / 16 = KCHUNKS vectors that keeps its sums in
// registers (at most 24); sets how many heads one call takes.
template <int KCHUNKS>
inline TileValuesFn pick_tile_values(int64_t heads, int64_t* heads_per_call) {
  constexpr int kMost = std::min(6, 24 / KCHUNKS);
  *heads_per_call = std::min<int64_t>(heads, kMost);
  switch (*heads_per_call) {
    case 1: return &tile_values<1, KCHUNKS>;
    case 2: return &tile_values<2, KCHUNKS>;
    case 3: return &tile_values<std::min(3, kMost), KCHUNKS>;
    case 4: return &tile_values<std::min(4, kMost), KCHUNKS>;
    case 5: return &tile_values<std::min(5, kMost), KCHUNKS>;
    default: return &tile_values<kMost, KCHUNKS>;
  }
}

inline TileValuesFn pick_tile_values(int64_t head_dim, int64_t heads, int64_t* heads_per_call) {
  switch (head_dim / 16) {
    case 2: return pick_tile_values<2>(heads, heads_per_call);
    case 4: return pick_tile_values<4>(heads, heads_per_call);
    case 6: return pick_tile_values<6>(heads, heads_per_call);
    default: return pick_tile_values<8>(heads, heads_per_call);
  }
}

// The one pass over a row's sequence (see the top of this file).
template <int CHUNKS>
inline void attend(const uint16_t* k_cache, const uint16_t* v_cache, const int32_t* table, int64_t block_size,
                   int64_t num_kv_heads, int64_t head_dim, int64_t num_heads, int64_t seq_len, float scale,
                   DecodeScratch& s) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t cache_row = num_kv_heads * head_dim;
  const int64_t chunks = cache_row / kValuesPerChunk;
  const int64_t tile_bytes = kKeysPerTile * cache_row * 2;
  if constexpr (CHUNKS > 0) load_query<CHUNKS>(s.query.data());
  const auto slots = [&](int64_t first) {
    return table[first / block_size] * block_size * cache_row + (first % block_size) * cache_row;
  };
  // How a kv head's group of query heads is cut into calls of tile_values, picked once per row.
  TileValuesFn call_fn[kTileRows];
  int64_t call_first[kTileRows];
  int value_calls = 0;
  for (int64_t h = 0; h < group; ++value_calls) {
    int64_t heads = 1;
    call_fn[value_calls] = pick_tile_values(head_dim, group - h, &heads);
    call_first[value_calls] = h;
    h += heads;
  }
  alignas(64) float scores[kKeysPerTile * kTileRows];
  alignas(64) float rescale[kTileRows];
  const Vec vscale(scale);
  Vec top(-std::numeric_limits<float>::infinity()), total(0.f);
  for (int64_t first = 0; first < seq_len; first += kKeysPerTile) {
    const int64_t count = std::min<int64_t>(kKeysPerTile, seq_len - first);
    const int64_t at = slots(first);
    if (first == 0) {
      for (int64_t ahead = 0; ahead < kPrefetchTiles; ++ahead) {
        if (ahead * kKeysPerTile < seq_len) {
          const int64_t next = slots(ahead * kKeysPerTile);
          prefetch_slots(k_cache + next, v_cache + next, tile_bytes);
        }
      }
    }
    if (first + kPrefetchTiles * kKeysPerTile < seq_len) {
      const int64_t next = slots(first + kPrefetchTiles * kKeysPerTile);
      prefetch_slots(k_cache + next, v_cache + next, tile_bytes);
    }
    score_tile<CHUNKS>(k_cache + at, cache_row * 2, chunks, s.query.data(), scores);
    Vec tile_top = Vec::loadu(scores);
    for (int64_t j = 1; j < count; ++j) tile_top = at::vec::maximum(tile_top, Vec::loadu(scores + j * kTileRows));
    const Vec new_top = at::vec::maximum(top, tile_top);
    // The sums so far were weighted against the old max: scaled down to the new one (none yet on
    // the first tile, whose old max is -inf).
    const Vec factor = first == 0 ? Vec(0.f) : ((top - new_top) * vscale).exp_u20();
    factor.store(rescale);
    total = total * factor;
    for (int64_t j = 0; j < count; ++j) {
      const Vec e = ((Vec::loadu(scores + j * kTileRows) - new_top) * vscale).exp_u20();
      e.store(scores + j * kTileRows);
      total = total + e;
    }
    top = new_top;
    for (int64_t kv = 0; kv < num_kv_heads; ++kv) {
      for (int c = 0; c < value_calls; ++c) {
        const int64_t h0 = kv * group + call_first[c];
        call_fn[c](v_cache + at + kv * head_dim, cache_row, count, scores, rescale, h0, s.sums.data() + h0 * head_dim);
      }
    }
  }
  alignas(64) float totals[kTileRows];
  total.store(totals);
  for (int64_t h = 0; h < num_heads; ++h) {
    const Vec inv(1.f / totals[h]);
    for (int64_t d = 0; d < head_dim; d += 16) (Vec::loadu(s.sums.data() + h * head_dim + d) * inv).store(s.sums.data() + h * head_dim + d);
  }
}

// out[h][:] (bf16, `out_head` apart) = attention of the query row over the sequence's first seq_len keys.
inline void decode_row(const uint16_t* q, int64_t q_head, const uint16_t* k_cache, const uint16_t* v_cache,
                       const int32_t* table, int64_t block_size, int64_t num_kv_heads, int64_t head_dim,
                       int64_t num_heads, int64_t seq_len, float scale, uint16_t* out, int64_t out_head,
                       DecodeScratch& s) {
  const int64_t chunks = num_kv_heads * head_dim / kValuesPerChunk;
  const int all16[8] = {kTileRows, kTileRows, kTileRows, kTileRows, kTileRows, kTileRows, kTileRows, kTileRows};
  s.tiles.shape(1, all16);
  pack_query(q, q_head, num_heads, num_heads / num_kv_heads, head_dim, chunks, s.query);
  s.sums.assign(num_heads * head_dim, 0.f);
#define HELEXA_ATTEND(C) \
  attend<C>(k_cache, v_cache, table, block_size, num_kv_heads, head_dim, num_heads, seq_len, scale, s)
  switch (chunks) {
    case 1: HELEXA_ATTEND(1); break;
    case 2: HELEXA_ATTEND(2); break;
    case 3: HELEXA_ATTEND(3); break;
    case 4: HELEXA_ATTEND(4); break;
    case 5: HELEXA_ATTEND(5); break;
    case 6: HELEXA_ATTEND(6); break;
    default: HELEXA_ATTEND(0);
  }
#undef HELEXA_ATTEND
  for (int64_t h = 0; h < num_heads; ++h) {
    uint16_t* dst = out + h * out_head;
    for (int64_t d = 0; d < head_dim; d += 16) {
      const __m512 o = _mm512_loadu_ps(s.sums.data() + h * head_dim + d);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d), (__m256i)_mm512_cvtneps_pbh(o));
    }
  }
}

}  // namespace helexa_amx

#endif
