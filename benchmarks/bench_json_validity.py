"""How often constrained JSON comes back whole: N requests at temperature 1 (seeded 0..N-1) per kind, each
with max_tokens 120, against a served mesh (the embedded model unless --model), counting the answers that
parse (and hold their schema) and those cut short. The kinds: response_format json_object, a json_schema
(an object with a name, an age and at most 4 tags, no length bounds) and tool_choice "required" over two
tools, read back as tool_calls. Prints one line per kind and a JSON summary.

    .venv/bin/python benchmarks/bench_json_validity.py                   # serves the mesh itself
    .venv/bin/python benchmarks/bench_json_validity.py --url http://127.0.0.1:8000/v1 --requests 200
    .venv/bin/python benchmarks/bench_json_validity.py --serve-arg=--structured-outputs-config \\
        --serve-arg='{"disable_any_whitespace": false}'                  # whitespace allowed (bounded)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_process import start_serve, stop  # noqa: E402

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"},
                                                                    "maxItems": 4}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"},
                                                                         "unit": {"enum": ["c", "f"]}},
                                                          "required": ["city", "unit"]}}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
KINDS = {
    "json_object": ("Describe a person as a JSON object.", {"response_format": {"type": "json_object"}}),
    "json_schema": ("Describe a person as JSON.", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "person", "schema": SCHEMA}}}),
    "required_tools": ("What is the weather and the time in Paris?", {"tools": TOOLS, "tool_choice": "required"}),
}


def one(client: openai.OpenAI, model: str, kind: str, seed: int, max_tokens: int, temperature: float) -> str:
    """"valid", "length" (cut short, reported so) or "invalid"."""
    ask, kwargs = KINDS[kind]
    out = client.chat.completions.create(model=model, messages=[{"role": "user", "content": ask}], seed=seed,
                                         temperature=temperature, max_tokens=max_tokens, **kwargs)
    choice = out.choices[0]
    if choice.finish_reason == "length":
        return "length" if kind != "required_tools" or not choice.message.content else "invalid"
    try:
        if kind == "required_tools":
            calls = choice.message.tool_calls or []
            assert calls and all(c.function.name in ("get_weather", "get_time") for c in calls)
            for c in calls:
                json.loads(c.function.arguments)
        else:
            value = json.loads(choice.message.content)
            assert isinstance(value, dict)
            if kind == "json_schema":
                jsonschema.validate(value, SCHEMA)
    except (AssertionError, ValueError, jsonschema.ValidationError):
        return "invalid"
    return "valid"


def run(url: str, model: str, requests: int, max_tokens: int, temperature: float, concurrency: int) -> dict:
    client = openai.OpenAI(base_url=url, api_key="none", timeout=600)
    results = {}
    for kind in KINDS:
        start = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            outcomes = list(pool.map(lambda s: one(client, model, kind, s, max_tokens, temperature),
                                     range(requests)))
        counts = {k: outcomes.count(k) for k in ("valid", "length", "invalid")}
        results[kind] = counts
        print(f"{kind:15s} {counts['valid']}/{requests} valid, {counts['length']} cut short (finish_reason "
              f"length), {counts['invalid']} invalid  ({time.perf_counter() - start:.0f} s)", flush=True)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=None, help="a served mesh's /v1 (default: serve one here)")
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=120)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--serve-arg", action="append", default=[], help="a flag for `stagemesh serve` (repeat)")
    a = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if a.url:
        results = run(a.url, a.model, a.requests, a.max_tokens, a.temperature, a.concurrency)
    else:
        proc, base = start_serve(a.serve_arg)
        try:
            results = run(f"{base}/v1", a.model, a.requests, a.max_tokens, a.temperature, a.concurrency)
        finally:
            stop(proc)
    print(json.dumps({"requests": a.requests, "max_tokens": a.max_tokens, "temperature": a.temperature,
                      "serve_args": a.serve_arg, "results": results}))


if __name__ == "__main__":
    main()
