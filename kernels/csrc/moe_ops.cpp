// Fused mixture-of-experts layer for fp32 CPU tensors: one call per layer, where the torch
// reference runs five ops per expert and a host round trip.
//
// The (token, k) slots routed to this rank's experts are counting-sorted by expert, so each
// expert's tokens are contiguous rows of the intermediate buffers. A decode step gives an
// expert a handful of tokens: the work is reading its weights, so work items are (expert,
// block of weight rows) over all threads, and each weight row, read once, is dotted with four
// token rows at a time (SiLU-and-mul fused into the gate/up pass, the routing weight into the
// down pass). An expert with many tokens (prefill) is compute-bound instead and goes through
// at::mm on its contiguous rows. The per-token sum over k runs last, in k order.
#include "moe_ops.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

constexpr int64_t kTile = 4;          // token rows dotted with each weight row read
constexpr int64_t kRowsPerItem = 16;  // weight rows per work item
constexpr int64_t kGemmRows = 64;     // an expert with at least this many tokens takes at::mm

// y[r] = <w, x_r> for the R rows of a tile, each element of w loaded once for all of them.
template <int R>
inline void dot_rows(const float* w, const float* const* x, int64_t n, float* y) {
  const float *x0 = x[0], *x1 = x[R > 1 ? 1 : 0], *x2 = x[R > 2 ? 2 : 0], *x3 = x[R > 3 ? 3 : 0];
  float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
  for (int64_t i = 0; i < n; ++i) {
    const float wi = w[i];
    a0 += x0[i] * wi;
    if constexpr (R > 1) a1 += x1[i] * wi;
    if constexpr (R > 2) a2 += x2[i] * wi;
    if constexpr (R > 3) a3 += x3[i] * wi;
  }
  const float a[4] = {a0, a1, a2, a3};
  for (int r = 0; r < R; ++r) y[r] = a[r];
}

inline void dot_tile(const float* w, const float* const* x, int64_t rows, int64_t n, float* y) {
  switch (rows) {
    case 1: return dot_rows<1>(w, x, n, y);
    case 2: return dot_rows<2>(w, x, n, y);
    case 3: return dot_rows<3>(w, x, n, y);
    default: return dot_rows<4>(w, x, n, y);
  }
}

inline float silu(float g) { return g / (1.f + std::exp(-g)); }

// Slots (token * top_k + k) routed to local experts, sorted by expert; row[slot] is the
// slot's row in that order (-1: held by another rank).
struct Routing {
  std::vector<int64_t> slots, offsets, row;
};

Routing sort_slots(const int64_t* ids, int64_t num_slots, int64_t expert_start, int64_t experts) {
  Routing r;
  r.offsets.assign(experts + 1, 0);
  r.row.assign(num_slots, -1);
  for (int64_t s = 0; s < num_slots; ++s) {
    const int64_t e = ids[s] - expert_start;
    if (e >= 0 && e < experts) ++r.offsets[e + 1];
  }
  for (int64_t e = 0; e < experts; ++e) r.offsets[e + 1] += r.offsets[e];
  std::vector<int64_t> next(r.offsets.begin(), r.offsets.end() - 1);
  r.slots.resize(r.offsets[experts]);
  for (int64_t s = 0; s < num_slots; ++s) {
    const int64_t e = ids[s] - expert_start;
    if (e >= 0 && e < experts) {
      r.row[s] = next[e];
      r.slots[next[e]++] = s;
    }
  }
  return r;
}

struct Item {
  int64_t expert, first;  // weight rows [first, first + kRowsPerItem)
};

// Work items over the experts with fewer than kGemmRows tokens.
std::vector<Item> items_for(const Routing& r, int64_t experts, int64_t rows) {
  std::vector<Item> items;
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t n = r.offsets[e + 1] - r.offsets[e];
    if (n == 0 || n >= kGemmRows) continue;
    for (int64_t j = 0; j < rows; j += kRowsPerItem) items.push_back({e, j});
  }
  return items;
}

// The rows of tile [t, min(t + kTile, end)) of an expert's sorted rows, as rows of base (through
// index when given); returns how many.
int64_t tile_rows(const float* base, int64_t stride, const int64_t* index, int64_t t, int64_t end, const float** x) {
  const int64_t rows = std::min(kTile, end - t);
  for (int64_t r = 0; r < rows; ++r) x[r] = base + (index != nullptr ? index[t + r] : t + r) * stride;
  return rows;
}

}  // namespace

at::Tensor fused_moe(const at::Tensor& x_in, const at::Tensor& w13, const at::Tensor& w2,
                     const at::Tensor& topk_weights, const at::Tensor& topk_ids, int64_t expert_start) {
  TORCH_CHECK(x_in.device().is_cpu() && x_in.scalar_type() == at::kFloat, "x must be float32 on the CPU");
  TORCH_CHECK(w13.is_contiguous() && w2.is_contiguous(), "expert weights must be contiguous");
  const at::Tensor x = x_in.contiguous(), ids_t = topk_ids.contiguous(), wts_t = topk_weights.contiguous();
  const int64_t tokens = x.size(0), hidden = x.size(1), top_k = ids_t.size(1);
  const int64_t experts = w13.size(0), inter = w13.size(1) / 2;
  const Routing r = sort_slots(ids_t.data_ptr<int64_t>(), tokens * top_k, expert_start, experts);
  const int64_t rows = r.offsets[experts];
  at::Tensor act = at::empty({rows, inter}, x.options());   // SiLU(gate) * up per sorted row
  at::Tensor down = at::empty({rows, hidden}, x.options());  // weighted expert output per sorted row
  std::vector<int64_t> token_of(rows);
  for (int64_t i = 0; i < rows; ++i) token_of[i] = r.slots[i] / top_k;
  const float *xp = x.data_ptr<float>(), *w13p = w13.data_ptr<float>(), *w2p = w2.data_ptr<float>();
  const float* wts = wts_t.data_ptr<float>();
  float *ap = act.data_ptr<float>(), *dp = down.data_ptr<float>();

  for (int64_t e = 0; e < experts; ++e) {  // experts with many tokens: ATen's GEMM on contiguous rows
    const int64_t lo = r.offsets[e], n = r.offsets[e + 1] - lo;
    if (n < kGemmRows) continue;
    const at::Tensor tokens = at::from_blob(token_of.data() + lo, {n}, at::kLong);
    const at::Tensor slots = at::from_blob(const_cast<int64_t*>(r.slots.data()) + lo, {n}, at::kLong);
    const at::Tensor h = at::mm(x.index_select(0, tokens), w13[e].t());
    act.narrow(0, lo, n).copy_(at::silu(h.narrow(1, 0, inter)) * h.narrow(1, inter, inter));
    at::Tensor out = down.narrow(0, lo, n);
    at::mm_out(out, act.narrow(0, lo, n), w2[e].t());
    out.mul_(wts_t.view(-1).index_select(0, slots).unsqueeze(1));
  }

  const std::vector<Item> up_items = items_for(r, experts, inter);
  at::parallel_for(0, up_items.size(), 1, [&](int64_t a, int64_t b) {
    const float* xr[kTile];
    float g[kTile], u[kTile];
    for (int64_t it = a; it < b; ++it) {
      const Item item = up_items[it];
      const int64_t lo = r.offsets[item.expert], hi = r.offsets[item.expert + 1];
      const float* w = w13p + item.expert * 2 * inter * hidden;
      for (int64_t j = item.first; j < std::min(item.first + kRowsPerItem, inter); ++j) {
        for (int64_t t = lo; t < hi; t += kTile) {
          const int64_t rows = tile_rows(xp, hidden, token_of.data(), t, hi, xr);
          dot_tile(w + j * hidden, xr, rows, hidden, g);
          dot_tile(w + (inter + j) * hidden, xr, rows, hidden, u);
          for (int64_t k = 0; k < rows; ++k) ap[(t + k) * inter + j] = silu(g[k]) * u[k];
        }
      }
    }
  });

  const std::vector<Item> down_items = items_for(r, experts, hidden);
  at::parallel_for(0, down_items.size(), 1, [&](int64_t a, int64_t b) {
    const float* hr[kTile];
    float y[kTile];
    for (int64_t it = a; it < b; ++it) {
      const Item item = down_items[it];
      const int64_t lo = r.offsets[item.expert], hi = r.offsets[item.expert + 1];
      const float* w = w2p + item.expert * hidden * inter;
      for (int64_t j = item.first; j < std::min(item.first + kRowsPerItem, hidden); ++j) {
        for (int64_t t = lo; t < hi; t += kTile) {
          const int64_t rows = tile_rows(ap, inter, nullptr, t, hi, hr);
          dot_tile(w + j * inter, hr, rows, inter, y);
          for (int64_t k = 0; k < rows; ++k) dp[(t + k) * hidden + j] = y[k] * wts[r.slots[t + k]];
        }
      }
    }
  });

  at::Tensor out = at::zeros({tokens, hidden}, x.options());
  float* op = out.data_ptr<float>();
  at::parallel_for(0, tokens, std::max<int64_t>(1, (1 << 15) / std::max<int64_t>(hidden * top_k, 1)),
                   [&](int64_t a, int64_t b) {
    for (int64_t t = a; t < b; ++t) {
      float* o = op + t * hidden;
      for (int64_t k = 0; k < top_k; ++k) {
        const int64_t row = r.row[t * top_k + k];
        if (row < 0) continue;
        const float* d = dp + row * hidden;
#pragma omp simd
        for (int64_t j = 0; j < hidden; ++j) o[j] += d[j];
      }
    }
  });
  return out;
}
