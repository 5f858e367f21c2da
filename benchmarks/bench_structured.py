"""What a structured-output constraint costs: the standard CPU workload (32 requests, prompts of 16-256
random tokens, outputs of 16-128, all at once) through the in-process engine (the replica's driver over
its stage slices, no RPC), every request constrained by a JSON schema, against the same workload
unconstrained, the arms alternating in one run; and the time to compile a 50-field schema.

The schema keeps the output open for the whole of max_tokens (an object with one string of at least 4096
characters: `{"story": "...`), so both arms decode the same number of tokens and the difference is the
constraint's cost per token (mask, apply, advance), not shorter outputs.

    .venv/bin/python benchmarks/bench_structured.py [--rounds 3] [--num-prompts 32]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from stagemesh.entry.local_engine import LocalEngine  # noqa: E402
from stagemesh.entry.bench.workload import synthetic  # noqa: E402
from stagemesh.core.default_model import resolve_model  # noqa: E402
from stagemesh.core.sampling_params import SamplingParams, StructuredOutputs  # noqa: E402

STORY = json.dumps({"type": "object", "properties": {"story": {"type": "string", "minLength": 4096}},
                    "required": ["story"]})  # longer than any output here: the string stays open


def fifty_fields() -> str:
    kinds = [{"type": "string", "maxLength": 20}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"},
             {"enum": ["a", "b", "c"]}, {"type": "array", "items": {"type": "string"}}]
    props = {f"field_{i}": kinds[i % len(kinds)] for i in range(50)}
    return json.dumps({"type": "object", "properties": props, "required": list(props)})


def run_arm(engine: LocalEngine, workload, constrained: bool) -> tuple[float, int]:
    """(output tokens per second, output tokens) of the workload, all requests at once."""
    structured = StructuredOutputs("json", STORY) if constrained else None
    params = [SamplingParams(max_tokens=r.max_tokens, temperature=1.0, seed=i, structured=structured,
                             ignore_eos=not constrained) for i, r in enumerate(workload)]
    start = time.perf_counter()
    outs = engine.generate([r.prompt_ids for r in workload], params)
    tokens = sum(map(len, outs))
    return tokens / (time.perf_counter() - start), tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=32)
    a = p.parse_args()
    from transformers import AutoTokenizer

    from stagemesh.core.grammar import GrammarCompiler

    model_dir = str(resolve_model(None))
    tok = AutoTokenizer.from_pretrained(model_dir)
    workload = synthetic(len(tok), set(tok.all_special_ids), a.num_prompts, (16, 256), (16, 128), seed=0)
    start = time.perf_counter()
    compiler = GrammarCompiler(tok, len(tok), [tok.eos_token_id])
    indexed = time.perf_counter() - start
    start = time.perf_counter()
    compiler.compile(StructuredOutputs("json", fifty_fields()))
    print(f"vocabulary indexed in {indexed * 1000:.0f} ms (once per process); a 50-field schema compiled in "
          f"{(time.perf_counter() - start) * 1000:.1f} ms")
    results: dict[bool, list[float]] = {True: [], False: []}
    with LocalEngine.of(model_dir) as engine:
        run_arm(engine, workload[:2], True)  # warm up: the stage's compiler
        run_arm(engine, workload, False)  # and the kernels at every batch size the workload reaches
        for rnd in range(a.rounds):
            for constrained in ((False, True) if rnd % 2 == 0 else (True, False)):
                tps, tokens = run_arm(engine, workload, constrained)
                results[constrained].append(tps)
                print(f"  round {rnd}: {'json_schema' if constrained else 'unconstrained'}: {tps:.1f} output tok/s "
                      f"({tokens} tokens)", flush=True)
    on, off = statistics.median(results[True]), statistics.median(results[False])
    print(f"every request under a json_schema: {on:.1f} tok/s; unconstrained: {off:.1f} tok/s; ratio {on / off:.3f} "
          f"(target >= 0.90)")


if __name__ == "__main__":
    main()
