"""Read a Hugging Face config.json into the few fields every service needs."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stagemesh.core import families, generation_config
from stagemesh.core.errors import StagemeshError
from stagemesh.core.families import SUPPORTED_MODEL_TYPES, Family

__all__ = ["ModelConfig", "SUPPORTED_MODEL_TYPES", "layer_split", "parse_layer_split", "layer_ranges"]


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    # of a KV head as the paged cache holds it (and of an attention head, but with MLA: there the cache's one "head"
    # is half the latent per token, stagemesh.core.families.deepseek_v2)
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    # None or a dict with at least "rope_type" (e.g. llama3 scaling factors).
    rope_scaling: dict[str, Any] | None
    # positions served: the config's, capped at its sliding window (within it, sliding attention is full attention)
    # unless its family runs the window on its sliding layers (Family.sliding_layers)
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections (the family says where the config keeps it)
    qk_norm: bool  # RMSNorm on each head of q and k (the family's)
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    torch_dtype: str  # as the checkpoint stores it, e.g. "bfloat16"
    sliding_window: int | None = None
    # Mixture of experts: a sparse layer routes each token to num_experts_per_tok of num_experts
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalise the top-k routing weights to sum to 1 (Mixtral always does)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: a dense expert every token takes, behind a sigmoid gate
    mlp_only_layers: tuple[int, ...] = ()  # Qwen-MoE: layers with a dense MLP instead of experts
    decoder_sparse_step: int = 1  # Qwen-MoE: layer i has experts when (i + 1) % step == 0
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def family(self) -> Family:
        """What the model's family declares (stagemesh.core.families): weight names, quirks, kernels."""
        return families.get(self.model_type)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_sparse_layer(self, index: int) -> bool:
        """Whether decoder layer `index` routes to experts (else it has a dense MLP), as transformers decides."""
        return (self.is_moe and index not in self.mlp_only_layers
                and (index + 1) % self.decoder_sparse_step == 0)

    def check_expert_parallel(self, ep_size: int, across_replicas: bool = False) -> None:
        """--enable-expert-parallel spreads whole experts over a stage's TP ranks (EP size = TP size), or with
        --data-parallel-size over the replicas' stages (EP size = DP size, stage_worker.ep_group)."""
        if not self.is_moe:
            raise StagemeshError(f"--enable-expert-parallel needs a mixture-of-experts model; {self.model_type} "
                                 "has no experts")
        if self.num_experts % ep_size:
            over, flag, short = (("replicas", "--data-parallel-size", "DP") if across_replicas
                                 else ("ranks", "--tensor-parallel-size", "TP"))
            raise StagemeshError(f"--enable-expert-parallel: the model's {self.num_experts} experts do not split "
                                 f"evenly over {flag} {ep_size} {over} (EP size = {short} size); use a {short} size "
                                 f"that divides {self.num_experts}")

    def kv_bytes_per_token(self, dtype_bytes: int, num_layers: int | None = None) -> int:
        layers = self.num_hidden_layers if num_layers is None else num_layers
        return 2 * layers * self.num_key_value_heads * self.head_dim * dtype_bytes

    def valid_tp_sizes(self, limit: int = 64) -> list[int]:
        """TP sizes that divide the attention heads and split or replicate the KV heads evenly."""
        kv = self.num_key_value_heads
        return [tp for tp in range(1, limit + 1)
                if self.num_attention_heads % tp == 0 and (kv % tp == 0 or tp % kv == 0)]

    def check_tp_size(self, tp_size: int) -> None:
        if tp_size not in self.valid_tp_sizes(max(tp_size, 1)):
            valid = ", ".join(str(t) for t in self.valid_tp_sizes())
            raise StagemeshError(
                f"--tensor-parallel-size {tp_size} does not divide the model's "
                f"{self.num_attention_heads} attention heads; sizes that work: {valid}"
            )

    def check_decode_context_parallel(self, tp_size: int, dcp_size: int, block_size: int) -> None:
        """--decode-context-parallel-size refused at start-up where it cannot split what it must, with the reason."""
        flag = f"--decode-context-parallel-size {dcp_size}"
        if dcp_size < 1:
            raise StagemeshError(f"{flag} must be at least 1")
        if dcp_size == 1:
            return
        if tp_size % dcp_size:
            raise StagemeshError(f"{flag} does not divide --tensor-parallel-size {tp_size}: a DCP group is "
                                 f"{dcp_size} of a stage's TP ranks (as vLLM's)")
        if block_size % dcp_size:
            raise StagemeshError(f"{flag} does not divide --block-size {block_size}: each rank of a DCP group holds "
                                 f"block_size / {dcp_size} tokens of every block")
        try:
            self.check_tp_size(tp_size // dcp_size)
        except StagemeshError as err:
            raise StagemeshError(f"{flag} with --tensor-parallel-size {tp_size} shards the KV heads over "
                                 f"{tp_size // dcp_size} groups, which the model cannot: {err}") from None

    def check_prefill_context_parallel(self, pcp_size: int, block_size: int, dcp_size: int = 1) -> None:
        """--prefill-context-parallel-size refused at start-up where it is not built or cannot split, with why."""
        flag = f"--prefill-context-parallel-size {pcp_size}"
        if pcp_size < 1:
            raise StagemeshError(f"{flag} must be at least 1")
        if pcp_size == 1:
            return
        if dcp_size > 1:
            raise StagemeshError(f"{flag} with --decode-context-parallel-size {dcp_size} is not built yet: PCP already "
                                 "spreads each sequence's KV over its ranks")
        if block_size % pcp_size:
            raise StagemeshError(f"{flag} does not divide --block-size {block_size}: each PCP rank keeps "
                                 f"block_size / {pcp_size} tokens of every block")

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        model_type = cfg.get("model_type", "")
        if "vision_config" in cfg:  # (its text part's tensors are named otherwise too: not served as a text model)
            archs = ", ".join(cfg.get("architectures") or [model_type])
            raise StagemeshError(f"{archs}: the vision tower (vision_config) is not supported: multimodal models are "
                                 "not served yet (a text-only checkpoint of the same model is, e.g. "
                                 "Gemma3ForCausalLM)")
        if "text_config" in cfg and "num_hidden_layers" not in cfg:
            return cls.from_dict({**cfg["text_config"], "model_type": cfg["text_config"].get("model_type", model_type)})
        family = families.get(model_type, cfg.get("architectures"))
        family.check(cfg)
        try:
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            eos = cfg.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            theta, scaling = _rope(cfg)
            config = cls(
                model_type=model_type,
                hidden_size=hidden,
                intermediate_size=int(cfg.get("intermediate_size") or 0),
                num_hidden_layers=int(cfg["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                vocab_size=int(cfg["vocab_size"]),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=theta,
                rope_scaling=scaling,
                max_position_embeddings=min(int(cfg.get("max_position_embeddings", 2048)),
                                            (not family.sliding_layers and family.sliding_window(cfg)) or 1 << 62),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=family.attention_bias(cfg),
                qk_norm=family.qk_norm,
                eos_token_ids=eos_ids,
                bos_token_id=cfg.get("bos_token_id"),
                torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
                sliding_window=family.sliding_window(cfg),
                num_experts=int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0) if family.experts else 0,
                num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 0),
                moe_intermediate_size=int(cfg.get("moe_intermediate_size") or cfg.get("intermediate_size") or 0),
                norm_topk_prob=bool(family.experts and family.experts.always_renormalize)
                or bool(cfg.get("norm_topk_prob", False)),
                shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0),
                mlp_only_layers=tuple(int(i) for i in cfg.get("mlp_only_layers") or ()),
                decoder_sparse_step=int(cfg.get("decoder_sparse_step") or 1),
                raw=dict(cfg),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise StagemeshError(f"config.json is missing or has a bad field: {err}") from None
        if family.fields is not None:
            config = dataclasses.replace(config, **family.fields(cfg))
        _check_mlp(config, cfg)
        return config

    @classmethod
    def from_path(cls, path: str | Path) -> "ModelConfig":
        """A model directory or a config.json file."""
        path = Path(path)
        file = path / "config.json" if path.is_dir() else path
        if not file.is_file():
            raise StagemeshError(f"{path} is not a model: no config.json there")
        try:
            cfg = json.loads(file.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise StagemeshError(f"{file} is not valid JSON: {err}") from None
        if not isinstance(cfg, dict):
            raise StagemeshError(f"{file} is not a model config (not a JSON object)")
        config = cls.from_dict(_with_hf_quant_config(cfg, file.parent / "hf_quant_config.json"))
        extra = [i for i in generation_config.eos_token_ids(file.parent) if i not in config.eos_token_ids]
        return dataclasses.replace(config, eos_token_ids=config.eos_token_ids + tuple(extra)) if extra else config


def _with_hf_quant_config(cfg: dict[str, Any], file: Path) -> dict[str, Any]:
    """cfg, with an older ModelOpt checkpoint's hf_quant_config.json as its quantization_config where config.json
    has none (as vLLM reads it; stage_worker.quant_methods.modelopt)."""
    if "quantization_config" in cfg or not file.is_file():
        return cfg
    try:
        extra = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise StagemeshError(f"{file} is not valid JSON: {err}") from None
    if not isinstance(extra, dict) or not isinstance(extra.get("quantization"), dict):
        raise StagemeshError(f"{file} has no quantization object: it is not ModelOpt's hf_quant_config.json")
    return {**cfg, "quantization_config": {"quant_method": "modelopt", **extra}}


def _rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    # transformers >= 5 writes rope_parameters; older configs rope_theta + rope_scaling. A model whose layer types
    # rotate differently keeps one per type: the model's is its full-attention layers' (the family reads the rest)
    params = dict(cfg.get("rope_parameters") or {})
    if isinstance(params.get("full_attention"), dict):
        params = dict(params["full_attention"])
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = dict(cfg.get("rope_scaling") or params or {})
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    scaling.pop("rope_theta", None)
    if scaling.get("rope_type", "default") == "default":
        return theta, None
    return theta, scaling


def _check_mlp(config: "ModelConfig", cfg: dict[str, Any]) -> None:
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise StagemeshError(f"hidden_act {act!r} is not supported (the MLPs and experts are SwiGLU: silu)")
    if config.is_moe and not 0 < config.num_experts_per_tok <= config.num_experts:
        raise StagemeshError(f"num_experts_per_tok {config.num_experts_per_tok} must be between 1 and the model's "
                             f"{config.num_experts} experts")


def layer_split(num_layers: int, num_stages: int) -> list[int]:
    """A balanced split of layers into contiguous stages (earlier stages take the extra)."""
    if num_stages < 1 or num_stages > num_layers:
        raise StagemeshError(f"cannot split {num_layers} layers into {num_stages} pipeline stages")
    base, extra = divmod(num_layers, num_stages)
    return [base + (1 if i < extra else 0) for i in range(num_stages)]


def parse_layer_split(text: str, num_layers: int, num_stages: int) -> list[int]:
    """Parse --layer-split "10,12,8" and check it covers the model."""
    try:
        split = [int(x) for x in text.split(",")]
    except ValueError:
        raise StagemeshError(f"--layer-split {text!r} must be comma-separated integers") from None
    if len(split) != num_stages or any(n < 1 for n in split) or sum(split) != num_layers:
        raise StagemeshError(
            f"--layer-split {text!r} must give {num_stages} positive layer counts summing to "
            f"the model's {num_layers} layers"
        )
    return split


def layer_ranges(split: list[int]) -> list[tuple[int, int]]:
    starts = [sum(split[:i]) for i in range(len(split))]
    return [(s, s + n) for s, n in zip(starts, split)]
