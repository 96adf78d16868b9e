// y = x @ W^T + bias for bf16 weights and few rows of x (decode steps): the small linears of a small
// model, where oneDNN's fixed cost per call, not the weight's bytes, sets the time.
//
// A llama-50m layer's four linears (0.5-2.8 MB of weights each) took 22-57 us per call through oneDNN's
// prepacked path at one row, 1.2-1.8x more than here, and still 1.06-1.2x more at 32 rows (AMD EPYC
// Zen 5, 2 threads, weights streamed from DRAM as in a real step). For weights of tens of MB (an LM
// head, a 1B model's layers) both read at the same speed there, so without AMX infer/layers/linear.py
// sends only weights of up to SMALL_WEIGHT_BYTES here, and steps of more than SMALL_ROWS rows (prefill)
// to oneDNN's GEMM.
//
// With AMX (Sapphire Rapids and later), 2+ rows go to the tiles (run_amx below), which beat oneDNN's
// prepacked path at every row count measured on a Sapphire Rapids, weights from DRAM
// (docs/optimizations.md, "The small-batch linear"; `bench_layer_ops.py --switch tiles`).
// Only 2048-row prefills of small-K weights stay faster in oneDNN (3072x512: 2.4-2.6 vs 2.9-3.4 ms;
// writing the 12.6 MB output is a third of the time), which is why weights of up to 8 MiB keep oneDNN's
// copy for steps over SMALL_ROWS.
//
// small_linear_silu: a gate_up projection with SiLU-and-multiply in the tiles' epilogue (its weight's
// rows interleaved by 16: gate, up, gate, ...), so a SiLU MLP never writes its [rows, 2I] product.
//
// Layout (packed once, infer/layers/linear.py): [N / 16][K / 2][16 channels][2 inputs] bf16, oneDNN's
// for vdpbf16ps. A vector of 32 weights is 16 output channels x one input pair, x enters as one broadcast
// pair, and the 16 float32 lanes of an accumulator are 16 output channels: no horizontal sums. Threads
// (torch's OpenMP pool) take tiles of output channels.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>

#include "amx.h"
#include "vec.h"

namespace {

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)

constexpr int64_t kBlock = 16;     // output channels per block: one float32 vector
constexpr int64_t kPrefetch = 16;  // input pairs ahead (1 KB of each block's stream)
constexpr int64_t kChunkRows = 8;
constexpr int64_t kAmxMinRows = 1;  // one row on vdpbf16ps; 2+ on tiles, ~as fast as 1 row up to 8

struct Problem {
  const c10::BFloat16* x;
  const c10::BFloat16* w;
  const c10::BFloat16* bias;
  c10::BFloat16* y;
  int64_t M, N, K;
};

// rows m0..m0+ROWS of x times blocks b0..b0+NB of the weight
template <int ROWS, int NB>
void tile(const Problem& P, int64_t b0, int64_t m0) {
  __m512 acc[ROWS][NB];
  for (auto& row : acc)
    for (auto& a : row) a = _mm512_setzero_ps();
  const int64_t pairs = P.K / 2;
  const c10::BFloat16* w[NB];
  for (int b = 0; b < NB; ++b) w[b] = P.w + (b0 + b) * pairs * 32;
  const int32_t* x[ROWS];
  for (int r = 0; r < ROWS; ++r) x[r] = reinterpret_cast<const int32_t*>(P.x + (m0 + r) * P.K);
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh wv[NB];
    for (int b = 0; b < NB; ++b) {
      _mm_prefetch(reinterpret_cast<const char*>(w[b] + (p + kPrefetch) * 32), _MM_HINT_T0);
      wv[b] = (__m512bh)_mm512_loadu_si512(w[b] + p * 32);
    }
    for (int r = 0; r < ROWS; ++r) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(x[r][p]);
      for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], xv, wv[b]);
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int b = 0; b < NB; ++b) {
      const int64_t n = (b0 + b) * kBlock;
      __m512 v = acc[r][b];
      if (P.bias) v = _mm512_add_ps(v, infer_vec::vload(P.bias + n));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(P.y + (m0 + r) * P.N + n), (__m256i)_mm512_cvtneps_pbh(v));
    }
}

template <int NB>
void tile_rows(const Problem& P, int64_t b0, int64_t m0, int64_t rows) {
  switch (rows) {
    case 1: return tile<1, NB>(P, b0, m0);
    case 2: return tile<2, NB>(P, b0, m0);
    case 3: return tile<3, NB>(P, b0, m0);
    case 4: return tile<4, NB>(P, b0, m0);
  }
  if constexpr (NB <= 2) {  // 16 accumulators at most: no spills
    switch (rows) {
      case 5: return tile<5, NB>(P, b0, m0);
      case 6: return tile<6, NB>(P, b0, m0);
      case 7: return tile<7, NB>(P, b0, m0);
      default: return tile<8, NB>(P, b0, m0);
    }
  }
}

// Up to 4 rows: tiles of 4 blocks, one pass. More: tiles of 2 blocks, rows in chunks of 8, the tile's
// weights (2 x 16 channels x K: 64 KB at K = 1024) read from DRAM by the first chunk, from L2 after.
void run(const Problem& P) {
  const int64_t nb_max = P.M <= 4 ? 4 : 2, blocks = P.N / kBlock, tiles = (blocks + nb_max - 1) / nb_max;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b0 = t * nb_max, nb = std::min(nb_max, blocks - b0);
      for (int64_t m0 = 0; m0 < P.M; m0 += kChunkRows) {
        const int64_t rows = std::min(nb_max == 4 ? P.M : kChunkRows, P.M - m0);
        switch (nb) {
          case 1: tile_rows<1>(P, b0, m0, rows); break;
          case 2: tile_rows<2>(P, b0, m0, rows); break;
          case 3: tile_rows<3>(P, b0, m0, rows); break;
          default: tile_rows<4>(P, b0, m0, rows); break;
        }
      }
    }
  });
}

// SiLU-and-multiply of 16 output channels from their float32 gate and up sums (+ bias), rounded where
// the unfused path rounds (layer_ops.cpp silu_and_mul after a bf16 gate_up): the same bits.
inline void silu_mul_16(const float* gate, const float* up, const c10::BFloat16* bias, c10::BFloat16* dst) {
  using namespace infer_vec;
  VecF g = vload(gate), u = vload(up);
  if (bias) {
    g = vadd(g, vload(bias));
    u = vadd(u, vload(bias + 16));
  }
  g = vround_to<c10::BFloat16>(g);
  u = vround_to<c10::BFloat16>(u);
  const VecF silu = vsilu(g);
  vstore_as(dst, vmul(vround_to<c10::BFloat16>(silu), u));
}

#if defined(INFER_AMX)
// AMX tiles (Sapphire Rapids): the same layout read 16 input pairs at a time as a B tile (16 rows of 16
// channels x 2 inputs: 1 KB, contiguous), x as A tiles of 16 rows x 32 inputs, products in 16 x 16 float32
// C tiles. Tiles 0-3: C (two row blocks x two channel blocks), 4-5: A, 6-7: B. Each pass of up to 32 rows
// reads the weights once, so up to 32 rows cost what one does when the weights come from DRAM.
constexpr int64_t kAmxRows = 32;

// Rows m0..m0+rows (up to 32) of x times channel blocks 2bp, 2bp+1, left in C tiles 0-3; the caller
// has loaded the rows' `rows_config`.
inline void amx_products(const Problem& P, int64_t m0, int64_t bp, bool two) {
  const int64_t pairs = P.K / 2, x_stride = P.K * 2;
  const c10::BFloat16* x0 = P.x + m0 * P.K;
  const c10::BFloat16* x1 = x0 + 16 * P.K;
  const c10::BFloat16* w0 = P.w + 2 * bp * pairs * 32;
  const c10::BFloat16* w1 = w0 + pairs * 32;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t k = 0; k < P.K; k += 32) {
    _tile_loadd(6, w0 + k * 16, 64);
    _tile_loadd(7, w1 + k * 16, 64);
    _tile_loadd(4, x0 + k, x_stride);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (two) {
      _tile_loadd(5, x1 + k, x_stride);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
}

inline void amx_store(float (*c)[32], bool two) {
  _tile_stored(0, &c[0][0], 128);
  _tile_stored(1, &c[0][16], 128);
  if (two) {
    _tile_stored(2, &c[16][0], 128);
    _tile_stored(3, &c[16][16], 128);
  }
}

// A pass's float32 results (`amx_store`) -> its bf16 outputs (+ bias; gated: SiLU-and-multiply)
template <bool kGated>
inline void amx_finish(const Problem& P, const float (*c)[32], int64_t m0, int64_t bp, int64_t rows) {
  const int64_t n = bp * 32;
  for (int64_t r = 0; r < rows; ++r) {
    if constexpr (kGated) {  // the pair is 16 gate channels and their 16 up channels
      silu_mul_16(&c[r][0], &c[r][16], P.bias ? P.bias + n : nullptr, P.y + (m0 + r) * (P.N / 2) + bp * 16);
      continue;
    }
    for (int h = 0; h < 2; ++h) {
      __m512 v = _mm512_load_ps(&c[r][h * 16]);
      if (P.bias) v = _mm512_add_ps(v, infer_vec::vload(P.bias + n + h * 16));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(P.y + (m0 + r) * P.N + n + h * 16),
                          (__m256i)_mm512_cvtneps_pbh(v));
    }
  }
}

// A thread's passes, software-pipelined: the vector epilogue of one pass (`amx_finish`) is issued after
// the next pass's tile products, so the out-of-order core runs it while the tiles compute, instead of
// after them. Two buffers: a pass stores its results while the one before is still being finished.
template <bool kGated>
class AmxPipeline {
 public:
  explicit AmxPipeline(const Problem& P) : P_(P) {}
  void pass(int64_t m0, int64_t bp, int64_t rows) {
    const bool two = rows > 16;
    amx_products(P_, m0, bp, two);
    finish_pending();
    amx_store(buf_[cur_], two);
    pending_ = {m0, bp, rows};
    cur_ ^= 1;
  }
  void finish_pending() {  // the pending pass is in the buffer `pass` stored last
    if (pending_.rows > 0) amx_finish<kGated>(P_, buf_[cur_ ^ 1], pending_.m0, pending_.bp, pending_.rows);
    pending_.rows = 0;
  }

 private:
  struct Pending {
    int64_t m0 = 0, bp = 0, rows = 0;  // rows 0: none
  };
  const Problem& P_;
  alignas(64) float buf_[2][32][32];
  Pending pending_;
  int cur_ = 0;  // the buffer the next pass stores into
};

// Rows in blocks whose x stays in L2 (kAmxBlockBytes); per block, threads take ranges of 32-channel
// pairs of blocks, and for each pair every pass of 32 rows, so the pair's weights (32 x K) come from
// DRAM once per block and from L1/L2 for its other passes. Decode steps are one block: one weight read.
constexpr int64_t kAmxBlockBytes = 1 << 20;

template <bool kGated>
void run_amx(const Problem& P) {
  const int64_t block_rows = std::max<int64_t>(kAmxRows, kAmxBlockBytes / (2 * P.K) / kAmxRows * kAmxRows);
  for (int64_t b0 = 0; b0 < P.M; b0 += block_rows) {
    const int64_t rows = std::min(block_rows, P.M - b0);
    at::parallel_for(0, P.N / 32, 1, [&](int64_t begin, int64_t end) {
      const int64_t tail = rows % kAmxRows, full = rows - tail;
      const infer_amx::TileConfig full_cfg = infer_amx::rows_config(kAmxRows), tail_cfg = infer_amx::rows_config(tail);
      const bool both = full > 0 && tail > 0;  // else one configuration serves the whole range
      AmxPipeline<kGated> pipe(P);  // a pending pass's results are in memory: a new configuration keeps them
      _tile_loadconfig(full > 0 ? &full_cfg : &tail_cfg);
      for (int64_t bp = begin; bp < end; ++bp) {
        if (both) _tile_loadconfig(&full_cfg);
        for (int64_t m0 = b0; m0 < b0 + full; m0 += kAmxRows) pipe.pass(m0, bp, kAmxRows);
        if (both) _tile_loadconfig(&tail_cfg);
        if (tail > 0) pipe.pass(b0 + full, bp, tail);
      }
      pipe.finish_pending();
      _tile_release();
    });
  }
}
#endif

#endif

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
// What both ops take: x [M, K], the weight [N, K] in the kernel's layout, N a multiple of `channels`
void check_args(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                int64_t channels) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16, "x: contiguous bf16 [M, K]");
  const int64_t K = x.size(1), N = weight.size(0);
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.scalar_type() == at::kBFloat16 &&
                  weight.size(1) == K,
              "weight: contiguous bf16 [N, K] (in the kernel's layout)");
  TORCH_CHECK(N % channels == 0 && K % 2 == 0, "N: a multiple of ", channels, "; K: even");
  TORCH_CHECK(!bias || (bias->is_contiguous() && bias->scalar_type() == at::kBFloat16 && bias->numel() == N),
              "bias: contiguous bf16 [N]");
}
#endif

at::Tensor small_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
  check_args(x, weight, bias, kBlock);
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  const Problem P{x.const_data_ptr<c10::BFloat16>(), weight.const_data_ptr<c10::BFloat16>(),
                  bias ? bias->const_data_ptr<c10::BFloat16>() : nullptr, y.data_ptr<c10::BFloat16>(), M, N, K};
  if (M == 0) return y;
#if defined(INFER_AMX)
  if (M > kAmxMinRows && N % 32 == 0 && K % 32 == 0 && infer_amx::permitted()) {
    run_amx<false>(P);
    return y;
  }
#endif
  run(P);
  return y;
#else
  TORCH_CHECK(false, "small_linear needs AVX-512 BF16; this build has ", infer_vec::kIsa);
#endif
}

// The gate_up projection and SiLU-and-multiply in one pass: `weight` is a gate_up weight whose rows
// alternate 16 gate channels and the same 16 up channels (infer/layers/linear.py `interleave_gate_up`),
// packed as for small_linear; out[m, i] = round(silu(round(gate_i))) * round(up_i), rounded, as
// silu_and_mul(small_linear(...)) of the plain weight. On tiles the epilogue applies it to each 32 x 32
// result, so the [M, 2I] gate_up output (12 MB for a 2048-token llama-50m step) is never written and
// read back; up to 6 rows (vdpbf16ps) through a small buffer.
at::Tensor small_linear_silu(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
  check_args(x, weight, bias, 32);  // weight: interleaved gate | up
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  at::Tensor y = at::empty({M, N / 2}, x.options());
  if (M == 0) return y;
  const c10::BFloat16* b = bias ? bias->const_data_ptr<c10::BFloat16>() : nullptr;
#if defined(INFER_AMX)
  if (M > kAmxMinRows && K % 32 == 0 && infer_amx::permitted()) {
    run_amx<true>(Problem{x.const_data_ptr<c10::BFloat16>(), weight.const_data_ptr<c10::BFloat16>(), b,
                          y.data_ptr<c10::BFloat16>(), M, N, K});
    return y;
  }
#endif
  at::Tensor both = at::empty({M, N}, x.options());  // few rows: the plain kernel, then the epilogue
  run(Problem{x.const_data_ptr<c10::BFloat16>(), weight.const_data_ptr<c10::BFloat16>(), b,
              both.data_ptr<c10::BFloat16>(), M, N, K});
  const c10::BFloat16* src = both.const_data_ptr<c10::BFloat16>();
  c10::BFloat16* dst = y.data_ptr<c10::BFloat16>();
  alignas(64) float gate[16], up[16];
  for (int64_t m = 0; m < M; ++m)
    for (int64_t bp = 0; bp < N / 32; ++bp) {
      const c10::BFloat16* row = src + m * N + bp * 32;
      for (int i = 0; i < 16; ++i) gate[i] = row[i], up[i] = row[16 + i];
      silu_mul_16(gate, up, nullptr, dst + m * (N / 2) + bp * 16);
    }
  return y;
#else
  TORCH_CHECK(false, "small_linear_silu needs AVX-512 BF16; this build has ", infer_vec::kIsa);
#endif
}

// oneDNN's prepacked linear (torch's mkldnn::_linear_pointwise, no post-op), the path of larger weights
// and longer steps, under a schema TorchScript can record: torch's own takes a Scalar?[] argument that
// the TorchScript tracer rejects, which left a decode graph holding one (the LM head without AMX) to be
// replayed in Python (infer/runner/decode_graph.py).
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed_weight, const std::optional<at::Tensor>& bias) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, packed_weight, bias, std::string("none"), c10::List<std::optional<c10::Scalar>>(),
                          std::string("")};
  op.callBoxed(&stack);
  return stack.back().toTensor();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(infer_kernels, m) {
  m.def("small_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("small_linear_silu(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("onednn_linear(Tensor x, Tensor packed_weight, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(infer_kernels, CPU, m) {
  m.impl("small_linear", &small_linear);
  m.impl("small_linear_silu", &small_linear_silu);
  m.impl("onednn_linear", &onednn_linear);
}

TORCH_LIBRARY_IMPL(infer_kernels, MkldnnCPU, m) {  // the dispatch key of the opaque packed weight
  m.impl("onednn_linear", &onednn_linear);
}
