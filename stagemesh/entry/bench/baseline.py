"""The transformers baseline: the same workload through `generate` in static batches, on this machine."""
from __future__ import annotations

import time

from stagemesh.entry.bench.workload import BenchRequest


def transformers_static(model_dir: str, requests: list[BenchRequest], batch_size: int = 16,
                        progress: bool = True) -> dict:
    """Greedy `generate` over batches of `batch_size` in order; each batch runs to its longest output and
    counts only the tokens its requests asked for (what a user gets)."""
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from stagemesh.core.errors import StagemeshError

    if not progress:
        hf_logging.disable_progress_bar()  # "Loading weights" too
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # (transformers' decorator on PreTrainedModel.to loses `self` in its type)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()  # type: ignore[arg-type]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    prompts = []
    for r in requests:
        if r.prompt_ids is not None:
            prompts.append(list(r.prompt_ids))
        elif r.prompt is not None:
            prompts.append(tokenizer.encode(r.prompt))
        else:
            raise StagemeshError("the transformers baseline takes prompts, not chat messages")
    batches = [list(range(i, min(i + batch_size, len(requests)))) for i in range(0, len(requests), batch_size)]
    useful, start = 0, time.perf_counter()
    with torch.inference_mode():
        for batch in tqdm(batches, desc="transformers baseline", unit="batch", disable=not progress):
            width = max(len(prompts[i]) for i in batch)
            ids = torch.tensor([[pad] * (width - len(prompts[i])) + prompts[i] for i in batch], device=device)
            mask = torch.tensor([[0] * (width - len(prompts[i])) + [1] * len(prompts[i]) for i in batch],
                                device=device)
            new = max(requests[i].max_tokens for i in batch)
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=pad)
            useful += sum(requests[i].max_tokens for i in batch)
    duration = time.perf_counter() - start
    return {"name": f"transformers generate, static batches of {batch_size}, {device}", "duration_s": duration,
            "total_output_tokens": useful, "output_throughput": useful / duration}
