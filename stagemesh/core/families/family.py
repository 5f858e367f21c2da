"""What a model family declares, once: how its config.json maps onto ModelConfig, its layers' quirks, its
tensors' names (safetensors and GGUF), the shapes the planner counts, and whether the fused CPU layer plan runs
it. Pure Python (no torch): the router and the planner read it too.

Every family here is a decoder of RMSNorm, rotary attention (rotate-half) and SwiGLU (silu) MLPs or experts:
that is what the kernels compute. A family that differs there needs kernels first, then a field here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

from stagemesh.core.errors import StagemeshError

# A merged linear's rows, in order: (checkpoint tensor prefix, first row in that tensor, rows).
Parts = list[tuple[str, int, int]]
# Checkpoint tensors and their shapes, in Hugging Face's order ([out, in] for a weight).
Shapes = dict[str, tuple[int, ...]]


class ModelConfigView(Protocol):
    """What a family reads of a model's config. stagemesh.core.model_config.ModelConfig is one: it stands on the
    families (it finds a config's family through them), so the families name only what they read, not it."""

    @property
    def model_type(self) -> str: ...
    @property
    def raw(self) -> dict[str, Any]: ...  # config.json as read
    @property
    def family(self) -> Family: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def intermediate_size(self) -> int: ...
    @property
    def num_attention_heads(self) -> int: ...
    @property
    def num_key_value_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def attention_bias(self) -> bool: ...
    @property
    def qk_norm(self) -> bool: ...
    @property
    def rope_scaling(self) -> dict[str, Any] | None: ...
    @property
    def num_experts(self) -> int: ...
    @property
    def moe_intermediate_size(self) -> int: ...
    @property
    def shared_expert_intermediate_size(self) -> int: ...


@dataclass(frozen=True)
class WeightNames:
    """How the checkpoint (Hugging Face's safetensors names) spells a layer's attention and MLP weights."""

    fused_qkv: str | None = None  # one tensor [q; k; v] (Phi-3's qkv_proj) instead of q_proj, k_proj, v_proj
    fused_gate_up: str | None = None  # one tensor [gate; up] (Phi-3's gate_up_proj) instead of gate_proj, up_proj

    def qkv(self, prefix: str, cfg: ModelConfigView, q: tuple[int, int], kv: tuple[int, int]) -> Parts:
        """The q, k and v rows of a TP rank: q = (first row, rows) of its query heads, kv the same of its KV heads."""
        if self.fused_qkv is None:
            return [(f"{prefix}.q_proj", *q), (f"{prefix}.k_proj", *kv), (f"{prefix}.v_proj", *kv)]
        name = f"{prefix}.{self.fused_qkv}"
        q_rows, kv_rows = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        return [(name, q[0], q[1]), (name, q_rows + kv[0], kv[1]), (name, q_rows + kv_rows + kv[0], kv[1])]

    def gate_up(self, prefix: str, intermediate: int, start: int, rows: int) -> Parts:
        """The gate and up rows start:start+rows of an MLP of `intermediate` columns."""
        if self.fused_gate_up is None:
            return [(f"{prefix}.gate_proj", start, rows), (f"{prefix}.up_proj", start, rows)]
        name = f"{prefix}.{self.fused_gate_up}"
        return [(name, start, rows), (name, intermediate + start, rows)]

    def attention_shapes(self, prefix: str, cfg: ModelConfigView) -> Shapes:
        h, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        shapes: Shapes
        if self.fused_qkv is None:
            shapes = {f"{prefix}.q_proj.weight": (q, h), f"{prefix}.k_proj.weight": (kv, h),
                      f"{prefix}.v_proj.weight": (kv, h)}
            if cfg.attention_bias:
                shapes.update({f"{prefix}.q_proj.bias": (q,), f"{prefix}.k_proj.bias": (kv,),
                               f"{prefix}.v_proj.bias": (kv,)})
        else:
            shapes = {f"{prefix}.{self.fused_qkv}.weight": (q + 2 * kv, h)}
            if cfg.attention_bias:
                shapes[f"{prefix}.{self.fused_qkv}.bias"] = (q + 2 * kv,)
        shapes[f"{prefix}.o_proj.weight"] = (h, q)
        if cfg.qk_norm:
            shapes.update({f"{prefix}.q_norm.weight": (cfg.head_dim,), f"{prefix}.k_norm.weight": (cfg.head_dim,)})
        return shapes

    def mlp_shapes(self, prefix: str, hidden: int, intermediate: int) -> Shapes:
        shapes: Shapes
        if self.fused_gate_up is None:
            shapes = {f"{prefix}.gate_proj.weight": (intermediate, hidden),
                      f"{prefix}.up_proj.weight": (intermediate, hidden)}
        else:
            shapes = {f"{prefix}.{self.fused_gate_up}.weight": (2 * intermediate, hidden)}
        return {**shapes, f"{prefix}.down_proj.weight": (hidden, intermediate)}


@dataclass(frozen=True)
class Experts:
    """A mixture-of-experts family: where its sparse block and its experts' weights sit in the checkpoint."""

    block: str = "mlp"  # model.layers.{i}.{block}: the router (gate), experts.{e}.*, the shared expert
    names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # each expert's gate, up and down
    always_renormalize: bool = False  # top-k weights renormalised whatever norm_topk_prob says (Mixtral)
    shared: str = "shared_expert"  # {block}.{shared}: the dense expert every token takes (when the config has one)
    shared_gate: bool = True  # the shared expert's output scaled by a sigmoid gate (Qwen2-MoE); False: added as is
    # how tokens pick experts: "topk" (softmax, top-k: kernels.select_experts) or "grouped" (DeepSeek's gate over
    # groups of experts, stage_worker.grouped_gate, set by the family's config fields)
    router: str = "topk"


@dataclass(frozen=True)
class GGUF:
    """How llama.cpp's GGUF files hold the family (tensor names: stage_worker.gguf)."""

    architecture: str  # general.architecture
    permuted_qk: bool = False  # llama.cpp's converter interleaves the rotary halves of each q and k head's rows
    # (name within a layer, GGUF name) where llama.cpp names a tensor of this family otherwise than it names
    # Llama's (stage_worker.gguf's table), e.g. a fused tensor
    tensor_names: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Family:
    model_type: str  # config.json's model_type
    architectures: tuple[str, ...]  # transformers' classes of it, for messages
    bias_key: str | None = None  # config.json's switch for q/k/v biases (None: transformers reads none)
    bias_default: bool = False  # biases on q/k/v when the config does not say (or always, without a switch)
    # the switch biases o_proj as well (Llama, Qwen3): not implemented (a row-parallel bias), so refused
    o_proj_bias: bool = False
    qk_norm: bool = False  # RMSNorm on each head of q and k before the rotation (Qwen3)
    # a config switch that must be on for sliding_window to count (Qwen's use_sliding_window); None: it always does
    sliding_window_switch: str | None = None
    experts: Experts | None = None  # mixture of experts
    weights: WeightNames = WeightNames()
    gguf: GGUF | None = None  # None: not served from GGUF files
    # the fused C++ CPU layer (stage_worker.layer_plan, kernels/csrc/decoder_layer.cpp) runs its dense layers;
    # False: the Python layer runs them (no per-head q/k norm there)
    fused_cpu_plan: bool = True
    # the norms of each decoder layer, in the checkpoint's names (Gemma's sandwich adds two around the MLP)
    layer_norms: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")
    # each layer's kind as the family reads config.json's layer_types ("sliding_attention" or "full_attention"):
    # sliding_window applies to the sliding ones, which attend within it (the stage runs the window), and the
    # context is not capped at it (Gemma 3, gpt-oss); None: no layer kinds, sliding_window caps the context
    layer_types: Callable[[dict[str, Any]], list[str]] | None = None
    # the quantization methods built for this family's layers alone (stage_worker.quant_methods: a method with
    # family_only is refused for a family that does not name it), e.g. gpt-oss's MXFP4 experts
    own_quant_methods: tuple[str, ...] = ()
    # stage_worker's module of the family's own stage model (its STAGE_MODEL), where its layers are not the
    # Llama-like decoder's (stage_worker.model.StageModel); None: that decoder
    stage_model: str | None = None
    # every checkpoint tensor of a decoder layer and its shape, where the family's are not what layer_shapes
    # derives from the fields above (gpt-oss's stacked experts, sinks and biases)
    layer_shapes_of: Callable[[ModelConfigView, int], Shapes] | None = None
    # what of the family's configs stagemesh does not implement: a message naming it, or None (checked at start-up)
    refuse: Callable[[dict[str, Any]], str | None] | None = None
    # "mha": multi-head attention over K and V heads (stage_worker.model.Attention); "mla": DeepSeek's multi-head
    # latent attention, its cache a latent per token (stage_worker.mla)
    attention: str = "mha"
    # ModelConfigView fields the family derives from its config its own way (e.g. its experts' count under another
    # name), over what stagemesh.core.model_config reads: {field: value}
    fields: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    # the config key that counts the checkpoint's multi-token-prediction layers, after the model's own (DeepSeek-V3's
    # num_nextn_predict_layers): what speculation's deepseek_mtp runs (stage_worker.mtp); None: the family has none
    mtp_layers: str | None = None

    def check(self, raw: dict[str, Any]) -> None:
        """Refuse, naming it, what of this config stagemesh does not implement."""
        why = self.refuse(raw) if self.refuse is not None else None
        if self.o_proj_bias and self.attention_bias(raw):
            why = f"{self.bias_key} (biases on q, k, v and o_proj)"
        if why:
            raise StagemeshError(f"{self.model_type}: {why} is not supported")

    @property
    def sliding_layers(self) -> bool:
        """Whether sliding_window applies to some layers only, which the stage runs within it."""
        return self.layer_types is not None

    def attention_bias(self, raw: dict[str, Any]) -> bool:
        return bool(raw.get(self.bias_key, self.bias_default) if self.bias_key else self.bias_default)

    def sliding_window(self, raw: dict[str, Any]) -> int | None:
        if self.sliding_window_switch is not None and not raw.get(self.sliding_window_switch, False):
            return None
        window = raw.get("sliding_window")
        return int(window) if window else None

    def layer_shapes(self, cfg: ModelConfigView, index: int, sparse: bool) -> Shapes:
        """Every checkpoint tensor of decoder layer `index` and its shape (`sparse`: the layer has experts)."""
        if self.layer_shapes_of is not None:
            return self.layer_shapes_of(cfg, index)
        h, prefix = cfg.hidden_size, f"model.layers.{index}"
        shapes: Shapes = {**{f"{prefix}.{norm}.weight": (h,) for norm in self.layer_norms},
                          **self.attention_shapes(f"{prefix}.self_attn", cfg)}
        if not sparse or self.experts is None:
            return {**shapes, **self.weights.mlp_shapes(f"{prefix}.mlp", h, cfg.intermediate_size)}
        block, (gate, up, down) = f"{prefix}.{self.experts.block}", self.experts.names
        inter = cfg.moe_intermediate_size
        shapes[f"{block}.gate.weight"] = (cfg.num_experts, h)
        for e in range(cfg.num_experts):
            shapes.update({f"{block}.experts.{e}.{gate}.weight": (inter, h),
                           f"{block}.experts.{e}.{up}.weight": (inter, h),
                           f"{block}.experts.{e}.{down}.weight": (h, inter)})
        if cfg.shared_expert_intermediate_size:
            shared = f"{block}.{self.experts.shared}"
            shapes.update(WeightNames().mlp_shapes(shared, h, cfg.shared_expert_intermediate_size))
            if self.experts.shared_gate:
                shapes[f"{shared}_gate.weight"] = (1, h)
        return shapes

    def attention_shapes(self, prefix: str, cfg: ModelConfigView) -> Shapes:
        """A layer's attention tensors (prefix: model.layers.{i}.self_attn) and their shapes."""
        return self.weights.attention_shapes(prefix, cfg)
