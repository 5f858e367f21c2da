// The decode attention of a family (decode_attention.h), written once over a vector type V: included by
// each family's source inside its namespace and its target pragma, after V (W floats per register: load
// from float or bf16, set1, mul, fma, sum of lanes, store) and every system header. It includes only
// exp_poly.h, which is written to be included so.
//
// Work: one item per (query row, KV head), the item's G query heads sharing every key and value it reads
// (each key row is widened once for G heads, where a loop per query head reads it G times). Items are
// shared out over the threads by their positions, not their count, so that one long context does not
// leave the other threads waiting; with fewer items than twice the threads (batch 1 or 2), an fp32 item is
// cut into a piece of positions per thread, whose softmax sums merge at the end. Per item, two passes
// over its positions: scores (q . k, a register of partial sums per head and position, added across at
// the end), softmax in fp32, then the values
// summed into registers that hold the G heads' output rows for the whole pass. With a bf16 cache the
// softmax's weights are rounded to bf16 before they multiply the values, and the sum divides last, as
// torch's bf16 attention (the reference's) does; everything else is fp32.
//
// The cache's elements are of type C: q's own (T, fp32 or bf16) or fp8 (--kv-cache-dtype fp8: c10's
// Float8_e4m3fn or Float8_e5m2), widened in registers by V::load. An fp8 element read is `stored * scale`:
// the key scale is folded into the query row (scores are exact q . k * scale), the value scale into the
// output row, so the loops are those of any other cache. V::load gives an e4m3 element's value / 256 (its bits
// moved into fp16's, exact: load_factor says so), e5m2's exactly (it is fp16's top byte).

constexpr int kRegs = V::kAccumulators;  // accumulator registers a pass may keep (of the family's file)

#include "exp_poly.h"  // the softmax's exp, as cpu_ops.cpp's

template <typename C>
constexpr bool is_fp8() {
  return std::is_same<C, c10::Float8_e4m3fn>::value || std::is_same<C, c10::Float8_e5m2>::value;
}

// What V::load's value of a C element is multiplied by to give the element's value (see above).
template <typename C>
constexpr float load_factor() {
  return std::is_same<C, c10::Float8_e4m3fn>::value ? 256.f : 1.f;
}

template <typename T>
struct Item {
  const T* keys;    // the item's KV head in position 0 of block 0: + (block * block_size + offset) * row
  const T* values;
  const int32_t* table;
  int64_t len, block_size, row;  // row: elements from one position to the next (kv_heads * dim)
  int64_t first;                 // the item's positions are [first, first + len) of its sequence
  const T* at(const T* base, int64_t t) const {
    t += first;
    return base + (static_cast<int64_t>(table[t / block_size]) * block_size + t % block_size) * row;
  }
};

// scores[h][t] = q_h . k_t for HB heads (q already scaled), NC registers per row of dim
template <int NC, int HB, typename T>
void scores(const Item<T>& it, const float* q, int64_t dim, float* s, int64_t stride) {
  typename V::reg qr[HB][NC];
  for (int h = 0; h < HB; ++h)
    for (int c = 0; c < NC; ++c) qr[h][c] = V::load(q + h * dim + c * V::W);
  for (int64_t t = 0; t < it.len; ++t) {
    const T* key = it.at(it.keys, t);
    typename V::reg k[NC];
    for (int c = 0; c < NC; ++c) k[c] = V::load(key + c * V::W);
    for (int h = 0; h < HB; ++h) {
      typename V::reg acc = V::mul(qr[h][0], k[0]);
      for (int c = 1; c < NC; ++c) acc = V::fma(qr[h][c], k[c], acc);
      s[h * stride + t] = V::sum(acc);
    }
  }
}

// o[h] = sum_t p[h][t] v_t for HB heads
template <int NC, int HB, typename T>
void values(const Item<T>& it, const float* p, int64_t stride, float* o, int64_t dim) {
  typename V::reg acc[HB][NC];
  for (int h = 0; h < HB; ++h)
    for (int c = 0; c < NC; ++c) acc[h][c] = V::zero();
  for (int64_t t = 0; t < it.len; ++t) {
    const T* value = it.at(it.values, t);
    for (int c = 0; c < NC; ++c) {
      const typename V::reg v = V::load(value + c * V::W);
      for (int h = 0; h < HB; ++h) acc[h][c] = V::fma(V::set1(p[h * stride + t]), v, acc[h][c]);
    }
  }
  for (int h = 0; h < HB; ++h)
    for (int c = 0; c < NC; ++c) V::store(o + h * dim + c * V::W, acc[h][c]);
}

// One pass over an item's positions for HB of its heads.
template <int NC, int HB, typename T>
void pass(const Item<T>& it, const float* q, float* s, float* o, int64_t dim, int64_t stride, bool scoring) {
  if (scoring) scores<NC, HB>(it, q, dim, s, stride);
  else values<NC, HB>(it, s, stride, o, dim);
}

// The heads of an item in blocks of as many as keep a pass's accumulators in registers (at most 4).
template <int NC, typename T>
void heads_in_blocks(const Item<T>& it, const float* q, float* s, float* o, int64_t heads, int64_t dim,
                     int64_t stride, bool scoring) {
  constexpr int64_t kMax = kRegs / NC < 1 ? 1 : kRegs / NC > 4 ? 4 : kRegs / NC;
  for (int64_t h = 0; h < heads;) {
    const int64_t n = std::min(kMax, heads - h);
    const float* qh = q + h * dim;
    float *sh = s + h * stride, *oh = o + h * dim;
    switch (n) {
      case 4: pass<NC, 4>(it, qh, sh, oh, dim, stride, scoring); break;
      case 3: pass<NC, 3>(it, qh, sh, oh, dim, stride, scoring); break;
      case 2: pass<NC, 2>(it, qh, sh, oh, dim, stride, scoring); break;
      default: pass<NC, 1>(it, qh, sh, oh, dim, stride, scoring); break;
    }
    h += n;
  }
}

// A row that sees no position (a context-parallel rank's empty share, only where the lse is asked): output 0,
// lse -inf.
template <typename T>
void no_positions(const Problem& p, int64_t item) {
  const int64_t r = item / p.kv_heads, kvh = item % p.kv_heads, group = p.heads / p.kv_heads;
  T* orow = static_cast<T*>(p.out) + (r * p.heads + kvh * group) * p.dim;
  std::fill(orow, orow + group * p.dim, static_cast<T>(0.f));
  std::fill(p.lse + r * p.heads + kvh * group, p.lse + r * p.heads + (kvh + 1) * group,
            -std::numeric_limits<float>::infinity());
}

// The item's positions [first, last): with partial null, the attention of its G query heads into p.out;
// else, for a piece of a split item, each head's max score, sum of exp(score - max) and unnormalised
// output (dim floats) into partial [G][dim + 2], for merge() (fp32 queries only). T: q's and the output's
// type, C: the cache's.
template <int NC, typename T, typename C>
void attend(const Problem& p, int64_t item, int64_t first, int64_t last, std::vector<float>& buf,
            float* partial = nullptr) {
  const int64_t r = item / p.kv_heads, kvh = item % p.kv_heads, group = p.heads / p.kv_heads, dim = p.dim;
  const int64_t len = last - first, stride = len;
  const int64_t row = p.kv_heads * dim;
  const Item<C> it{static_cast<const C*>(p.k_cache) + kvh * dim, static_cast<const C*>(p.v_cache) + kvh * dim,
                   p.block_tables + static_cast<int64_t>(p.seq[r]) * p.width, len, p.block_size, row, first};
  buf.resize(2 * group * dim + 2 * group + group * len);
  float *q = buf.data(), *o = q + group * dim, *inv = o + group * dim, *top = inv + group, *s = top + group;
  const T* qrow = static_cast<const T*>(p.q) + (r * p.heads + kvh * group) * dim;
  const float q_scale = is_fp8<C>() ? p.scale * p.k_scale * load_factor<C>() : p.scale;
  for (int64_t i = 0; i < group * dim; ++i) q[i] = static_cast<float>(qrow[i]) * q_scale;
  heads_in_blocks<NC>(it, q, s, o, group, dim, stride, true);
  for (int64_t h = 0; h < group; ++h) {  // softmax over the row's positions, in fp32, normalised at the end
    float* sh = s + h * stride;
    const float m = top[h] = *std::max_element(sh, sh + len);
    float total = 0.f;
#pragma omp simd reduction(+ : total)
    for (int64_t t = 0; t < len; ++t) {
      sh[t] = exp_poly(sh[t] - m);
      total += sh[t];
    }
    inv[h] = 1.f / total;
    // bf16: the weights of the values in bf16, as torch's bf16 attention multiplies them (the sum stays fp32)
    if (std::is_same<T, c10::BFloat16>::value)
      for (int64_t t = 0; t < len; ++t) sh[t] = static_cast<float>(c10::BFloat16(sh[t]));
  }
  heads_in_blocks<NC>(it, q, s, o, group, dim, stride, false);
  if (is_fp8<C>()) {  // the values' scale, once per output element
    const float v_scale = p.v_scale * load_factor<C>();
    for (int64_t i = 0; i < group * dim; ++i) o[i] *= v_scale;
  }
  // buf now holds q, o, inv, top and s, in this order: attend_lse reads inv and top
  if (partial != nullptr) {
    for (int64_t h = 0; h < group; ++h) {
      float* ph = partial + h * (dim + 2);
      ph[0] = top[h], ph[1] = 1.f / inv[h];
      std::copy(o + h * dim, o + (h + 1) * dim, ph + 2);
    }
    return;
  }
  T* orow = static_cast<T*>(p.out) + (r * p.heads + kvh * group) * dim;
  for (int64_t h = 0; h < group; ++h)  // bf16: rounded to nearest even once
    for (int64_t i = 0; i < dim; ++i) orow[h * dim + i] = static_cast<T>(o[h * dim + i] * inv[h]);
}

// attend() of a whole item, and its heads' lse = max + log(sum) into p.lse: written apart from attend(), which
// the path without the lse runs as it was (a second instantiation of attend in this file changes how the
// compiler inlines the first, about 15% slower on fp32).
template <int NC, typename T, typename C>
void attend_lse(const Problem& p, int64_t item, int64_t first, int64_t last, std::vector<float>& buf) {
  if (last == first) return no_positions<T>(p, item);
  attend<NC, T, C>(p, item, first, last, buf);
  const int64_t r = item / p.kv_heads, kvh = item % p.kv_heads, group = p.heads / p.kv_heads;
  const float *inv = buf.data() + 2 * group * p.dim, *top = inv + group;
  for (int64_t h = 0; h < group; ++h) p.lse[r * p.heads + kvh * group + h] = top[h] - std::log(inv[h]);
}

// An item's pieces merged: each piece's sums rescaled to the largest max (flash-decoding's reduction).
inline void merge(const Problem& p, int64_t item, const float* pieces, int64_t count) {
  const int64_t group = p.heads / p.kv_heads, dim = p.dim, width = group * (dim + 2);
  float* orow = static_cast<float*>(p.out) + ((item / p.kv_heads) * p.heads + (item % p.kv_heads) * group) * dim;
  for (int64_t h = 0; h < group; ++h) {
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t c = 0; c < count; ++c) m = std::max(m, pieces[c * width + h * (dim + 2)]);
    float total = 0.f;
    float* o = orow + h * dim;
    std::fill(o, o + dim, 0.f);
    for (int64_t c = 0; c < count; ++c) {
      const float* ph = pieces + c * width + h * (dim + 2);
      const float w = std::exp(ph[0] - m);
      total += w * ph[1];
      for (int64_t i = 0; i < dim; ++i) o[i] += w * ph[2 + i];
    }
    const float inv = 1.f / total;
    for (int64_t i = 0; i < dim; ++i) o[i] *= inv;
    if (p.lse != nullptr) p.lse[(item / p.kv_heads) * p.heads + (item % p.kv_heads) * group + h] = m + std::log(total);
  }
}

// Fewer items than twice the threads (a batch of one or two rows): each item of fp32 queries long enough is cut
// into a piece per thread, so that three KV heads on two threads do not leave one thread idle a third of
// the time; the pieces' softmax sums merge at the end. Returns false where it does not apply.
template <int NC, typename T, typename C>
bool run_pieces(const Problem& p, int64_t items) {
  constexpr int64_t kMinPiece = 64;  // positions: below this a piece's merge and start cost more than it saves
  const int64_t threads = at::get_num_threads();
  if (!std::is_same<T, float>::value || threads < 2 || items >= 2 * threads) return false;
  int64_t longest = 0;
  for (int64_t r = 0; r < p.rows; ++r) longest = std::max<int64_t>(longest, p.row_len(r));
  if (longest < threads * kMinPiece) return false;
  struct Piece { int64_t item, first, last, slot; };
  std::vector<Piece> pieces;
  std::vector<int64_t> counts(items);
  for (int64_t i = 0; i < items; ++i) {
    const int64_t from = p.row_first(i / p.kv_heads), len = p.row_len(i / p.kv_heads);
    counts[i] = len >= threads * kMinPiece ? threads : 1;
    for (int64_t c = 0; c < counts[i]; ++c)
      pieces.push_back({i, from + len * c / counts[i], from + len * (c + 1) / counts[i], counts[i] > 1 ? c : -1});
  }
  const int64_t width = (p.heads / p.kv_heads) * (p.dim + 2);
  std::vector<float> partials(items * threads * width);
  at::parallel_for(0, static_cast<int64_t>(pieces.size()), 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> buf;
    for (int64_t k = lo; k < hi; ++k) {
      const Piece& c = pieces[k];
      float* slot = c.slot < 0 ? nullptr : partials.data() + (c.item * threads + c.slot) * width;
      if (slot == nullptr && p.lse != nullptr) attend_lse<NC, T, C>(p, c.item, c.first, c.last, buf);
      else attend<NC, T, C>(p, c.item, c.first, c.last, buf, slot);
    }
  });
  for (int64_t i = 0; i < items; ++i)
    if (counts[i] > 1) merge(p, i, partials.data() + i * threads * width, counts[i]);
  return true;
}

// Items [0, rows * kv_heads) shared over the threads in ranges of about equal positions.
template <int NC, typename T, typename C>
void run_items(const Problem& p) {
  const int64_t items = p.rows * p.kv_heads;
  if (run_pieces<NC, T, C>(p, items)) return;
  std::vector<int64_t> ends(items);  // positions read up to and including each item
  int64_t total = 0;
  for (int64_t i = 0; i < items; ++i) ends[i] = total += p.row_len(i / p.kv_heads);
  // below kGrain positions x dim the other threads cost more to wake than the work
  constexpr int64_t kGrain = 1 << 13;
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>({at::get_num_threads(), items,
                                                                  total * p.dim / kGrain}));
  at::parallel_for(0, parts, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> buf;
    for (int64_t part = lo; part < hi; ++part) {
      // the items whose last position falls in this part's share of all the positions
      const int64_t from = total * part / parts, to = total * (part + 1) / parts;
      const int64_t first = std::upper_bound(ends.begin(), ends.end(), from) - ends.begin();
      const int64_t last = part + 1 == parts ? items : std::upper_bound(ends.begin(), ends.end(), to) - ends.begin();
      for (int64_t i = part == 0 ? 0 : first; i < last; ++i) {
        const int64_t r = i / p.kv_heads;
        if (p.lse != nullptr) attend_lse<NC, T, C>(p, i, p.row_first(r), p.visible[r], buf);
        else attend<NC, T, C>(p, i, p.row_first(r), p.visible[r], buf);
      }
    }
  });
}

template <int NC, typename T>
void run_cache(const Problem& p) {
  switch (p.cache) {
    case CacheKind::kE4M3: return run_items<NC, T, c10::Float8_e4m3fn>(p);
    case CacheKind::kE5M2: return run_items<NC, T, c10::Float8_e5m2>(p);
    case CacheKind::kSame: break;
  }
  run_items<NC, T, T>(p);
}

template <int NC>
void run_dtype(const Problem& p) {
  if (p.bf16) run_cache<NC, c10::BFloat16>(p);
  else run_cache<NC, float>(p);
}

bool covers(int64_t dim) { return dim == 4 * V::W || dim == 8 * V::W || dim == 16 * V::W; }

void run(const Problem& p) {
  switch (p.dim / V::W) {
    case 4: return run_dtype<4>(p);
    case 8: return run_dtype<8>(p);
    case 16: return run_dtype<16>(p);
    default: TORCH_CHECK(false, "decode attention: head_dim ", p.dim, " is not covered by this family");
  }
}
