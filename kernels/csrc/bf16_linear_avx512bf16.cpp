// The avx512_bf16 family of linear_bf16 (bf16_linear.cpp has the avx2 one): y = x W^T (+ b) with
// vdpbf16ps, which multiplies two bf16 pairs per fp32 lane and adds both products to the lane: 32
// bf16 products per instruction where the avx2 kernel widens each weight and does 8 fp32 FMAs.
// x is taken in bf16 (fp32 x is rounded to bf16 first, as torch's bf16 linear takes it); sums in fp32.
//
// Layout: W [N, K] packed once, at load, into blocks of 16 output features with k in pairs
// ([N/16][K/2][16][2], K padded to even and the tail block to 16 with zeros), so one 64-byte load is
// the 16 outputs' weights for two k, the operand vdpbf16ps takes. A register tile is up to 4 rows of x
// by 4 blocks (64 outputs, 16 accumulators); tiles are shared out over the threads in blocks of 4.
//
// Compiled with the avx512_bf16 target for its functions alone (the rest of the module keeps the build's
// level); it runs only where the CPU has the instructions (available()).
#include "bf16_linear.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11
#include <immintrin.h>
#define STAGEMESH_AVX512BF16 1
#endif

namespace bf16_avx512 {

constexpr int64_t kBlock = 16;  // output features per packed block
constexpr int kMR = 4;          // rows of x per register tile
constexpr int kNB = 4;          // blocks per register tile

bool available() {
#ifdef STAGEMESH_AVX512BF16
  return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl");
#else
  return false;
#endif
}

at::Tensor pack(const at::Tensor& weight) {
  TORCH_CHECK(available(), "this CPU has no avx512_bf16 instructions (or this build cannot emit them)");
  const at::Tensor w = weight.to(at::kBFloat16).contiguous();
  const int64_t N = w.size(0), K = w.size(1), pairs = (K + 1) / 2, blocks = (N + kBlock - 1) / kBlock;
  at::Tensor packed = at::zeros({blocks, pairs, 2 * kBlock}, w.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(packed.data_ptr<at::BFloat16>());
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t j = 0; j < kBlock && b * kBlock + j < N; ++j)
        for (int64_t k = 0; k < K; ++k) dst[(b * pairs + k / 2) * 2 * kBlock + 2 * j + k % 2] = src[(b * kBlock + j) * K + k];
  });
  return packed;
}

#ifdef STAGEMESH_AVX512BF16
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")

// acc[MR][NB] (16 fp32 each) = sum over k pairs of x[m, pair] . w[block][pair][16][2]. One row alone
// keeps a second set of accumulators over odd pairs, so that the dot products' latency overlaps.
template <int MR, int NB>
void tile(const uint32_t* x, int64_t ldx, const uint16_t* w, int64_t block_stride, int64_t pairs, float* acc) {
  constexpr int S = MR == 1 ? 2 : 1;
  __m512 a[S][MR][NB];
  #pragma GCC unroll 2
  for (int s = 0; s < S; ++s)
    #pragma GCC unroll 4
    for (int m = 0; m < MR; ++m)
      #pragma GCC unroll 4
      for (int b = 0; b < NB; ++b) a[s][m][b] = _mm512_setzero_ps();
  int64_t p = 0;
  const auto step = [&](int s, int64_t q) {
    __m512bh wv[NB];
    #pragma GCC unroll 4
    for (int b = 0; b < NB; ++b) wv[b] = (__m512bh)_mm512_loadu_si512(w + b * block_stride + q * 2 * kBlock);
    #pragma GCC unroll 4
    for (int m = 0; m < MR; ++m) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[m * ldx + q]));
      #pragma GCC unroll 4
      for (int b = 0; b < NB; ++b) a[s][m][b] = _mm512_dpbf16_ps(a[s][m][b], xv, wv[b]);
    }
  };
  for (; p + S <= pairs; p += S) {
    #pragma GCC unroll 2
    for (int s = 0; s < S; ++s) step(s, p + s);
  }
  for (; p < pairs; ++p) step(0, p);
  #pragma GCC unroll 4
  for (int m = 0; m < MR; ++m)
    #pragma GCC unroll 4
    for (int b = 0; b < NB; ++b)
      _mm512_storeu_ps(acc + (m * NB + b) * kBlock, S == 2 ? _mm512_add_ps(a[0][m][b], a[S - 1][m][b]) : a[0][m][b]);
}

using TileFn = void (*)(const uint32_t*, int64_t, const uint16_t*, int64_t, int64_t, float*);
template <int MR>
constexpr TileFn kRow[kNB + 1] = {nullptr, tile<MR, 1>, tile<MR, 2>, tile<MR, 3>, tile<MR, 4>};
constexpr const TileFn* kTiles[kMR + 1] = {nullptr, kRow<1>, kRow<2>, kRow<3>, kRow<4>};

void run(const Bf16Problem& P) {
  const int64_t pairs = P.K / 2, groups = (P.blocks + kNB - 1) / kNB, block_stride = pairs * 2 * kBlock;
  const uint32_t* x = reinterpret_cast<const uint32_t*>(P.x);
  // A thread takes whole groups of 4 blocks; below ~64K products of work the caller's thread does it alone.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(P.K * kBlock * kNB * P.M, 1));
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    float acc[kMR * kNB * kBlock];
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t b0 = g * kNB, nb = std::min<int64_t>(kNB, P.blocks - b0);
      const uint16_t* w = P.w + b0 * block_stride;
      for (int64_t m0 = 0; m0 < P.M; m0 += kMR) {
        const int rows = static_cast<int>(std::min<int64_t>(kMR, P.M - m0));
        kTiles[rows][nb](x + m0 * pairs, pairs, w, block_stride, pairs, acc);
        for (int r = 0; r < rows; ++r)
          for (int64_t b = 0; b < nb; ++b)
            store_block(P, m0 + r, (b0 + b) * kBlock, acc + (r * nb + b) * kBlock);
      }
    }
  });
}

#pragma GCC pop_options
#else
void run(const Bf16Problem&) { TORCH_CHECK(false, "the avx512_bf16 kernels are not in this build"); }
#endif

}  // namespace bf16_avx512
