// y = x @ dequant(W)^T for int8 and int4 weights, bf16 activations: the linear layers of a quantized
// model (infer/quant/linear.py), for every number of rows from a one-token decode to a prefill chunk.
//
// torch's own weight-only kernels (_weight_int8pack_mm, _weight_int4pack_mm_for_cpu) beat a bf16
// matmul at one row but lose 1.3x at 8 rows and 2.3x at 32 (docs/benchmarks.md): they dequantize and
// multiply row by row. Here each thread owns a slice of output channels and, for tiles of 4 channels:
//
//   codes of 4 rows of W, all of K  --convert once-->  bf16 tile in a small buffer (L1/L2)
//   (a decode, up to 4 rows of x: each chunk converted in registers and used at once)
//   for each 4 rows of x:  16 accumulators (4 x 4) += vdpbf16ps(x chunk, w chunk), 32 inputs per step
//   sum each accumulator's lanes (vsum_each), scale, add the bias, store bf16
//
// so the weights are read from memory once per call, whatever M, and the multiply-adds run at the bf16
// dot-product rate of the CPU (AVX-512 BF16: Zen 4, Sapphire Rapids), which is what oneDNN's bf16 matmul
// uses. Conversion: codes -> float32 -> (q - z) * s per group -> bf16, except for int8 with one scale
// per channel and no zero, where the integer codes are exact in bf16 and the scale multiplies the sum.
//
// Layouts (infer/quant/linear.py packs them), in tiles of 4 rows (see chunk()):
//   int8   int8, a chunk = 32 codes of one row as they are
//   int4   uint8, a chunk = 16 bytes for 32 inputs k0..k0+31 of one row, unsigned codes 0..15: byte j
//          holds input k0 + j in its low nibble and k0 + 16 + j in its high nibble
//   scales float32 [N, K / group]; offsets float32 [N, K / group] = -zero * scale (or absent)
// Requires K and the group size to be multiples of 32 and N a multiple of 4; the caller checks.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <vector>

#include "vec.h"

namespace {

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)

constexpr int64_t kN = 4;   // output channels per tile
constexpr int64_t kM = 4;   // rows of x per tile: kN * kM = 16 accumulators, one vsum_each
constexpr int64_t kK = 32;  // inputs per dot-product step (one 512-bit bf16 vector)

struct Problem {
  const c10::BFloat16* x;
  const uint8_t* w;
  const float* scales;
  const float* offsets;  // nullptr: no zero points
  const c10::BFloat16* bias;
  c10::BFloat16* y;
  int64_t M, N, K, bits, group;
  bool scale_after;  // int8 per channel, symmetric: exact codes, the scale multiplies the sum
};

// 32 codes of row n starting at input k, as float32 halves: lo = inputs k..k+15, hi = k+16..k+31.
// Layout: tiles of kN rows, each tile's chunks in input order and, within a chunk, its kN rows side by
// side: the kernel reads a tile as one sequential stream (4 rows read apart, each a stream of its own,
// ran 1.6x slower from DRAM for rows of 8 KB)
template <int BITS>
inline const uint8_t* chunk(const Problem& P, int64_t n, int64_t k) {
  constexpr int64_t bytes = BITS == 8 ? kK : kK / 2;
  return P.w + (((n / kN) * (P.K / kK) + k / kK) * kN + n % kN) * bytes;
}

template <int BITS>
inline void codes(const Problem& P, int64_t n, int64_t k, __m512& lo, __m512& hi) {
  const uint8_t* p = chunk<BITS>(P, n, k);
  if constexpr (BITS == 8) {
    __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(b)));
    hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(b, 1)));
  } else {
    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    lo = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(0xF)));
    hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
  }
}

// rows n0..n0+kN-1 of W, inputs [k0, k1), into buf as bf16 (row-major, k1 - k0 per row); k0 and k1 are
// multiples of the group size (or anything, for scale_after)
template <int BITS>
void convert_tile(const Problem& P, int64_t n0, int64_t k0, int64_t k1, __m512bh* buf) {
  const int64_t groups = P.K / P.group, per_group = P.group / kK, steps = (k1 - k0) / kK;
  for (int64_t i = 0; i < kN; ++i) {
    const int64_t n = n0 + i;
    __m512bh* out = buf + i * steps;
    if (P.scale_after) {
      for (int64_t k = k0; k < k1; k += kK, ++out) {
        __m512 lo, hi;
        codes<BITS>(P, n, k, lo, hi);
        *out = _mm512_cvtne2ps_pbh(hi, lo);
      }
      continue;
    }
    for (int64_t g = k0 / P.group; g < k1 / P.group; ++g) {
      const __m512 scale = _mm512_set1_ps(P.scales[n * groups + g]);
      const __m512 offset = _mm512_set1_ps(P.offsets ? P.offsets[n * groups + g] : 0.0f);
      for (int64_t s = 0; s < per_group; ++s, ++out) {
        __m512 lo, hi;
        codes<BITS>(P, n, (g * per_group + s) * kK, lo, hi);
        *out = _mm512_cvtne2ps_pbh(_mm512_fmadd_ps(hi, scale, offset), _mm512_fmadd_ps(lo, scale, offset));
      }
    }
  }
}

// 16 accumulators (ROWS x kN of them) -> y[m0..m0+ROWS, n0..n0+kN], scaled, plus the bias
template <int ROWS>
inline void store_tile(const Problem& P, int64_t n0, int64_t m0, __m512* acc) {
  alignas(64) float sums[kM * kN];
  _mm512_store_ps(sums, infer_vec::vsum_each(acc));
  for (int r = 0; r < ROWS; ++r) {
    for (int64_t i = 0; i < kN; ++i) {
      float v = sums[r * kN + i];
      if (P.scale_after) v *= P.scales[n0 + i];
      if (P.bias) v += static_cast<float>(P.bias[n0 + i]);
      P.y[(m0 + r) * P.N + n0 + i] = c10::BFloat16(v);
    }
  }
}

// y[m0..m0+ROWS, n0..n0+kN] from the converted tile (ROWS a constant: the accumulators stay in registers)
template <int ROWS>
void multiply_tile(const Problem& P, int64_t n0, const __m512bh* buf, int64_t m0) {
  const int64_t steps = P.K / kK;
  __m512 acc[kM * kN];
  for (auto& a : acc) a = _mm512_setzero_ps();
  const c10::BFloat16* x = P.x + m0 * P.K;
  for (int64_t s = 0; s < steps; ++s) {
    __m512bh w[kN];
    for (int64_t i = 0; i < kN; ++i) w[i] = buf[i * steps + s];
    for (int r = 0; r < ROWS; ++r) {
      __m512bh xs = (__m512bh)_mm512_loadu_si512(x + r * P.K + s * kK);
      for (int64_t i = 0; i < kN; ++i) acc[r * kN + i] = _mm512_dpbf16_ps(acc[r * kN + i], xs, w[i]);
    }
  }
  store_tile<ROWS>(P, n0, m0, acc);
}

// A decode of up to kM rows: each chunk of the tile converted in registers and used at once (the
// tile is one sequential stream; no buffer to write and read back)
template <int BITS, int ROWS>
void decode_tile(const Problem& P, int64_t n0) {
  const int64_t groups = P.K / P.group, per_group = P.group / kK;
  __m512 acc[kM * kN];
  for (auto& a : acc) a = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512 scale[kN], offset[kN];
    for (int64_t i = 0; i < kN; ++i) {
      scale[i] = _mm512_set1_ps(P.scale_after ? 1.0f : P.scales[(n0 + i) * groups + g]);
      offset[i] = _mm512_set1_ps(P.offsets ? P.offsets[(n0 + i) * groups + g] : 0.0f);
    }
    for (int64_t s = 0; s < per_group; ++s) {
      const int64_t k = (g * per_group + s) * kK;
      __m512bh xs[ROWS];
      for (int r = 0; r < ROWS; ++r) xs[r] = (__m512bh)_mm512_loadu_si512(P.x + r * P.K + k);
      for (int64_t i = 0; i < kN; ++i) {
        __m512 lo, hi;
        codes<BITS>(P, n0 + i, k, lo, hi);
        if (!P.scale_after) {
          lo = _mm512_fmadd_ps(lo, scale[i], offset[i]);
          hi = _mm512_fmadd_ps(hi, scale[i], offset[i]);
        }
        const __m512bh w = _mm512_cvtne2ps_pbh(hi, lo);
        for (int r = 0; r < ROWS; ++r) acc[r * kN + i] = _mm512_dpbf16_ps(acc[r * kN + i], xs[r], w);
      }
    }
  }
  store_tile<ROWS>(P, n0, 0, acc);
}

template <int BITS>
void decode_rows(const Problem& P, int64_t n0) {
  switch (P.M) {
    case 1: return decode_tile<BITS, 1>(P, n0);
    case 2: return decode_tile<BITS, 2>(P, n0);
    case 3: return decode_tile<BITS, 3>(P, n0);
    default: return decode_tile<BITS, 4>(P, n0);
  }
}

void multiply_rows(const Problem& P, int64_t n0, const __m512bh* buf, int64_t m0, int64_t rows) {
  switch (rows) {
    case 1: return multiply_tile<1>(P, n0, buf, m0);
    case 2: return multiply_tile<2>(P, n0, buf, m0);
    case 3: return multiply_tile<3>(P, n0, buf, m0);
    default: return multiply_tile<4>(P, n0, buf, m0);
  }
}

void run(const Problem& P) {
  const int64_t tiles = P.N / kN, steps = P.K / kK;
  if (P.M <= kM) {
    at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        if (P.bits == 8) decode_rows<8>(P, t * kN);
        else decode_rows<4>(P, t * kN);
      }
    });
    return;
  }
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<__m512bh> buf(kN * steps);
    for (int64_t t = begin; t < end; ++t) {
      if (P.bits == 8) convert_tile<8>(P, t * kN, 0, P.K, buf.data());
      else convert_tile<4>(P, t * kN, 0, P.K, buf.data());
      for (int64_t m0 = 0; m0 < P.M; m0 += kM) multiply_rows(P, t * kN, buf.data(), m0, std::min(kM, P.M - m0));
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
              "weight: contiguous [N, K] int8 or [N, K / 2] uint8");
  TORCH_CHECK(K % kK == 0 && N % kN == 0 && group_size % kK == 0 && K % group_size == 0,
              "K and the group size: multiples of 32; N: a multiple of 4");
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == at::kFloat && scales.numel() == N * (K / group_size),
              "scales: contiguous float32 [N, K / group]");
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
