// Linear products with bf16 weights and fp32 arithmetic on CPU tensors (bf16_linear.cpp).
#pragma once

#include <torch/extension.h>

// W [N, K] (any float dtype) in bf16, re-laid for linear_bf16: [ceil(N/16), K, 16], zero-padded.
at::Tensor pack_bf16_weight(const at::Tensor& weight);

// x [..., K] (float32 or bfloat16) times the packed W^T, plus bias: [..., out_features] in x's
// dtype; sums in fp32, one rounding at the end (torch's bf16 linear does the same).
at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                       const c10::optional<at::Tensor>& bias);
