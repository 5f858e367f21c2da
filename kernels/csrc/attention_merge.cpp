// Partial attentions of the same query rows over disjoint sets of keys merged into the attention over
// their union by the partials' log-sum-exps (flash attention's merge; kernels.reference.merge_attention_states
// is the oracle): what context parallelism combines its ranks' results with. One C++ call, because on a CPU
// the torch reference's dozen small ops cost more than the arithmetic (a decode step merges once per layer).
//
// Per (row, head): m = max_r lse_r, w_r = exp(lse_r - m), out = sum_r w_r out_r / sum_r w_r,
// lse = m + log sum_r w_r, in fp32. A partial of lse -inf (no keys) adds nothing, whatever its output holds;
// where every partial is -inf the output is 0 and the lse -inf.
#include "decode_attention.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

template <typename T>
void merge_rows(const T* parts, const float* part_lses, T* out, float* lse, int64_t ranks, int64_t cells,
                int64_t dim, int64_t lo, int64_t hi) {
  std::vector<float> acc(dim), weights(ranks);
  for (int64_t c = lo; c < hi; ++c) {  // c: one (row, head)
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t r = 0; r < ranks; ++r) m = std::max(m, part_lses[r * cells + c]);
    if (std::isinf(m) && m < 0) m = 0.f;  // every partial empty: weights 0, no -inf - -inf
    float total = 0.f;
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t r = 0; r < ranks; ++r) {
      const float w = std::exp(part_lses[r * cells + c] - m);
      total += w;
      if (w == 0.f) continue;
      const T* o = parts + (r * cells + c) * dim;
#pragma omp simd
      for (int64_t i = 0; i < dim; ++i) acc[i] += w * static_cast<float>(o[i]);
    }
    const float inv = total > 0.f ? 1.f / total : 1.f;
    for (int64_t i = 0; i < dim; ++i) out[c * dim + i] = static_cast<T>(acc[i] * inv);
    lse[c] = m + std::log(total);
  }
}

}  // namespace

std::vector<at::Tensor> merge_attention_states(const at::Tensor& outputs, const at::Tensor& lses) {
  TORCH_CHECK(outputs.device().is_cpu() && lses.device().is_cpu(), "merge_attention_states runs on CPU tensors");
  TORCH_CHECK(outputs.dim() == 4 && lses.dim() == 3 && lses.sizes() == outputs.sizes().slice(0, 3),
              "outputs [R, T, H, D] and lses [R, T, H]");
  TORCH_CHECK(lses.scalar_type() == at::kFloat, "lses must be float32");
  TORCH_CHECK(outputs.scalar_type() == at::kFloat || outputs.scalar_type() == at::kBFloat16,
              "outputs must be float32 or bfloat16");
  const at::Tensor parts = outputs.contiguous(), part_lses = lses.contiguous();
  const int64_t ranks = parts.size(0), cells = parts.size(1) * parts.size(2), dim = parts.size(3);
  at::Tensor out = at::empty({parts.size(1), parts.size(2), dim}, parts.options());
  at::Tensor lse = at::empty({parts.size(1), parts.size(2)}, part_lses.options());
  // below this many floats of work a thread costs more to wake than the work
  const int64_t grain = std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(1, ranks * dim));
  at::parallel_for(0, cells, grain, [&](int64_t lo, int64_t hi) {
    if (parts.scalar_type() == at::kFloat)
      merge_rows(parts.data_ptr<float>(), part_lses.data_ptr<float>(), out.data_ptr<float>(), lse.data_ptr<float>(),
                 ranks, cells, dim, lo, hi);
    else
      merge_rows(parts.data_ptr<at::BFloat16>(), part_lses.data_ptr<float>(), out.data_ptr<at::BFloat16>(),
                 lse.data_ptr<float>(), ranks, cells, dim, lo, hi);
  });
  return {out, lse};
}
