"""Decode context parallelism (-dcp) on CPU: the longest prompt a replica takes, decode TPOT and a long prompt's
TTFT, `-tp 2` against `-tp 2 -dcp 2`, through `stagemesh serve` over HTTP.

The model is a random Llama-like one made here in a temp dir (tests/tiny_models.py; nothing is downloaded), with
one KV head (MQA): --hidden 256, --heads 4 (head_dim 64), 4 layers, fp32, a word-level tokenizer. At TP=2 plain
TP holds that one KV head on both ranks (each rank keeps every token); with -dcp 2 the two ranks keep the same
head but each half of every block's tokens, so the same per-rank --kv-cache-memory holds twice the tokens.

1. Capacity. Each layout is served with --capacity-kv-memory bytes per rank; its "KV cache size: N tokens"
   (the scheduler's log: num_kv_blocks x block_size) and /v1/models' max_model_len are read, then checked for
   real: a prompt of N - max_tokens tokens (max_tokens 1) is served (200, one token), and one token more is
   refused (a 400 through the router). Prints both sizes and the ratio (expected 2.0).
2. Decode TPOT. Each layout is served with --kv-memory bytes per rank (room for --concurrency x (prompt +
   --output-len) in both); for each prompt length and concurrency, that many streamed greedy requests
   (ignore_eos, --output-len tokens, distinct random prompts so prefix caching shares nothing) go at once; the
   time per output token is read from the arrival times of their streamed tokens (a chunk of k tokens counts
   as k tokens at its time). TPOT: the median over the requests of (last token - first token) / (tokens - 1),
   vLLM's definition, which at concurrency > 1 takes in the batch's other prefills; steady: the window from the
   batch's last first token to its first last token, over the median count of tokens a request got in it (the
   decode step of a full batch, where the window holds 4 tokens or more).
3. TTFT of a --long-prompt-token prompt (one request alone, max_tokens 1, a fresh random prompt each time),
   measured from the client, --ttft-reps times per round.

Layouts alternate (tp2, tp2-dcp2, tp2, ...) for --rounds rounds, a fresh serve each, every stage process with
--threads 1 (two stage processes on this machine's cores). Prints, per layout, the best and the median over
rounds, and the ratio dcp / tp (TPOT and TTFT ratios: the cost of DCP's extra all-gathers and log-sum-exp merge,
where a rank attends half the tokens; not a speed-up on a machine this small).

    .venv/bin/python benchmarks/bench_dcp.py [--rounds 3] [--quick]
"""
from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))

from serve_process import start_serve, stop  # noqa: E402
from tiny_models import save_random_model, with_word_tokenizer  # noqa: E402

LAYOUTS = {"tp2": ["-tp", "2"], "tp2-dcp2": ["-tp", "2", "-dcp", "2"]}
NAME = "dcp-bench"
VOCAB = 384


def make_model(tmp: Path, hidden: int, heads: int, layers: int) -> Path:
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=1, vocab_size=VOCAB,
                      max_position_embeddings=1 << 17, rms_norm_eps=1e-6, tie_word_embeddings=False,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return with_word_tokenizer(save_random_model(tmp / "raw", cfg), tmp / "model", VOCAB)


def serve(model: Path, layout: str, kv_memory: int, log: Path, extra: list[str]):
    log.unlink(missing_ok=True)
    return start_serve([str(model), "--device", "cpu", "--served-model-name", NAME, "--kv-cache-memory",
                        str(kv_memory), "--threads", "1", *LAYOUTS[layout], *extra], log=log, timeout=300)


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def complete(base: str, ids: list[int], max_tokens: int) -> requests.Response:
    return requests.post(f"{base}/v1/completions", json={"model": NAME, "prompt": ids, "max_tokens": max_tokens,
                                                         "temperature": 0, "ignore_eos": True}, timeout=600)


def stream(base: str, ids: list[int], max_tokens: int) -> tuple[float, list[float]]:
    """(the request's start, the arrival time of each of its tokens) of one streamed greedy request (a chunk of k
    tokens gives k arrivals at its time)."""
    body = {"model": NAME, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    start, arrivals = time.perf_counter(), []
    with requests.post(f"{base}/v1/completions", json=body, stream=True, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines(chunk_size=None):  # each read as it arrives (512 would hold tokens back)
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            n = sum(len(c.get("token_ids") or []) for c in json.loads(line[6:]).get("choices", []))
            arrivals += [time.perf_counter()] * n
    return start, arrivals


def tpot(results: list[tuple[float, list[float]]]) -> tuple[float | None, float | None]:
    """(median over requests of (last token - first token) / (tokens - 1), vLLM's TPOT; the steady decode time per
    token: the window from the last request's first token to the first request's last one, over the median
    count of tokens a request got in it, None where the window holds fewer than 4). A request whose tokens all
    came in one burst (under 0.1 ms a token: the stream held back, the machine busy elsewhere) is left out of the
    TPOT, and a batch with one out of the steady figure; None where nothing is left."""
    per = [(t[-1] - t[0]) / (len(t) - 1) for _, t in results]
    kept = [x for x in per if x >= 1e-4]
    if len(kept) < len(per):
        print(f"    ({len(per) - len(kept)} of {len(per)} requests streamed in one burst: left out)")
    lo, hi = max(t[0] for _, t in results), min(t[-1] for _, t in results)
    inside = statistics.median(sum(lo < x <= hi for x in t) for _, t in results)
    steady = (hi - lo) / inside if inside >= 4 and len(kept) == len(per) else None
    return (statistics.median(kept) if kept else None), steady


def capacity(model: Path, layout: str, kv_memory: int, tmp: Path) -> dict:
    log = tmp / f"capacity-{layout}.log"
    proc, base = serve(model, layout, kv_memory, log, [])
    try:
        m = re.search(r"KV cache size: ([0-9,]+) tokens", log.read_text(errors="replace"))
        kv_tokens = int(m.group(1).replace(",", "")) if m else None
        max_len = requests.get(f"{base}/v1/models", timeout=10).json()["data"][0]["max_model_len"]
        rng = random.Random(1)
        fits = max_len - 1
        start = time.perf_counter()
        ok = complete(base, prompt(rng, fits), 1)
        served_s = time.perf_counter() - start
        served = ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 1
        over = complete(base, prompt(rng, fits + 1), 1)
        return {"kv_tokens": kv_tokens, "max_model_len": max_len, "served": served, "served_s": served_s,
                "served_status": ok.status_code, "refused": over.status_code == 400, "refused_status": over.status_code,
                "refusal": over.text[:160] if over.status_code != 200 else ""}
    finally:
        stop(proc)


def speed_round(model: Path, layout: str, args, tmp: Path, rng: random.Random) -> dict:
    """{(prompt_len, concurrency): median gap} and {"ttft": [s, ...]} from one fresh serve of `layout`."""
    proc, base = serve(model, layout, args.kv_memory, tmp / f"speed-{layout}.log", [])
    out: dict = {}
    try:
        complete(base, prompt(rng, 64), 4)  # warm-up
        for plen in args.prompt_lens:
            for conc in args.concurrency:
                results: list = [None] * conc
                ids = [prompt(rng, plen) for _ in range(conc)]

                def one(i: int) -> None:
                    results[i] = stream(base, ids[i], args.output_len)
                threads = [threading.Thread(target=one, args=(i,)) for i in range(conc)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                assert all(r is not None and len(r[1]) == args.output_len for r in results), results
                out[(plen, conc)] = tpot(results)
        out["ttft"] = []
        for _ in range(args.ttft_reps):
            start, arrivals = stream(base, prompt(rng, args.long_prompt), 1)
            out["ttft"].append(arrivals[0] - start)
    finally:
        stop(proc)
    return out


def fmt_ratio(a: list[float], b: list[float]) -> str:
    return (f"best {min(a) * 1e3:8.2f} / {min(b) * 1e3:8.2f} ms ({min(b) / min(a):.3f}x)   median "
            f"{statistics.median(a) * 1e3:8.2f} / {statistics.median(b) * 1e3:8.2f} ms "
            f"({statistics.median(b) / statistics.median(a):.3f}x)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--capacity-kv-memory", type=int, default=8 << 20,
                   help="per-rank KV bytes for the capacity check (8 MiB: 4096 fp32 tokens of this model at TP=2)")
    p.add_argument("--kv-memory", type=int, default=48 << 20, help="per-rank KV bytes for the TPOT/TTFT runs")
    p.add_argument("--prompt-lens", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--long-prompt", type=int, default=4096, help="tokens of the TTFT prompt")
    p.add_argument("--ttft-reps", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--skip-capacity", action="store_true")
    p.add_argument("--quick", action="store_true", help="~1 minute: 1 round, 512-token prompts, 16 output tokens, "
                   "a 2048-token TTFT prompt, a 2 MiB capacity check")
    args = p.parse_args()
    if args.quick:
        args.rounds, args.prompt_lens, args.output_len, args.long_prompt = 1, [512], 16, 2048
        args.ttft_reps, args.capacity_kv_memory = 1, 2 << 20
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model = make_model(tmp, args.hidden, args.heads, args.layers)
        print(f"random llama: hidden {args.hidden}, {args.heads} heads, 1 KV head, {args.layers} layers, fp32, CPU, "
              f"--threads 1 per stage process")
        if not args.skip_capacity:
            caps = {layout: capacity(model, layout, args.capacity_kv_memory, tmp) for layout in LAYOUTS}
            print(f"\n1. longest prompt at --kv-cache-memory {args.capacity_kv_memory:,} bytes per rank")
            for layout, c in caps.items():
                print(f"  {layout:9s} KV cache {c['kv_tokens']:,} tokens, max_model_len {c['max_model_len']:,}: "
                      f"prompt {c['max_model_len'] - 1:,} + 1 output {'served' if c['served'] else 'NOT served'} "
                      f"({c['served_status']}, {c['served_s']:.1f} s), prompt {c['max_model_len']:,} + 1 "
                      f"{'refused (400)' if c['refused'] else 'NOT refused'} ({c['refused_status']})")
                if c["refusal"] and not c["refused"] or c["served_status"] != 200:
                    print(f"    {c['refusal']}")
            a, b = caps["tp2"], caps["tp2-dcp2"]
            print(f"  ratio dcp2 / tp2: KV cache {b['kv_tokens'] / a['kv_tokens']:.2f}x, longest prompt "
                  f"{(b['max_model_len'] - 1) / (a['max_model_len'] - 1):.2f}x  ({time.monotonic() - t0:.0f} s)")
        runs: dict[str, list[dict]] = {layout: [] for layout in LAYOUTS}
        rng = random.Random(0)
        for _ in range(args.rounds):
            for layout in LAYOUTS:
                runs[layout].append(speed_round(model, layout, args, tmp, rng))
        print(f"\n2. decode time per output token ({args.output_len} tokens, greedy; TPOT: median over requests; "
              f"steady: while all of a batch decode), "
              f"--kv-cache-memory {args.kv_memory:,}, {args.rounds} round(s); tp2 / tp2-dcp2")
        for key in runs["tp2"][0]:
            if key == "ttft":
                continue
            for i, what in enumerate(("TPOT  ", "steady")[:1 if key[1] == 1 else 2]):
                a = [r[key][i] for r in runs["tp2"] if r[key][i] is not None]
                b = [r[key][i] for r in runs["tp2-dcp2"] if r[key][i] is not None]
                if a and b:
                    print(f"  prompt {key[0]:5d} concurrency {key[1]:2d} {what}: {fmt_ratio(a, b)}")
        a = [t for r in runs["tp2"] for t in r["ttft"]]
        b = [t for r in runs["tp2-dcp2"] for t in r["ttft"]]
        print(f"\n3. TTFT of a {args.long_prompt}-token prompt (alone, {len(a)} per layout); tp2 / tp2-dcp2")
        print(f"  {fmt_ratio(a, b)}")
    print(f"\n({time.monotonic() - t0:.0f} s)")


if __name__ == "__main__":
    main()
