"""The memory math of a parallel layout: weights and KV cache per GPU, KV capacity,
maximum concurrency, and a layer split that evens memory across stages."""
from __future__ import annotations

import math
from dataclasses import dataclass

from stagemesh.core.kv_cache_dtype import element_bytes
from stagemesh.core.kv_groups import KVGroups, blocks_at_most, kv_groups, tokens_held
from stagemesh.core.model_config import ModelConfig, layer_ranges

# Bytes a layer's parameter takes as a stage holds it, in the kernels' layouts (kernels/quant_reference.py):
# 4-bit quants with an fp32 scale and min per group of 32 (the GGUF files hold less: Q4_0 18 and Q4_1 20 bytes a
# block of 32, Q4_K 144 a block of 256), Q8_0 8 bits with an fp32 scale per 32; int8 (w8a16 / w8a8) and fp8
# 8 bits, their fp32 scale per output row counted apart (weight_bytes). int4: a GPTQ / AWQ / compressed-tensors
# W4A16 checkpoint's (stage_worker.quant_methods), 4 bits with an fp32 scale and min per group of 128.
# mxfp4: gpt-oss's experts, 4-bit e2m1 with an e8m0 scale per 32 (17 bytes a block); the rest of it bf16.
DTYPE_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int4": 0.5625,
               "q4_0": 0.75, "q4_1": 0.75, "q4_k": 0.75, "q8_0": 1.125, "int8": 1.0, "mxfp4": 17 / 32}
# The embedding table and LM head: a GGUF's as the embedded model's file holds them (Q8_0); int8 and fp8 keep
# them in bf16.
TABLE_BYTES = {"q4_0": 1.125, "q4_1": 1.125, "q4_k": 1.125, "q8_0": 1.125, "int8": 2.0, "fp8": 2.0, "int4": 2.0,
               "mxfp4": 2.0}
KV_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 2, "int4": 2,  # KV stays 16-bit when weights are quantized
                  "q4_0": 2, "q4_1": 2, "q4_k": 2, "q8_0": 2, "int8": 2, "mxfp4": 2}
# What a GPU keeps besides weights and KV: activations of a step, CUDA graphs and
# the allocator's slack. vLLM measures it by profiling; a plan without the weights
# has to assume it.
ACTIVATION_RESERVE = 2 * 2**30
# serve's defaults, which the hybrid KV cache manager's count of a sliding group's blocks reads
BLOCK_SIZE, MAX_NUM_BATCHED_TOKENS = 16, 2048


@dataclass(frozen=True)
class ParamCounts:
    embedding: int  # the input embedding
    lm_head: int  # the output head (0 when tied: the embedding serves)
    per_layer: int
    final_norm: int

    def total(self, num_layers: int) -> int:
        return self.embedding + self.lm_head + self.per_layer * num_layers + self.final_norm


def _layer_kinds(cfg: ModelConfig) -> list[tuple[dict[str, tuple[int, ...]], int]]:
    """Each kind of layer's tensors as its family names them, and how many layers are of that kind: a mixture of
    experts' sparse layers and its dense ones (DeepSeek's first_k_dense_replace, Qwen-MoE's mlp_only_layers)."""
    sparse = sum(cfg.is_sparse_layer(i) for i in range(cfg.num_hidden_layers))
    kinds = [(True, sparse), (False, cfg.num_hidden_layers - sparse)]
    index = {True: next((i for i in range(cfg.num_hidden_layers) if cfg.is_sparse_layer(i)), 0),
             False: next((i for i in range(cfg.num_hidden_layers) if not cfg.is_sparse_layer(i)), 0)}
    return [(cfg.family.layer_shapes(cfg, index[kind], sparse=kind), n) for kind, n in kinds if n]


def _per_layer(cfg: ModelConfig, count) -> int:
    """`count` of a layer's tensors, averaged over the model's layers (a stage is counted its share of layers)."""
    return sum(n * count(shapes) for shapes, n in _layer_kinds(cfg)) // cfg.num_hidden_layers


def param_counts(cfg: ModelConfig) -> ParamCounts:
    h = cfg.hidden_size
    per_layer = _per_layer(cfg, lambda shapes: sum(math.prod(shape) for shape in shapes.values()))
    embedding = cfg.vocab_size * h
    return ParamCounts(embedding, 0 if cfg.tie_word_embeddings else embedding, per_layer, h)


def expert_params(cfg: ModelConfig) -> int:
    """The routed experts' parameters over every layer (what expert parallelism across replicas splits)."""
    return sum(n * sum(math.prod(shape) for name, shape in shapes.items() if ".experts." in name)
               for shapes, n in _layer_kinds(cfg))


def linear_rows_per_layer(cfg: ModelConfig) -> int:
    """Output rows of a layer's linear weights (attention, MLP or experts, routers), each with its int8 scale."""
    return _per_layer(cfg, lambda shapes: sum(shape[0] for shape in shapes.values() if len(shape) == 2))


def weight_bytes(cfg: ModelConfig, dtype: str, layers: int, tables: int) -> float:
    """Bytes of `layers` decoder layers and `tables` embedding / LM-head parameters in `dtype`."""
    counts = param_counts(cfg)
    table_bytes = tables * TABLE_BYTES.get(dtype, DTYPE_BYTES[dtype])
    block = fp8_block(cfg) if dtype == "fp8" else None
    if block is not None:
        per_layer = sum(n * _block_fp8_bytes(shapes, block) for shapes, n in _layer_kinds(cfg)) / cfg.num_hidden_layers
        return per_layer * layers + table_bytes
    if dtype == "mxfp4":  # the experts' weights packed (not their biases), the rest of each layer bf16
        experts = sum(n * sum(math.prod(shape) for name, shape in shapes.items() if name.endswith("_proj"))
                      for shapes, n in _layer_kinds(cfg)) / cfg.num_hidden_layers
        return ((counts.per_layer - experts) * 2 + experts * DTYPE_BYTES[dtype]) * layers + table_bytes
    total = counts.per_layer * layers * DTYPE_BYTES[dtype] + table_bytes
    if dtype in ("int8", "fp8"):  # an fp32 scale per output row
        total += 4 * linear_rows_per_layer(cfg) * layers
    return total


def fp8_block(cfg: ModelConfig) -> tuple[int, int] | None:
    """The [rows, columns] of a block-FP8 checkpoint's scales (DeepSeek-V3's weight_block_size), from its
    quantization_config, or for a reference config the released checkpoint's (`_fp8_quantization_config`)."""
    qc = cfg.raw.get("quantization_config") or cfg.raw.get("_fp8_quantization_config") or {}
    block = qc.get("weight_block_size") if qc.get("quant_method") == "fp8" else None
    return (int(block[0]), int(block[1])) if block else None


def _block_fp8_bytes(shapes: dict[str, tuple[int, ...]], block: tuple[int, int]) -> int:
    """A layer's bytes as a block-FP8 checkpoint stores it (DeepSeek-V3's): each linear one byte a weight and an
    fp32 weight_scale_inv per block (a partial block too); a mixture of experts' router and the norms in bf16, its
    e_score_correction_bias in fp32."""
    total = 0
    for name, shape in shapes.items():
        if len(shape) == 2 and not name.endswith(".gate.weight"):
            total += math.prod(shape) + 4 * math.ceil(shape[0] / block[0]) * math.ceil(shape[1] / block[1])
        else:
            total += math.prod(shape) * (4 if name.endswith("e_score_correction_bias") else 2)
    return total


def kv_bytes_per_token(cfg: ModelConfig, num_layers: int, tp: int, dtype: str, dcp: int = 1,
                       kv_cache_dtype: str = "auto") -> int:
    """Per GPU, per token the GPU holds: layers x KV heads on this GPU x head dim x 2 (K and V) x bytes (1 with
    --kv-cache-dtype fp8; auto: the cache in the weights' compute dtype, KV_DTYPE_BYTES). (With multi-head latent
    attention the one KV head is half the latent: layers x (kv_lora_rank + qk_rope_head_dim) x bytes, replicated
    on each TP rank.)

    The KV heads are sharded as if TP were tp / dcp, and replicate past that = KV heads. With decode context
    parallelism (dcp > 1) the dcp ranks of a group hold the same KV heads but each 1/dcp of every sequence's
    tokens, so a sequence token costs a GPU this / dcp bytes (evaluate counts tokens as free * dcp // this)."""
    kv_heads = max(1, cfg.num_key_value_heads // (tp // dcp))
    return num_layers * kv_heads * cfg.head_dim * 2 * element_bytes(kv_cache_dtype, KV_DTYPE_BYTES[dtype])


def balanced_split(cfg: ModelConfig, pp: int) -> list[int]:
    """Contiguous layer counts that even out weights: the first stage also holds the
    embedding and the last the LM head, so they may take fewer layers."""
    counts = param_counts(cfg)
    head = (counts.lm_head or counts.embedding) + counts.final_norm  # tied: the last stage reads a copy
    first, last = counts.embedding / counts.per_layer, head / counts.per_layer
    layers = cfg.num_hidden_layers
    if pp == 1:
        return [layers]
    share = (layers + first + last) / pp
    bounds, start = [], 0
    for i in range(1, pp):
        end = round(i * share - first)
        end = min(max(end, start + 1), layers - (pp - i))
        bounds.append(end)
        start = end
    edges = [0, *bounds, layers]
    return [b - a for a, b in zip(edges, edges[1:])]


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    layer_split: list[int]
    weight_bytes_per_gpu: int  # the heaviest GPU
    kv_bytes_per_gpu: int  # what is left for the KV cache on the tightest stage
    kv_cache_tokens: int  # per replica: the minimum over stages (a sequence's tokens, over its DCP ranks)
    max_concurrency: float  # kv_cache_tokens / max_model_len (with KV cache groups: blocks / a request's blocks)
    dcp: int = 1  # decode context parallel size: each sequence's KV split over this many of a stage's TP ranks

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp


@dataclass(frozen=True)
class Budget:
    """What every layout of a plan is measured against: a GPU's memory and the share of it serve may take
    (--gpu-memory-utilization), the weights' and the KV cache's formats, and the context a sequence may reach."""
    gpu_bytes: int
    utilization: float
    dtype: str  # the weights' (DTYPE_BYTES)
    max_model_len: int
    kv_cache_dtype: str = "auto"  # --kv-cache-dtype (fp8: one byte a cached value)

    @property
    def usable(self) -> int:
        """Bytes a GPU gives to weights and the KV cache."""
        return int(self.gpu_bytes * self.utilization) - ACTIVATION_RESERVE


def evaluate(cfg: ModelConfig, budget: Budget, tp: int, pp: int, split: list[int] | None = None, dp: int = 1,
             dcp: int = 1) -> Layout:
    if dcp < 1 or tp % dcp:
        raise ValueError(f"a DCP size ({dcp}) must divide the TP size ({tp})")
    counts = param_counts(cfg)
    split = split or balanced_split(cfg, pp)
    dtype = budget.dtype
    groups = kv_groups(cfg)
    weights, kv_free, tokens, blocks = 0, None, None, None
    for a, b in layer_ranges(split):
        tables = counts.embedding if a == 0 else 0
        if b == cfg.num_hidden_layers:
            tables += (counts.lm_head or counts.embedding) + counts.final_norm
        stage_weights = int(weight_bytes(cfg, dtype, b - a, tables) / tp)
        free = budget.usable - stage_weights
        weights = max(weights, stage_weights)
        kv_free = free if kv_free is None else min(kv_free, free)
        if groups.hybrid:  # (a block: one layer of every group on this stage's slots)
            per_block = BLOCK_SIZE * kv_bytes_per_token(cfg, groups.num_slots(a, b), tp, dtype, dcp,
                                                        budget.kv_cache_dtype)
            blocks = min(blocks if blocks is not None else 1 << 62, max(free, 0) * dcp // per_block)
            continue
        # each of a DCP group's ranks holds 1/dcp of a sequence's tokens: dcp times the tokens it has room for
        stage_tokens = max(free, 0) * dcp // kv_bytes_per_token(cfg, b - a, tp, dtype, dcp, budget.kv_cache_dtype)
        tokens = stage_tokens if tokens is None else min(tokens, stage_tokens)
    assert kv_free is not None  # (a split has at least one stage)
    if blocks is not None:
        tokens, concurrency = _held_in_groups(groups, blocks, budget.max_model_len)
    else:
        assert tokens is not None
        concurrency = tokens / budget.max_model_len
    return Layout(tp, pp, dp, split, weights, kv_free, tokens, concurrency, dcp)


def _held_in_groups(groups: KVGroups, blocks: int, max_model_len: int) -> tuple[int, float]:
    """With the hybrid KV cache manager (stagemesh.core.kv_groups): the tokens one request can hold in `blocks`,
    and how many requests of max_model_len fit at once (a sliding group holding only its window's blocks)."""
    held = tokens_held(groups.windows, blocks, BLOCK_SIZE, MAX_NUM_BATCHED_TOKENS)
    per_request = blocks_at_most(groups.windows, max_model_len, BLOCK_SIZE, MAX_NUM_BATCHED_TOKENS)
    return held, max(blocks - 1, 0) / per_request


def evaluate_dp_ep(cfg: ModelConfig, budget: Budget, dp: int) -> Layout:
    """DP replicas of one GPU each whose stages share the experts (--data-parallel-size with
    --enable-expert-parallel, EP = DP): each GPU holds everything but the routed experts whole, 1 / dp of those, and
    its own replica's KV cache."""
    counts = param_counts(cfg)
    tables = counts.embedding + counts.lm_head + counts.final_norm
    experts = expert_params(cfg) * DTYPE_BYTES[budget.dtype]
    weights = int(weight_bytes(cfg, budget.dtype, cfg.num_hidden_layers, tables) - experts + experts / dp)
    free = budget.usable - weights
    tokens = max(free, 0) // kv_bytes_per_token(cfg, cfg.num_hidden_layers, 1, budget.dtype)
    return Layout(1, 1, dp, [cfg.num_hidden_layers], weights, free, tokens, tokens / budget.max_model_len)
