// y = x @ dequant(W)^T for int8 and int4 weights, bf16 activations: the linear layers of a quantized
// model (infer/quant/linear.py), for every number of rows from a one-token decode to a prefill chunk.
//
// torch's own weight-only kernels (_weight_int8pack_mm, _weight_int4pack_mm_for_cpu) beat a bf16
// matmul at one row but lose 1.3x at 8 rows and 2.3x at 32 (AMD EPYC; docs/quantization.md has ours).
// Here the weights are laid out as oneDNN lays out bf16 weights for vdpbf16ps (blocks of 16 output
// channels, the two inputs of each pair side by side), so one vector of codes, converted, is one
// operand of vdpbf16ps whose 16 lanes are 16 output channels, and x enters as one broadcast pair:
//
//   int8 activations (the caller's choice: infer/quant/linear.py), with VNNI: x rounded to int8 per
//       row, vpdpbusd on 4-input quads of the codes (run_a8, below: 2.6x the multiply-add rate of
//       vdpbf16ps here); decodes (M <= 4 rows) of int8 codes read them straight into the sums
//       (run_decode_a8); int4 decodes take the bf16 path, whose conversion costs less than the codes'
//       rearrangement for vpdpbusd
//   bf16 activations, decode (M <= 4 rows): per tile of up to 4 blocks (64 channels), per input pair:
//       convert each block's 32 codes in registers -> bf16; acc[row][block] += dp(x pair, w)
//   with AMX (Sapphire Rapids), int8 activations at every row count (int4: from 2 rows): the same int8
//       sums on the tiles (run_amx_a8, below; 64 inputs a tile product, 32 for groups of 32), the codes
//       rearranged into B tiles as they are read
//   batch with bf16 activations (INFER_INT8_ACTIVATIONS=0, or no VNNI): per tile of 2 blocks, per
//       block of 512 inputs: the codes converted once into a 32 KB buffer (L1) -> for each 12 rows of
//       x: 24 accumulators (kept in a small float tile between blocks of inputs) += dp(x pair, w)
//
// No horizontal sums: lanes are channels, an output row is one vector store. Conversion: codes ->
// float32 -> (q - z) * s per group -> bf16, except for int8 with one scale per channel and no zero,
// where the codes are exact in bf16 and the scale multiplies the sum.
//
// Layouts (infer/quant/linear.py packs them); a chunk is 16 channels x 2 inputs = 32 codes:
//   int8   [N / 16][K / 2][16 channels][2 inputs] int8
//   int4   [N / 16][K / 4][32 bytes] uint8, codes 0..15: two chunks (pairs 2i, 2i + 1) share 32 bytes,
//          byte j holding code j of the first (low nibble) and of the second (high nibble)
//   scales float16 [K / group][N] (inputs-major, so that 16 channels are one load); offsets alike,
//          = the weight at code 0 (-zero * scale, or a group's min), or absent: int8 codes are then
//          symmetric, and int4 codes 0..15 stand for q - 8 (llama.cpp's Q4_0; the weight at code 0 is
//          -8 * scale), so neither stores an offset. float16 halves what a group's scale costs to read
//          (llama.cpp's blocks hold theirs so too)
// Requires N a multiple of 16, K and the group size multiples of 32; the caller checks.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "amx.h"
#include "vec.h"

namespace {

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)

constexpr int64_t kLanes = 16;    // channels per block: one fp32 vector
constexpr int64_t kDecode = 4;    // most rows of x on the decode path; blocks per decode tile
constexpr int64_t kRows = 12;     // rows of x per batch micro-tile (x 2 blocks = 24 accumulators)
constexpr int64_t kBlockK = 512;  // inputs per converted batch buffer: 2 blocks x 256 pairs x 64 B = 32 KB

struct Problem {
  const c10::BFloat16* x;
  const uint8_t* w;
  const c10::Half* scales;   // [groups][N]
  const c10::Half* offsets;  // [groups][N], or nullptr: symmetric codes (int4: q - 8)
  const c10::BFloat16* bias;
  c10::BFloat16* y;
  int64_t M, N, K, bits, group;
  bool scale_after;  // int8 per channel, symmetric: exact codes, the scale multiplies the sum
  // int8 activations, int8 weights: [groups][N] sums of each group's codes, int16 for groups of up to
  // 256 (a Q8_0 block's sum fits: half the bytes), int32 for longer groups (one per channel)
  const int16_t* qsums16;
  const int32_t* qsums32;
};

// scale (or offset) of group g for the lanes of a converted chunk: its low half (channels 0-7, each
// twice: two inputs) and its high half (channels 8-15)
inline __m512 load_half(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// the weight at code 0 of group g for channels n..n+15 (the kernel's `shifted` terms): the stored
// offsets, -8 * scale for symmetric int4, 0 for symmetric int8
inline __m512 group_offset(const Problem& P, int64_t g, int64_t n, __m512 scale) {
  if (P.offsets) return load_half(P.offsets + g * P.N + n);
  return P.bits == 4 ? _mm512_mul_ps(scale, _mm512_set1_ps(-8.0f)) : _mm512_setzero_ps();
}

inline void pair_lanes(const c10::Half* v, __m512& lo, __m512& hi) {
  const __m512 c = load_half(v);
  lo = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7), c);
  hi = _mm512_permutexvar_ps(_mm512_setr_epi32(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15), c);
}

struct GroupScale {
  __m512 s_lo, s_hi, o_lo, o_hi;
};

inline GroupScale group_scale(const Problem& P, int64_t block, int64_t g) {
  GroupScale gs;
  pair_lanes(P.scales + g * P.N + block * kLanes, gs.s_lo, gs.s_hi);
  if (P.offsets) {
    pair_lanes(P.offsets + g * P.N + block * kLanes, gs.o_lo, gs.o_hi);
  } else if (P.bits == 4) {
    gs.o_lo = _mm512_mul_ps(gs.s_lo, _mm512_set1_ps(-8.0f));
    gs.o_hi = _mm512_mul_ps(gs.s_hi, _mm512_set1_ps(-8.0f));
  } else {
    gs.o_lo = gs.o_hi = _mm512_setzero_ps();
  }
  return gs;
}

// the 32 codes of int4 chunk `pair` of `block`, one per byte
inline __m256i int4_chunk(const Problem& P, int64_t block, int64_t pair) {
  const uint8_t* p = P.w + (block * (P.K / 4) + pair / 2) * 32;
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm256_and_si256(pair % 2 ? _mm256_srli_epi16(b, 4) : b, _mm256_set1_epi8(0x0F));
}

// chunk `pair` (inputs 2 pair, 2 pair + 1) of `block`, as 32 bf16 in lane order
template <int BITS>
inline __m512bh convert(const Problem& P, int64_t block, int64_t pair, const GroupScale* gs) {
  __m512 lo, hi;
  if constexpr (BITS == 8) {
    const uint8_t* p = P.w + (block * (P.K / 2) + pair) * 32;
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(b)));
    hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(b, 1)));
  } else {
    const __m256i codes = int4_chunk(P, block, pair);  // 32 bytes, one code each
    lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(codes)));
    hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(codes, 1)));
  }
  if (gs) {
    lo = _mm512_fmadd_ps(lo, gs->s_lo, gs->o_lo);
    hi = _mm512_fmadd_ps(hi, gs->s_hi, gs->o_hi);
  }
  return _mm512_cvtne2ps_pbh(hi, lo);
}

inline __m512bh x_pair(const Problem& P, int64_t m, int64_t pair) {
  return (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(P.x + m * P.K + 2 * pair));
}

// 16 sums of channel block `block` for row m -> y, scaled (scale_after), plus the bias
inline void store(const Problem& P, int64_t m, int64_t block, __m512 acc) {
  const int64_t n = block * kLanes;
  if (P.scale_after) acc = _mm512_mul_ps(acc, load_half(P.scales + n));
  if (P.bias) acc = _mm512_add_ps(acc, infer_vec::vload(P.bias + n));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(P.y + m * P.N + n), (__m256i)_mm512_cvtneps_pbh(acc));
}

// a decode's channel blocks in tiles of up to kDecode, spread over the threads: tile(b0, nb)
template <typename Tile>
void decode_tiles(const Problem& P, const Tile& tile) {
  const int64_t blocks = P.N / kLanes, tiles = (blocks + kDecode - 1) / kDecode;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) tile(t * kDecode, std::min(kDecode, blocks - t * kDecode));
  });
}

// ---- decode: up to kDecode rows, blocks b0..b0+NB, every chunk converted in registers ----

template <int BITS, int ROWS, int NB>
void decode_tile(const Problem& P, int64_t b0) {
  __m512 acc[ROWS * NB];
  for (auto& a : acc) a = _mm512_setzero_ps();
  const int64_t groups = P.K / P.group, pairs_per_group = P.group / 2;
  for (int64_t g = 0; g < groups; ++g) {
    GroupScale gs[NB];
    if (!P.scale_after)
      for (int b = 0; b < NB; ++b) gs[b] = group_scale(P, b0 + b, g);
    for (int64_t p = g * pairs_per_group; p < (g + 1) * pairs_per_group; ++p) {
      __m512bh w[NB];
      for (int b = 0; b < NB; ++b) w[b] = convert<BITS>(P, b0 + b, p, P.scale_after ? nullptr : &gs[b]);
      for (int r = 0; r < ROWS; ++r) {
        const __m512bh xs = x_pair(P, r, p);
        for (int b = 0; b < NB; ++b) acc[r * NB + b] = _mm512_dpbf16_ps(acc[r * NB + b], xs, w[b]);
      }
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int b = 0; b < NB; ++b) store(P, r, b0 + b, acc[r * NB + b]);
}

// int4 decodes: codes to bf16 without floats. 128 + q (q = 0..15) is exact in bf16 and its bits are
// 0x4300 | q, so two chunks convert in 4 integer operations (the float route of convert() takes 8 per
// chunk, and bound int4 decodes at 62-70% of their bandwidth roofline). Per group and channel the sums then hold
// sum_k x (128 + q), and
//   s (sum_k x q - z sum_k x) = s * sums + (-(128 + z) s) * sum_k x
// chunks 2i and 2i + 1 of `block` as bf16 128 + q: the 32 shared bytes widened to 16 bits each, then
// the low nibbles (one ternary-logic op: (v & 0x0F) | 0x4300) and the high ones (shift, or)
inline void int4_pair_plus_128(const Problem& P, int64_t block, int64_t pair2, __m512bh& first, __m512bh& second) {
  const uint8_t* p = P.w + (block * (P.K / 4) + pair2) * 32;
  const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512i bias = _mm512_set1_epi16(0x4300);
  first = (__m512bh)_mm512_ternarylogic_epi32(v, _mm512_set1_epi16(0x0F), bias, 0xEA);  // (v & m) | bias
  second = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(v, 4), bias);
}

template <int ROWS, int NB>
void decode_tile_int4(const Problem& P, int64_t b0) {
  __m512 total[ROWS * NB];
  for (auto& t : total) t = _mm512_setzero_ps();
  const int64_t groups = P.K / P.group, pairs_per_group = P.group / 2;
  for (int64_t g = 0; g < groups; ++g) {
    __m512 acc[ROWS * NB];
    for (auto& a : acc) a = _mm512_setzero_ps();
    for (int64_t p = g * pairs_per_group; p < (g + 1) * pairs_per_group; p += 2) {
      __m512bh w0[NB], w1[NB];
      for (int b = 0; b < NB; ++b) int4_pair_plus_128(P, b0 + b, p / 2, w0[b], w1[b]);
      for (int r = 0; r < ROWS; ++r) {
        const __m512bh x0 = x_pair(P, r, p), x1 = x_pair(P, r, p + 1);
        for (int b = 0; b < NB; ++b) {
          acc[r * NB + b] = _mm512_dpbf16_ps(acc[r * NB + b], x0, w0[b]);
          acc[r * NB + b] = _mm512_dpbf16_ps(acc[r * NB + b], x1, w1[b]);
        }
      }
    }
    float xsum[ROWS];
    for (int r = 0; r < ROWS; ++r) {
      __m512 sum = _mm512_setzero_ps();
      for (int64_t k = g * P.group; k < (g + 1) * P.group; k += 16) sum = _mm512_add_ps(sum, infer_vec::vload(P.x + r * P.K + k));
      xsum[r] = _mm512_reduce_add_ps(sum);
    }
    for (int b = 0; b < NB; ++b) {
      const int64_t n = (b0 + b) * kLanes;
      const __m512 scale = load_half(P.scales + g * P.N + n);
      const __m512 offset = group_offset(P, g, n, scale);  // -z s
      const __m512 shifted = _mm512_fnmadd_ps(_mm512_set1_ps(128.0f), scale, offset);  // -(128 + z) s
      for (int r = 0; r < ROWS; ++r) {
        total[r * NB + b] = _mm512_fmadd_ps(acc[r * NB + b], scale, total[r * NB + b]);
        total[r * NB + b] = _mm512_fmadd_ps(_mm512_set1_ps(xsum[r]), shifted, total[r * NB + b]);
      }
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int b = 0; b < NB; ++b) store(P, r, b0 + b, total[r * NB + b]);
}

template <int BITS, int ROWS>
void decode_blocks(const Problem& P, int64_t b0, int64_t nb) {
  if constexpr (BITS == 4) {
    switch (nb) {
      case 1: return decode_tile_int4<ROWS, 1>(P, b0);
      case 2: return decode_tile_int4<ROWS, 2>(P, b0);
      case 3: return decode_tile_int4<ROWS, 3>(P, b0);
      default: return decode_tile_int4<ROWS, 4>(P, b0);
    }
  } else {
    switch (nb) {
      case 1: return decode_tile<BITS, ROWS, 1>(P, b0);
      case 2: return decode_tile<BITS, ROWS, 2>(P, b0);
      case 3: return decode_tile<BITS, ROWS, 3>(P, b0);
      default: return decode_tile<BITS, ROWS, 4>(P, b0);
    }
  }
}

template <int BITS>
void decode(const Problem& P, int64_t b0, int64_t nb) {
  switch (P.M) {
    case 1: return decode_blocks<BITS, 1>(P, b0, nb);
    case 2: return decode_blocks<BITS, 2>(P, b0, nb);
    case 3: return decode_blocks<BITS, 3>(P, b0, nb);
    default: return decode_blocks<BITS, 4>(P, b0, nb);
  }
}

// ---- batch: more rows; tiles of 2 blocks, inputs in blocks of kBlockK through an L1 buffer ----

// buf[pair - p0][b] = chunk `pair` of block b0 + b, converted
template <int BITS, int NB>
void convert_tile(const Problem& P, int64_t b0, int64_t p0, int64_t p1, __m512bh* buf) {
  const int64_t pairs_per_group = P.group / 2;
  for (int b = 0; b < NB; ++b) {
    for (int64_t g0 = p0; g0 < p1; g0 += pairs_per_group) {  // p0 and p1 are on group boundaries
      GroupScale gs;
      if (!P.scale_after) gs = group_scale(P, b0 + b, g0 / pairs_per_group);
      const int64_t g1 = std::min(p1, g0 + pairs_per_group);
      for (int64_t p = g0; p < g1; ++p)
        buf[(p - p0) * NB + b] = convert<BITS>(P, b0 + b, p, P.scale_after ? nullptr : &gs);
    }
  }
}

// rows m0..m0+ROWS of blocks b0..b0+NB over pairs [p0, p1): acc in/out through c ([ROWS][NB] vectors)
template <int ROWS, int NB>
void multiply_tile(const Problem& P, const __m512bh* buf, int64_t p0, int64_t p1, int64_t m0, __m512* c) {
  __m512 acc[ROWS * NB];
  for (int j = 0; j < ROWS * NB; ++j) acc[j] = c[j];
  for (int64_t p = p0; p < p1; ++p) {
    __m512bh w[NB];
    for (int b = 0; b < NB; ++b) w[b] = buf[(p - p0) * NB + b];
    for (int r = 0; r < ROWS; ++r) {
      const __m512bh xs = x_pair(P, m0 + r, p);
      for (int b = 0; b < NB; ++b) acc[r * NB + b] = _mm512_dpbf16_ps(acc[r * NB + b], xs, w[b]);
    }
  }
  for (int j = 0; j < ROWS * NB; ++j) c[j] = acc[j];
}

template <int NB>
void multiply_rows(const Problem& P, const __m512bh* buf, int64_t p0, int64_t p1, int64_t m0, int64_t rows,
                   __m512* c) {
  switch (rows) {  // the largest tile that fits; the rest in smaller ones
    case 12: case 13: case 14: case 15: return multiply_tile<12, NB>(P, buf, p0, p1, m0, c);
    case 8: case 9: case 10: case 11: return multiply_tile<8, NB>(P, buf, p0, p1, m0, c);
    case 4: case 5: case 6: case 7: return multiply_tile<4, NB>(P, buf, p0, p1, m0, c);
    case 2: case 3: return multiply_tile<2, NB>(P, buf, p0, p1, m0, c);
    default: return multiply_tile<1, NB>(P, buf, p0, p1, m0, c);
  }
}

inline int64_t tile_rows(int64_t rows) {
  return rows >= 12 ? 12 : rows >= 8 ? 8 : rows >= 4 ? 4 : rows >= 2 ? 2 : 1;
}

template <int BITS, int NB>
void batch_tile(const Problem& P, int64_t b0, __m512bh* buf, __m512* c) {
  const int64_t pairs = P.K / 2;
  // blocks of inputs on group boundaries (scale_after: one group, any boundary)
  const int64_t step = P.scale_after ? kBlockK / 2 : std::max<int64_t>(1, kBlockK / P.group) * (P.group / 2);
  for (int64_t j = 0; j < P.M * NB; ++j) c[j] = _mm512_setzero_ps();
  for (int64_t p0 = 0; p0 < pairs; p0 += step) {
    const int64_t p1 = std::min(pairs, p0 + step);
    convert_tile<BITS, NB>(P, b0, p0, p1, buf);
    for (int64_t m0 = 0; m0 < P.M;) {
      const int64_t rows = tile_rows(P.M - m0);
      multiply_rows<NB>(P, buf, p0, p1, m0, rows, c + m0 * NB);
      m0 += rows;
    }
  }
  for (int64_t m = 0; m < P.M; ++m)
    for (int b = 0; b < NB; ++b) store(P, m, b0 + b, c[m * NB + b]);
}

#if defined(__AVX512VNNI__)
// ---- batch with int8 activations (W8A8): vpdpbusd, 64 multiply-adds per instruction ----
//
// Each row of x is rounded to 8 bits with its own scale (x ~ sx * xq, xq in -127..127), as vLLM's and
// oneDNN's dynamic quantization do; vpdpbusd then multiplies 4 inputs of 16 channels per lane group at
// 2.6x the multiply-add rate of vdpbf16ps here, and the weights need no conversion to floats. One
// operand must be unsigned: int4 codes are (0..15); for int8 codes, x is shifted to xq + 128 and
// 128 * (sum of the group's codes) taken back. Per group g, in int32 then folded into floats:
//   int4:  s[g, n] * (sum_k q * xq - z[g, n] * sum_k xq)
//   int8:  s[g, n] * (sum_k (xq + 128) * q - 128 * qsum[g, n] - z[g, n] * sum_k xq)
// y[m, n] = sx[m] * sum over groups. The perplexity this costs is measured (docs/quantization.md).

struct Activations {
  std::vector<int32_t> q;    // [K / 4][M]: 4 inputs of a row as bytes; int4 weights: xq, int8: xq + 128
                             // (row-major for the tiles: [M][K / 4], xq)
  std::vector<float> scale;  // [M]
  std::vector<float> sums;   // [M][groups]: sum of xq over each group (zero points)
};

// A thread's scratch, kept from call to call: a one-token decode step makes ~4 calls a layer, and
// fresh zeroed buffers in each cost as much as the call's own work on a small weight. Every entry a
// call reads, it has written first.
template <typename T>
T* scratch(std::vector<T>& buf, int64_t n) {
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(n);
  return buf.data();
}

// kRowMajor (the AMX tiles' A operand): q holds x's rows as [M][K] signed bytes, unshifted. The result
// is the calling thread's (see scratch), valid until its next call.
template <bool kRowMajor = false>
const Activations& quantize_x(const Problem& P) {
  const int64_t groups = P.K / P.group;
  thread_local Activations mine;
  Activations& A = mine;  // the calling thread's: the workers below write into it, not into their own
  scratch(A.q, P.M * P.K / 4);
  scratch(A.scale, P.M);
  scratch(A.sums, P.M * groups);
  const int shift = P.bits == 8 && !kRowMajor ? 128 : 0;
  at::parallel_for(0, P.M, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const c10::BFloat16* x = P.x + m * P.K;
      __m512 top = _mm512_setzero_ps();
      for (int64_t k = 0; k < P.K; k += 16) top = _mm512_max_ps(top, _mm512_abs_ps(infer_vec::vload(x + k)));
      const float amax = _mm512_reduce_max_ps(top);
      const float scale = amax > 0 ? amax / 127.0f : 1.0f;
      const __m512 inv = _mm512_set1_ps(1.0f / scale);
      for (int64_t g = 0; g < groups; ++g) {
        __m512i sum = _mm512_setzero_si512();
        for (int64_t k = g * P.group; k < (g + 1) * P.group; k += 16) {
          const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(infer_vec::vload(x + k), inv));  // nearest
          sum = _mm512_add_epi32(sum, v);
          const __m128i bytes = _mm512_cvtepi32_epi8(_mm512_add_epi32(v, _mm512_set1_epi32(shift)));
          if constexpr (kRowMajor) {
            _mm_storeu_si128(reinterpret_cast<__m128i*>(A.q.data() + (m * P.K + k) / 4), bytes);
            continue;
          }
          alignas(16) int32_t four[4];  // 16 inputs = 4 quads, each to its own row of A.q
          _mm_store_si128(reinterpret_cast<__m128i*>(four), bytes);
          for (int j = 0; j < 4; ++j) A.q[(k / 4 + j) * P.M + m] = four[j];
        }
        A.sums[m * groups + g] = static_cast<float>(_mm512_reduce_add_epi32(sum));
      }
      A.scale[m] = scale;
    }
  });
  return A;
}

// quad `quad` (inputs 4 quad .. 4 quad + 3) of `block` as 64 bytes: channel c's 4 codes in bytes
// 4c..4c+3, from the two pair chunks 2 quad and 2 quad + 1 (adjacent in memory)
template <int BITS>
inline __m512i quad_codes(const Problem& P, int64_t block, int64_t quad) {
  if constexpr (BITS == 8) {
    // words: pair chunk A's word c (channel c, inputs 0-1) then B's word c (inputs 2-3)
    const __m512i idx = _mm512_setr_epi32(0x00100000, 0x00110001, 0x00120002, 0x00130003, 0x00140004, 0x00150005,
                                          0x00160006, 0x00170007, 0x00180008, 0x00190009, 0x001a000a, 0x001b000b,
                                          0x001c000c, 0x001d000d, 0x001e000e, 0x001f000f);
    const __m512i v = _mm512_loadu_si512(P.w + (block * (P.K / 2) + 2 * quad) * 32);
    return _mm512_permutexvar_epi16(idx, v);
  } else {
    // 32 bytes: low nibbles = chunk A's 32 codes, high nibbles = chunk B's; as bytes A then B, then
    // the words interleaved as for int8
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(P.w + (block * (P.K / 4) + quad) * 32));
    const __m256i mask = _mm256_set1_epi8(0x0F);
    const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(b, mask)),
                                         _mm256_and_si256(_mm256_srli_epi16(b, 4), mask), 1);
    const __m512i idx = _mm512_setr_epi32(0x00100000, 0x00110001, 0x00120002, 0x00130003, 0x00140004, 0x00150005,
                                          0x00160006, 0x00170007, 0x00180008, 0x00190009, 0x001a000a, 0x001b000b,
                                          0x001c000c, 0x001d000d, 0x001e000e, 0x001f000f);
    return _mm512_permutexvar_epi16(idx, v);
  }
}

// acc += 4-input dot products (vpdpbusd: its first source unsigned): x + 128 with int8 codes, int4
// codes (0..15) with x
template <int BITS>
inline __m512i dot4(__m512i acc, __m512i w, __m512i x) {
  if constexpr (BITS == 8) return _mm512_dpbusd_epi32(acc, x, w);
  else return _mm512_dpbusd_epi32(acc, w, x);
}

// the int32 sums of one group (quads [g0, g1)) for ROWS x NB, into out
template <int BITS, int ROWS, int NB>
__attribute__((noinline)) void group_sums(const Problem& P, const Activations& A, const __m512i* buf, int64_t q0,
                                          int64_t g0, int64_t g1, int64_t m0, __m512i* out) {
  __m512i acc[ROWS * NB];
  for (auto& a : acc) a = _mm512_setzero_si512();
  const int32_t* x = A.q.data() + m0;
  for (int64_t q = g0; q < g1; ++q) {
    __m512i w[NB];
    for (int b = 0; b < NB; ++b) w[b] = buf[(q - q0) * NB + b];
    for (int r = 0; r < ROWS; ++r) {
      const __m512i xs = _mm512_set1_epi32(x[q * P.M + r]);
      for (int b = 0; b < NB; ++b) acc[r * NB + b] = dot4<BITS>(acc[r * NB + b], w[b], xs);
    }
  }
  for (int j = 0; j < ROWS * NB; ++j) out[j] = acc[j];
}

// The full tile, 8 rows x 2 blocks, written out: 16 named accumulators, vpdpbusd in asm accumulating in
// place. gcc 12 compiles the loop above with two register copies per vpdpbusd and spills (measured:
// the intrinsic's tied operand), which halved its rate.
#define INFER_DP(acc, u, s) asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s))
template <int BITS>
__attribute__((noinline)) void group_sums_8x2(const Problem& P, const Activations& A, const __m512i* buf, int64_t q0,
                                              int64_t g0, int64_t g1, int64_t m0, __m512i* out) {
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  __m512i b0 = a0, b1 = a0, b2 = a0, b3 = a0, b4 = a0, b5 = a0, b6 = a0, b7 = a0;
  const int32_t* x = A.q.data() + m0 + g0 * P.M;
  const __m512i* w = buf + (g0 - q0) * 2;
  for (int64_t q = g0; q < g1; ++q, x += P.M, w += 2) {
    const __m512i w0 = w[0], w1 = w[1];
#define INFER_ROW(r, ar, br)                            \
  {                                                     \
    const __m512i xs = _mm512_set1_epi32(x[r]);         \
    if constexpr (BITS == 8) {                          \
      INFER_DP(ar, xs, w0);                             \
      INFER_DP(br, xs, w1);                             \
    } else {                                            \
      INFER_DP(ar, w0, xs);                             \
      INFER_DP(br, w1, xs);                             \
    }                                                   \
  }
    INFER_ROW(0, a0, b0) INFER_ROW(1, a1, b1) INFER_ROW(2, a2, b2) INFER_ROW(3, a3, b3)
    INFER_ROW(4, a4, b4) INFER_ROW(5, a5, b5) INFER_ROW(6, a6, b6) INFER_ROW(7, a7, b7)
#undef INFER_ROW
  }
  out[0] = a0, out[1] = b0, out[2] = a1, out[3] = b1, out[4] = a2, out[5] = b2, out[6] = a3, out[7] = b3;
  out[8] = a4, out[9] = b4, out[10] = a5, out[11] = b5, out[12] = a6, out[13] = b6, out[14] = a7, out[15] = b7;
}
#undef INFER_DP

// group g's int32 sums acc ([ROWS][NB], rows m0.., blocks b0..) folded into c as floats: the weights'
// scales and offsets applied, and int8 codes' shift of x taken back
template <int BITS, int ROWS, int NB>
inline void fold_group(const Problem& P, const Activations& A, const __m512i* acc, int64_t b0, int64_t g, int64_t m0,
                       __m512* c) {
  const int64_t groups = P.K / P.group;
  for (int b = 0; b < NB; ++b) {
    const int64_t n = (b0 + b) * kLanes;
    const __m512 scale = load_half(P.scales + g * P.N + n);
    __m512 back = _mm512_setzero_ps();  // what the sums hold beyond sum_k xq * q
    if (BITS == 8) {
      const __m512i qsum =
          P.qsums16 ? _mm512_cvtepi16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(P.qsums16 + g * P.N + n)))
                    : _mm512_loadu_si512(P.qsums32 + g * P.N + n);
      back = _mm512_mul_ps(_mm512_set1_ps(128.0f), _mm512_cvtepi32_ps(qsum));
    }
    const __m512 offset = group_offset(P, g, n, scale);  // -z * s
    for (int r = 0; r < ROWS; ++r) {
      __m512 v = _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(acc[r * NB + b]), back), scale);
      v = _mm512_fmadd_ps(_mm512_set1_ps(A.sums[(m0 + r) * groups + g]), offset, v);
      c[r * NB + b] = _mm512_add_ps(c[r * NB + b], v);
    }
  }
}

// row m's sums of block b0 + b (c), times x's scale, plus the bias -> y
inline void store_a8(const Problem& P, const Activations& A, int64_t m, int64_t block, __m512 c) {
  const int64_t n = block * kLanes;
  __m512 v = _mm512_mul_ps(c, _mm512_set1_ps(A.scale[m]));
  if (P.bias) v = _mm512_add_ps(v, infer_vec::vload(P.bias + n));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(P.y + m * P.N + n), (__m256i)_mm512_cvtneps_pbh(v));
}

// rows m0..m0+ROWS x blocks b0..b0+NB over quads [q0, q1) (whole groups); folds into c ([ROWS][NB])
template <int BITS, int ROWS, int NB>
void multiply_a8(const Problem& P, const Activations& A, const __m512i* buf, int64_t b0, int64_t q0, int64_t q1,
                 int64_t m0, __m512* c) {
  const int64_t quads_per_group = P.group / 4;
  for (int64_t g0 = q0; g0 < q1; g0 += quads_per_group) {
    __m512i acc[ROWS * NB];
    if constexpr (ROWS == 8 && NB == 2) group_sums_8x2<BITS>(P, A, buf, q0, g0, g0 + quads_per_group, m0, acc);
    else group_sums<BITS, ROWS, NB>(P, A, buf, q0, g0, g0 + quads_per_group, m0, acc);
    fold_group<BITS, ROWS, NB>(P, A, acc, b0, g0 / quads_per_group, m0, c);
  }
}

template <int BITS, int NB>
void multiply_a8_rows(const Problem& P, const Activations& A, const __m512i* buf, int64_t b0, int64_t q0, int64_t q1,
                      int64_t m0, int64_t rows, __m512* c) {
  switch (rows) {  // 8, 4, 2 or 1 (batch_tile_a8)
    case 8: return multiply_a8<BITS, 8, NB>(P, A, buf, b0, q0, q1, m0, c);
    case 4: return multiply_a8<BITS, 4, NB>(P, A, buf, b0, q0, q1, m0, c);
    case 2: return multiply_a8<BITS, 2, NB>(P, A, buf, b0, q0, q1, m0, c);
    default: return multiply_a8<BITS, 1, NB>(P, A, buf, b0, q0, q1, m0, c);
  }
}

template <int BITS, int NB>
void batch_tile_a8(const Problem& P, const Activations& A, int64_t b0, __m512i* buf, __m512* c) {
  const int64_t quads = P.K / 4, quads_per_group = P.group / 4;
  const int64_t step = std::max<int64_t>(1, kBlockK / P.group) * quads_per_group;  // whole groups
  for (int64_t j = 0; j < P.M * NB; ++j) c[j] = _mm512_setzero_ps();
  for (int64_t q0 = 0; q0 < quads; q0 += step) {
    const int64_t q1 = std::min(quads, q0 + step);
    for (int64_t q = q0; q < q1; ++q)
      for (int b = 0; b < NB; ++b) buf[(q - q0) * NB + b] = quad_codes<BITS>(P, b0 + b, q);
    for (int64_t m0 = 0; m0 < P.M;) {
      const int64_t rows = std::min<int64_t>(8, tile_rows(P.M - m0));  // 16 int32 accumulators: no spills
      multiply_a8_rows<BITS, NB>(P, A, buf, b0, q0, q1, m0, rows, c + m0 * NB);
      m0 += rows;
    }
  }
  for (int64_t m = 0; m < P.M; ++m)
    for (int b = 0; b < NB; ++b) store_a8(P, A, m, b0 + b, c[m * NB + b]);
}

void run_a8(const Problem& P) {
  const Activations& A = quantize_x(P);
  const int64_t blocks = P.N / kLanes, tiles = (blocks + 1) / 2;
  const int64_t step_quads = std::max<int64_t>(kBlockK, P.group) / 4;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<__m512i> buf_store;
    thread_local std::vector<__m512> c_store;
    __m512i* buf = scratch(buf_store, step_quads * 2);
    __m512* c = scratch(c_store, P.M * 2);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b0 = t * 2;
      const bool pair = b0 + 1 < blocks;
      if (P.bits == 8) pair ? batch_tile_a8<8, 2>(P, A, b0, buf, c) : batch_tile_a8<8, 1>(P, A, b0, buf, c);
      else pair ? batch_tile_a8<4, 2>(P, A, b0, buf, c) : batch_tile_a8<4, 1>(P, A, b0, buf, c);
    }
  });
}

// ---- decodes (up to kDecode rows) of int8 codes with int8 activations: the batch path's sums and folds,
// the codes taken straight from the weight (read once: no buffer) ----
template <int ROWS, int NB>
void decode_tile_a8(const Problem& P, const Activations& A, int64_t b0) {
  const int64_t quads_per_group = P.group / 4, groups = P.K / P.group;
  __m512 c[ROWS * NB];
  for (auto& v : c) v = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i acc[ROWS * NB];
    for (auto& a : acc) a = _mm512_setzero_si512();
    for (int64_t q = g * quads_per_group; q < (g + 1) * quads_per_group; ++q) {
      __m512i w[NB];
      for (int b = 0; b < NB; ++b) w[b] = quad_codes<8>(P, b0 + b, q);
      for (int r = 0; r < ROWS; ++r) {
        const __m512i xs = _mm512_set1_epi32(A.q[q * P.M + r]);
        for (int b = 0; b < NB; ++b) acc[r * NB + b] = dot4<8>(acc[r * NB + b], w[b], xs);
      }
    }
    fold_group<8, ROWS, NB>(P, A, acc, b0, g, 0, c);
  }
  for (int r = 0; r < ROWS; ++r)
    for (int b = 0; b < NB; ++b) store_a8(P, A, r, b0 + b, c[r * NB + b]);
}

template <int ROWS>
void decode_blocks_a8(const Problem& P, const Activations& A, int64_t b0, int64_t nb) {
  switch (nb) {
    case 1: return decode_tile_a8<ROWS, 1>(P, A, b0);
    case 2: return decode_tile_a8<ROWS, 2>(P, A, b0);
    case 3: return decode_tile_a8<ROWS, 3>(P, A, b0);
    default: return decode_tile_a8<ROWS, 4>(P, A, b0);
  }
}

void run_decode_a8(const Problem& P) {
  const Activations& A = quantize_x(P);
  decode_tiles(P, [&](int64_t b0, int64_t nb) {
    switch (P.M) {
      case 1: return decode_blocks_a8<1>(P, A, b0, nb);
      case 2: return decode_blocks_a8<2>(P, A, b0, nb);
      case 3: return decode_blocks_a8<3>(P, A, b0, nb);
      default: return decode_blocks_a8<4>(P, A, b0, nb);
    }
  });
}

#if defined(INFER_AMX) && defined(__AMX_INT8__)
// ---- the same W8A8 sums on AMX tiles (Sapphire Rapids): 16 x 16 x 64 multiply-adds an instruction ----
//
// x's int8 rows are A tiles (16 rows x 64 inputs), the codes of 16 channels x 64 inputs a B tile: 16
// quads x 16 channels x 4 codes, which quad_codes gives a quad at a time. int8 codes are signed
// (tdpbssd: no shift of x, no qsums), int4 codes unsigned (tdpbsud), so per group both are
//   s[g, n] * sum_k xq q + (-z s)[g, n] * sum_k xq
// folded into float32 after each group's tiles. As small_linear's run_amx: rows in blocks whose x stays
// in L2, threads take pairs of channel blocks, a pair's codes are rearranged once per block of rows
// into a buffer (K x 32 bytes) and read from there by each pass of 32 rows.
constexpr int64_t kAmxRows = 32;
constexpr int64_t kAmxBlockBytes = 1 << 20;

// inputs a tile product covers: 64 (a full tile), or 32 where groups of 32 (llama.cpp's blocks) each need
// their own sums
inline int64_t amx_depth(const Problem& P) { return P.group % 64 == 0 ? 64 : 32; }

// B tiles of blocks b0..b0+NB for inputs [k0, k1) (kStream: k1 = k0 + the tile depth) into w, block b's at
// w + b * (k1 - k0) * 16: the codes' quads as quad_codes gives them, 64 (or 32) inputs a tile
template <int BITS, int NB>
inline void b_tiles(const Problem& P, int64_t b0, int64_t k0, int64_t k1, int8_t* w) {
  const int64_t chunk_bytes = BITS == 8 ? 64 : 32;  // a quad's codes in the weight
  for (int b = 0; b < NB; ++b) {
    const char* src = reinterpret_cast<const char*>(P.w) + (b0 + b) * (P.K / 4) * chunk_bytes;
    for (int64_t q = k0 / 4; q < k1 / 4; ++q) {
      _mm_prefetch(src + (q + 64) * chunk_bytes, _MM_HINT_T0);
      _mm512_storeu_si512(w + (b * (k1 - k0) / 4 + q - k0 / 4) * 64, quad_codes<BITS>(P, b0 + b, q));
    }
  }
}

// rows m0..m0+32 x blocks b0..b0+NB; tiles: the caller's `rows_config`. w: the blocks' B tiles for all
// of K, or with kStream a 2 KB buffer that the tiles of each 64 (or 32) inputs pass through (one pass of
// rows: the codes go from memory to L1 to the tiles)
template <int BITS, int NB, bool kStream>
void amx_tile_a8(const Problem& P, const Activations& A, int8_t* w, int64_t b0, int64_t m0) {
  const int64_t r0 = std::min<int64_t>(16, P.M - m0), r1 = std::min<int64_t>(16, P.M - m0 - r0);
  const int64_t groups = P.K / P.group, depth = amx_depth(P);
  const int8_t* x0 = reinterpret_cast<const int8_t*>(A.q.data()) + m0 * P.K;
  const int8_t* x1 = x0 + 16 * P.K;
  alignas(64) int32_t sums[32][32];
  alignas(64) float acc[32][32] = {};
  for (int64_t g = 0; g < groups; ++g) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t k = g * P.group; k < (g + 1) * P.group; k += depth) {
      const int8_t* w0 = kStream ? w : w + k * 16;
      const int8_t* w1 = kStream ? w + depth * 16 : w + (P.K + k) * 16;  // the second block's tile
      if constexpr (kStream) b_tiles<BITS, NB>(P, b0, k, k + depth, w);
      _tile_loadd(6, w0, 64);
      if (NB == 2) _tile_loadd(7, w1, 64);
      _tile_loadd(4, x0 + k, P.K);
      if (r1 > 0) _tile_loadd(5, x1 + k, P.K);
      if constexpr (BITS == 8) {
        _tile_dpbssd(0, 4, 6);
        if (NB == 2) _tile_dpbssd(1, 4, 7);
        if (r1 > 0) _tile_dpbssd(2, 5, 6);
        if (r1 > 0 && NB == 2) _tile_dpbssd(3, 5, 7);
      } else {
        _tile_dpbsud(0, 4, 6);
        if (NB == 2) _tile_dpbsud(1, 4, 7);
        if (r1 > 0) _tile_dpbsud(2, 5, 6);
        if (r1 > 0 && NB == 2) _tile_dpbsud(3, 5, 7);
      }
    }
    _tile_stored(0, &sums[0][0], 128);
    if (NB == 2) _tile_stored(1, &sums[0][16], 128);
    if (r1 > 0) _tile_stored(2, &sums[16][0], 128);
    if (r1 > 0 && NB == 2) _tile_stored(3, &sums[16][16], 128);
    for (int b = 0; b < NB; ++b) {
      const int64_t n = (b0 + b) * kLanes;
      const __m512 scale = load_half(P.scales + g * P.N + n);
      const __m512 offset = group_offset(P, g, n, scale);
      for (int64_t r = 0; r < r0 + r1; ++r) {
        __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(&sums[r][b * 16])), scale,
                                   _mm512_load_ps(&acc[r][b * 16]));
        if (P.offsets || P.bits == 4) v = _mm512_fmadd_ps(_mm512_set1_ps(A.sums[(m0 + r) * groups + g]), offset, v);
        _mm512_store_ps(&acc[r][b * 16], v);
      }
    }
  }
  for (int64_t r = 0; r < r0 + r1; ++r) {
    for (int b = 0; b < NB; ++b) {
      const int64_t n = (b0 + b) * kLanes;
      __m512 v = _mm512_mul_ps(_mm512_load_ps(&acc[r][b * 16]), _mm512_set1_ps(A.scale[m0 + r]));
      if (P.bias) v = _mm512_add_ps(v, infer_vec::vload(P.bias + n));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(P.y + (m0 + r) * P.N + n), (__m256i)_mm512_cvtneps_pbh(v));
    }
  }
}

// blocks b0..b0+NB of rows [m0, m1) in passes of 32 rows; `loaded`: the tile configuration in force
template <int BITS, int NB>
void amx_rows_a8(const Problem& P, const Activations& A, int8_t* w, int64_t b0, int64_t m0, int64_t m1,
                 const infer_amx::TileConfig* full, const infer_amx::TileConfig* tail,
                 const infer_amx::TileConfig*& loaded) {
  const bool stream = m1 - m0 <= kAmxRows;
  if (!stream) b_tiles<BITS, NB>(P, b0, 0, P.K, w);
  for (int64_t m = m0; m < m1; m += kAmxRows) {
    const infer_amx::TileConfig* cfg = m1 - m >= kAmxRows ? full : tail;
    if (cfg != loaded) _tile_loadconfig(loaded = cfg);
    if (stream) amx_tile_a8<BITS, NB, true>(P, A, w, b0, m);
    else amx_tile_a8<BITS, NB, false>(P, A, w, b0, m);
  }
}

void run_amx_a8(const Problem& P) {
  const Activations& A = quantize_x<true>(P);
  const int64_t blocks = P.N / kLanes, tiles = (blocks + 1) / 2;
  const int64_t block_rows = std::max<int64_t>(kAmxRows, kAmxBlockBytes / P.K / kAmxRows * kAmxRows);
  for (int64_t m0 = 0; m0 < P.M; m0 += block_rows) {
    const int64_t m1 = std::min(P.M, m0 + block_rows);
    at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
      const infer_amx::TileConfig full = infer_amx::rows_config(kAmxRows, amx_depth(P));
      const infer_amx::TileConfig tail = infer_amx::rows_config((m1 - m0) % kAmxRows, amx_depth(P));
      const infer_amx::TileConfig* loaded = nullptr;
      // two blocks' B tiles: K x 32 bytes, or 2 x 64 (or 32) inputs x 16 bytes where one pass of rows
      // streams them (amx_rows_a8)
      thread_local std::vector<__m512i> buf;
      const int64_t depth = amx_depth(P);
      int8_t* w = reinterpret_cast<int8_t*>(scratch(buf, m1 - m0 <= kAmxRows ? 2 * depth * 16 / 64 : P.K / 2));
      for (int64_t t = begin; t < end; ++t) {
        const int64_t b0 = 2 * t;
        const bool pair = b0 + 1 < blocks;
        if (P.bits == 8 && pair) amx_rows_a8<8, 2>(P, A, w, b0, m0, m1, &full, &tail, loaded);
        else if (P.bits == 8) amx_rows_a8<8, 1>(P, A, w, b0, m0, m1, &full, &tail, loaded);
        else if (pair) amx_rows_a8<4, 2>(P, A, w, b0, m0, m1, &full, &tail, loaded);
        else amx_rows_a8<4, 1>(P, A, w, b0, m0, m1, &full, &tail, loaded);
      }
      _tile_release();
    });
  }
}
#endif  // INFER_AMX && __AMX_INT8__

#endif  // __AVX512VNNI__

void run(const Problem& P) {
  const int64_t blocks = P.N / kLanes;
  if (P.M <= kDecode) {
    decode_tiles(P, [&](int64_t b0, int64_t nb) {
      if (P.bits == 8) decode<8>(P, b0, nb);
      else decode<4>(P, b0, nb);
    });
    return;
  }
  const int64_t tiles = (blocks + 1) / 2;
  const int64_t step_pairs = std::max<int64_t>(kBlockK, P.scale_after ? 0 : P.group) / 2;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<__m512bh> buf(step_pairs * 2);
    std::vector<__m512> c(P.M * 2);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b0 = t * 2;
      const bool pair = b0 + 1 < blocks;
      if (P.bits == 8) pair ? batch_tile<8, 2>(P, b0, buf.data(), c.data()) : batch_tile<8, 1>(P, b0, buf.data(), c.data());
      else pair ? batch_tile<4, 2>(P, b0, buf.data(), c.data()) : batch_tile<4, 1>(P, b0, buf.data(), c.data());
    }
  });
}

#endif

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                        const std::optional<at::Tensor>& offsets, const std::optional<at::Tensor>& bias,
                        int64_t bits, int64_t group_size, const std::optional<at::Tensor>& qsums,
                        bool int8_activations) {
#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16, "x: contiguous bf16 [M, K]");
  TORCH_CHECK(bits == 8 || bits == 4, "bits: 8 or 4");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(weight.is_contiguous() && weight.dim() == 2 && weight.size(1) == (bits == 8 ? K : K / 2) &&
                  weight.element_size() == 1,
              "weight: contiguous [N, K] int8 or [N, K / 2] uint8 (in the kernel's layout)");
  TORCH_CHECK(K % 32 == 0 && N % kLanes == 0 && group_size % 32 == 0 && K % group_size == 0,
              "K and the group size: multiples of 32; N: a multiple of 16");
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == at::kHalf && scales.numel() == N * (K / group_size),
              "scales: contiguous float16 [K / group, N]");
  TORCH_CHECK(!offsets || (offsets->is_contiguous() && offsets->scalar_type() == at::kHalf &&
                           offsets->numel() == scales.numel()),
              "offsets: like scales");
  TORCH_CHECK(!bias || (bias->is_contiguous() && bias->scalar_type() == at::kBFloat16 && bias->numel() == N),
              "bias: contiguous bf16 [N]");
  at::Tensor y = at::empty({M, N}, x.options());
  Problem P{x.data_ptr<c10::BFloat16>(),
            static_cast<const uint8_t*>(weight.data_ptr()),
            scales.data_ptr<c10::Half>(),
            offsets ? offsets->data_ptr<c10::Half>() : nullptr,
            bias ? bias->data_ptr<c10::BFloat16>() : nullptr,
            y.data_ptr<c10::BFloat16>(),
            M, N, K, bits, group_size,
            bits == 8 && group_size == K && !offsets,
            qsums && qsums->scalar_type() == at::kShort ? qsums->data_ptr<int16_t>() : nullptr,
            qsums && qsums->scalar_type() == at::kInt ? qsums->data_ptr<int32_t>() : nullptr};
  TORCH_CHECK(!int8_activations || bits == 4 ||
                  (qsums && qsums->is_contiguous() && (P.qsums16 || P.qsums32) && qsums->numel() == scales.numel()),
              "int8 activations with int8 weights need qsums: int16 or int32 [K / group, N]");
#if defined(__AVX512VNNI__)
#if defined(INFER_AMX) && defined(__AMX_INT8__)
  // the caller asks for int8 activations at every row count here (int4: from 2 rows; infer/quant/linear.py)
  if (int8_activations && M > 0 && infer_amx::permitted())
    return run_amx_a8(P), y;
#endif
  if (int8_activations && M > kDecode) return run_a8(P), y;
  if (int8_activations && M > 0 && bits == 8) return run_decode_a8(P), y;
#endif
  if (M > 0) run(P);
  return y;
#else
  TORCH_CHECK(false, "quant_linear needs AVX-512 BF16; this build has ", infer_vec::kIsa);
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(infer_kernels, m) {
  m.def("quant_linear(Tensor x, Tensor weight, Tensor scales, Tensor? offsets, Tensor? bias, int bits,"
      " int group_size, Tensor? qsums, bool int8_activations) -> Tensor");
}

TORCH_LIBRARY_IMPL(infer_kernels, CPU, m) {
  m.impl("quant_linear", &quant_linear);
}
