// An fp8 KV cache's elements (--kv-cache-dtype fp8, kernels/kv_quant.py is the reference): a key or value x is
// stored as x / scale, saturated to the format's largest finite value and rounded to nearest even (c10's
// conversion, the one torch's .to() uses), and read as stored * scale. The scale is the layer's per-tensor
// k_scale or v_scale. Included by cpu_ops.cpp (the cache writes); the decode attention reads the cache in
// decode_attention_impl.h.
#pragma once

#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <ATen/ATen.h>  // (not torch/extension.h: its Python bindings cost each file ~20 s of compiling)

#include <algorithm>
#include <cstdint>

namespace kv_fp8 {

template <typename F>
constexpr float max_finite();
template <>
constexpr float max_finite<c10::Float8_e4m3fn>() { return 448.f; }
template <>
constexpr float max_finite<c10::Float8_e5m2>() { return 57344.f; }

// x / scale in F, saturated (c10's own conversion gives NaN or inf past the largest finite value)
template <typename F>
inline F quantize(float x, float scale) {
  const float m = max_finite<F>();
  return F(std::min(std::max(x / scale, -m), m));
}

template <typename F, typename T>
inline void quantize_row(const T* src, F* dst, int64_t n, float scale) {
  for (int64_t i = 0; i < n; ++i) dst[i] = quantize<F>(static_cast<float>(src[i]), scale);
}

inline bool is_fp8(at::ScalarType t) { return t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2; }

// Runs body(F{}) with F the C++ type of an fp8 dtype.
template <typename Body>
decltype(auto) with_fp8(at::ScalarType dtype, Body&& body) {
  TORCH_CHECK(is_fp8(dtype), "not an fp8 KV cache: ", dtype);
  if (dtype == at::kFloat8_e5m2) return body(c10::Float8_e5m2{});
  return body(c10::Float8_e4m3fn{});
}

}  // namespace kv_fp8
