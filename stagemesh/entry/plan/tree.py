"""vLLM's decision tree for TP / PP / DP, as a function that records its path.

One GPU if the model fits; else quantization as a suggestion; else TP over the
GPUs of a node; TP within nodes and PP across nodes; PP alone (TP=1) when the
GPU count does not divide the heads or there is no NVLink; DP replicas when a
concurrency target needs them; expert parallelism over each stage's TP ranks for
a mixture-of-experts model. Invalid TP sizes are never proposed. Where a layout's
TP replicates the KV heads (TP > KV heads) and max_model_len's KV does not fit,
decode context parallelism (DCP) over the TP ranks is tried before more nodes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from stagemesh.core.errors import StagemeshError
from stagemesh.core.model_config import ModelConfig
from stagemesh.entry.plan.memory import DTYPE_BYTES, Budget, Layout, evaluate

GB = 1e9
BLOCK_SIZE = 16  # the serving commands' default --block-size: a DCP size divides it
TIGHT = 0.8  # weights above this share of a GPU leave little for the KV cache and activations


@dataclass(frozen=True)
class PlanRequest:
    cfg: ModelConfig
    gpus_per_node: int
    nodes: int
    gpu_bytes: int
    dtype: str = "bf16"
    max_model_len: int = 8192
    utilization: float = 0.9
    nvlink: bool = True
    target_concurrency: float | None = None
    tensor_parallel_size: int | None = None
    pipeline_parallel_size: int | None = None
    decode_context_parallel_size: int | None = None  # None: the tree may propose DCP; 1: it may not
    kv_cache_dtype: str = "auto"  # --kv-cache-dtype (fp8: one byte a cached value)

    def budget(self, dtype: str | None = None) -> Budget:
        """What a layout is measured against: this request's GPU and settings (another weights' format: dtype)."""
        return Budget(self.gpu_bytes, self.utilization, dtype or self.dtype, self.max_model_len, self.kv_cache_dtype)


@dataclass
class Plan:
    layout: Layout
    nodes_used: int
    path: list[str] = field(default_factory=list)
    considered: list[Layout] = field(default_factory=list)
    suggestion: str | None = None
    expert_parallel: bool = False  # --enable-expert-parallel: whole experts over each stage's TP ranks
    # other layouts of the same GPUs worth knowing (a mixture of experts' DP + EP), each a line of text
    alternatives: list[str] = field(default_factory=list)

    def tight(self, gpu_bytes: int) -> bool:
        return self.layout.weight_bytes_per_gpu > TIGHT * gpu_bytes or self.layout.max_concurrency < 1


def make_plan(req: PlanRequest) -> Plan:
    if req.tensor_parallel_size or req.pipeline_parallel_size or req.decode_context_parallel_size not in (None, 1):
        plan = _forced(req)
    else:
        plan = _tree(req)
    return _expert_parallel(req, _data_parallel(req, plan))


def _eval(req: PlanRequest, tp: int, pp: int, dtype: str | None = None, dcp: int = 1) -> Layout:
    return evaluate(req.cfg, req.budget(dtype), tp, pp, dcp=dcp)


def _fits(req: PlanRequest, layout: Layout) -> bool:
    return layout.kv_cache_tokens >= req.max_model_len


def _describe(layout: Layout) -> str:
    dcp = f" x DCP={layout.dcp}" if layout.dcp > 1 else ""  # each sequence's KV over DCP of the TP ranks
    return (f"TP={layout.tp} x PP={layout.pp}{dcp}: {layout.weight_bytes_per_gpu / GB:.1f} GB of weights per GPU, "
            f"KV cache {layout.kv_cache_tokens:,} tokens")


def check_dcp(cfg: ModelConfig, tp: int, dcp: int) -> None:
    """--decode-context-parallel-size as a stage checks it (ModelConfig.check_decode_context_parallel), at the
    default block size: the DCP group is `dcp` consecutive TP ranks, each holding block_size / dcp tokens of
    every block, the KV heads sharded as if TP were tp / dcp."""
    cfg.check_decode_context_parallel(tp, dcp, BLOCK_SIZE)


def dcp_sizes(cfg: ModelConfig, tp: int) -> list[int]:
    """The DCP sizes that remove TP's duplication of the KV heads, smallest first: none where TP does not
    replicate them (TP <= KV heads: DCP would save nothing). Past tp / DCP = KV heads DCP saves no more."""
    kv = cfg.num_key_value_heads
    if tp <= kv:
        return []
    sizes = []
    for d in range(2, tp + 1):
        if tp % d or BLOCK_SIZE % d or tp // d < kv:
            continue
        try:
            check_dcp(cfg, tp, d)
        except StagemeshError:
            continue
        sizes.append(d)
    return sizes


def _try_dcp(req: PlanRequest, layout: Layout, path: list[str], considered: list[Layout]) -> Layout | None:
    """The smallest DCP size at which `layout` (which does not fit max_model_len's KV) fits, recorded in path."""
    if req.decode_context_parallel_size is not None:  # -dcp 1 given: DCP is not wanted
        return None
    tp, kv = layout.tp, req.cfg.num_key_value_heads
    sizes = dcp_sizes(req.cfg, tp)
    if not sizes:
        return None
    why = f"TP={tp} replicates each of the {kv} KV heads {tp // kv}x"
    tried = []
    for d in sizes:
        cand = _eval(req, tp, layout.pp, dcp=d)
        considered.append(cand)
        if _fits(req, cand):
            path.append(f"{why}; DCP={d} splits each sequence's KV over {d} ranks instead "
                        f"(--decode-context-parallel-size {d}): KV cache {cand.kv_cache_tokens:,} tokens, "
                        f"enough for {req.max_model_len:,}")
            return cand
        tried.append(f"DCP={d}: {cand.kv_cache_tokens:,} tokens")
    path.append(f"{why}, but splitting each sequence's KV over the TP ranks does not fit "
                f"{req.max_model_len:,} tokens either ({'; '.join(tried)})")
    return None


def _tree(req: PlanRequest) -> Plan:
    path, considered = [], []
    one = _eval(req, 1, 1)
    considered.append(one)
    if _fits(req, one):
        path.append(f"fits on one GPU ({_describe(one)}): no distributed inference needed")
        return Plan(one, 1, path, considered)
    path.append(f"does not fit one GPU ({_describe(one)}, needs {req.max_model_len:,} tokens of KV)")
    suggestion = _quantization_hint(req, path)
    node_tp, node_pp = _node_layout(req, path)
    for nodes in range(1, req.nodes + 1):
        layout = _eval(req, node_tp, node_pp * nodes)
        considered.append(layout)
        where = "one node" if nodes == 1 else f"{nodes} nodes: TP within each node, PP across nodes"
        if _fits(req, layout):
            path.append(f"fits on {where} ({_describe(layout)})")
            return Plan(layout, nodes, path, considered, suggestion)
        path.append(f"does not fit on {nodes} node(s) ({_describe(layout)})")
        if (with_dcp := _try_dcp(req, layout, path, considered)) is not None:
            path.append(f"fits on {where} ({_describe(with_dcp)})")
            return Plan(with_dcp, nodes, path, considered, suggestion)
    total = req.gpus_per_node * req.nodes
    raise StagemeshError(f"{req.cfg.model_type} with {_weights_gb(req):.0f} GB of {req.dtype} weights does not fit "
                         f"{total} GPUs of {req.gpu_bytes / GB:.0f} GB with {req.max_model_len:,}-token requests; "
                         f"add nodes, use bigger GPUs, lower --max-model-len or quantize" +
                         (f" ({suggestion})" if suggestion else ""))


def _weights_gb(req: PlanRequest) -> float:
    from stagemesh.entry.plan.memory import param_counts, weight_bytes

    counts = param_counts(req.cfg)
    return weight_bytes(req.cfg, req.dtype, req.cfg.num_hidden_layers,
                        counts.embedding + counts.lm_head + counts.final_norm) / GB


def _quantization_hint(req: PlanRequest, path: list[str]) -> str | None:
    for dtype, how in (("fp8", "--quantization fp8"), ("q4_k", "a Q4_K GGUF, --quantization gguf")):
        if DTYPE_BYTES[dtype] < DTYPE_BYTES[req.dtype] and _fits(req, layout := _eval(req, 1, 1, dtype)):
            hint = (f"quantized to {dtype} ({how}) it would fit one GPU ({layout.weight_bytes_per_gpu / GB:.1f} GB "
                    f"of weights); the plan stays at {req.dtype} (plan --dtype {dtype} to plan it)")
            path.append(f"suggestion: {hint}")
            return hint
    return None


def _node_layout(req: PlanRequest, path: list[str]) -> tuple[int, int]:
    """(TP, PP) over the GPUs of one node."""
    n, heads = req.gpus_per_node, req.cfg.num_attention_heads
    valid = req.cfg.valid_tp_sizes(n)
    if not req.nvlink:
        path.append(f"no NVLink: pipeline parallel over the node's {n} GPUs (TP=1), since TP's two all-reduces per "
                    "layer would cross PCIe")
        return 1, n
    if n in valid:
        path.append(f"tensor parallel over the node's {n} GPUs (TP={n} divides the {heads} attention heads)")
        return n, 1
    tp = max(t for t in valid if n % t == 0)
    path.append(f"TP={n} does not divide the {heads} attention heads (valid: {', '.join(map(str, valid))}): "
                f"TP={tp} x PP={n // tp} over the node's {n} GPUs" + (" (pipeline only)" if tp == 1 else ""))
    return tp, n // tp


def _forced(req: PlanRequest) -> Plan:
    cfg = req.cfg
    tp = req.tensor_parallel_size or 1
    cfg.check_tp_size(tp)
    pp = req.pipeline_parallel_size or 1
    if not 1 <= pp <= cfg.num_hidden_layers:
        raise StagemeshError(f"--pipeline-parallel-size {pp} must be between 1 and the model's "
                             f"{cfg.num_hidden_layers} layers")
    if tp > req.gpus_per_node:
        raise StagemeshError(f"--tensor-parallel-size {tp} exceeds the {req.gpus_per_node} GPUs of a node")
    if tp * pp > req.gpus_per_node * req.nodes:
        raise StagemeshError(f"TP={tp} x PP={pp} needs {tp * pp} GPUs; {req.nodes} node(s) of {req.gpus_per_node} "
                             f"have {req.gpus_per_node * req.nodes}")
    dcp = 1 if req.decode_context_parallel_size is None else req.decode_context_parallel_size
    if dcp > 1 and not req.tensor_parallel_size:
        raise StagemeshError(f"--decode-context-parallel-size {dcp} needs --tensor-parallel-size: a DCP group is "
                             "that many of a stage's TP ranks")
    check_dcp(cfg, tp, dcp)
    layout = _eval(req, tp, pp, dcp=dcp)
    verdict = "fits" if _fits(req, layout) else "does NOT fit (no room for one request's KV cache)"
    path = [f"layout as asked: {_describe(layout)}: {verdict}"]
    if dcp > 1 and tp <= cfg.num_key_value_heads:
        path.append(f"DCP={dcp} saves no KV memory: TP={tp} does not replicate the {cfg.num_key_value_heads} KV "
                    f"heads, so each sequence token costs a GPU what it costs at DCP=1")
    if layout.weight_bytes_per_gpu > TIGHT * req.gpu_bytes:
        path.append(f"tight: weights take {layout.weight_bytes_per_gpu / req.gpu_bytes:.0%} of each GPU, leaving "
                    f"little for the KV cache and activations")
    return Plan(layout, math.ceil(tp * pp / req.gpus_per_node), path, [layout])


def _data_parallel(req: PlanRequest, plan: Plan) -> Plan:
    per_replica = plan.layout.tp * plan.layout.pp
    available = (req.gpus_per_node * req.nodes) // per_replica
    if not req.target_concurrency:
        return plan
    need = math.ceil(req.target_concurrency / max(plan.layout.max_concurrency, 1e-9))
    dp = max(1, min(need, available))
    plan.path.append(f"target concurrency {req.target_concurrency:g}: one replica holds "
                     f"{plan.layout.max_concurrency:.2f}x; {need} replica(s) needed, {available} fit the GPUs: DP={dp}")
    plan.layout = replace(plan.layout, dp=dp)
    plan.nodes_used = math.ceil(dp * per_replica / req.gpus_per_node)
    return plan


def _expert_parallel(req: PlanRequest, plan: Plan) -> Plan:
    """EP over each stage's TP ranks where the guides use it (DeepSeek-V3: TP=8 with EP=8). Each GPU
    holds E / TP whole experts instead of 1 / TP of every expert: the same bytes, so the memory math
    above holds either way, but fewer, larger expert GEMMs."""
    cfg, tp, dp = req.cfg, plan.layout.tp, plan.layout.dp
    if not cfg.is_moe:
        return plan
    why_not = None
    if tp == 1:
        why_not = "each stage's one GPU holds all of its experts"
    elif dp > 1:
        why_not = ("expert parallelism spans one stage's TP ranks for now, not the replicas (data-parallel "
                   "attention with experts across replicas is not built)")
    elif cfg.num_experts % tp:
        why_not = f"TP={tp} does not divide the {cfg.num_experts} experts"
    if why_not:
        plan.path.append(f"mixture of experts: the experts stay TP-sharded: {why_not}")
        return plan
    plan.expert_parallel = True
    plan.path.append(f"mixture of experts: expert parallel over each stage's TP={tp} GPUs (--enable-expert-parallel, "
                     f"EP={tp}): {cfg.num_experts // tp} of the {cfg.num_experts} experts whole on each GPU, "
                     f"attention stays TP, as the guides deploy DeepSeek-V3 (TP=8 with EP)")
    plan.alternatives.append(_dp_ep(req, plan.layout.gpus))
    return plan


def _dp_ep(req: PlanRequest, gpus: int) -> str:
    """The same GPUs as data-parallel replicas of one GPU whose experts spread over all of them (the guides' wide
    EP: attention per replica, the experts across the replicas), as one line."""
    from stagemesh.entry.plan.memory import evaluate_dp_ep

    cfg, flags = req.cfg, f"--data-parallel-size {gpus} --enable-expert-parallel"
    if cfg.num_experts % gpus:
        return f"DP={gpus} x EP={gpus} ({flags}): the {cfg.num_experts} experts do not split over {gpus} GPUs"
    lay = evaluate_dp_ep(cfg, req.budget(), gpus)
    verdict = "fits" if _fits(req, lay) else "does NOT fit (no room for one request's KV cache)"
    return (f"DP={gpus} x EP={gpus} ({flags}): attention and the dense layers whole on each GPU, "
            f"{cfg.num_experts // gpus} of the {cfg.num_experts} experts: {lay.weight_bytes_per_gpu / GB:.1f} GB of "
            f"weights per GPU, KV cache {lay.kv_cache_tokens:,} tokens per replica ({lay.max_concurrency:.2f}x each, "
            f"{gpus * lay.max_concurrency:.2f}x over the {gpus} replicas): {verdict}")
