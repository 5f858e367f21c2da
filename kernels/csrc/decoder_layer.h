// A dense decoder layer (Llama's shape) as one call: the kernels of cpu_ops.cpp, the linear products of
// bf16_linear.cpp / quant_linear.cpp / oneDNN / ATen, in the order and with the arguments the Python layer
// (stage_worker/model.py DecoderLayer) gives them, so the result is the same bits; what it saves is the
// Python between them (stage_worker/layer_plan.py says when it runs).
#pragma once

#include <ATen/ATen.h>  // (not torch/extension.h: its Python bindings cost each file ~20 s of compiling)

#include <string>
#include <vector>

// The kernels of cpu_ops.cpp the layer calls.
std::vector<at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                                 const c10::optional<at::Tensor>& residual);
at::Tensor rotary_and_cache(const at::Tensor& qkv, int64_t num_heads, int64_t num_kv_heads, const at::Tensor& positions,
                            const at::Tensor& cos_sin_cache, at::Tensor& k_cache, at::Tensor& v_cache,
                            const at::Tensor& slot_mapping, double k_scale, double v_scale);
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq, const at::Tensor& visible,
                            double scale, const std::string& family, double k_scale, double v_scale);
at::Tensor silu_and_mul(const at::Tensor& x);

// One linear's weight as its layer holds it. kind: "quant" (quant_linear: weight = qs, with scales, mins
// and int8_activations), "bf16" (linear_bf16: weight packed, out_features), "mkldnn" (oneDNN's packed fp32:
// torch.ops.mkldnn._linear_pointwise), "dense" (at::linear). lora_a / lora_bt: a LoRALinear's adapter slots
// (stage_worker/lora.py), whose products lora_ops.h adds for a step's tokens that use an adapter.
struct LayerLinear {
  LayerLinear(const std::string& kind, at::Tensor weight, c10::optional<at::Tensor> scales,
              c10::optional<at::Tensor> mins, c10::optional<at::Tensor> bias, int64_t out_features,
              bool int8_activations, c10::optional<at::Tensor> lora_a = c10::nullopt,
              c10::optional<at::Tensor> lora_bt = c10::nullopt);
  at::Tensor operator()(const at::Tensor& x, const std::string& quant_family) const;
  // the product, plus the adapters' for the tokens lora_slots names (none: the product alone)
  at::Tensor operator()(const at::Tensor& x, const std::string& quant_family,
                        const c10::optional<at::Tensor>& lora_slots) const;

  enum class Kind { kQuant, kBf16, kMkldnn, kDense } kind;
  at::Tensor weight;
  c10::optional<at::Tensor> scales, mins, bias;
  int64_t out_features;
  bool int8_activations;
  c10::optional<at::Tensor> lora_a, lora_bt;
};

struct DecoderLayerPlan {
  DecoderLayerPlan(at::Tensor input_norm, double input_eps, at::Tensor post_norm, double post_eps, LayerLinear qkv,
                   LayerLinear o, LayerLinear gate_up, LayerLinear down, int64_t num_heads, int64_t num_kv_heads,
                   double scale);
  // (the layer's output, the residual stream), as DecoderLayer.forward returns them. k_scale / v_scale: an fp8
  // cache's (kv_fp8.h; the layer's, which --calculate-kv-scales may set after the plan is built).
  std::vector<at::Tensor> forward(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                  const at::Tensor& positions, const at::Tensor& cos_sin, at::Tensor& k_cache,
                                  at::Tensor& v_cache, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                                  const at::Tensor& seqs, const at::Tensor& visible,
                                  const std::string& attention_family, const std::string& quant_family,
                                  const c10::optional<at::Tensor>& lora_slots = c10::nullopt, double k_scale = 1.0,
                                  double v_scale = 1.0) const;

  at::Tensor input_norm, post_norm;
  double input_eps, post_eps;
  LayerLinear qkv, o, gate_up, down;
  int64_t num_heads, num_kv_heads;
  double scale;
};
