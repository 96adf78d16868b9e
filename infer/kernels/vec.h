// float32 vectors of the widest ISA this file is compiled for (-march=native on the machine that builds
// it): AVX-512 (16 lanes), AVX2 + FMA (8 lanes), or plain C++ (8 floats in a loop, for any CPU). VecF
// and the few operations the kernels need, with loads that convert bfloat16 and float16 on the way.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace infer_vec {

#if defined(__AVX512F__) && defined(__AVX512BW__)
constexpr int64_t kLanes = 16;
constexpr const char* kIsa = "avx512";
using VecF = __m512;
inline VecF vzero() { return _mm512_setzero_ps(); }
inline VecF vset1(float x) { return _mm512_set1_ps(x); }
inline VecF vload(const float* p) { return _mm512_loadu_ps(p); }
inline VecF vload(const c10::BFloat16* p) {
  // bf16 is the upper half of a float32: widen each 16-bit value to 32 bits and shift it up
  __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));
}
inline VecF vload(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline void vstore(float* p, VecF x) { _mm512_storeu_ps(p, x); }
inline VecF vadd(VecF a, VecF b) { return _mm512_add_ps(a, b); }
inline VecF vsub(VecF a, VecF b) { return _mm512_sub_ps(a, b); }
inline VecF vmul(VecF a, VecF b) { return _mm512_mul_ps(a, b); }
inline VecF vdiv(VecF a, VecF b) { return _mm512_div_ps(a, b); }
inline VecF vmax(VecF a, VecF b) { return _mm512_max_ps(a, b); }
inline VecF vmin(VecF a, VecF b) { return _mm512_min_ps(a, b); }
inline VecF vfma(VecF a, VecF b, VecF c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(VecF x) { return _mm512_reduce_add_ps(x); }
inline float vhmax(VecF x) { return _mm512_reduce_max_ps(x); }
inline VecF vround(VecF x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline VecF vscale2(VecF x, VecF n) { return _mm512_scalef_ps(x, n); }  // x * 2^n, n integral
inline VecF vzero_below(VecF y, VecF x, float lo) {  // y where x >= lo, else 0
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, vset1(lo), _CMP_GE_OQ), y);
}
inline VecF vnan_only(VecF x) { return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), x); }

// lane i of the result = the sum of a[i]'s 16 lanes: a transpose-and-add tree, ~3 instructions per sum
// where a reduction of each vector on its own takes ~9
inline VecF vsum_each(const VecF* a) {
  VecF b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)  // b[i]: 256-bit halves added; lanes 0-7 sum a[2i], lanes 8-15 a[2i + 1]
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // c[i]: 128-bit quarter q sums a[4i + q]
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)  // d[i]: quarter q holds 2 partial sums of a[8i + q], 2 of a[8i + 4 + q]
    d[i] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0xEE));
  // quarter q: the sums of a[q], a[4 + q], a[8 + q], a[12 + q]; one permutation puts a[i]'s in lane i
  VecF e = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), e);
}

#elif defined(__AVX2__) && defined(__FMA__)
constexpr int64_t kLanes = 8;
constexpr const char* kIsa = "avx2";
using VecF = __m256;
inline VecF vzero() { return _mm256_setzero_ps(); }
inline VecF vset1(float x) { return _mm256_set1_ps(x); }
inline VecF vload(const float* p) { return _mm256_loadu_ps(p); }
inline VecF vload(const c10::BFloat16* p) {
  // bf16 is the upper half of a float32: widen each 16-bit value to 32 bits and shift it up
  __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(x), 16));
}
inline VecF vload(const c10::Half* p) {
#if defined(__F16C__)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  alignas(32) float x[8];
  for (int i = 0; i < 8; ++i) x[i] = static_cast<float>(p[i]);
  return _mm256_load_ps(x);
#endif
}
inline void vstore(float* p, VecF x) { _mm256_storeu_ps(p, x); }
inline VecF vadd(VecF a, VecF b) { return _mm256_add_ps(a, b); }
inline VecF vsub(VecF a, VecF b) { return _mm256_sub_ps(a, b); }
inline VecF vmul(VecF a, VecF b) { return _mm256_mul_ps(a, b); }
inline VecF vdiv(VecF a, VecF b) { return _mm256_div_ps(a, b); }
inline VecF vmax(VecF a, VecF b) { return _mm256_max_ps(a, b); }
inline VecF vmin(VecF a, VecF b) { return _mm256_min_ps(a, b); }
inline VecF vnan_only(VecF x) { return _mm256_and_ps(x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q)); }
inline VecF vfma(VecF a, VecF b, VecF c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(VecF x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float vhmax(VecF x) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
inline VecF vround(VecF x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// x * 2^n for integral n in [-126, 127]: n + 127, shifted into place, is the float 2^n
inline VecF vscale2(VecF x, VecF n) {
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(x, _mm256_castsi256_ps(e));
}
inline VecF vzero_below(VecF y, VecF x, float lo) {  // y where x >= lo, else 0
  return _mm256_and_ps(y, _mm256_cmp_ps(x, vset1(lo), _CMP_GE_OQ));
}

// lane i of the result = the sum of a[i]'s 8 lanes: pairwise horizontal adds within 128-bit halves,
// then the two halves of each sum added
inline VecF vsum_each(const VecF* a) {
  VecF t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  VecF t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  VecF u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

#else  // plain C++
constexpr int64_t kLanes = 8;
constexpr const char* kIsa = "scalar";
struct VecF {
  float x[8];
};
inline VecF vzero() { return VecF{}; }
inline VecF vset1(float v) {
  VecF r;
  std::fill(r.x, r.x + 8, v);
  return r;
}
template <typename T>
inline VecF vload(const T* p) {
  VecF r;
  for (int i = 0; i < 8; ++i) r.x[i] = static_cast<float>(p[i]);
  return r;
}
inline void vstore(float* p, VecF v) { std::copy(v.x, v.x + 8, p); }
template <typename F>
inline VecF velementwise(VecF a, VecF b, F f) {
  for (int i = 0; i < 8; ++i) a.x[i] = f(a.x[i], b.x[i]);
  return a;
}
inline VecF vadd(VecF a, VecF b) { return velementwise(a, b, [](float x, float y) { return x + y; }); }
inline VecF vsub(VecF a, VecF b) { return velementwise(a, b, [](float x, float y) { return x - y; }); }
inline VecF vmul(VecF a, VecF b) { return velementwise(a, b, [](float x, float y) { return x * y; }); }
inline VecF vdiv(VecF a, VecF b) { return velementwise(a, b, [](float x, float y) { return x / y; }); }
inline VecF vmax(VecF a, VecF b) {
  return velementwise(a, b, [](float x, float y) { return std::max(x, y); });
}
inline VecF vnan_only(VecF a) {  // a's NaN lanes, 0 elsewhere
  return velementwise(a, a, [](float x, float) { return x != x ? x : 0.f; });
}
inline VecF vfma(VecF a, VecF b, VecF c) {
  for (int i = 0; i < 8; ++i) c.x[i] = std::fma(a.x[i], b.x[i], c.x[i]);
  return c;
}
inline float vsum(VecF v) {
  float s = 0.f;
  for (float x : v.x) s += x;
  return s;
}
inline float vhmax(VecF v) { return *std::max_element(v.x, v.x + 8); }
inline VecF vsum_each(const VecF* a) {
  VecF r;
  for (int i = 0; i < 8; ++i) r.x[i] = vsum(a[i]);
  return r;
}
inline VecF vexp(VecF v) {
  for (float& x : v.x) x = std::exp(x);
  return v;
}
#endif

#if defined(__AVX2__) || defined(__AVX512F__)
// e^x = 2^n * e^r with n = round(x / ln 2), |r| <= ln(2) / 2, and e^r by Cephes' expf polynomial
// (relative error ~1e-7). Below -87.3 (e^x < FLT_MIN; a masked score's -inf) the result is exactly 0.
inline VecF vexp(VecF x) {
  const VecF xc = vmin(vmax(x, vset1(-87.3f)), vset1(88.3f));
  const VecF n = vround(vmul(xc, vset1(1.44269504088896341f)));
  VecF r = vfma(n, vset1(-0.693359375f), xc);  // ln 2 in two parts: x - n ln 2 without cancellation
  r = vfma(n, vset1(2.12194440e-4f), r);
  VecF p = vset1(1.9875691500e-4f);
  p = vfma(p, r, vset1(1.3981999507e-3f));
  p = vfma(p, r, vset1(8.3334519073e-3f));
  p = vfma(p, r, vset1(4.1665795894e-2f));
  p = vfma(p, r, vset1(1.6666665459e-1f));
  p = vfma(p, r, vset1(5.0000001201e-1f));
  const VecF y = vfma(vmul(p, r), r, vadd(r, vset1(1.f)));  // 1 + r + r^2 p(r)
  return vzero_below(vscale2(y, n), x, -87.3f);
}
#endif

// silu(x) = x / (1 + e^-x): layer_ops.cpp's silu_and_mul and small_linear.cpp's fused epilogue both call
// this one, so that the fused path keeps giving the same bits as the two ops
inline VecF vsilu(VecF x) { return vdiv(x, vadd(vset1(1.f), vexp(vsub(vzero(), x)))); }

#if defined(__AVX2__)
// 8 float32 -> bf16, rounded to nearest even as c10::BFloat16 rounds (NaN -> 0x7FC0)
inline __m128i bf16x8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}
#endif

// Stores that convert to the destination's dtype, rounding to nearest even as torch's conversions do.
// Any ISA: through a float array and c10's conversion; AVX-512 and AVX2: in registers (below).
template <typename T>
inline void vstore_as(T* p, VecF x) {
  alignas(64) float f[kLanes];
  vstore(f, x);
  for (int64_t i = 0; i < kLanes; ++i) p[i] = static_cast<T>(f[i]);
}
inline void vstore_as(float* p, VecF x) { vstore(p, x); }

#if defined(__AVX512F__) && defined(__AVX512BW__)
// x's bfloat16 (rounded to nearest even; NaN stays a quiet NaN) in the upper 16 bits of each lane
inline __m512i bf16_bits(VecF x) {
  const __m512i b = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC00000));
}
inline void vstore_as(c10::BFloat16* p, VecF x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_bits(x), 16)));
}
inline void vstore_as(c10::Half* p, VecF x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#elif defined(__AVX2__) && defined(__FMA__)
inline void vstore_as(c10::BFloat16* p, VecF x) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), bf16x8(x)); }
#if defined(__F16C__)
inline void vstore_as(c10::Half* p, VecF x) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#endif
#endif

// x rounded to T's precision, as a float (a no-op for float): where a reference rounds in between
template <typename T>
inline VecF vround_to(VecF x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    if constexpr (std::is_same_v<T, c10::BFloat16>)
      return _mm512_castsi512_ps(_mm512_and_si512(bf16_bits(x), _mm512_set1_epi32(int(0xFFFF0000))));
#endif
    alignas(64) T t[kLanes];
    vstore_as(t, x);
    return vload(t);
  }
}

}  // namespace infer_vec
