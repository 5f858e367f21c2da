// decoder_layer.h: a dense decoder layer as one call, each step the kernel the Python layer would call.
#include "decoder_layer.h"

#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <vector>

#include "bf16_linear.h"
#include "lora_ops.h"
#include "quant_linear.h"

namespace {

LayerLinear::Kind kind_of(const std::string& kind) {
  if (kind == "quant") return LayerLinear::Kind::kQuant;
  if (kind == "bf16") return LayerLinear::Kind::kBf16;
  if (kind == "mkldnn") return LayerLinear::Kind::kMkldnn;
  TORCH_CHECK(kind == "dense", "no linear kind ", kind, " (quant, bf16, mkldnn, dense)");
  return LayerLinear::Kind::kDense;
}

at::Tensor onednn_call(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&, c10::string_view,
                            c10::List<c10::optional<at::Scalar>>, c10::optional<c10::string_view>)>();
  return op.call(x, w, bias, "none", c10::List<c10::optional<at::Scalar>>(), "");
}

// oneDNN keeps what it builds for each row count it meets (~0.4-1 MiB each, in caches of 1,024 entries), so
// products run on a bounded set of row counts, as stage_worker/layers.py onednn_linear does (the same bits):
// up to 16 rows as they are, then pieces of at most 256 rows, each padded to one of 8 sizes per octave.
constexpr int64_t kOnednnExactRows = 16;
constexpr int64_t kOnednnPieceRows = 256;

int64_t onednn_rows(int64_t rows) {
  if (rows <= kOnednnExactRows) return rows;
  int bits = 0;
  for (int64_t r = rows; r > 0; r >>= 1) ++bits;
  const int64_t step = int64_t{1} << (bits - 4);
  return (rows + step - 1) / step * step;
}

at::Tensor onednn_packed_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2, "a layer's product takes 2-d activations");
  const int64_t rows = x.size(0);
  if (rows <= kOnednnPieceRows && rows == onednn_rows(rows)) return onednn_call(x, w, bias);
  std::vector<at::Tensor> outs;
  for (int64_t start = 0; start < rows; start += kOnednnPieceRows) {
    const int64_t n = std::min(kOnednnPieceRows, rows - start);
    const int64_t padded = onednn_rows(n);
    at::Tensor piece = x.narrow(0, start, n);
    if (padded != n) piece = at::constant_pad_nd(piece, {0, 0, 0, padded - n});
    at::Tensor out = onednn_call(piece, w, bias);
    outs.push_back(padded != n ? out.narrow(0, 0, n) : out);
  }
  return outs.size() == 1 ? outs[0] : at::cat(outs);
}

}  // namespace

LayerLinear::LayerLinear(const std::string& kind_name, at::Tensor weight_, c10::optional<at::Tensor> scales_,
                         c10::optional<at::Tensor> mins_, c10::optional<at::Tensor> bias_, int64_t out_features_,
                         bool int8_activations_, c10::optional<at::Tensor> lora_a_,
                         c10::optional<at::Tensor> lora_bt_)
    : kind(kind_of(kind_name)), weight(std::move(weight_)), scales(std::move(scales_)), mins(std::move(mins_)),
      bias(std::move(bias_)), out_features(out_features_), int8_activations(int8_activations_),
      lora_a(std::move(lora_a_)), lora_bt(std::move(lora_bt_)) {
  TORCH_CHECK(kind != Kind::kQuant || scales.has_value(), "a quantised linear needs its scales");
  TORCH_CHECK(lora_a.has_value() == lora_bt.has_value(), "a LoRA linear needs both lora_a and lora_bt");
}

at::Tensor LayerLinear::operator()(const at::Tensor& x, const std::string& quant_family,
                                   const c10::optional<at::Tensor>& lora_slots) const {
  at::Tensor y = (*this)(x, quant_family);
  if (lora_slots.has_value() && lora_a.has_value()) {
    if (!y.is_contiguous()) y = y.contiguous();
    lora_add(y, x.contiguous(), *lora_a, *lora_bt, *lora_slots);
  }
  return y;
}

at::Tensor LayerLinear::operator()(const at::Tensor& x, const std::string& quant_family) const {
  switch (kind) {
    case Kind::kQuant:
      return quant_linear(x, weight, *scales, mins, bias, int8_activations, quant_family);
    case Kind::kBf16:
      return linear_bf16(x, weight, out_features, bias);
    case Kind::kMkldnn:
      return onednn_packed_linear(x, weight, bias);
    case Kind::kDense:
      break;
  }
  return at::linear(x, weight, bias);
}

DecoderLayerPlan::DecoderLayerPlan(at::Tensor input_norm_, double input_eps_, at::Tensor post_norm_, double post_eps_,
                                   LayerLinear qkv_, LayerLinear o_, LayerLinear gate_up_, LayerLinear down_,
                                   int64_t num_heads_, int64_t num_kv_heads_, double scale_)
    : input_norm(std::move(input_norm_)), post_norm(std::move(post_norm_)), input_eps(input_eps_),
      post_eps(post_eps_), qkv(std::move(qkv_)), o(std::move(o_)), gate_up(std::move(gate_up_)),
      down(std::move(down_)), num_heads(num_heads_), num_kv_heads(num_kv_heads_), scale(scale_) {
  TORCH_CHECK(num_heads > 0 && num_kv_heads > 0, "a layer needs query and KV heads");
}

std::vector<at::Tensor> DecoderLayerPlan::forward(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                                  const at::Tensor& positions, const at::Tensor& cos_sin,
                                                  at::Tensor& k_cache, at::Tensor& v_cache,
                                                  const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                                                  const at::Tensor& seqs, const at::Tensor& visible,
                                                  const std::string& attention_family,
                                                  const std::string& quant_family,
                                                  const c10::optional<at::Tensor>& lora_slots, double k_scale,
                                                  double v_scale) const {
  const std::vector<at::Tensor> normed = rms_norm(x, input_norm, input_eps, residual);
  const at::Tensor q = rotary_and_cache(qkv(normed[0], quant_family, lora_slots), num_heads, num_kv_heads, positions,
                                        cos_sin, k_cache, v_cache, slot_mapping, k_scale, v_scale);
  const at::Tensor attn = decode_attention(q, k_cache, v_cache, block_tables, seqs, visible, scale, attention_family,
                                           k_scale, v_scale);
  const at::Tensor out = o(attn.reshape({q.size(0), q.size(1) * q.size(2)}), quant_family, lora_slots);
  const std::vector<at::Tensor> post = rms_norm(out, post_norm, post_eps, normed[1]);
  return {down(silu_and_mul(gate_up(post[0], quant_family, lora_slots)), quant_family, lora_slots), post[1]};
}
