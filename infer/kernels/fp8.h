// An fp8 KV cache (`--kv-cache-dtype fp8`): one byte per element in OCP FP8, e4m3 (torch.float8_e4m3fn,
// "fp8" as vLLM) or e5m2 (torch.float8_e5m2), no scale (vLLM's default: 1.0). Half of bf16's bytes, so
// twice the tokens in the same memory and half the reads of a long-context decode step.
//
// Writing (write_cache): a float rounded to the nearest code, ties to even, saturated at the format's
// largest finite value (+-448 / +-57344; infinities too): what `x.clamp(-max, max).to(torch.float8_*)`
// gives. NaN stays NaN (code 0x7F with its sign, a NaN in both formats).
// Reading (paged_attention, prefill_attention): codes become bf16 and meet the bf16 queries and
// probabilities on vdpbf16ps as a bf16 cache does. Every fp8 value of either format is a bf16 value
// (bf16's 8 exponent bits cover both ranges, subnormals included; NaN and e5m2's infinities too), so the
// conversion is exact: a lookup of the code's magnitude (7 bits) in a 128-entry table of its bf16's low
// and high bytes (vpermt2b, AVX-512 VBMI), the sign ORed in: 64 codes in 5 instructions.
#pragma once

#include <c10/core/ScalarType.h>

namespace infer_fp8 {

// a cache of fp8 codes (either format)?
inline bool is_fp8(c10::ScalarType t) { return t == c10::kFloat8_e4m3fn || t == c10::kFloat8_e5m2; }

}  // namespace infer_fp8

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__) && defined(__AVX512VBMI__)
#define INFER_FP8 1

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <limits>

namespace infer_fp8 {

struct Format {
  int mant;          // mantissa bits
  int bias;          // exponent bias
  float max;         // largest finite value
  float min_normal;  // 2^(1 - bias)
  float steps;       // subnormals per unit: 2^(bias - 1 + mant)
  bool ieee_top;     // the top exponent holds infinities and NaNs (e5m2); else only code 0x7F, NaN (e4m3fn)
};
constexpr Format kE4M3{3, 7, 448.f, 0x1p-6f, 0x1p9f, false};
constexpr Format kE5M2{2, 15, 57344.f, 0x1p-14f, 0x1p16f, true};
constexpr int kNaN = 0x7F;  // a NaN in both formats

// the value of a code whose sign bit is 0
inline float value(const Format& f, int code) {
  const int e = code >> f.mant, m = code & ((1 << f.mant) - 1);
  if (code == kNaN || (f.ieee_top && e == (1 << (7 - f.mant)) - 1))
    return m == 0 ? std::numeric_limits<float>::infinity() : std::numeric_limits<float>::quiet_NaN();
  if (e == 0) return std::ldexp(static_cast<float>(m), 1 - f.bias - f.mant);  // subnormal
  return std::ldexp(1.f + static_cast<float>(m) / static_cast<float>(1 << f.mant), e - f.bias);
}

// the bf16 bits of codes 0..127, split into low and high bytes, 64 per register
struct Lut {
  __m512i lo0, lo1, hi0, hi1;
};

inline Lut make_lut(const Format& f) {
  alignas(64) uint8_t lo[128], hi[128];
  for (int c = 0; c < 128; ++c) {
    const uint16_t bits = c10::BFloat16(value(f, c)).x;  // exact: at most 3 mantissa bits (NaN: a NaN)
    lo[c] = static_cast<uint8_t>(bits & 0xFF);
    hi[c] = static_cast<uint8_t>(bits >> 8);
  }
  return {_mm512_load_si512(lo), _mm512_load_si512(lo + 64), _mm512_load_si512(hi), _mm512_load_si512(hi + 64)};
}

// 64 codes -> their 64 bf16, two vectors in the order the byte interleave leaves: in 128-bit lane L, word
// i (< 8) of `a` is code 16 L + i and of `b` code 16 L + 8 + i. A dot product only needs the other side
// in the same order (queries are permuted once per call: permute_dims); see decode64_natural otherwise.
inline void decode64(const Lut& t, __m512i codes, __m512i& a, __m512i& b) {
  const __m512i lo = _mm512_permutex2var_epi8(t.lo0, codes, t.lo1);  // bit 7, the sign, is not an index bit
  __m512i hi = _mm512_permutex2var_epi8(t.hi0, codes, t.hi1);
  hi = _mm512_ternarylogic_epi32(hi, codes, _mm512_set1_epi8(static_cast<char>(0x80)), 0xF8);  // hi | sign
  a = _mm512_unpacklo_epi8(lo, hi);
  b = _mm512_unpackhi_epi8(lo, hi);
}

// The same in dim order: `first` holds codes 0..31, `second` 32..63
inline void decode64_natural(const Lut& t, __m512i codes, __m512i& first, __m512i& second) {
  __m512i a, b;
  decode64(t, codes, a, b);
  const __m512i i1 = _mm512_set_epi16(47, 46, 45, 44, 43, 42, 41, 40, 15, 14, 13, 12, 11, 10, 9, 8,  //
                                      39, 38, 37, 36, 35, 34, 33, 32, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i i2 = _mm512_add_epi16(i1, _mm512_set1_epi16(16));
  first = _mm512_permutex2var_epi16(a, i1, b);
  second = _mm512_permutex2var_epi16(a, i2, b);
}

// dim d (< 64) of a group of 64 sits at this position of decode64's (a, b) as one array of 64 words
inline int permuted_position(int d) {
  const int lane = d / 16, i = d % 16;
  return i < 8 ? lane * 8 + i : 32 + lane * 8 + (i - 8);
}

// 16 floats -> 16 codes: to nearest, ties to even, saturated at +-max; NaN -> kNaN
inline __m128i encode16(const Format& f, __m512 x) {
  const __m512i sign = _mm512_srli_epi32(_mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(INT32_MIN)), 24);
  const __m512 a = _mm512_min_ps(_mm512_abs_ps(x), _mm512_set1_ps(f.max));
  // a normal code: the float's mantissa rounded to f.mant bits (a carry moves into the exponent), then
  // the exponent rebiased
  const int drop = 23 - f.mant;
  __m512i u = _mm512_castps_si512(a);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, drop), _mm512_set1_epi32(1));
  u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32((1 << (drop - 1)) - 1), odd));
  const __m512i normal = _mm512_sub_epi32(_mm512_srli_epi32(u, drop), _mm512_set1_epi32((127 - f.bias) << f.mant));
  // below the smallest normal: a multiple of the smallest subnormal (the count 2^mant is the smallest normal's code)
  const __m512 steps = _mm512_mul_ps(a, _mm512_set1_ps(f.steps));
  const __m512i subnormal = _mm512_cvt_roundps_epi32(steps, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __mmask16 tiny = _mm512_cmp_ps_mask(a, _mm512_set1_ps(f.min_normal), _CMP_LT_OQ);
  __m512i code = _mm512_mask_mov_epi32(normal, tiny, subnormal);
  code = _mm512_mask_mov_epi32(code, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(kNaN));
  code = _mm512_or_si512(code, sign);
  return _mm512_cvtepi32_epi8(code);
}

// the format of a cache dtype (at::kFloat8_e4m3fn or at::kFloat8_e5m2)
inline const Format& format_of(bool e5m2) { return e5m2 ? kE5M2 : kE4M3; }

inline const Lut& lut_of(bool e5m2) {
  static const Lut e4m3 = make_lut(kE4M3), e5 = make_lut(kE5M2);
  return e5m2 ? e5 : e4m3;
}

}  // namespace infer_fp8

#endif
