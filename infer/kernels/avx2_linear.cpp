// y = x @ W^T + bias for few rows of x (decode steps) on a CPU with AVX2 and FMA but no bf16 arithmetic:
// the weight, bf16, or int8 or int4 codes with a scale (and offset) per group of inputs, is widened to
// float32 in registers and multiplied there, so a step reads the weight's own bytes once. torch's bf16
// matmul on such a CPU costs about one matrix-vector product per row, an int8 weight in groups (a GGUF
// file's Q8_0) has no torch kernel at all, and torch's int4 kernel is slower than widening here.
// Steps of many rows go to a float32 GEMM instead (infer/layers/widened_linear.py): there the multiply-
// adds, not the bytes, set the time. Figures: docs/optimizations.md, "bf16 on a CPU without bf16
// arithmetic"; docs/quantization.md, "GGUF files".
//
// Layout: the weight as the model holds it, [N, K] row-major (no second copy); int4 codes 0..15 packed two a
// byte, [N, K / 2], as GGUF's Q4_0 packs a block of 32 (byte j: code j in its low nibble, code j + 16 in
// its high one), symmetric codes shifted by 8 with -8 x scale as their offset; scales and offsets
// [N, K / group], float16 (a Q8_0 block's own scale: 34 bytes a 32 weights, as in the file) or float32
// (a Q6_K group's, the product of two scales, which float16 does not hold exactly). x is widened once
// into a float32 buffer; for bf16 weights its inputs are reordered within each 16 to match how one unpack
// widens 16 bf16 weights (lanes 0-3 and 8-11 in the first vector, 4-7 and 12-15 in the second): a dot
// product does not care about the order of its terms.
// A tile is ROWS rows x CH output channels, each accumulator a vector of partial sums of one (row, channel),
// added across its lanes at the end. Threads (torch's OpenMP pool) take ranges of output channels.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <type_traits>
#include <vector>

#include "vec.h"

namespace {

#if defined(__AVX2__) && defined(__FMA__)

constexpr int64_t kRowChunk = 4;  // rows per tile: 4 x 2 accumulators, 2 weight vectors, in 16 registers

struct Problem {
  const float* x;  // [M, K] float32 (bf16 weights: reordered, see above)
  const void* w;   // [N, K] bf16 or int8, or [N, K / 2] packed int4
  const void* scales;   // int8: [N, K / group], float16 or float32
  const void* offsets;  // int8: as the scales, or null
  bool half_scales;
  bool int4;
  // int8 activations (one or two rows, weights in groups of a multiple of 32): x rounded to int8 per
  // block of 32 inputs, [M, K], its blocks' scales [M, K / 32] and each weight group's sum of the rounded
  // x [M, K / group] (for the offsets); else null
  const int8_t* xq;
  const float* xscale;
  const float* xsum;
  const float* bias;     // [N] float32 or null
  void* y;               // [M, N] in x's dtype
  bool bf16_out;
  int64_t M, N, K, group;
};

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// each (row, channel)'s partial sums added, plus `extra` (the groups' offsets times x's sums) and the bias
template <int ROWS, int CH, int S>
void store(const Problem& P, __m256 (&acc)[ROWS][CH][S], int64_t n0, int64_t m0,
           const float (*extra)[CH] = nullptr) {
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < CH; ++c) {
      __m256 sum = acc[r][c][0];
      for (int i = 1; i < S; ++i) sum = _mm256_add_ps(sum, acc[r][c][i]);
      const float v = hsum(sum) + (extra ? extra[r][c] : 0.f) + (P.bias ? P.bias[n0 + c] : 0.f);
      const int64_t i = (m0 + r) * P.N + n0 + c;
      if (P.bf16_out)
        static_cast<c10::BFloat16*>(P.y)[i] = c10::BFloat16(v);  // rounded to nearest even
      else
        static_cast<float*>(P.y)[i] = v;
    }
}

// 16 bf16 weights as two float32 vectors, in the reordered input order (file comment)
inline void widen16(const c10::BFloat16* p, __m256& lo, __m256& hi) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i zero = _mm256_setzero_si256();
  lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, v));
  hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, v));
}

// the 8 codes of a row from input k (a multiple of 8) as float32: int8 codes, or packed int4 (file comment)
template <bool INT4>
inline __m256 widen8(const uint8_t* row, int64_t k) {
  if constexpr (!INT4)
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + k))));
  const int64_t j = k % 32;
  const __m256i bytes =
      _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + k / 32 * 16 + j % 16)));
  return _mm256_cvtepi32_ps(j < 16 ? _mm256_and_si256(bytes, _mm256_set1_epi32(15)) : _mm256_srli_epi32(bytes, 4));
}

// a row's bytes: int4 codes take half a byte each
inline int64_t row_bytes(const Problem& P) { return P.int4 ? P.K / 2 : P.K; }

// Few rows have few accumulators: each (row, channel) then keeps SPLIT of them, so that enough independent
// FMAs are in flight to cover their latency (2 units, 4-5 cycles each on these cores).
template <int ROWS>
constexpr int kSplit = ROWS <= 2 ? 2 : 1;

// the next tile's weights, a cache line of each of its channels' streams, while this tile computes
template <int CH>
inline void prefetch_next(const char* w, int64_t row_bytes, int64_t offset) {
  for (int c = 0; c < CH; ++c) _mm_prefetch(w + (CH + c) * row_bytes + offset, _MM_HINT_T0);
}

template <int ROWS, int CH>
void tile_bf16(const Problem& P, int64_t n0, int64_t m0) {
  constexpr int S = kSplit<ROWS>;
  __m256 acc[ROWS][CH][S];
  std::fill_n(&acc[0][0][0], ROWS * CH * S, _mm256_setzero_ps());
  const auto* w = static_cast<const c10::BFloat16*>(P.w) + n0 * P.K;
  const float* x = P.x + m0 * P.K;
  for (int64_t k = 0; k < P.K; k += 16) {
    if (k % 32 == 0) prefetch_next<CH>(reinterpret_cast<const char*>(w), P.K * 2, k * 2);
    __m256 lo[CH], hi[CH];
    for (int c = 0; c < CH; ++c) widen16(w + c * P.K + k, lo[c], hi[c]);
    for (int r = 0; r < ROWS; ++r) {
      const __m256 x0 = _mm256_loadu_ps(x + r * P.K + k), x1 = _mm256_loadu_ps(x + r * P.K + k + 8);
      for (int c = 0; c < CH; ++c) {
        acc[r][c][0] = _mm256_fmadd_ps(lo[c], x0, acc[r][c][0]);
        acc[r][c][S - 1] = _mm256_fmadd_ps(hi[c], x1, acc[r][c][S - 1]);
      }
    }
  }
  store<ROWS, CH, S>(P, acc, n0, m0);
}

inline float to_float(c10::Half h) {
#if defined(__F16C__)
  return _cvtsh_ss(h.x);
#else
  return static_cast<float>(h);
#endif
}
inline float to_float(float f) { return f; }

template <int ROWS, int CH, typename Scale, bool INT4>
void tile_int8(const Problem& P, int64_t n0, int64_t m0) {
  constexpr int S = kSplit<ROWS>;
  __m256 acc[ROWS][CH][S];
  std::fill_n(&acc[0][0][0], ROWS * CH * S, _mm256_setzero_ps());
  const int64_t stride = row_bytes(P);
  const auto* w = static_cast<const uint8_t*>(P.w) + n0 * stride;
  const auto* scales = static_cast<const Scale*>(P.scales);
  const auto* offsets = static_cast<const Scale*>(P.offsets);
  const float* x = P.x + m0 * P.K;
  const int64_t groups = P.K / P.group;
  for (int64_t g = 0; g < groups; ++g) {
    __m256 scale[CH], offset[CH];
    for (int c = 0; c < CH; ++c) {
      const int64_t i = (n0 + c) * groups + g;
      scale[c] = _mm256_set1_ps(to_float(scales[i]));
      offset[c] = _mm256_set1_ps(offsets ? to_float(offsets[i]) : 0.f);
    }
    // 8 inputs into accumulator set `s`, a constant (a variable index would keep acc in memory)
    auto step = [&](int64_t k, auto s) {
      __m256 wv[CH];
      for (int c = 0; c < CH; ++c) wv[c] = _mm256_fmadd_ps(widen8<INT4>(w + c * stride, k), scale[c], offset[c]);
      for (int r = 0; r < ROWS; ++r) {
        const __m256 xv = _mm256_loadu_ps(x + r * P.K + k);
        for (int c = 0; c < CH; ++c)
          acc[r][c][decltype(s)::value] = _mm256_fmadd_ps(wv[c], xv, acc[r][c][decltype(s)::value]);
      }
    };
    const int64_t end = (g + 1) * P.group;
    int64_t k = g * P.group;
    for (; k + 16 <= end; k += 16) {
      if (k % 64 == 0) prefetch_next<CH>(reinterpret_cast<const char*>(w), stride, INT4 ? k / 2 : k);
      step(k, std::integral_constant<int, 0>());
      step(k + 8, std::integral_constant<int, S - 1>());
    }
    if (k < end) step(k, std::integral_constant<int, 0>());
  }
  store<ROWS, CH, S>(P, acc, n0, m0);
}

// One or two rows with int8 activations, as llama.cpp's Q8_0 and Q4_0 dot products on AVX2: a block of 32
// codes times 32 int8 inputs in two instructions (vpmaddubsw on |w| and x with w's sign, or on int4's
// unsigned codes and x; vpmaddwd), exact in int32, then scaled by the group's scale times the block's;
// offsets times the sums of the rounded x, so that a row gets the dot product of the weights with it. A
// fifth of the float path's operations a weight, where one row is bound by them, not by the weight's bytes.
template <int ROWS, int CH, typename Scale, bool INT4>
void tile_w8a8(const Problem& P, int64_t n0, int64_t m0) {
  __m256 acc[ROWS][CH][1];
  float offset_sum[ROWS][CH] = {};
  std::fill_n(&acc[0][0][0], ROWS * CH, _mm256_setzero_ps());
  const int64_t stride = row_bytes(P);
  const auto* w = static_cast<const uint8_t*>(P.w) + n0 * stride;
  const auto* scales = static_cast<const Scale*>(P.scales);
  const auto* offsets = static_cast<const Scale*>(P.offsets);
  const int64_t groups = P.K / P.group, blocks = P.K / 32;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < groups; ++g) {
    float scale[CH];
    for (int c = 0; c < CH; ++c) {
      const int64_t i = (n0 + c) * groups + g;
      scale[c] = to_float(scales[i]);
      if (offsets)
        for (int r = 0; r < ROWS; ++r) offset_sum[r][c] += to_float(offsets[i]) * P.xsum[(m0 + r) * groups + g];
    }
    for (int64_t k = g * P.group; k < (g + 1) * P.group; k += 32) {
      if (k % 64 == 0) prefetch_next<CH>(reinterpret_cast<const char*>(w), stride, INT4 ? k / 2 : k);
      __m256i wv[CH], magnitude[CH];
      for (int c = 0; c < CH; ++c) {
        if constexpr (INT4) {
          const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + c * stride + k / 2));
          magnitude[c] = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), _mm256_set1_epi8(15));
        } else {
          wv[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + c * stride + k));
          magnitude[c] = _mm256_sign_epi8(wv[c], wv[c]);  // |w| as unsigned bytes (-128 -> 128)
        }
      }
      for (int r = 0; r < ROWS; ++r) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(P.xq + (m0 + r) * P.K + k));
        const float dx = P.xscale[(m0 + r) * blocks + k / 32];
        for (int c = 0; c < CH; ++c) {
          const __m256i pairs =
              _mm256_maddubs_epi16(magnitude[c], INT4 ? xv : _mm256_sign_epi8(xv, wv[c]));
          const __m256 dots = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));
          acc[r][c][0] = _mm256_fmadd_ps(dots, _mm256_set1_ps(scale[c] * dx), acc[r][c][0]);
        }
      }
    }
  }
  store<ROWS, CH, 1>(P, acc, n0, m0, offset_sum);
}

// x [M, K] float32 -> int8 per block of 32 (scale max|x| / 127, rounded to nearest even) and, given
// `xsum`, each weight group's sum of the rounded x, for tile_w8a8
void quantize_rows(const float* x, int64_t M, int64_t K, int64_t group, int8_t* xq, float* xscale, float* xsum) {
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
  for (int64_t m = 0; xsum && m < M; ++m)
    for (int64_t g = 0; g < K / group; ++g) {
      float sum = 0.f;
      for (int64_t b = g * group / 32; b < (g + 1) * group / 32; ++b) {
        int32_t codes = 0;
        for (int i = 0; i < 32; ++i) codes += xq[m * K + b * 32 + i];
        sum += xscale[m * (K / 32) + b] * codes;
      }
      xsum[m * (K / group) + g] = sum;
    }
}

template <int ROWS, int CH, typename Scale, bool INT4>
void tile_codes(const Problem& P, int64_t n0, int64_t m0) {
  if (P.xq && ROWS <= 2)
    tile_w8a8<ROWS, CH, Scale, INT4>(P, n0, m0);
  else
    tile_int8<ROWS, CH, Scale, INT4>(P, n0, m0);
}

template <bool CODES, int ROWS, int CH>
void tile(const Problem& P, int64_t n0, int64_t m0) {
  if constexpr (!CODES)
    tile_bf16<ROWS, CH>(P, n0, m0);
  else if (P.half_scales)
    P.int4 ? tile_codes<ROWS, CH, c10::Half, true>(P, n0, m0) : tile_codes<ROWS, CH, c10::Half, false>(P, n0, m0);
  else
    P.int4 ? tile_codes<ROWS, CH, float, true>(P, n0, m0) : tile_codes<ROWS, CH, float, false>(P, n0, m0);
}

template <bool CODES, int CH>
void rows_of(const Problem& P, int64_t n0, int64_t m0, int64_t rows) {
  switch (rows) {
    case 1: return tile<CODES, 1, CH>(P, n0, m0);
    case 2: return tile<CODES, 2, CH>(P, n0, m0);
    case 3: return tile<CODES, 3, CH>(P, n0, m0);
    default: return tile<CODES, 4, CH>(P, n0, m0);
  }
}

template <bool CODES>
void run(const Problem& P) {
  // one row: 4 channels a tile (4 weight streams hide the widening); more: 2 channels x up to 4 rows
  const int64_t ch = P.M == 1 ? 4 : 2;
  const int64_t tiles = (P.N + ch - 1) / ch;
  at::parallel_for(0, tiles, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * ch;
      const bool whole = n0 + ch <= P.N;
      for (int64_t m0 = 0; m0 < P.M; m0 += kRowChunk) {
        const int64_t rows = std::min(kRowChunk, P.M - m0);
        if (!whole) {
          for (int64_t n = n0; n < P.N; ++n) rows_of<CODES, 1>(P, n, m0, rows);
        } else if (ch == 4) {
          rows_of<CODES, 4>(P, n0, m0, rows);
        } else {
          rows_of<CODES, 2>(P, n0, m0, rows);
        }
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
    TORCH_CHECK(group % (int4 ? 32 : 8) == 0, "avx2_linear: groups of a multiple of 8 inputs (int4: 32)");
    TORCH_CHECK(!offsets || (offsets->sizes() == scales->sizes() &&
                             offsets->scalar_type() == scales->scalar_type() && offsets->is_contiguous()),
                "avx2_linear: offsets as the scales");
  } else {
    TORCH_CHECK(K % 16 == 0, "avx2_linear: bf16 weights of a multiple of 16 inputs");
  }
  // x in float32 (bf16 weights: each 16 inputs reordered as widen16 widens the weight's), in a buffer of
  // the calling thread's that outlives the call's threads
  thread_local std::vector<float> buffer;
  const float* xf = nullptr;
  at::Tensor xc = x.contiguous();
  if (codes && x.scalar_type() == at::kFloat) {
    xf = xc.const_data_ptr<float>();
  } else {
    buffer.resize(M * K);
    static constexpr int kOrder[16] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15};
    const bool bf16_in = x.scalar_type() == at::kBFloat16;
    const auto* xb = bf16_in ? xc.const_data_ptr<c10::BFloat16>() : nullptr;
    const auto* xs = bf16_in ? nullptr : xc.const_data_ptr<float>();
    auto at = [&](int64_t i) { return bf16_in ? static_cast<float>(xb[i]) : xs[i]; };
    if (codes)
      for (int64_t i = 0; i < M * K; ++i) buffer[i] = at(i);
    else
      for (int64_t i = 0; i < M * K; i += 16)
        for (int j = 0; j < 16; ++j) buffer[i + j] = at(i + kOrder[j]);
    xf = buffer.data();
  }
  // int8 activations where asked (as llama.cpp rounds x for its Q8_0 and Q4_0 dot products, float32 x
  // too) and where they pay: one or two rows, weights in groups of whole blocks of 32
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> xscale, xsum;
  const bool w8a8 = codes && int8_activations && M <= 2 && group % 32 == 0;
  if (w8a8) {
    xq.resize(M * K);
    xscale.resize(M * K / 32);
    xsum.resize(offsets ? M * K / group : 0);
    quantize_rows(xf, M, K, group, xq.data(), xscale.data(), offsets ? xsum.data() : nullptr);
  }
  at::Tensor bf = bias ? bias->to(at::kFloat).contiguous() : at::Tensor();
  at::Tensor y = at::empty({M, N}, x.options());
  const Problem P{xf,
                  weight.const_data_ptr(),
                  codes ? scales->const_data_ptr() : nullptr,
                  offsets ? offsets->const_data_ptr() : nullptr,
                  codes && scales->scalar_type() == at::kHalf,
                  int4,
                  w8a8 ? xq.data() : nullptr,
                  w8a8 ? xscale.data() : nullptr,
                  w8a8 && offsets ? xsum.data() : nullptr,
                  bias ? bf.const_data_ptr<float>() : nullptr,
                  y.data_ptr(),
                  x.scalar_type() == at::kBFloat16,
                  M, N, K, group};
  if (M > 0) {
    if (codes)
      run<true>(P);
    else
      run<false>(P);
  }
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
