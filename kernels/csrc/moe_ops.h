// The fused mixture-of-experts layer on fp32 CPU tensors (moe_ops.cpp).
#pragma once

#include <ATen/ATen.h>  // (not torch/extension.h: its Python bindings cost each file ~20 s of compiling)

// Semantics of kernels/moe_reference.py fused_moe: the experts this rank holds (w13[e] =
// cat(gate, up), w2[e] = down of global expert expert_start + e) applied to the tokens routed
// to them, weighted and summed per token; slots routed elsewhere contribute nothing.
at::Tensor fused_moe(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2,
                     const at::Tensor& topk_weights, const at::Tensor& topk_ids, int64_t expert_start);
