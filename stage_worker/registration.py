"""A stage's registration with its replica's scheduler: a heartbeat for as long as the stage runs (a restarted
scheduler takes the stage back), the adapters it must serve, and its drain."""
from __future__ import annotations

import logging
import threading

import grpc

from stagemesh.core.deadlines import DEADLINES
from stagemesh.core.errors import StagemeshError
from stagemesh.core.service_options import channel

log = logging.getLogger("stagemesh.stage")


def start_heartbeat(scheduler: str, servicer, stop: threading.Event, shutdown, server) -> list[BaseException]:
    """keep_registered on a thread of its own; what ends it with an error is put in the list returned (and stops
    the main loop), for the main thread to raise."""
    failed: list[BaseException] = []

    def supervise() -> None:
        try:
            keep_registered(scheduler, servicer, stop, shutdown, server)
        except BaseException as err:  # noqa: BLE001 - re-raised on the main thread
            failed.append(err)
            stop.set()

    threading.Thread(target=supervise, name="register", daemon=True).start()
    return failed


def keep_registered(scheduler: str, servicer, stop: threading.Event, shutdown=None, server=None,
                    interval_s: float = 2.0) -> None:
    """Register with the scheduler, then again every interval for as long as the stage runs: a heartbeat
    that a restarted scheduler answers by taking the stage back. Retries an unreachable scheduler
    forever (with backoff); a refusal ends the stage with the scheduler's reason. A TP follower that
    died ends it too (the stage cannot serve without it; its supervisor restarts it).

    Told to stop (`shutdown`), the stage drains: its heartbeats say so, every DRAIN_BEAT_S, and the replica
    takes no new requests; it stops once the scheduler has none left (or cannot be reached) or its
    --shutdown-timeout ends (the scheduler keeps what is left for the stage that comes back)."""
    from stagemesh.v1 import scheduler_pb2, scheduler_pb2_grpc

    delay, warned = 0.2, False
    with channel(scheduler) as chan:
        stub = scheduler_pb2_grpc.SchedulerStub(chan)
        while not stop.is_set():
            if not servicer.worker.followers_alive():
                raise StagemeshError("a TP follower of this stage died; the stage stops")
            draining = shutdown is not None and shutdown.requested.is_set()
            if draining and not servicer.draining:
                servicer.draining = True
                if server is not None:
                    server.set_ready(False)
            try:
                reply = stub.RegisterStage(scheduler_pb2.RegisterStageRequest(stage=servicer.describe()),
                                           timeout=DEADLINES.register_s)
                if sync_lora(servicer.worker, reply.lora_adapters):
                    continue  # registers again at once, serving the scheduler's adapters
                if reply.first_seen:
                    log.info("registered with the scheduler at %s (%d stage(s) still missing)", scheduler,
                             reply.num_missing_stages)
                delay, warned = interval_s, False
                if draining and _drained(shutdown, reply.num_unfinished_requests, stop):
                    return
            except grpc.RpcError as err:
                if err.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
                                  grpc.StatusCode.UNAUTHENTICATED):
                    raise StagemeshError(f"the scheduler refused this stage: {err.details()}") from None
                if draining:  # nothing to wait for
                    log.info("draining: no scheduler answers (%s): stopping", err.code().name)
                    stop.set()
                    return
                if not warned:
                    warned = True
                    log.warning("no scheduler answers at %s (%s); retrying", scheduler, err.code().name)
                delay = min(delay * 2, interval_s)
            if shutdown is None:
                stop.wait(delay)
            else:  # told to stop, the stage says so in its next heartbeat at once, not a beat later
                (shutdown.hurry if draining else shutdown.requested).wait(DRAIN_BEAT_S if draining else delay)
            if shutdown is not None and shutdown.hurry.is_set():
                stop.set()


DRAIN_BEAT_S = 0.2
LORA_LOAD_WAIT_S = 120.0


def sync_lora(worker, adapters) -> bool:
    """The scheduler's adapters this stage lacks (loaded at run time while the stage was away): read them now.
    True when it read any (the stage is not in the pipeline until it serves them all)."""
    lora = worker.runner.lora
    if lora is None:
        return False
    missing = [a for a in adapters if a.name not in lora.modules]
    for a in missing:
        log.info("reading LoRA adapter %r (%s), which the scheduler serves (waiting at most %.0fs)", a.name, a.path,
                 LORA_LOAD_WAIT_S)
        try:
            worker.load_lora(a.name, lora.settings.runtime_path(a.name, a.path)).result(LORA_LOAD_WAIT_S)
        except (StagemeshError, TimeoutError) as err:
            raise StagemeshError(f"the scheduler serves LoRA adapter {a.name!r}, which this stage cannot: "
                                 f"{err}") from None
    return bool(missing)


def _drained(shutdown, unfinished: int, stop: threading.Event) -> bool:
    """Whether a draining stage stops now: its replica has nothing left, or the time is up."""
    if unfinished and shutdown.left_s > 0:
        return False
    if unfinished:
        log.warning("the drain ended with %d request(s) left in the replica: they wait for this stage's "
                    "replacement", unfinished)
    else:
        log.info("drained: the replica has no request left; stopping")
    stop.set()
    return True
