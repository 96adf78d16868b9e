// Prefill attention (prompts, long chunks) over the paged KV cache in float32 FMAs, for builds without
// AVX-512 BF16 (AVX2 + FMA, or AVX-512 without BF16), where prefill_attention.cpp's vdpbf16ps path does
// not exist: prefill_attention() calls this one there. Flash attention's forward pass:
//
//   items  (sequence, kv head, block of up to kBlockQueries queries), longest first, from a shared
//          counter; an item's rows are its queries times the kv head's group (row = query * group + g)
//   tiles  kTile keys at positions [i * kTile, (i + 1) * kTile), from the first its first query's window
//          reaches to its last query, each converted to float32 into the thread's buffers as it comes:
//            Kt [D][kTile]   keys transposed: one vector is kLanes keys' dim d
//            V  [kTile][D]
//   per 6 rows:  S = Q K^T in 12 registers (6 rows x 2 vectors of keys) per d, the mask on a tile the
//                diagonal or a window's edge crosses; online softmax per row (running max and sum);
//                O += P V in 12 registers (6 rows x 2 vectors of dims) per key
//
// Queries are taken in their own dtype (float32 over a 16-bit cache, or the cache's), multiplied in
// float32; the output is q's dtype. Tiles sit at fixed positions, so a query's arithmetic does not depend
// on how its prompt was chunked or batched. Figures: docs/optimizations.md, "C++ attention".

#include "float_prefill_attention.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

#include "vec.h"

namespace infer_float_prefill {

#if defined(__AVX2__) || defined(__AVX512F__)

namespace {

using namespace infer_vec;

constexpr int64_t kTile = 64;
constexpr int kRows = 6;               // rows per register block
constexpr int64_t kBlockQueries = 32;  // queries per item
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

#define UNROLL _Pragma("GCC unroll 8")

struct Item {
  int64_t seq, head, t0, n, cost;
};

struct Scratch {  // one thread's buffers, kept from call to call
  std::vector<float> kt, v, q, s, o, max, sum;
};
thread_local Scratch scratch;

// keys [start, start + count) of sequence s, kv head h, into Kt and V (float32), zeros past count
template <typename T>
void pack_tile(const infer_paged::PagedCall& P, int64_t s, int64_t h, int64_t start, int64_t count, float* kt,
               float* v) {
  const int64_t D = P.head_dim, slot_stride = P.num_kv_heads * D;
  const int64_t* table = P.block_tables + s * P.table_stride;
  const T* keys = static_cast<const T*>(P.key_cache);
  const T* values = static_cast<const T*>(P.value_cache);
  for (int64_t j = 0; j < count; ++j) {
    const int64_t pos = start + j;
    const int64_t at = (table[pos / P.block_size] * P.block_size + pos % P.block_size) * slot_stride + h * D;
    for (int64_t d = 0; d < D; d += kLanes) {
      alignas(64) float k[kLanes];
      vstore(k, vload(keys + at + d));
      for (int64_t i = 0; i < kLanes; ++i) kt[(d + i) * kTile + j] = k[i];
      vstore(v + j * D + d, vload(values + at + d));
    }
  }
  for (int64_t j = count; j < kTile; ++j) {
    for (int64_t d = 0; d < D; ++d) kt[d * kTile + j] = 0.f;
    std::fill(v + j * D, v + (j + 1) * D, 0.f);
  }
}

// s[r][j] = q_r . k_j for R rows (q pre-scaled) and the tile's kTile keys. Built as -O2 with its loops
// unrolled: GCC 12 -O3 spills such accumulator blocks at every step (avx2_linear.cpp's tile_pairs).
template <int R>
__attribute__((optimize("O2"))) void scores(const float* q, int64_t D, const float* kt, float* s) {
  for (int64_t j0 = 0; j0 < kTile; j0 += 2 * kLanes) {
    VecF acc[R][2];
    UNROLL for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = vzero();
    for (int64_t d = 0; d < D; ++d) {
      const VecF k0 = vload(kt + d * kTile + j0), k1 = vload(kt + d * kTile + j0 + kLanes);
      UNROLL for (int r = 0; r < R; ++r) {
        const VecF x = vset1(q[r * D + d]);
        acc[r][0] = vfma(x, k0, acc[r][0]);
        acc[r][1] = vfma(x, k1, acc[r][1]);
      }
    }
    UNROLL for (int r = 0; r < R; ++r) {
      vstore(s + r * kTile + j0, acc[r][0]);
      vstore(s + r * kTile + j0 + kLanes, acc[r][1]);
    }
  }
}

// o[r] += sum_j p[r][j] v_j for R rows, NC vectors of dims at a time
template <int R, int NC>
__attribute__((optimize("O2"))) void accumulate(const float* p, const float* v, int64_t D, int64_t d0, float* o) {
  VecF acc[R][NC];
  UNROLL for (int r = 0; r < R; ++r) UNROLL for (int c = 0; c < NC; ++c) acc[r][c] = vload(o + r * D + d0 + c * kLanes);
  for (int64_t j = 0; j < kTile; ++j) {
    VecF vv[NC];
    UNROLL for (int c = 0; c < NC; ++c) vv[c] = vload(v + j * D + d0 + c * kLanes);
    UNROLL for (int r = 0; r < R; ++r) {
      const VecF x = vset1(p[r * kTile + j]);
      UNROLL for (int c = 0; c < NC; ++c) acc[r][c] = vfma(x, vv[c], acc[r][c]);
    }
  }
  UNROLL for (int r = 0; r < R; ++r) UNROLL for (int c = 0; c < NC; ++c) vstore(o + r * D + d0 + c * kLanes, acc[r][c]);
}

template <int R>
void block(const float* q, const float* kt, const float* v, int64_t D, float* s, float* o, const int64_t* lo,
           const int64_t* hi, float* max, float* sum) {
  scores<R>(q, D, kt, s);
  for (int r = 0; r < R; ++r) {
    float* row = s + r * kTile;
    for (int64_t j = 0; j < std::min<int64_t>(lo[r], kTile); ++j) row[j] = kNegInf;
    for (int64_t j = std::max<int64_t>(hi[r] + 1, 0); j < kTile; ++j) row[j] = kNegInf;
    infer_paged::softmax_row(row, kTile, max[r], sum[r], o + r * D, D);
  }
  int64_t d0 = 0;
  for (; d0 + 2 * kLanes <= D; d0 += 2 * kLanes) accumulate<R, 2>(s, v, D, d0, o);
  if (d0 < D) accumulate<R, 1>(s, v, D, d0, o);
}

template <int R = kRows>
void run_block(int rows, const float* q, const float* kt, const float* v, int64_t D, float* s, float* o,
               const int64_t* lo, const int64_t* hi, float* max, float* sum) {
  if constexpr (R > 1) {
    if (rows < R) return run_block<R - 1>(rows, q, kt, v, D, s, o, lo, hi, max, sum);
  }
  block<R>(q, kt, v, D, s, o, lo, hi, max, sum);
}

template <typename T, typename Q>
void run_item(const infer_paged::PagedCall& P, const Item& item) {
  Scratch& ws = scratch;
  const int64_t s = item.seq, h = item.head, D = P.head_dim, G = P.group;
  const int64_t rows = item.n * G;
  infer_paged::grow(ws.kt, D * kTile);
  infer_paged::grow(ws.v, kTile * D);
  infer_paged::grow(ws.q, rows * D);
  infer_paged::grow(ws.s, kRows * kTile);
  infer_paged::grow(ws.o, rows * D);
  infer_paged::grow(ws.max, rows);
  infer_paged::grow(ws.sum, rows);
  const int64_t seq_len = P.seq_lens[s], q_len = P.query_len(s), token0 = P.query_start(s) + item.t0;
  const int64_t first_pos = seq_len - q_len + item.t0;  // the item's first query's position
  const float scale = P.scale;
  for (int64_t r = 0; r < rows; ++r) {  // q scaled once: the scores come out scaled
    const Q* src = static_cast<const Q*>(P.q) + (token0 + r / G) * P.q_token_stride + (h * G + r % G) * P.q_head_stride;
    for (int64_t d = 0; d < D; ++d) ws.q[r * D + d] = static_cast<float>(src[d]) * scale;
  }
  std::fill(ws.o.begin(), ws.o.begin() + rows * D, 0.f);
  std::fill(ws.max.begin(), ws.max.begin() + rows, kNegInf);
  std::fill(ws.sum.begin(), ws.sum.begin() + rows, 0.f);
  const int64_t last_pos = first_pos + item.n - 1;
  const int64_t first_key = P.window > 0 ? std::max<int64_t>(0, first_pos - P.window + 1) : 0;
  for (int64_t start = first_key / kTile * kTile; start <= last_pos; start += kTile) {
    const int64_t count = std::min(kTile, seq_len - start);
    pack_tile<T>(P, s, h, start, count, ws.kt.data(), ws.v.data());
    for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
      const int n = static_cast<int>(std::min<int64_t>(kRows, rows - r0));
      // each row's keys in this tile: [lo, hi] (its window's start, its own position)
      int64_t lo[kRows], hi[kRows];
      bool any = false;
      for (int i = 0; i < n; ++i) {
        const int64_t pos = first_pos + (r0 + i) / G;
        hi[i] = std::min(pos, start + count - 1) - start;
        lo[i] = P.window > 0 ? pos - P.window + 1 - start : 0;
        any = any || (hi[i] >= 0 && lo[i] < kTile && lo[i] <= hi[i]);
      }
      if (!any) continue;  // a tile no row of the block sees (past the diagonal, before a window)
      run_block(n, ws.q.data() + r0 * D, ws.kt.data(), ws.v.data(), D, ws.s.data(), ws.o.data() + r0 * D, lo, hi,
                ws.max.data() + r0, ws.sum.data() + r0);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    Q* dst = static_cast<Q*>(P.out) + ((token0 + r / G) * P.num_heads + h * G + r % G) * D;
    const float inv = 1.f / ws.sum[r];
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<Q>(ws.o[r * D + d] * inv);
  }
}

template <typename T, typename Q>
void run(const infer_paged::PagedCall& P, std::vector<Item>& items) {
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  const int64_t num_items = static_cast<int64_t>(items.size());
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), num_items), 1, [&](int64_t, int64_t) {
    for (int64_t i = next.fetch_add(1); i < num_items; i = next.fetch_add(1)) run_item<T, Q>(P, items[i]);
  });
}

}  // namespace

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
                             const at::Tensor& block_tables, const at::Tensor& seq_lens,
                             const at::Tensor& query_starts, double scale, int64_t window) {
  TORCH_CHECK(scale > 0, "scale must be positive");
  at::Tensor out;
  const infer_paged::PagedCall P = infer_paged::check_call(q, key_cache, value_cache, block_tables, seq_lens,
                                                           &query_starts, scale, window, out, true);
  TORCH_CHECK(!P.fp8, "prefill_attention: an fp8 cache needs AVX-512 BF16 and VBMI; this build has ",
              infer_vec::kIsa);
  std::vector<Item> items;
  for (int64_t s = 0; s < P.num_seqs; ++s) {
    const int64_t seq_len = P.seq_lens[s], q_len = P.query_len(s);
    P.checked_first_key(s);
    for (int64_t t = 0; t < q_len; t += kBlockQueries) {
      const int64_t n = std::min(kBlockQueries, q_len - t), pos = seq_len - q_len + t;
      const int64_t first = P.window > 0 ? std::max<int64_t>(0, pos - P.window + 1) : 0;
      for (int64_t h = 0; h < P.num_kv_heads; ++h) items.push_back({s, h, t, n, n * (pos + n - first + kTile)});
    }
  }
  const at::ScalarType qt = q.scalar_type(), ct = key_cache.scalar_type();
  if (qt == at::kFloat && ct == at::kBFloat16) run<c10::BFloat16, float>(P, items);
  else if (qt == at::kFloat && ct == at::kHalf) run<c10::Half, float>(P, items);
  else if (qt == at::kFloat) run<float, float>(P, items);
  else if (qt == at::kBFloat16) run<c10::BFloat16, c10::BFloat16>(P, items);
  else if (qt == at::kHalf) run<c10::Half, c10::Half>(P, items);
  else TORCH_CHECK(false, "prefill_attention: float32, bfloat16 or float16, not ", qt);
  return out;
}

#endif  // AVX2 or AVX-512

}  // namespace infer_float_prefill
