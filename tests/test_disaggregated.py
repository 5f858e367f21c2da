"""Disaggregated prefill (issue 33): a prefill replica computes prompts and holds their KV, a decode replica's
stages fetch it and go on; the layouts differ (PP=2 with a TP=2 stage, whose ranks gather their KV heads,
against one TP=4 stage, whose ranks share the model's 2 KV heads). Every request ends with
transformers' greedy tokens whether its KV was fetched or, when the fetch cannot work, computed again; held KV
is freed when fetched or when its hold times out. A decode replica reads KV only from the prefill replicas its
scheduler was given (--kv-peer): a kv_transfer or a PullKV naming any other address is refused without a
connection to it. The kv_load_failure_policy (issue 44): a stalled prefill replica (SIGSTOP) holds a decode
request no longer than --kv-load-timeout, after which it fails (fail) or computes its prompt (recompute); so do
expired holds, stale epochs and non-peers; an abort during a pull releases the prefill replica's KV at once; the
router leaves a stalled prefill replica. Real processes on loopback."""
from __future__ import annotations

import re
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import grpc
import pytest

from mesh import Mesh, free_port, internal_channel
from parity import prompts
from stagemesh.core.sampling_params import SamplingParams
from stagemesh.core.wire import sampling_to_pb
from stagemesh.v1 import scheduler_pb2, stage_pb2, stage_pb2_grpc
from tiny_models import reference_model, reference_tokens, with_word_tokenizer

pytestmark = pytest.mark.slow
NEW_TOKENS = 12
LENGTHS = (40, 17, 70, 5, 33)


def run(mesh: Mesh, submits: list[scheduler_pb2.SubmitRequest], timeout: float = 120) -> dict:
    """request id -> (tokens, finish reason, kv_transfer or None), or its RequestError, over one SubmitStream."""
    finished = threading.Event()

    def actions():
        yield scheduler_pb2.SubmitStreamRequest(submits=[scheduler_pb2.StreamSubmit(request=r) for r in submits])
        finished.wait(timeout)

    results = {r.request_id: ([], None, None) for r in submits}
    remaining = set(results)
    call = mesh.stub.SubmitStream(actions(), timeout=timeout)
    try:
        for reply in call:
            for update in reply.updates:
                if update.HasField("error"):
                    results[update.request_id] = update.error
                    remaining.discard(update.request_id)
                    continue
                tokens = results[update.request_id][0] + list(update.output.token_ids)
                out = update.output
                if out.finish_reason:
                    kv = out.kv_transfer if out.HasField("kv_transfer") else None
                    results[update.request_id] = (tokens, out.finish_reason, kv)
                    remaining.discard(update.request_id)
                else:
                    results[update.request_id] = (tokens, None, None)
            if not remaining:
                break
    finally:
        finished.set()
        call.cancel()
    return results


def kv_usage(mesh: Mesh) -> float:
    return mesh.stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=5).kv_cache_usage


@pytest.fixture(scope="module")
def meshes(tiny_model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("disagg")
    model_dir = with_word_tokenizer(tiny_model_dir("llama"), logs / "model")  # the router needs a tokenizer
    for name in ("p", "d"):
        (logs / name).mkdir()
    (logs / "f").mkdir()
    # d: --kv-load-failure-policy recompute (a load that fails computes the prompt there), bound 5 s;
    # f: the default policy, fail, bound 2 s
    with Mesh(model_dir, [2, 2], tp=[1, 2], log_dir=logs / "p",
              scheduler_args=("--kv-role", "prefill", "--kv-hold-timeout", "3")) as p, \
            Mesh(model_dir, [4], tp=[4], log_dir=logs / "d",
                 scheduler_args=("--kv-role", "decode", "--kv-peer", p.address,
                                 "--kv-load-failure-policy", "recompute", "--kv-load-timeout", "5")) as d:
        global FAIL_MESH, FAIL_METRICS
        f = Mesh(model_dir, [4], log_dir=logs / "f",
                 scheduler_args=("--kv-role", "decode", "--kv-peer", p.address, "--kv-load-timeout", "2"))
        metrics_port = next(port for port in iter(free_port, None) if port not in (p.port, d.port, f.port))
        f.scheduler_args += ["--metrics-port", str(metrics_port)]
        FAIL_METRICS = f"http://127.0.0.1:{metrics_port}/metrics"
        with f:
            FAIL_MESH = f
            yield model_dir, p, d, logs


def prefill_all(p: Mesh, batch: list[list[int]], want: list[list[int]]) -> list[scheduler_pb2.SubmitRequest]:
    """Each prompt of the batch prefilled on p, request r{i}, checked to give its first greedy token: the requests
    that decode them from there on another replica, each with its KV's handle."""
    sampling = sampling_to_pb(SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    prefilled = run(p, [scheduler_pb2.SubmitRequest(request_id=f"r{i}", prompt_token_ids=x, sampling=sampling,
                                                    prefill_only=True) for i, x in enumerate(batch)])
    decode = []
    for i, x in enumerate(batch):
        tokens, reason, kv = prefilled[f"r{i}"]
        assert reason == scheduler_pb2.FINISH_REASON_PREFILLED and tokens == want[i][:1], prefilled[f"r{i}"]
        decode.append(scheduler_pb2.SubmitRequest(request_id=f"r{i}", prompt_token_ids=x, sampling=sampling,
                                                  generated_token_ids=tokens, kv_transfer=kv))
    return decode


def assert_decoded(done: dict, want: list[list[int]]) -> None:
    """The decode replica's results (run's) go on from each prefill's first token to the greedy tokens."""
    for i in range(len(want)):
        tokens, reason, _ = done[f"r{i}"]
        assert want[i][:1] + tokens == want[i] and reason == scheduler_pb2.FINISH_REASON_LENGTH, f"request {i}"


FAIL_MESH: Mesh | None = None  # the decode replica with the default --kv-load-failure-policy, fail
FAIL_METRICS = ""  # its scheduler's Prometheus metrics


def test_a_decode_replica_fetches_the_prompts_kv_and_goes_on_exactly(meshes):
    model_dir, p, d, logs = meshes
    ref = reference_model(model_dir)
    batch = prompts(384, LENGTHS, seed=3)
    want = [reference_tokens(ref, x, NEW_TOKENS) for x in batch]
    decode = prefill_all(p, batch, want)
    for x, r in zip(batch, decode):
        kv = r.kv_transfer
        assert kv.num_tokens == len(x) and len(kv.block_ids) == -(-len(x) // 16) and len(kv.stages) == 2
    assert kv_usage(p) > 0  # the prefills' KV is held
    assert_decoded(run(d, decode), want)
    log = (logs / "d" / "scheduler.log").read_text()
    assert len(re.findall(r"request r\d: its prompt's KV \(\d+ tokens", log)) == len(batch), log[-3000:]
    assert "failed" not in log
    deadline = time.monotonic() + 10
    while kv_usage(p) > 0:  # every fetch released its blocks on the prefill replica
        assert time.monotonic() < deadline, "the prefill replica still holds KV"
        time.sleep(0.1)


def test_a_fetch_that_cannot_work_falls_back_to_computing_the_prompt(meshes):
    model_dir, p, d, logs = meshes
    ref = reference_model(model_dir)
    x = prompts(384, (50,), seed=4)[0]
    want = reference_tokens(ref, x, NEW_TOKENS)
    sampling = sampling_to_pb(SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    tokens, reason, kv = run(p, [scheduler_pb2.SubmitRequest(request_id="f", prompt_token_ids=x, sampling=sampling,
                                                             prefill_only=True)])["f"]
    stale = scheduler_pb2.KVTransferParams()
    stale.CopyFrom(kv)
    stale.epoch = kv.epoch + 7  # the prefill replica's pipeline re-formed since: its blocks hold nothing of it
    dead = scheduler_pb2.KVTransferParams()
    dead.CopyFrom(kv)
    del dead.stages[:]
    dead.stages.add(address="127.0.0.1:1", layer_start=0, layer_end=4)  # nobody there
    done = run(d, [scheduler_pb2.SubmitRequest(request_id=f"f{i}", prompt_token_ids=x, sampling=sampling,
                                               generated_token_ids=tokens, kv_transfer=params)
                   for i, params in enumerate((stale, dead))])
    for i in range(2):
        assert tokens + done[f"f{i}"][0] == want, f"fallback {i}"
    log = (logs / "d" / "scheduler.log").read_text()
    assert len(re.findall(r"request f\d: fetching its prompt's KV from \S+ failed .*: computing the prompt here",
                          log)) == 2, log[-3000:]


class Listener:
    """A loopback port that counts the connections made to it."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.1)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.accepted = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:  # (the timeout: look at _stop again)
                continue
            self.accepted += 1
            conn.close()

    def __enter__(self) -> "Listener":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()


def test_kv_is_read_only_from_the_replicas_the_decode_scheduler_was_given(meshes):
    model_dir, p, d, logs = meshes
    x = prompts(384, (40,), seed=6)[0]
    want = reference_tokens(reference_model(model_dir), x, NEW_TOKENS)
    sampling = sampling_to_pb(SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    tokens, _, kv = run(p, [scheduler_pb2.SubmitRequest(request_id="u", prompt_token_ids=x, sampling=sampling,
                                                        prefill_only=True)])["u"]
    decode_stage = d.stub.GetModelInfo(scheduler_pb2.GetModelInfoRequest(), timeout=5).stages[0].address
    channel = internal_channel(decode_stage)
    stage = stage_pb2_grpc.StageStub(channel)
    try:
        with Listener() as stranger:
            # kv_transfers naming the stranger as a prefill stage, and as a prefill scheduler: the prompt is
            # computed here
            its_stage, its_scheduler = scheduler_pb2.KVTransferParams(), scheduler_pb2.KVTransferParams()
            its_stage.CopyFrom(kv)
            its_stage.stages[0].address = stranger.address
            its_scheduler.CopyFrom(kv)
            its_scheduler.scheduler_address = stranger.address
            done = run(d, [scheduler_pb2.SubmitRequest(request_id=f"u{i}", prompt_token_ids=x, sampling=sampling,
                                                       generated_token_ids=tokens, kv_transfer=params)
                           for i, params in enumerate((its_stage, its_scheduler))])
            assert [tokens + done[f"u{i}"][0] for i in range(2)] == [want, want]
            # a PullKV sent to a decode stage itself, naming a stage of no prefill replica its scheduler knows
            pull = stage_pb2.PullKVRequest(epoch=0, block_ids=range(len(kv.block_ids)), source_epoch=kv.epoch,
                                           source_block_ids=kv.block_ids, source_block_size=kv.block_size,
                                           sources=[stage_pb2.KVSource(address=stranger.address, layer_start=0,
                                                                       layer_end=4)])
            with pytest.raises(grpc.RpcError) as refused:
                stage.PullKV(pull, timeout=30)
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert refused.value.details() == (
                f"PullKV refused: '{stranger.address}' is not a stage of a prefill replica this stage's scheduler "
                "fetches KV from (the scheduler's --kv-peer)")
            time.sleep(0.3)  # (a connection on its way would be accepted by now)
            assert stranger.accepted == 0
        log = (logs / "d" / "scheduler.log").read_text()
        assert re.search(r"request u0: fetching its prompt's KV from \S+ failed .*PERMISSION_DENIED.*: computing "
                         r"the prompt here", log), log[-3000:]
        assert f"request u1: its kv_transfer names the scheduler {stranger.address}, which is not a --kv-peer of " \
               "this replica: computing the prompt here" in log
        # a pull into an epoch the stage is not in is refused without telling the stage's epoch
        pull.epoch, pull.sources[0].address = 987654, kv.stages[0].address
        del pull.sources[1:]
        pull.sources.add().CopyFrom(kv.stages[1])
        with pytest.raises(grpc.RpcError) as refused:
            stage.PullKV(pull, timeout=30)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert refused.value.details() == "KV pulled into epoch 987654, which is not the stage's"
    finally:
        channel.close()


def test_a_prefill_stage_hands_kv_only_to_a_reader_with_the_blocks_ticket(meshes):
    """ReadKV straight to a prefill stage, from a holder of the internal token but not of the blocks' read ticket
    (none, a forged one, the ticket of other blocks): PERMISSION_DENIED, naming nothing of the stage's state.
    The ticket the prefill replica wrote into the kv_transfer reads them."""
    _, p, _, _ = meshes
    sampling = sampling_to_pb(SamplingParams(max_tokens=4, ignore_eos=True))
    _, _, kv = run(p, [scheduler_pb2.SubmitRequest(request_id="t", prompt_token_ids=list(range(10, 50)),
                                                   sampling=sampling, prefill_only=True)])["t"]
    assert len(kv.read_ticket) == 32
    source = kv.stages[0]
    channel = internal_channel(source.address)
    try:
        stage = stage_pb2_grpc.StageStub(channel)
        read = stage_pb2.ReadKVRequest(epoch=kv.epoch, block_ids=kv.block_ids, layer_start=source.layer_start,
                                       layer_end=source.layer_end)
        forged = bytes([kv.read_ticket[0] ^ 1]) + kv.read_ticket[1:]
        for ticket, blocks in ((b"", kv.block_ids), (forged, kv.block_ids), (kv.read_ticket, kv.block_ids[:1])):
            read.ticket, read.block_ids[:] = ticket, blocks
            with pytest.raises(grpc.RpcError) as refused:
                list(stage.ReadKV(read, timeout=30))
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED, refused.value
            details = refused.value.details()
            assert details.startswith("ReadKV refused: the request carries no read ticket for these blocks")
            assert str(kv.epoch) not in details and not re.search(r"\d", details), details
        read.ticket, read.block_ids[:] = kv.read_ticket, kv.block_ids
        chunks = list(stage.ReadKV(read, timeout=30))
        assert {c.layer for c in chunks} == set(range(source.layer_start, source.layer_end))
    finally:
        channel.close()
        p.stub.ReleaseKV(scheduler_pb2.ReleaseKVRequest(request_id="t"), timeout=10)


def test_held_kv_no_decode_replica_fetches_is_freed_after_the_hold_timeout(meshes):
    _, p, _, logs = meshes
    sampling = sampling_to_pb(SamplingParams(max_tokens=4, ignore_eos=True))
    _, reason, _ = run(p, [scheduler_pb2.SubmitRequest(request_id="h", prompt_token_ids=list(range(10, 60)),
                                                       sampling=sampling, prefill_only=True)])["h"]
    assert reason == scheduler_pb2.FINISH_REASON_PREFILLED and kv_usage(p) > 0
    deadline = time.monotonic() + 15  # --kv-hold-timeout 3, checked every probe interval (2 s)
    while kv_usage(p) > 0:
        assert time.monotonic() < deadline, "the held KV was never freed"
        time.sleep(0.2)
    assert "request h: no decode replica fetched its KV within --kv-hold-timeout: freed" in \
        (logs / "p" / "scheduler.log").read_text()


def test_through_the_router_prompts_run_on_the_prefill_replica_and_the_rest_on_the_decode_one(meshes):
    """The official client against a router over both; then the prefill replica's scheduler dies and the router
    sends whole requests to the decode replica."""
    from mesh import Router

    model_dir, p, d, logs = meshes
    ref = reference_model(model_dir)
    batch = prompts(384, (30, 9, 61), seed=5)
    want = [reference_tokens(ref, x, NEW_TOKENS) for x in batch]
    with Router(model_dir, [p.address, d.address], ("--served-model-name", "m"), log_dir=logs) as router:
        client = router.client()
        wait_for_roles(router)
        for i, x in enumerate(batch):
            got = client.completions.create(model="m", prompt=x, max_tokens=NEW_TOKENS, temperature=0,
                                            extra_body={"ignore_eos": True, "return_token_ids": True},
                                            extra_headers={"X-Request-Id": f"pd{i}"})
            assert got.choices[0].token_ids == want[i] and got.usage.completion_tokens == NEW_TOKENS
        streamed = []
        for chunk in client.completions.create(model="m", prompt=batch[0], max_tokens=NEW_TOKENS, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True, "return_token_ids": True},
                                               extra_headers={"X-Request-Id": "pds"}):
            streamed += chunk.choices[0].token_ids or [] if chunk.choices else []
        assert streamed == want[0]
        p_log, d_log = ((logs / n / "scheduler.log").read_text() for n in ("p", "d"))
        for rid in ("pd0", "pd1", "pd2", "pds"):
            assert re.search(rf"request cmpl-{rid} finished: prefilled", p_log), rid
            assert re.search(rf"request cmpl-{rid}: its prompt's KV \(\d+ tokens", d_log), rid
        p.kill_scheduler()
        got = client.completions.create(model="m", prompt=batch[1], max_tokens=NEW_TOKENS, temperature=0,
                                        extra_body={"ignore_eos": True, "return_token_ids": True})
        assert got.choices[0].token_ids == want[1]  # computed whole on the decode replica


def wait_for_roles(router) -> None:
    """Until the router knows both replicas' roles (it reads them with their model info once they serve)."""
    import requests

    deadline = time.monotonic() + 30
    while not all(r["healthy"] for r in requests.get(f"{router.base_url}/health", timeout=5).json()["replicas"]):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    time.sleep(1.0)  # a health round after both are healthy: their model info is in


# -- the kv_load_failure_policy (issue 44) ---------------------------------------------------------------------

FAILED_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION.value[0]


def serving(mesh: Mesh) -> Mesh:
    """The mesh, its scheduler started again if a test before killed it."""
    if mesh.scheduler.poll() is not None:
        mesh.start_scheduler()
        mesh.wait_healthy(120)
    return mesh


def prefill(p: Mesh, ids: list[str], x: list[int], sampling) -> dict:
    """request id -> (first token, kv_transfer) of prefill_only requests of prompt x."""
    serving(p)
    done = run(p, [scheduler_pb2.SubmitRequest(request_id=i, prompt_token_ids=x, sampling=sampling, prefill_only=True)
                   for i in ids])
    assert all(done[i][1] == scheduler_pb2.FINISH_REASON_PREFILLED for i in ids), done
    return {i: (done[i][0], done[i][2]) for i in ids}


def decode(mesh: Mesh, request_id: str, x: list[int], sampling, first: list[int], kv, timeout: float = 60):
    return run(mesh, [scheduler_pb2.SubmitRequest(request_id=request_id, prompt_token_ids=x, sampling=sampling,
                                                  generated_token_ids=first, kv_transfer=kv)], timeout)[request_id]


@contextmanager
def stalled(mesh: Mesh):
    """A stalled prefill replica: the TP follower processes of its stages stopped (SIGSTOP), so that a ReadKV its
    stage answers hangs in the gather of their KV heads, on a connection that is up (a stopped gRPC server fails
    new connections within a second); continued on the way out, and the mesh healthy again."""
    import psutil

    stopped = [child for proc in mesh.stages for child in psutil.Process(proc.pid).children()]
    assert stopped, "a mesh with TP followers"
    try:
        for proc in stopped:
            proc.send_signal(signal.SIGSTOP)
        yield
    finally:
        for proc in stopped:
            proc.send_signal(signal.SIGCONT)
        mesh.wait_healthy(120)


def test_a_stalled_prefill_replica_holds_a_decode_request_no_longer_than_the_bound(meshes):
    """Stalled after the prefill: under fail the decode request fails at --kv-load-timeout (2 s) with the reason;
    under recompute it computes its prompt then (5 s) and ends with the greedy tokens."""
    model_dir, p, d, logs = meshes
    f = FAIL_MESH
    x = prompts(384, (45,), seed=8)[0]
    want = reference_tokens(reference_model(model_dir), x, NEW_TOKENS)
    sampling = sampling_to_pb(SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    held = prefill(p, ["sf", "sr"], x, sampling)
    with stalled(p), ThreadPoolExecutor(2) as pool:
        start = time.monotonic()
        failing = pool.submit(lambda: (decode(f, "sf", x, sampling, *held["sf"], timeout=30), time.monotonic()))
        recomputing = pool.submit(lambda: (decode(d, "sr", x, sampling, *held["sr"], timeout=40),
                                           time.monotonic()))
        (error, failed_at), ((tokens, reason, _), done_at) = failing.result(), recomputing.result()
    assert error.code == FAILED_PRECONDITION, error
    assert "its prompt's KV could not be loaded from the prefill replica" in error.message
    assert "(timeout: " in error.message and "kv_load_failure_policy fail" in error.message, error.message
    assert failed_at - start < 2 + 4, "the fail policy applied past the bound"  # (the slack: a loaded machine)
    assert held["sr"][0] + tokens == want and reason == scheduler_pb2.FINISH_REASON_LENGTH
    assert done_at - start < 5 + 6, "the recompute policy applied past the bound"
    assert re.search(r"request sr: fetching its prompt's KV from \S+ failed \(timeout: .*: computing the "
                     r"prompt here \(kv_load_failure_policy recompute\)", (logs / "d" / "scheduler.log").read_text())
    assert re.search(r"request sf: fetching its prompt's KV from \S+ failed \(timeout: .*: the request "
                     "fails", (logs / "f" / "scheduler.log").read_text())


def test_kv_whose_hold_expired_or_that_is_gone_follows_the_policy(meshes):
    """The prefill replica freed the blocks (its --kv-hold-timeout passed) before the decode replica read them: the
    read cannot be trusted (the blocks may hold another prompt's KV by then), so the load failed. So did a load
    whose kv_transfer names another epoch (its read ticket no longer fits it: refused by the prefill stages) and
    one from a scheduler that is not a --kv-peer."""
    model_dir, p, d, logs = meshes
    f = FAIL_MESH
    x = prompts(384, (37,), seed=9)[0]
    want = reference_tokens(reference_model(model_dir), x, NEW_TOKENS)
    sampling = sampling_to_pb(SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    held = prefill(p, ["xf", "xr"], x, sampling)
    p_log = logs / "p" / "scheduler.log"
    deadline = time.monotonic() + 15  # --kv-hold-timeout 3, checked every probe interval (2 s)
    while not all(f"request {i}: no decode replica fetched its KV within --kv-hold-timeout: freed" in
                  p_log.read_text() for i in ("xf", "xr")):
        assert time.monotonic() < deadline, "the holds never expired"
        time.sleep(0.2)
    error = decode(f, "xf", x, sampling, *held["xf"])
    assert error.code == FAILED_PRECONDITION and "(hold_expired: " in error.message, error
    tokens, reason, _ = decode(d, "xr", x, sampling, *held["xr"])
    assert held["xr"][0] + tokens == want
    assert re.search(r"request xr: fetching its prompt's KV from \S+ failed \(hold_expired: .*computing the prompt "
                     "here", (logs / "d" / "scheduler.log").read_text())
    first, kv = prefill(p, ["xg"], x, sampling)["xg"]
    stale, elsewhere = scheduler_pb2.KVTransferParams(), scheduler_pb2.KVTransferParams()
    stale.CopyFrom(kv)
    stale.epoch = kv.epoch + 7
    elsewhere.CopyFrom(kv)
    elsewhere.scheduler_address = "127.0.0.1:1"  # not a --kv-peer: refused before anything is dialled
    for params, reason in ((stale, "refused"), (elsewhere, "not_peer")):
        error = decode(f, f"xg-{reason}", x, sampling, first, params)
        assert error.code == FAILED_PRECONDITION and f"({reason}: " in error.message, (reason, error)
    import requests

    metrics = requests.get(FAIL_METRICS, timeout=10).text
    for reason in ("hold_expired", "refused", "not_peer"):
        assert f'stagemesh:kv_transfer_failures_total{{reason="{reason}"}}' in metrics, reason
    failed = re.search(r"^stagemesh:kv_transfer_failed_requests_total (\S+)$", metrics, re.M)
    assert failed and float(failed.group(1)) >= 3, metrics[-2000:]
    assert re.search(r"^stagemesh:kv_transfer_wait_seconds_count [1-9]", metrics, re.M)


def test_a_decode_request_that_ends_during_its_pull_releases_the_prefill_kv_at_once(meshes):
    """The client of a decode request goes away while its KV is being pulled from a stalled prefill replica: the
    prefill replica is told to free that KV at once, not when the pull ends (at d's 5 s bound)."""
    model_dir, p, d, logs = meshes
    x = prompts(384, (33,), seed=10)[0]
    sampling = sampling_to_pb(SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    first, kv = prefill(p, ["ab"], x, sampling)["ab"]
    p_log = logs / "p" / "scheduler.log"
    with stalled(p):
        try:  # the call ends (its deadline, or the request stream's end) during the pull: the request is aborted
            tokens, _, _ = decode(d, "ab", x, sampling, first, kv, timeout=0.6)
            assert tokens == []
        except grpc.RpcError:
            pass
        gone = time.monotonic()
        while "request ab: its KV released" not in p_log.read_text():
            assert time.monotonic() - gone < 3, "the prefill replica's KV was not released at once"
            time.sleep(0.05)


def test_through_the_router_a_stalled_prefill_replica_is_left_for_the_decode_one(meshes):
    """The prefill replica's scheduler stops (SIGSTOP) with a request on it: once it fails its health checks the
    router stops waiting for it and the request runs whole on the decode replica; the client sees no error."""
    from mesh import Router

    model_dir, p, _, logs = meshes
    f = FAIL_MESH
    serving(p)  # (an earlier test killed its scheduler)
    x = prompts(384, (29,), seed=11)[0]
    want = reference_tokens(reference_model(model_dir), x, NEW_TOKENS)
    with Router(model_dir, [p.address, f.address], ("--served-model-name", "m"), log_dir=logs) as router:
        client = router.client()
        wait_for_roles(router)
        p.scheduler.send_signal(signal.SIGSTOP)
        try:
            start = time.monotonic()
            got = client.completions.create(model="m", prompt=x, max_tokens=NEW_TOKENS, temperature=0, timeout=40,
                                            extra_body={"ignore_eos": True, "return_token_ids": True},
                                            extra_headers={"X-Request-Id": "stall"})
            elapsed = time.monotonic() - start
        finally:
            p.scheduler.send_signal(signal.SIGCONT)
            p.wait_healthy(120)
        assert got.choices[0].token_ids == want
        assert elapsed < 15, elapsed  # health checks every 0.5 s, each bounded by 2 s
        router_log = (logs / f"router-{router.port}.log").read_text()
    assert re.search(r"the prefill replica \S+ stopped passing health checks", router_log), router_log[-3000:]
