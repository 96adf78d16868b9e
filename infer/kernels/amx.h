// What the kernels that run on Intel's AMX tiles (Sapphire Rapids and later) share: the tile
// configuration's memory layout and the one-time request for the tile state. Compiled only where the
// build's -march has AMX (__AMX_TILE__ and __AMX_BF16__); callers check INFER_AMX.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define INFER_AMX 1

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

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

}  // namespace infer_amx

#endif
