// What the AMX forms of the C++ CPU kernels share: permission to use the tiles, and their shapes.
//
// Built only for a CPU with AMX-BF16 (-march=native defines __AMX_TILE__ and __AMX_BF16__).
// Linux hands a process the 8 KiB of tile state only once it asks (`arch_prctl(ARCH_REQ_XCOMP_PERM)`);
// `ready()` asks once and says whether it was granted. Tile shapes are per thread: a kernel
// shapes them through a `Tiles` in each thread it runs in, which releases them when that thread's
// share is done.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define HELEXA_AMX 1

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>

namespace helexa_amx {

constexpr int kTileRows = 16;   // the most rows a tile has
constexpr int kTileBytes = 64;  // the most bytes a tile row has: 32 bf16 or 16 fp32

inline bool request_permission() {
  constexpr long kReqXcompPerm = 0x1023;
  constexpr long kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
}

// Whether the AMX forms are wanted (the default; switched off to compare or test the others).
inline std::atomic<bool>& wanted() {
  static std::atomic<bool> flag{true};
  return flag;
}

// Whether this process may use the tiles (asked once) and the AMX forms are wanted.
inline bool ready() {
  static const bool granted = request_permission();
  return granted && wanted().load(std::memory_order_relaxed);
}

// ldtilecfg's 64-byte operand: palette 1, then per tile its bytes per row and its rows.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-7, each 64 bytes wide with rows[t] rows.
inline void configure(const int (&rows)[8]) {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = kTileBytes;
    config.rows[t] = static_cast<uint8_t>(rows[t]);
  }
  _tile_loadconfig(&config);
}

// A thread's tiles during one kernel call: shaped on demand (`shape`, a no-op when `key` names the
// shape they have), released when the call's work in that thread is done.
class Tiles {
 public:
  Tiles() = default;
  Tiles(Tiles&& other) noexcept : key_(other.key_) { other.key_ = 0; }
  Tiles(const Tiles&) = delete;
  Tiles& operator=(const Tiles&) = delete;
  ~Tiles() {
    if (key_) _tile_release();
  }
  // key: any nonzero number that stands for these rows.
  void shape(int key, const int (&rows)[8]) {
    if (key != key_) configure(rows);
    key_ = key;
  }

 private:
  int key_ = 0;
};

}  // namespace helexa_amx

#endif
