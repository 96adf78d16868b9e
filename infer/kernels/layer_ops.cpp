// The small per-layer ops of a decoder, each one pass over its rows instead of torch's several:
// RMSNorm (and the residual add before it), rotary embeddings in place, SiLU-and-multiply; the write of
// a step's keys and values into the KV cache (vLLM's reshape_and_cache); and the greedy sampler's argmax
// over the logits.
//
// In torch each of these is 4-8 elementwise ops, each a pass over memory, an allocation and a dispatch
// of ~5-20 us; a llama-50m step runs 16 norms, 8 rotaries and 8 activations (a 512-token prefill spent
// 8 ms of its 51 in them, a 32-stream decode step ~2 ms of its 10: see infer/layers/norms.py). vLLM's CPU
// backend has the same three kernels (csrc/cpu/layernorm.cpp, pos_encoding.cpp, activation.cpp).
//
// Results equal the torch reference of the layers (infer/layers/*.py: Hugging Face's formulas) up to the
// order of float32 sums: math in float32, rounding to the tensor's dtype exactly where the reference
// rounds (the residual sum, the normalized row before the weight, the activation before the product),
// round-to-nearest-even as torch converts. Rows go to torch's OpenMP threads in chunks big enough to
// pay for the fork (a decode's one row stays on the calling thread).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "fp8.h"
#include "vec.h"

namespace {

using namespace infer_vec;

constexpr int64_t kGrainElements = 1 << 14;  // a thread's least share: ~16K elements (~10 us of work)

template <typename F>
void for_rows(int64_t rows, int64_t width, F&& body) {
  const int64_t grain = std::max<int64_t>(1, kGrainElements / std::max<int64_t>(width, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) body(r);
  });
}

// out = weight * round(x * rsqrt(mean(x^2) + eps)); with a residual, first residual = round(x + residual)
// and x := that sum (the fused add of vLLM's fused_add_rms_norm, written back to both).
template <typename T>
void rms_norm_rows(const T* x, int64_t x_stride, T* residual, int64_t res_stride, const T* weight, T* out,
                   int64_t out_stride, int64_t rows, int64_t H, float eps) {
  for_rows(rows, H, [&](int64_t r) {
    const T* xr = x + r * x_stride;
    T* outr = out + r * out_stride;
    const T* src = xr;
    if (residual != nullptr) {  // residual += x, rounded: the row the norm reads
      T* res = residual + r * res_stride;
      for (int64_t i = 0; i < H; i += kLanes) vstore_as(res + i, vadd(vload(xr + i), vload(res + i)));
      src = res;
    }
    VecF acc = vzero();
    for (int64_t i = 0; i < H; i += kLanes) {
      const VecF v = vload(src + i);
      acc = vfma(v, v, acc);
    }
    const VecF inv = vset1(1.f / std::sqrt(vsum(acc) / static_cast<float>(H) + eps));
    for (int64_t i = 0; i < H; i += kLanes)
      vstore_as(outr + i, vmul(vload(weight + i), vround_to<T>(vmul(vload(src + i), inv))));
  });
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, ": [rows, width], last dim contiguous");
  TORCH_CHECK(t.size(1) % kLanes == 0, name, ": width must be a multiple of ", kLanes);
}

template <typename F>
void dispatch(at::ScalarType type, const char* op, F&& f) {
  switch (type) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(c10::BFloat16{}); break;
    case at::kHalf: f(c10::Half{}); break;
    default: TORCH_CHECK(false, op, ": float32, bfloat16 or float16, not ", type);
  }
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(1) &&
                  weight.scalar_type() == x.scalar_type(),
              "weight: contiguous [width], x's dtype");
  at::Tensor out = at::empty(x.sizes(), x.options());
  dispatch(x.scalar_type(), "rms_norm", [&](auto t) {
    using T = decltype(t);
    rms_norm_rows<T>(x.const_data_ptr<T>(), x.stride(0), nullptr, 0, weight.const_data_ptr<T>(),
                     out.data_ptr<T>(), out.stride(0), x.size(0), x.size(1), static_cast<float>(eps));
  });
  return out;
}

// In place: residual = x + residual, x = rms_norm(residual).
void add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  TORCH_CHECK(x.sizes() == residual.sizes() && x.scalar_type() == residual.scalar_type(),
              "x and residual: the same shape and dtype");
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(1) &&
                  weight.scalar_type() == x.scalar_type(),
              "weight: contiguous [width], x's dtype");
  dispatch(x.scalar_type(), "add_rms_norm", [&](auto t) {
    using T = decltype(t);
    rms_norm_rows<T>(x.data_ptr<T>(), x.stride(0), residual.data_ptr<T>(), residual.stride(0),
                     weight.const_data_ptr<T>(), x.data_ptr<T>(), x.stride(0), x.size(0), x.size(1),
                     static_cast<float>(eps));
  });
}

// Neox-style rotary in place on x [num_tokens, heads, head_dim] (tokens and heads strided, head_dim
// contiguous): (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), halves of head_dim, in float32.
template <typename T>
void rotate_rows(T* x, int64_t token_stride, int64_t head_stride, int64_t tokens, int64_t heads, int64_t D,
                 const int64_t* positions, const float* cos, const float* sin) {
  const int64_t half = D / 2;
  for_rows(tokens, heads * D, [&](int64_t t) {
    const float* c = cos + positions[t] * half;
    const float* s = sin + positions[t] * half;
    for (int64_t h = 0; h < heads; ++h) {
      T* row = x + t * token_stride + h * head_stride;
      for (int64_t i = 0; i < half; i += kLanes) {
        const VecF x1 = vload(row + i), x2 = vload(row + half + i);
        const VecF cv = vload(c + i), sv = vload(s + i);
        vstore_as(row + i, vsub(vmul(x1, cv), vmul(x2, sv)));
        vstore_as(row + half + i, vfma(x1, sv, vmul(x2, cv)));
      }
    }
  });
}

void rotary(const at::Tensor& positions, at::Tensor& q, at::Tensor& k, const at::Tensor& cos,
            const at::Tensor& sin) {
  TORCH_CHECK(positions.dim() == 1 && positions.scalar_type() == at::kLong && positions.is_contiguous(),
              "positions: int64 [num_tokens]");
  TORCH_CHECK(cos.dim() == 2 && cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes() &&
                  cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "cos, sin: float32 [max_positions, head_dim / 2], contiguous");
  const int64_t half = cos.size(1), tokens = positions.size(0);
  TORCH_CHECK(half % kLanes == 0, "head_dim / 2 must be a multiple of ", kLanes);
  const int64_t* pos = positions.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "position out of the cos/sin table");
  for (at::Tensor* x : {&q, &k}) {
    TORCH_CHECK(x->dim() == 3 && x->stride(2) == 1 && x->size(0) == tokens && x->size(2) == 2 * half,
                "q, k: [num_tokens, heads, head_dim], head_dim contiguous");
    dispatch(x->scalar_type(), "rotary", [&](auto t) {
      using T = decltype(t);
      rotate_rows<T>(x->data_ptr<T>(), x->stride(0), x->stride(1), tokens, x->size(1), 2 * half, pos,
                     cos.const_data_ptr<float>(), sin.const_data_ptr<float>());
    });
  }
}

// k, v [num_tokens, num_kv_heads, head_dim] (tokens and heads strided, head_dim contiguous) into the
// slots of the caches [num_blocks, block_size, num_kv_heads, head_dim]: what `cache.view(-1, kv heads,
// head_dim)[slots] = k` does, both caches in one call, several times faster than two index_puts
// (docs/optimizations.md, "C++ layer ops").
// Slots are distinct (each token its own); a repeated one would get either token's row. Slot -1 is
// padding (a decode graph's rows past its step's tokens): nothing is written. An fp8 cache
// (fp8.h) gets each element's code: bf16, float16 or float32 keys and values in, one byte each out; a
// bf16 or float16 cache under float32 keys and values (a float32 model's 16-bit cache), each rounded.
void write_cache(const at::Tensor& k, const at::Tensor& v, at::Tensor& key_cache, at::Tensor& value_cache,
                 const at::Tensor& slots) {
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.stride(2) == 1 && v.stride(2) == 1,
              "k, v: [num_tokens, num_kv_heads, head_dim], the same shape, head_dim contiguous");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes() && key_cache.is_contiguous() &&
                  value_cache.is_contiguous() && key_cache.size(2) == k.size(1) && key_cache.size(3) == k.size(2),
              "caches: contiguous [num_blocks, block_size, num_kv_heads, head_dim] of k's heads");
  const at::ScalarType cache_type = key_cache.scalar_type();
  const bool fp8 = infer_fp8::is_fp8(cache_type);
  const bool narrow = k.scalar_type() == at::kFloat && (cache_type == at::kBFloat16 || cache_type == at::kHalf);
  TORCH_CHECK(k.scalar_type() == v.scalar_type() && value_cache.scalar_type() == cache_type &&
                  (fp8 || narrow || cache_type == k.scalar_type()),
              "k, v and the caches share a dtype (or the caches are fp8, or 16-bit under float32 k and v)");
  TORCH_CHECK(slots.dim() == 1 && slots.scalar_type() == at::kLong && slots.is_contiguous() &&
                  slots.size(0) == k.size(0),
              "slots: int64 [num_tokens]");
  const int64_t tokens = k.size(0), heads = k.size(1), num_slots = key_cache.size(0) * key_cache.size(1);
  const int64_t* slot = slots.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) TORCH_CHECK(slot[t] >= -1 && slot[t] < num_slots, "slot out of range");
  if (fp8) {
#if defined(INFER_FP8)
    const infer_fp8::Format& f = infer_fp8::format_of(cache_type == at::kFloat8_e5m2);
    const int64_t D = k.size(2);
    TORCH_CHECK(D % 16 == 0, "an fp8 cache needs a head_dim of a multiple of 16");
    auto* kc = static_cast<uint8_t*>(key_cache.data_ptr());
    auto* vc = static_cast<uint8_t*>(value_cache.data_ptr());
    dispatch(k.scalar_type(), "write_cache", [&](auto t) {
      using T = decltype(t);
      const T* kp = k.const_data_ptr<T>();
      const T* vp = v.const_data_ptr<T>();
      for_rows(tokens, 2 * heads * D, [&](int64_t row) {
        for (int64_t h = 0; h < heads && slot[row] >= 0; ++h) {
          const int64_t dst = (slot[row] * heads + h) * D;
          const T* ks = kp + row * k.stride(0) + h * k.stride(1);
          const T* vs = vp + row * v.stride(0) + h * v.stride(1);
          for (int64_t d = 0; d < D; d += 16) {
            _mm_storeu_si128(reinterpret_cast<__m128i*>(kc + dst + d), infer_fp8::encode16(f, vload(ks + d)));
            _mm_storeu_si128(reinterpret_cast<__m128i*>(vc + dst + d), infer_fp8::encode16(f, vload(vs + d)));
          }
        }
      });
    });
    return;
#else
    TORCH_CHECK(false, "write_cache: an fp8 cache needs AVX-512 BF16 and VBMI; this build has ", kIsa);
#endif
  }
  if (narrow) {  // rounded as torch's .to() rounds (vstore_as)
    const int64_t D = k.size(2);
    TORCH_CHECK(D % kLanes == 0, "a 16-bit cache under float32 k and v needs a head_dim of a multiple of ", kLanes);
    const float* kp = k.const_data_ptr<float>();
    const float* vp = v.const_data_ptr<float>();
    dispatch(cache_type, "write_cache", [&](auto t) {
      using T = decltype(t);
      T* kc = static_cast<T*>(key_cache.data_ptr());
      T* vc = static_cast<T*>(value_cache.data_ptr());
      for_rows(tokens, 2 * heads * D, [&](int64_t row) {
        for (int64_t h = 0; h < heads && slot[row] >= 0; ++h) {
          const int64_t dst = (slot[row] * heads + h) * D;
          const float* ks = kp + row * k.stride(0) + h * k.stride(1);
          const float* vs = vp + row * v.stride(0) + h * v.stride(1);
          for (int64_t d = 0; d < D; d += kLanes) {
            vstore_as(kc + dst + d, vload(ks + d));
            vstore_as(vc + dst + d, vload(vs + d));
          }
        }
      });
    });
    return;
  }
  const int64_t size = k.element_size(), row = k.size(2) * size;
  const char* kp = static_cast<const char*>(k.const_data_ptr());
  const char* vp = static_cast<const char*>(v.const_data_ptr());
  char* kc = static_cast<char*>(key_cache.data_ptr());
  char* vc = static_cast<char*>(value_cache.data_ptr());
  for_rows(tokens, 2 * heads * k.size(2), [&](int64_t t) {
    for (int64_t h = 0; h < heads && slot[t] >= 0; ++h) {
      const int64_t dst = (slot[t] * heads + h) * row;
      std::memcpy(kc + dst, kp + (t * k.stride(0) + h * k.stride(1)) * size, row);
      std::memcpy(vc + dst, vp + (t * v.stride(0) + h * v.stride(1)) * size, row);
    }
  });
}

// [rows, 2 * I] (gate | up) -> [rows, I]: round(silu(gate)) * up, rounded, as F.silu(gate) * up.
at::Tensor silu_and_mul(const at::Tensor& x) {
  check_rows(x, "x");
  const int64_t rows = x.size(0), I = x.size(1) / 2;
  TORCH_CHECK(I % kLanes == 0, "x: width / 2 must be a multiple of ", kLanes);
  at::Tensor out = at::empty({rows, I}, x.options());
  dispatch(x.scalar_type(), "silu_and_mul", [&](auto t) {
    using T = decltype(t);
    const T* src = x.const_data_ptr<T>();
    T* dst = out.data_ptr<T>();
    const int64_t stride = x.stride(0);
    for_rows(rows, I, [&](int64_t r) {
      const T* gate = src + r * stride;
      const T* up = gate + I;
      for (int64_t i = 0; i < I; i += kLanes) {
        const VecF g = vload(gate + i);
        const VecF silu = vsilu(g);
        vstore_as(dst + r * I + i, vmul(vround_to<T>(silu), vload(up + i)));
      }
    });
  });
  return out;
}


// The index of each row's largest value, as torch.argmax: the first of equal maxima, a NaN counts as the
// largest. Greedy sampling over a [rows, vocab] of logits in their own dtype (bf16 from the LM head: no
// float32 copy first, the argmax of the converted values being the same index): torch's argmax took
// 300 us for 32 x 32000 float32 (and its bf16 one 1.7 ms), this one pass ~10x less.
// Vectors find each block's maximum; only the block holding the row's first maximum is scanned for it.
template <typename T>
int64_t argmax_row(const T* x, int64_t n) {
  constexpr int64_t kBlock = 16 * kLanes;
  const int64_t vec_end = n / kBlock * kBlock;
  float best = -INFINITY;
  int64_t best_block = -1;
  // NaN once a NaN was seen: such rows take the exact scalar path. Infinities stay on the vector path
  // (-inf is what every ban writes: a grammar's mask bans most of the vocabulary).
  VecF poison = vzero();
  for (int64_t b = 0; b < vec_end; b += kBlock) {
    VecF m = vset1(-INFINITY);
    for (int64_t i = 0; i < kBlock; i += kLanes) {
      const VecF v = vload(x + b + i);
      m = vmax(m, v);
      poison = vadd(poison, vnan_only(v));
    }
    const float block_max = vhmax(m);
    if (block_max > best) best = block_max, best_block = b;
  }
  const float sum = vsum(poison);
  int64_t begin = 0, end = n;
  if (sum == sum) {  // no NaN: the first maximum is in best_block, or in the tail
    int64_t found = -1;
    if (best_block >= 0)
      for (int64_t i = best_block; i < best_block + kBlock; ++i)
        if (static_cast<float>(x[i]) == best) {
          found = i;
          break;
        }
    begin = vec_end;
    for (int64_t i = vec_end; i < n; ++i) {
      const float v = static_cast<float>(x[i]);
      if (v != v) return i;
      if (v > best) best = v, found = i;
    }
    if (found >= 0) return found;
    begin = 0;  // no vector block (a short row) and an all -inf tail: the scalar pass decides
  }
  int64_t arg = begin;
  float top = static_cast<float>(x[begin]);
  for (int64_t i = begin; i < end; ++i) {
    const float v = static_cast<float>(x[i]);
    if (v != v) return i;
    if (v > top) top = v, arg = i;
  }
  return arg;
}

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) > 0, "x: [rows, width > 0], last dim contiguous");
  at::Tensor out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  int64_t* dst = out.data_ptr<int64_t>();
  dispatch(x.scalar_type(), "argmax_rows", [&](auto t) {
    using T = decltype(t);
    const T* src = x.const_data_ptr<T>();
    const int64_t stride = x.stride(0), n = x.size(1);
    for_rows(x.size(0), n, [&](int64_t r) { dst[r] = argmax_row<T>(src + r * stride, n); });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(infer_kernels, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("rotary(Tensor positions, Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("write_cache(Tensor k, Tensor v, Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor slots) -> ()");
}

TORCH_LIBRARY_IMPL(infer_kernels, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rotary", &rotary);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("write_cache", &write_cache);
}
