// Multi-LoRA's product on CPU, per token (lora_ops.h). Each token's work is two small matrix-vector products:
// the shrink, R dot products of length `in` (A's rows), then the expand, R axpys of length `out` (B^T's rows)
// into an fp32 row that is rounded once. AVX-512 where the build has it (bf16 widened in registers), else plain
// loops; tokens are spread over the threads in runs of one slot. (Blocking several tokens of a slot per load of the rows measured
// slower here: for long steps torch's products, bf16 dot products among them, win; kernels.dispatch keeps this
// kernel to decode-sized steps.)
#include "lora_ops.h"

#include <ATen/Parallel.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

inline float to_float(float v) { return v; }
inline float to_float(c10::BFloat16 v) {
  const uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline void store(float* p, float v) { *p = v; }
inline void store(c10::BFloat16* p, float v) { *p = c10::BFloat16(v); }  // round to nearest even

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
#endif

// sum_i w[i] v[i]
template <typename T>
inline float dot(const T* w, const float* v, int64_t n) {
  int64_t i = 0;
  float sum = 0.f;
#if defined(__AVX512F__)
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  for (; i + 32 <= n; i += 32) {
    acc0 = _mm512_fmadd_ps(load16(w + i), _mm512_loadu_ps(v + i), acc0);
    acc1 = _mm512_fmadd_ps(load16(w + i + 16), _mm512_loadu_ps(v + i + 16), acc1);
  }
  for (; i + 16 <= n; i += 16) acc0 = _mm512_fmadd_ps(load16(w + i), _mm512_loadu_ps(v + i), acc0);
  sum = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
#endif
  for (; i < n; ++i) sum += to_float(w[i]) * v[i];
  return sum;
}

// acc[i] += alpha w[i]
template <typename T>
inline void axpy(float* acc, float alpha, const T* w, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 a = _mm512_set1_ps(alpha);
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(acc + i, _mm512_fmadd_ps(a, load16(w + i), _mm512_loadu_ps(acc + i)));
#endif
  for (; i < n; ++i) acc[i] += alpha * to_float(w[i]);
}

template <typename T>
void lora_add_impl(at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& bt,
                   const int32_t* slots) {
  const int64_t tokens = x.size(0), in = x.size(1), rank = a.size(1), out = bt.size(2);
  T* yp = y.data_ptr<T>();
  const T* xp = x.data_ptr<T>();
  const T* ap = a.data_ptr<T>();
  const T* bp = bt.data_ptr<T>();
  // the tokens that use an adapter, ordered by slot (counting sort, stable): each thread takes a run of them,
  // so a slot's rows stream from memory into one thread's cache once, not into every thread's
  const int64_t num_slots = a.size(0);
  std::vector<int64_t> start(num_slots + 1, 0), order;
  for (int64_t t = 0; t < tokens; ++t)
    if (slots[t] >= 0) ++start[slots[t] + 1];
  for (int64_t s = 0; s < num_slots; ++s) start[s + 1] += start[s];
  order.resize(start[num_slots]);
  {
    std::vector<int64_t> next(start.begin(), start.end() - 1);
    for (int64_t t = 0; t < tokens; ++t)
      if (slots[t] >= 0) order[next[slots[t]]++] = t;
  }
  const int64_t work = std::max<int64_t>(rank * (in + out), 1);
  at::parallel_for(0, static_cast<int64_t>(order.size()), std::max<int64_t>((1 << 17) / work, 1),
                   [&](int64_t begin, int64_t end) {
    std::vector<float> xf(in), mid(rank), acc(out);
    for (int64_t k = begin; k < end; ++k) {
      const int64_t t = order[k];
      const int32_t s = slots[t];
      const T* xr = xp + t * in;
      for (int64_t i = 0; i < in; ++i) xf[i] = to_float(xr[i]);
      const T* as = ap + s * rank * in;
      for (int64_t r = 0; r < rank; ++r) mid[r] = dot(as + r * in, xf.data(), in);
      T* yr = yp + t * out;
      for (int64_t o = 0; o < out; ++o) acc[o] = to_float(yr[o]);
      const T* bs = bp + s * rank * out;
      for (int64_t r = 0; r < rank; ++r)
        if (mid[r] != 0.f) axpy(acc.data(), mid[r], bs + r * out, out);  // (a zero-padded rank adds nothing)
      for (int64_t o = 0; o < out; ++o) store(yr + o, acc[o]);
    }
  });
}

}  // namespace

void lora_add(at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& bt,
              const at::Tensor& token_slots) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && a.dim() == 3 && bt.dim() == 3, "lora_add: y, x 2-d; A, B^T 3-d");
  TORCH_CHECK(x.size(0) == y.size(0) && a.size(2) == x.size(1) && bt.size(2) == y.size(1)
                  && a.size(1) == bt.size(1) && a.size(0) == bt.size(0), "lora_add: shapes do not agree");
  TORCH_CHECK(token_slots.scalar_type() == at::kInt && token_slots.numel() == x.size(0), "lora_add: token_slots "
              "int32, one per token");
  TORCH_CHECK(x.scalar_type() == y.scalar_type() && a.scalar_type() == x.scalar_type()
                  && bt.scalar_type() == x.scalar_type(), "lora_add: one dtype for y, x, A and B^T");
  TORCH_CHECK(x.is_contiguous() && y.is_contiguous() && a.is_contiguous() && bt.is_contiguous()
                  && token_slots.is_contiguous(), "lora_add: contiguous tensors");
  const int32_t* slots = token_slots.data_ptr<int32_t>();
  const int64_t num_slots = a.size(0);
  for (int64_t t = 0; t < x.size(0); ++t)
    TORCH_CHECK(slots[t] < num_slots, "lora_add: token ", t, " names slot ", slots[t], " of ", num_slots);
  if (x.scalar_type() == at::kFloat) {
    lora_add_impl<float>(y, x, a, bt, slots);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "lora_add: float32 or bfloat16");
    lora_add_impl<c10::BFloat16>(y, x, a, bt, slots);
  }
}
