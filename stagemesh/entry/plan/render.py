"""The plan as text (path, memory table, commands) or as a JSON object."""
from __future__ import annotations

from stagemesh.core.kv_groups import FULL, kv_groups
from stagemesh.core.model_config import layer_ranges
from stagemesh.entry.plan.memory import Layout, kv_bytes_per_token
from stagemesh.entry.plan.tree import GB, Plan, PlanRequest


def _dcp(lay: Layout) -> str:
    """The DCP flag, after --tensor-parallel-size wherever that is (its group is that many of the TP ranks)."""
    return f" --decode-context-parallel-size {lay.dcp}" if lay.dcp > 1 else ""


def _kv(req: PlanRequest) -> str:
    """--kv-cache-dtype where the plan counts the cache in it (every service of a replica takes it)."""
    return f" --kv-cache-dtype {req.kv_cache_dtype}" if req.kv_cache_dtype != "auto" else ""


def _label(lay: Layout) -> str:
    return f"TP={lay.tp} PP={lay.pp}" + (f" DCP={lay.dcp}" if lay.dcp > 1 else "")


def stage_nodes(req: PlanRequest, plan: Plan) -> list[tuple[int, int, int]]:
    """(replica, stage index, node) of every stage: the replicas' stages fill the nodes' GPUs in order."""
    lay = plan.layout
    per_node = max(1, req.gpus_per_node // lay.tp)
    return [(r, i, (r * lay.pp + i) // per_node) for r in range(lay.dp) for i in range(lay.pp)]


def ray_commands(req: PlanRequest, plan: Plan, model: str, device: str) -> dict:
    """`ray start` on every node, `stagemesh serve --distributed-executor-backend ray` on the head, and
    where Ray will put what: the router and the schedulers on the head, a stage where its bundle fits."""
    lay = plan.layout
    split = ",".join(map(str, lay.layer_split))
    serve = (f"stagemesh serve {model} --tensor-parallel-size {lay.tp}{_dcp(lay)} --pipeline-parallel-size {lay.pp}"
             + (f" --data-parallel-size {lay.dp}" if lay.dp > 1 else "")
             + (f" --layer-split {split}" if lay.pp > 1 else "")
             # with -dp > 1 the flag means experts across the replicas, which the Ray backend does not build
             + (" --enable-expert-parallel" if plan.expert_parallel and lay.dp == 1 else "")
             + f"{_kv(req)} --device {device} --max-model-len {req.max_model_len} --distributed-executor-backend ray")
    bundle = f"GPU {lay.tp}, CPU {lay.tp}" if device == "cuda" else f"CPU {lay.tp}"
    placement = {"node 0 (head)": [f"router, {', '.join(f'scheduler[{r}]' for r in range(lay.dp))} (no CPUs)"]}
    for r, i, node in stage_nodes(req, plan):
        name = "node 0 (head)" if node == 0 else f"node {node}"
        placement.setdefault(name, []).append(f"stage[{r}.{i}] ({bundle})")
    return {"head": ["ray start --head --port=6379", serve],
            "workers": "ray start --address=$HEAD_NODE_IP:6379" if plan.nodes_used > 1 else None,
            "placement": placement}


def commands(req: PlanRequest, plan: Plan, model: str, device: str, backend: str = "mp") -> dict:
    if backend == "ray":
        return ray_commands(req, plan, model, device)
    lay = plan.layout
    split = ",".join(map(str, lay.layer_split))
    common = f"--max-model-len {req.max_model_len}{_kv(req)}"
    if device == "cuda":
        common += f" --gpu-memory-utilization {req.utilization}"
    experts = " --enable-expert-parallel" if plan.expert_parallel else ""
    if plan.nodes_used <= 1:
        cmd = (f"stagemesh serve {model} --tensor-parallel-size {lay.tp}{_dcp(lay)} --pipeline-parallel-size {lay.pp}"
               + (f" --data-parallel-size {lay.dp}" if lay.dp > 1 else "")
               + (f" --layer-split {split}" if lay.pp > 1 else "") + f"{experts} --device {device} {common}")
        return {"serve": cmd}
    # every scheduler and the router on the head node (they are light); replicas' stages fill the GPUs in order
    workers: dict[str, list[str]]
    head, workers, replicas = [], {}, []
    ranges = layer_ranges(lay.layer_split)
    for r in range(lay.dp):
        port = 50051 + r
        replicas.append(f"$HEAD_NODE_IP:{port}")
        head.append(f"stagemesh scheduler {model} --host 0.0.0.0 --advertise-host $HEAD_NODE_IP --port {port} "
                    f"--dist-port {29500 + r} --pipeline-parallel-size {lay.pp} --max-model-len {req.max_model_len}"
                    f"{_kv(req)}")
        for _, i, node in [x for x in stage_nodes(req, plan) if x[0] == r]:
            a, b = ranges[i]
            cmd = (f"stagemesh stage {model} --scheduler $HEAD_NODE_IP:{port} --stage-index {i} --layers {a}:{b} "
                   f"--tensor-parallel-size {lay.tp}{_dcp(lay)} --device {device} --handoff nccl --host 0.0.0.0 "
                   f"--advertise-host {'$HEAD_NODE_IP' if node == 0 else '$NODE_IP'}{experts}{_kv(req)}"
                   + (f" --gpu-memory-utilization {req.utilization}" if device == "cuda" else ""))
            (head if node == 0 else workers.setdefault(f"node {node}", [])).append(cmd)
    head.append(f"stagemesh router {model} " + " ".join(f"--replica {x}" for x in replicas) +
                " --host 0.0.0.0 --port 8000")
    env = {"HEAD_NODE_IP": "<address of node 0>", "NODE_IP": "<this node's address>", "NCCL_SOCKET_IFNAME": "<nic>"}
    return {"head": head, "workers": workers, "environment": env}


def _kv_per_token(req: PlanRequest, lay: Layout) -> str:
    """A token's KV over all the model's layers, as a GPU of the layout holds it (MLA: its latent)."""
    cfg, per_gpu = req.cfg, kv_bytes_per_token(req.cfg, req.cfg.num_hidden_layers, lay.tp, req.dtype, lay.dcp,
                                               req.kv_cache_dtype)
    what = "K and V of its KV heads on the GPU"
    if cfg.family.attention == "mla":
        from stagemesh.core.families.deepseek_v2 import mla_dims

        d = mla_dims(cfg)
        what = (f"the MLA latent, kv_lora_rank {d.kv_lora_rank} + qk_rope_head_dim {d.qk_rope_head_dim} values a "
                "layer, whole on every TP rank")
    groups = kv_groups(cfg)
    if groups.hybrid:
        full = sum(1 for g in groups.layer_group if groups.windows[g] == FULL)
        what += (f"; past the sliding window of {max(groups.windows)} tokens a token stays in {full} of the "
                 f"{cfg.num_hidden_layers} layers, the full-attention ones: the hybrid KV cache manager frees the "
                 "rest, docs/hybrid-kv-cache.md")
    return f"KV per token: {per_gpu:,} bytes per GPU over the model's {cfg.num_hidden_layers} layers ({what})"


def as_json(req: PlanRequest, plan: Plan, model: str, device: str, backend: str = "mp") -> dict:
    lay = plan.layout
    return {
        "model_type": req.cfg.model_type, "dtype": req.dtype, "kv_cache_dtype": req.kv_cache_dtype,
        "max_model_len": req.max_model_len,
        "tensor_parallel_size": lay.tp, "decode_context_parallel_size": lay.dcp, "pipeline_parallel_size": lay.pp,
        "data_parallel_size": lay.dp,
        "layer_split": lay.layer_split, "expert_parallel_size": lay.tp if plan.expert_parallel else 1,
        "nodes": plan.nodes_used, "gpus": lay.gpus,
        "weight_bytes_per_gpu": lay.weight_bytes_per_gpu, "kv_cache_bytes_per_gpu": max(lay.kv_bytes_per_gpu, 0),
        "kv_cache_tokens": lay.kv_cache_tokens, "max_concurrency": round(lay.max_concurrency, 2),
        "kv_bytes_per_token": kv_bytes_per_token(req.cfg, req.cfg.num_hidden_layers, lay.tp, req.dtype, lay.dcp,
                                                 req.kv_cache_dtype),
        "tight": plan.tight(req.gpu_bytes), "path": plan.path, "suggestion": plan.suggestion,
        "alternatives": plan.alternatives,
        "commands": commands(req, plan, model, device, backend),
    }


def as_text(req: PlanRequest, plan: Plan, model: str, device: str, backend: str = "mp") -> str:
    lay = plan.layout
    kv = f", KV cache {req.kv_cache_dtype}" if req.kv_cache_dtype != "auto" else ""
    lines = [f"Plan for {model} ({req.cfg.model_type}, {req.dtype}{kv}) on {req.nodes} node(s) x {req.gpus_per_node} "
             f"GPU(s) of {req.gpu_bytes / GB:.0f} GB" + ("" if req.nvlink else ", no NVLink"), "", "Decision path:"]
    lines += [f"  {i}. {step}" for i, step in enumerate(plan.path, 1)]
    width = max(14, *(len(_label(c)) + 2 for c in [*plan.considered, lay]))
    lines += ["", f"  {'layout':<{width}}{'weights/GPU':>13}{'KV tokens':>14}{'max concurrency':>17}"]
    shown = [(c.tp, c.pp, c.dcp) for c in plan.considered]
    for cand in plan.considered + ([lay] if (lay.tp, lay.pp, lay.dcp) not in shown else []):
        mark = " <- chosen" if (cand.tp, cand.pp, cand.dcp) == (lay.tp, lay.pp, lay.dcp) else ""
        lines.append(f"  {_label(cand):<{width}}{cand.weight_bytes_per_gpu / GB:>10.1f} GB"
                     f"{cand.kv_cache_tokens:>14,}{cand.max_concurrency:>16.2f}x{mark}")
    lines += ["", f"KV cache size: {lay.kv_cache_tokens:,} tokens",
              f"Maximum concurrency for {req.max_model_len:,} tokens per request: {lay.max_concurrency:.2f}x",
              _kv_per_token(req, lay)]
    if plan.alternatives:
        lines += ["", "Also possible on these GPUs:", *(f"  {a}" for a in plan.alternatives)]
    if plan.tight(req.gpu_bytes):
        lines.append("This layout is TIGHT: little or no memory is left for the KV cache.")
    cmds = commands(req, plan, model, device, backend)
    lines += ["", "Run it:"]
    if backend == "ray":
        lines += ["  # on the head node (node 0)", *(f"  {c}" for c in cmds["head"])]
        if cmds["workers"]:
            lines += ["  # on every other node", f"  {cmds['workers']}"]
        lines += ["", "Where Ray puts what (each stage in a placement group of its own, on a node with room):"]
        lines += [f"  {node}: {', '.join(what)}" for node, what in cmds["placement"].items()]
    elif "serve" in cmds:
        lines.append(f"  {cmds['serve']}")
    else:
        lines.append("  # on the head node (node 0)")
        lines += [f"  {c}" for c in cmds["head"]]
        for node, cs in cmds["workers"].items():
            lines.append(f"  # on {node}")
            lines += [f"  {c}" for c in cs]
        lines.append("  # compose / shell environment on every node")
        lines += [f"  {k}={v}" for k, v in cmds["environment"].items()]
    return "\n".join(lines)
