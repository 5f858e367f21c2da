"""The prefill replicas this replica may fetch prompts' KV from (disaggregated prefill): their schedulers come
from configuration (--kv-peer), never from a request, and their stages from those schedulers themselves.

A request's kv_transfer names a scheduler and its stages; a scheduler that is not a peer is never dialled (the
prompt is computed here), and this replica's stages read KV only from the stages the peers report
(Scheduler.GetKVPeers), so a kv_transfer, or a PullKV sent to a stage directly, cannot make any service of
this replica connect to an address of its choosing.
"""
from __future__ import annotations

import asyncio
import logging
import time

import grpc

from stagemesh.core.deadlines import DEADLINES
from stagemesh.core.service_options import aio_channel
from stagemesh.v1 import scheduler_pb2, scheduler_pb2_grpc

log = logging.getLogger("stagemesh.scheduler")

REFRESH_S = 1.0  # the peers are asked for their stages at most this often (a stage's miss asks again)


class KVPeers:
    def __init__(self, schedulers: tuple[str, ...], deadline_s: float = DEADLINES.kv_release_s):
        self.schedulers = schedulers
        self.deadline_s = deadline_s
        self._stages: frozenset[str] = frozenset()
        self._asked = float("-inf")
        self._lock = asyncio.Lock()

    def knows(self, scheduler_address: str) -> bool:
        return scheduler_address in self.schedulers

    async def stage_addresses(self) -> frozenset[str]:
        """Every stage of the peers, as they report them now (asked again when the last answer is over
        REFRESH_S old); a peer that does not answer contributes none."""
        async with self._lock:
            if time.monotonic() - self._asked >= REFRESH_S:
                found = await asyncio.gather(*(self._ask(s) for s in self.schedulers))
                self._stages = frozenset(a for stages in found for a in stages)
                self._asked = time.monotonic()
            return self._stages

    async def _ask(self, scheduler: str) -> list[str]:
        channel = aio_channel(scheduler)
        try:
            info = await scheduler_pb2_grpc.SchedulerStub(channel).GetModelInfo(
                scheduler_pb2.GetModelInfoRequest(), timeout=self.deadline_s)
            return [s.address for s in info.stages]
        except grpc.aio.AioRpcError as err:
            log.warning("the KV peer %s does not answer (%s): none of its stages may be read from now",
                        scheduler, err.code().name)
            return []
        finally:
            await channel.close()
