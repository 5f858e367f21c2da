"""A draining replica's running requests move on with their KV (scheduler.driver.Driver.migrate): in the
scheduler core, a request between two decode steps ends "migrated" with its blocks held (all but its last
token's), one in flight waits for its step, a waiting one goes without; the replica that takes it finds that
KV fits it exactly and goes on from its last token. Then real processes: replica A's scheduler drains under 4
streams, B (its --kv-peer) reads their KV and they finish token-exact, counted how="kv"."""
from __future__ import annotations

import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from scheduler import handover
from scheduler.config import SchedulerConfig
from scheduler.kv_transfer import KVLoadFailed
from scheduler.scheduler import Scheduler
from stagemesh.core.engine_request import EngineRequest, KVSourceInfo
from stagemesh.core.sampling_params import SamplingParams
from stagemesh.core.step import SampledToken


def make(**kw) -> Scheduler:
    return Scheduler(SchedulerConfig(num_kv_blocks=64, block_size=4, max_model_len=128, eos_token_ids=(2,),
                                     max_num_seqs=2, **kw))


def step(s: Scheduler, token: int = 7):
    out = s.schedule()
    return out, s.update_from_output(out, [SampledToken(c.seq_id, token) for c in out.step_batch.chunks if c.sample])


def long_streams(pool, base_url: str, batch: list[list[int]], max_tokens: int, timeout_s: float = 120) -> list:
    """Greedy completion streams of `batch` (model "m") through the router at base_url, run in `pool`: their
    futures, returned once each has streamed 5 tokens."""
    from sse_client import stream

    progress: dict[int, int] = {}

    def one(i: int):
        def seen(out):
            progress[i] = len(out.token_ids)
        body = {"model": "m", "prompt": batch[i], "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True, "return_token_ids": True}
        return stream([base_url], "/v1/completions", body, f"s{i}", on_event=seen)

    futures = [pool.submit(one, i) for i in range(len(batch))]
    deadline = time.monotonic() + timeout_s
    while sum(v >= 5 for v in progress.values()) < len(batch):
        assert time.monotonic() < deadline, progress
        time.sleep(0.01)
    return futures


def test_a_decoding_request_moves_with_its_kv_and_a_waiting_one_without():
    s = make()
    for i in range(3):
        s.add_request(EngineRequest(f"r{i}", list(range(3, 13)), SamplingParams(max_tokens=20)))
    for _ in range(3):
        step(s)  # r0, r1 run (max_num_seqs 2); r2 waits
    outs = {o.request_id: o for o in handover.migrate_all(s, with_kv=True)}
    assert set(outs) == {"r0", "r1", "r2"} and all(o.finish_reason == "migrated" for o in outs.values())
    held = outs["r0"].held_kv
    assert held.num_tokens == 10 + 3 - 1 and len(held.block_ids) == 3  # prompt + 3 generated, but the last
    assert outs["r2"].held_kv is None and not s.has_unfinished()
    assert set(s.transfers.held) == {"r0", "r1"}  # their blocks wait for the replica that takes them
    assert s.release_kv("r0") and not s.release_kv("r0")


def test_recompute_policy_and_a_request_in_flight():
    s = make()
    s.add_request(EngineRequest("r0", list(range(3, 13)), SamplingParams(max_tokens=20)))
    step(s)
    assert handover.migrate_all(s, with_kv=False)[0].held_kv is None and not s.transfers.held
    s.add_request(EngineRequest("r1", list(range(3, 13)), SamplingParams(max_tokens=20)))
    s.schedule()  # in flight: left for the next call
    assert handover.migrate_all(s, with_kv=True) == [] and s.has_unfinished()


def test_the_replica_that_takes_it_goes_on_from_its_last_token_with_the_kv_it_read():
    prompt, generated = list(range(3, 13)), [7, 7, 7]
    source = KVSourceInfo("a:1", "r0", 1, (4, 5, 6), 4, len(prompt) + len(generated) - 1, (("s:1", 0, 2),))
    s = make()
    r = EngineRequest("r0", prompt, SamplingParams(max_tokens=20), generated_token_ids=generated, kv_source=source)
    assert s.add_request(r)  # the held KV fits: prompt + generated, but the last
    assert s.schedule() is None  # its KV is being read
    [pull] = s.transfers.take_pulls()
    assert s.kv_pulled(pull.request_id, ok=True) == []
    out = s.schedule()
    [chunk] = out.step_batch.chunks
    assert chunk.token_ids == [7] and chunk.start_position == 12  # one decode step: its last token
    short = KVSourceInfo("a:1", "r1", 1, (4, 5), 4, 8, (("s:1", 0, 2),))
    with pytest.raises(KVLoadFailed, match="the KV of 12 tokens"):  # not its KV (its router: computed again)
        s.add_request(EngineRequest("r1", prompt, SamplingParams(max_tokens=20), generated_token_ids=generated,
                                    kv_source=short))



@pytest.mark.slow
def test_a_draining_replica_hands_its_streams_on_with_their_kv_token_exact(wide_model_dir, tmp_path):
    """A drains with 1 s left under 4 long streams: B, which names A with --kv-peer, reads their KV and they go
    on token-exact; the router counts them how="kv", and B's log shows the reads."""
    from mesh import Mesh, Router
    from parity import prompts
    from tiny_models import greedy_tokens

    batch = prompts(384, (5, 3, 9, 17))
    long = 400  # far more than a 1 s drain finishes
    want = greedy_tokens(wide_model_dir, batch, long)
    args = ("--shutdown-timeout", "1", "--served-model-name", "m")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with Mesh(wide_model_dir, [2, 2], log_dir=tmp_path / "a", scheduler_args=args) as a, \
            Mesh(wide_model_dir, [2, 2], log_dir=tmp_path / "b", scheduler_args=(*args, "--kv-peer", a.address)) \
            as b, Router(wide_model_dir, [a.address, b.address], ("--policy", "round-robin"), log_dir=tmp_path) \
            as router:
        with ThreadPoolExecutor(4) as pool:
            streams = long_streams(pool, router.base_url, batch, long)
            a.scheduler.send_signal(signal.SIGTERM)
            results = [s.result(timeout=300) for s in streams]
            assert a.scheduler.wait(timeout=60) == 0
        metrics = requests.get(f"{router.base_url}/metrics", timeout=10).text
    for i, got in enumerate(results):
        assert got.done and got.resumes == 0 and got.token_ids == want[i], f"stream {i}"
    moved = re.search(r"(\d+) request\(s\) handed back .* \((\d+) with their KV\)",
                      (tmp_path / "a" / "scheduler.log").read_text())
    assert moved and int(moved.group(2)) >= 1, (tmp_path / "a" / "scheduler.log").read_text()[-2000:]
    kv = re.search(r'stagemesh:migrated_requests_total\{how="kv"\} (\S+)', metrics)
    assert kv and float(kv.group(1)) == int(moved.group(2)), metrics[-3000:]
    assert "fetched from" in (tmp_path / "b" / "scheduler.log").read_text()
