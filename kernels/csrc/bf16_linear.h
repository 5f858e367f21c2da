// Linear products with bf16 weights and fp32 sums on CPU tensors, in two kernel families:
// avx2 (bf16_linear.cpp: bf16 widened to fp32, 8-wide FMA, x in fp32) and avx512_bf16
// (bf16_linear_avx512bf16.cpp: vdpbf16ps, x in bf16). The family is chosen when the weight is packed;
// the packed layout says which one linear_bf16 runs.
#pragma once

#include <ATen/ATen.h>  // (not torch/extension.h: its Python bindings cost each file ~20 s of compiling)

#include <string>

// W [N, K] (any float dtype) in bf16, re-laid for the family's kernel:
//   "avx2":        [ceil(N/16), K, 16], zero-padded;
//   "avx512_bf16": [ceil(N/16), ceil(K/2), 32] (k in pairs), zero-padded; refused where the CPU lacks it.
at::Tensor pack_bf16_weight(const at::Tensor& weight, const std::string& family);

// x [..., K] (float32 or bfloat16) times the packed W^T, plus bias: [..., out_features] in x's
// dtype; sums in fp32, one rounding at the end (torch's bf16 linear does the same). The avx2 family
// multiplies fp32 x exactly; the avx512_bf16 one rounds fp32 x to bf16 first.
at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                       const c10::optional<at::Tensor>& bias);

// Whether this CPU runs the avx512_bf16 family (and this build has it).
bool bf16_avx512_available();

// One product for a family's kernel: x [M, K] (fp32 for avx2; bf16 with K even for avx512_bf16),
// the packed weight, and where the rows go.
struct Bf16Problem {
  const void* x;
  int64_t M, K;
  const uint16_t* w;
  int64_t blocks, N;
  const float* bias;  // or nullptr
  bool out_bf16;
  char* out;  // [M, N] fp32 or bf16
};

// out[row, n0 : n0 + 16] = acc (+ bias), in the output's dtype (bf16: rounded to nearest even); the
// tail block writes only the columns below N.
void store_block(const Bf16Problem& P, int64_t row, int64_t n0, const float* acc);

namespace bf16_avx512 {
bool available();
at::Tensor pack(const at::Tensor& weight);
void run(const Bf16Problem& P);
}  // namespace bf16_avx512
