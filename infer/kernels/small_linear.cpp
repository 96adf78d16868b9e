// y = x @ W^T + bias for bf16 weights and few rows of x (decode steps): the small linears of a small
// model, where oneDNN's fixed cost per call, not the weight's bytes, sets the time.
//
// A llama-50m layer's four linears (0.5-2.8 MB of weights each) took 22-57 us per call through oneDNN's
// prepacked path at one row, 1.2-1.8x more than here, and still 1.06-1.2x more at 32 rows (AMD EPYC
// Zen 5, 2 threads, weights streamed from DRAM as in a real step). For weights of tens of MB (an LM
// head, a 1B model's layers) both read at the same speed, so infer/layers/linear.py sends only weights
// of up to SMALL_WEIGHT_BYTES here, and steps of more than SMALL_ROWS rows (prefill) to oneDNN's GEMM.
//
// Layout (packed once, infer/layers/linear.py): [N / 16][K / 2][16 channels][2 inputs] bf16, oneDNN's
// for vdpbf16ps. A vector of 32 weights is 16 output channels x one input pair, x enters as one broadcast
// pair, and the 16 float32 lanes of an accumulator are 16 output channels: no horizontal sums. Threads
// (torch's OpenMP pool) take tiles of output channels.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>

#include "vec.h"

namespace {

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)

constexpr int64_t kBlock = 16;     // output channels per block: one float32 vector
constexpr int64_t kPrefetch = 16;  // input pairs ahead (1 KB of each block's stream)
constexpr int64_t kChunkRows = 8;

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

#endif

at::Tensor small_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16, "x: contiguous bf16 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.scalar_type() == at::kBFloat16 &&
                  weight.size(1) == K,
              "weight: contiguous bf16 [N, K] (in the kernel's layout)");
  TORCH_CHECK(N % kBlock == 0 && K % 2 == 0, "N: a multiple of 16; K: even");
  TORCH_CHECK(!bias || (bias->is_contiguous() && bias->scalar_type() == at::kBFloat16 && bias->numel() == N),
              "bias: contiguous bf16 [N]");
  at::Tensor y = at::empty({M, N}, x.options());
  const Problem P{x.const_data_ptr<c10::BFloat16>(), weight.const_data_ptr<c10::BFloat16>(),
                  bias ? bias->const_data_ptr<c10::BFloat16>() : nullptr, y.data_ptr<c10::BFloat16>(), M, N, K};
  if (M > 0) run(P);
  return y;
#else
  TORCH_CHECK(false, "small_linear needs AVX-512 BF16; this build has ", infer_vec::kIsa);
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(infer_kernels, m) {
  m.def("small_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor", &small_linear);
}
