"""Benchmark workloads: seeded synthetic prompts of exact token lengths, or a JSONL file."""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from stagemesh.core.errors import StagemeshError


@dataclass
class BenchRequest:
    max_tokens: int
    prompt_ids: list[int] | None = None  # synthetic prompts travel as token ids: exact lengths
    prompt: str | None = None
    messages: list[dict] | None = None
    input_len: int = 0  # known for token-id prompts; from the usage otherwise
    model: str | None = None  # --lora-modules: the adapter it names (else the run's model)


def parse_range(text: str, flag: str) -> tuple[int, int]:
    try:
        low, high = (int(x) for x in str(text).split(":")) if ":" in str(text) else (int(text), int(text))
    except ValueError:
        raise StagemeshError(f"{flag} {text!r} must be A:B (or one number), e.g. 16:256") from None
    if not 1 <= low <= high:
        raise StagemeshError(f"{flag} {text!r}: need 1 <= A <= B")
    return low, high


def synthetic(vocab_size: int, special_ids: set[int], num: int, input_len: tuple[int, int],
              output_len: tuple[int, int], seed: int = 0) -> list[BenchRequest]:
    """`num` prompts of random (non-special) token ids; lengths uniform in the ranges; same seed, same workload."""
    rng = random.Random(seed)
    pool = [t for t in range(vocab_size) if t not in special_ids]
    out = []
    for _ in range(num):
        n = rng.randint(*input_len)
        out.append(BenchRequest(max_tokens=rng.randint(*output_len), prompt_ids=[rng.choice(pool) for _ in range(n)],
                                input_len=n))
    return out


def prefix_repetition(vocab_size: int, special_ids: set[int], num: int, num_prefixes: int, prefix_len: int,
                      suffix_len: tuple[int, int], output_len: tuple[int, int], seed: int = 0) -> list[BenchRequest]:
    """Requests that share long prefixes (vLLM bench's prefix_repetition): `num_prefixes` random prefixes of
    `prefix_len` tokens (system prompts), each request one of them (in turn) + a suffix of its own; the
    requests come shuffled, so a balancer does not get the groups in order."""
    rng = random.Random(seed)
    pool = [t for t in range(vocab_size) if t not in special_ids]
    prefixes = [[rng.choice(pool) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    out = []
    for i in range(num):
        suffix = [rng.choice(pool) for _ in range(rng.randint(*suffix_len))]
        prompt = prefixes[i % num_prefixes] + suffix
        out.append(BenchRequest(max_tokens=rng.randint(*output_len), prompt_ids=prompt, input_len=len(prompt)))
    rng.shuffle(out)
    return out


def as_text(requests: list[BenchRequest], tokenizer) -> list[BenchRequest]:
    """The same prompts as text, for servers that take no token ids (llama.cpp's): the server counts the
    tokens again (usage), which may differ slightly from the ids'."""
    return [BenchRequest(r.max_tokens, prompt=tokenizer.decode(r.prompt_ids), input_len=0)
            if r.prompt_ids is not None else r for r in requests]


def load_jsonl(path: str | Path, default_max_tokens: int = 128) -> list[BenchRequest]:
    """Lines of {"prompt": str | [ids], "max_tokens": N} or {"messages": [...], "max_tokens": N}."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as err:
        raise StagemeshError(f"--dataset {path}: {err.strerror}") from None
    out = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as err:
            raise StagemeshError(f"--dataset {path}, line {number}: not JSON ({err.msg})") from None
        if not isinstance(item, dict) or ("prompt" in item) == ("messages" in item):
            raise StagemeshError(f"--dataset {path}, line {number}: need an object with 'prompt' or 'messages'")
        max_tokens = item.get("max_tokens", default_max_tokens)
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise StagemeshError(f"--dataset {path}, line {number}: max_tokens must be a positive integer")
        prompt = item.get("prompt")
        if isinstance(prompt, list):
            out.append(BenchRequest(max_tokens, prompt_ids=prompt, input_len=len(prompt)))
        elif isinstance(prompt, str):
            out.append(BenchRequest(max_tokens, prompt=prompt))
        elif isinstance(item.get("messages"), list):
            out.append(BenchRequest(max_tokens, messages=item["messages"]))
        else:
            raise StagemeshError(f"--dataset {path}, line {number}: 'prompt' must be a string or a list of token ids")
    if not out:
        raise StagemeshError(f"--dataset {path}: no requests in it")
    return out
