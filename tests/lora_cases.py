"""LoRA test helpers: PEFT adapter directories with random weights, transformers with an adapter merged into
its weights (the reference: W + scaling * B A is what PEFT's merge gives), and stage slices driven over a
batch whose sequences use different adapters."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from stagemesh.core.model_config import ModelConfig, layer_ranges
from stagemesh.core.sampling_params import SamplingParams
from stagemesh.core.step import NewSequence, ScheduledChunk, StepBatch
from stage_worker.lora import shapes
from stage_worker.runner import StageRunner
from tiny_models import reference_model

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
ALL = ATTENTION + ("gate_proj", "up_proj", "down_proj")


def make_adapter(path: Path, model_dir: Path, rank: int = 8, targets=ALL, seed: int = 1, alpha: float = 16.0,
                 config: dict | None = None, layers=None, use_rslora: bool = False) -> Path:
    """A PEFT adapter directory for the model at model_dir: random A and B (B is not zero, unlike PEFT's
    initialisation, so that the adapter changes the model's tokens)."""
    cfg = ModelConfig.from_path(model_dir)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in (range(cfg.num_hidden_layers) if layers is None else layers):
        for name in targets:
            out_f, in_f = shapes(cfg)[name]
            block = "self_attn" if name in ATTENTION else "mlp"
            key = f"base_model.model.model.layers.{layer}.{block}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_f, generator=gen) * 0.1
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_f, rank, generator=gen) * 0.1
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    raw = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(targets), "bias": "none",
           "use_rslora": use_rslora, "base_model_name_or_path": str(model_dir), "task_type": "CAUSAL_LM",
           **(config or {})}
    (path / "adapter_config.json").write_text(json.dumps(raw))
    return path


def peft_adapter(path: Path, model_dir: Path, rank: int, targets, seed: int, alpha: float = 16.0,
                 use_rslora: bool = False):
    """An adapter made by PEFT itself (LoraConfig with random B, init_lora_weights=False, so that it changes the
    tokens) on transformers' model, saved with save_pretrained; and that model with it merged by PEFT
    (merge_and_unload): the reference."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(reference_model(model_dir), LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=list(targets), use_rslora=use_rslora, init_lora_weights=False,
        lora_dropout=0.0, task_type="CAUSAL_LM"))
    model.save_pretrained(str(path))
    return path, model.merge_and_unload().eval()


def merged_reference(model_dir: Path, adapter: Path | None):
    """transformers' model with the adapter merged into its weights."""
    model = reference_model(model_dir)
    if adapter is None:
        return model
    raw = json.loads((adapter / "adapter_config.json").read_text())
    scaling = raw["lora_alpha"] / (raw["r"] ** 0.5 if raw.get("use_rslora") else raw["r"])
    from safetensors.torch import load_file

    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    with torch.no_grad():
        for key, a in tensors.items():
            if ".lora_A." not in key:
                continue
            b = tensors[key.replace(".lora_A.", ".lora_B.")]
            path = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            model.get_submodule(path).weight += scaling * (b.double() @ a.double()).float()
    return model


def settings(modules: dict[str, Path], max_loras: int = 4, max_lora_rank: int = 16,
             max_cpu_loras: int | None = None) -> dict:
    """The LoRA flags of a stage serving `modules`."""
    return dict(enable_lora=True, lora_modules=tuple(f"{n}={p}" for n, p in modules.items()), max_loras=max_loras,
                max_lora_rank=max_lora_rank, max_cpu_loras=max_cpu_loras)


def runners(model_dir, split, lora: dict | None, tp_rank=0, tp_size=1, tp_group=None, **kw):
    out = [StageRunner.of(model_dir, a, b, tp_rank=tp_rank, tensor_parallel_size=tp_size, tp_group=tp_group,
                          **(lora or {}), **kw)
           for a, b in layer_ranges(split)]
    for r in out:
        r.allocate_kv_cache(128)
    return out


def run_mixed(stages: list[StageRunner], seqs: list[tuple[list[int], str]], new_tokens: int,
              first_seq_id: int = 0) -> list[list[int]]:
    """Greedy tokens of each (prompt, adapter) sequence, all in one batch: their prompts in one step, then
    decode steps of all of them together."""
    news, chunks, block = [], [], 0
    for i, (prompt, adapter) in enumerate(seqs):
        seq_id = first_seq_id + i
        need = -(-(len(prompt) + new_tokens) // 16)
        news.append(NewSequence(seq_id, prompt, SamplingParams(max_tokens=new_tokens), lora_name=adapter))
        chunks.append(ScheduledChunk(seq_id, prompt, 0, list(range(block, block + need)), True))
        block += need
    ids = [first_seq_id + i for i in range(len(seqs))]
    outputs: dict[int, list[int]] = {s: [] for s in ids}
    batch = StepBatch(0, news, chunks)
    for step in range(new_tokens):
        hidden = None
        for stage in stages:
            out = stage.execute(batch, hidden, return_logits=True)
            hidden = out.hidden_states
        # TP rank 0 samples; every rank has the gathered logits, whose argmax is the greedy token
        sampled = [t.token_id for t in out.sampled] or out.logits.argmax(dim=-1).tolist()
        for seq_id, token in zip(ids, sampled):
            outputs[seq_id].append(token)
        batch = StepBatch(step + 1, [], [ScheduledChunk(s, [outputs[s][-1]], len(p) + step, [], True)
                                         for s, (p, _) in zip(ids, seqs)])
    finished = StepBatch(new_tokens + 1, [], [], finished_seq_ids=ids)
    for stage in stages:
        stage.execute(finished)
    return [outputs[s] for s in ids]
