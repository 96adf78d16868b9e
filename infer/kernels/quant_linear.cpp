// y = x @ dequant(W)^T for int8 and int4 weights, bf16 activations: the linear layers of a quantized
// model (infer/quant/linear.py), for every number of rows from a one-token decode to a prefill chunk.
//
// torch's own weight-only kernels (_weight_int8pack_mm, _weight_int4pack_mm_for_cpu) beat a bf16
// matmul at one row but lose 1.3x at 8 rows and 2.3x at 32: they dequantize and multiply row by row.
// Here the weights are laid out as oneDNN lays out bf16 weights for vdpbf16ps (blocks of 16 output
// channels, the two inputs of each pair side by side), so one vector of codes, converted, is one
// operand of vdpbf16ps whose 16 lanes are 16 output channels, and x enters as one broadcast pair:
//
//   decode (M <= 4 rows): per tile of up to 4 blocks (64 channels), per input pair:
//       convert each block's 32 codes in registers -> bf16; acc[row][block] += dp(x pair, w)
//   batch (M > 4): per tile of 2 blocks (32 channels), per block of 512 inputs:
//       convert the tile's codes once into a 32 KB buffer (L1) -> for each 12 rows of x:
//       24 accumulators (kept in a small float tile between blocks of inputs) += dp(x pair, w)
//
// No horizontal sums: lanes are channels, an output row is one vector store. Conversion: codes ->
// float32 -> (q - z) * s per group -> bf16, except for int8 with one scale per channel and no zero,
// where the codes are exact in bf16 and the scale multiplies the sum.
//
// Layouts (infer/quant/linear.py packs them); a chunk is 16 channels x 2 inputs = 32 codes:
//   int8   [N / 16][K / 2][16 channels][2 inputs] int8
//   int4   [N / 16][K / 2][16 bytes] uint8, codes 0..15: byte j holds code j of the chunk (low nibble)
//          and code 16 + j (high nibble), codes in the int8 order
//   scales float32 [K / group][N] (inputs-major, so that 16 channels are one load); offsets alike,
//          = -zero * scale, or absent
// Requires N a multiple of 16, K and the group size multiples of 32; the caller checks.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

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
  const float* scales;   // [groups][N]
  const float* offsets;  // [groups][N], or nullptr: no zero points
  const c10::BFloat16* bias;
  c10::BFloat16* y;
  int64_t M, N, K, bits, group;
  bool scale_after;  // int8 per channel, symmetric: exact codes, the scale multiplies the sum
};

// scale (or offset) of group g for the lanes of a converted chunk: its low half (channels 0-7, each
// twice: two inputs) and its high half (channels 8-15)
inline void pair_lanes(const float* v, __m512& lo, __m512& hi) {
  const __m512 c = _mm512_loadu_ps(v);
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
  } else {
    gs.o_lo = gs.o_hi = _mm512_setzero_ps();
  }
  return gs;
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
    const uint8_t* p = P.w + (block * (P.K / 2) + pair) * 16;
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    lo = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(0xF)));
    hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
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
  if (P.scale_after) acc = _mm512_mul_ps(acc, _mm512_loadu_ps(P.scales + n));
  if (P.bias) acc = _mm512_add_ps(acc, infer_vec::vload(P.bias + n));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(P.y + m * P.N + n), (__m256i)_mm512_cvtneps_pbh(acc));
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

template <int BITS, int ROWS>
void decode_blocks(const Problem& P, int64_t b0, int64_t nb) {
  switch (nb) {
    case 1: return decode_tile<BITS, ROWS, 1>(P, b0);
    case 2: return decode_tile<BITS, ROWS, 2>(P, b0);
    case 3: return decode_tile<BITS, ROWS, 3>(P, b0);
    default: return decode_tile<BITS, ROWS, 4>(P, b0);
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

void run(const Problem& P) {
  const int64_t blocks = P.N / kLanes;
  if (P.M <= kDecode) {
    const int64_t tiles = (blocks + kDecode - 1) / kDecode;
    at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t b0 = t * kDecode, nb = std::min(kDecode, blocks - b0);
        if (P.bits == 8) decode<8>(P, b0, nb);
        else decode<4>(P, b0, nb);
      }
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
                        int64_t bits, int64_t group_size) {
#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16, "x: contiguous bf16 [M, K]");
  TORCH_CHECK(bits == 8 || bits == 4, "bits: 8 or 4");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(weight.is_contiguous() && weight.dim() == 2 && weight.size(1) == (bits == 8 ? K : K / 2) &&
                  weight.element_size() == 1,
              "weight: contiguous [N, K] int8 or [N, K / 2] uint8 (in the kernel's layout)");
  TORCH_CHECK(K % 32 == 0 && N % kLanes == 0 && group_size % 32 == 0 && K % group_size == 0,
              "K and the group size: multiples of 32; N: a multiple of 16");
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == at::kFloat && scales.numel() == N * (K / group_size),
              "scales: contiguous float32 [K / group, N]");
  TORCH_CHECK(!offsets || (offsets->is_contiguous() && offsets->scalar_type() == at::kFloat &&
                           offsets->numel() == scales.numel()),
              "offsets: like scales");
  TORCH_CHECK(!bias || (bias->is_contiguous() && bias->scalar_type() == at::kBFloat16 && bias->numel() == N),
              "bias: contiguous bf16 [N]");
  at::Tensor y = at::empty({M, N}, x.options());
  Problem P{x.data_ptr<c10::BFloat16>(),
            static_cast<const uint8_t*>(weight.data_ptr()),
            scales.data_ptr<float>(),
            offsets ? offsets->data_ptr<float>() : nullptr,
            bias ? bias->data_ptr<c10::BFloat16>() : nullptr,
            y.data_ptr<c10::BFloat16>(),
            M, N, K, bits, group_size,
            bits == 8 && group_size == K && !offsets};
  if (M > 0) run(P);
  return y;
#else
  TORCH_CHECK(false, "quant_linear needs AVX-512 BF16; this build has ", infer_vec::kIsa);
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(infer_kernels, m) {
  m.def(
      "quant_linear(Tensor x, Tensor weight, Tensor scales, Tensor? offsets, Tensor? bias, int bits,"
      " int group_size) -> Tensor",
      &quant_linear);
}
