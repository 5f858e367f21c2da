// The avx512 family of decode attention (decode_attention.h): 16-wide FMA, 32 registers, so a pass keeps
// up to four query heads' accumulators of a 64-wide head (two of a 128-wide one) in registers. Keys and
// values of a bf16 or fp8 cache are widened in registers (exact), products and sums in fp32.
//
// Compiled with the AVX-512 target for its own functions alone (every header comes before the pragma);
// it runs only where the CPU has the instructions (avx512_available()).
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
#define STAGEMESH_ATTN_AVX512 1
#endif

namespace decode_attn {

bool avx512_available() {
#ifdef STAGEMESH_ATTN_AVX512
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
#else
  return false;
#endif
}

#ifdef STAGEMESH_ATTN_AVX512
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")
namespace avx512 {

struct V {
  using reg = __m512;
  static constexpr int W = 16;
  static constexpr int kAccumulators = 16;
  static reg zero() { return _mm512_setzero_ps(); }
  static reg load(const float* p) { return _mm512_loadu_ps(p); }
  static reg load(const c10::BFloat16* p) {  // bf16 -> fp32 is the 16 bits moved to the top: exact
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  // fp8 as the avx2 family widens it (decode_attention_avx2.cpp): e4m3 gives the value / 256, e5m2 the value
  static reg load(const c10::Float8_e4m3fn* p) {
    const __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm512_cvtph_ps(
        _mm256_and_si256(_mm256_slli_epi16(b, 7), _mm256_set1_epi16(static_cast<short>(0xBFFF))));
  }
  static reg load(const c10::Float8_e5m2* p) {
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm512_cvtph_ps(_mm256_slli_epi16(b, 8));
  }
  static reg set1(float x) { return _mm512_set1_ps(x); }
  static reg mul(reg a, reg b) { return _mm512_mul_ps(a, b); }
  static reg fma(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }
  static float sum(reg a) { return _mm512_reduce_add_ps(a); }
  static void store(float* p, reg a) { _mm512_storeu_ps(p, a); }
};

#include "decode_attention_impl.h"

}  // namespace avx512
#pragma GCC pop_options

bool avx512_covers(int64_t dim) { return avx512_available() && avx512::covers(dim); }

void avx512_run(const Problem& p) {
  TORCH_CHECK(avx512_available(), "this CPU has no AVX-512 instructions (the avx512 decode attention)");
  avx512::run(p);
}
#else
bool avx512_covers(int64_t) { return false; }
void avx512_run(const Problem&) { TORCH_CHECK(false, "this build has no avx512 decode attention"); }
#endif

}  // namespace decode_attn
