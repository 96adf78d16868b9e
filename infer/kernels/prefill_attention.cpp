// Prefill attention (prompts, and chunks of 8 tokens or more) straight over the paged KV cache: flash
// attention's forward pass, on vdpbf16ps for bfloat16. infer/layers/attention.py serves every such
// sequence of a step with one call of this per layer (SDPA ran them one at a time).
//
// Two passes, each spread over torch's OpenMP threads (at::parallel_for):
//
// 1. Pack: every tile of kTile = 64 keys a query of the call sees, per kv head, once, from its blocks
//    into a buffer of the calling thread (kept for its next call; as large as those keys and values):
//      Kp [D / 2][64 keys]      pairs of dims: one vector is 16 keys' pair (d, d + 1)
//      Vp [32 key pairs][D]     pairs of keys: one vector is 16 dims' pair (key j, key j + 1)
// 2. Items (sequence, kv head, block of up to kItemRows / group queries), from a shared counter,
//    longest first. An item's rows are its queries times the kv head's group of query heads (row =
//    query * group + head in the group); it walks the tiles from the first one its first query's
//    window reaches (position 0 without a window) to its last query's position, none past the diagonal:
//      per 6 rows:  S = Q K^T in 24 registers (6 rows x 4 vectors of 16 keys): per pair of dims, one
//                   vdpbf16ps of a broadcast pair of the row's query with each vector of Kp;
//                   then in registers: the mask (only on a diagonal tile or a window's edge), the
//                   row max, p = 2^(s * scale * log2(e) - max) (a cubic: p is rounded to bf16
//                   anyway), the running sums; P -> bf16 [rows][64 keys]
//      per 6 rows x 64 dims:  O = O * alpha + P V, per pair of keys one vdpbf16ps of a broadcast
//                   pair of P with each vector of Vp; alpha = 2^(old max - new max), online softmax
//    On a diagonal tile a block of rows computes only the vectors of 16 keys up to its last query, and
//    rows that see no key of a tile (before it, or past their window) skip it. A thread keeps its item
//    buffers (~40 KB: L1/L2) from call to call.
//
// float32 and float16 take the same path with one float per 32-bit word instead of a pair and FMA for
// vdpbf16ps (float16 converted as it is packed), and an exp accurate to float32. Accumulation and the
// softmax are float32 in every dtype.
//
// With AMX (a build whose -march has it, Sapphire Rapids on), bf16 items run the two products on the
// tiles instead (amx_tiles below, head_dim a multiple of 64): same packing, same softmax.
//
// An fp8 cache (fp8.h; bf16 queries) is decoded to bf16 as its tiles are packed; the rest is bf16's.
//
// Against torch's SDPA, one prompt at a time: ~5x faster on a Zen (vdpbf16ps), ~1.5x on a Sapphire Rapids
// (tiles; there vdpbf16ps alone was slower than SDPA, which runs on AMX too): docs/optimizations.md,
// "C++ attention". Needs AVX-512 BF16: elsewhere the op raises, isa() (paged_attention.cpp) says so, and
// the Python side keeps SDPA.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include "amx.h"
#include "float_prefill_attention.h"
#include "fp8.h"
#include "paged_call.h"
#include "vec.h"

namespace {

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define INFER_PREFILL_ATTENTION 1

constexpr int64_t kTile = 64;      // keys per tile: 4 vectors of scores per row
constexpr int64_t kRows = 6;       // rows per register block (S: 6 x 4, PV: 6 x 4 accumulators)
constexpr int64_t kItemRows = 60;  // rows per item (queries x group), at most: 10 blocks of 6
constexpr int64_t kAmxRows = 16;      // rows per block on AMX tiles (one tile's rows)
constexpr int64_t kAmxItemRows = 64;  // rows per item on AMX, at most: 4 blocks of 16
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kLog2e = 1.4426950408889634f;

using Word = uint32_t;  // the packed buffers' unit: a pair of bf16, or one float

// How a dtype packs into words and multiplies them: acc += a . b, lane by lane over words
template <typename T>
struct Words {  // float32 and float16: one float per word
  static constexpr int64_t kPer = 1;
  static __m512 madd(__m512 acc, __m512i a, __m512i b) {
    return _mm512_fmadd_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(b), acc);
  }
};
template <>
struct Words<c10::BFloat16> {  // a pair of bf16 per word; vdpbf16ps adds both products to the lane
  static constexpr int64_t kPer = 2;
  static __m512 madd(__m512 acc, __m512i a, __m512i b) {
    return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
  }
};

inline __mmask16 first_lanes(int64_t n) { return n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1); }

// words w .. w + n (n <= 16) of a row, zeros after
inline __m512i load_words(const c10::BFloat16* row, int64_t w, int64_t n) {
  return _mm512_maskz_loadu_epi32(first_lanes(n), reinterpret_cast<const int32_t*>(row) + w);
}
inline __m512i load_words(const float* row, int64_t w, int64_t n) {
  return _mm512_maskz_loadu_epi32(first_lanes(n), row + w);
}
inline __m512i load_words(const c10::Half* row, int64_t w, int64_t n) {
  return _mm512_castps_si512(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(first_lanes(n), row + w)));
}

inline void store_row(float* dst, __m512 x) { _mm512_storeu_ps(dst, x); }
inline void store_row(c10::BFloat16* dst, __m512 x) {  // rounded to nearest even, as torch converts
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh(x));
}
inline void store_row(c10::Half* dst, __m512 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// 2^x for x <= 0: 2^n 2^f, n = round(x), |f| <= 1/2. Accurate: 2^f by Cephes' exp2f polynomial
// (relative error ~2e-7); else by a cubic fitted here (7.5e-5: plenty for probabilities rounded to
// bf16, 8 bits). Nothing is computed under 2^-125: a denormal result costs a microcode assist per lane
// on Intel cores (torch's threads do not flush denormals), and every causal tile's masked keys made one
// (4 x 512-token prompts, one thread: 4.9 ms against 3.2 ms with denormals flushed). Masked: below
// -125 (a masked score's -inf included) the result is exactly 0; else x is raised to -125 there, 2^-125
// (~2e-38) where the truth is less, one instruction where the unmasked tiles' softmax is the bound.
template <bool Accurate, bool Masked>
inline __m512 exp2_nonpositive(__m512 x) {
  const __mmask16 live = Masked ? _mm512_cmp_ps_mask(x, _mm512_set1_ps(-125.f), _CMP_GE_OQ) : 0xFFFF;
  x = _mm512_max_ps(x, _mm512_set1_ps(-125.f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p;
  if constexpr (Accurate) {
    p = _mm512_set1_ps(1.535336188319500e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  } else {
    p = _mm512_set1_ps(0.055171654f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24261115f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.69326097f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.99992806f));
  }
  return Masked ? _mm512_maskz_scalef_ps(live, p, n) : _mm512_scalef_ps(p, n);
}

// r[i] <- column i of the 16 x 16 words r (row j = r[j])
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {  // per 128-bit lane: pairs of rows interleaved
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // per lane: 4 rows of one column
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // r[4a + c] lane l: rows 4a .. 4a + 3 of column 4l + c
  for (int c = 0; c < 4; ++c) {
    t[c] = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x88);       // cols c, 8 + c of rows 0-7
    t[4 + c] = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xDD);   // cols 4 + c, 12 + c of rows 0-7
    t[8 + c] = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x88);
    t[12 + c] = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xDD);
  }
  for (int c = 0; c < 4; ++c) {
    r[c] = _mm512_shuffle_i32x4(t[c], t[8 + c], 0x88);
    r[8 + c] = _mm512_shuffle_i32x4(t[c], t[8 + c], 0xDD);
    r[4 + c] = _mm512_shuffle_i32x4(t[4 + c], t[12 + c], 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(t[4 + c], t[12 + c], 0xDD);
  }
}

struct Problem : infer_paged::PagedCall {
  // The packed tiles: tile i (keys i * kTile ...) of sequence s and kv head h, its Kp then its Vp.
  // Sequence s has tiles first_tile[s] .. first_tile[s] + num_tiles[s], from word tile_base[s] on.
  Word* packed;
  int64_t tile_words;
  const int64_t *first_tile, *num_tiles, *tile_base;
  bool amx;  // bf16 items on the tiles (amx_tiles)

  Word* tile(int64_t s, int64_t h, int64_t i) const {
    return packed + tile_base[s] + (h * num_tiles[s] + i - first_tile[s]) * tile_words;
  }
};

struct Item {
  int64_t seq, kv_head, first_query, num_queries;
  int64_t cost;  // rows x keys: the order of the queue
};

// One thread's buffers, kept from call to call (grown, never shrunk).
struct Workspace {
  std::vector<Word> q;       // [rows][D / per] the item's queries
  std::vector<Word> p;       // [rows][kTile / per] a tile's probabilities
  std::vector<float> s;      // [kAmxRows][kTile] a block's scores (AMX)
  std::vector<float> acc;    // [rows][D] unnormalized output
  std::vector<float> sum;    // [rows][16] running sums of the probabilities, lane by lane
  std::vector<float> max;    // [rows] running max of the scores (times scale * log2 e)
  std::vector<float> alpha;  // [rows] this tile's rescaling of acc and sum
  std::vector<int64_t> pos;  // [rows] the row's query position
  std::vector<const void*> keys, values;  // [kTile] a tile's rows of one kv head, to pack
  std::vector<c10::BFloat16> decoded;     // [2][kTile][D] an fp8 tile's keys and values in bf16

  void reserve(int64_t rows, int64_t head_dim) {
    using infer_paged::grow;
    grow(q, rows * head_dim);
    grow(p, rows * kTile);
    grow(s, kAmxRows * kTile);
    grow(acc, rows * head_dim);
    grow(sum, rows * 16);
    grow(max, rows);
    grow(alpha, rows);
    grow(pos, rows);
    grow(keys, kTile);
    grow(values, kTile);
  }
};

// (Through a pointer: a thread_local object itself, passed down, made gcc re-derive its address with
// a call to __tls_get_addr inside the hot loops.)
Workspace& thread_workspace() {
  thread_local std::unique_ptr<Workspace> ws;
  if (!ws) ws = std::make_unique<Workspace>();
  return *ws;
}

// ---- packing: every tile once per call, read by every item of its sequence and kv head ----

// kp[w][j] = word w of key j (rows[j]); keys from count on are zeros
template <typename T>
void pack_keys(const void* const* rows, int64_t count, int64_t words, Word* kp) {
  for (int64_t j0 = 0; j0 < kTile; j0 += 16) {
    if (j0 >= count) {
      for (int64_t w = 0; w < words; ++w) _mm512_storeu_si512(kp + w * kTile + j0, _mm512_setzero_si512());
      continue;
    }
    for (int64_t w0 = 0; w0 < words; w0 += 16) {
      const int64_t n = std::min<int64_t>(16, words - w0);
      __m512i r[16];
      for (int64_t i = 0; i < 16; ++i)
        r[i] = j0 + i < count ? load_words(static_cast<const T*>(rows[j0 + i]), w0, n) : _mm512_setzero_si512();
      transpose16(r);
      for (int64_t i = 0; i < n; ++i) _mm512_storeu_si512(kp + (w0 + i) * kTile + j0, r[i]);
    }
  }
}

// vp[w][d] = word w of the values' column d: (v_2w[d], v_2w+1[d]) in bf16, v_w[d] for floats. Only
// the words that hold one of the count keys; the second of an odd last pair is 0.
template <typename T>
void pack_values(const void* const* rows, int64_t count, int64_t D, Word* vp) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,  //
                                        39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    for (int64_t j = 0; j < count; j += 2) {
      const auto* a = static_cast<const c10::BFloat16*>(rows[j]);
      const auto* b = j + 1 < count ? static_cast<const c10::BFloat16*>(rows[j + 1]) : nullptr;
      Word* dst = vp + j / 2 * D;
      for (int64_t d = 0; d < D; d += 32) {
        const __mmask32 m = D - d >= 32 ? 0xFFFFFFFFu : 0xFFFFu;
        const __m512i va = _mm512_maskz_loadu_epi16(m, a + d);
        const __m512i vb = b ? _mm512_maskz_loadu_epi16(m, b + d) : _mm512_setzero_si512();
        _mm512_storeu_si512(dst + d, _mm512_permutex2var_epi16(va, lo, vb));
        if (D - d >= 32) _mm512_storeu_si512(dst + d + 16, _mm512_permutex2var_epi16(va, hi, vb));
      }
    }
    // the AMX path reads 32 keys at a time with probabilities 0 past the last key: 0 x stale words
    // from an earlier call could be 0 x NaN
    std::fill(vp + (count + 1) / 2 * D, vp + kTile / 2 * D, Word{0});
  } else {
    for (int64_t j = 0; j < count; ++j)
      for (int64_t d = 0; d < D; d += 16)
        _mm512_storeu_si512(vp + j * D + d, load_words(static_cast<const T*>(rows[j]), d, 16));
  }
}

// tile i of sequence s, kv head h: its keys and values from their blocks into P.tile(s, h, i)
template <typename T>
void pack_tile(const Problem& P, Workspace& ws, int64_t s, int64_t h, int64_t i) {
  const int64_t D = P.head_dim, words = D / Words<T>::kPer, slot_stride = P.num_kv_heads * D;
  const int64_t elem = P.fp8 ? 1 : static_cast<int64_t>(sizeof(T));  // bytes per cached element
  const int64_t start = i * kTile, count = std::min<int64_t>(kTile, P.seq_lens[s] - start);
  const int64_t* table = P.block_tables + s * P.table_stride;
  for (int64_t j = 0; j < count;) {  // block by block
    const int64_t pos = start + j, offset = pos % P.block_size;
    const int64_t n = std::min(P.block_size - offset, count - j);
    const int64_t first = (table[pos / P.block_size] * P.block_size + offset) * slot_stride + h * D;
    for (int64_t k = 0; k < n; ++k, ++j) {
      ws.keys[j] = static_cast<const char*>(P.key_cache) + (first + k * slot_stride) * elem;
      ws.values[j] = static_cast<const char*>(P.value_cache) + (first + k * slot_stride) * elem;
    }
  }
  Word* dst = P.tile(s, h, i);
  if (P.fp8) {  // bf16 queries: the rows decoded, then packed as bf16's
#if defined(INFER_FP8)
    const infer_fp8::Lut& lut = infer_fp8::lut_of(P.e5m2);
    infer_paged::grow(ws.decoded, 2 * kTile * D);
    c10::BFloat16* out = ws.decoded.data();
    for (const void** rows : {ws.keys.data(), ws.values.data()})
      for (int64_t j = 0; j < count; ++j, out += D) {
        for (int64_t d = 0; d < D; d += 64) {
          __m512i first, second;
          infer_fp8::decode64_natural(lut, _mm512_loadu_si512(static_cast<const uint8_t*>(rows[j]) + d), first, second);
          _mm512_storeu_si512(out + d, first);
          _mm512_storeu_si512(out + d + 32, second);
        }
        rows[j] = out;
      }
    pack_keys<c10::BFloat16>(ws.keys.data(), count, D / 2, dst);
    pack_values<c10::BFloat16>(ws.values.data(), count, D, dst + D / 2 * kTile);
#endif
    return;
  }
  pack_keys<T>(ws.keys.data(), count, words, dst);
  pack_values<T>(ws.values.data(), count, D, dst + words * kTile);
}

// x with -inf at the keys key0 .. key0 + 16 that a query at pos does not see: past it, or before its window
inline __m512 mask_keys(__m512 x, int64_t key0, int64_t pos, int64_t window) {
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i key = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(key0)), iota);
  const __m512i last = _mm512_set1_epi32(static_cast<int>(pos));
  const __m512i first = _mm512_set1_epi32(static_cast<int>(window > 0 ? pos - window + 1 : 0));
  const __mmask16 out = _mm512_cmpgt_epi32_mask(key, last) | _mm512_cmplt_epi32_mask(key, first);
  return _mm512_mask_mov_ps(x, out, _mm512_set1_ps(kNegInf));
}

// ---- scores and softmax: rows r0 .. r0 + RB over the first 16 NV keys of a tile (Masked: some key is
// past a row's query or before its window; the keys past the rows' last query are not computed) ----

template <typename T, int RB, int NV, bool Masked>
void score_rows(const Problem& P, Workspace& ws, const Word* kp, int64_t r0, int64_t start) {
  using W = Words<T>;
  const int64_t words = P.head_dim / W::kPer;
  const Word* q = ws.q.data() + r0 * words;
  __m512 s[RB][NV];
  for (auto& row : s)
    for (auto& x : row) x = _mm512_setzero_ps();
  int64_t w = 0;
  do {  // words >= 1 (see value_rows)
    __m512i k[NV];
    for (int v = 0; v < NV; ++v) k[v] = _mm512_loadu_si512(kp + w * kTile + 16 * v);
    for (int r = 0; r < RB; ++r) {
      const __m512i qw = _mm512_set1_epi32(static_cast<int>(q[r * words + w]));
      for (int v = 0; v < NV; ++v) s[r][v] = W::madd(s[r][v], qw, k[v]);
    }
  } while (++w < words);
  // the new running max of each row; the old one's rescaling, alpha = 2^(old - new), for all at once
  const float c = P.scale * kLog2e;
  alignas(64) float old_max[16] = {}, base[16] = {}, alpha[16];
  for (int r = 0; r < RB; ++r) {
    const int64_t row = r0 + r;
    if constexpr (Masked)
      for (int v = 0; v < NV; ++v) s[r][v] = mask_keys(s[r][v], start + 16 * v, ws.pos[row], P.window);
    __m512 top = s[r][0];
    for (int v = 1; v < NV; ++v) top = _mm512_max_ps(top, s[r][v]);
    const float new_max = std::max(ws.max[row], _mm512_reduce_max_ps(top) * c);
    old_max[r] = ws.max[row];
    base[r] = new_max == kNegInf ? 0.f : new_max;  // a row that saw no key yet: p = 0
    ws.max[row] = new_max;
  }
  _mm512_store_ps(alpha, exp2_nonpositive<true, true>(_mm512_sub_ps(_mm512_load_ps(old_max), _mm512_load_ps(base))));
  constexpr int64_t pw = kTile / W::kPer;
  const __m512 cv = _mm512_set1_ps(c);
  for (int r = 0; r < RB; ++r) {
    const int64_t row = r0 + r;
    const __m512 neg = _mm512_set1_ps(-base[r]);
    __m512 p[NV];
    for (int v = 0; v < NV; ++v) p[v] = exp2_nonpositive<W::kPer == 1, Masked>(_mm512_fmadd_ps(s[r][v], cv, neg));
    ws.alpha[row] = alpha[r];
    float* sum = ws.sum.data() + row * 16;
    __m512 tile_sum = p[0];
    for (int v = 1; v < NV; ++v) tile_sum = _mm512_add_ps(tile_sum, p[v]);
    _mm512_storeu_ps(sum, _mm512_fmadd_ps(_mm512_loadu_ps(sum), _mm512_set1_ps(alpha[r]), tile_sum));
    Word* dst = ws.p.data() + row * pw;
    if constexpr (W::kPer == 2) {  // 16 keys' bf16 in 8 words; an odd last vector pairs with zeros
      for (int v = 0; v < NV; v += 2) {
        const __m512 hi = v + 1 < NV ? p[v + 1] : _mm512_setzero_ps();
        _mm512_storeu_si512(dst + 8 * v, (__m512i)_mm512_cvtne2ps_pbh(hi, p[v]));
      }
    } else {
      for (int v = 0; v < NV; ++v) _mm512_storeu_ps(dst + 16 * v, p[v]);
    }
  }
}

// ---- values: rows r0 .. r0 + RB, dims d0 .. d0 + 16 NC: acc = acc * alpha + P V ----

template <typename T, int RB, int NC>
void value_rows(const Problem& P, Workspace& ws, const Word* vp, int64_t r0, int64_t d0, int64_t words) {
  using W = Words<T>;
  constexpr int64_t pw = kTile / W::kPer;
  const int64_t D = P.head_dim;
  float* acc = ws.acc.data() + r0 * D + d0;
  const Word* p = ws.p.data() + r0 * pw;
  vp += d0;
  __m512 a[RB][NC];
  for (int r = 0; r < RB; ++r) {
    const __m512 alpha = _mm512_set1_ps(ws.alpha[r0 + r]);
    for (int c = 0; c < NC; ++c) a[r][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * D + 16 * c), alpha);
  }
  int64_t w = 0;
  do {  // words >= 1: as a for loop (maybe none), gcc kept the accumulators on the stack around it
    __m512i v[NC];
    for (int c = 0; c < NC; ++c) v[c] = _mm512_loadu_si512(vp + w * D + 16 * c);
    for (int r = 0; r < RB; ++r) {
      const __m512i pr = _mm512_set1_epi32(static_cast<int>(p[r * pw + w]));
      for (int c = 0; c < NC; ++c) a[r][c] = W::madd(a[r][c], pr, v[c]);
    }
  } while (++w < words);
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc + r * D + 16 * c, a[r][c]);
}

template <typename T, int NC>
void value_block(const Problem& P, Workspace& ws, const Word* vp, int64_t r0, int64_t n, int64_t d0, int64_t words) {
  switch (n) {
    case 6: value_rows<T, 6, NC>(P, ws, vp, r0, d0, words); break;
    case 5: value_rows<T, 5, NC>(P, ws, vp, r0, d0, words); break;
    case 4: value_rows<T, 4, NC>(P, ws, vp, r0, d0, words); break;
    case 3: value_rows<T, 3, NC>(P, ws, vp, r0, d0, words); break;
    case 2: value_rows<T, 2, NC>(P, ws, vp, r0, d0, words); break;
    default: value_rows<T, 1, NC>(P, ws, vp, r0, d0, words);
  }
}

template <typename T, int NV, bool Masked>
void score_block(const Problem& P, Workspace& ws, const Word* kp, int64_t r0, int64_t n, int64_t start) {
  switch (n) {
    case 6: score_rows<T, 6, NV, Masked>(P, ws, kp, r0, start); break;
    case 5: score_rows<T, 5, NV, Masked>(P, ws, kp, r0, start); break;
    case 4: score_rows<T, 4, NV, Masked>(P, ws, kp, r0, start); break;
    case 3: score_rows<T, 3, NV, Masked>(P, ws, kp, r0, start); break;
    case 2: score_rows<T, 2, NV, Masked>(P, ws, kp, r0, start); break;
    default: score_rows<T, 1, NV, Masked>(P, ws, kp, r0, start);
  }
}

// rows r0 .. r0 + n over their first `keys` keys of the tile: the whole tile unless masked
template <typename T>
void scores(const Problem& P, Workspace& ws, const Word* kp, int64_t r0, int64_t n, int64_t start, int64_t keys,
            bool masked) {
  if (!masked) return score_block<T, 4, false>(P, ws, kp, r0, n, start);
  switch ((keys + 15) / 16) {
    case 1: return score_block<T, 1, true>(P, ws, kp, r0, n, start);
    case 2: return score_block<T, 2, true>(P, ws, kp, r0, n, start);
    case 3: return score_block<T, 3, true>(P, ws, kp, r0, n, start);
    default: return score_block<T, 4, true>(P, ws, kp, r0, n, start);
  }
}

// ---- AMX (bf16 on Sapphire Rapids and later): blocks of 16 rows, S = Q K^T and P V on the tiles ----
//
// The packed tiles are already what the tile registers load: 16 words of Kp (32 dims) x 16 keys is a B
// tile for S, 16 words of Vp (32 keys) x 16 dims a B tile for P V; the queries (16 rows x 32 dims) and P
// (16 rows x 32 keys) are A tiles. Per block of 16 rows and tile of 64 keys: S in C tiles 0-3 (16 keys
// each) -> ws.s; the softmax in AVX-512 as above (mask, running max, p rounded to bf16 -> ws.p, sums);
// acc rows rescaled by alpha where the max moved, then loaded into C tiles 0-3 (64 dims), += P V, stored.
// Tiles 4: A, 6 and 7: B. What is left is mostly the softmax (leaving it out of a timing run took ~3
// ms of ~6 off a 2048-token llama-50m layer; leaving out P V ~2). An item's rows are padded to a
// multiple of 16 (zero queries at its last query's position, never written out).
#if defined(INFER_AMX)

inline bool amx_usable(int64_t head_dim) { return head_dim % 64 == 0 && infer_amx::permitted(); }

infer_amx::TileConfig amx_config() {
  infer_amx::TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = kAmxRows;
    cfg.colsb[t] = 64;
  }
  return cfg;
}

// ws.s[0 .. 16][0 .. 16 nv] <- the scores of rows r0 .. r0 + 16 with the tile's first 16 nv keys
void amx_scores(const Problem& P, Workspace& ws, const Word* kp, int64_t r0, int64_t nv) {
  const int64_t words = P.head_dim / 2, k_stride = kTile * sizeof(Word);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t w = 0; w < words; w += 16) {
    _tile_loadd(4, ws.q.data() + r0 * words + w, words * sizeof(Word));
    const Word* k = kp + w * kTile;
    _tile_loadd(6, k, k_stride);
    _tile_dpbf16ps(0, 4, 6);
    if (nv > 1) {
      _tile_loadd(7, k + 16, k_stride);
      _tile_dpbf16ps(1, 4, 7);
    }
    if (nv > 2) {
      _tile_loadd(6, k + 32, k_stride);
      _tile_dpbf16ps(2, 4, 6);
    }
    if (nv > 3) {
      _tile_loadd(7, k + 48, k_stride);
      _tile_dpbf16ps(3, 4, 7);
    }
  }
  float* s = ws.s.data();
  const int64_t s_stride = kTile * sizeof(float);
  _tile_stored(0, s, s_stride);
  if (nv > 1) _tile_stored(1, s + 16, s_stride);
  if (nv > 2) _tile_stored(2, s + 32, s_stride);
  if (nv > 3) _tile_stored(3, s + 48, s_stride);
}

// The softmax step of score_rows for the 16 rows of ws.s: running max, alpha, p -> ws.p (keys past the
// first 16 nv of the tile as zeros), sums.
template <bool Masked>
void amx_softmax(const Problem& P, Workspace& ws, int64_t r0, int64_t start, int64_t nv) {
  const float c = P.scale * kLog2e;
  alignas(64) float old_max[16], base[16], alpha[16];
  auto masked = [&](int64_t row, int64_t v, __m512 x) {
    if constexpr (!Masked) return x;
    return mask_keys(x, start + 16 * v, ws.pos[row], P.window);
  };
  for (int64_t r = 0; r < kAmxRows; ++r) {
    const int64_t row = r0 + r;
    const float* s = ws.s.data() + r * kTile;
    __m512 top = masked(row, 0, _mm512_loadu_ps(s));
    for (int64_t v = 1; v < nv; ++v) top = _mm512_max_ps(top, masked(row, v, _mm512_loadu_ps(s + 16 * v)));
    const float new_max = std::max(ws.max[row], _mm512_reduce_max_ps(top) * c);
    old_max[r] = ws.max[row];
    base[r] = new_max == kNegInf ? 0.f : new_max;  // a row that saw no key yet: p = 0
    ws.max[row] = new_max;
  }
  _mm512_store_ps(alpha, exp2_nonpositive<true, true>(_mm512_sub_ps(_mm512_load_ps(old_max), _mm512_load_ps(base))));
  const __m512 cv = _mm512_set1_ps(c);
  for (int64_t r = 0; r < kAmxRows; ++r) {
    const int64_t row = r0 + r;
    const float* s = ws.s.data() + r * kTile;
    const __m512 neg = _mm512_set1_ps(-base[r]);
    __m512 p[4], tile_sum = _mm512_setzero_ps();
    for (int64_t v = 0; v < 4; ++v) {
      p[v] = v < nv ? exp2_nonpositive<false, Masked>(_mm512_fmadd_ps(masked(row, v, _mm512_loadu_ps(s + 16 * v)), cv, neg))
                    : _mm512_setzero_ps();
      tile_sum = _mm512_add_ps(tile_sum, p[v]);
    }
    ws.alpha[row] = alpha[r];
    float* sum = ws.sum.data() + row * 16;
    _mm512_storeu_ps(sum, _mm512_fmadd_ps(_mm512_loadu_ps(sum), _mm512_set1_ps(alpha[r]), tile_sum));
    Word* dst = ws.p.data() + row * (kTile / 2);
    _mm512_storeu_si512(dst, (__m512i)_mm512_cvtne2ps_pbh(p[1], p[0]));
    _mm512_storeu_si512(dst + 16, (__m512i)_mm512_cvtne2ps_pbh(p[3], p[2]));
  }
}

// acc rows r0 .. r0 + 16 <- acc * alpha + P V over the tile's first 32 nk keys
void amx_values(const Problem& P, Workspace& ws, const Word* vp, int64_t r0, int64_t nk) {
  const int64_t D = P.head_dim, acc_stride = D * sizeof(float), v_stride = D * sizeof(Word);
  float* acc = ws.acc.data() + r0 * D;
  for (int64_t r = 0; r < kAmxRows; ++r) {
    const float a = ws.alpha[r0 + r];
    if (a == 1.f) continue;
    const __m512 alpha = _mm512_set1_ps(a);
    for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(acc + r * D + d, _mm512_mul_ps(_mm512_loadu_ps(acc + r * D + d), alpha));
  }
  const Word* p = ws.p.data() + r0 * (kTile / 2);
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    _tile_loadd(0, acc + d0, acc_stride);
    _tile_loadd(1, acc + d0 + 16, acc_stride);
    _tile_loadd(2, acc + d0 + 32, acc_stride);
    _tile_loadd(3, acc + d0 + 48, acc_stride);
    for (int64_t kh = 0; kh < nk; ++kh) {
      _tile_loadd(4, p + kh * 16, (kTile / 2) * sizeof(Word));
      const Word* v = vp + kh * 16 * D + d0;
      _tile_loadd(6, v, v_stride);
      _tile_dpbf16ps(0, 4, 6);
      _tile_loadd(7, v + 16, v_stride);
      _tile_dpbf16ps(1, 4, 7);
      _tile_loadd(6, v + 32, v_stride);
      _tile_dpbf16ps(2, 4, 6);
      _tile_loadd(7, v + 48, v_stride);
      _tile_dpbf16ps(3, 4, 7);
    }
    _tile_stored(0, acc + d0, acc_stride);
    _tile_stored(1, acc + d0 + 16, acc_stride);
    _tile_stored(2, acc + d0 + 32, acc_stride);
    _tile_stored(3, acc + d0 + 48, acc_stride);
  }
}

// run_item's walk over the tiles, in blocks of 16 rows (rows: the item's, a multiple of 16 here)
void amx_tiles(const Problem& P, Workspace& ws, int64_t s, int64_t h, int64_t rows, int64_t begin, int64_t end) {
  const int64_t words = P.head_dim / 2;
  for (int64_t i = begin / kTile; i * kTile < end; ++i) {
    const int64_t start = i * kTile, count = std::min(kTile, end - start);
    const Word* kp = P.tile(s, h, i);
    const Word* vp = kp + words * kTile;
    for (int64_t r = 0; r < rows; r += kAmxRows) {
      const int64_t first = ws.pos[r], last = ws.pos[r + kAmxRows - 1];
      if (last < start) continue;                                            // no row sees the tile yet
      if (P.window > 0 && first - P.window + 1 > start + count - 1) break;  // every window starts past it
      const int64_t keys = std::min(count, last - start + 1), nv = (keys + 15) / 16;
      const bool masked = start + kTile - 1 > first || (P.window > 0 && start < last - P.window + 1);
      amx_scores(P, ws, kp, r, nv);
      if (masked) amx_softmax<true>(P, ws, r, start, nv);
      else amx_softmax<false>(P, ws, r, start, nv);
      amx_values(P, ws, vp, r, (nv + 1) / 2);
    }
  }
}

#endif  // AMX

// ---- items ----

// run_item's walk over the tiles in blocks of kRows rows, on vdpbf16ps (bf16) or FMAs
template <typename T>
void vec_tiles(const Problem& P, Workspace& ws, int64_t s, int64_t h, int64_t rows, int64_t begin, int64_t end) {
  using W = Words<T>;
  const int64_t D = P.head_dim, words = D / W::kPer;
  for (int64_t i = begin / kTile; i * kTile < end; ++i) {
    const int64_t start = i * kTile, count = std::min(kTile, end - start);
    const Word* kp = P.tile(s, h, i);
    const Word* vp = kp + words * kTile;
    // the rows that see a key of the tile: none before the tile's first key (causal) and none whose
    // window ends before it
    int64_t first_row = 0, last_row = rows;
    while (first_row < rows && ws.pos[first_row] < start) ++first_row;
    if (P.window > 0)
      while (last_row > first_row && ws.pos[last_row - 1] - P.window + 1 > start + count - 1) --last_row;
    // a block of rows sees keys up to its last row's query: on the diagonal, less than the tile
    auto block_keys = [&](int64_t r, int64_t n) { return std::min(count, ws.pos[r + n - 1] - start + 1); };
    for (int64_t r = first_row; r < last_row; r += kRows) {
      const int64_t n = std::min(kRows, last_row - r);
      const bool masked =
          start + kTile - 1 > ws.pos[r] || (P.window > 0 && start < ws.pos[r + n - 1] - P.window + 1);
      scores<T>(P, ws, kp, r, n, start, block_keys(r, n), masked);
    }
    for (int64_t d0 = 0; d0 < D;) {
      const int64_t left = (D - d0) / 16;
      const int64_t nc = left >= 4 ? 4 : left >= 2 ? 2 : 1;
      for (int64_t r = first_row; r < last_row; r += kRows) {
        const int64_t n = std::min(kRows, last_row - r);
        const int64_t value_words = (block_keys(r, n) + W::kPer - 1) / W::kPer;
        if (nc == 4) value_block<T, 4>(P, ws, vp, r, n, d0, value_words);
        else if (nc == 2) value_block<T, 2>(P, ws, vp, r, n, d0, value_words);
        else value_block<T, 1>(P, ws, vp, r, n, d0, value_words);
      }
      d0 += nc * 16;
    }
  }
}

template <typename T>
void run_item(const Problem& P, Workspace& ws, const Item& item) {
  using W = Words<T>;
  const int64_t s = item.seq, h = item.kv_head, G = P.group, D = P.head_dim, words = D / W::kPer;
  const int64_t seq_len = P.seq_lens[s], query_start = P.query_starts[s];
  const int64_t query_len = P.query_starts[s + 1] - query_start;
  const int64_t rows = item.num_queries * G;
  const int64_t padded = P.amx ? (rows + kAmxRows - 1) / kAmxRows * kAmxRows : rows;
  ws.reserve(padded, D);

  // the item's queries into ws.q (as words: bf16 as they are, others as float32)
  const int64_t first_pos = seq_len - query_len + item.first_query;
  for (int64_t t = 0; t < item.num_queries; ++t) {
    const int64_t token = query_start + item.first_query + t;
    for (int64_t g = 0; g < G; ++g) {
      const int64_t row = t * G + g;
      const T* src = static_cast<const T*>(P.q) + token * P.q_token_stride + (h * G + g) * P.q_head_stride;
      Word* dst = ws.q.data() + row * words;
      for (int64_t w = 0; w < words; w += 16) _mm512_storeu_si512(dst + w, load_words(src, w, words - w));
      ws.pos[row] = first_pos + t;
    }
  }
  for (int64_t row = rows; row < padded; ++row) {  // AMX's padding: a zero query at the last position
    std::fill(ws.q.begin() + row * words, ws.q.begin() + (row + 1) * words, Word{0});
    ws.pos[row] = ws.pos[rows - 1];
  }
  std::fill(ws.max.begin(), ws.max.begin() + padded, kNegInf);
  std::fill(ws.sum.begin(), ws.sum.begin() + padded * 16, 0.f);
  std::fill(ws.acc.begin(), ws.acc.begin() + padded * D, 0.f);

  const int64_t end = first_pos + item.num_queries;  // past the last query's position
  const int64_t begin = P.window > 0 ? std::max<int64_t>(0, first_pos - P.window + 1) : 0;
  if (P.amx) {  // bf16 only
#if defined(INFER_AMX)
    amx_tiles(P, ws, s, h, padded, begin, end);
#endif
  } else {
    vec_tiles<T>(P, ws, s, h, rows, begin, end);
  }

  for (int64_t t = 0; t < item.num_queries; ++t) {
    const int64_t token = query_start + item.first_query + t;
    for (int64_t g = 0; g < G; ++g) {
      const int64_t row = t * G + g;
      const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(_mm512_loadu_ps(ws.sum.data() + row * 16)));
      T* dst = static_cast<T*>(P.out) + (token * P.num_kv_heads * G + h * G + g) * D;
      const float* acc = ws.acc.data() + row * D;
      for (int64_t d = 0; d < D; d += 16) store_row(dst + d, _mm512_mul_ps(_mm512_loadu_ps(acc + d), inv));
    }
  }
}

struct PackTask {
  int64_t seq, kv_head, tile;
};

template <typename T>
void run(const Problem& P, const std::vector<PackTask>& tasks, std::vector<Item>& items) {
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
  at::parallel_for(0, num_tasks, 1, [&](int64_t begin, int64_t end) {
    Workspace& ws = thread_workspace();
    ws.reserve(1, P.head_dim);
    for (int64_t i = begin; i < end; ++i) pack_tile<T>(P, ws, tasks[i].seq, tasks[i].kv_head, tasks[i].tile);
  });
  // longest first, then each thread takes the next item: the threads finish close together
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  const int64_t num_items = static_cast<int64_t>(items.size());
  const int64_t num_threads = std::min<int64_t>(at::get_num_threads(), num_items);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, num_threads, 1, [&](int64_t, int64_t) {
    Workspace& ws = thread_workspace();
#if defined(INFER_AMX)
    const infer_amx::TileConfig cfg = amx_config();
    if (P.amx) _tile_loadconfig(&cfg);
#endif
    for (int64_t i; (i = next.fetch_add(1)) < num_items;) run_item<T>(P, ws, items[i]);
#if defined(INFER_AMX)
    if (P.amx) _tile_release();
#endif
  });
}

#endif  // AVX-512 BF16

// ---- the op ----

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
                             const at::Tensor& block_tables, const at::Tensor& seq_lens,
                             const at::Tensor& query_starts, double scale, int64_t window) {
#if defined(INFER_PREFILL_ATTENTION)
  TORCH_CHECK(scale > 0, "scale must be positive");
  at::Tensor out;
  Problem P{};
  static_cast<infer_paged::PagedCall&>(P) =
      infer_paged::check_call(q, key_cache, value_cache, block_tables, seq_lens, &query_starts, scale, window, out);
#if !defined(INFER_FP8)
  TORCH_CHECK(!P.fp8, "prefill_attention: an fp8 cache needs AVX-512 BF16 and VBMI; this build has ", infer_vec::kIsa);
#endif
  const int64_t num_seqs = P.num_seqs, D = P.head_dim, num_kv_heads = P.num_kv_heads;
  const int32_t* starts = P.query_starts;

  // Per sequence: the tiles its queries see (from the first key its first query's window reaches),
  // each packed once per kv head; items: per kv head, blocks of queries of kItemRows rows at most.
  const int64_t per = q.scalar_type() == at::kBFloat16 ? 2 : 1;
  P.tile_words = (D / per) * kTile + (kTile / per) * D;
  std::vector<int64_t> first_tile(num_seqs), num_tiles(num_seqs), tile_base(num_seqs);
  std::vector<PackTask> tasks;
  std::vector<Item> items;
#if defined(INFER_AMX)
  P.amx = q.scalar_type() == at::kBFloat16 && amx_usable(D);
#endif
  const int64_t block_queries = std::max<int64_t>(1, (P.amx ? kAmxItemRows : kItemRows) / P.group);
  int64_t total_words = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t seq_len = P.seq_lens[s], query_len = starts[s + 1] - starts[s];
    const int64_t first_key = P.checked_first_key(s);
    first_tile[s] = first_key / kTile;
    num_tiles[s] = (seq_len + kTile - 1) / kTile - first_tile[s];
    tile_base[s] = total_words;
    total_words += num_kv_heads * num_tiles[s] * P.tile_words;
    for (int64_t h = 0; h < num_kv_heads; ++h)
      for (int64_t i = first_tile[s]; i < first_tile[s] + num_tiles[s]; ++i) tasks.push_back({s, h, i});
    for (int64_t t = 0; t < query_len; t += block_queries) {
      const int64_t n = std::min(block_queries, query_len - t);
      const int64_t first_pos = seq_len - query_len + t;
      const int64_t first = P.window > 0 ? std::max<int64_t>(0, first_pos - P.window + 1) : 0;
      const int64_t cost = n * P.group * (first_pos + n - first + kTile);
      for (int64_t h = 0; h < num_kv_heads; ++h) items.push_back({s, h, t, n, cost});
    }
  }
  // The packed tiles, in a buffer of the calling thread kept for its next call (a fresh one per call
  // would page-fault each time): as large as the K and V the call reads, at most
  thread_local std::vector<Word> packed;
  if (static_cast<int64_t>(packed.size()) < total_words) packed.resize(total_words);
  P.packed = packed.data();
  P.first_tile = first_tile.data();
  P.num_tiles = num_tiles.data();
  P.tile_base = tile_base.data();

  switch (q.scalar_type()) {
    case at::kFloat: run<float>(P, tasks, items); break;
    case at::kBFloat16: run<c10::BFloat16>(P, tasks, items); break;
    case at::kHalf: run<c10::Half>(P, tasks, items); break;
    default: TORCH_CHECK(false, "prefill_attention: float32, bfloat16 or float16, not ", q.scalar_type());
  }
  return out;
#elif defined(__AVX2__) || defined(__AVX512F__)
  return infer_float_prefill::prefill_attention(q, key_cache, value_cache, block_tables, seq_lens, query_starts,
                                                scale, window);
#else
  TORCH_CHECK(false, "prefill_attention needs AVX2 or AVX-512; this build has ", infer_vec::kIsa);
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(infer_kernels, m) {
  m.def("prefill_attention(Tensor q, Tensor key_cache, Tensor value_cache, Tensor block_tables, Tensor seq_lens,"
      " Tensor query_starts, float scale, int window) -> Tensor");
}

TORCH_LIBRARY_IMPL(infer_kernels, CPU, m) {
  m.impl("prefill_attention", &prefill_attention);
}
