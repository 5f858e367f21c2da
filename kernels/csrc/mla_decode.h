// Absorbed multi-head latent attention over the paged latent cache (mla_decode.cpp; kernels.mla_reference's
// mla_attention_rows is the oracle): the weighted c_kv [rows, heads, kv_lora_rank] in q's dtype and the lse of
// the scaled scores [rows, heads] fp32 of each query row over the first row_visible latents of its sequence.
#pragma once

#include <ATen/ATen.h>  // (not torch/extension.h: its Python bindings cost each file ~20 s of compiling)

#include <vector>

std::vector<at::Tensor> mla_attention_rows_cpu(const at::Tensor& q, const at::Tensor& k_cache,
                                               const at::Tensor& v_cache, const at::Tensor& block_tables,
                                               const at::Tensor& row_seqs, const at::Tensor& row_visible,
                                               double scale, int64_t kv_lora_rank);
