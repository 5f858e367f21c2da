// Absorbed multi-head latent attention (DeepSeek's MLA) over the paged latent cache, on the CPU:
// kernels.mla_reference.mla_attention_rows is the oracle. Each query row q [heads, latent] (q_nope W_UK and
// q_pe, stage_worker.mla) is scored against the first visible[r] latents of its sequence, every head sharing
// each latent (one KV head of width `latent`, as MQA), and returns the attention-weighted c_kv (a latent's first
// kv_lora_rank values) [heads, kv_lora_rank] and the log-sum-exp of the scaled scores [heads], in fp32 arithmetic.
//
// The cache holds each latent in two halves, the first in k_cache and the second in v_cache, each
// [blocks, block_size, 1, latent / 2]. Where the torch reference gathers every latent a row sees into a new
// tensor and multiplies it twice (and its batched matmuls take one head row at a time against it), this reads
// each latent once per piece of positions, widened to fp32 once, for all heads, and sums the weighted c_kv in
// register tiles of heads by columns.
//
// Work: one item per (row, piece of its positions). A piece is long enough that its heads' output rows stay
// in cache and short enough that batch 1 at a long context still gives every thread pieces; the pieces' softmax
// partials (max, sum, unnormalised output) merge per row at the end, as flash decoding does.
#include "mla_decode.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

#include "exp_poly.h"

inline float widen(float v) { return v; }
inline float widen(c10::BFloat16 v) { return static_cast<float>(v); }

// s[h * stride] = scale * q_h . row for every head: four heads at a time, four independent sums (one head's
// sum alone is a chain of dependent FMAs, bound by their latency rather than their rate)
inline void score_heads(const float* q, const float* row, int64_t heads, int64_t n, float scale, float* s,
                        int64_t stride) {
  int64_t h = 0;
  for (; h + 4 <= heads; h += 4) {
    const float *q0 = q + h * n, *q1 = q0 + n, *q2 = q1 + n, *q3 = q2 + n;
    float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
    for (int64_t i = 0; i < n; ++i) {
      const float r = row[i];
      a0 += q0[i] * r;
      a1 += q1[i] * r;
      a2 += q2[i] * r;
      a3 += q3[i] * r;
    }
    s[h * stride] = a0 * scale;
    s[(h + 1) * stride] = a1 * scale;
    s[(h + 2) * stride] = a2 * scale;
    s[(h + 3) * stride] = a3 * scale;
  }
  for (; h < heads; ++h) {
    float a = 0.f;
#pragma omp simd reduction(+ : a)
    for (int64_t i = 0; i < n; ++i) a += q[h * n + i] * row[i];
    s[h * stride] = a * scale;
  }
}

// acc[h][j] = sum over the piece's positions i of w[h][i] c_i[j], c_i a latent's first `rank` values (c_kv).
// Tiles of 4 heads by 32 columns keep their sums in registers over every position (each c_i tile loaded once
// for 4 heads), where a position-by-position loop loads and stores every head's whole output row per position.
inline void weighted_sums(const float* latents, int64_t latent, const float* w, int64_t count, int64_t heads,
                          int64_t rank, float* acc) {
  constexpr int64_t kHeads = 4, kCols = 32;
  int64_t h0 = 0;
  for (; h0 + kHeads <= heads; h0 += kHeads) {
    const float *w0 = w + h0 * count, *w1 = w0 + count, *w2 = w1 + count, *w3 = w2 + count;
    int64_t j0 = 0;
    for (; j0 + kCols <= rank; j0 += kCols) {
      float t0[kCols] = {}, t1[kCols] = {}, t2[kCols] = {}, t3[kCols] = {};
      for (int64_t i = 0; i < count; ++i) {
        const float* c = latents + i * latent + j0;
        const float a0 = w0[i], a1 = w1[i], a2 = w2[i], a3 = w3[i];
#pragma omp simd
        for (int64_t j = 0; j < kCols; ++j) {
          t0[j] += a0 * c[j];
          t1[j] += a1 * c[j];
          t2[j] += a2 * c[j];
          t3[j] += a3 * c[j];
        }
      }
      for (int64_t j = 0; j < kCols; ++j) {
        acc[h0 * rank + j0 + j] = t0[j];
        acc[(h0 + 1) * rank + j0 + j] = t1[j];
        acc[(h0 + 2) * rank + j0 + j] = t2[j];
        acc[(h0 + 3) * rank + j0 + j] = t3[j];
      }
    }
    for (int64_t k = 0; k < kHeads && j0 < rank; ++k) {  // the columns past the last whole tile
      float* o = acc + (h0 + k) * rank;
      std::fill(o + j0, o + rank, 0.f);
      for (int64_t i = 0; i < count; ++i)
        for (int64_t j = j0; j < rank; ++j) o[j] += w[(h0 + k) * count + i] * latents[i * latent + j];
    }
  }
  for (; h0 < heads; ++h0) {  // the heads past the last group of 4
    float* o = acc + h0 * rank;
    std::fill(o, o + rank, 0.f);
    for (int64_t i = 0; i < count; ++i) {
      const float a0 = w[h0 * count + i];
      const float* c = latents + i * latent;
#pragma omp simd
      for (int64_t j = 0; j < rank; ++j) o[j] += a0 * c[j];
    }
  }
}

struct Piece {
  int64_t row, first, count;  // positions [first, first + count) of the row's sequence
};

struct Args {
  int64_t heads, latent, half, rank, block_size, width;
  float scale;
  const int32_t* tables;
  const int32_t* seqs;
};

// One piece: its scores, softmax partials (m, l) and unnormalised output acc [heads, rank], all fp32.
template <typename T>
void run_piece(const Args& a, const Piece& p, const float* q, const T* k_cache, const T* v_cache, float* acc,
               float* m, float* l, std::vector<float>& latents, std::vector<float>& scores) {
  const int32_t* table = a.tables + static_cast<int64_t>(a.seqs[p.row]) * a.width;
  latents.resize(p.count * a.latent);
  scores.resize(a.heads * p.count);
  for (int64_t i = 0; i < p.count; ++i) {  // the piece's latents, widened once
    const int64_t t = p.first + i;
    const int64_t slot = static_cast<int64_t>(table[t / a.block_size]) * a.block_size + t % a.block_size;
    const T* k = k_cache + slot * a.half;
    const T* v = v_cache + slot * a.half;
    float* row = latents.data() + i * a.latent;
    for (int64_t j = 0; j < a.half; ++j) row[j] = widen(k[j]);
    for (int64_t j = 0; j < a.half; ++j) row[a.half + j] = widen(v[j]);
    score_heads(q, row, a.heads, a.latent, a.scale, scores.data() + i, p.count);
  }
  for (int64_t h = 0; h < a.heads; ++h) {
    float* s = scores.data() + h * p.count;
    const float top = *std::max_element(s, s + p.count);
    float total = 0.f;
#pragma omp simd reduction(+ : total)
    for (int64_t i = 0; i < p.count; ++i) {
      s[i] = exp_poly(s[i] - top);
      total += s[i];
    }
    m[h] = top;
    l[h] = total;
  }
  weighted_sums(latents.data(), a.latent, scores.data(), p.count, a.heads, a.rank, acc);
}

}  // namespace

std::vector<at::Tensor> mla_attention_rows_cpu(const at::Tensor& q, const at::Tensor& k_cache,
                                               const at::Tensor& v_cache, const at::Tensor& block_tables,
                                               const at::Tensor& row_seqs, const at::Tensor& row_visible,
                                               double scale, int64_t kv_lora_rank) {
  TORCH_CHECK(q.device().is_cpu() && (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16),
              "q must be a float32 or bfloat16 CPU tensor");
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be contiguous [rows, heads, latent]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.size(2) == 1,
              "the latent cache must be two tensors [blocks, block_size, 1, latent / 2] of one shape");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "the latent cache must be in q's dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the latent cache must be contiguous");
  const int64_t rows = q.size(0), heads = q.size(1), latent = q.size(2), half = k_cache.size(3);
  TORCH_CHECK(latent == 2 * half, "q's latent (", latent, ") is not the cache's two halves of ", half);
  TORCH_CHECK(kv_lora_rank > 0 && kv_lora_rank <= latent, "kv_lora_rank ", kv_lora_rank, " is outside 1..", latent);
  for (const auto* t : {&block_tables, &row_seqs, &row_visible})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kInt && t->is_contiguous(),
                "block tables, rows' sequences and visible counts must be contiguous int32 CPU tensors");
  TORCH_CHECK(block_tables.dim() == 2 && row_seqs.numel() == rows && row_visible.numel() == rows,
              "one sequence and one visible count per row, block tables [sequences, width]");
  const int64_t blocks = k_cache.size(0), block_size = k_cache.size(1), width = block_tables.size(1);
  const int32_t *seqs = row_seqs.data_ptr<int32_t>(), *visible = row_visible.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  int64_t total = 0;
  for (int64_t r = 0; r < rows; ++r) {  // every index the kernel will follow, checked before it runs
    TORCH_CHECK(seqs[r] >= 0 && seqs[r] < block_tables.size(0), "row ", r, " names sequence ", seqs[r], " of ",
                block_tables.size(0));
    TORCH_CHECK(visible[r] >= 0 && visible[r] <= width * block_size, "row ", r, " sees ", visible[r],
                " positions; its block table holds ", width * block_size);
    const int32_t* table = tables + static_cast<int64_t>(seqs[r]) * width;
    for (int64_t b = 0; b * block_size < visible[r]; ++b)
      TORCH_CHECK(table[b] >= 0 && table[b] < blocks, "block ", table[b], " is outside the latent cache");
    total += visible[r];
  }
  auto out = at::zeros({rows, heads, kv_lora_rank}, q.options());
  auto lse = at::full({rows, heads}, -std::numeric_limits<float>::infinity(), q.options().dtype(at::kFloat));
  if (total == 0) return {out, lse};

  // pieces: at least 4 per thread over all rows' positions, at most 512 positions (and at least 32) each
  const int64_t threads = at::get_num_threads();
  const int64_t length = std::clamp<int64_t>((total + 4 * threads - 1) / (4 * threads), 32, 512);
  std::vector<Piece> pieces;
  std::vector<int64_t> first_piece(rows + 1);
  for (int64_t r = 0; r < rows; ++r) {
    first_piece[r] = static_cast<int64_t>(pieces.size());
    for (int64_t t = 0; t < visible[r]; t += length) pieces.push_back({r, t, std::min<int64_t>(length, visible[r] - t)});
  }
  first_piece[rows] = static_cast<int64_t>(pieces.size());
  const int64_t n = static_cast<int64_t>(pieces.size());
  std::vector<float> acc(n * heads * kv_lora_rank), m(n * heads), l(n * heads);
  const Args args{heads, latent, half, kv_lora_rank, block_size, width, static_cast<float>(scale), tables, seqs};

  const auto run = [&](auto zero) {
    using T = decltype(zero);
    const T* qp = q.data_ptr<T>();
    const T *kc = k_cache.data_ptr<T>(), *vc = v_cache.data_ptr<T>();
    at::parallel_for(0, n, 1, [&](int64_t lo, int64_t hi) {
      std::vector<float> qf(heads * latent), latents, scores;
      int64_t loaded = -1;
      for (int64_t i = lo; i < hi; ++i) {
        const Piece& p = pieces[i];
        if (p.row != loaded) {
          for (int64_t j = 0; j < heads * latent; ++j) qf[j] = widen(qp[p.row * heads * latent + j]);
          loaded = p.row;
        }
        run_piece<T>(args, p, qf.data(), kc, vc, acc.data() + i * heads * kv_lora_rank, m.data() + i * heads,
                     l.data() + i * heads, latents, scores);
      }
    });
    T* op = out.data_ptr<T>();
    float* lp = lse.data_ptr<float>();
    at::parallel_for(0, rows * heads, 16, [&](int64_t lo, int64_t hi) {
      std::vector<float> o(kv_lora_rank);
      for (int64_t c = lo; c < hi; ++c) {  // c: one (row, head); the row's pieces merged by their maxima
        const int64_t r = c / heads, h = c % heads;
        if (first_piece[r] == first_piece[r + 1]) continue;  // sees nothing: 0 and -inf
        float top = -std::numeric_limits<float>::infinity();
        for (int64_t i = first_piece[r]; i < first_piece[r + 1]; ++i) top = std::max(top, m[i * heads + h]);
        float sum = 0.f;
        std::fill(o.begin(), o.end(), 0.f);
        for (int64_t i = first_piece[r]; i < first_piece[r + 1]; ++i) {
          const float w = std::exp(m[i * heads + h] - top);
          sum += w * l[i * heads + h];
          const float* part = acc.data() + (i * heads + h) * kv_lora_rank;
          for (int64_t j = 0; j < kv_lora_rank; ++j) o[j] += w * part[j];
        }
        const float inv = 1.f / sum;
        T* dst = op + c * kv_lora_rank;
        for (int64_t j = 0; j < kv_lora_rank; ++j) dst[j] = static_cast<T>(o[j] * inv);
        lp[c] = top + std::log(sum);
      }
    });
  };
  if (q.scalar_type() == at::kBFloat16) {
    run(c10::BFloat16{});
  } else {
    run(float{});
  }
  return {out, lse};
}
