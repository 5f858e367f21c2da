"""`stagemesh bench`: drive a running router with a workload and report what it measured.

    stagemesh bench --num-prompts 32 --input-len-range 16:256 --output-len-range 16:128 [--baseline transformers]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time

from stagemesh.core.errors import StagemeshError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=("openai", "grpc"), default="openai", help="HTTP gateway or gRPC frontend")
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the router's HTTP address")
    p.add_argument("--grpc-target", default="127.0.0.1:50050", help="the router's gRPC frontend")
    p.add_argument("--model", default=None, help="model name to send (default: the server's)")
    p.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME",
                   help="LoRA adapters the server serves: each request names one of them as its model, picked at "
                        "random (seeded), as vLLM bench's --lora-modules")
    p.add_argument("--model-path", default=None, help="model directory for the tokenizer and the baseline "
                                                      "(default: the embedded model)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--dataset", default=None, metavar="FILE.jsonl", help="requests from a file instead of "
                                                                          "synthetic prompts")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len-range", default="16:256", metavar="A:B", help="prompt tokens (synthetic)")
    p.add_argument("--output-len-range", default="16:128", metavar="A:B", help="output tokens (ignore_eos)")
    p.add_argument("--prefix-repetition-num-prefixes", type=int, default=0, metavar="G",
                   help="requests share G long prefixes (system prompts), as vLLM bench's prefix_repetition "
                        "dataset; each request is a prefix + its own suffix of --input-len-range tokens (0: off)")
    p.add_argument("--prefix-repetition-prefix-len", type=int, default=512, metavar="L",
                   help="tokens of each shared prefix")
    p.add_argument("--prompt-format", choices=("ids", "text"), default="ids",
                   help="send synthetic prompts as token ids (exact lengths) or as their text (servers that take "
                        "only text, e.g. llama.cpp's)")
    p.add_argument("--count-tokens", choices=("auto", "server", "local"), default="auto",
                   help="how prompt and completion tokens are counted (openai backend): auto: the stream's usage "
                        "(or its token ids); for a stream with neither (llama-cpp-python's server sends no usage), "
                        "the text again through the server's tokenize endpoint (POST /tokenize or "
                        "/extras/tokenize), else the local tokenizer (--model-path). server / local: always "
                        "that way, the stream not asked for usage (the same counting for two servers)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests/s, Poisson arrivals "
                                                                        "(default inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    p.add_argument("--baseline", choices=("transformers",), default=None,
                   help="also run the workload through transformers' generate and print the ratio")
    p.add_argument("--baseline-batch-size", type=int, default=16)
    p.add_argument("--baseline-only", action="store_true", help="measure the baseline alone (no server)")
    p.add_argument("--json", default=None, metavar="FILE", help="write the results as JSON ('-': stdout)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--timeout", type=float, default=600, help="deadline of one request, seconds")


def build_workload(args: argparse.Namespace, model_dir) -> list:
    from stagemesh.entry.bench.workload import as_text, load_jsonl, parse_range, prefix_repetition, synthetic

    if args.dataset and args.prefix_repetition_num_prefixes:
        raise StagemeshError("--dataset and --prefix-repetition-num-prefixes are two workloads: give one")
    if args.dataset and args.prompt_format == "ids":
        return load_jsonl(args.dataset, parse_range(args.output_len_range, "--output-len-range")[1])[:args.num_prompts]
    if args.num_prompts < 1:
        raise StagemeshError("--num-prompts must be at least 1")
    if args.prefix_repetition_num_prefixes < 0 or args.prefix_repetition_prefix_len < 1:
        raise StagemeshError("--prefix-repetition-num-prefixes must be >= 0 and --prefix-repetition-prefix-len >= 1")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    if args.dataset:  # --prompt-format text: the dataset's token-id prompts as their text
        requests = load_jsonl(args.dataset, parse_range(args.output_len_range, "--output-len-range")[1])
        return as_text(requests[:args.num_prompts], tokenizer)
    lengths = (parse_range(args.input_len_range, "--input-len-range"),
               parse_range(args.output_len_range, "--output-len-range"))
    special = set(tokenizer.all_special_ids)
    if args.prefix_repetition_num_prefixes:
        requests = prefix_repetition(len(tokenizer), special, args.num_prompts, args.prefix_repetition_num_prefixes,
                                     args.prefix_repetition_prefix_len, *lengths, args.seed)
    else:
        requests = synthetic(len(tokenizer), special, args.num_prompts, *lengths, args.seed)
    return as_text(requests, tokenizer) if args.prompt_format == "text" else requests


async def drive(backend, requests: list, rate: float, max_concurrency: int | None, seed: int,
                progress: bool) -> tuple[list, float]:
    """Send every request (Poisson arrivals at `rate`, at most `max_concurrency` at once); results in order."""
    from tqdm import tqdm

    rng = random.Random(seed)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(requests), desc="requests", unit="req", disable=not progress, file=sys.stderr)

    async def one(req):
        if limit is None:
            result = await backend.send(req)
        else:
            async with limit:
                result = await backend.send(req)
        bar.update(1)
        return result

    start = time.perf_counter()
    tasks = []
    for req in requests:
        tasks.append(asyncio.create_task(one(req)))
        if rate != math.inf:
            await asyncio.sleep(rng.expovariate(rate))
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    bar.close()
    return list(results), duration


async def _server_model(args: argparse.Namespace) -> str:
    """The served model's name (or --model); asking first also tells at once when no server answers."""
    if args.backend == "grpc":
        from stagemesh.client import AsyncClient

        client = AsyncClient(args.grpc_target, api_key=args.api_key)
        try:
            names = await client.models()
        except Exception as err:  # noqa: BLE001
            detail = err.details() if hasattr(err, "details") else err
            raise StagemeshError(f"no gRPC frontend answered at {args.grpc_target}: {detail}") from None
        finally:
            await client.channel.close()
        return _pick(args.model, names, args.grpc_target)
    import aiohttp

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
            async with s.get(f"{args.base_url.rstrip('/')}/v1/models", headers=headers) as resp:
                resp.raise_for_status()
                names = [m["id"] for m in (await resp.json())["data"]]
    except aiohttp.ClientResponseError as err:
        raise StagemeshError(f"{args.base_url}/v1/models answered HTTP {err.status} {err.message}") from None
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as err:
        raise StagemeshError(f"no server answered at {args.base_url}: {err or type(err).__name__}") from None
    except (ValueError, KeyError, TypeError, IndexError):
        raise StagemeshError(f"{args.base_url}/v1/models is not an OpenAI model list") from None
    return _pick(args.model, names, args.base_url)


def _pick(wanted: str | None, names: list[str], where: str) -> str:
    if wanted:
        return wanted
    if not names:
        raise StagemeshError(f"the server at {where} lists no model; pass --model")
    return names[0]


async def _serve_bench(args: argparse.Namespace, requests: list, model_dir) -> tuple[list, float]:
    from stagemesh.entry.bench.backends import GrpcBackend, OpenAIBackend

    model = await _server_model(args)
    backend: GrpcBackend | OpenAIBackend
    if args.backend == "grpc":
        backend = GrpcBackend(args.grpc_target, model, args.api_key, args.timeout)
    else:
        backend = OpenAIBackend(args.base_url, model, args.api_key, args.timeout,
                                ask_usage=args.count_tokens == "auto")
    try:
        results, duration = await drive(backend, requests, args.request_rate, args.max_concurrency, args.seed,
                                        not args.no_progress)
        if isinstance(backend, OpenAIBackend):  # after the timed run: streams without usage get their tokens counted
            from stagemesh.entry.bench.counting import TokenCounter

            counter = TokenCounter(backend.session, args.base_url, model, backend.headers, args.count_tokens,
                                   lambda: _local_tokenizer(model_dir), str(model_dir))
            await counter.fill(results, requests)
        return results, duration
    finally:
        await backend.close()


def _local_tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def run(args: argparse.Namespace) -> int:
    from stagemesh.entry.bench.report import summarize, table
    from stagemesh.core.default_model import resolve_model

    if args.request_rate <= 0 or (args.max_concurrency is not None and args.max_concurrency < 1):
        raise StagemeshError("--request-rate must be > 0 and --max-concurrency at least 1")
    if args.backend == "grpc" and args.count_tokens != "auto":
        raise StagemeshError("--count-tokens server / local is for --backend openai (gRPC replies carry usage)")
    if args.backend == "grpc" and args.lora_modules:
        raise StagemeshError("--lora-modules is for --backend openai (the gRPC client sends one model)")
    model_dir = resolve_model(args.model_path)
    requests = build_workload(args, model_dir)
    if args.lora_modules:
        import random

        rng = random.Random(args.seed)
        for req in requests:
            req.model = rng.choice(args.lora_modules)
    summary: dict = {"backend": args.backend, "num_prompts": len(requests)}
    if not args.baseline_only:
        results, duration = asyncio.run(_serve_bench(args, requests, model_dir))
        summary.update(summarize(results, duration))
    if args.baseline or args.baseline_only:
        from stagemesh.entry.bench.baseline import transformers_static

        base = transformers_static(str(model_dir), requests, args.baseline_batch_size, not args.no_progress)
        summary["baseline"] = base
        if not args.baseline_only:
            summary["ratio_to_baseline"] = summary["output_throughput"] / base["output_throughput"]
    if args.baseline_only:
        b = summary["baseline"]
        print(f"{b['name']}: {b['total_output_tokens']} tokens in {b['duration_s']:.2f}s = "
              f"{b['output_throughput']:.2f} tok/s")
    else:
        print(table(summary))
    if args.json:
        text = json.dumps(summary, indent=2)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text + "\n")
    return 0 if args.baseline_only or summary["failed_requests"] == 0 else 1
