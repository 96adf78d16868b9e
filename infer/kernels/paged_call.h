// What both attention ops (paged_attention.cpp: decodes and short chunks; prefill_attention.cpp: prompts
// and long chunks) take from a call over the paged KV cache, checked in one place: q, the caches, the
// block tables, seq_lens and query_starts, and each sequence's blocks; and the online softmax of their
// float32 paths.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "fp8.h"
#include "vec.h"

namespace infer_paged {

struct PagedCall {
  const void* q;  // [num_tokens, num_heads, head_dim] in the caches' dtype (bf16 over fp8), strided
  int64_t q_token_stride, q_head_stride;
  const void* key_cache;  // [num_blocks, block_size, num_kv_heads, head_dim], contiguous
  const void* value_cache;
  bool fp8, e5m2;  // caches of fp8 codes (fp8.h; q is bf16 then), e5m2 rather than e4m3
  int64_t block_size, num_kv_heads, head_dim, group;
  const int64_t* block_tables;  // [num_seqs, table_stride]
  int64_t table_stride;
  const int32_t* seq_lens;      // [num_seqs]
  const int32_t* query_starts;  // [num_seqs + 1], or null: one query per sequence
  float scale;
  int64_t window;  // 0: none
  void* out;       // [num_tokens, num_heads, head_dim], contiguous
  int64_t num_seqs, num_tokens, num_heads, num_blocks, max_blocks_per_seq;

  int64_t query_start(int64_t s) const { return query_starts ? query_starts[s] : s; }
  int64_t query_len(int64_t s) const { return query_starts ? query_starts[s + 1] - query_starts[s] : 1; }

  // Sequence s's first key any of its queries sees (its first query's window start, else 0), after
  // checking its lengths and the ids of the blocks its keys from there on are in.
  int64_t checked_first_key(int64_t s) const {
    const int64_t seq_len = seq_lens[s], q_len = query_len(s);
    TORCH_CHECK(q_len >= 1 && seq_len >= q_len, "every sequence needs 1 <= query_len <= seq_len");
    TORCH_CHECK(seq_len <= max_blocks_per_seq * block_size, "a block table is too short for its seq_len");
    const int64_t first = window > 0 ? std::max<int64_t>(0, seq_len - q_len - window + 1) : 0;
    for (int64_t b = first / block_size; b * block_size < seq_len; ++b) {
      const int64_t block = block_tables[s * table_stride + b];
      TORCH_CHECK(block >= 0 && block < num_blocks, "block id out of range");
    }
    return first;
  }
};

// Checks the tensors of a call and describes it; `out` is allocated here ([num_tokens, num_heads,
// head_dim], q's dtype). query_starts: int32 [num_seqs + 1] from 0 to num_tokens, or none.
// float32_over_16bit: the op also takes float32 queries over a bfloat16 or float16 cache.
inline PagedCall check_call(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens,
                            const at::Tensor* query_starts, double scale, int64_t window, at::Tensor& out,
                            bool float32_over_16bit = false) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q: [num_tokens, num_heads, head_dim], last dim contiguous");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.is_contiguous() && value_cache.is_contiguous() &&
                  key_cache.sizes() == value_cache.sizes(),
              "caches: contiguous [num_blocks, block_size, num_kv_heads, head_dim]");
  const at::ScalarType cache_type = key_cache.scalar_type();
  const bool fp8 = infer_fp8::is_fp8(cache_type);
  const bool narrow = float32_over_16bit && q.scalar_type() == at::kFloat &&
                      (cache_type == at::kBFloat16 || cache_type == at::kHalf);
  TORCH_CHECK(value_cache.scalar_type() == cache_type && (q.scalar_type() == cache_type || fp8 || narrow),
              "q and the caches must share a dtype (or the caches are fp8",
              float32_over_16bit ? ", or 16-bit under float32 queries)" : ")");
  TORCH_CHECK(!fp8 || (q.scalar_type() == at::kBFloat16 && q.size(2) % 64 == 0),
              "an fp8 cache is read with bfloat16 queries and a head_dim of a multiple of 64");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kLong && block_tables.stride(1) == 1,
              "block_tables: int64 [num_seqs, max_blocks], rows contiguous");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous(),
              "seq_lens: int32 [num_seqs]");
  PagedCall c{};
  c.num_seqs = seq_lens.size(0);
  c.num_tokens = q.size(0);
  c.num_heads = q.size(1);
  c.head_dim = q.size(2);
  c.num_blocks = key_cache.size(0);
  c.block_size = key_cache.size(1);
  c.num_kv_heads = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == c.head_dim && c.head_dim % 16 == 0,
              "head_dim: the same in q and caches, a multiple of 16");
  TORCH_CHECK(c.num_heads % c.num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(block_tables.size(0) == c.num_seqs, "one block table row per sequence");
  if (query_starts != nullptr) {
    TORCH_CHECK(query_starts->scalar_type() == at::kInt && query_starts->is_contiguous() &&
                    query_starts->numel() == c.num_seqs + 1,
                "query_starts: int32 [num_seqs + 1]");
    c.query_starts = query_starts->data_ptr<int32_t>();
    TORCH_CHECK(c.query_starts[0] == 0, "query_starts must start at 0");
  }
  TORCH_CHECK((c.query_starts ? c.query_starts[c.num_seqs] : c.num_seqs) == c.num_tokens,
              "q must hold every sequence's queries");
  out = at::empty({c.num_tokens, c.num_heads, c.head_dim}, q.options());
  c.q = q.data_ptr();
  c.q_token_stride = q.stride(0);
  c.q_head_stride = q.stride(1);
  c.fp8 = fp8;
  c.e5m2 = cache_type == at::kFloat8_e5m2;
  c.key_cache = key_cache.data_ptr();
  c.value_cache = value_cache.data_ptr();
  c.group = c.num_heads / c.num_kv_heads;
  c.block_tables = block_tables.data_ptr<int64_t>();
  c.table_stride = block_tables.stride(0);
  c.max_blocks_per_seq = block_tables.size(1);
  c.seq_lens = seq_lens.data_ptr<int32_t>();
  c.scale = static_cast<float>(scale);
  c.window = std::max<int64_t>(window, 0);
  c.out = out.data_ptr();
  return c;
}

// a per-thread workspace vector: at least n elements, never shrunk (kept across calls)
template <typename V>
inline void grow(V& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(n);
}

// Online softmax over one tile for one row: scores -> probabilities against the running max, the row's
// earlier sum and output rescaled when the max grows. A row that sees no key of the tile (a chunk's early
// query, a window) gets probabilities 0. The float32 paths of both attention ops take it
// (paged_attention.cpp, float_prefill_attention.cpp).
inline void softmax_row(float* s, int64_t count, float& max, float& sum, float* acc, int64_t head_dim) {
  using namespace infer_vec;
  const int64_t padded = (count + kLanes - 1) / kLanes * kLanes;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  std::fill(s + count, s + padded, kNegInf);
  VecF m = vset1(kNegInf);
  for (int64_t j = 0; j < padded; j += kLanes) m = vmax(m, vload(s + j));
  const float tile_max = vhmax(m);
  if (tile_max == kNegInf) {
    std::fill(s, s + padded, 0.f);  // the padding too: bf16's pairs of keys read past an odd count
    return;
  }
  const float new_max = std::max(max, tile_max);
  if (new_max > max && sum > 0.f) {
    const float alpha = std::exp(max - new_max);
    sum *= alpha;
    for (int64_t d = 0; d < head_dim; d += kLanes) vstore(acc + d, vmul(vload(acc + d), vset1(alpha)));
  }
  VecF total = vzero();
  for (int64_t j = 0; j < padded; j += kLanes) {
    const VecF p = vexp(vadd(vload(s + j), vset1(-new_max)));
    vstore(s + j, p);
    total = vadd(total, p);
  }
  sum += vsum(total);
  max = new_max;
}

}  // namespace infer_paged
