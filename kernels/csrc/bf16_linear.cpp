// y = x W^T (+ b) with W stored in bf16, products and sums in fp32: the avx2 family, and the entry
// points of both families (bf16_linear_avx512bf16.cpp has the avx512_bf16 kernel).
//
// A CPU without bf16 dot-product instructions (AVX2, or AVX-512 without avx512_bf16) still gains
// from bf16 weights where a product is bound by memory: a decode step reads every weight once, and
// bf16 halves those bytes. Widening a bf16 to fp32 is a 16-bit shift, so the kernel reads bf16 and
// multiplies in fp32 (FMA); the result is what torch's bf16 linear gives (fp32 accumulation, one
// rounding of the output to the caller's dtype).
//
// Layout: W [N, K] is packed once, at load, into blocks of 16 output features, k-major inside a
// block ([N/16][K][16]), so one 32-byte load gives the 16 weights of one k for the block's outputs;
// the tail block is zero-padded; inside a block the 16 are in the order column_of undoes. A block is computed for up to 6 rows of x at a time (12 fp32
// accumulators), and blocks are shared out over the threads.
#include "bf16_linear.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define STAGEMESH_BF16_AVX2 1
#endif

namespace {

constexpr int64_t kBlock = 16;  // output features per packed block
constexpr int kMaxRows = 6;     // rows of x per register tile

// Where the packed position p of a block's 16 weights puts output column column_of(p): the order that
// interleaving zeros into the low and high words of each 128-bit lane (unpacklo / unpackhi, one
// in-lane instruction each, which is all widening bf16 to fp32 takes) turns into columns 0-7 and 8-15.
constexpr int column_of(int p) { return ((p % 8) / 4) * 8 + (p / 8) * 4 + p % 4; }

// acc[MR][16] = sum_k x[m, k] * w[k][0..15], w one packed block.
template <int MR>
void tile(const float* x, int64_t ldx, const uint16_t* w, int64_t K, float* acc) {
#ifdef STAGEMESH_BF16_AVX2
  // 16 ymm registers: MR x 2 accumulators, 2 widened weights, 1 broadcast. Up to 2 rows, a second set
  // of accumulators over odd k hides the FMA's latency (one row alone would wait on it at every k);
  // from 3 rows the rows themselves are independent chains.
  constexpr int S = MR <= 2 ? 2 : 1;
  __m256 a[S][MR][2];
  #pragma GCC unroll 8
  for (int s = 0; s < S; ++s)
    #pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) a[s][m][0] = a[s][m][1] = _mm256_setzero_ps();
  const __m256i zero = _mm256_setzero_si256();
  int64_t k = 0;
  for (; k + S <= K; k += S) {
    #pragma GCC unroll 8
    for (int s = 0; s < S; ++s) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (k + s) * kBlock));
      const __m256 w0 = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, wv));
      const __m256 w1 = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, wv));
      #pragma GCC unroll 8
      for (int m = 0; m < MR; ++m) {
        const __m256 xv = _mm256_broadcast_ss(x + m * ldx + k + s);
        a[s][m][0] = _mm256_fmadd_ps(xv, w0, a[s][m][0]);
        a[s][m][1] = _mm256_fmadd_ps(xv, w1, a[s][m][1]);
      }
    }
  }
  for (; k < K; ++k) {
    const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k * kBlock));
    const __m256 w0 = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, wv));
    const __m256 w1 = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, wv));
    #pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const __m256 xv = _mm256_broadcast_ss(x + m * ldx + k);
      a[0][m][0] = _mm256_fmadd_ps(xv, w0, a[0][m][0]);
      a[0][m][1] = _mm256_fmadd_ps(xv, w1, a[0][m][1]);
    }
  }
  #pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
    __m256 lo = a[0][m][0], hi = a[0][m][1];
    #pragma GCC unroll 8
    for (int s = 1; s < S; ++s) lo = _mm256_add_ps(lo, a[s][m][0]), hi = _mm256_add_ps(hi, a[s][m][1]);
    _mm256_storeu_ps(acc + m * kBlock, lo);
    _mm256_storeu_ps(acc + m * kBlock + 8, hi);
  }
#else
  for (int m = 0; m < MR; ++m) {
    float* a = acc + m * kBlock;
    std::fill(a, a + kBlock, 0.f);
    for (int64_t k = 0; k < K; ++k) {
      const float xv = x[m * ldx + k];
      for (int p = 0; p < kBlock; ++p)
        a[column_of(p)] += xv * static_cast<float>(c10::BFloat16(w[k * kBlock + p], c10::BFloat16::from_bits()));
    }
  }
#endif
}

using TileFn = void (*)(const float*, int64_t, const uint16_t*, int64_t, float*);
constexpr TileFn kTiles[kMaxRows + 1] = {nullptr, tile<1>, tile<2>, tile<3>, tile<4>, tile<5>, tile<6>};

void run_avx2(const Bf16Problem& P) {
  const int64_t K = P.K;
  const float* xp = static_cast<const float*>(P.x);
  // A thread takes whole blocks; below ~64K multiply-adds of work the caller's thread does it alone.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(K * kBlock * P.M, 1));
  at::parallel_for(0, P.blocks, grain, [&](int64_t b0, int64_t b1) {
    float acc[kMaxRows * kBlock];
    for (int64_t b = b0; b < b1; ++b) {
      const uint16_t* w = P.w + b * K * kBlock;
      for (int64_t m0 = 0; m0 < P.M; m0 += kMaxRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, P.M - m0));
        kTiles[rows](xp + m0 * K, K, w, K, acc);
        for (int r = 0; r < rows; ++r) store_block(P, m0 + r, b * kBlock, acc + r * kBlock);
      }
    }
  });
}

}  // namespace

#ifdef STAGEMESH_BF16_AVX2
// 8 fp32 (+ bias) to bf16 as c10::BFloat16 rounds them: to nearest even, a NaN to 0x7FC0.
inline __m128i round_to_bf16(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i bias = _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1)),
                                        _mm256_set1_epi32(0x7FFF));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(bits, bias), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  const __m256i packed = _mm256_packus_epi32(r, r);  // [0..3 0..3 | 4..7 4..7] per 128-bit lane
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}
#endif

void store_block(const Bf16Problem& P, int64_t row, int64_t n0, const float* a) {
  const int64_t width = std::min<int64_t>(kBlock, P.N - n0), at = row * P.N + n0;
  const float* b = P.bias ? P.bias + n0 : nullptr;
#ifdef STAGEMESH_BF16_AVX2
  if (width == kBlock) {  // a whole block: 8 columns at a time (a large output's stores were a tenth of the time)
    for (int64_t j = 0; j < kBlock; j += 8) {
      __m256 v = _mm256_loadu_ps(a + j);
      if (b) v = _mm256_add_ps(v, _mm256_loadu_ps(b + j));
      if (P.out_bf16)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(reinterpret_cast<uint16_t*>(P.out) + at + j), round_to_bf16(v));
      else
        _mm256_storeu_ps(reinterpret_cast<float*>(P.out) + at + j, v);
    }
    return;
  }
#endif
  if (P.out_bf16) {
    at::BFloat16* o = reinterpret_cast<at::BFloat16*>(P.out) + at;  // rounds to nearest even
    for (int64_t j = 0; j < width; ++j) o[j] = static_cast<at::BFloat16>(a[j] + (b ? b[j] : 0.f));
  } else {
    float* o = reinterpret_cast<float*>(P.out) + at;
    for (int64_t j = 0; j < width; ++j) o[j] = a[j] + (b ? b[j] : 0.f);
  }
}

bool bf16_avx512_available() { return bf16_avx512::available(); }

at::Tensor pack_bf16_weight(const at::Tensor& weight, const std::string& family) {
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2, "the weight must be a 2-D CPU tensor");
  TORCH_CHECK(family == "avx2" || family == "avx512_bf16", "no bf16 linear kernels for the family ", family,
              " (avx2, avx512_bf16)");
  if (family == "avx512_bf16") return bf16_avx512::pack(weight);
  const at::Tensor w = weight.to(at::kBFloat16).contiguous();
  const int64_t N = w.size(0), K = w.size(1), blocks = (N + kBlock - 1) / kBlock;
  at::Tensor packed = at::zeros({blocks, K, kBlock}, w.options());
  int position_of[kBlock];
  for (int p = 0; p < kBlock; ++p) position_of[column_of(p)] = p;
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(packed.data_ptr<at::BFloat16>());
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t j = 0; j < kBlock && b * kBlock + j < N; ++j)
        for (int64_t k = 0; k < K; ++k) dst[(b * K + k) * kBlock + position_of[j]] = src[(b * kBlock + j) * K + k];
  });
  return packed;
}

at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                       const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "linear_bf16 runs on CPU tensors");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x must be float32 or bfloat16");
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 3 &&
                  (packed.size(2) == kBlock || packed.size(2) == 2 * kBlock) && packed.is_contiguous(),
              "the weight must be packed by pack_bf16_weight");
  const bool pairs = packed.size(2) == 2 * kBlock;  // the avx512_bf16 layout
  TORCH_CHECK(!pairs || bf16_avx512::available(), "the weight is packed for avx512_bf16, which this CPU lacks");
  const int64_t K = x.size(-1), blocks = packed.size(0), N = out_features;
  TORCH_CHECK(N > 0 && (N + kBlock - 1) / kBlock == blocks, "out_features ", N, " does not match the packed weight");
  TORCH_CHECK(pairs ? (K + 1) / 2 == packed.size(1) : K == packed.size(1), "x has ", K, " features, the weight ",
              pairs ? 2 * packed.size(1) : packed.size(1));
  at::Tensor xc = x.reshape({-1, K});
  const int64_t M = xc.size(0);
  if (pairs) {  // bf16 rows, K padded to even
    xc = xc.to(at::kBFloat16);
    if (K % 2) xc = at::constant_pad_nd(xc, {0, 1});
  } else {
    xc = xc.to(at::kFloat);  // [M, K] is small next to W
  }
  xc = xc.contiguous();
  at::Tensor bf;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == N, "bias has ", bias->numel(), " elements for ", N, " outputs");
    bf = bias->to(at::kFloat).contiguous();
  }
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = N;
  at::Tensor out = at::empty(out_shape, x.options());
  if (M == 0) return out;
  const Bf16Problem P{xc.data_ptr(), M, xc.size(1), reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()),
                      blocks, N, bf.defined() ? bf.data_ptr<float>() : nullptr, x.scalar_type() == at::kBFloat16,
                      static_cast<char*>(out.data_ptr())};
  pairs ? bf16_avx512::run(P) : run_avx2(P);
  return out;
}
