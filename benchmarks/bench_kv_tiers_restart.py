"""A prefix cache that survives a restart (issue 44): `stagemesh serve` on the default model with a host and a
disk KV tier (`--kv-offloading-size 1 --kv-offloading-disk-size 4 --kv-offloading-disk-path DIR`). A first
serve computes a known --prompt-len-token prompt (its cold TTFT and greedy output, the reference) and stops
(SIGTERM) once the disk tier holds its blocks. Then, --restarts times: serve started again on the same DIR
(seconds to ready, the scheduler's "held from before"; the block files' pages dropped from the page cache
before, so the loads read the disk), then the known prompt (served from disk) and a prompt never seen (cold),
their order alternating restart by restart, so that the disk hit is the very first request after a restart
every other time (serve warms itself up before it serves: issue 58; --client-warm-up sends one short request
first, under one block, as the clients of older versions had to); then stopped once the disk holds what it
computed. Each request streams (completions, a token-id prompt, temperature 0, --max-tokens): TTFT,
usage.prompt_tokens_details.cached_tokens, the scheduler's disk loads
(stagemesh:kv_tier_loaded_blocks_total{tier="disk"}) and the output's token ids, which must equal the
reference's on every disk hit. Prints each request, then the medians and the disk/cold ratio.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_kv_tiers_restart.py [--restarts 3 --prompt-len 1000
        --max-tokens 16]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import requests

from serve_process import free_port, start_serve, stop


def metric(port: int, name: str, tier: str | None = None) -> float:
    """A scheduler metric's value (for one tier; 0 before its first sample)."""
    text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    for line in text.splitlines():
        m = re.match(rf'{re.escape(name)}(\{{.*\}})? ([0-9.e+-]+)$', line)
        if m and (tier is None or f'tier="{tier}"' in (m.group(1) or "")):
            return float(m.group(2))
    return 0.0


def tier_counts(port: int) -> tuple[float, float]:
    """(blocks loaded from disk, seconds spent loading from the tiers) so far."""
    return (metric(port, "stagemesh:kv_tier_loaded_blocks_total", "disk"),
            metric(port, "stagemesh:kv_tier_load_seconds_sum"))


def kv_files(disk: Path) -> int:
    """Block files on rank 0 of replica 0's disk tier."""
    return sum(1 for _ in disk.glob("replica-0/*/rank0/*.kv"))


def complete(base: str, prompt: list[int], max_tokens: int) -> dict:
    """One streamed completion: TTFT (to the first token), cached tokens, the output's token ids."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True, "ignore_eos": True}
    start, ttft, ids, usage = time.monotonic(), None, [], None
    with requests.post(f"{base}/v1/completions", json=body, stream=True, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                got = choice.get("token_ids") or []
                if got and ttft is None:
                    ttft = time.monotonic() - start
                ids += got
            if chunk.get("usage"):
                usage = chunk["usage"]
    cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"ttft": ttft, "cached": cached, "ids": ids, "prompt_tokens": (usage or {}).get("prompt_tokens")}


def drop_page_cache(disk: Path) -> int:
    """Written back and dropped from the page cache (posix_fadvise DONTNEED, no root needed), so that a load
    after the restart reads the disk, not memory; the block files' count."""
    files = list(disk.glob("replica-*/*/rank*/*.kv"))
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return len(files)


def wait_disk(disk: Path, at_least: int, timeout: float = 120) -> float:
    """Seconds until rank 0's disk tier holds at least this many block files."""
    start = time.monotonic()
    while kv_files(disk) < at_least:
        if time.monotonic() - start > timeout:
            sys.exit(f"the disk tier holds {kv_files(disk)} block files after {timeout:.0f} s, not {at_least}")
        time.sleep(0.1)
    return time.monotonic() - start


def isa() -> str:
    flags = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    have = [f for f in ("avx2", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni",
                        "amx_tile") if f in flags]
    return f"{platform.machine()} {os.cpu_count()} cores: {' '.join(have) or 'no AVX flags'}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--restarts", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=1000)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--block-size", type=int, default=16, help="serve's --block-size (the default's)")
    p.add_argument("--host-gib", default="1")
    p.add_argument("--disk-gib", default="4")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep-page-cache", action="store_true",
                   help="leave the block files in the page cache across a restart (default: dropped)")
    p.add_argument("--keep", action="store_true", help="keep the disk tier's directory and the logs")
    p.add_argument("--client-warm-up", action="store_true",
                   help="send one short request (under one block) before the measured ones after each restart")
    args = p.parse_args()

    rng = random.Random(args.seed)
    draw = lambda: [rng.randrange(1000, 40000) for _ in range(args.prompt_len)]  # noqa: E731
    known, warm = draw(), [rng.randrange(1000, 40000) for _ in range(args.block_size // 2)]
    blocks = args.prompt_len // args.block_size  # full blocks: what can come back from a tier
    work = Path(tempfile.mkdtemp(prefix="stagemesh-kv-restart-"))
    disk, log = work / "kv", work / "serve.log"
    mport = free_port()
    serve_args = ["--kv-offloading-size", args.host_gib, "--kv-offloading-disk-size", args.disk_gib,
                  "--kv-offloading-disk-path", str(disk), "--block-size", str(args.block_size),
                  "--metrics-port", str(mport)]
    print(f"{isa()}; serve on the default model, {' '.join(serve_args[:-2])}; prompts of {args.prompt_len} "
          f"tokens ({blocks} full blocks), {args.max_tokens} output tokens, greedy; logs in {log}", flush=True)

    # the first serve: the known prompt computed cold, the reference output; its blocks onto the disk
    t0 = time.monotonic()
    serve, base = start_serve(serve_args, log)
    ready0 = time.monotonic() - t0
    try:
        complete(base, warm, 1)
        ref = complete(base, known, args.max_tokens)
        flush = wait_disk(disk, blocks)
    finally:
        stop(serve)
    print(f"first serve: ready in {ready0:.1f} s; known prompt cold TTFT {ref['ttft'] * 1e3:.0f} ms, cached "
          f"{ref['cached']}; its {blocks} blocks on disk {flush:.2f} s after its answer", flush=True)

    rows, mismatches = [], 0
    for r in range(args.restarts):
        before_files = kv_files(disk)
        if not args.keep_page_cache:
            drop_page_cache(disk)
        t0 = time.monotonic()
        serve, base = start_serve(serve_args, log)
        ready = time.monotonic() - t0
        held = re.findall(r"KV tiers:.*", log.read_text(errors="replace"))
        try:
            if args.client_warm_up:
                complete(base, warm, 1)
            order = ("disk", "cold") if r % 2 == 0 else ("cold", "disk")
            for kind in order:
                prompt = known if kind == "disk" else draw()
                loaded, seconds = tier_counts(mport)
                res = complete(base, prompt, args.max_tokens)
                after = tier_counts(mport)
                res["disk_loads"], res["load_s"] = after[0] - loaded, after[1] - seconds
                res.update(kind=kind, restart=r + 1, ready=ready, first=kind == order[0])
                if kind == "disk":
                    res["same"] = res["ids"] == ref["ids"]
                    mismatches += not res["same"]
                rows.append(res)
                print(f"restart {r + 1} (ready in {ready:.1f} s, {before_files} block files before) {kind}: TTFT "
                      f"{res['ttft'] * 1e3:7.0f} ms  cached {res['cached']:4d}/{res['prompt_tokens']}  disk loads "
                      f"{res['disk_loads']:.0f} blocks in {res['load_s'] * 1e3:.0f} ms"
                      + (f"  output {'==' if res['same'] else '!='} reference" if kind == "disk" else ""),
                      flush=True)
            wait_disk(disk, before_files + blocks)  # the cold prompt's blocks written before the SIGTERM
        finally:
            stop(serve)
        if held:
            print(f"  scheduler: {held[-1].strip()}", flush=True)

    med = {k: statistics.median(x["ttft"] for x in rows if x["kind"] == k) for k in ("cold", "disk")}
    cached = sorted({x["cached"] for x in rows if x["kind"] == "disk"})
    for first in (True, False):
        disk = [x for x in rows if x["kind"] == "disk" and x["first"] == first]
        if disk:
            ttfts = ", ".join(f"{x['ttft'] * 1e3:.0f}" for x in disk)
            loads = ", ".join(f"{x['load_s'] * 1e3:.0f}" for x in disk)
            print(f"disk hit {'first after the restart' if first else 'after the cold prompt'}: TTFT {ttfts} ms, "
                  f"of which loading {loads} ms")
    firsts = [x["ttft"] for x in rows if x["kind"] == "disk" and x["first"]]
    laters = [x["ttft"] for x in rows if x["kind"] == "disk" and not x["first"]]
    if firsts and laters:
        print(f"disk hit first after a restart / disk hit after the cold prompt: "
              f"{statistics.median(firsts) / statistics.median(laters):.2f} (medians; issue 58's target <= 1.5)")
    print(f"median over {args.restarts} restarts: cold TTFT {med['cold'] * 1e3:.0f} ms, disk TTFT "
          f"{med['disk'] * 1e3:.0f} ms, disk/cold {med['disk'] / med['cold']:.2f} ({med['cold'] / med['disk']:.1f}x "
          f"faster); cached tokens on the disk hits {cached}; ready in "
          f"{statistics.median(x['ready'] for x in rows):.1f} s (median); outputs equal to the cold reference: "
          f"{sum(1 for x in rows if x.get('same'))}/{sum(1 for x in rows if x['kind'] == 'disk')}")
    problems = [line for line in log.read_text(errors="replace").splitlines()
                if re.search(r"WARNING|ERROR|CRITICAL|Traceback", line)]
    print(f"serve's log: {len(problems)} warning/error lines" + "".join(f"\n  {x}" for x in problems[:10]))
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    if mismatches:
        sys.exit(f"{mismatches} disk hit(s) gave another output than the cold run")


if __name__ == "__main__":
    main()
