// What the kernels that run on Intel's AMX tiles (Sapphire Rapids and later) share: the tile
// configuration's memory layout and the one-time request for the tile state. Compiled only where the
// build's -march has AMX (__AMX_TILE__ and __AMX_BF16__); callers check INFER_AMX.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define INFER_AMX 1

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>

namespace infer_amx {

// LDTILECFG's 64 bytes (palette 1): per tile register, its rows and its bytes per row
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Linux hands out the tile state only to a process that asks for it (once; false where it refuses)
inline bool permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
}

// The linears' layout (small_linear.cpp, quant_linear.cpp): C tiles 0-3 (two blocks of up to 16 rows x
// two of 16 channels), A tiles 4-5 (the two row blocks), B tiles 6-7 (the two channel blocks), 64 bytes
// a row each; for `rows` (1-32) rows of x. `depth_bytes` < 64 makes the tiles shallower: A rows of that
// many bytes, B tiles of depth_bytes / 4 rows (int8 groups of 32: one group a tile product)
inline TileConfig rows_config(int64_t rows, int depth_bytes = 64) {
  const uint8_t r0 = std::min<int64_t>(16, rows), r1 = std::max<int64_t>(1, std::min<int64_t>(16, rows - 16));
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64;
  cfg.colsb[4] = cfg.colsb[5] = depth_bytes;
  cfg.rows[0] = cfg.rows[1] = cfg.rows[4] = r0;
  cfg.rows[2] = cfg.rows[3] = cfg.rows[5] = r1;
  cfg.rows[6] = cfg.rows[7] = depth_bytes / 4;
  return cfg;
}

}  // namespace infer_amx

#endif
