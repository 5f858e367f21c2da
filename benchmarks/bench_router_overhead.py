"""Time to first token and time per output token through the router (HTTP, streaming)
against the scheduler's gRPC API (SubmitStream) directly, on the same replica in the same run.

    .venv/bin/python benchmarks/bench_router_overhead.py [--requests 8] [--tokens 64]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))

from mesh import Mesh, Router  # noqa: E402

from stagemesh.core.default_model import DEFAULT_MODEL_NAME, default_model_dir  # noqa: E402
from stagemesh.core.sampling_params import SamplingParams  # noqa: E402
from stagemesh.v1 import scheduler_pb2  # noqa: E402
from stagemesh.core.wire import sampling_to_pb  # noqa: E402


def direct(mesh: Mesh, prompt: list[int], tokens: int) -> tuple[float, float]:
    start = time.perf_counter()
    submit = scheduler_pb2.SubmitRequest(request_id=f"d{start}", prompt_token_ids=prompt,
                                         sampling=sampling_to_pb(SamplingParams(max_tokens=tokens, ignore_eos=True)))
    done = threading.Event()

    def actions():
        yield scheduler_pb2.SubmitStreamRequest(submits=[scheduler_pb2.StreamSubmit(request=submit)])
        done.wait(300)  # ending the client's side would abort the request

    stamps, call = [], mesh.stub.SubmitStream(actions(), timeout=300)
    try:
        for reply in call:
            for update in reply.updates:
                stamps += [time.perf_counter()] * len(update.output.token_ids)
            if len(stamps) >= tokens:
                break
    finally:
        done.set()
        call.cancel()
    return stamps[0] - start, (stamps[-1] - stamps[0]) / (len(stamps) - 1)


def via_router(base: str, prompt: list[int], tokens: int) -> tuple[float, float]:
    body = {"model": DEFAULT_MODEL_NAME, "prompt": prompt, "max_tokens": tokens, "ignore_eos": True,
            "temperature": 0, "stream": True, "return_token_ids": True}
    start = time.perf_counter()
    stamps = []
    with requests.post(f"{base}/v1/completions", json=body, stream=True, timeout=300) as resp:
        for line in resp.iter_lines():
            if line.startswith(b"data: {"):
                stamps += [time.perf_counter()] * len(json.loads(line[6:])["choices"][0]["token_ids"])
    return stamps[0] - start, (stamps[-1] - stamps[0]) / (len(stamps) - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    model = default_model_dir()
    prompt = list(range(1000, 1100))
    with Mesh(model, [30], stage_args=("--threads", "2")) as mesh, Router(model, [mesh.address]) as router:
        direct(mesh, prompt, 4), via_router(router.base_url, prompt, 4)  # warm-up
        rows = {"scheduler gRPC": [], "router HTTP": []}
        for i in range(args.requests):  # interleaved, so drift hits both alike
            p = [t + i for t in prompt]  # no prefix-cache hits
            rows["scheduler gRPC"].append(direct(mesh, p, args.tokens))
            rows["router HTTP"].append(via_router(router.base_url, [t + 500 for t in p], args.tokens))
    med = {k: (statistics.median(t for t, _ in v), statistics.median(p for _, p in v)) for k, v in rows.items()}
    print(f"default model, batch 1, {len(prompt)}-token prompts, {args.tokens} tokens, {args.requests} requests each")
    for name, (ttft, tpot) in med.items():
        print(f"{name:15s} TTFT {ttft * 1e3:8.1f} ms   TPOT {tpot * 1e3:7.2f} ms")
    (dt, dp), (rt, rp) = med["scheduler gRPC"], med["router HTTP"]
    print(f"router overhead: TTFT {100 * (rt / dt - 1):+.1f}%, TPOT {100 * (rp / dp - 1):+.1f}% (target < 5%)")


if __name__ == "__main__":
    main()
