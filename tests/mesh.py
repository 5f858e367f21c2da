"""Start a real replica (scheduler + stage processes on loopback) for tests, and talk to it."""
from __future__ import annotations

import os
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from router.submit_stream import REASONS
from stagemesh.core.model_config import layer_ranges
from stagemesh.core.sampling_params import SamplingParams
from stagemesh.core import ports
from stagemesh.core.wire import sampling_to_pb
from stagemesh.entry.forkserver import METHOD_ENV, spawn_stagemesh
from stagemesh.entry.supervisor import PARENT_ENV
from stagemesh.v1 import scheduler_pb2, scheduler_pb2_grpc


def free_port() -> int:
    """A loopback port for a server a test starts (stagemesh.core.ports: not from the kernel's ephemeral range,
    not one handed out before in this run, nothing bound to it now)."""
    return ports.free_port()


# the processes started here (and the tests' and benchmarks' clients) share one internal token
os.environ.setdefault("STAGEMESH_INTERNAL_TOKEN", "mesh-" + os.urandom(16).hex())


def internal_channel(address: str, credentials=None) -> grpc.Channel:
    """A channel to an internal service that carries the tests' internal token (conftest sets it)."""
    from stagemesh.core.internal_token import ENV, SyncClientInterceptor

    chan = grpc.secure_channel(address, credentials) if credentials else grpc.insecure_channel(address)
    return grpc.intercept_channel(chan, SyncClientInterceptor(os.environ[ENV])) if os.environ[ENV] else chan


def internal_aio_channel(address: str) -> grpc.aio.Channel:
    from stagemesh.core.internal_token import ENV, aio_client_interceptors

    interceptors = aio_client_interceptors(os.environ[ENV]) if os.environ[ENV] else None
    return grpc.aio.insecure_channel(address, interceptors=interceptors)


# The meshes and routers the tests start are forked by a fork server that imported torch and transformers once for
# the whole session (stagemesh.entry.forkserver): a cold start pays 3.5-4 s of CPU for those imports, and the suite
# starts hundreds. STAGEMESH_TEST_START_METHOD=spawn starts them cold, as `serve` does by default.
START_METHOD = os.environ.get("STAGEMESH_TEST_START_METHOD", "forkserver")


def start_stagemesh(argv: list[str], **kw) -> subprocess.Popen:
    """`stagemesh *argv` as the tests start it (START_METHOD), dying with its parent as serve's children do
    (stagemesh.entry.supervisor.die_with_parent): a pytest killed before its teardown (SIGTERM, SIGKILL) leaves no
    service behind. Its parent is the fork server, which exits with the test process, or the test process when it
    is spawned (spawn mode, or no fork server free). Only from the test process's main thread: a spawned child dies
    with the thread that started it."""
    parent = threading.current_thread() is threading.main_thread()
    return spawn_stagemesh(argv, start_method=START_METHOD, parent_env=PARENT_ENV if parent else None, **kw)


class Mesh:
    """A scheduler and its stages as real processes; every one is stopped on exit."""

    def __init__(self, model_dir: Path, split: list[int], tp: list[int] | None = None, handoff: str = "grpc",
                 scheduler_args: tuple[str, ...] = (), stage_args: tuple[str, ...] = (), log_dir: Path | None = None,
                 per_stage_args: dict[int, list[str]] | None = None, credentials=None):
        self.model_dir, self.split, self.handoff = str(model_dir), split, handoff
        self.tp = tp or [1] * len(split)
        self.scheduler_args, self.stage_args = list(scheduler_args), list(stage_args)
        self.per_stage_args = per_stage_args or {}
        self.credentials = credentials  # grpc.ChannelCredentials when the services run with TLS
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log_dir = log_dir
        self.scheduler: subprocess.Popen | None = None
        self.stages: list[subprocess.Popen | None] = []
        self.spares: list[subprocess.Popen] = []
        # forked, a stage forks its TP followers too (stage_worker.follower_start)
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                    METHOD_ENV: os.environ.get(METHOD_ENV, START_METHOD)}
        self.cached_tokens: dict[str, int] = {}  # request id -> its prompt's prefix-cache hit tokens

    def _spawn(self, args: list[str], name: str) -> subprocess.Popen:
        out = open(self.log_dir / f"{name}.log", "ab") if self.log_dir else subprocess.DEVNULL
        return start_stagemesh(args, stdout=out, env=self.env)

    def start_stage(self, index: int, standby: bool = False) -> None:
        """Start stage `index` (again); standby: a spare for it, beside the one that serves (self.spares)."""
        a, b = layer_ranges(self.split)[index]
        extra = ["--standby"] if standby else self.per_stage_args.get(index, [])
        proc = self._spawn(["stage", self.model_dir, "--scheduler", self.address, "--stage-index", str(index),
                            "--layers", f"{a}:{b}", "--tensor-parallel-size", str(self.tp[index]),
                            "--handoff", self.handoff, "--threads", "1", *self.stage_args, *extra],
                           f"stage{index}{'-standby' if standby else ''}")
        if standby:
            self.spares.append(proc)
        elif index < len(self.stages):
            self.stages[index] = proc
        else:
            self.stages.append(proc)

    def kill_stage(self, index: int) -> None:
        proc = self.stages[index]
        proc.kill()
        proc.wait()

    def start_scheduler(self) -> None:
        self.scheduler = self._spawn(["scheduler", self.model_dir, "--port", str(self.port),
                                      "--pipeline-parallel-size", str(len(self.split)), *self.scheduler_args],
                                     "scheduler")

    def kill_scheduler(self) -> None:
        self.scheduler.kill()
        self.scheduler.wait()

    def start(self) -> None:
        """Start the scheduler and the stages without waiting for them (meshes whose stages need each other)."""
        self.channel = internal_channel(self.address, self.credentials)
        self.stub = scheduler_pb2_grpc.SchedulerStub(self.channel)
        self.start_scheduler()
        for i in range(len(self.split)):
            self.start_stage(i)

    def __enter__(self) -> "Mesh":
        try:
            self.start()
            self.wait_healthy()
        except BaseException:  # a mesh that never came up still stops every process it started
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        if getattr(self, "channel", None) is not None:
            self.channel.close()
        for proc in [*self.stages, *self.spares, self.scheduler]:
            if proc is not None and proc.poll() is None:
                proc.terminate()
        for proc in [*self.stages, *self.spares, self.scheduler]:
            if proc is not None:
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()

    def health(self) -> int:
        stub = health_pb2_grpc.HealthStub(self.channel)
        try:
            return stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2).status
        except grpc.RpcError:
            return health_pb2.HealthCheckResponse.UNKNOWN

    def wait_healthy(self, timeout: float = 180, healthy: bool = True) -> None:
        want = health_pb2.HealthCheckResponse.SERVING
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if (self.health() == want) == healthy:
                return
            for proc in [self.scheduler, *self.stages]:
                if proc is not None and proc.poll() is not None and healthy:
                    raise RuntimeError(f"a mesh process exited with {proc.returncode} (see logs in {self.log_dir})")
            time.sleep(0.2)
        raise TimeoutError(f"mesh not {'healthy' if healthy else 'unhealthy'} after {timeout}s")

    def submit(self, request_id: str, prompt: list[int], sampling, timeout: float = 120):
        """(token ids, finish reason) of one request over a SubmitStream of its own; raises RequestFailed (a
        grpc.RpcError with the request's status) when it fails."""
        result = self.submit_stream([(request_id, prompt, sampling)], timeout)[request_id]
        if not isinstance(result, tuple):
            raise RequestFailed(result)
        return result

    def submit_stream(self, requests: list[tuple[str, list[int], SamplingParams]], timeout: float = 300,
                      stub=None) -> dict:
        """Requests sent together over one SubmitStream, read until each has finished or failed:
        request id -> (token ids, finish reason: "stop", "length" or "abort"), or the RequestError of a request
        that failed. A sampling given as protobuf goes as it is (a test's malformed one). The messages the
        scheduler wrote are counted in self.stream_messages."""
        message = scheduler_pb2.SubmitStreamRequest()
        for request_id, prompt, sampling in requests:
            if isinstance(sampling, SamplingParams):
                sampling = sampling_to_pb(sampling)
            message.submits.add(request=scheduler_pb2.SubmitRequest(
                request_id=request_id, prompt_token_ids=prompt, sampling=sampling))
        finished = threading.Event()

        def actions():
            yield message
            finished.wait(timeout)  # ending the client's side would abort the requests

        results: dict = {request_id: ([], None) for request_id, _, _ in requests}
        remaining = set(results)
        call = (stub or self.stub).SubmitStream(actions(), timeout=timeout)
        self.stream_messages = 0
        try:
            for reply in call:
                self.stream_messages += 1
                for update in reply.updates:
                    if update.HasField("error"):
                        results[update.request_id] = update.error
                        remaining.discard(update.request_id)
                        continue
                    tokens, _ = results[update.request_id]
                    tokens.extend(update.output.token_ids)
                    if update.output.num_prompt_tokens:  # (the first update's)
                        self.cached_tokens[update.request_id] = update.output.num_cached_tokens
                    if update.output.finish_reason:
                        results[update.request_id] = (tokens, REASONS[update.output.finish_reason])
                        remaining.discard(update.request_id)
                if not remaining:
                    break
        finally:
            finished.set()
            call.cancel()
        return results

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[list[int]]:
        with ThreadPoolExecutor(len(prompts)) as pool:
            futures = [pool.submit(self.submit, f"r{i}", p, sampling) for i, p in enumerate(prompts)]
            return [f.result()[0] for f in futures]


class RequestFailed(grpc.RpcError):
    """A request that failed on a SubmitStream (its RequestError), raised as a gRPC error with its status."""
    CODES = {c.value[0]: c for c in grpc.StatusCode}

    def __init__(self, error):
        super().__init__(error.message)
        self._code, self._details = self.CODES.get(error.code, grpc.StatusCode.UNKNOWN), error.message

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def run_stagemesh(argv: list[str], timeout: float = 120, env: dict[str, str] | None = None
                  ) -> subprocess.CompletedProcess:
    """`subprocess.run([python, -m, stagemesh, *argv], capture_output=True, text=True, timeout=timeout)`, forked as
    the meshes are (START_METHOD)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = start_stagemesh(argv, env=env, stdout=out, stderr=err)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(proc.args, code, out.read().decode(errors="replace"),
                                           err.read().decode(errors="replace"))


def start_serve(argv: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`stagemesh serve *argv`, its output (stderr too) appended to log. Forked as the meshes are (START_METHOD), and
    serve forks its own children the same way: a serve start costs a fork server's imports, not every child's.
    Users' default (spawn, cold children) is what test_serve and test_startup start."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", METHOD_ENV: os.environ.get(METHOD_ENV, START_METHOD), **(env or {})}
    with open(log, "ab") as out:
        return start_stagemesh(["serve", *argv], stdout=out, env=env)


def stop_process(proc: subprocess.Popen, grace_s: float = 10) -> None:
    """SIGTERM, and SIGKILL if it has not exited within grace_s."""
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def exit_codes(procs: list[subprocess.Popen], timeout_s: float = 300) -> list[int]:
    """Each process's exit code, waiting up to timeout_s for each; any still running after that (or when the
    wait fails) is killed, so none outlives the test."""
    try:
        return [p.wait(timeout=timeout_s) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def wait_http_ok(proc: subprocess.Popen, url: str, timeout_s: float, what: str, log: Path | None = None) -> None:
    """Until GET url answers 200. If the process exits first or the time runs out, it is stopped and the error
    says so (with its log's tail when there is one): a server that never came up is never left running."""
    import requests

    tail = lambda: f": {log.read_text()[-2000:]}" if log is not None and log.exists() else ""  # noqa: E731
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}{tail()}")
        try:
            if requests.get(url, timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.2)
    stop_process(proc)
    raise TimeoutError(f"{what} not up at {url} after {timeout_s:.0f}s{tail()}")


class Router:
    """A `stagemesh router` process over the given replicas; stopped on exit."""

    def __init__(self, model_dir, replicas: list[str], extra: tuple[str, ...] = (), log_dir: Path | None = None,
                 grpc_frontend: bool = False):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.grpc_port = free_port() if grpc_frontend else None
        if grpc_frontend:
            extra = (*extra, "--grpc-port", str(self.grpc_port))
        out = open(log_dir / f"router-{self.port}.log", "ab") if log_dir else subprocess.DEVNULL
        argv = ["router", str(model_dir), "--port", str(self.port), "--health-interval", "0.5", *extra]
        for r in replicas:
            argv += ["--replica", r]
        self.proc = start_stagemesh(argv, stdout=out, env={**os.environ, "OMP_NUM_THREADS": "1"})

    def __enter__(self) -> "Router":
        wait_http_ok(self.proc, f"{self.base_url}/ready", 120, "router")
        return self

    def __exit__(self, *exc) -> None:
        stop_process(self.proc)

    def client(self, **kw):
        import openai

        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=kw.pop("api_key", "none"), max_retries=0, **kw)


def completion_ids(base_url: str, model: str, prompt: list[int], max_tokens: int) -> list[int]:
    """The greedy token ids a gateway generates for a prompt of token ids (ignore_eos)."""
    import requests

    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    resp = requests.post(f"{base_url}/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["token_ids"]
