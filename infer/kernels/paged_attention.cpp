// Attention of short queries (decodes, small prompt chunks) straight over the paged KV cache, the
// batched step of infer/layers/attention.py in one call, without a gathered copy of the keys.
//
// A work item is one sequence, or one part of its keys: a context that crosses a multiple of kPart keys
// (of more for chunks longer than kPartQueries) is split there, whatever the step holds, so that every core
// works on one stream's attention and a row's arithmetic does not depend on the batch it is in.
// Its rows are every (kv head, query, head of the kv head's group); it walks its keys in tiles:
//
//   rows   r = (h * query_len + t) * group + g     kv head h, query t, query head h * group + g
//   keys   [begin, end) in tiles of kTile:
//            scores of every row  ->  online softmax (running max and sum per row)  ->  += probs @ values
//
// A slot (one position's keys of every kv head, [num_kv_heads, head_dim]) is contiguous, and so is a
// block of slots: an item reads its blocks whole, in order, while it prefetches the next tile (see
// Prefetcher). Scores and values go kSub slots at a time, every kv head's part of them in turn, so the
// slots are read front to back (head by head over the whole tile read each slot 4 times, 2 lines at a
// time for a kv head of 64 dims: 2-8% slower a step at long contexts). GQA: the group of query heads of
// a kv head reads each of its keys once, together.
// A sequence of seq_len 0 is padding (infer/runner/decode_graph.py: a decode graph's arguments are sized
// for a sequence per row, and its rows past a step's tokens are queries of one such sequence): its rows of
// the output are zeros; one without queries (query_starts[s] == query_starts[s + 1]) must be one.
// Threads (at::parallel_for: torch's OpenMP pool, torch.get_num_threads()) take items from a shared
// counter, longest first, each claiming its next item before it runs one (Prefetcher). A part of a split
// context leaves (max, sum, unnormalized output) per row; the thread that runs a context's last part
// merges them. Float32 queries over a bfloat16 or float16 cache (a float32 model's 16-bit cache) are read
// rounded to the cache's dtype and the output rounded to it, as if q were given in that dtype, without
// the two conversions around the call. Accumulation is float32 whatever the cache's dtype (float32,
// bfloat16, float16); the vector ISA is this build's (vec.h), plus vdpbf16ps for bfloat16 scores and
// probs @ values where present.
// An fp8 cache (fp8.h) is read with bf16 queries on the same vdpbf16ps path: each 64-dim group of a key or
// value decoded to bf16 as it is loaded, in an order of its own (the queries permuted to match once per
// item, the output unpermuted at the end).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <atomic>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "amx.h"
#include "fp8.h"
#include "paged_call.h"
#include "vec.h"

namespace {

using namespace infer_vec;

constexpr int64_t kTile = 64;  // keys per tile: a tile's keys and values (and the next's) stay in L2
// a context is split at every multiple of kPart keys where its queries are at most kPartQueries, and
// a longer chunk's parts are as many times longer: its partial results (rows x parts) stay bounded
constexpr int64_t kPart = kTile;
constexpr int64_t kPartQueries = 8;
constexpr int64_t kSub = 16;  // slots per sub-tile (llama-50m's 4 kv heads x 64 dims: 8 KB of keys)
// a sub-tile starts where a block of keys (up to kLanes) and a bf16 pair of keys (2) start
static_assert(kSub % kLanes == 0 && kTile % kSub == 0);
constexpr int64_t kStride = kTile + kLanes;  // a row of tile scores, with room for a block's overhang
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Fp8 {};  // the cache's element type of an fp8 cache (one byte), for the templates below

struct Item {
  int64_t seq;
  int64_t begin, end;  // key positions [begin, end)
  int64_t partial;     // -1: the item is the whole context; else the offset of its partial result
  int64_t split;       // the index of its context's split (Splits), where partial >= 0
};

struct Problem : infer_paged::PagedCall {
  float* partials;

  // row r of sequence s is (kv head h, query t, head g of h's group): q's and out's [t, h * group + g]
  int64_t head_of(int64_t s, int64_t r) const { return r / (group * query_len(s)) * group + r % group; }
  int64_t token_of(int64_t s, int64_t r) const {
    return query_start(s) + r % (group * query_len(s)) / group;
  }
  template <typename T>
  T* out_row(int64_t s, int64_t r) const {
    return static_cast<T*>(out) + (token_of(s, r) * group * num_kv_heads + head_of(s, r)) * head_dim;
  }
};

// One thread's buffers, kept from call to call (grown, never shrunk).
struct Workspace {
  std::vector<float> q;               // [rows, head_dim] the item's queries in float32
  std::vector<c10::BFloat16> q_bf16;  // the same in bfloat16, for vdpbf16ps
  std::vector<float> scores;          // [rows, kStride]: a tile's scores, then its probabilities
  std::vector<c10::BFloat16> p_bf16;  // [rows, kStride] the same probabilities in bfloat16 (bf16_values)
  std::vector<float> acc;             // [rows, head_dim] unnormalized output
  std::vector<float> max, sum;        // [rows] running max of the scores, sum of exp(score - max)
  std::vector<const void*> keys, values, next_keys, next_values;  // this tile's slots, the next tile's
#if defined(INFER_FP8)
  const infer_fp8::Lut* lut = nullptr;  // an fp8 cache's decoding table
#endif

  void reserve(int64_t rows, int64_t head_dim) {
    using infer_paged::grow;
    grow(q, rows * head_dim);
    grow(q_bf16, rows * head_dim);
    grow(scores, rows * kStride);
    grow(p_bf16, rows * kStride);
    grow(acc, rows * head_dim);
    grow(max, rows);
    grow(sum, rows);
    for (auto* slots : {&keys, &values, &next_keys, &next_values}) grow(*slots, kTile + kLanes);
  }
};
thread_local Workspace workspace;

// Software prefetch of the next tile's slots, spread over the current tile's sub-tiles (scores, then
// values) so that the loads overlap with compute. The hardware prefetchers don't keep up on their own
// (blocks are scattered; the compute between loads): without it, a cache beyond L3 took 1.3-1.5x longer.
// An item's last tile prefetches the first tile of the item its thread takes next: at short contexts a
// sequence is 2-3 tiles, and its first one, fetched when the item starts, would wait on memory
// (docs/optimizations.md, "C++ attention"). The last num_threads items are not claimed ahead (see run).
struct Prefetcher {
  const void* const* keys = nullptr;
  const void* const* values = nullptr;
  int64_t next = 0, end = 0, per_step = 0, slot_bytes = 0;

  void spread_over(int64_t steps) { per_step = (end - next + steps - 1) / std::max<int64_t>(steps, 1); }
  void step() {
    for (const int64_t stop = std::min(end, next + per_step); next < stop; ++next) {
      const char* k = static_cast<const char*>(keys[next]);
      const char* v = static_cast<const char*>(values[next]);
      for (int64_t b = 0; b < slot_bytes; b += 64) {  // every line (every other one was slower)
        __builtin_prefetch(k + b, 0, 2);              // for reading, into L2: used a tile later
        __builtin_prefetch(v + b, 0, 2);
      }
    }
  }
};

// ---- scores: kLanes dot products at once ----
//
// A dot product ends with a sum across the lanes of its accumulator, which costs more than its few
// FMAs. So kLanes of them (RB rows x kLanes / RB keys) accumulate side by side, and vsum_each adds up
// all kLanes accumulators at once.

// scores[r][k] = scale * q_r . key_k for RB rows of float32 queries (stride head_dim) and kLanes / RB
// keys (each at offset in its slot)
template <int RB, typename T>
void dot_block(const float* q, const void* const* keys, int64_t offset, int64_t head_dim, float scale,
               float* scores) {
  constexpr int KB = kLanes / RB;
  VecF acc[kLanes];
  for (auto& a : acc) a = vzero();
  for (int64_t d = 0; d < head_dim; d += kLanes) {
    for (int k = 0; k < KB; ++k) {
      const VecF kv = vload(static_cast<const T*>(keys[k]) + offset + d);  // converted once for RB rows
      for (int r = 0; r < RB; ++r) acc[r * KB + k] = vfma(vload(q + r * head_dim + d), kv, acc[r * KB + k]);
    }
  }
  alignas(64) float sums[kLanes];
  vstore(sums, vmul(vsum_each(acc), vset1(scale)));
  for (int r = 0; r < RB; ++r) std::copy(sums + r * KB, sums + (r + 1) * KB, scores + r * kStride);
}

#if defined(__AVX512BF16__)
// The same from bfloat16 queries and keys: vdpbf16ps multiplies 32 bf16 pairs and adds each two adjacent
// products into one of 16 float32 lanes, with no conversion. A head_dim of 16 mod 32 ends with a
// half-width load (the other half zero).
inline __m512bh load_bf16(const c10::BFloat16* p, int64_t left) {
  return (__m512bh)(left >= 32 ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi16(0xFFFF, p));
}

template <int RB>
void dot_block_bf16(const c10::BFloat16* q, const void* const* keys, int64_t offset, int64_t head_dim,
                    float scale, float* scores) {
  constexpr int KB = 16 / RB;
  __m512 acc[16];
  for (auto& a : acc) a = _mm512_setzero_ps();
  for (int64_t d = 0; d < head_dim; d += 32) {
    for (int k = 0; k < KB; ++k) {
      const auto* key = static_cast<const c10::BFloat16*>(keys[k]) + offset;
      const __m512bh kv = load_bf16(key + d, head_dim - d);
      for (int r = 0; r < RB; ++r) {
        const __m512bh qv = load_bf16(q + r * head_dim + d, head_dim - d);
        acc[r * KB + k] = _mm512_dpbf16_ps(acc[r * KB + k], qv, kv);
      }
    }
  }
  alignas(64) float sums[16];
  _mm512_store_ps(sums, _mm512_mul_ps(vsum_each(acc), _mm512_set1_ps(scale)));
  for (int r = 0; r < RB; ++r) std::copy(sums + r * KB, sums + (r + 1) * KB, scores + r * kStride);
}
#endif

#if defined(INFER_FP8)
// The same from an fp8 cache: each key's 64-dim groups decoded once for RB rows, two vdpbf16ps per row
// and group, the queries in the decoded order (permute_queries)
template <int RB>
void dot_block_fp8(const c10::BFloat16* q, const void* const* keys, int64_t offset, int64_t head_dim, float scale,
                   float* scores, const infer_fp8::Lut& lut) {
  constexpr int KB = 16 / RB;
  __m512 acc[16];
  for (auto& a : acc) a = _mm512_setzero_ps();
  for (int64_t d = 0; d < head_dim; d += 64) {
    for (int k = 0; k < KB; ++k) {
      __m512i ka, kb;
      infer_fp8::decode64(lut, _mm512_loadu_si512(static_cast<const uint8_t*>(keys[k]) + offset + d), ka, kb);
      for (int r = 0; r < RB; ++r) {
        const c10::BFloat16* qr = q + r * head_dim + d;
        acc[r * KB + k] = _mm512_dpbf16_ps(acc[r * KB + k], (__m512bh)_mm512_loadu_si512(qr), (__m512bh)ka);
        acc[r * KB + k] = _mm512_dpbf16_ps(acc[r * KB + k], (__m512bh)_mm512_loadu_si512(qr + 32), (__m512bh)kb);
      }
    }
  }
  alignas(64) float sums[16];
  _mm512_store_ps(sums, _mm512_mul_ps(vsum_each(acc), _mm512_set1_ps(scale)));
  for (int r = 0; r < RB; ++r) std::copy(sums + r * KB, sums + (r + 1) * KB, scores + r * kStride);
}

// rows' bf16 queries (rows x head_dim) in decode64's order, group of 64 dims by group
inline void permute_queries(c10::BFloat16* q, int64_t rows, int64_t head_dim) {
  c10::BFloat16 tmp[64];
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t d0 = 0; d0 < head_dim; d0 += 64) {
      c10::BFloat16* g = q + r * head_dim + d0;
      for (int d = 0; d < 64; ++d) tmp[infer_fp8::permuted_position(d)] = g[d];
      std::copy(tmp, tmp + 64, g);
    }
}
#endif

// rows r .. r + RB over the tile's keys [j0, j1)
template <int RB, typename T>
void dot_rows(Workspace& ws, int64_t r, int64_t j0, int64_t j1, int64_t offset, int64_t head_dim,
              float scale) {
  constexpr int KB = kLanes / RB;
  float* scores = ws.scores.data() + r * kStride;
  for (int64_t j = j0; j < j1; j += KB) {
    if constexpr (std::is_same_v<T, Fp8>) {
#if defined(INFER_FP8)
      const c10::BFloat16* q = ws.q_bf16.data() + r * head_dim;
      dot_block_fp8<RB>(q, &ws.keys[j], offset, head_dim, scale, scores + j, *ws.lut);
#endif
    } else {
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        const c10::BFloat16* q = ws.q_bf16.data() + r * head_dim;
        dot_block_bf16<RB>(q, &ws.keys[j], offset, head_dim, scale, scores + j);
        continue;
      }
#endif
      dot_block<RB, T>(ws.q.data() + r * head_dim, &ws.keys[j], offset, head_dim, scale, scores + j);
    }
  }
}

// The scores of rows r0 .. r0 + rows with the tile's keys [j0, j1), in blocks of 8, 4, 2, 1 rows. A block
// of keys past j1 reads the next ones (past the tile's count, the caller repeats its last slot); their
// scores land where the next keys' will, or in the padding of kStride.
template <typename T>
void tile_scores(Workspace& ws, int64_t r0, int64_t rows, int64_t j0, int64_t j1, int64_t offset,
                 int64_t head_dim, float scale) {
  for (int64_t r = r0, left = rows; left > 0;) {
    const int64_t n = left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
    if (n == 8) dot_rows<8, T>(ws, r, j0, j1, offset, head_dim, scale);
    else if (n == 4) dot_rows<4, T>(ws, r, j0, j1, offset, head_dim, scale);
    else if (n == 2) dot_rows<2, T>(ws, r, j0, j1, offset, head_dim, scale);
    else dot_rows<1, T>(ws, r, j0, j1, offset, head_dim, scale);
    r += n;
    left -= n;
  }
}

// ---- values: acc[r] += sum_j p[r][j] * v_j ----
//
// NR rows x NC vectors of head_dim stay in registers while the tile's values stream by once: each
// value vector is loaded (and converted) once for NR rows.

template <int NR, int NC, typename T>
void accumulate_block(const float* p, const void* const* values, int64_t j0, int64_t j1, int64_t offset,
                      int64_t d0, int64_t head_dim, float* acc) {
  VecF a[NR][NC];
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < NC; ++c) a[r][c] = vload(acc + r * head_dim + d0 + c * kLanes);
  for (int64_t j = j0; j < j1; ++j) {
    const T* v = static_cast<const T*>(values[j]) + offset + d0;
    VecF vv[NC];
    for (int c = 0; c < NC; ++c) vv[c] = vload(v + c * kLanes);
    for (int r = 0; r < NR; ++r) {
      const VecF pr = vset1(p[r * kStride + j]);
      for (int c = 0; c < NC; ++c) a[r][c] = vfma(pr, vv[c], a[r][c]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < NC; ++c) vstore(acc + r * head_dim + d0 + c * kLanes, a[r][c]);
}

template <int NC, typename T>
void accumulate_rows(Workspace& ws, int64_t r, int64_t nr, int64_t j0, int64_t j1, int64_t offset,
                     int64_t d0, int64_t head_dim) {
  const float* p = ws.scores.data() + r * kStride;
  const void* const* v = ws.values.data();
  float* acc = ws.acc.data() + r * head_dim;
  switch (nr) {
    case 4: accumulate_block<4, NC, T>(p, v, j0, j1, offset, d0, head_dim, acc); break;
    case 3: accumulate_block<3, NC, T>(p, v, j0, j1, offset, d0, head_dim, acc); break;
    case 2: accumulate_block<2, NC, T>(p, v, j0, j1, offset, d0, head_dim, acc); break;
    default: accumulate_block<1, NC, T>(p, v, j0, j1, offset, d0, head_dim, acc);
  }
}

// rows r0 .. r0 + rows of acc += their probabilities @ the values of keys [j0, j1) (at offset in each slot)
template <typename T>
void tile_values(Workspace& ws, int64_t r0, int64_t rows, int64_t j0, int64_t j1, int64_t offset,
                 int64_t head_dim) {
  // AVX-512's 32 registers hold 4 rows x 4 vectors of accumulators; AVX2's 16, 2 rows x 4 vectors
  constexpr int64_t kRows = kLanes == 16 ? 4 : 2;
  for (int64_t d0 = 0; d0 < head_dim;) {
    const int64_t left = (head_dim - d0) / kLanes;
    const int64_t nc = left >= 4 ? 4 : left >= 2 ? 2 : 1;
    for (int64_t r = r0; r < r0 + rows; r += kRows) {
      const int64_t nr = std::min(kRows, r0 + rows - r);
      if (nc == 4) accumulate_rows<4, T>(ws, r, nr, j0, j1, offset, d0, head_dim);
      else if (nc == 2) accumulate_rows<2, T>(ws, r, nr, j0, j1, offset, d0, head_dim);
      else accumulate_rows<1, T>(ws, r, nr, j0, j1, offset, d0, head_dim);
    }
    d0 += nc * kLanes;
  }
}

#if defined(__AVX512BF16__)
// The same for bfloat16 values on vdpbf16ps (bf16_values): two keys at a time, their probabilities a
// bf16 pair broadcast to every lane, their values interleaved dim by dim (unpacklo/hi of the two rows,
// within 128-bit lanes), so that one instruction adds two keys' products for 16 dims: a third of the
// instructions of converting the values to float32 for FMAs (~3% a step at 32 x 1,900 tokens). The
// probabilities are rounded to bf16 as the values are (the prefill kernel's AMX path does the same); the
// interleave leaves acc's dims permuted within each group of 32 until unpermute_rows.
template <int NR, int NG>  // NR rows x NG groups of 32 dims
void accumulate_block_bf16(const c10::BFloat16* p, const void* const* values, int64_t j0, int64_t j1,
                           int64_t offset, int64_t d0, int64_t head_dim, float* acc) {
  __m512 a[NR][2 * NG];
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < 2 * NG; ++c) a[r][c] = _mm512_loadu_ps(acc + r * head_dim + d0 + c * 16);
  for (int64_t j = j0; j < j1; j += 2) {  // j1 - j0 even: the tile's odd count ends with p = 0
    const auto* v0 = static_cast<const c10::BFloat16*>(values[j]) + offset + d0;
    const auto* v1 = static_cast<const c10::BFloat16*>(values[j + 1]) + offset + d0;
    __m512bh vv[2 * NG];
    for (int g = 0; g < NG; ++g) {
      const __m512i x = _mm512_loadu_si512(v0 + 32 * g), y = _mm512_loadu_si512(v1 + 32 * g);
      vv[2 * g] = (__m512bh)_mm512_unpacklo_epi16(x, y);
      vv[2 * g + 1] = (__m512bh)_mm512_unpackhi_epi16(x, y);
    }
    for (int r = 0; r < NR; ++r) {
      int32_t pair;
      std::memcpy(&pair, p + r * kStride + j, sizeof(pair));
      const __m512bh pr = (__m512bh)_mm512_set1_epi32(pair);
      for (int c = 0; c < 2 * NG; ++c) a[r][c] = _mm512_dpbf16_ps(a[r][c], pr, vv[c]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < 2 * NG; ++c) _mm512_storeu_ps(acc + r * head_dim + d0 + c * 16, a[r][c]);
}

template <int NG>
void accumulate_rows_bf16(Workspace& ws, int64_t r, int64_t nr, int64_t j0, int64_t j1, int64_t offset,
                          int64_t d0, int64_t head_dim) {
  const c10::BFloat16* p = ws.p_bf16.data() + r * kStride;
  const void* const* v = ws.values.data();
  float* acc = ws.acc.data() + r * head_dim;
  switch (nr) {
    case 4: accumulate_block_bf16<4, NG>(p, v, j0, j1, offset, d0, head_dim, acc); break;
    case 3: accumulate_block_bf16<3, NG>(p, v, j0, j1, offset, d0, head_dim, acc); break;
    case 2: accumulate_block_bf16<2, NG>(p, v, j0, j1, offset, d0, head_dim, acc); break;
    default: accumulate_block_bf16<1, NG>(p, v, j0, j1, offset, d0, head_dim, acc);
  }
}

// rows r0 .. r0 + rows of acc += their bf16 probabilities @ the keys [j0, j1)'s values
inline void tile_values_bf16(Workspace& ws, int64_t r0, int64_t rows, int64_t j0, int64_t j1, int64_t offset,
                             int64_t head_dim) {
  j1 += (j1 - j0) % 2;
  for (int64_t d0 = 0; d0 < head_dim;) {
    const int64_t ng = head_dim - d0 >= 64 ? 2 : 1;
    for (int64_t r = r0; r < r0 + rows; r += 4) {
      const int64_t nr = std::min<int64_t>(4, r0 + rows - r);
      if (ng == 2) accumulate_rows_bf16<2>(ws, r, nr, j0, j1, offset, d0, head_dim);
      else accumulate_rows_bf16<1>(ws, r, nr, j0, j1, offset, d0, head_dim);
    }
    d0 += 32 * ng;
  }
}

#if defined(INFER_FP8)
// The same for fp8 values (head_dim a multiple of 64): each key's 64-dim group decoded (fp8.h), two keys'
// interleaved as bf16_values does. A row's 4 accumulators of a group hold, in lane 4 L + m of vector c,
// dim 16 L + 4 c + m, until unpermute_rows.
template <int NR>
void accumulate_block_fp8(const c10::BFloat16* p, const void* const* values, int64_t j0, int64_t j1,
                          int64_t offset, int64_t d0, int64_t head_dim, float* acc, const infer_fp8::Lut& lut) {
  __m512 a[NR][4];
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < 4; ++c) a[r][c] = _mm512_loadu_ps(acc + r * head_dim + d0 + c * 16);
  for (int64_t j = j0; j < j1; j += 2) {  // j1 - j0 even: the tile's odd count ends with p = 0
    // the two keys' codes interleaved byte by byte, then decoded: each word pair is (key j, key j + 1) of
    // one dim, as vdpbf16ps takes it (two fewer shuffles than interleaving the decoded words)
    const __m512i x = _mm512_loadu_si512(static_cast<const uint8_t*>(values[j]) + offset + d0);
    const __m512i y = _mm512_loadu_si512(static_cast<const uint8_t*>(values[j + 1]) + offset + d0);
    __m512i v[4];
    infer_fp8::decode64(lut, _mm512_unpacklo_epi8(x, y), v[0], v[1]);
    infer_fp8::decode64(lut, _mm512_unpackhi_epi8(x, y), v[2], v[3]);
    const __m512bh vv[4] = {(__m512bh)v[0], (__m512bh)v[1], (__m512bh)v[2], (__m512bh)v[3]};
    for (int r = 0; r < NR; ++r) {
      int32_t pair;
      std::memcpy(&pair, p + r * kStride + j, sizeof(pair));
      const __m512bh pr = (__m512bh)_mm512_set1_epi32(pair);
      for (int c = 0; c < 4; ++c) a[r][c] = _mm512_dpbf16_ps(a[r][c], pr, vv[c]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(acc + r * head_dim + d0 + c * 16, a[r][c]);
}

inline void tile_values_fp8(Workspace& ws, int64_t r0, int64_t rows, int64_t j0, int64_t j1, int64_t offset,
                            int64_t head_dim) {
  j1 += (j1 - j0) % 2;
  const void* const* v = ws.values.data();
  for (int64_t d0 = 0; d0 < head_dim; d0 += 64)
    for (int64_t r = r0; r < r0 + rows; r += 4) {
      const c10::BFloat16* p = ws.p_bf16.data() + r * kStride;
      float* acc = ws.acc.data() + r * head_dim;
      switch (std::min<int64_t>(4, r0 + rows - r)) {
        case 4: accumulate_block_fp8<4>(p, v, j0, j1, offset, d0, head_dim, acc, *ws.lut); break;
        case 3: accumulate_block_fp8<3>(p, v, j0, j1, offset, d0, head_dim, acc, *ws.lut); break;
        case 2: accumulate_block_fp8<2>(p, v, j0, j1, offset, d0, head_dim, acc, *ws.lut); break;
        default: accumulate_block_fp8<1>(p, v, j0, j1, offset, d0, head_dim, acc, *ws.lut);
      }
    }
}

#endif

// row's probabilities (count of them, the padding to kLanes zero) -> bf16, zeros to a multiple of 32
inline void probs_to_bf16(const float* s, int64_t count, c10::BFloat16* dst) {
  for (int64_t j = 0; j < count; j += 32) {
    const __m512 lo = _mm512_loadu_ps(s + j);
    const __m512 hi = j + 16 < count ? _mm512_loadu_ps(s + j + 16) : _mm512_setzero_ps();
    _mm512_storeu_si512(dst + j, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
}

#else
inline void tile_values_bf16(Workspace&, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t) {}
inline void probs_to_bf16(const float*, int64_t, c10::BFloat16*) {}
#endif
#if !defined(INFER_FP8)
inline void permute_queries(c10::BFloat16*, int64_t, int64_t) {}
inline void tile_values_fp8(Workspace&, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t) {}
#endif

// acc's rows back in dim order, group of G dims by group, where dim i of a group sat at position at(i):
// the bf16 values' interleave (G = 32: lane 4k + m of a group's first vector is dim 8k + m, of its second
// 8k + 4 + m) and the fp8 decode's (G = 64: lane 4 L + m of vector c is dim 16 L + 4 c + m)
template <int G, typename At>
void unpermute_rows(float* acc, int64_t rows, int64_t head_dim, At at) {
  alignas(64) float tmp[G];
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t d0 = 0; d0 < head_dim; d0 += G) {
      float* g = acc + r * head_dim + d0;
      for (int i = 0; i < G; ++i) tmp[i] = g[at(i)];
      std::copy(tmp, tmp + G, g);
    }
}

// Whether P V runs on vdpbf16ps: bfloat16 values, a head_dim of a multiple of 32, an AVX-512 BF16 build
template <typename T>
bool bf16_values(int64_t head_dim) {
#if defined(__AVX512BF16__)
  return std::is_same_v<T, c10::BFloat16> && head_dim % 32 == 0;
#else
  (void)head_dim;
  return false;
#endif
}

// ---- items ----

// the slots of sequence s's positions [start, start + count): position p is in slot
// table[p / block_size] * block_size + p % block_size; block by block
inline void find_slots(const Problem& P, int64_t s, int64_t start, int64_t count, int64_t elem,
                       std::vector<const void*>& keys, std::vector<const void*>& values) {
  const int64_t slot_stride = P.num_kv_heads * P.head_dim;
  const int64_t* table = P.block_tables + s * P.table_stride;
  for (int64_t j = 0; j < count;) {
    const int64_t pos = start + j, offset = pos % P.block_size;
    const int64_t n = std::min(P.block_size - offset, count - j);
    const int64_t first = (table[pos / P.block_size] * P.block_size + offset) * slot_stride;
    for (int64_t i = 0; i < n; ++i, ++j) {
      keys[j] = static_cast<const char*>(P.key_cache) + (first + i * slot_stride) * elem;
      values[j] = static_cast<const char*>(P.value_cache) + (first + i * slot_stride) * elem;
    }
  }
}

// A row of out: its unnormalized output times the inverse of its sum, for a whole context (run_item) and
// a split one's merge (merge_parts) alike, so that a context in one part gets the same bits either way.
// Rounded to the cache's dtype T, then stored as out's Q (float32 queries over a 16-bit cache).
template <typename T, typename Q>
void write_row(Q* dst, const float* acc, float sum, int64_t D) {
  const float inv = 1.f / sum;
  for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<Q>(static_cast<T>(acc[d] * inv));
}

// `following`: the item this thread takes next, or nullptr; its first tile is prefetched during this
// item's last (`warm`: this item's first tile was, by the item before). T: the cache's element type (the
// queries' over fp8); Q: the queries' and the output's, T or float32 over a 16-bit cache, whose queries
// are read rounded to T as if given in T.
template <typename T, typename Q>
void run_item(const Problem& P, const Item& item, const Item* following, bool warm) {
  Workspace& ws = workspace;
  const int64_t s = item.seq, D = P.head_dim, G = P.group, num_kv_heads = P.num_kv_heads;
  const int64_t q_len = P.query_len(s), seq_len = P.seq_lens[s];
  const int64_t head_rows = G * q_len, rows = num_kv_heads * head_rows;
  ws.reserve(rows, D);
  for (int64_t r = 0; r < rows; ++r) {
    const Q* src = static_cast<const Q*>(P.q) + P.token_of(s, r) * P.q_token_stride;
    src += P.head_of(s, r) * P.q_head_stride;
    std::transform(src, src + D, ws.q.begin() + r * D, [](Q x) { return static_cast<float>(static_cast<T>(x)); });
    if constexpr (std::is_same_v<T, c10::BFloat16>)
      std::transform(src, src + D, ws.q_bf16.begin() + r * D, [](Q x) { return static_cast<T>(x); });
  }
  if (P.fp8) {
#if defined(INFER_FP8)
    ws.lut = &infer_fp8::lut_of(P.e5m2);
#endif
    permute_queries(ws.q_bf16.data(), rows, D);
  }
  std::fill(ws.max.begin(), ws.max.begin() + rows, kNegInf);
  std::fill(ws.sum.begin(), ws.sum.begin() + rows, 0.f);
  std::fill(ws.acc.begin(), ws.acc.begin() + rows * D, 0.f);

  const int64_t slot_stride = num_kv_heads * D;
  const int64_t elem = P.fp8 ? 1 : static_cast<int64_t>(sizeof(T));  // bytes per cached element
  const int64_t slot_bytes = slot_stride * elem;
  const bool bf16 = !P.fp8 && bf16_values<T>(D);
  find_slots(P, s, item.begin, std::min(kTile, item.end - item.begin), elem, ws.next_keys, ws.next_values);
  for (int64_t start = item.begin; start < item.end; start += kTile) {
    const int64_t count = std::min(kTile, item.end - start);
    std::swap(ws.keys, ws.next_keys);
    std::swap(ws.values, ws.next_values);
    if (start == item.begin && !warm) {  // the first tile: all of it at once
      Prefetcher first{ws.keys.data(), ws.values.data(), 0, count, count, slot_bytes};
      first.step();
    }
    const int64_t next_count = std::max<int64_t>(0, std::min(kTile, item.end - start - count));
    int64_t ahead_count = next_count;
    if (next_count > 0) find_slots(P, s, start + count, next_count, elem, ws.next_keys, ws.next_values);
    else if (following) {  // the last tile: the next item's first one comes in meanwhile
      ahead_count = std::min(kTile, following->end - following->begin);
      find_slots(P, following->seq, following->begin, ahead_count, elem, ws.next_keys, ws.next_values);
    }
    // every kv head's scores, kSub slots at a time (the slots past count repeat the last one: a block of
    // keys needs no tail)
    std::fill(ws.keys.begin() + count, ws.keys.begin() + count + kLanes, ws.keys[count - 1]);
    const int64_t subs = (count + kSub - 1) / kSub;
    Prefetcher ahead{ws.next_keys.data(), ws.next_values.data(), 0, ahead_count, 0, slot_bytes};
    ahead.spread_over(subs * num_kv_heads * 2);
    for (int64_t j0 = 0; j0 < count; j0 += kSub) {
      const int64_t j1 = std::min(count, j0 + kSub);
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        ahead.step();
        if (P.fp8) tile_scores<Fp8>(ws, h * head_rows, head_rows, j0, j1, h * D, D, P.scale);
        else tile_scores<T>(ws, h * head_rows, head_rows, j0, j1, h * D, D, P.scale);
      }
    }
    if (q_len > 1) {  // a chunk: query t sees the keys up to its own position (within the window)
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t q_pos = seq_len - q_len + (r % head_rows) / G;
        const int64_t lo = P.window > 0 ? q_pos - P.window + 1 : 0;
        float* scores = ws.scores.data() + r * kStride;
        for (int64_t j = 0; j < count; ++j)
          if (start + j > q_pos || start + j < lo) scores[j] = kNegInf;
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      infer_paged::softmax_row(ws.scores.data() + r * kStride, count, ws.max[r], ws.sum[r], ws.acc.data() + r * D, D);
      if (bf16 || P.fp8) probs_to_bf16(ws.scores.data() + r * kStride, count, ws.p_bf16.data() + r * kStride);
    }
    ws.values[count] = ws.values[count - 1];  // bf16 pairs: an odd count's last pair has p = 0
    for (int64_t j0 = 0; j0 < count; j0 += kSub) {
      const int64_t j1 = std::min(count, j0 + kSub);
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        ahead.step();
        if (P.fp8) tile_values_fp8(ws, h * head_rows, head_rows, j0, j1, h * D, D);
        else if (bf16) tile_values_bf16(ws, h * head_rows, head_rows, j0, j1, h * D, D);
        else tile_values<T>(ws, h * head_rows, head_rows, j0, j1, h * D, D);
      }
    }
  }

  if (bf16) unpermute_rows<32>(ws.acc.data(), rows, D, [](int i) { return i % 8 / 4 * 16 + i / 8 * 4 + i % 4; });
  if (P.fp8) unpermute_rows<64>(ws.acc.data(), rows, D, [](int i) { return i % 16 / 4 * 16 + i / 16 * 4 + i % 4; });
  if (item.partial >= 0) {  // one part of a split context: (max, sum, unnormalized output) per row
    float* dst = P.partials + item.partial;
    std::copy(ws.max.begin(), ws.max.begin() + rows, dst);
    std::copy(ws.sum.begin(), ws.sum.begin() + rows, dst + rows);
    std::copy(ws.acc.begin(), ws.acc.begin() + rows * D, dst + 2 * rows);
    return;
  }
  for (int64_t r = 0; r < rows; ++r) write_row<T>(P.out_row<Q>(s, r), ws.acc.data() + r * D, ws.sum[r], D);
}

// The parts of one split context into its rows of out: each part's output weighted by exp(its max - the
// overall max), over the weighted sum (write_row): a context whose keys all fall in one part gets that
// part's output bit for bit, whatever its other parts hold. A part may hold no key of a row (its max is
// -inf): weight 0.
template <typename T, typename Q>
void merge_parts(const Problem& P, int64_t s, const std::vector<int64_t>& offsets) {
  const int64_t D = P.head_dim, rows = P.num_kv_heads * P.group * P.query_len(s);
  std::vector<float> out(D);
  for (int64_t r = 0; r < rows; ++r) {
    float max = kNegInf, sum = 0.f;
    for (int64_t o : offsets) max = std::max(max, P.partials[o + r]);
    std::fill(out.begin(), out.end(), 0.f);
    for (int64_t o : offsets) {
      const float m = P.partials[o + r];
      if (m == kNegInf) continue;
      const float w = std::exp(m - max);
      sum += w * P.partials[o + rows + r];
      const float* acc = P.partials + o + 2 * rows + r * D;
      for (int64_t d = 0; d < D; d += kLanes)
        vstore(out.data() + d, vfma(vset1(w), vload(acc + d), vload(out.data() + d)));
    }
    write_row<T>(P.out_row<Q>(s, r), out.data(), sum, D);
  }
}

using Splits = std::vector<std::pair<int64_t, std::vector<int64_t>>>;  // (sequence, its parts' offsets)

template <typename T, typename Q>
void run(const Problem& P, std::vector<Item>& items, const Splits& splits) {
  // longest first, then each thread takes the next item: the threads finish close together
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.end - a.begin > b.end - b.begin; });
  const int64_t num_items = static_cast<int64_t>(items.size());
  const int64_t num_threads = std::min<int64_t>(at::get_num_threads(), num_items);
  std::atomic<int64_t> next{0};
  // a split's parts left to run: the thread that runs its last one merges them
  std::unique_ptr<std::atomic<int64_t>[]> parts_left(new std::atomic<int64_t>[splits.size()]);
  for (size_t i = 0; i < splits.size(); ++i) parts_left[i] = static_cast<int64_t>(splits[i].second.size());
  at::parallel_for(0, num_threads, 1, [&](int64_t, int64_t) {
    bool warm = false;
    for (int64_t i = next.fetch_add(1); i < num_items;) {
      // the next item claimed now, to prefetch it; but the last num_threads items go to whichever thread
      // is free first (claimed early, one could wait behind a long item while another thread idles)
      int64_t j = -1;
      if (next.load(std::memory_order_relaxed) < num_items - num_threads) j = next.fetch_add(1);
      const Item* following = j >= 0 && j < num_items ? &items[j] : nullptr;
      const Item& item = items[i];
      run_item<T, Q>(P, item, following, warm);
      if (item.partial >= 0 && parts_left[item.split].fetch_sub(1, std::memory_order_acq_rel) == 1)
        merge_parts<T, Q>(P, splits[item.split].first, splits[item.split].second);
      i = j >= 0 ? j : next.fetch_add(1);
      warm = following != nullptr;
    }
  });
}

// ---- the op ----

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
                           const at::Tensor& block_tables, const at::Tensor& seq_lens,
                           const std::optional<at::Tensor>& query_starts, double scale, int64_t window) {
  at::Tensor out;
  Problem P{};
  static_cast<infer_paged::PagedCall&>(P) = infer_paged::check_call(
      q, key_cache, value_cache, block_tables, seq_lens, query_starts ? &*query_starts : nullptr, scale, window, out,
      /*float32_over_16bit=*/true);
  const int64_t num_seqs = P.num_seqs, num_heads = P.num_heads, D = P.head_dim;
#if !defined(INFER_FP8)
  TORCH_CHECK(!P.fp8, "paged_attention: an fp8 cache needs AVX-512 BF16 and VBMI; this build has ", kIsa);
#endif

  // Each sequence's keys: [the first its first query sees, seq_len), their blocks checked.
  std::vector<int64_t> begins(num_seqs);
  for (int64_t s = 0; s < num_seqs; ++s) {
    if (P.seq_lens[s] == 0) continue;  // padding
    TORCH_CHECK(P.query_len(s) > 0, "a sequence without queries must have seq_len 0");
    begins[s] = P.checked_first_key(s);
  }
  // Items: a sequence, or its parts where its keys cross a multiple of part_len. Parts are fixed by
  // position, not by the step: a row's arithmetic is the same in any batch and at any later length of its
  // sequence (a verification's extra keys fall in parts of their own, which its earlier rows do not see).
  std::vector<Item> items;
  Splits splits;
  int64_t partial_floats = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t seq_len = P.seq_lens[s], rows = num_heads * P.query_len(s);
    if (seq_len == 0) {  // padding: zeros, not whatever the output's memory held
      const int64_t first = P.query_start(s) * num_heads * D, count = rows * D;
      std::memset(static_cast<char*>(out.data_ptr()) + first * out.element_size(), 0, count * out.element_size());
      continue;
    }
    const int64_t part_len = kPart * ((P.query_len(s) + kPartQueries - 1) / kPartQueries);
    const int64_t first_part = begins[s] / part_len, last_part = (seq_len - 1) / part_len;
    if (first_part == last_part) {
      items.push_back({s, begins[s], seq_len, -1, -1});
      continue;
    }
    const int64_t split = static_cast<int64_t>(splits.size());
    splits.emplace_back(s, std::vector<int64_t>());
    for (int64_t p = first_part; p <= last_part; ++p) {
      const int64_t b = std::max(begins[s], p * part_len);
      items.push_back({s, b, std::min(seq_len, (p + 1) * part_len), partial_floats, split});
      splits.back().second.push_back(partial_floats);
      partial_floats += rows * (2 + D);
    }
  }
  at::Tensor partials = at::empty({partial_floats}, q.options().dtype(at::kFloat));
  P.partials = partials.data_ptr<float>();

  switch (q.scalar_type()) {
    case at::kFloat:  // over a 16-bit cache (check_call) or a float32 one
      if (key_cache.scalar_type() == at::kBFloat16) run<c10::BFloat16, float>(P, items, splits);
      else if (key_cache.scalar_type() == at::kHalf) run<c10::Half, float>(P, items, splits);
      else run<float, float>(P, items, splits);
      break;
    case at::kBFloat16: run<c10::BFloat16, c10::BFloat16>(P, items, splits); break;
    case at::kHalf: run<c10::Half, c10::Half>(P, items, splits); break;
    default: TORCH_CHECK(false, "paged_attention: float32, bfloat16 or float16, not ", q.scalar_type());
  }
  return out;
}

// The vector ISA of this build, for logs and tests: "+bf16" with AVX-512 BF16, "+vnni" with its VNNI too
// (six_bit_linear), "+fp8" where the attention ops and write_cache read and write fp8 caches (VBMI too),
// then "+amx" where the build has AMX
// and the kernel lets this process use the tiles (small_linear, prefill_attention).
std::string isa() {
#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
  std::string isa = std::string(kIsa) + "+bf16";
#if defined(__AVX512VNNI__)
  isa += "+vnni";
#endif
#if defined(INFER_FP8)
  isa += "+fp8";
#endif
#if defined(INFER_AMX)
  if (infer_amx::permitted()) isa += "+amx";
#endif
  return isa;
#else
  return kIsa;
#endif
}

}  // namespace

// Each op's kernel is registered for the CPU dispatch key (TORCH_LIBRARY_IMPL in each source), not as a
// catch-all with its schema: a tracer (make_fx, torch.compile) then records a call as the op itself
// instead of tracing into its allocations, so that a captured decode step calls the kernels
// (infer/runner/decode_graph.py). isa() takes no tensor, so no dispatch key: it stays a catch-all.
TORCH_LIBRARY(infer_kernels, m) {
  m.def("paged_attention(Tensor q, Tensor key_cache, Tensor value_cache, Tensor block_tables, Tensor seq_lens,"
      " Tensor? query_starts, float scale, int window) -> Tensor");
  m.def("isa() -> str", &isa);
}

TORCH_LIBRARY_IMPL(infer_kernels, CPU, m) {
  m.impl("paged_attention", &paged_attention);
}
