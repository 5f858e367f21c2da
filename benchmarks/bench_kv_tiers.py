"""KV tiers (issue 44) on a multi-turn chat workload whose working set is several times the KV pool.

C conversations, each a system prompt and T turns; each turn sends the whole history plus a new user message
(seeded random words) through /v1/chat/completions, streams a reply of a fixed number of tokens (temperature
0, ignore_eos) and appends it to the history. Turns go round-robin over the conversations (turn 1 of every
conversation, then turn 2, ...) with a few in flight at once, so by the time a conversation comes back its
prefix has been pushed out of a pool that holds about 1/--pool-ratio of the working set (the sum of the
conversations' final lengths).

Configurations, a fresh `stagemesh serve` (one replica, the embedded default model) for each, alternating
round by round (off, host, disk, [ext,] off, host, disk, ...):
  off   tiers off (prefix caching on)
  host  --kv-offloading-size for the whole working set
  disk  --kv-offloading-size about one pool, --kv-offloading-disk-size the whole working set (a temp dir)

Prints per configuration and round: TTFT p50/p99 of turns >= 2 and of all turns, output throughput, total time,
the prefix-cache hit rate (router /metrics) and the scheduler's tier counters (stagemesh:kv_tier_*), and
whether each reply matches configuration `off`'s (the same history, greedy); then medians and ratios to `off`.
With --url an external OpenAI server (vLLM, started by hand with the same KV bytes; VLLM_SERVER_DEV_MODE=1 lets
each round start with its prefix cache reset) joins the rotation under --label (or alone with --only-url); its
replies are compared with `off`'s too.

    .venv/bin/python benchmarks/bench_kv_tiers.py [--configs off host disk --rounds 2 --conversations 12
        --turns 4 --user-len 150:250 --output-len 28 --concurrency 2 --pool-ratio 4 --dtype bfloat16]
    .venv/bin/python benchmarks/bench_kv_tiers.py --url http://127.0.0.1:8001 --served-model smol --label vllm
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's stagemesh

from serve_process import free_port, start_serve, stop

CONFIGS = ("off", "host", "disk")


def cpu_isa() -> str:
    try:
        flags = set(next(l for l in open("/proc/cpuinfo") if l.startswith("flags")).split(":")[1].split())
        model = next(l for l in open("/proc/cpuinfo") if l.startswith("model name")).split(":")[1].strip()
    except (OSError, StopIteration):
        return "unknown"
    isa = [f for f in ("avx2", "avx512f", "avx512bw", "avx512_bf16", "avx512_vnni", "amx_bf16") if f in flags]
    return f"{model}, {os.cpu_count()} cores, {' '.join(isa)}"


# ---------------------------------------------------------------- the workload

def build_workload(args, tok) -> tuple[list[str], list[list[str]]]:
    """(system prompt per conversation, user messages per conversation), seeded: words from the tokenizer's
    vocabulary (tokens that are a space + letters), so a message of N words is about N tokens."""
    rng = random.Random(args.seed)
    words = sorted({t[1:] for t in tok.get_vocab() if t.startswith("Ġ") and t[1:].isalpha() and 3 <= len(t) <= 9})

    def text(n: int) -> str:
        return " ".join(rng.choice(words) for _ in range(n))

    lo, hi = (int(x) for x in args.user_len.split(":"))
    systems = [f"You are assistant number {c}. " + text(args.system_len) for c in range(args.conversations)]
    users = [[text(rng.randint(lo, hi)) for _ in range(args.turns)] for _ in range(args.conversations)]
    return systems, users


def working_set_estimate(args, tok, systems, users) -> list[int]:
    """Each conversation's final length in tokens (the last turn's prompt + its reply), with replies of
    --output-len placeholder tokens."""
    rng = random.Random(1)
    vocab = sorted(i for t, i in tok.get_vocab().items() if t.startswith("Ġ") and t[1:].isalpha())
    out = []
    for sys_text, turns in zip(systems, users):
        msgs = [{"role": "system", "content": sys_text}]
        for u in turns:
            msgs += [{"role": "user", "content": u},
                     {"role": "assistant", "content": tok.decode([rng.choice(vocab) for _ in range(args.output_len)])}]
        ids = tok.apply_chat_template(msgs, tokenize=True)
        out.append(len(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


async def chat(session, base: str, model: str, messages: list[dict], max_tokens: int) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    res = {"ttft": None, "text": "", "prompt_tokens": 0, "completion_tokens": 0, "error": None}
    try:
        async with session.post(f"{base}/v1/chat/completions", json=body) as resp:
            if resp.status != 200:
                res["error"] = f"HTTP {resp.status}: {(await resp.text())[:500]}"
                return res
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if isinstance(chunk.get("error"), dict):
                    res["error"] = f"stream error: {chunk['error']}"
                    return res
                if chunk.get("usage"):
                    res["prompt_tokens"] = chunk["usage"]["prompt_tokens"]
                    res["completion_tokens"] = chunk["usage"]["completion_tokens"]
                for c in chunk.get("choices") or []:
                    piece = (c.get("delta") or {}).get("content")
                    if piece:
                        if res["ttft"] is None:
                            res["ttft"] = time.perf_counter() - start
                        res["text"] += piece
    except Exception as err:  # noqa: BLE001 - counted as a failed turn
        res["error"] = f"{type(err).__name__}: {err}"
    res["latency"] = time.perf_counter() - start
    return res


async def run_workload(base: str, model: str, args, systems, users) -> dict:
    """Every turn of every conversation, turn-major (round-robin), at most --concurrency in flight; a turn
    waits for its conversation's previous one. Returns the per-turn records and the wall time."""
    import aiohttp

    C, T = len(systems), len(users[0])
    history = [[{"role": "system", "content": s}] for s in systems]
    done = [[asyncio.Event() for _ in range(T)] for _ in range(C)]
    jobs = asyncio.Queue()
    for t in range(T):
        for c in range(C):
            jobs.put_nowait((c, t))
    records = []

    failed = []

    async def worker(session):
        while not failed:  # a failed turn (an error, a stall past --turn-timeout) ends the run
            try:
                c, t = jobs.get_nowait()
            except asyncio.QueueEmpty:
                return
            if t:
                await done[c][t - 1].wait()
            history[c].append({"role": "user", "content": users[c][t]})
            r = await chat(session, base, model, list(history[c]), args.output_len)
            history[c].append({"role": "assistant", "content": r["text"]})
            records.append({"conv": c, "turn": t, **r})
            if r["error"]:
                failed.append((c, t))
                print(f"      conversation {c} turn {t + 1} failed after {r['latency']:.0f} s: {r['error']}; "
                      "ending this run", flush=True)
            done[c][t].set()

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=args.turn_timeout)) as session:
        warm = await chat(session, base, model, [{"role": "user", "content": "Say hello."}], 8)
        if warm["error"]:
            sys.exit(f"warm-up request failed: {warm['error']}")
        start = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(args.concurrency)))
        wall = time.perf_counter() - start
    # turns never sent (the run ended at a failure) count as failed
    sent = {(r["conv"], r["turn"]) for r in records}
    records += [{"conv": c, "turn": t, "ttft": None, "text": "", "prompt_tokens": 0, "completion_tokens": 0,
                 "error": "not sent (an earlier turn failed)", "latency": 0.0}
                for t in range(T) for c in range(C) if (c, t) not in sent]
    return {"records": sorted(records, key=lambda r: (r["conv"], r["turn"])), "wall": wall}


# ---------------------------------------------------------------- metrics

def scrape(url: str) -> dict[str, float]:
    """Prometheus counters/gauges of interest, summed over label sets (name{tier=..} kept apart)."""
    out: dict[str, float] = {}
    try:
        text = requests.get(url, timeout=10).text
    except requests.RequestException:
        return out
    for line in text.splitlines():
        m = re.match(r"(vllm:prefix_cache_(?:queries|hits)|stagemesh:kv_tier_\w+?|stagemesh:scheduler_step_seconds_\w+|"
                     r"stagemesh:stage_compute_seconds_\w+|stagemesh:num_preemptions)(?:_total)?"
                     r"(\{[^}]*\})? ([0-9.e+-]+)$", line)
        if not m or line.startswith("#") or m.group(1).endswith(("_created", "_bucket")):
            continue
        tier = re.search(r'tier="([^"]+)"', m.group(2) or "")
        key = m.group(1) + (f"[{tier.group(1)}]" if tier else "")
        out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


def diff(after: dict, before: dict) -> dict:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(run: dict, before: dict, after: dict, reference: list[dict] | None) -> dict:
    recs = run["records"]
    failed = [r for r in recs if r["error"] or r["ttft"] is None]
    ok = [r for r in recs if r not in failed]
    later = [r["ttft"] * 1000 for r in ok if r["turn"] >= 1]
    every = [r["ttft"] * 1000 for r in ok]
    m = diff(after, before)
    queries, hits = m.get("vllm:prefix_cache_queries", 0.0), m.get("vllm:prefix_cache_hits", 0.0)
    out = {"ttft_later_p50": pct(later, 50), "ttft_later_p99": pct(later, 99), "ttft_all_p50": pct(every, 50),
           "ttft_all_p99": pct(every, 99), "tok_s": sum(r["completion_tokens"] for r in ok) / run["wall"],
           "wall_s": run["wall"], "hit_rate": hits / queries if queries else float("nan"), "failed": len(failed),
           "errors": [r["error"] for r in failed][:3],
           "final_lens": {r["conv"]: r["prompt_tokens"] + r["completion_tokens"] for r in ok},
           "tiers": {k: v for k, v in m.items() if k.startswith("stagemesh:kv_tier") and v}}
    if reference is not None:
        ref = {(r["conv"], r["turn"]): r["text"] for r in reference}
        out["same_as_off"] = sum(ref.get((r["conv"], r["turn"])) == r["text"] for r in recs) / len(recs)
        out["differ_from_off"] = [(r["conv"], r["turn"] + 1) for r in recs
                                  if ref.get((r["conv"], r["turn"])) != r["text"]]
    out["texts"] = {f"{r['conv']}.{r['turn'] + 1}": r["text"] for r in recs}
    steps = {k.split("seconds_")[1]: v for k, v in m.items() if "scheduler_step_seconds" in k}
    compute = {k.split("seconds_")[1]: v for k, v in m.items() if "stage_compute_seconds" in k}
    out["steps"] = {"n": steps.get("count", 0), "step_s": steps.get("sum", 0.0), "compute_s": compute.get("sum", 0.0),
                    "preemptions": m.get("stagemesh:num_preemptions", 0.0)}
    return out


# ---------------------------------------------------------------- the mesh

def serve_args(config: str, args, kv_bytes: int, ws_bytes: int, disk_dir: Path | None, metrics_port: int) -> list[str]:
    gib = 1 << 30
    argv = [*(["--dtype", args.dtype] if args.dtype else []), "--kv-cache-memory", str(kv_bytes),
            "--metrics-port", str(metrics_port), *args.serve_arg]
    if config == "host":
        argv += ["--kv-offloading-size", f"{ws_bytes * 1.25 / gib:.4f}"]
    elif config == "disk":
        argv += ["--kv-offloading-size", f"{kv_bytes * 1.0 / gib:.4f}",
                 "--kv-offloading-disk-size", f"{ws_bytes * 1.25 / gib:.4f}",
                 "--kv-offloading-disk-path", str(disk_dir)]
    return argv


def pool_tokens(log: Path, since: int) -> tuple[int | None, str]:
    text = log.read_text(errors="replace")[since:]
    m = re.search(r"KV cache size: ([0-9,]+) tokens", text)
    tiers = re.search(r"KV tiers: [^\n]*", text)
    return (int(m.group(1).replace(",", "")) if m else None), (tiers.group(0) if tiers else "")


def kv_bytes_per_token(model_dir: Path, dtype: str | None) -> int:
    cfg = json.loads((model_dir / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    width = 4 if dtype in ("float32", "fp32") else 2
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * width


def fmt(name: str, s: dict) -> str:
    tiers = " ".join(f"{k.removeprefix('stagemesh:kv_tier_')}={v:g}" for k, v in sorted(s["tiers"].items())
                     if not k.startswith("stagemesh:kv_tier_blocks") and "seconds" not in k)
    same = f"  same-as-off {s['same_as_off']:.0%} (differ: conv.turn {s['differ_from_off'][:6]})" \
        if s.get("differ_from_off") else f"  same-as-off {s['same_as_off']:.0%}" if "same_as_off" in s else ""
    t = s["tiers"]
    loads = [f"{k} mean {t[f'stagemesh:kv_tier_{k}_seconds_sum'] / n * 1000:.0f} ms x{n:g}" for k in ("load", "store")
             if (n := t.get(f"stagemesh:kv_tier_{k}_seconds_count"))]
    st = s["steps"]
    steps = f"{st['n']:g} steps, {st['step_s']:.1f} s in steps, {st['compute_s']:.1f} s stage compute, " \
            f"{st['preemptions']:g} preemptions" if st["n"] else ""
    return (f"{name:5s} TTFT turns>=2 p50 {s['ttft_later_p50']:7.0f} p99 {s['ttft_later_p99']:7.0f} ms | all p50 "
            f"{s['ttft_all_p50']:7.0f} p99 {s['ttft_all_p99']:7.0f} ms | {s['tok_s']:5.1f} tok/s | "
            f"{s['wall_s']:6.1f} s | hit {s['hit_rate']:6.1%} | failed {s['failed']}{same}"
            + (f"\n      tiers: {tiers}; {', '.join(loads)}" if tiers else "") + (f"\n      {steps}" if steps else "")
            + (f"\n      errors: {s['errors']}" if s["errors"] else ""))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--conversations", type=int, default=12)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-len", type=int, default=48, help="words of each conversation's own system prompt")
    p.add_argument("--user-len", default="150:250", help="words (about tokens) per user message, A:B")
    p.add_argument("--output-len", type=int, default=28, help="max_tokens of every reply (ignore_eos)")
    p.add_argument("--concurrency", type=int, default=2,
                   help="turns in flight")
    p.add_argument("--turn-timeout", type=float, default=300, help="seconds a turn may take (a stall fails it)")
    p.add_argument("--pool-ratio", type=float, default=4.0, help="working set / KV pool")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--serve-arg", action="append", default=[], help="one more flag for serve (repeatable)")
    p.add_argument("--url", default=None, help="an external OpenAI server (vLLM) to run in the rotation too")
    p.add_argument("--only-url", action="store_true", help="run the external server only")
    p.add_argument("--url-pool-tokens", type=int, default=None, help="the external server's KV pool (tokens)")
    p.add_argument("--served-model", default=None, help="the external server's model name")
    p.add_argument("--label", default=None, help="the external server's name in the table")
    p.add_argument("--json", default=None, help="write every round's summary here")
    p.add_argument("--dry-run", action="store_true", help="print the workload and the KV pool size, run nothing")
    args = p.parse_args()

    from transformers import AutoTokenizer

    from stagemesh.core.default_model import default_model_dir

    model_dir = default_model_dir()
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    systems, users = build_workload(args, tok)
    finals = working_set_estimate(args, tok, systems, users)
    ws_tokens = sum(finals)
    per_token = kv_bytes_per_token(model_dir, args.dtype)
    kv_bytes = int(ws_tokens / args.pool_ratio * per_token)
    ws_bytes = ws_tokens * per_token
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {cpu_isa()}", flush=True)
    print(f"workload: {args.conversations} conversations x {args.turns} turns, user {args.user_len} words, "
          f"system {args.system_len} words, replies {args.output_len} tokens, concurrency {args.concurrency}; "
          f"working set ~{ws_tokens:,} tokens (final lengths {min(finals)}-{max(finals)}), "
          f"{per_token:,} KV bytes/token ({args.dtype}): --kv-cache-memory {kv_bytes:,} "
          f"(~{ws_tokens / args.pool_ratio:,.0f} tokens)", flush=True)
    if args.dry_run:
        return

    results: dict[str, list[dict]] = {}
    ext = args.label or "ext"
    if args.url:
        model_ext = args.served_model or requests.get(f"{args.url}/v1/models", timeout=10).json()["data"][0]["id"]
    configs = tuple(args.configs) + ((ext,) if args.url and ext not in args.configs else ())
    if args.url and args.only_url:
        configs = (ext,)
    log_dir = Path(tempfile.mkdtemp(prefix="stagemesh-kv-tiers-"))
    print(f"configurations {', '.join(configs)}; logs in {log_dir}", flush=True)
    for r in range(args.rounds):
        reference = None
        for config in configs:
            if config == ext:
                # a cold prefix cache for each round where the server lets us (vLLM: VLLM_SERVER_DEV_MODE=1)
                reset = requests.post(f"{args.url}/reset_prefix_cache", timeout=30).status_code
                before = scrape(f"{args.url}/metrics")
                run = asyncio.run(run_workload(args.url, model_ext, args, systems, users))
                s = summarize(run, before, scrape(f"{args.url}/metrics"), reference)
                s["pool_tokens"], s["ws_tokens"] = args.url_pool_tokens, sum(s["final_lens"].values())
                results.setdefault(config, []).append(s)
                print(f"round {r + 1} " + fmt(config, s), flush=True)
                print(f"      measured working set {s['ws_tokens']:,} tokens; prefix cache reset before: HTTP {reset}",
                      flush=True)
                continue
            disk_dir = Path(tempfile.mkdtemp(prefix="kv-disk-", dir=os.environ.get("KV_TIERS_DISK_TMP"))) \
                if config == "disk" else None
            log = log_dir / f"serve-{config}-{r + 1}.log"
            mport = free_port()
            serve, base = start_serve(serve_args(config, args, kv_bytes, ws_bytes, disk_dir, mport), log)
            try:
                tokens, tiers_line = pool_tokens(log, 0)
                model = requests.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
                before = {**scrape(f"{base}/metrics"), **scrape(f"http://127.0.0.1:{mport}/metrics")}
                run = asyncio.run(run_workload(base, model, args, systems, users))
                after = {**scrape(f"{base}/metrics"), **scrape(f"http://127.0.0.1:{mport}/metrics")}
                s = summarize(run, before, after, reference)
                if config == "off":
                    reference = run["records"]
                ws = sum(s["final_lens"].values())
                s["pool_tokens"], s["ws_tokens"] = tokens, ws
                results.setdefault(config, []).append(s)
                print(f"round {r + 1} " + fmt(config, s), flush=True)
                print(f"      pool {tokens} tokens, measured working set {ws:,} tokens: "
                      f"{ws / tokens if tokens else float('nan'):.2f}x the pool; {tiers_line}", flush=True)
            finally:
                stop(serve)
                if disk_dir is not None:
                    du = subprocess.run(["du", "-sh", str(disk_dir)], capture_output=True, text=True).stdout.split()
                    print(f"      disk tier dir held {du[0] if du else '?'}", flush=True)
                    shutil.rmtree(disk_dir, ignore_errors=True)

    keys = ("ttft_later_p50", "ttft_later_p99", "ttft_all_p50", "ttft_all_p99", "tok_s", "wall_s", "hit_rate")
    med = {c: {k: statistics.median(s[k] for s in rs) for k in keys} for c, rs in results.items()}
    print("\nmedian over the rounds (TTFT ms):")
    print("| config | TTFT p50 turns>=2 | p99 turns>=2 | p50 all | p99 all | out tok/s | total s | prefix hit |")
    print("|---|---|---|---|---|---|---|---|")
    for c, m in med.items():
        print(f"| {c} | {m['ttft_later_p50']:.0f} | {m['ttft_later_p99']:.0f} | {m['ttft_all_p50']:.0f} | "
              f"{m['ttft_all_p99']:.0f} | {m['tok_s']:.1f} | {m['wall_s']:.1f} | {m['hit_rate']:.1%} |")
    if "off" in med:
        for c in med:
            if c != "off":
                ratios = [statistics.median(x[k] / y[k] for x, y in zip(results[c], results["off"]))
                          for k in ("ttft_later_p50", "ttft_later_p99", "ttft_all_p50", "tok_s", "wall_s")]
                print(f"{c} / off (median of per-round ratios): TTFT p50 turns>=2 {ratios[0]:.2f}x, p99 turns>=2 "
                      f"{ratios[1]:.2f}x, p50 all {ratios[2]:.2f}x, throughput {ratios[3]:.2f}x, total time "
                      f"{ratios[4]:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
