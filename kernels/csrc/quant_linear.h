// Linear products with weights quantised in groups along K (quant_linear.cpp): GGUF Q4_0 / Q4_1 /
// Q4_K / Q8_0 and per-channel int8, all re-laid at load into one of two forms.
#pragma once

#include <ATen/ATen.h>  // (not torch/extension.h: its Python bindings cost each file ~20 s of compiling)

// x [..., K] (float32 or bfloat16) times W^T (+ bias), W [N, K] in groups of G (a multiple of 32) along K:
//   4-bit: qs uint8 [N, K/2], each 32 weights in 16 bytes (byte j: weight j in the low nibble, weight
//          j+16 in the high one), w = scale * q + min, scales and mins [N, K/G];
//   8-bit: qs int8 [N, K], w = scale * q, scales [N, K/G], mins absent;
//   scales and mins float32, or both float16 (GGUF's own: fewer bytes a step; widened exactly).
// int8_activations: x is quantised to int8 per row and block of 32 (scale max|x|/127, llama.cpp's q8
// blocks; finer than dynamic per-token W8A8) and the products run on integers (vpmaddubsw / vpmaddwd);
// otherwise every product is fp32 with the weights dequantised exactly. Output in x's dtype.
// family (refused where the CPU lacks it): "avx2"; "avx512": the fp32 products 16 lanes wide, the
// integer ones avx2's; "avx512_vnni": the fp32 products avx512's, the integer ones on vpdpbusd;
// "avx512_bf16": avx512_vnni's, and the many-row products on vdpbf16ps: fp32 x split into two bf16 (hi + lo: x
// to 2^-18; the quants exact), or bf16 x (7 rows or more) against the weights dequantised to bf16, as a model
// served in bf16 holds them (the bf16 model's product, bias added before the one rounding). The few-row (decode)
// products have an avx512 tile (exact fp32 weights); the many-row ones are avx2's in the other families.
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scales,
                        const c10::optional<at::Tensor>& mins, const c10::optional<at::Tensor>& bias,
                        bool int8_activations, const std::string& family);

// Whether this CPU runs the avx512_vnni integer products.
bool int8_vnni_available();

// Whether this CPU runs the avx512 fp32 products (AVX-512 F, BW, VL, DQ).
bool quant_avx512_available();

// Whether this CPU runs the avx512_bf16 family (avx512_vnni's, and the many-row fp32 products on vdpbf16ps).
bool quant_bf16_available();

// The instruction family these kernels were compiled for ("avx2", or "none" where they are not built).
std::string quant_isa();
