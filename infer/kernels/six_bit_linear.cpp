// y = x @ W^T for weights of 6-bit codes in sub-blocks of 16 inputs: llama.cpp's Q6_K as the file
// holds it (infer/quant/gguf_kquants.py), W[n, k] = d[n, k / 256] * sc[n, k / 16] * (q[n, k] - 32),
// q in 0..63, sc int8, d float32: 0.83 bytes a weight, about the file's 0.82, which a decode step
// reads all of.
//
// x is rounded to int8 per row (one scale a row, vLLM's dynamic quantization, as quant_linear's int8
// paths do), and vpdpbusd multiplies 4 unsigned codes by 4 signed inputs for 16 channels at once. Per
// sub-block s of 16 inputs, channel n, row m:
//   sum_k W x = sx[m] * d * sc * (sum_k q xq - 32 sum_k xq)
// the int32 sum of one sub-block is 4 vpdpbusd; it is folded into float32 with its scale d * sc
// (16 int8 sc of 16 channels: one load, two conversions and a multiply by d).
//
// Layout, per block of 16 output channels and sub-block of 16 inputs (4 quads of 4 inputs), 192 bytes:
//   bytes   0..63   quads 0 (low nibble) and 1 (high nibble): byte 4c + j = input j of channel c
//   bytes  64..127  quads 2 and 3, alike
//   bytes 128..191  the codes' top 2 bits: bits 2i, 2i + 1 of byte 4c + j for quad i
//   codes  uint8 [N / 16][K / 16][192]; sc int8 [K / 16][N]; d float32 [K / 256][N] (inputs-major:
//   16 channels are one load)
// Requires N a multiple of 16 and K of 256; the caller (infer/quant/linear.py) checks. Rows run in tiles
// of up to 4, each tile decoding the codes again. From kDequantRows rows on (prefill chunks, large
// batches) the weight is dequantized into a bf16 buffer for the call and multiplied by oneDNN (AMX tiles
// where the CPU has them): on one Sapphire Rapids core 1.4x faster than tiles of 4 rows at 128 rows, 6x
// at 512.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "vec.h"

namespace {

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512BF16__)

constexpr int64_t kLanes = 16;     // channels per block
constexpr int64_t kSub = 16;       // inputs per sub-block (one sc)
constexpr int64_t kSuper = 256;    // inputs per super-block (one d)
constexpr int64_t kSubBytes = 192;  // a block's codes of one sub-block
constexpr int64_t kRowTile = 4;    // rows of x per tile
constexpr int64_t kBlockTile = 4;  // blocks per tile: 4 independent vpdpbusd chains a row
// from here on: a bf16 copy of the weight and oneDNN. Not below: the copy of a 32000 x 512 head (32 MB,
// written afresh each call) took over 10x the tiles' time at 16 rows (a decode step of 16 streams)
constexpr int64_t kDequantRows = 64;

struct Problem {
  const uint8_t* w;
  const int8_t* sc;  // [K / 16][N]
  const float* d;    // [K / 256][N]
  const c10::BFloat16* bias;
  c10::BFloat16* y;
  int64_t M, N, K;
  const int32_t* xq;   // [M][K / 4]: x rounded to int8, 4 inputs a word
  const float* xs;     // [M]: the row's scale
  const float* shift;  // [M][K / 16]: 32 * sum of xq over each sub-block
};

// the 4 quads of sub-block s of `block`, channel c's 4 codes (0..63) in bytes 4c..4c+3
inline void sub_codes(const Problem& P, int64_t block, int64_t s, __m512i q[4]) {
  const uint8_t* p = P.w + (block * (P.K / kSub) + s) * kSubBytes;
  const __m512i lo01 = _mm512_loadu_si512(p), lo23 = _mm512_loadu_si512(p + 64);
  const __m512i hi = _mm512_loadu_si512(p + 128);
  const __m512i low = _mm512_set1_epi8(0x0F), top = _mm512_set1_epi8(0x30);
  // (a & 0x0F) | b, b the 2 top bits already at bits 4-5 (ternary logic 0xEC: (A & C) | B)
  q[0] = _mm512_ternarylogic_epi32(lo01, _mm512_and_si512(_mm512_slli_epi16(hi, 4), top), low, 0xEC);
  q[1] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(lo01, 4), _mm512_and_si512(_mm512_slli_epi16(hi, 2), top),
                                   low, 0xEC);
  q[2] = _mm512_ternarylogic_epi32(lo23, _mm512_and_si512(hi, top), low, 0xEC);
  q[3] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(lo23, 4), _mm512_and_si512(_mm512_srli_epi16(hi, 2), top),
                                   low, 0xEC);
}

template <int ROWS, int NB>
void tile(const Problem& P, int64_t m0, int64_t b0) {
  __m512 total[ROWS * NB];
  for (auto& t : total) t = _mm512_setzero_ps();
  const int64_t subs = P.K / kSub, quads = P.K / 4;
  __m512 d[NB];
  for (int64_t s = 0; s < subs; ++s) {
    if (s % (kSuper / kSub) == 0)
      for (int b = 0; b < NB; ++b) d[b] = _mm512_loadu_ps(P.d + (s / (kSuper / kSub)) * P.N + (b0 + b) * kLanes);
    for (int b = 0; b < NB; ++b) {
      const int64_t n = (b0 + b) * kLanes;
      const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(P.sc + s * P.N + n));
      const __m512 scale = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)), d[b]);
      __m512i q[4];
      sub_codes(P, b0 + b, s, q);
      for (int r = 0; r < ROWS; ++r) {
        const int32_t* x = P.xq + (m0 + r) * quads + 4 * s;
        __m512i acc = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q[0], _mm512_set1_epi32(x[0]));
        acc = _mm512_dpbusd_epi32(acc, q[1], _mm512_set1_epi32(x[1]));
        acc = _mm512_dpbusd_epi32(acc, q[2], _mm512_set1_epi32(x[2]));
        acc = _mm512_dpbusd_epi32(acc, q[3], _mm512_set1_epi32(x[3]));
        const __m512 sum = _mm512_sub_ps(_mm512_cvtepi32_ps(acc), _mm512_set1_ps(P.shift[(m0 + r) * subs + s]));
        total[r * NB + b] = _mm512_fmadd_ps(sum, scale, total[r * NB + b]);
      }
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    for (int b = 0; b < NB; ++b) {
      const int64_t n = (b0 + b) * kLanes;
      __m512 v = _mm512_mul_ps(total[r * NB + b], _mm512_set1_ps(P.xs[m0 + r]));
      if (P.bias) v = _mm512_add_ps(v, infer_vec::vload(P.bias + n));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(P.y + (m0 + r) * P.N + n), (__m256i)_mm512_cvtneps_pbh(v));
    }
  }
}

template <int ROWS>
void tile_blocks(const Problem& P, int64_t m0, int64_t b0, int64_t nb) {
  switch (nb) {
    case 1: return tile<ROWS, 1>(P, m0, b0);
    case 2: return tile<ROWS, 2>(P, m0, b0);
    case 3: return tile<ROWS, 3>(P, m0, b0);
    default: return tile<ROWS, 4>(P, m0, b0);
  }
}

void tile_rows(const Problem& P, int64_t m0, int64_t rows, int64_t b0, int64_t nb) {
  switch (rows) {
    case 1: return tile_blocks<1>(P, m0, b0, nb);
    case 2: return tile_blocks<2>(P, m0, b0, nb);
    case 3: return tile_blocks<3>(P, m0, b0, nb);
    default: return tile_blocks<4>(P, m0, b0, nb);
  }
}

// x's rows rounded to int8 (nearest, one scale a row: its largest |x| at 127), and 32 x each
// sub-block's sum of them
void quantize_rows(const c10::BFloat16* x, int64_t M, int64_t K, std::vector<int32_t>& xq, std::vector<float>& xs,
                   std::vector<float>& shift) {
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const c10::BFloat16* row = x + m * K;
      __m512 top = _mm512_setzero_ps();
      for (int64_t k = 0; k < K; k += kSub) top = _mm512_max_ps(top, _mm512_abs_ps(infer_vec::vload(row + k)));
      const float amax = _mm512_reduce_max_ps(top);
      const float scale = amax > 0 ? amax / 127.0f : 1.0f;
      const __m512 inv = _mm512_set1_ps(1.0f / scale);
      for (int64_t k = 0; k < K; k += kSub) {
        const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(infer_vec::vload(row + k), inv));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(xq.data() + (m * K + k) / 4), _mm512_cvtepi32_epi8(v));
        shift[m * (K / kSub) + k / kSub] = 32.0f * static_cast<float>(_mm512_reduce_add_epi32(v));
      }
      xs[m] = scale;
    }
  });
}

// the weight as bf16 [N, K] (row-major, for oneDNN): channel c's 16 inputs of a sub-block are the 4
// bytes at 4c of each of the sub-block's 4 quads, one float vector once gathered
void dequantize(const Problem& P, c10::BFloat16* out) {
  const int64_t blocks = P.N / kLanes, subs = P.K / kSub;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    alignas(64) int32_t quads[4][16];
    alignas(64) float scales[16];
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t s = 0; s < subs; ++s) {
        __m512i q[4];
        sub_codes(P, b, s, q);
        for (int i = 0; i < 4; ++i) _mm512_store_si512(quads[i], q[i]);
        const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(P.sc + s * P.N + b * kLanes));
        const __m512 d = _mm512_loadu_ps(P.d + (s / (kSuper / kSub)) * P.N + b * kLanes);
        _mm512_store_ps(scales, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)), d));
        for (int c = 0; c < 16; ++c) {
          const __m128i codes = _mm_setr_epi32(quads[0][c], quads[1][c], quads[2][c], quads[3][c]);
          const __m512 v = _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(codes)), _mm512_set1_ps(32.0f));
          const __m512 w = _mm512_mul_ps(v, _mm512_set1_ps(scales[c]));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (b * kLanes + c) * P.K + s * kSub),
                              (__m256i)_mm512_cvtneps_pbh(w));
        }
      }
    }
  });
}

void run(const Problem& P) {
  const int64_t blocks = P.N / kLanes, tiles = (blocks + kBlockTile - 1) / kBlockTile;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b0 = t * kBlockTile, nb = std::min(kBlockTile, blocks - b0);
      for (int64_t m0 = 0; m0 < P.M; m0 += kRowTile) tile_rows(P, m0, std::min(kRowTile, P.M - m0), b0, nb);
    }
  });
}

#endif

at::Tensor six_bit_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& sub_scales,
                          const at::Tensor& super_scales, const std::optional<at::Tensor>& bias) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512BF16__)
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16, "x: contiguous bf16 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = sub_scales.numel() / std::max<int64_t>(1, K / kSub);
  TORCH_CHECK(K % kSuper == 0 && N % kLanes == 0, "K: a multiple of 256; N: a multiple of 16");
  TORCH_CHECK(codes.is_contiguous() && codes.scalar_type() == at::kByte && codes.numel() == N / kLanes * (K / kSub) * kSubBytes,
              "codes: contiguous uint8, 12 bytes per 16 weights (in the kernel's layout)");
  TORCH_CHECK(sub_scales.is_contiguous() && sub_scales.scalar_type() == at::kChar && sub_scales.dim() == 2 &&
                  sub_scales.size(0) == K / kSub,
              "sub_scales: contiguous int8 [K / 16, N]");
  TORCH_CHECK(super_scales.is_contiguous() && super_scales.scalar_type() == at::kFloat &&
                  super_scales.numel() == N * (K / kSuper),
              "super_scales: contiguous float32 [K / 256, N]");
  TORCH_CHECK(!bias || (bias->is_contiguous() && bias->scalar_type() == at::kBFloat16 && bias->numel() == N),
              "bias: contiguous bf16 [N]");
  if (M >= kDequantRows) {
    const Problem P{static_cast<const uint8_t*>(codes.data_ptr()), sub_scales.data_ptr<int8_t>(),
                    super_scales.data_ptr<float>(), nullptr, nullptr, 0, N, K, nullptr, nullptr, nullptr};
    at::Tensor w = at::empty({N, K}, x.options());
    dequantize(P, w.data_ptr<c10::BFloat16>());
    return at::linear(x, w, bias);
  }
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  // the calling thread's, kept from call to call (a decode step makes several calls a layer): every
  // entry is written by quantize_rows before it is read
  thread_local std::vector<int32_t> xq;
  thread_local std::vector<float> xs, shift;
  if (static_cast<int64_t>(xq.size()) < M * K / 4) xq.resize(M * K / 4);
  if (static_cast<int64_t>(xs.size()) < M) xs.resize(M);
  if (static_cast<int64_t>(shift.size()) < M * (K / kSub)) shift.resize(M * (K / kSub));
  quantize_rows(x.data_ptr<c10::BFloat16>(), M, K, xq, xs, shift);
  const Problem P{static_cast<const uint8_t*>(codes.data_ptr()),
                  sub_scales.data_ptr<int8_t>(),
                  super_scales.data_ptr<float>(),
                  bias ? bias->data_ptr<c10::BFloat16>() : nullptr,
                  y.data_ptr<c10::BFloat16>(),
                  M, N, K, xq.data(), xs.data(), shift.data()};
  run(P);
  return y;
#else
  TORCH_CHECK(false, "six_bit_linear needs AVX-512 VNNI and BF16; this build has ", infer_vec::kIsa);
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(infer_kernels, m) {
  m.def("six_bit_linear(Tensor x, Tensor codes, Tensor sub_scales, Tensor super_scales, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(infer_kernels, CPU, m) {
  m.impl("six_bit_linear", &six_bit_linear);
}
