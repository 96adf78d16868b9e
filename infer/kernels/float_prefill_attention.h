// float_prefill_attention.cpp's entry point, for prefill_attention.cpp's op on builds without AVX-512 BF16.
#pragma once

#include <ATen/core/Tensor.h>

#include "paged_call.h"

namespace infer_float_prefill {

#if defined(__AVX2__) || defined(__AVX512F__)
// Queries of the cache's dtype (float32, bfloat16, float16), or float32 ones over a 16-bit cache
at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
                             const at::Tensor& block_tables, const at::Tensor& seq_lens,
                             const at::Tensor& query_starts, double scale, int64_t window);
#endif

}  // namespace infer_float_prefill
