"""The data-parallel replicas behind a router: clients, health, load."""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import grpc

from stagemesh.sampling_params import SamplingParams
from stagemesh.v1 import scheduler_pb2, scheduler_pb2_grpc
from stagemesh.wire import sampling_to_pb

log = logging.getLogger("stagemesh.router")
STATS_DEADLINE_S = 2.0


@dataclass
class Replica:
    address: str
    healthy: bool = False
    reason: str = "not checked yet"
    num_running: int = 0
    num_waiting: int = 0
    dispatched: int = 0  # sent since the last stats poll
    max_model_len: int = 0
    eos_token_ids: tuple[int, ...] = ()
    served_model_name: str = ""
    stub: scheduler_pb2_grpc.SchedulerStub | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.channel = grpc.aio.insecure_channel(self.address)
        self.stub = scheduler_pb2_grpc.SchedulerStub(self.channel)

    @property
    def load(self) -> int:
        return self.num_running + 4 * self.num_waiting + self.dispatched

    async def refresh(self) -> None:
        try:
            stats = await self.stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=STATS_DEADLINE_S)
            if stats.healthy and not self.max_model_len:
                info = await self.stub.GetModelInfo(scheduler_pb2.GetModelInfoRequest(), timeout=STATS_DEADLINE_S)
                self.max_model_len, self.eos_token_ids = info.max_model_len, tuple(info.eos_token_ids)
                self.served_model_name = info.served_model_name
            was = self.healthy
            self.healthy, self.reason = stats.healthy, stats.unhealthy_reason
            self.num_running, self.num_waiting, self.dispatched = stats.num_running, stats.num_waiting, 0
        except grpc.aio.AioRpcError as err:
            was = self.healthy
            self.healthy, self.reason = False, f"{err.code().name}: {err.details()}"
        if was != self.healthy:
            log.log(logging.INFO if self.healthy else logging.WARNING, "replica %s is now %s%s", self.address, "healthy" if self.healthy else "UNHEALTHY",
                        "" if self.healthy else f": {self.reason}")

    def submit(self, request_id: str, prompt: list[int], sampling: SamplingParams):
        self.dispatched += 1
        request = scheduler_pb2.SubmitRequest(request_id=request_id, prompt_token_ids=prompt,
                                              sampling=sampling_to_pb(sampling))
        return self.stub.Submit(request)  # streams as long as generation runs: no fixed deadline

    async def close(self) -> None:
        await self.channel.close()


class ReplicaSet:
    def __init__(self, addresses: list[str], policy, interval_s: float = 1.0):
        self.replicas = [Replica(a) for a in addresses]
        self.policy = policy
        self.interval_s = interval_s

    async def refresh(self) -> None:
        await asyncio.gather(*(r.refresh() for r in self.replicas))

    async def health_loop(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self.interval_s)

    def healthy(self) -> list[Replica]:
        return [r for r in self.replicas if r.healthy]

    def pick(self, prompt: list[int], exclude: set[str] = frozenset()) -> Replica | None:
        candidates = [r for r in self.healthy() if r.address not in exclude]
        return self.policy.pick(candidates, prompt) if candidates else None

    @property
    def max_model_len(self) -> int:
        return min((r.max_model_len for r in self.healthy() if r.max_model_len), default=0)
