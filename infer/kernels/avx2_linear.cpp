// y = x @ W^T + bias on a CPU with AVX2 and FMA but no bf16 arithmetic, reading the weight's own bytes
// once. bf16 weights, at any row count: widened to float32 in registers (a decode reads half a float32
// copy's bytes; a prompt multiplies faster than torch's float32 GEMM over a widened copy).
// int8 or int4 codes with a scale (and offset) per group of inputs, at any row count:
// multiplied as int8 against x rounded to int8 per block of 32 (as llama.cpp's Q8_0 and Q4_0 on AVX2), or
// widened to float32 where asked for exact float32 sums (then few rows only).
// torch's bf16 matmul on such a CPU costs about one matrix-vector product per row, an int8 weight in
// groups (a GGUF file's Q8_0) has no torch kernel at all, and torch's int4 kernel is slower than this.
// Figures: docs/optimizations.md, "bf16 on a CPU without bf16 arithmetic"; docs/quantization.md, "GGUF
// files"; docs/performance.md, "On a CPU with AVX2 alone".
//
// bf16 layout: infer/layers/linear.py's pack_pairs (the AVX-512 kernels' too), blocks of 16 output
// channels, each block's inputs pair by pair, a pair's 16 channels side by side with their two inputs
// adjacent: [N / 16][K / 2][16][2]. A tile is up to 6 rows x 16 channels (one or two rows: 32), x's values
// broadcast, no sums across lanes at the end.
//
// Codes layout (infer/quant/linear.py packs it at load, in place of the row-major codes): output channels
// in blocks of 8, each block's codes in runs of 4 inputs x 8 channels, 32 bytes, channel i's 4 codes at
// bytes 4i..4i+3, so that one load holds 8 channels' terms side by side: int8 [N / 8][K / 4][8][4];
// int4 (codes 0..15; symmetric ones shifted by 8, -8 x scale their offset) per block of 32 inputs 4 x 32
// bytes, run t holding inputs 4t..4t+3 in its low nibbles and 16 + 4t.. in its high ones, [N / 8][K / 32]
// [4][8][4]. Scales and offsets [N / 8][K / group][8], float16 (a Q8_0 or Q4_0 block's own scale, exact)
// or float32 (K-quants' products of two scales, which float16 does not hold exactly).
// Threads (torch's OpenMP pool) take ranges of output channels.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <vector>

#include "vec.h"

namespace {

#if defined(__AVX2__) && defined(__FMA__)

constexpr int64_t kRowChunk = 4;  // rows per tile of codes

struct Problem {
  const float* x;  // [M, K] float32 (bf16 weights: packed by row groups, pack_group)
  const void* w;   // bf16 in pairs, or codes interleaved (file comment)
  const void* scales;   // codes: [N / 8, K / group, 8], float16 or float32
  const void* offsets;  // codes: as the scales, or null
  bool half_scales;
  bool int4;
  // int8 activations: x rounded to int8 per block of 32 inputs [M, K] and its blocks' scales [M, K / 32];
  // else null
  const int8_t* xq;
  const float* xscale;
  const float* xsum;  // with offsets: each row's sum of x (int8 activations: of the rounded x) per group
  const float* bias;     // [N] float32 or null
  void* y;               // [M, N] in x's dtype
  bool bf16_out;
  float* sums;  // bf16 weights: the tiles' float32 sums [M, N]: y itself where y is float32 and no bias
  int64_t M, N, K, group;
};

// x [M, K] float32 -> int8 per block of 32 (scale max|x| / 127, rounded to nearest even), for codes_w8a8
void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* xq, float* xscale) {
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes the packs' lane interleave
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < K / 32; ++b) {
      const float* src = x + m * K + b * 32;
      __m256 v[4], amax = _mm256_setzero_ps();
      const __m256 sign_bit = _mm256_set1_ps(-0.f);
      for (int i = 0; i < 4; ++i) {
        v[i] = _mm256_loadu_ps(src + 8 * i);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_bit, v[i]));
      }
      __m128 h = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
      h = _mm_max_ps(h, _mm_movehl_ps(h, h));
      const float top = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
      xscale[m * (K / 32) + b] = top / 127.f;
      const __m256 inv = _mm256_set1_ps(top > 0.f ? 127.f / top : 0.f);
      __m256i q[4];
      for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
      const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + m * K + b * 32),
                          _mm256_permutevar8x32_epi32(packed, order));
    }
}

// each row's sum over each weight group [M, K / group], for the groups' offsets: of x, or given xq, of the
// rounded x (block scale times code)
void group_sums(const float* x, const int8_t* xq, const float* xscale, int64_t M, int64_t K, int64_t group,
                float* xsum) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < K / group; ++g) {
      float sum = 0.f;
      if (xq) {
        const int64_t run = std::min<int64_t>(group, 32);  // codes of one block's scale (groups of 16: half)
        for (int64_t k0 = g * group; k0 < (g + 1) * group; k0 += run) {
          int32_t codes = 0;  // summed as integers (vectorized), then scaled
          for (int64_t k = k0; k < k0 + run; ++k) codes += xq[m * K + k];
          sum += xscale[m * (K / 32) + k0 / 32] * codes;
        }
      } else {
        for (int64_t k = g * group; k < (g + 1) * group; ++k) sum += x[m * K + k];
      }
      xsum[m * (K / group) + g] = sum;
    }
}

// ---- bf16 weights in pairs (file comment) ----

#define UNROLL _Pragma("GCC unroll 8")

constexpr int kGroupRows = 6;       // rows of a tile: 6 x 2 accumulators, 2 weight vectors, a broadcast
constexpr int kChunkGroups = 8;     // row groups whose packed x stays in L2 while a thread's blocks pass
constexpr int64_t kAheadPairs = 16;  // input pairs prefetched ahead in each block's stream

// M rows make this many groups of at most kGroupRows
inline int64_t row_groups(int64_t M) { return (M + kGroupRows - 1) / kGroupRows; }

// the first row of group g, the groups as even as can be (8 rows: 4 + 4, not 6 + 2: 2 rows keep half the
// FMA units waiting on their accumulators)
inline int64_t group_start(int64_t g, int64_t M) {
  const int64_t groups = row_groups(M);
  return g * (M / groups) + std::min(g, M % groups);
}

// x's rows in groups of R, each group's inputs pair by pair: [K / 2][2][R] float32, so that a tile's
// broadcasts read one stream, in order (6 row streams from L2 halved the tiles' speed)
template <typename T>
void pack_group(const T* x, int64_t K, int64_t m0, int64_t R, float* out) {
  for (int64_t r = 0; r < R; ++r) {
    const T* row = x + (m0 + r) * K;
    for (int64_t k = 0; k < K; ++k) out[(k / 2) * 2 * R + (k % 2) * R + r] = static_cast<float>(row[k]);
  }
}

// A tile's float32 sums (`sums`, row stride N), plus the bias, into y's dtype
void finish(const Problem& P, const float* sums, int64_t n0, int64_t channels, int64_t m0, int64_t rows) {
  for (int64_t m = m0; m < m0 + rows; ++m)
    for (int64_t n = n0; n < n0 + channels; n += 8) {
      __m256 v = _mm256_loadu_ps(sums + m * P.N + n);
      if (P.bias) v = _mm256_add_ps(v, _mm256_loadu_ps(P.bias + n));
      if (P.bf16_out)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<c10::BFloat16*>(P.y) + m * P.N + n),
                         infer_vec::bf16x8(v));
      else
        _mm256_storeu_ps(static_cast<float*>(P.y) + m * P.N + n, v);
    }
}

// R rows (packed x: xp) times CB blocks of 16 channels from block nb. Each load holds one input pair of 8
// channels, a 32-bit lane per channel: shifted left by 16 it is the pair's first weight in float32, its
// high half alone the second. Every (row, channel) sums its terms in input order in one accumulator, in
// every tile shape: a row's outputs do not depend on the rows beside it.
// Built as -O2, its loops unrolled by hand: GCC -O3 stores every accumulator to the stack at every input
// pair (never read back in the loop), which halved the tile's speed.
template <int R, int CB>
__attribute__((optimize("O2"))) void tile_pairs(const Problem& P, const float* xp, int64_t nb, int64_t m0) {
  const int64_t K = P.K;
  __m256 acc[R][CB][2];
  UNROLL for (int r = 0; r < R; ++r)
    UNROLL for (int c = 0; c < CB; ++c) acc[r][c][0] = acc[r][c][1] = _mm256_setzero_ps();
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  const auto* w = static_cast<const uint16_t*>(P.w) + nb * 16 * K;
  for (int64_t k = 0; k < K; k += 2, xp += 2 * R, w += 32) {
    __m256i pair[CB][2];
    UNROLL for (int c = 0; c < CB; ++c) {
      const uint16_t* p = w + c * 16 * K;
      _mm_prefetch(reinterpret_cast<const char*>(p + kAheadPairs * 32), _MM_HINT_T0);
      pair[c][0] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
      pair[c][1] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16));
    }
    UNROLL for (int c = 0; c < CB; ++c) {
      const __m256 w0 = _mm256_castsi256_ps(_mm256_slli_epi32(pair[c][0], 16));
      const __m256 w1 = _mm256_castsi256_ps(_mm256_slli_epi32(pair[c][1], 16));
      UNROLL for (int r = 0; r < R; ++r) {
        const __m256 xb = _mm256_broadcast_ss(xp + r);
        acc[r][c][0] = _mm256_fmadd_ps(w0, xb, acc[r][c][0]);
        acc[r][c][1] = _mm256_fmadd_ps(w1, xb, acc[r][c][1]);
      }
    }
    UNROLL for (int c = 0; c < CB; ++c) {
      const __m256 w0 = _mm256_castsi256_ps(_mm256_and_si256(pair[c][0], high));
      const __m256 w1 = _mm256_castsi256_ps(_mm256_and_si256(pair[c][1], high));
      UNROLL for (int r = 0; r < R; ++r) {
        const __m256 xb = _mm256_broadcast_ss(xp + R + r);
        acc[r][c][0] = _mm256_fmadd_ps(w0, xb, acc[r][c][0]);
        acc[r][c][1] = _mm256_fmadd_ps(w1, xb, acc[r][c][1]);
      }
    }
  }
  UNROLL for (int r = 0; r < R; ++r)
    UNROLL for (int c = 0; c < CB; ++c) {
      float* out = P.sums + (m0 + r) * P.N + (nb + c) * 16;
      _mm256_storeu_ps(out, acc[r][c][0]);
      _mm256_storeu_ps(out + 8, acc[r][c][1]);
    }
  if (P.sums != P.y) finish(P, P.sums, nb * 16, CB * 16, m0, R);
}

template <int CB>
void group_tile(const Problem& P, const float* xp, int64_t nb, int64_t m0, int64_t rows) {
  switch (rows) {
    case 1: return tile_pairs<1, CB>(P, xp, nb, m0);
    case 2: return tile_pairs<2, CB>(P, xp, nb, m0);
    case 3: return tile_pairs<3, CB>(P, xp, nb, m0);
    case 4: return tile_pairs<4, CB>(P, xp, nb, m0);
    case 5: return tile_pairs<5, CB>(P, xp, nb, m0);
    default: return tile_pairs<6, CB>(P, xp, nb, m0);
  }
}

// Row groups (group_start) times ranges of 16-channel blocks, a range a thread. One or two rows, whose
// time is the weight's bytes: two blocks a tile, two weight streams with enough accumulators.
void run_pairs(const Problem& P) {
  const int64_t groups = row_groups(P.M);
  at::parallel_for(0, P.N / 16, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t g0 = 0; g0 < groups; g0 += kChunkGroups) {
      const int64_t g1 = std::min(groups, g0 + kChunkGroups);
      for (int64_t nb = b0; nb < b1;) {
        if (P.M <= 2 && nb + 2 <= b1) {
          group_tile<2>(P, P.x, nb, 0, P.M);
          nb += 2;
          continue;
        }
        for (int64_t g = g0; g < g1; ++g) {
          const int64_t m0 = group_start(g, P.M);
          group_tile<1>(P, P.x + m0 * P.K, nb, m0, group_start(g + 1, P.M) - m0);
        }
        ++nb;
      }
    }
  });
}

// ---- int8 and int4 codes, interleaved by 8 output channels (file comment) ----

inline __m256 load8(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

// the 4 int8 inputs at p in every lane
inline __m256i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// v itself, kept in a register: the sum it ends stays a chain of adds. Without it GCC reassociates a
// unit's adds into a tree whose partial sums spill to the stack at 4 rows: a 512-row GEMM took 1.5x.
inline __m256i chained(__m256i v) {
  asm("" : "+x"(v));
  return v;
}

// Block nb of 8 output channels: its codes, and its groups' scales and offsets (null without offsets)
template <typename Scale>
struct ChannelBlock {
  const uint8_t* w;
  const Scale* scales;
  const Scale* offsets;
  int64_t groups;
  ChannelBlock(const Problem& P, int64_t nb)
      : w(static_cast<const uint8_t*>(P.w) + nb * 8 * (P.int4 ? P.K / 2 : P.K)),
        scales(static_cast<const Scale*>(P.scales) + nb * (P.K / P.group) * 8),
        offsets(P.offsets ? static_cast<const Scale*>(P.offsets) + nb * (P.K / P.group) * 8 : nullptr),
        groups(P.K / P.group) {}
};

// A channel block's 8 outputs of rows m0.. (acc[r], in channel order) plus the bias, stored in y's dtype
template <int ROWS>
void store8(const Problem& P, const __m256 (&acc)[ROWS], int64_t n0, int64_t m0) {
  const __m256 bias = P.bias ? _mm256_loadu_ps(P.bias + n0) : _mm256_setzero_ps();
  for (int r = 0; r < ROWS; ++r) {
    const __m256 v = _mm256_add_ps(acc[r], bias);
    if (P.bf16_out) {
      alignas(32) float out[8];
      _mm256_store_ps(out, v);
      auto* y = static_cast<c10::BFloat16*>(P.y) + (m0 + r) * P.N + n0;
      for (int i = 0; i < 8; ++i) y[i] = c10::BFloat16(out[i]);  // rounded to nearest even
    } else {
      _mm256_storeu_ps(static_cast<float*>(P.y) + (m0 + r) * P.N + n0, v);
    }
  }
}

// Rows of int8 activations (x rounded per block of 32, as llama.cpp's Q8_0) times a block of 8 channels,
// as llama.cpp's repacked Q4_0 on AVX2 does it: each load holds 4 inputs of the 8 channels, x's 4 inputs
// are broadcast, vpmaddubsw + vpmaddwd sum them per channel exactly (int4: unsigned codes times x, int16
// sums of up to 8 such pairs before widening; int8: |w| times x with w's sign), and one FMA a unit (16 or 32
// inputs) scales the 8 channels' sums by their groups' scales times the block's. Offsets: times each
// group's sum of the rounded x, so that a row gets the weights' dot product with the rounded x.
template <int ROWS, typename Scale, bool INT4, int UNIT>
void codes_w8a8(const Problem& P, int64_t nb, int64_t m0) {
  const auto [w, scales, offsets, groups] = ChannelBlock<Scale>(P, nb);
  const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(15);
  __m256 acc[ROWS];
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const __m256 scale = load8(scales + g * 8);
    if (offsets) {
      const __m256 offset = load8(offsets + g * 8);
      for (int r = 0; r < ROWS; ++r)
        acc[r] = _mm256_fmadd_ps(offset, _mm256_set1_ps(P.xsum[(m0 + r) * groups + g]), acc[r]);
    }
    for (int64_t k = g * P.group; k < (g + 1) * P.group; k += UNIT) {
      __m256i sums[ROWS];
      if constexpr (INT4) {  // UNIT 32: 4 loads, inputs 4t.. in the low nibbles, 16 + 4t.. in the high ones
        for (int r = 0; r < ROWS; ++r) sums[r] = _mm256_setzero_si256();
        for (int t = 0; t < 4; ++t) {
          const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k * 4 + t * 32));
          const __m256i lo = _mm256_and_si256(packed, low);
          const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
          for (int r = 0; r < ROWS; ++r) {
            const int8_t* xr = P.xq + (m0 + r) * P.K + k;
            const __m256i low_terms = _mm256_maddubs_epi16(lo, broadcast4(xr + 4 * t));
            sums[r] = chained(_mm256_add_epi16(sums[r], low_terms));
            const __m256i high_terms = _mm256_maddubs_epi16(hi, broadcast4(xr + 16 + 4 * t));
            sums[r] = chained(_mm256_add_epi16(sums[r], high_terms));
          }
        }
        for (int r = 0; r < ROWS; ++r) sums[r] = _mm256_madd_epi16(sums[r], ones);
      } else {
        for (int r = 0; r < ROWS; ++r) sums[r] = _mm256_setzero_si256();
        for (int t = 0; t < UNIT / 4; ++t) {
          const __m256i codes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k * 8 + t * 32));
          const __m256i magnitude = _mm256_sign_epi8(codes, codes);  // |w| as unsigned bytes (-128 -> 128)
          for (int r = 0; r < ROWS; ++r) {
            const __m256i xv = _mm256_sign_epi8(broadcast4(P.xq + (m0 + r) * P.K + k + 4 * t), codes);
            const __m256i terms = _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, xv), ones);
            sums[r] = chained(_mm256_add_epi32(sums[r], terms));
          }
        }
      }
      for (int r = 0; r < ROWS; ++r) {
        const __m256 dx = _mm256_set1_ps(P.xscale[(m0 + r) * (P.K / 32) + k / 32]);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r]), _mm256_mul_ps(scale, dx), acc[r]);
      }
    }
  }
  store8<ROWS>(P, acc, nb * 8, m0);
}

// Rows of float32 x times a block of 8 channels (no int8 activations: INFER_INT8_ACTIVATIONS=0, the exact
// reference): each 4 inputs' 32 bytes transposed in registers to 4 vectors of the 8 channels' codes, one
// an input, widened to float32 and multiplied by x's input broadcast; a group's sums are then scaled, plus
// its offsets times the group's sum of x.
template <int ROWS, typename Scale, bool INT4>
void codes_float(const Problem& P, int64_t nb, int64_t m0) {
  const auto [w, scales, offsets, groups] = ChannelBlock<Scale>(P, nb);
  // within each 128-bit lane, 4 channels x 4 inputs -> 4 inputs x 4 channels
  const __m256i transpose = _mm256_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15,
                                             0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  const __m256i low = _mm256_set1_epi8(15);
  __m256 acc[ROWS];
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm256_setzero_ps();
  // 4 inputs' codes of the 8 channels (bytes 4i + e: channel i, input e) times rows' x from input k
  auto quad = [&](__m256i codes, int64_t k, __m256 (&sums)[ROWS]) {
    const __m256i t = _mm256_shuffle_epi8(codes, transpose);  // dword e of each lane: input e, 4 channels
    for (int e = 0; e < 4; ++e) {
      const __m256i picked = _mm256_permutevar8x32_epi32(t, _mm256_setr_epi32(e, e + 4, 0, 0, 0, 0, 0, 0));
      const __m128i bytes = _mm256_castsi256_si128(picked);
      const __m256 wv = _mm256_cvtepi32_ps(INT4 ? _mm256_cvtepu8_epi32(bytes) : _mm256_cvtepi8_epi32(bytes));
      for (int r = 0; r < ROWS; ++r)
        sums[r] = _mm256_fmadd_ps(wv, _mm256_set1_ps(P.x[(m0 + r) * P.K + k + e]), sums[r]);
    }
  };
  for (int64_t g = 0; g < groups; ++g) {
    __m256 sums[ROWS];
    for (int r = 0; r < ROWS; ++r) sums[r] = _mm256_setzero_ps();
    for (int64_t k = g * P.group; k < (g + 1) * P.group; k += INT4 ? 32 : 4) {
      if constexpr (INT4) {
        for (int t = 0; t < 4; ++t) {
          const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k * 4 + t * 32));
          quad(_mm256_and_si256(packed, low), k + 4 * t, sums);
          quad(_mm256_and_si256(_mm256_srli_epi16(packed, 4), low), k + 16 + 4 * t, sums);
        }
      } else {
        quad(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k * 8)), k, sums);
      }
    }
    const __m256 scale = load8(scales + g * 8);
    const __m256 offset = offsets ? load8(offsets + g * 8) : _mm256_setzero_ps();
    for (int r = 0; r < ROWS; ++r) {
      acc[r] = _mm256_fmadd_ps(sums[r], scale, acc[r]);
      if (offsets) acc[r] = _mm256_fmadd_ps(offset, _mm256_set1_ps(P.xsum[(m0 + r) * groups + g]), acc[r]);
    }
  }
  store8<ROWS>(P, acc, nb * 8, m0);
}

template <int ROWS, typename Scale, bool INT4>
void codes_tile(const Problem& P, int64_t nb, int64_t m0) {
  if (!P.xq)
    codes_float<ROWS, Scale, INT4>(P, nb, m0);
  else if (INT4 || P.group % 32 == 0)
    codes_w8a8<ROWS, Scale, INT4, 32>(P, nb, m0);
  else
    codes_w8a8<ROWS, Scale, INT4, 16>(P, nb, m0);
}

template <int ROWS>
void codes_rows(const Problem& P, int64_t nb, int64_t m0) {
  if (P.half_scales)
    P.int4 ? codes_tile<ROWS, c10::Half, true>(P, nb, m0) : codes_tile<ROWS, c10::Half, false>(P, nb, m0);
  else
    P.int4 ? codes_tile<ROWS, float, true>(P, nb, m0) : codes_tile<ROWS, float, false>(P, nb, m0);
}

void run_codes(const Problem& P) {
  at::parallel_for(0, P.N / 8, 4, [&](int64_t b0, int64_t b1) {
    for (int64_t nb = b0; nb < b1; ++nb)
      for (int64_t m0 = 0; m0 < P.M; m0 += kRowChunk) {
        switch (std::min(kRowChunk, P.M - m0)) {
          case 1: codes_rows<1>(P, nb, m0); break;
          case 2: codes_rows<2>(P, nb, m0); break;
          case 3: codes_rows<3>(P, nb, m0); break;
          default: codes_rows<4>(P, nb, m0);
        }
      }
  });
}

#endif

at::Tensor avx2_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& scales,
                       const std::optional<at::Tensor>& offsets, const std::optional<at::Tensor>& bias,
                       bool int8_activations) {
#if defined(__AVX2__) && defined(__FMA__)
  const bool int4 = weight.scalar_type() == at::kByte;
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1) * (int4 ? 2 : 1),
              "avx2_linear: x [M, K], weight [N, K] (int4: [N, K / 2])");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "avx2_linear: x bf16 or float32");
  TORCH_CHECK(weight.is_contiguous(), "avx2_linear: a contiguous weight");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const bool codes = weight.scalar_type() == at::kChar || int4;  // codes with scales
  TORCH_CHECK(codes == scales.has_value(), "avx2_linear: int8 and int4 weights, and only they, have scales");
  TORCH_CHECK(codes || weight.scalar_type() == at::kBFloat16, "avx2_linear: bf16, int8 or uint8 (int4) weights");
  TORCH_CHECK(codes || !offsets, "avx2_linear: offsets belong to int8 and int4 weights");
  int64_t group = K;
  if (codes) {
    TORCH_CHECK((scales->scalar_type() == at::kHalf || scales->scalar_type() == at::kFloat) &&
                    scales->is_contiguous() && scales->dim() == 2 && scales->size(0) == N &&
                    K % scales->size(1) == 0,
                "avx2_linear: scales float16 or float32 [N, K / group]");
    group = K / scales->size(1);
    TORCH_CHECK(N % 8 == 0 && K % 32 == 0, "avx2_linear: codes of a multiple of 8 channels and 32 inputs");
    TORCH_CHECK(group % (int4 ? 32 : 16) == 0, "avx2_linear: groups of a multiple of 16 inputs (int4: 32)");
    TORCH_CHECK(!offsets || (offsets->sizes() == scales->sizes() &&
                             offsets->scalar_type() == scales->scalar_type() && offsets->is_contiguous()),
                "avx2_linear: offsets as the scales");
  } else {
    TORCH_CHECK(N % 16 == 0 && K % 2 == 0,
                "avx2_linear: bf16 weights in pairs, of a multiple of 16 channels and an even number of "
                "inputs");
  }
  // x in float32: as given (codes), or widened (codes), or packed by row groups (bf16 weights: pack_group),
  // in a buffer of the calling thread's that outlives the call's threads
  thread_local std::vector<float> buffer;
  const float* xf = nullptr;
  at::Tensor xc = x.contiguous();
  if (!codes) {
    buffer.resize(M * K);
    float* const packed = buffer.data();
    at::parallel_for(0, row_groups(M), 1, [&](int64_t g0, int64_t g1) {
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t m0 = group_start(g, M);
        const int64_t R = group_start(g + 1, M) - m0;
        if (x.scalar_type() == at::kBFloat16)
          pack_group(xc.const_data_ptr<c10::BFloat16>(), K, m0, R, packed + m0 * K);
        else
          pack_group(xc.const_data_ptr<float>(), K, m0, R, packed + m0 * K);
      }
    });
    xf = packed;
  } else if (x.scalar_type() == at::kFloat) {
    xf = xc.const_data_ptr<float>();
  } else {
    buffer.resize(M * K);
    const auto* xb = xc.const_data_ptr<c10::BFloat16>();
    for (int64_t i = 0; i < M * K; ++i) buffer[i] = static_cast<float>(xb[i]);
    xf = buffer.data();
  }
  // int8 activations where asked (as llama.cpp rounds x for its Q8_0 and Q4_0 dot products)
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> xscale, xsum;
  const bool w8a8 = codes && int8_activations;
  if (w8a8) {
    xq.resize(M * K);
    xscale.resize(M * K / 32);
  }
  if (offsets) xsum.resize(M * K / group);
  // rows in parallel (at a prompt's 512 rows, a tenth of the GEMM's time alone), into this thread's
  // buffers (a thread_local named in the lambda would be each worker's own)
  int8_t* const xq_rows = w8a8 ? xq.data() : nullptr;
  float* const xscale_rows = w8a8 ? xscale.data() : nullptr;
  float* const xsum_rows = offsets ? xsum.data() : nullptr;
  if (w8a8 || offsets) {
    at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
      const int64_t rows = m1 - m0;
      int8_t* const q = w8a8 ? xq_rows + m0 * K : nullptr;
      float* const qs = w8a8 ? xscale_rows + m0 * (K / 32) : nullptr;
      if (w8a8) quantize_rows(xf + m0 * K, rows, K, q, qs);
      if (offsets) group_sums(xf + m0 * K, q, qs, rows, K, group, xsum_rows + m0 * (K / group));
    });
  }
  at::Tensor bf = bias ? bias->to(at::kFloat).contiguous() : at::Tensor();
  at::Tensor y = at::empty({M, N}, x.options());
  // the bf16 tiles' float32 sums: y itself, unless a bias or bf16 y comes after them
  thread_local std::vector<float> sum_buffer;
  float* sums = nullptr;
  if (!codes && x.scalar_type() == at::kFloat && !bias) {
    sums = y.data_ptr<float>();
  } else if (!codes) {
    sum_buffer.resize(M * N);
    sums = sum_buffer.data();
  }
  const Problem P{xf,
                  weight.const_data_ptr(),
                  codes ? scales->const_data_ptr() : nullptr,
                  offsets ? offsets->const_data_ptr() : nullptr,
                  codes && scales->scalar_type() == at::kHalf,
                  int4,
                  xq_rows,
                  xscale_rows,
                  xsum_rows,
                  bias ? bf.const_data_ptr<float>() : nullptr,
                  y.data_ptr(),
                  x.scalar_type() == at::kBFloat16,
                  sums,
                  M, N, K, group};
  if (M > 0) codes ? run_codes(P) : run_pairs(P);
  return y;
#else
  TORCH_CHECK(false, "avx2_linear needs AVX2 and FMA; this build has ", infer_vec::kIsa);
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(infer_kernels, m) {
  m.def(
      "avx2_linear(Tensor x, Tensor weight, Tensor? scales, Tensor? offsets, Tensor? bias,"
      " bool int8_activations=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(infer_kernels, CPU, m) {
  m.impl("avx2_linear", &avx2_linear);
}
