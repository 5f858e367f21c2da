// Fused CPU kernels for the serving path (fp32 and bf16): one call where the torch
// reference takes five to ten small ops. On a CPU, small ops cost more in
// dispatch and thread hand-off than in arithmetic, and the decode attention of
// the reference copies every key and value it reads; these read them once.
// Semantics are those of kernels/reference.py, which the tests compare against.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include "bf16_linear.h"
#include "decoder_layer.h"
#include "decode_attention.h"
#include "kv_fp8.h"
#include "lora_ops.h"
#include "mla_decode.h"
#include "moe_ops.h"
#include "quant_linear.h"
#include "shm_comm.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// Below this many floats of work a kernel runs on the calling thread: waking
// the other threads costs more than the work.
constexpr int64_t kGrainFloats = 1 << 15;

// The activations' and the cache's element type: float32, or bfloat16 (stored in bf16, computed in
// fp32, rounded to nearest even once per output, as torch's own bf16 ops do).
void check_cpu(const at::Tensor& t, const char* name, at::ScalarType dtype) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, " (it is ", t.scalar_type(), ")");
}

void check_float_or_bf16(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
              " must be float32 or bfloat16");
}

// Runs body<T>() with T the C++ type of dtype (float or c10::BFloat16).
template <typename Body>
decltype(auto) with_dtype(at::ScalarType dtype, Body&& body) {
  if (dtype == at::kBFloat16) return body(c10::BFloat16{});
  return body(float{});
}

inline float f32(float v) { return v; }
inline float f32(c10::BFloat16 v) { return static_cast<float>(v); }
template <typename T>
inline T to(float v) { return static_cast<T>(v); }  // c10::BFloat16(float) rounds to nearest even
template <typename T>
inline float round_as(float v) { return f32(to<T>(v)); }  // v as it would be stored in T

int64_t grain_rows(int64_t floats_per_row) {
  return std::max<int64_t>(1, kGrainFloats / std::max<int64_t>(floats_per_row, 1));
}

#include "exp_poly.h"  // exp_poly(x), inside this anonymous namespace

template <typename T>
inline float dot(const float* a, const T* b, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * f32(b[i]);
  return acc;
}

template <typename T>
inline float sum_of_squares(const T* a, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += f32(a[i]) * f32(a[i]);
  return acc;
}

}  // namespace

// (x + residual) normalised: returns (normed, x + residual); residual may be undefined.
// In bf16 the roundings are transformers' (the sum stored in bf16, the normalised row rounded to bf16
// before the weight multiplies it), the arithmetic fp32.
std::vector<at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                                 const c10::optional<at::Tensor>& residual) {
  check_float_or_bf16(x, "x");
  check_cpu(weight, "weight", x.scalar_type());
  const int64_t hidden = x.size(-1);
  TORCH_CHECK(weight.numel() == hidden, "weight has ", weight.numel(), " elements, rows have ", hidden);
  at::Tensor in = x.contiguous();
  at::Tensor sum = in;
  const bool add = residual.has_value() && residual->defined();
  at::Tensor res;
  if (add) {
    check_cpu(*residual, "residual", x.scalar_type());
    TORCH_CHECK(residual->sizes() == x.sizes(), "residual and x differ in shape");
    sum = at::empty_like(in);
    res = residual->contiguous();
  }
  at::Tensor out = at::empty_like(sum);
  const at::Tensor w_c = weight.contiguous();  // held: a temporary's pointer would dangle
  with_dtype(x.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    if (add) {
      const T *a = in.data_ptr<T>(), *b = res.data_ptr<T>();
      T* s = sum.data_ptr<T>();
      at::parallel_for(0, in.numel(), kGrainFloats, [&](int64_t lo, int64_t hi) {
#pragma omp simd
        for (int64_t i = lo; i < hi; ++i) s[i] = to<T>(f32(a[i]) + f32(b[i]));
      });
    }
    const int64_t rows = sum.numel() / hidden;
    const T *src = sum.data_ptr<T>(), *w = w_c.data_ptr<T>();
    T* dst = out.data_ptr<T>();
    at::parallel_for(0, rows, grain_rows(hidden), [&](int64_t lo, int64_t hi) {
      for (int64_t r = lo; r < hi; ++r) {
        const T* h = src + r * hidden;
        T* o = dst + r * hidden;
        const float inv =
            1.f / std::sqrt(sum_of_squares(h, hidden) / static_cast<float>(hidden) + static_cast<float>(eps));
#pragma omp simd
        for (int64_t i = 0; i < hidden; ++i) o[i] = to<T>(round_as<T>(f32(h[i]) * inv) * f32(w[i]));
      }
    });
  });
  return {out, sum};
}

namespace {

// One head's rotate-half rotation, a -> b (apply_rotary and rotary_and_cache share it, so both give the
// same bits). cos and sin are fp32; in bf16 they are rounded to bf16 first (transformers casts them to the
// model's dtype).
template <typename T>
inline void rotate_head(const T* a, T* b, const float* cos, const float* sin, int64_t half) {
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float c = round_as<T>(cos[i]), s = round_as<T>(sin[i]);
    const float lo = f32(a[i]), hi = f32(a[i + half]);
    b[i] = to<T>(lo * c - hi * s);
    b[i + half] = to<T>(hi * c + lo * s);
  }
}

// positions as int64, each checked against the rotary cache's rows.
at::Tensor checked_positions(const at::Tensor& positions, int64_t tokens, int64_t num_positions) {
  const at::Tensor pos = positions.to(at::kLong).contiguous();
  TORCH_CHECK(pos.numel() == tokens, "one position per token: ", pos.numel(), " for ", tokens);
  const int64_t* p = pos.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(p[t] >= 0 && p[t] < num_positions, "position ", p[t], " is outside the rotary cache of ",
                num_positions);
  return pos;
}

// slot_mapping as int64, each slot checked against the cache [num_blocks, block_size, kv_heads, dim] (fp32,
// bf16 or fp8).
at::Tensor checked_slots(const at::Tensor& slot_mapping, const at::Tensor& k_cache, const at::Tensor& v_cache) {
  if (!kv_fp8::is_fp8(k_cache.scalar_type())) check_float_or_bf16(k_cache, "k_cache");
  check_cpu(v_cache, "v_cache", k_cache.scalar_type());
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "k_cache and v_cache must both be [num_blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the KV cache must be contiguous");
  const at::Tensor slots = slot_mapping.to(at::kLong).contiguous();
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* s = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < slots.numel(); ++t)
    TORCH_CHECK(s[t] >= 0 && s[t] < num_slots, "slot ", s[t], " is outside the KV cache");
  return slots;
}

}  // namespace

// Rotary embedding (rotate-half layout) of q [tokens, heads, dim] and k [tokens, kv_heads, dim],
// which may be strided views of a fused QKV output; returns contiguous rotated copies. The cache is
// fp32 [positions, dim] (cos half, sin half).
std::vector<at::Tensor> apply_rotary(const at::Tensor& q, const at::Tensor& k, const at::Tensor& positions,
                                     const at::Tensor& cos_sin_cache) {
  check_float_or_bf16(q, "q");
  check_cpu(k, "k", q.scalar_type());
  check_cpu(cos_sin_cache, "cos_sin_cache", at::kFloat);
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3, "q and k must be [tokens, heads, head_dim]");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1, "q and k must have contiguous head_dim");
  const int64_t tokens = q.size(0), dim = q.size(2), half = dim / 2;
  TORCH_CHECK(cos_sin_cache.size(1) == dim, "cos_sin_cache rows must be head_dim wide");
  TORCH_CHECK(k.size(0) == tokens && k.size(2) == dim, "q and k differ in tokens or head_dim");
  const at::Tensor cache = cos_sin_cache.contiguous();
  const at::Tensor pos = checked_positions(positions, tokens, cache.size(0));
  at::Tensor q_out = at::empty({tokens, q.size(1), dim}, q.options());
  at::Tensor k_out = at::empty({tokens, k.size(1), dim}, k.options());
  const int64_t* p = pos.data_ptr<int64_t>();
  const float* cs = cache.data_ptr<float>();
  with_dtype(q.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    auto rotate = [&](const at::Tensor& x, at::Tensor& y, int64_t t) {
      const float* cos = cs + p[t] * dim;
      const int64_t heads = x.size(1);
      for (int64_t h = 0; h < heads; ++h)
        rotate_head<T>(x.data_ptr<T>() + t * x.stride(0) + h * x.stride(1), y.data_ptr<T>() + (t * heads + h) * dim,
                       cos, cos + half, half);
    };
    at::parallel_for(0, tokens, grain_rows((q.size(1) + k.size(1)) * dim), [&](int64_t lo, int64_t hi) {
      for (int64_t t = lo; t < hi; ++t) {
        rotate(q, q_out, t);
        rotate(k, k_out, t);
      }
    });
  });
  return {q_out, k_out};
}

// An fp8 cache's write: each row quantised with its scale (kv_fp8.h).
static void write_kv_cache_fp8(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
                               const at::Tensor& slots, double k_scale, double v_scale) {
  const at::Tensor kc = k.to(at::kFloat).contiguous(), vc = v.to(at::kFloat).contiguous();
  const int64_t row = k_cache.size(2) * k_cache.size(3);
  TORCH_CHECK(kc.numel() == slots.numel() * row && vc.numel() == kc.numel(), "k/v do not match the slot mapping");
  const int64_t* s = slots.data_ptr<int64_t>();
  const float ks = static_cast<float>(k_scale), vs = static_cast<float>(v_scale);
  kv_fp8::with_fp8(k_cache.scalar_type(), [&](auto zero) {
    using F = decltype(zero);
    const float *kp = kc.data_ptr<float>(), *vp = vc.data_ptr<float>();
    F *kd = static_cast<F*>(k_cache.data_ptr()), *vd = static_cast<F*>(v_cache.data_ptr());
    at::parallel_for(0, slots.numel(), grain_rows(2 * row), [&](int64_t lo, int64_t hi) {
      for (int64_t t = lo; t < hi; ++t) {
        kv_fp8::quantize_row(kp + t * row, kd + s[t] * row, row, ks);
        kv_fp8::quantize_row(vp + t * row, vd + s[t] * row, row, vs);
      }
    });
  });
}

// Keys and values of this step's tokens into their slots of the paged cache
// [num_blocks, block_size, kv_heads, dim], in place (k and v converted to the cache's dtype; into an fp8
// cache quantised with k_scale and v_scale, which a cache of another dtype ignores).
void write_kv_cache(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
                    const at::Tensor& slot_mapping, double k_scale, double v_scale) {
  const at::Tensor slots = checked_slots(slot_mapping, k_cache, v_cache);
  if (kv_fp8::is_fp8(k_cache.scalar_type())) return write_kv_cache_fp8(k, v, k_cache, v_cache, slots, k_scale, v_scale);
  const at::Tensor kc = k.to(k_cache.scalar_type()).contiguous(), vc = v.to(k_cache.scalar_type()).contiguous();
  const int64_t row = k_cache.size(2) * k_cache.size(3);
  TORCH_CHECK(kc.numel() == slots.numel() * row && vc.numel() == kc.numel(), "k/v do not match the slot mapping");
  const int64_t* s = slots.data_ptr<int64_t>();
  with_dtype(k_cache.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    const T *ks = kc.data_ptr<T>(), *vs = vc.data_ptr<T>();
    T *kd = k_cache.data_ptr<T>(), *vd = v_cache.data_ptr<T>();
    at::parallel_for(0, slots.numel(), grain_rows(2 * row), [&](int64_t lo, int64_t hi) {
      for (int64_t t = lo; t < hi; ++t) {
        std::copy(ks + t * row, ks + (t + 1) * row, kd + s[t] * row);
        std::copy(vs + t * row, vs + (t + 1) * row, vd + s[t] * row);
      }
    });
  });
}

// k rotated (in T, as a cache of qkv's dtype would hold it) and v quantised into an fp8 cache's slot `slot`.
template <typename T, typename F>
inline void rotate_into_fp8(const T* k, F* kd, F* vd, const float* cos, int64_t half, int64_t num_kv_heads,
                            int64_t dim, float k_scale, float v_scale, std::vector<T>& rotated) {
  const int64_t row = num_kv_heads * dim;
  rotated.resize(row);
  for (int64_t h = 0; h < num_kv_heads; ++h) rotate_head<T>(k + h * dim, rotated.data() + h * dim, cos, cos + half, half);
  kv_fp8::quantize_row(rotated.data(), kd, row, k_scale);
  kv_fp8::quantize_row(k + row, vd, row, v_scale);
}

// apply_rotary + write_kv_cache straight from the fused QKV output qkv [tokens, (heads + 2 kv_heads) * dim]
// (rows contiguous, the cache in qkv's dtype or fp8): returns q rotated [tokens, heads, dim]; k is rotated into
// its cache slot and v copied into its own (quantised with k_scale and v_scale into an fp8 cache). One call
// instead of the split views, a rotated k and the copies write_kv_cache makes (a decode step's per-layer
// overhead, kernels.dispatch.rotary_and_cache).
at::Tensor rotary_and_cache(const at::Tensor& qkv, int64_t num_heads, int64_t num_kv_heads, const at::Tensor& positions,
                            const at::Tensor& cos_sin_cache, at::Tensor& k_cache, at::Tensor& v_cache,
                            const at::Tensor& slot_mapping, double k_scale, double v_scale) {
  check_float_or_bf16(qkv, "qkv");
  check_cpu(cos_sin_cache, "cos_sin_cache", at::kFloat);
  const at::Tensor slots = checked_slots(slot_mapping, k_cache, v_cache);
  const bool fp8 = kv_fp8::is_fp8(k_cache.scalar_type());
  TORCH_CHECK(fp8 || k_cache.scalar_type() == qkv.scalar_type(), "the KV cache must be in qkv's dtype or fp8");
  const int64_t dim = cos_sin_cache.size(1), half = dim / 2;
  TORCH_CHECK(num_heads > 0 && num_kv_heads > 0 && k_cache.size(2) == num_kv_heads && k_cache.size(3) == dim,
              "the KV cache must be [num_blocks, block_size, ", num_kv_heads, ", ", dim, "]");
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) == (num_heads + 2 * num_kv_heads) * dim,
              "qkv must be [tokens, (", num_heads, " + 2 x ", num_kv_heads, ") x ", dim, "] with contiguous rows");
  const int64_t tokens = qkv.size(0), row = num_kv_heads * dim;
  TORCH_CHECK(slots.numel() == tokens, "one slot per token: ", slots.numel(), " for ", tokens);
  const at::Tensor cache = cos_sin_cache.contiguous();
  const at::Tensor pos = checked_positions(positions, tokens, cache.size(0));
  at::Tensor q_out = at::empty({tokens, num_heads, dim}, qkv.options());
  const int64_t* p = pos.data_ptr<int64_t>();
  const int64_t* s = slots.data_ptr<int64_t>();
  const float* cs = cache.data_ptr<float>();
  with_dtype(qkv.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    const T* in = qkv.data_ptr<T>();
    T* qd = q_out.data_ptr<T>();
    at::parallel_for(0, tokens, grain_rows((num_heads + 2 * num_kv_heads) * dim), [&](int64_t lo, int64_t hi) {
      std::vector<T> rotated;  // (fp8: a rotated k row before it is quantised)
      for (int64_t t = lo; t < hi; ++t) {
        const float* cos = cs + p[t] * dim;
        const T* q = in + t * qkv.stride(0);
        const T* k = q + num_heads * dim;
        for (int64_t h = 0; h < num_heads; ++h)
          rotate_head<T>(q + h * dim, qd + (t * num_heads + h) * dim, cos, cos + half, half);
        if (fp8) {
          kv_fp8::with_fp8(k_cache.scalar_type(), [&](auto f) {
            using F = decltype(f);
            rotate_into_fp8<T, F>(k, static_cast<F*>(k_cache.data_ptr()) + s[t] * row,
                                  static_cast<F*>(v_cache.data_ptr()) + s[t] * row, cos, half, num_kv_heads, dim,
                                  static_cast<float>(k_scale), static_cast<float>(v_scale), rotated);
          });
          continue;
        }
        T *kd = k_cache.data_ptr<T>(), *vd = v_cache.data_ptr<T>();
        for (int64_t h = 0; h < num_kv_heads; ++h)
          rotate_head<T>(k + h * dim, kd + s[t] * row + h * dim, cos, cos + half, half);
        std::copy(k + row, k + 2 * row, vd + s[t] * row);
      }
    });
  });
  return q_out;
}

// The kernel decode_attention runs for `family` and this head_dim here: the family's own, avx2's for a head_dim
// avx512 does not cover, or nullptr (the portable loop).
static decode_attn::Kernel family_kernel(const std::string& family, int64_t dim) {
  if (family == "avx512" && decode_attn::avx512_covers(dim)) return decode_attn::avx512_run;
  if (family != "portable" && decode_attn::avx2_covers(dim)) return decode_attn::avx2_run;
  return nullptr;
}

// Attention of single query rows over the paged cache. Row r belongs to sequence seq[r]
// and sees its first visible[r] positions. `family` (kernels/isa.py): "avx512" or "avx2" run that
// family's kernel (decode_attention.h) where it covers the head_dim; "portable", and any head_dim no
// family covers, the loop below: one task per row, walking the row's blocks in order and reading each
// position's keys (then values) of all KV heads as one contiguous run; softmax in fp32, two passes. A
// bf16 cache is read as bf16 (half the bytes) and widened in registers; sums and the output row are
// fp32 until the row is stored. With `lse` (decode_attention_lse) a family kernel also stores each row's
// log-sum-exp there, and a row may see no position. An fp8 cache (family kernels only) is read as stored *
// k_scale (keys) and stored * v_scale (values); a cache of q's dtype ignores the scales.
static at::Tensor attend_rows(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                              const at::Tensor& block_tables, const at::Tensor& seq, const at::Tensor& visible,
                              double scale, const std::string& family, float* lse, double k_scale, double v_scale,
                              const at::Tensor* first = nullptr) {
  TORCH_CHECK(family == "avx512" || family == "avx2" || family == "portable", "no decode attention for the family ",
              family, " (avx512, avx2, portable)");
  check_float_or_bf16(q, "q");
  const auto cache = k_cache.scalar_type() == at::kFloat8_e4m3fn ? decode_attn::CacheKind::kE4M3
                     : k_cache.scalar_type() == at::kFloat8_e5m2 ? decode_attn::CacheKind::kE5M2
                                                                  : decode_attn::CacheKind::kSame;
  check_cpu(k_cache, "k_cache", cache == decode_attn::CacheKind::kSame ? q.scalar_type() : k_cache.scalar_type());
  check_cpu(v_cache, "v_cache", k_cache.scalar_type());
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the KV cache must be contiguous");
  const at::Tensor qc = q.contiguous();
  const at::Tensor tables = block_tables.to(at::kInt).contiguous();
  const at::Tensor seqs = seq.to(at::kInt).contiguous(), lens = visible.to(at::kInt).contiguous();
  const int64_t rows = qc.size(0), heads = qc.size(1), dim = qc.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2), num_blocks = k_cache.size(0);
  TORCH_CHECK(heads % kv_heads == 0, heads, " query heads do not share ", kv_heads, " KV heads evenly");
  TORCH_CHECK(k_cache.size(3) == dim, "q and the KV cache differ in head_dim");
  TORCH_CHECK(tables.dim() == 2 && seqs.numel() == rows && lens.numel() == rows,
              "one sequence and one length per query row, and a 2-d block table");
  const int64_t group = heads / kv_heads, width = tables.size(1), row_floats = kv_heads * dim;
  const int32_t *bt = tables.data_ptr<int32_t>(), *sq = seqs.data_ptr<int32_t>(), *ln = lens.data_ptr<int32_t>();
  const at::Tensor starts = first != nullptr ? first->to(at::kInt).contiguous() : at::Tensor();
  const int32_t* fs = first != nullptr ? starts.data_ptr<int32_t>() : nullptr;
  TORCH_CHECK(fs == nullptr || starts.numel() == rows, "one first position per query row");
  int64_t max_len = 0;
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(sq[r] >= 0 && sq[r] < tables.size(0), "row ", r, " names sequence ", sq[r], " of ", tables.size(0));
    TORCH_CHECK(ln[r] > (lse == nullptr ? 0 : -1) && ln[r] <= width * block_size, "row ", r, " sees ", ln[r], " positions; its block table holds ",
                width * block_size);
    const int64_t from = fs != nullptr ? fs[r] : 0;  // (a sliding window's first position; blocks before it unread)
    TORCH_CHECK(from >= 0 && from <= ln[r] && (from < ln[r] || lse != nullptr), "row ", r, " starts at position ",
                from, " of its ", ln[r]);
    for (int64_t b = from / block_size; b < (ln[r] + block_size - 1) / block_size; ++b) {
      const int32_t block = bt[static_cast<int64_t>(sq[r]) * width + b];
      TORCH_CHECK(block >= 0 && block < num_blocks, "block ", block, " is outside the KV cache");
    }
    max_len = std::max<int64_t>(max_len, ln[r]);
  }
  at::Tensor out = at::empty_like(qc);
  const float fscale = static_cast<float>(scale);
  const decode_attn::Problem problem{qc.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), bt, sq, ln,
                                     rows, heads, kv_heads, dim, block_size, width, max_len, fscale,
                                     q.scalar_type() == at::kBFloat16, lse, cache, static_cast<float>(k_scale),
                                     static_cast<float>(v_scale), fs};
  if (const auto kernel = family_kernel(family, dim)) {
    kernel(problem);
    return out;
  }
  TORCH_CHECK(lse == nullptr && fs == nullptr,
              "the portable decode attention returns no lse and sees no window (a family kernel does)");
  TORCH_CHECK(cache == decode_attn::CacheKind::kSame,
              "the portable decode attention reads no fp8 cache (a family kernel does; kernels.cpu_ops falls back to "
              "the torch reference)");
  with_dtype(q.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    const T *qp = qc.data_ptr<T>(), *kp = k_cache.data_ptr<T>(), *vp = v_cache.data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, rows, grain_rows(2 * max_len * row_floats), [&](int64_t lo, int64_t hi) {
      std::vector<float> scores(heads * max_len);  // [head][position]
      std::vector<float> qf(heads * dim), of(heads * dim);
      for (int64_t r = lo; r < hi; ++r) {
        const int64_t len = ln[r];
        const int32_t* table = bt + static_cast<int64_t>(sq[r]) * width;
        for (int64_t i = 0; i < heads * dim; ++i) qf[i] = f32(qp[r * heads * dim + i]);
        for (int64_t t = 0; t < len; ++t) {
          const T* key = kp + (table[t / block_size] * block_size + t % block_size) * row_floats;
          for (int64_t h = 0; h < heads; ++h)
            scores[h * max_len + t] = dot(qf.data() + h * dim, key + (h / group) * dim, dim) * fscale;
        }
        for (int64_t h = 0; h < heads; ++h) {
          float* s = scores.data() + h * max_len;
          const float m = *std::max_element(s, s + len);
          float total = 0.f;
#pragma omp simd reduction(+ : total)
          for (int64_t t = 0; t < len; ++t) {
            s[t] = exp_poly(s[t] - m);
            total += s[t];
          }
          const float inv = 1.f / total;
#pragma omp simd
          for (int64_t t = 0; t < len; ++t) s[t] *= inv;
        }
        std::fill(of.begin(), of.end(), 0.f);
        for (int64_t t = 0; t < len; ++t) {
          const T* value = vp + (table[t / block_size] * block_size + t % block_size) * row_floats;
          for (int64_t h = 0; h < heads; ++h) {
            const float p = scores[h * max_len + t];
            const T* v = value + (h / group) * dim;
            float* o = of.data() + h * dim;
#pragma omp simd
            for (int64_t i = 0; i < dim; ++i) o[i] += p * f32(v[i]);
          }
        }
        T* orow = op + r * heads * dim;
        for (int64_t i = 0; i < heads * dim; ++i) orow[i] = to<T>(of[i]);
      }
    });
  });
  return out;
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq, const at::Tensor& visible,
                            double scale, const std::string& family, double k_scale, double v_scale) {
  return attend_rows(q, k_cache, v_cache, block_tables, seq, visible, scale, family, nullptr, k_scale, v_scale);
}

// decode_attention and each row's log-sum-exp of its scaled scores, [rows, heads] fp32, for context
// parallelism's merge (attention_merge.cpp); a row of no positions gives output 0 and lse -inf.
std::vector<at::Tensor> decode_attention_lse(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                             const at::Tensor& block_tables, const at::Tensor& seq,
                                             const at::Tensor& visible, double scale, const std::string& family,
                                             double k_scale, double v_scale) {
  at::Tensor lse = at::empty({q.size(0), q.size(1)}, q.options().dtype(at::kFloat));
  return {attend_rows(q, k_cache, v_cache, block_tables, seq, visible, scale, family, lse.data_ptr<float>(), k_scale,
                      v_scale),
          lse};
}

// decode_attention_lse where row r sees positions [first[r], visible[r]) of its sequence: a sliding window, whose
// blocks before it are not read (the hybrid KV cache manager may have given them to another request).
std::vector<at::Tensor> decode_attention_window(const at::Tensor& q, const at::Tensor& k_cache,
                                                const at::Tensor& v_cache, const at::Tensor& block_tables,
                                                const at::Tensor& seq, const at::Tensor& visible,
                                                const at::Tensor& first, double scale, const std::string& family,
                                                double k_scale, double v_scale) {
  at::Tensor lse = at::empty({q.size(0), q.size(1)}, q.options().dtype(at::kFloat));
  return {attend_rows(q, k_cache, v_cache, block_tables, seq, visible, scale, family, lse.data_ptr<float>(), k_scale,
                      v_scale, &first),
          lse};
}

// Whether decode_attention's `family` runs a family kernel (not the portable loop) for this head_dim here.
bool decode_attention_covers(const std::string& family, int64_t dim) { return family_kernel(family, dim) != nullptr; }

// SiLU(gate) * up of x = cat(gate, up) along the last dimension; in bf16 SiLU(gate) is rounded to bf16
// before the product, as torch's F.silu(gate) * up does.
at::Tensor silu_and_mul(const at::Tensor& x) {
  check_float_or_bf16(x, "x");
  const at::Tensor xc = x.contiguous();
  const int64_t width = xc.size(-1) / 2, rows = xc.numel() / xc.size(-1);
  auto sizes = xc.sizes().vec();
  sizes.back() = width;
  at::Tensor out = at::empty(sizes, xc.options());
  with_dtype(x.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    const T* src = xc.data_ptr<T>();
    T* dst = out.data_ptr<T>();
    at::parallel_for(0, rows, grain_rows(2 * width), [&](int64_t lo, int64_t hi) {
      for (int64_t r = lo; r < hi; ++r) {
        const T *gate = src + r * 2 * width, *up = gate + width;
        T* o = dst + r * width;
#pragma omp simd
        for (int64_t i = 0; i < width; ++i) {
          const float g = f32(gate[i]);
          o[i] = to<T>(round_as<T>(g / (1.f + exp_poly(-g))) * f32(up[i]));
        }
      }
    });
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "(x + residual) RMSNorm");
  m.def("apply_rotary", &apply_rotary, "rotary embedding of q and k");
  m.def("write_kv_cache", &write_kv_cache, "write k and v into the paged cache (fp8: quantised with the scales)",
        pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("k_cache"), pybind11::arg("v_cache"),
        pybind11::arg("slot_mapping"), pybind11::arg("k_scale") = 1.0, pybind11::arg("v_scale") = 1.0);
  m.def("rotary_and_cache", &rotary_and_cache, "q rotated, k rotated and v written into the cache, from fused QKV",
        pybind11::arg("qkv"), pybind11::arg("num_heads"), pybind11::arg("num_kv_heads"), pybind11::arg("positions"),
        pybind11::arg("cos_sin_cache"), pybind11::arg("k_cache"), pybind11::arg("v_cache"),
        pybind11::arg("slot_mapping"), pybind11::arg("k_scale") = 1.0, pybind11::arg("v_scale") = 1.0);
  m.def("decode_attention", &decode_attention, "single-query attention over the paged cache (a family's kernel)",
        pybind11::arg("q"), pybind11::arg("k_cache"), pybind11::arg("v_cache"), pybind11::arg("block_tables"),
        pybind11::arg("seq"), pybind11::arg("visible"), pybind11::arg("scale"), pybind11::arg("family") = "portable",
        pybind11::arg("k_scale") = 1.0, pybind11::arg("v_scale") = 1.0);
  m.def("decode_attention_lse", &decode_attention_lse, "decode_attention and each row's log-sum-exp (a family's kernel)",
        pybind11::arg("q"), pybind11::arg("k_cache"), pybind11::arg("v_cache"), pybind11::arg("block_tables"),
        pybind11::arg("seq"), pybind11::arg("visible"), pybind11::arg("scale"), pybind11::arg("family"),
        pybind11::arg("k_scale") = 1.0, pybind11::arg("v_scale") = 1.0);
  m.def("mla_attention_rows", &mla_attention_rows_cpu,
        "absorbed latent attention of query rows over the paged latent cache, with each row's lse (mla_decode.cpp)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("merge_attention_states", &merge_attention_states, "partial attentions merged by their lse (attention_merge.cpp)");
  m.def("decode_attention_window", &decode_attention_window,
        "decode_attention_lse where each row sees [first, visible) of its positions (a family's kernel)",
        pybind11::arg("q"), pybind11::arg("k_cache"), pybind11::arg("v_cache"), pybind11::arg("block_tables"),
        pybind11::arg("seq"), pybind11::arg("visible"), pybind11::arg("first"), pybind11::arg("scale"),
        pybind11::arg("family"), pybind11::arg("k_scale") = 1.0, pybind11::arg("v_scale") = 1.0);
  m.def("decode_attention_covers", &decode_attention_covers, "whether a family's kernel covers this head_dim here");
  m.def("attention_avx512_available", &decode_attn::avx512_available, "whether this CPU runs the avx512 decode attention");
  m.def("silu_and_mul", &silu_and_mul, "SiLU(gate) * up");
  m.def("lora_add", &lora_add, "multi-LoRA's product per token, in place (lora_ops.h)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("fused_moe", &fused_moe, "the experts of a mixture-of-experts layer (moe_ops.cpp)");
  m.def("pack_bf16_weight", &pack_bf16_weight, "a weight packed for a family's linear_bf16 (bf16_linear.h)");
  m.def("bf16_avx512_available", &bf16_avx512_available, "whether this CPU runs the avx512_bf16 linear_bf16");
  m.def("linear_bf16", &linear_bf16, "x W^T + b with bf16 weights, fp32 sums (bf16_linear.cpp)");
  m.def("quant_linear", &quant_linear, "x W^T + b with W quantised in groups along K (quant_linear.cpp)");
  m.def("int8_vnni_available", &int8_vnni_available, "whether this CPU runs the avx512_vnni int8 products");
  m.def("quant_avx512_available", &quant_avx512_available, "whether this CPU runs the avx512 fp32 quantised products");
  m.def("quant_bf16_available", &quant_bf16_available,
        "whether this CPU runs the avx512_bf16 quantised products (the many-row fp32 ones on vdpbf16ps)");
  m.def("quant_isa", &quant_isa, "the instruction family quant_linear was compiled for");
  m.def("quant_fp8", []() { return true; }, "quant_linear takes float8_e4m3fn weights (decoded in registers)");
  pybind11::class_<LayerLinear>(m, "LayerLinear")
      .def(pybind11::init<const std::string&, at::Tensor, c10::optional<at::Tensor>, c10::optional<at::Tensor>,
                          c10::optional<at::Tensor>, int64_t, bool, c10::optional<at::Tensor>,
                          c10::optional<at::Tensor>>(),
           pybind11::arg("kind"), pybind11::arg("weight"), pybind11::arg("scales") = pybind11::none(),
           pybind11::arg("mins") = pybind11::none(), pybind11::arg("bias") = pybind11::none(),
           pybind11::arg("out_features") = 0, pybind11::arg("int8_activations") = false,
           pybind11::arg("lora_a") = pybind11::none(), pybind11::arg("lora_bt") = pybind11::none())
      .def("__call__",
           static_cast<at::Tensor (LayerLinear::*)(const at::Tensor&, const std::string&) const>(
               &LayerLinear::operator()),
           "x W^T (+ b) as the layer's plan computes it", pybind11::arg("x"),
           pybind11::arg("quant_family") = "", pybind11::call_guard<pybind11::gil_scoped_release>());
  pybind11::class_<DecoderLayerPlan>(m, "DecoderLayerPlan")
      .def(pybind11::init<at::Tensor, double, at::Tensor, double, LayerLinear, LayerLinear, LayerLinear, LayerLinear,
                          int64_t, int64_t, double>())
      .def("forward", &DecoderLayerPlan::forward, "a dense decoder layer as one call (decoder_layer.h)",
           pybind11::arg("x"), pybind11::arg("residual"), pybind11::arg("positions"), pybind11::arg("cos_sin"),
           pybind11::arg("k_cache"), pybind11::arg("v_cache"), pybind11::arg("slot_mapping"),
           pybind11::arg("block_tables"), pybind11::arg("seqs"), pybind11::arg("visible"),
           pybind11::arg("attention_family"), pybind11::arg("quant_family"),
           pybind11::arg("lora_slots") = pybind11::none(), pybind11::arg("k_scale") = 1.0,
           pybind11::arg("v_scale") = 1.0, pybind11::call_guard<pybind11::gil_scoped_release>());
  pybind11::class_<ShmComm>(m, "ShmComm")
      .def(pybind11::init<const std::string&, int64_t, int64_t, int64_t, double>())
      .def_static("file_bytes", &ShmComm::file_bytes)
      .def("slot_bytes", &ShmComm::slot_bytes)
      .def("all_reduce", &ShmComm::all_reduce, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("broadcast", &ShmComm::broadcast, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("all_gather", &ShmComm::all_gather, pybind11::call_guard<pybind11::gil_scoped_release>());
}
