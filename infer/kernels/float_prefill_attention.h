// float_prefill_attention.cpp's entry points, for prefill_attention.cpp's op on builds without AVX-512 BF16.
#pragma once

#include <ATen/core/Tensor.h>

#include "paged_call.h"

namespace infer_float_prefill {

#if defined(__AVX2__) || defined(__AVX512F__)
// Whether the kernel takes queries of dtype q over a cache of dtype cache: float32, bfloat16 or float16
// over their own dtype, or float32 over a 16-bit cache
bool serves(at::ScalarType q, at::ScalarType cache);

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
                             const at::Tensor& block_tables, const at::Tensor& seq_lens,
                             const at::Tensor& query_starts, double scale, int64_t window);
#endif

}  // namespace infer_float_prefill
