// The avx2 family of decode attention (decode_attention.h): 8-wide FMA, 16 registers, so a pass keeps one
// query head's accumulators of a 64-wide head in registers. Keys and values of a bf16 or fp8 cache are widened
// in registers (exact; fp8 through F16C's fp16 conversion), products and sums in fp32.
//
// Compiled with the AVX2 target for its own functions alone (every header comes before the pragma), as
// the rest of the module may be built for a lower level; it runs only where the CPU has AVX2 and FMA.
#include "decode_attention.h"

#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#define STAGEMESH_ATTN_AVX2 1
#endif

namespace decode_attn {

#ifdef STAGEMESH_ATTN_AVX2
static bool avx2_available() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {

struct V {
  using reg = __m256;
  static constexpr int W = 8;
  static constexpr int kAccumulators = 8;
  static reg zero() { return _mm256_setzero_ps(); }
  static reg load(const float* p) { return _mm256_loadu_ps(p); }
  static reg load(const c10::BFloat16* p) {  // bf16 -> fp32 is the 16 bits moved to the top: exact
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  // fp8 (decode_attention_impl.h): each byte moved into an fp16 and widened (F16C: fp16 subnormals need no
  // microcode assist, where fp32 ones would). e4m3's seven magnitude bits sit under fp16's exponent bias of 15
  // (not 7): the value / 256, subnormals included. The byte sign-extended and shifted by 7 puts its sign at bit
  // 15 and a copy at bit 14, which the mask clears: three operations a lane. e5m2 is fp16's top byte.
  static reg load(const c10::Float8_e4m3fn* p) {
    const __m128i b = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    return _mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(b, 7), _mm_set1_epi16(static_cast<short>(0xBFFF))));
  }
  static reg load(const c10::Float8_e5m2* p) {
    const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    return _mm256_cvtph_ps(_mm_slli_epi16(b, 8));
  }
  static reg set1(float x) { return _mm256_set1_ps(x); }
  static reg mul(reg a, reg b) { return _mm256_mul_ps(a, b); }
  static reg fma(reg a, reg b, reg c) { return _mm256_fmadd_ps(a, b, c); }
  static float sum(reg a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
  static void store(float* p, reg a) { _mm256_storeu_ps(p, a); }
};

#include "decode_attention_impl.h"

}  // namespace avx2
#pragma GCC pop_options

bool avx2_covers(int64_t dim) { return avx2_available() && avx2::covers(dim); }

void avx2_run(const Problem& p) {
  TORCH_CHECK(avx2_available(), "this CPU has no AVX2, FMA and F16C instructions (the avx2 decode attention)");
  avx2::run(p);
}
#else
bool avx2_covers(int64_t) { return false; }
void avx2_run(const Problem&) { TORCH_CHECK(false, "this build has no avx2 decode attention"); }
#endif

}  // namespace decode_attn
