// Decode attention over the paged KV cache, by kernel family (kernels/isa.py): single query rows, each
// seeing the first visible[r] positions of its sequence. cpu_ops.cpp validates the arguments and keeps
// a portable loop for what no family covers (another head_dim, a build below AVX2); the families are
// decode_attention_avx2.cpp (8-wide FMA) and decode_attention_avx512.cpp (16-wide FMA), both from the
// one algorithm in decode_attention_impl.h.
#pragma once

#include <ATen/ATen.h>  // (not torch/extension.h: its Python bindings cost each file ~20 s of compiling)

#include <cstdint>
#include <vector>

namespace decode_attn {

// The cache's element type: q's own (fp32 or bf16), or fp8 (--kv-cache-dtype fp8, kernels/kv_quant.py): each
// element read is `stored * scale` (k_scale for keys, v_scale for values), which the kernels fold into the
// query's scale and the output row rather than multiply per element.
enum class CacheKind { kSame = 0, kE4M3 = 1, kE5M2 = 2 };

// What a family's kernel reads; the caller has checked every sequence index, length and block id.
struct Problem {
  const void* q;        // [rows, heads, dim], fp32 or bf16
  const void* k_cache;  // [num_blocks, block_size, kv_heads, dim], q's dtype or fp8 (cache)
  const void* v_cache;
  void* out;            // like q
  const int32_t* block_tables;  // [*, width]
  const int32_t* seq;           // [rows]
  const int32_t* visible;       // [rows]
  int64_t rows, heads, kv_heads, dim, block_size, width, max_len;
  float scale;
  bool bf16;  // q (and a cache of q's dtype) are bf16 (else fp32)
  float* lse = nullptr;  // [rows, heads]: each row's log-sum-exp, where asked (rows may then see no position)
  CacheKind cache = CacheKind::kSame;
  float k_scale = 1.f, v_scale = 1.f;  // an fp8 cache's per-tensor scales (1 for a cache of q's dtype)
  // [rows]: the first position each row sees (a sliding window: it sees [first, visible)); null: every row from 0
  const int32_t* first = nullptr;
  int64_t row_first(int64_t r) const { return first != nullptr ? first[r] : 0; }
  int64_t row_len(int64_t r) const { return visible[r] - row_first(r); }
};

// Whether the family runs here (the CPU has its instructions and this build could emit them) and
// covers this head_dim; run() computes the attention into p.out.
using Kernel = void (*)(const Problem&);
bool avx2_covers(int64_t dim);
void avx2_run(const Problem& p);
bool avx512_available();
bool avx512_covers(int64_t dim);
void avx512_run(const Problem& p);

}  // namespace decode_attn

// R partial attentions [R, T, H, D] (fp32 or bf16) and their lses [R, T, H] fp32 merged into [T, H, D] and
// [T, H] (attention_merge.cpp; kernels.reference.merge_attention_states is the oracle).
std::vector<at::Tensor> merge_attention_states(const at::Tensor& outputs, const at::Tensor& lses);
