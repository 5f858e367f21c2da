// y = x W^T (+ b) with W quantised in groups along K (quant_linear.h has the two layouts), AVX2 + FMA.
//
// fp32 activations, the weights dequantised exactly (every product is what the dequantised fp32 model
// computes, up to the order of the sums):
// - few rows of x (decode): a thread takes a range of W's rows and reads their packed bytes once,
//   turning 32 quants at a time into fp32 in registers for up to 4 rows of x; a group's scale multiplies
//   the group's partial sums and the mins meet the group sums of x once per row, since
//   sum_k (d q_k + m) x_k = d sum_k q_k x_k + m sum_k x_k.
// - many rows (prefill, batch 32+): a thread dequantises a tile of W's rows once (fma(q, d, m): the fp32
//   number gguf's dequantiser gives) into a buffer and runs 4x3 register tiles of fp32 dot products over
//   every row of x. Where the CPU has avx512_bf16 (the family of that name), from 12 rows the pair tiles
//   run instead (run_pairs): the quants, exact in bf16, against x split into two bf16 on vdpbf16ps,
//   1.6-1.8x the avx2 tiles where the CPU has full-width 512-bit units (see kPairRows). x given in
//   bf16 (a model served in bf16), from 3 rows: the bf16 model's product, W dequantised to bf16 a tile at a
//   time, its rows in the lanes as the bf16 linear lays them, two columns of K a vdpbf16ps (run_lanes).
// int8 activations (W8A8; llama.cpp's q8 blocks): x quantised per row and block of 32 (whatever the
// weights' group: a per-token scale let one outlier channel of a row blur all the others), 32 products at a
// time on integers with vpmaddubsw + vpmaddwd (avx2) or vpdpbusd (the avx512_vnni family, chosen by the
// caller where the CPU has it), each block's sum times its two scales (x's block, the weights' group).
#include "quant_linear.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define STAGEMESH_QUANT_AVX2 1
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11  // avx512bf16 intrinsics
#define STAGEMESH_QUANT_BF16 1
#endif
#endif

namespace {

constexpr int64_t kChunk = 32;    // weights per decode (one block of GGUF's 32-wide formats)
// The BITS of float8_e4m3fn weights (a byte each, like int8; decoded to fp32 in registers, never integers)
constexpr int kFp8 = 9;
// Bytes of n weights at BITS
constexpr int64_t bytes_of(int bits, int64_t n) { return bits == 4 ? n / 2 : n; }
constexpr int kRows = 4;          // rows of x per register tile of the fused path
constexpr int64_t kFusedRows = 8; // up to this many rows of x the fused path runs; more: the tiled one
constexpr int kMR = 4, kNR = 3;   // the tiled path's register tile: rows of x by rows of W
constexpr int64_t kTileN = 24;    // rows of W a thread dequantises at a time (a multiple of kNR)
constexpr int64_t kTileK = 512;   // and columns (a multiple of kChunk): 48 KB of fp32

// scales and mins are stored in fp32, or in fp16 (the f16 pointers; GGUF's own scales, kept as they are:
// fewer bytes to stream at decode), and read as fp32 a row at a time (RowValues).
struct Weight {
  const uint8_t* qs;
  const float* scales;  // fp32 storage, else nullptr
  const float* mins;    // 4-bit, fp32 storage
  const uint16_t* scales_f16;  // fp16 storage, else nullptr
  const uint16_t* mins_f16;
  bool has_mins;  // 4-bit
  int64_t N, K, G, groups, row_bytes;
};

#ifdef STAGEMESH_QUANT_AVX2

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// sum_i a[i] b[i], 8 lanes at a time (a weight row's mins against x's group sums: a scalar loop of one
// FMA per group was a fifth of a 4-bit row's work at one row of x)
inline float dot(const float* a, const float* b, int64_t n) {
  __m256 v = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) v = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), v);
  float s = hsum(v);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// Row n's scales (d) and mins (m, 4-bit) as fp32: the weight's own where it stores fp32, else its fp16
// ones converted (exactly) into a buffer of this RowValues; one per tile call, loaded once a row.
struct RowValues {
  std::vector<float> buf;
  const float *d = nullptr, *m = nullptr;

  void load(const Weight& W, int64_t n) {
    const int64_t g = W.groups, at = n * g;
    if (!W.scales_f16) {
      d = W.scales + at;
      m = W.has_mins ? W.mins + at : nullptr;
      return;
    }
    buf.resize(2 * g);
    widen(W.scales_f16 + at, buf.data(), g);
    d = buf.data();
    if (W.has_mins) widen(W.mins_f16 + at, buf.data() + g, g);
    m = W.has_mins ? buf.data() + g : nullptr;
  }

  static void widen(const uint16_t* h, float* f, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(f + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
    for (; i < n; ++i) f[i] = _cvtsh_ss(h[i]);
  }
};

// 8 float8_e4m3fn bytes as fp32: each byte's sign, exponent and mantissa moved into an fp16's (e4m3's
// exponent bias is 7, fp16's 15: the fp16 is the value times 2^-8, subnormals included; no e4m3 NaN is a
// weight), widened exactly by vcvtph2ps and multiplied back by 256 (exact).
inline __m256 fp8x8(const uint8_t* q) {
  const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
  const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8),
                                 _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7F)), 7));
  return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.f));
}

// The 32 quants of a chunk as fp32, in k order.
template <int BITS>
inline void decode(const uint8_t* q, __m256 w[4]) {
  if constexpr (BITS == kFp8) {
    for (int i = 0; i < 4; ++i) w[i] = fp8x8(q + 8 * i);
  } else if constexpr (BITS == 4) {
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
    const __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
    w[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    w[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    w[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    w[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
  } else {
    for (int i = 0; i < 4; ++i)
      w[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * i))));
  }
}

// The 32 quants of a chunk as bytes in k order (4-bit: unsigned 0..15; 8-bit: signed).
template <int BITS>
inline __m256i decode_bytes(const uint8_t* q) {
  if constexpr (BITS == 4) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
    const __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(b), _mm_srli_epi16(b, 4), 1);
    return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
  } else {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
  }
}

// out[r * ldo + n] = sum_k x[r, k] w[n, k] for W's rows [n0, n1) and R rows of x (xsum: their group sums).
template <int BITS, int R>
void fused_tile(const Weight& W, const float* x, int64_t ldx, const float* xsum, int64_t n0, int64_t n1,
                float* out, int64_t ldo) {
  const int64_t chunks = W.G / kChunk;
  RowValues rv;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* q = W.qs + n * W.row_bytes;
    rv.load(W, n);
    const float* d = rv.d;
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    int64_t k = 0;
    for (int64_t g = 0; g < W.groups; ++g) {
      __m256 part[R];
      for (int r = 0; r < R; ++r) part[r] = _mm256_setzero_ps();
      for (int64_t c = 0; c < chunks; ++c, k += kChunk, q += bytes_of(BITS, kChunk)) {
        __m256 w[4];
        decode<BITS>(q, w);
        for (int r = 0; r < R; ++r) {
          const float* xr = x + r * ldx + k;
          __m256 t = _mm256_mul_ps(w[0], _mm256_loadu_ps(xr));
          __m256 u = _mm256_mul_ps(w[2], _mm256_loadu_ps(xr + 16));
          t = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xr + 8), t);
          u = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xr + 24), u);
          part[r] = _mm256_add_ps(part[r], _mm256_add_ps(t, u));
        }
      }
      const __m256 dv = _mm256_set1_ps(d[g]);
      for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(part[r], dv, acc[r]);
    }
    for (int r = 0; r < R; ++r) {
      float s = hsum(acc[r]);
      if (W.has_mins) s += dot(rv.m, xsum + r * W.groups, W.groups);
      out[r * ldo + n] = s;
    }
  }
}

// W's rows [n0, n0 + rows), columns [k0, k0 + kc), dequantised into buf [rows][kc].
template <int BITS>
void dequantize_tile(const Weight& W, int64_t n0, int64_t rows, int64_t k0, int64_t kc, float* buf, RowValues& rv) {
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t n = n0 + i;
    const uint8_t* q = W.qs + n * W.row_bytes + bytes_of(BITS, k0);
    float* o = buf + i * kc;
    rv.load(W, n);
    for (int64_t k = 0; k < kc; k += kChunk, q += bytes_of(BITS, kChunk), o += kChunk) {
      const int64_t g = (k0 + k) / W.G;
      const __m256 dv = _mm256_set1_ps(rv.d[g]);
      __m256 w[4];
      decode<BITS>(q, w);
      if constexpr (BITS == 4) {
        const __m256 mv = _mm256_set1_ps(rv.m[g]);
        for (int j = 0; j < 4; ++j) _mm256_storeu_ps(o + 8 * j, _mm256_fmadd_ps(w[j], dv, mv));
      } else {
        for (int j = 0; j < 4; ++j) _mm256_storeu_ps(o + 8 * j, _mm256_mul_ps(w[j], dv));
      }
    }
  }
}

// out[i * ldo + j] (+)= sum_k x[i, k] w[j, k] over kc columns, for MR rows of x and NR rows of w.
template <int MR, int NR>
void dot_tile(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t kc, float* out, int64_t ldo,
              bool accumulate) {
  __m256 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < kc; k += 8) {
    __m256 wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = _mm256_loadu_ps(w + j * ldw + k);
    for (int i = 0; i < MR; ++i) {
      const __m256 xv = _mm256_loadu_ps(x + i * ldx + k);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      const float s = hsum(acc[i][j]);
      out[i * ldo + j] = accumulate ? out[i * ldo + j] + s : s;
    }
}

using DotFn = void (*)(const float*, int64_t, const float*, int64_t, int64_t, float*, int64_t, bool);
constexpr DotFn kDotTiles[kMR + 1][kNR + 1] = {
    {nullptr, nullptr, nullptr, nullptr},
    {nullptr, dot_tile<1, 1>, dot_tile<1, 2>, dot_tile<1, 3>},
    {nullptr, dot_tile<2, 1>, dot_tile<2, 2>, dot_tile<2, 3>},
    {nullptr, dot_tile<3, 1>, dot_tile<3, 2>, dot_tile<3, 3>},
    {nullptr, dot_tile<4, 1>, dot_tile<4, 2>, dot_tile<4, 3>},
};

// int8 activations: R rows of quantised x (q [R][K], scales [R][K / 32] and fp32 group sums [R][groups]).
template <int BITS, int R>
void int8_tile(const Weight& W, const int8_t* xq, const float* xd, const float* xsum, int64_t n0, int64_t n1,
               float* out, int64_t ldo) {
  const int64_t chunks = W.G / kChunk, K = W.K;
  const __m256i ones = _mm256_set1_epi16(1);
  RowValues rv;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* q = W.qs + n * W.row_bytes;
    rv.load(W, n);
    const float* d = rv.d;
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    int64_t k = 0;
    for (int64_t g = 0; g < W.groups; ++g) {
      for (int64_t c = 0; c < chunks; ++c, k += kChunk, q += bytes_of(BITS, kChunk)) {
        const __m256i wb = decode_bytes<BITS>(q);
        for (int r = 0; r < R; ++r) {
          const __m256i xb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * K + k));
          __m256i p;
          if constexpr (BITS == 4) {
            p = _mm256_maddubs_epi16(wb, xb);  // unsigned quants times signed x: pairs fit int16
          } else {  // signed times signed: |x| times w with x's sign (|sum of a pair| <= 2 * 127 * 128)
            p = _mm256_maddubs_epi16(_mm256_sign_epi8(xb, xb), _mm256_sign_epi8(wb, xb));
          }
          const __m256i isum = _mm256_madd_epi16(p, ones);
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(d[g] * xd[(r * K + k) / kChunk]), acc[r]);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      float s = hsum(acc[r]);
      if (W.has_mins) s += dot(rv.m, xsum + r * W.groups, W.groups);
      out[r * ldo + n] = s;
    }
  }
}

// The avx512_vnni family of int8_tile: vpdpbusd multiplies 4 unsigned bytes by 4 signed ones and adds
// the 4 products to a 32-bit lane, one instruction for AVX2's vpmaddubsw + vpmaddwd + vpaddd (256-bit
// wide, the chunk's 32 quants). Compiled for its target alone; runs only where the CPU has VNNI. Its loops
// repeat int8_tile's: a body shared with the avx2 tile would be compiled either without VNNI (no vpdpbusd)
// or with it (AVX-512 encodings in the tile that AVX2 CPUs run).
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni")
template <int BITS, int R>
void int8_tile_vnni(const Weight& W, const int8_t* xq, const float* xd, const float* xsum, int64_t n0, int64_t n1,
                    float* out, int64_t ldo) {
  const int64_t chunks = W.G / kChunk, K = W.K;
  RowValues rv;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* q = W.qs + n * W.row_bytes;
    rv.load(W, n);
    const float* d = rv.d;
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    int64_t k = 0;
    for (int64_t g = 0; g < W.groups; ++g) {
      for (int64_t c = 0; c < chunks; ++c, k += kChunk, q += bytes_of(BITS, kChunk)) {
        const __m256i wb = decode_bytes<BITS>(q);
        for (int r = 0; r < R; ++r) {
          const __m256i xb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * K + k));
          __m256i isum;
          if constexpr (BITS == 4) {
            isum = _mm256_dpbusd_epi32(_mm256_setzero_si256(), wb, xb);  // unsigned quants times signed x
          } else {  // signed times signed: |x| times w with x's sign
            isum = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_sign_epi8(xb, xb), _mm256_sign_epi8(wb, xb));
          }
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(d[g] * xd[(r * K + k) / kChunk]), acc[r]);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      float s = hsum(acc[r]);
      if (W.has_mins) s += dot(rv.m, xsum + r * W.groups, W.groups);
      out[r * ldo + n] = s;
    }
  }
}
#pragma GCC pop_options

// The avx512 family of fused_tile: a chunk's 32 quants become two 16-lane fp32 vectors (half the
// converts, multiplies and adds of the 8-lane tile), and a row of x keeps two accumulators (even and odd
// groups), so the FMA chain of one accumulator no longer bounds a 32-wide group (GGUF's) at one row of x.
// Measured on a Zen 4 (which runs 512-bit operations as two 256-bit halves): 1.3-1.5x the avx2 tile on
// one thread. Compiled for its target alone; runs only where the CPU has AVX-512.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")
inline __m512 fp8x16(const uint8_t* q) {  // fp8x8's 16 wide
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
  const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8),
                                    _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7));
  return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.f));
}

template <int BITS>
inline void decode16(const uint8_t* q, __m512& lo, __m512& hi) {  // quants 0-15 and 16-31 of a chunk
  if constexpr (BITS == kFp8) {
    lo = fp8x16(q);
    hi = fp8x16(q + 16);
  } else if constexpr (BITS == 4) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    lo = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(0x0F)));
    hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
  } else {
    lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
    hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16))));
  }
}

// part[r] = sum over one group of x[r, k] q[k] (q: the group's first chunk, k its first column).
template <int BITS, int R>
inline void group_part(const uint8_t* q, int64_t chunks, const float* x, int64_t ldx, int64_t k, __m512 part[R]) {
  __m512 lo, hi;
  decode16<BITS>(q, lo, hi);
  __m512 odd[R];
  for (int r = 0; r < R; ++r) {
    part[r] = _mm512_mul_ps(lo, _mm512_loadu_ps(x + r * ldx + k));
    odd[r] = _mm512_mul_ps(hi, _mm512_loadu_ps(x + r * ldx + k + 16));
  }
  for (int64_t c = 1; c < chunks; ++c) {  // groups wider than a chunk (per-row scales: one group a row)
    q += bytes_of(BITS, kChunk), k += kChunk;
    decode16<BITS>(q, lo, hi);
    for (int r = 0; r < R; ++r) {
      part[r] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(x + r * ldx + k), part[r]);
      odd[r] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(x + r * ldx + k + 16), odd[r]);
    }
  }
  for (int r = 0; r < R; ++r) part[r] = _mm512_add_ps(part[r], odd[r]);
}

template <int BITS, int R>
void fused_tile_avx512(const Weight& W, const float* x, int64_t ldx, const float* xsum, int64_t n0, int64_t n1,
                       float* out, int64_t ldo) {
  const int64_t chunks = W.G / kChunk, group_bytes = bytes_of(BITS, W.G);
  RowValues rv;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* q = W.qs + n * W.row_bytes;
    rv.load(W, n);
    const float* d = rv.d;
    __m512 even[R], odd[R], part[R];
    for (int r = 0; r < R; ++r) even[r] = odd[r] = _mm512_setzero_ps();
    int64_t g = 0;
    for (; g + 2 <= W.groups; g += 2) {
      group_part<BITS, R>(q + g * group_bytes, chunks, x, ldx, g * W.G, part);
      for (int r = 0; r < R; ++r) even[r] = _mm512_fmadd_ps(part[r], _mm512_set1_ps(d[g]), even[r]);
      group_part<BITS, R>(q + (g + 1) * group_bytes, chunks, x, ldx, (g + 1) * W.G, part);
      for (int r = 0; r < R; ++r) odd[r] = _mm512_fmadd_ps(part[r], _mm512_set1_ps(d[g + 1]), odd[r]);
    }
    if (g < W.groups) {
      group_part<BITS, R>(q + g * group_bytes, chunks, x, ldx, g * W.G, part);
      for (int r = 0; r < R; ++r) even[r] = _mm512_fmadd_ps(part[r], _mm512_set1_ps(d[g]), even[r]);
    }
    for (int r = 0; r < R; ++r) {
      float s = _mm512_reduce_add_ps(_mm512_add_ps(even[r], odd[r]));
      if (W.has_mins) s += dot(rv.m, xsum + r * W.groups, W.groups);
      out[r * ldo + n] = s;
    }
  }
}
#pragma GCC pop_options


// The avx512_bf16 family of the many-row fp32 products: vdpbf16ps, which multiplies two bf16 pairs per
// fp32 lane (each product exact) and adds both to the lane, 32 products per instruction against the avx2
// tile's 8 FMAs. The numbers stay the fp32 model's: a quant is an integer (4-bit 0..15, 8-bit -128..127),
// exact in bf16, and x is split into two bf16, hi = bf16(x) and lo = bf16(x - hi), whose sum is x to
// 2^-18 of |x| (the pair (hi, lo) against the pair (q, q) is one instruction's two products); a group's
// scale then multiplies the group's fp32 sum and its min meets x's fp32 group sum, as in the fused path.
// The products are sum_k (hi + lo) q, not sum_k x q: every term within 2^-18 of x q (fp32's sums of a
// group are within about 2^-19 anyway), not a bf16 rounding of x (2^-9) as the bf16 linear has it.
// Lanes are 16 rows of x: x is re-laid once per call as [M/16][K][16] pairs (hi, lo) and the weights'
// pair (q, q) is a broadcast 32-bit load from a tile of W dequantised to [rows][K] once per chunk of x's
// rows. A register tile is 2 blocks of 16 rows by 6 rows of W (12 group sums, 12 totals).
// x given in bf16 (a model served in bf16) is the bf16 model's product instead (run_lanes, below).
#ifdef STAGEMESH_QUANT_BF16
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")
constexpr int kPairMB = 2;           // blocks of 16 rows of x per register tile
constexpr int kSplitNR = 6;          // rows of W per register tile (its group sums take 12 more registers)
constexpr int64_t kPairTileN = 48;   // rows of W a task dequantises (a multiple of kSplitNR)
constexpr int64_t kPairChunkM = 256; // rows of x a task takes (a multiple of 16 kPairMB): its x stays in cache
// From this many rows of x the pair tiles run (fewer: the avx2 tiles; up to kFusedRows, the fused path).
// Measured on 2026-11-27's AMD EPYC with avx512_bf16 (one thread, the default model's q/k/v, o, gate_up, down,
// GFLOPS avx2 tiles -> pair tiles; its bf16 linear ran 450-500 a core, so its 512-bit units were full width):
// 9 rows 76-79 -> 68-70 (padded to 16), 12 rows 88-92 -> 89-92, 16 rows 93-99 -> 117-122, 24 rows 99-105 ->
// 129-136, 32 rows 101-107 -> 168-178, 256 rows 110-114 -> 186-196, 2048 rows 92-109 -> 163-180.
// On a Zen 4 that runs a 512-bit op as two 256-bit halves (its bf16 linear 210-220 a core) a vdpbf16ps of split
// pairs does what two 256-bit FMA pipes do, so the pair tiles only tie the avx2 tiles where their lanes are full
// and lose where they are not (2 threads: 17 rows 144-152 against 90-93, 32 rows 167-177 against 169-171).
// One threshold serves both; choosing it by CPU is not built (benchmarks/RESULTS.md, 2026-11-30, third session).
constexpr int64_t kPairRows = 12;
// x in bf16 takes the lane tiles (run_lanes) from this many rows; fewer take the fused path. Measured on the
// Zen 4 (2 threads, the default model's q/k/v, o, gate_up, down; GFLOPS fused -> lane tiles): 1 row 34-63 ->
// 30-35, 2 rows 45-75 -> 59-70 (even), 3 rows 56-84 -> 80-85, 4 rows 55-96 -> 105-120, 6 rows 60-79 -> 136-157.
constexpr int64_t kBf16Rows = 3;

inline __m512i bf16_bits(__m512 v) {  // v's 16 lanes rounded to bf16 (to nearest even), in the low 16 bits
  return _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v));
}

// An index a lane a row of a block of 16 (row i at i * stride) and the mask of the rows below M.
inline __m512i row_index(int64_t stride) {
  return _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                            _mm512_set1_epi32(static_cast<int>(stride)));
}
inline __mmask16 live_rows(int64_t M, int64_t b) {
  const int64_t rows = std::min<int64_t>(16, M - b * 16);
  return rows >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << std::max<int64_t>(rows, 0)) - 1);
}

// x [M, K] fp32 -> xp [Mb][K][16] (hi in the low half of each pair, lo in the high one; rows past M zeros) and
// xs [Mb][groups][16], each group's fp32 sums (summed in k order, the bits of group_sums).
void pack_pairs(const float* x, int64_t M, int64_t K, int64_t G, int64_t Mb, uint32_t* xp, float* xs) {
  const int64_t groups = K / G;
  at::parallel_for(0, Mb, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const __mmask16 live = live_rows(M, b);
      const __m512i idx = row_index(K);
      const float* xb = x + b * 16 * K;
      for (int64_t g = 0; g < groups; ++g) {
        __m512 sum = _mm512_setzero_ps();
        for (int64_t k = g * G; k < (g + 1) * G; ++k) {
          const __m512 v = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), live, idx, xb + k, 4);
          sum = _mm512_add_ps(sum, v);
          const __m512i hi = bf16_bits(v);
          const __m512 rest = _mm512_sub_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(hi, 16)));
          _mm512_storeu_si512(xp + (b * K + k) * 16, _mm512_or_si512(hi, _mm512_slli_epi32(bf16_bits(rest), 16)));
        }
        _mm512_storeu_ps(xs + (b * groups + g) * 16, sum);
      }
    }
  });
}

// W's rows [n0, n0 + rows) as a model served in bf16 holds them (the weights transformers' bf16 model has):
// d q + m in fp32 (the bits of dequantize's), rounded to the nearest even bf16, in pairs (w of k, w of k + 1)
// [rows][K / 2]. The scale and min are in the weight: a tile has no group ends. 4-bit
// quants take 16 values a group: a table of them in bf16 (one multiply and add for the group's 16), and a
// vpermw looks 32 quants up at once.
template <int BITS>
void dequantize_bf16(const Weight& W, int64_t n0, int64_t rows, uint32_t* buf, RowValues& rv) {
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int64_t i = 0; i < rows; ++i) {
    rv.load(W, n0 + i);
    const uint8_t* q = W.qs + (n0 + i) * W.row_bytes;
    uint32_t* o = buf + i * W.K / 2;
    for (int64_t g = 0; g < W.groups; ++g) {
      const __m512 d = _mm512_set1_ps(rv.d[g]);
      __m512i table = _mm512_setzero_si512();
      if constexpr (BITS == 4)  // (4-bit weights have mins)
        table = _mm512_castsi256_si512(
            (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(_mm512_mul_ps(iota, d), _mm512_set1_ps(rv.m[g]))));
      for (int64_t k = 0; k < W.G; k += kChunk, q += bytes_of(BITS, kChunk), o += kChunk / 2) {
        if constexpr (BITS == 4) {
          const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
          const __m512i idx = _mm512_inserti64x4(
              _mm512_castsi256_si512(_mm256_and_si256(b, _mm256_set1_epi16(0x0F))), _mm256_srli_epi16(b, 4), 1);
          _mm512_storeu_si512(o, _mm512_permutexvar_epi16(idx, table));  // quants 0-15, then 16-31
        } else {  // 8-bit and fp8: no mins
          __m512 lo, hi;
          decode16<BITS>(q, lo, hi);
          _mm512_storeu_si512(o, (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(hi, d), _mm512_mul_ps(lo, d)));
        }
      }
    }
  }
}

// r[i] lane j <- r[j] lane i: a 16 x 16 transpose of 32-bit lanes in registers (unpacks, then shuffles of pairs
// and of 128-bit quarters).
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int j = 0; j < 16; j += 2) {
    t[j] = _mm512_unpacklo_ps(r[j], r[j + 1]);
    t[j + 1] = _mm512_unpackhi_ps(r[j], r[j + 1]);
  }
  for (int j = 0; j < 16; j += 4) {
    r[j] = _mm512_shuffle_ps(t[j], t[j + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[j + 1] = _mm512_shuffle_ps(t[j], t[j + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[j + 2] = _mm512_shuffle_ps(t[j + 1], t[j + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[j + 3] = _mm512_shuffle_ps(t[j + 1], t[j + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int h = 0; h < 16; h += 8)
    for (int j = 0; j < 4; ++j) {
      t[h + j] = _mm512_shuffle_f32x4(r[h + j], r[h + j + 4], 0x88);
      t[h + j + 4] = _mm512_shuffle_f32x4(r[h + j], r[h + j + 4], 0xdd);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0x88);
    r[j + 8] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0xdd);
  }
}

// x in bf16 (a model served in bf16), W's rows in the lanes as the bf16 linear lays them: a tile of W is
// dequantised to the bf16 model's weights (dequantize_bf16) and laid [rows / 16][K / 2][16] (a pair of w of k and
// k + 1 for 16 rows: one 16 x 16 transpose a block of 16 pairs), a row of x is a broadcast pair (x of k, x of
// k + 1, as x holds it), and a register tile is kLaneMR rows of x by kLaneNB blocks of 16 rows of W. Any number of
// rows of x fills the lanes, where x's rows in the lanes (blocks of 16) left 15 of 32 empty at 17 rows; and a
// register tile's sums are a row segment of the product, written as it is.
constexpr int kLaneMR = 6;           // rows of x per register tile
constexpr int kLaneNB = 4;           // blocks of 16 rows of W per register tile (24 accumulators)
constexpr int64_t kLaneTileN = 64;   // rows of W a task dequantises (kLaneNB blocks)

// W's rows [n0, n0 + rows) -> buf [ceil(rows / 16)][P][16] (rows past `rows` zeros); rowbuf: [16][P] scratch.
template <int BITS>
void dequantize_lanes(const Weight& W, int64_t n0, int64_t rows, uint32_t* rowbuf, uint32_t* buf, RowValues& rv) {
  const int64_t P = W.K / 2;  // a multiple of 16 (K is of 32)
  for (int64_t j0 = 0; j0 < rows; j0 += 16) {
    const int64_t live = std::min<int64_t>(16, rows - j0);
    dequantize_bf16<BITS>(W, n0 + j0, live, rowbuf, rv);
    uint32_t* o = buf + j0 * P;
    for (int64_t p = 0; p < P; p += 16) {
      __m512 r[16];
      for (int j = 0; j < 16; ++j)
        r[j] = j < live ? _mm512_loadu_ps(reinterpret_cast<const float*>(rowbuf + j * P + p)) : _mm512_setzero_ps();
      transpose16(r);
      for (int j = 0; j < 16; ++j) _mm512_storeu_ps(reinterpret_cast<float*>(o + (p + j) * 16), r[j]);
    }
  }
}

// out[m][n] (bf16; ldo apart) for MR rows of x (pairs, P a row) and NB blocks of 16 rows of W (w [NB][P][16]) of
// which n_live are live: the fp32 sums over the P pairs, plus the bias, rounded once to nearest even.
template <int MR, int NB>
void lane_tile(const uint32_t* x, int64_t P, const uint32_t* w, int64_t n_live, const float* bias, uint16_t* out,
               int64_t ldo) {
  __m512 acc[MR][NB];
  for (int i = 0; i < MR; ++i)
    for (int b = 0; b < NB; ++b) acc[i][b] = _mm512_setzero_ps();
  for (int64_t p = 0; p < P; ++p) {
    __m512bh wv[NB];
    for (int b = 0; b < NB; ++b) wv[b] = (__m512bh)_mm512_loadu_si512(w + (b * P + p) * 16);
    for (int i = 0; i < MR; ++i) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[i * P + p]));
      for (int b = 0; b < NB; ++b) acc[i][b] = _mm512_dpbf16_ps(acc[i][b], xv, wv[b]);
    }
  }
  for (int b = 0; b < NB; ++b) {
    const int64_t cols = std::min<int64_t>(16, n_live - 16 * b);
    const __mmask16 mask = cols >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << cols) - 1);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + 16 * b) : _mm512_setzero_ps();
    for (int i = 0; i < MR; ++i)
      _mm256_mask_storeu_epi16(out + i * ldo + 16 * b, mask, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[i][b], bv)));
  }
}

using LaneFn = void (*)(const uint32_t*, int64_t, const uint32_t*, int64_t, const float*, uint16_t*, int64_t);
template <int MR, size_t... NB>
constexpr std::array<LaneFn, kLaneNB + 1> lane_row(std::index_sequence<NB...>) {
  return {nullptr, lane_tile<MR, NB + 1>...};
}
template <size_t... MR>
constexpr std::array<std::array<LaneFn, kLaneNB + 1>, kLaneMR + 1> lane_table(std::index_sequence<MR...>) {
  return {std::array<LaneFn, kLaneNB + 1>{}, lane_row<MR + 1>(std::make_index_sequence<kLaneNB>())...};
}
constexpr auto kLaneTile = lane_table(std::make_index_sequence<kLaneMR>());

// out [M, N] bf16 = x [M, K] bf16 against W as the bf16 model holds it, plus the bias (fp32, or nullptr).
template <int BITS>
void run_lanes(const Weight& W, const uint16_t* x_bf16, int64_t M, uint16_t* out, const float* bias) {
  const int64_t N = W.N, P = W.K / 2;
  const uint32_t* x = reinterpret_cast<const uint32_t*>(x_bf16);
  // tiles of W: kLaneTileN rows, fewer where N would leave a thread without two of them
  const int64_t threads = at::get_num_threads();
  const int64_t tile_n = std::clamp<int64_t>(((N + 2 * threads - 1) / (2 * threads) + 15) / 16 * 16, 16, kLaneTileN);
  const int64_t tiles = (N + tile_n - 1) / tile_n, chunks = (M + kPairChunkM - 1) / kPairChunkM;
  at::parallel_for(0, chunks * tiles, 1, [&](int64_t t0, int64_t t1) {
    std::vector<uint32_t> buf(tile_n * P), rowbuf(16 * P);
    RowValues rv;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t c = t / tiles, n0 = (t % tiles) * tile_n, rows = std::min(tile_n, N - n0);
      dequantize_lanes<BITS>(W, n0, rows, rowbuf.data(), buf.data(), rv);
      const int64_t m_end = std::min(M, (c + 1) * kPairChunkM);
      for (int64_t j0 = 0; j0 < rows; j0 += 16 * kLaneNB) {
        const int64_t n_live = std::min<int64_t>(16 * kLaneNB, rows - j0);
        const int nb = static_cast<int>((n_live + 15) / 16);
        for (int64_t m = c * kPairChunkM; m < m_end; m += kLaneMR) {
          const int mr = static_cast<int>(std::min<int64_t>(kLaneMR, m_end - m));
          kLaneTile[mr][nb](x + m * P, P, buf.data() + j0 * P, n_live, bias ? bias + n0 + j0 : nullptr,
                            out + m * N + n0 + j0, N);
        }
      }
    }
  });
}

// W's rows [n0, n0 + rows) as pairs (q, q) of bf16 [rows][K], and their scales and mins [rows][groups].
template <int BITS>
void dequantize_pairs(const Weight& W, int64_t n0, int64_t rows, uint32_t* buf, float* d, float* m, RowValues& rv) {
  const auto pairs_of = [](__m512 v) {  // 16 quants (integers, or e4m3 values: 4 significant bits) -> 16
    const __m512i h = _mm512_srli_epi32(_mm512_castps_si512(v), 16);  // pairs (q, q) of bf16 (exact)
    return _mm512_or_si512(h, _mm512_slli_epi32(h, 16));
  };
  const auto pairs = [&](__m512i q) { return pairs_of(_mm512_cvtepi32_ps(q)); };
  for (int64_t i = 0; i < rows; ++i) {
    const uint8_t* q = W.qs + (n0 + i) * W.row_bytes;
    uint32_t* o = buf + i * W.K;
    for (int64_t k = 0; k < W.K; k += kChunk, q += bytes_of(BITS, kChunk), o += kChunk) {
      if constexpr (BITS == kFp8) {
        _mm512_storeu_si512(o, pairs_of(fp8x16(q)));
        _mm512_storeu_si512(o + 16, pairs_of(fp8x16(q + 16)));
        continue;
      }
      __m512i lo, hi;
      if constexpr (BITS == 4) {
        const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
        lo = _mm512_and_si512(b, _mm512_set1_epi32(0x0F));
        hi = _mm512_srli_epi32(b, 4);
      } else {
        lo = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
        hi = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16)));
      }
      _mm512_storeu_si512(o, pairs(lo));
      _mm512_storeu_si512(o + 16, pairs(hi));
    }
    rv.load(W, n0 + i);
    std::copy(rv.d, rv.d + W.groups, d + i * W.groups);
    if (W.has_mins) std::copy(rv.m, rv.m + W.groups, m + i * W.groups);
  }
}

// acc [NR][MB][16] = for MB blocks of 16 rows of x (xp, xs at the first) and NR rows of W (w [NR][K], d and
// m [NR][groups]): sum over groups of d sum_k (hi + lo) q + m xsum.
template <int MB, int NR, bool MINS>
void pair_tile(const uint32_t* xp, const float* xs, int64_t K, int64_t G, const uint32_t* w, const float* d,
               const float* m, float* acc_out) {
  const int64_t groups = K / G;
  __m512 acc[NR][MB], part[NR][MB];
  for (int j = 0; j < NR; ++j)
    for (int b = 0; b < MB; ++b) acc[j][b] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    for (int j = 0; j < NR; ++j)
      for (int b = 0; b < MB; ++b) part[j][b] = _mm512_setzero_ps();
    for (int64_t k = g * G; k < (g + 1) * G; ++k) {
      __m512bh xv[MB];
      for (int b = 0; b < MB; ++b) xv[b] = (__m512bh)_mm512_loadu_si512(xp + (b * K + k) * 16);
      for (int j = 0; j < NR; ++j) {
        const __m512bh wv = (__m512bh)_mm512_set1_epi32(static_cast<int>(w[j * K + k]));
        for (int b = 0; b < MB; ++b) part[j][b] = _mm512_dpbf16_ps(part[j][b], xv[b], wv);
      }
    }
    for (int j = 0; j < NR; ++j) {
      const __m512 dv = _mm512_set1_ps(d[j * groups + g]);
      for (int b = 0; b < MB; ++b) acc[j][b] = _mm512_fmadd_ps(part[j][b], dv, acc[j][b]);
      if constexpr (MINS) {
        const __m512 mv = _mm512_set1_ps(m[j * groups + g]);
        for (int b = 0; b < MB; ++b) acc[j][b] = _mm512_fmadd_ps(_mm512_loadu_ps(xs + (b * groups + g) * 16), mv, acc[j][b]);
      }
    }
  }
  for (int j = 0; j < NR; ++j)
    for (int b = 0; b < MB; ++b) _mm512_storeu_ps(acc_out + (j * MB + b) * 16, acc[j][b]);
}

// A register tile's 16 rows of x by nr rows of W (acc: column j, a row of W, at acc + j * lda, a lane a row of x)
// -> out[i * ldo + j] for the live rows i: a 16 x 16 transpose in registers, then a masked store a row, where
// scalar stores of one column at a time cost 2 a value.
inline void columns_to_rows(const float* acc, int64_t lda, int nr, int64_t live, float* out, int64_t ldo) {
  __m512 r[16];
  for (int j = 0; j < 16; ++j) r[j] = j < nr ? _mm512_loadu_ps(acc + j * lda) : _mm512_setzero_ps();
  transpose16(r);
  const __mmask16 cols = static_cast<__mmask16>((1u << nr) - 1);
  for (int64_t i = 0; i < live; ++i) _mm512_mask_storeu_ps(out + i * ldo, cols, r[i]);
}

using PairFn = void (*)(const uint32_t*, const float*, int64_t, int64_t, const uint32_t*, const float*, const float*,
                        float*);
// The tiles by rows of W (1 .. kSplitNR).
template <int MB, bool MINS, size_t... NR>
constexpr std::array<PairFn, kSplitNR + 1> split_row(std::index_sequence<NR...>) {
  return {nullptr, pair_tile<MB, NR + 1, MINS>...};
}
template <int MB, bool MINS>
constexpr auto kSplitRow = split_row<MB, MINS>(std::make_index_sequence<kSplitNR>());

// out [M, N] fp32 (the bias added by the caller) = x [M, K] fp32, split into (hi, lo), against the exact quants
// (pack_pairs, dequantize_pairs, pair_tile).
template <int BITS>
void run_pairs(const Weight& W, const float* x, int64_t M, float* out) {
  const int64_t N = W.N, K = W.K, G = W.G, groups = W.groups, Mb = (M + 15) / 16;
  std::vector<uint32_t> xp(Mb * K * 16);
  std::vector<float> xs(Mb * groups * 16);
  pack_pairs(x, M, K, G, Mb, xp.data(), xs.data());
  // tiles of W: kPairTileN rows, fewer where N would leave a thread without two of them
  const int64_t threads = at::get_num_threads();
  const int64_t tile_n = std::clamp<int64_t>(((N + 2 * threads - 1) / (2 * threads) + kSplitNR - 1) / kSplitNR *
                                             kSplitNR, kSplitNR, kPairTileN);
  const int64_t tiles = (N + tile_n - 1) / tile_n, chunks = (M + kPairChunkM - 1) / kPairChunkM;
  const PairFn* one = W.has_mins ? kSplitRow<1, true>.data() : kSplitRow<1, false>.data();
  const PairFn* two = W.has_mins ? kSplitRow<2, true>.data() : kSplitRow<2, false>.data();
  at::parallel_for(0, chunks * tiles, 1, [&](int64_t t0, int64_t t1) {
    std::vector<uint32_t> buf(tile_n * K);
    std::vector<float> d(tile_n * groups), m(tile_n * groups);
    RowValues rv;
    // a register tile's columns go to a buffer of the tile's rows first, then whole rows to out: columns
    // straight into out strided by N (3072 for gate_up: 12 KB, one L1 set for every row) ran at 0.6x
    std::vector<float> rows_buf(kPairMB * 16 * tile_n);
    float acc[kSplitNR * kPairMB * 16];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t c = t / tiles, n0 = (t % tiles) * tile_n, rows = std::min(tile_n, N - n0);
      dequantize_pairs<BITS>(W, n0, rows, buf.data(), d.data(), m.data(), rv);
      const int64_t b_end = std::min(Mb, (c + 1) * kPairChunkM / 16);
      for (int64_t b = c * kPairChunkM / 16; b < b_end; b += kPairMB) {
        const int mb = static_cast<int>(std::min<int64_t>(kPairMB, b_end - b));
        const int64_t m0 = b * 16, live = std::min<int64_t>(16 * mb, M - m0);
        for (int64_t j0 = 0; j0 < rows; j0 += kSplitNR) {
          const int nr = static_cast<int>(std::min<int64_t>(kSplitNR, rows - j0));
          (mb == 2 ? two : one)[nr](xp.data() + b * K * 16, xs.data() + b * groups * 16, K, G, buf.data() + j0 * K,
                                    d.data() + j0 * groups, m.data() + j0 * groups, acc);
          for (int b2 = 0; b2 < mb; ++b2)
            columns_to_rows(acc + b2 * 16, mb * 16, nr, std::min<int64_t>(16, live - 16 * b2),
                            rows_buf.data() + 16 * b2 * tile_n + j0, tile_n);
        }
        for (int64_t i = 0; i < live; ++i)
          std::copy(rows_buf.data() + i * tile_n, rows_buf.data() + i * tile_n + rows, out + (m0 + i) * N + n0);
      }
    }
  });
}
#pragma GCC pop_options
#endif  // STAGEMESH_QUANT_BF16

#endif  // STAGEMESH_QUANT_AVX2

// Per row and block of 32 of x (llama.cpp's q8 blocks, whatever the weights' group): its int8 quants
// (round to nearest even of x * 127 / max|x|) and the scale max|x| / 127; per row and weight group of G
// (a multiple of 32), the sum of the quantised x (each block's integer sum times its scale, added in fp32;
// llama.cpp's q8_1 sums). The mins of 4-bit weights meet it: the rounding of x then multiplies the weight
// d q + m itself, not d q alone (q 0..15 is not centred, so d q is about twice w in size).
void quantize_rows(const float* x, int64_t M, int64_t K, int64_t G, int8_t* q, float* d, float* sums) {
  const int64_t blocks = K / kChunk, per_group = G / kChunk;
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t b = 0; b < blocks; ++b) {
        const float* xb = x + m * K + b * kChunk;
        float amax = 0.f;
        for (int64_t i = 0; i < kChunk; ++i) amax = std::max(amax, std::fabs(xb[i]));
        const float inv = amax > 0.f ? 127.f / amax : 0.f;
        int32_t qsum = 0;
        for (int64_t i = 0; i < kChunk; ++i) {
          const int8_t qi = static_cast<int8_t>(std::nearbyint(xb[i] * inv));
          q[m * K + b * kChunk + i] = qi;
          qsum += qi;
        }
        d[m * blocks + b] = amax / 127.f;
        float& group_sum = sums[m * (K / G) + b / per_group];
        group_sum = (b % per_group == 0 ? 0.f : group_sum) + static_cast<float>(qsum) * d[m * blocks + b];
      }
  });
}

// The group sums of x (fp32), for the mins of 4-bit weights.
std::vector<float> group_sums(const float* x, int64_t M, int64_t K, int64_t G) {
  const int64_t groups = K / G;
  std::vector<float> sums(M * groups);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < groups; ++g) {
      float s = 0.f;
      for (int64_t i = 0; i < G; ++i) s += x[m * K + g * G + i];
      sums[m * groups + g] = s;
    }
  return sums;
}

#ifdef STAGEMESH_QUANT_AVX2

template <int BITS>
void run_fused(const Weight& W, const float* x, int64_t M, float* out, bool avx512) {
  const std::vector<float> sums = W.has_mins ? group_sums(x, M, W.K, W.G) : std::vector<float>();
  using Fn = void (*)(const Weight&, const float*, int64_t, const float*, int64_t, int64_t, float*, int64_t);
  constexpr Fn avx2[kRows + 1] = {nullptr, fused_tile<BITS, 1>, fused_tile<BITS, 2>, fused_tile<BITS, 3>,
                                  fused_tile<BITS, 4>};
  constexpr Fn wide[kRows + 1] = {nullptr, fused_tile_avx512<BITS, 1>, fused_tile_avx512<BITS, 2>,
                                  fused_tile_avx512<BITS, 3>, fused_tile_avx512<BITS, 4>};
  const Fn* tiles = avx512 ? wide : avx2;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(W.K * M, 1));
  at::parallel_for(0, W.N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t m0 = 0; m0 < M; m0 += kRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kRows, M - m0));
      tiles[rows](W, x + m0 * W.K, W.K, sums.data() + m0 * W.groups, n0, n1, out + m0 * W.N, W.N);
    }
  });
}

template <int BITS>
void run_tiled(const Weight& W, const float* x, int64_t M, float* out) {
  const int64_t tiles = (W.N + kTileN - 1) / kTileN, K = W.K, N = W.N;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> buf(kTileN * std::min(K, kTileK));
    RowValues rv;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * kTileN, rows = std::min(kTileN, N - n0);
      for (int64_t k0 = 0; k0 < K; k0 += kTileK) {
        const int64_t kc = std::min(kTileK, K - k0);
        dequantize_tile<BITS>(W, n0, rows, k0, kc, buf.data(), rv);
        for (int64_t m0 = 0; m0 < M; m0 += kMR) {
          const int64_t mr = std::min<int64_t>(kMR, M - m0);
          for (int64_t j0 = 0; j0 < rows; j0 += kNR) {
            const int64_t nr = std::min<int64_t>(kNR, rows - j0);
            kDotTiles[mr][nr](x + m0 * K + k0, K, buf.data() + j0 * kc, kc, kc, out + m0 * N + n0 + j0, N, k0 > 0);
          }
        }
      }
    }
  });
}

template <int BITS>
void run_int8(const Weight& W, const float* x, int64_t M, float* out, bool vnni) {
  std::vector<int8_t> xq(M * W.K);
  std::vector<float> xd(M * (W.K / kChunk)), sums(M * W.groups);
  quantize_rows(x, M, W.K, W.G, xq.data(), xd.data(), sums.data());
  using Fn = void (*)(const Weight&, const int8_t*, const float*, const float*, int64_t, int64_t, float*, int64_t);
  constexpr Fn avx2[kRows + 1] = {nullptr, int8_tile<BITS, 1>, int8_tile<BITS, 2>, int8_tile<BITS, 3>,
                                  int8_tile<BITS, 4>};
  constexpr Fn avx512_vnni[kRows + 1] = {nullptr, int8_tile_vnni<BITS, 1>, int8_tile_vnni<BITS, 2>,
                                         int8_tile_vnni<BITS, 3>, int8_tile_vnni<BITS, 4>};
  const Fn* tiles = vnni ? avx512_vnni : avx2;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(W.K * M, 1));
  at::parallel_for(0, W.N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t m0 = 0; m0 < M; m0 += kRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kRows, M - m0));
      tiles[rows](W, xq.data() + m0 * W.K, xd.data() + m0 * (W.K / kChunk), sums.data() + m0 * W.groups, n0, n1,
                  out + m0 * W.N, W.N);
    }
  });
}

#endif  // STAGEMESH_QUANT_AVX2

Weight check_weight(const at::Tensor& qs, const at::Tensor& scales, const c10::optional<at::Tensor>& mins,
                    int64_t K, int* bits) {
  TORCH_CHECK(qs.device().is_cpu() && qs.dim() == 2 && qs.is_contiguous(), "qs must be a contiguous 2-D CPU tensor");
  TORCH_CHECK(qs.scalar_type() == at::kByte || qs.scalar_type() == at::kChar ||
                  qs.scalar_type() == at::kFloat8_e4m3fn,
              "qs must be uint8 (4-bit, two a byte), int8 (8-bit) or float8_e4m3fn");
  *bits = qs.scalar_type() == at::kByte ? 4 : qs.scalar_type() == at::kChar ? 8 : kFp8;
  TORCH_CHECK(K > 0 && K % kChunk == 0 && K <= (int64_t{1} << 20), "K = ", K, " must be a positive multiple of ",
              kChunk, " up to 2^20");
  TORCH_CHECK(qs.size(1) == bytes_of(*bits, K), "qs has ", qs.size(1), " bytes a row; K = ", K, " at ", *bits,
              " bits needs ", bytes_of(*bits, K));
  const int64_t N = qs.size(0);
  const bool half = scales.scalar_type() == at::kHalf;
  TORCH_CHECK(scales.device().is_cpu() && (scales.scalar_type() == at::kFloat || half) && scales.dim() == 2 &&
                  scales.is_contiguous() && scales.size(0) == N && scales.size(1) > 0,
              "scales must be contiguous float32 or float16 [N, groups]");
  const int64_t groups = scales.size(1);
  TORCH_CHECK(K % groups == 0 && (K / groups) % kChunk == 0, groups, " groups do not split K = ", K,
              " into multiples of ", kChunk);
  if (*bits == 4) {
    TORCH_CHECK(mins.has_value() && mins->device().is_cpu() && mins->scalar_type() == scales.scalar_type() &&
                    mins->is_contiguous() && mins->sizes() == scales.sizes(),
                "4-bit weights need mins shaped as their scales, in their dtype");
  } else {
    TORCH_CHECK(!mins.has_value(), "8-bit and fp8 weights take no mins");
  }
  const bool has_mins = *bits == 4;
  const auto f16 = [](const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::Half>()); };
  return Weight{static_cast<const uint8_t*>(qs.data_ptr()),
                half ? nullptr : scales.data_ptr<float>(),
                has_mins && !half ? mins->data_ptr<float>() : nullptr,
                half ? f16(scales) : nullptr,
                has_mins && half ? f16(*mins) : nullptr,
                has_mins, N, K, K / groups, groups, qs.size(1)};
}

}  // namespace

bool int8_vnni_available() {
#ifdef STAGEMESH_QUANT_AVX2
  return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512bw");
#else
  return false;
#endif
}

bool quant_avx512_available() {
#ifdef STAGEMESH_QUANT_AVX2
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
#else
  return false;
#endif
}

bool quant_bf16_available() {
#ifdef STAGEMESH_QUANT_BF16
  return quant_avx512_available() && int8_vnni_available() && __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

std::string quant_isa() {
#ifdef STAGEMESH_QUANT_AVX2
  return "avx2";
#else
  return "none";
#endif
}

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scales,
                        const c10::optional<at::Tensor>& mins, const c10::optional<at::Tensor>& bias,
                        bool int8_activations, const std::string& family) {
#ifndef STAGEMESH_QUANT_AVX2
  TORCH_CHECK(false, "quant_linear is built for AVX2 + FMA only; this build has neither (use the torch reference)");
#else
  TORCH_CHECK(x.device().is_cpu(), "quant_linear runs on CPU tensors");
  TORCH_CHECK(family == "avx2" || family == "avx512" || family == "avx512_vnni" || family == "avx512_bf16",
              "no quantised kernels for the family ", family, " (avx2, avx512, avx512_vnni, avx512_bf16)");
  const bool bf16 = family == "avx512_bf16", vnni = family == "avx512_vnni" || bf16, avx512 = family != "avx2";
  TORCH_CHECK(!bf16 || quant_bf16_available(), "this CPU has no avx512_bf16 (with avx512_vnni) instructions");
  TORCH_CHECK(!vnni || int8_vnni_available(), "this CPU has no avx512_vnni instructions");
  TORCH_CHECK(!avx512 || quant_avx512_available(), "this CPU has no AVX-512 (avx512f, bw, vl, dq) instructions");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x must be float32 or bfloat16");
  int bits = 0;
  const Weight W = check_weight(qs, scales, mins, x.size(-1), &bits);
  const int64_t K = W.K, N = W.N, M = x.numel() / K;
  at::Tensor bf;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == N, "bias has ", bias->numel(), " elements for ", N, " outputs");
    bf = bias->to(at::kFloat).contiguous();
  }
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  TORCH_CHECK(!int8_activations || bits != kFp8, "int8 activations take integer weights, not float8_e4m3fn");
#ifdef STAGEMESH_QUANT_BF16
  if (bf16 && !int8_activations && M >= kBf16Rows && x.scalar_type() == at::kBFloat16) {
    // bf16 in and out as they are: no fp32 copy of x or of the product
    const at::Tensor xb = x.reshape({-1, K}).contiguous();
    at::Tensor out = at::empty(shape, x.options());
    const auto* xp = reinterpret_cast<const uint16_t*>(xb.data_ptr<at::BFloat16>());
    auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
    const float* bp = bf.defined() ? bf.data_ptr<float>() : nullptr;
    bits == 4 ? run_lanes<4>(W, xp, M, op, bp) : bits == 8 ? run_lanes<8>(W, xp, M, op, bp)
              : run_lanes<kFp8>(W, xp, M, op, bp);
    return out;
  }
#endif
  const at::Tensor xf = x.reshape({-1, K}).to(at::kFloat).contiguous();
  at::Tensor out = at::empty(shape, x.options().dtype(at::kFloat));
  if (M == 0) return out.to(x.scalar_type());
  const float* xp = xf.data_ptr<float>();
  float* op = out.data_ptr<float>();
  if (int8_activations) {
    bits == 4 ? run_int8<4>(W, xp, M, op, vnni) : run_int8<8>(W, xp, M, op, vnni);
  } else if (M <= kFusedRows) {
    bits == 4 ? run_fused<4>(W, xp, M, op, avx512) : bits == 8 ? run_fused<8>(W, xp, M, op, avx512)
              : run_fused<kFp8>(W, xp, M, op, avx512);
#ifdef STAGEMESH_QUANT_BF16
  } else if (bf16 && M >= kPairRows) {  // fp32 x (bf16 x took the branch above)
    bits == 4 ? run_pairs<4>(W, xp, M, op) : bits == 8 ? run_pairs<8>(W, xp, M, op) : run_pairs<kFp8>(W, xp, M, op);
#endif
  } else {
    bits == 4 ? run_tiled<4>(W, xp, M, op) : bits == 8 ? run_tiled<8>(W, xp, M, op) : run_tiled<kFp8>(W, xp, M, op);
  }
  if (bf.defined()) {
    const float* bp = bf.data_ptr<float>();
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) op[m * N + n] += bp[n];
  }
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
#endif
}
