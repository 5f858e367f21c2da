"""The router's replicas as a set: their health loop and watchers, adding and forgetting replicas, resuming a
request wherever it is held, and picking the replica a new request goes to (the balancing policy, after
lora_affinity). One replica's client is router.replicas.Replica."""
from __future__ import annotations

import asyncio
import logging
from typing import Callable

import grpc

from router.errors import APIError
from router.lora_registry import serves
from router.observe import add_replica, forget_replica
from router.replicas import Replica
from router.submit_stream import ReplicaOutput, RequestFailed, RequestStream
from stagemesh.core.engine_request import EngineRequest

log = logging.getLogger("stagemesh.router")
ATTACH_DEADLINE_S = 10.0  # a resume waits this long at most for the replicas to say whether they hold it


async def _first(stream: RequestStream) -> ReplicaOutput:
    async for out in stream:
        return out
    raise RequestFailed(grpc.StatusCode.NOT_FOUND, "the stream ended")


class ReplicaSet:
    def __init__(self, addresses: list[str], policy, interval_s: float = 1.0, max_waiting_requests: int = 0,
                 max_request_retries: int = 3):
        # replaced, never changed in place, when the replicas change (set_replicas): a loop over it that awaits
        # goes on over the list it started with
        for a in addresses:  # each one's engine label, in the order given, before any check reports on it
            add_replica(a)
        self.replicas = [Replica(a) for a in addresses]
        self.policy = policy
        self.interval_s = interval_s
        self.max_waiting_requests = max_waiting_requests  # 0: unbounded
        self.max_request_retries = max_request_retries  # times a request goes on elsewhere after its replica failed
        self.num_waiting = 0  # requests in this router still waiting for their first token
        self._watchers: dict[str, list[asyncio.Task]] | None = None  # per replica, while health_loop runs
        self.after_refresh: list[Callable[[], None]] = []  # called after each health check of every replica

    async def refresh(self) -> None:
        await asyncio.gather(*(r.refresh() for r in self.replicas))

    async def health_loop(self) -> None:
        self._watchers = {}
        for r in self.replicas:
            self._watch(r)
        try:
            while True:
                await self.refresh()
                for hook in self.after_refresh:
                    hook()
                await asyncio.sleep(self.interval_s)
        finally:
            for tasks in self._watchers.values():
                for task in tasks:
                    task.cancel()
            self._watchers = None

    def _watch(self, replica: Replica) -> None:
        """Follow a replica's load figures (and KV events, for a policy that routes by them) between checks."""
        if self._watchers is None:  # (health_loop starts them)
            return
        watch_ms = max(int(self.interval_s * 250), 50)  # load figures a few times per health check
        tasks = [asyncio.create_task(replica.watch(watch_ms))]
        index = getattr(self.policy, "index", None)
        if index is not None:
            tasks.append(asyncio.create_task(replica.watch_kv_events(index)))
        self._watchers[replica.address] = tasks

    async def set_replicas(self, wanted: dict[str, bool]) -> tuple[list[str], list[str]]:
        """The replicas as a whole (address -> cordoned): new ones added (checked once before they get work),
        those not named forgotten. Returns (added, removed) addresses."""
        have = {r.address: r for r in self.replicas}
        added = [Replica(a) for a in wanted if a not in have]
        removed = [r for r in self.replicas if r.address not in wanted]
        for r in [*self.replicas, *added]:
            r.cordoned = wanted.get(r.address, r.cordoned)
        for r in added:  # (before its first check reports on it)
            add_replica(r.address)
        await asyncio.gather(*(r.refresh() for r in added))
        self.replicas = [r for r in self.replicas if r.address in wanted] + added
        for r in added:
            self._watch(r)
        for r in removed:
            await self._forget(r)
        if added or removed:
            log.info("replicas now: %s (added %s, removed %s)", ", ".join(
                r.address + (" (cordoned)" if r.cordoned else "") for r in self.replicas),
                ", ".join(r.address for r in added) or "none", ", ".join(r.address for r in removed) or "none")
        return [r.address for r in added], [r.address for r in removed]

    async def _forget(self, replica: Replica) -> None:
        replica.forgotten = True
        forget_replica(replica.address)
        for task in (self._watchers or {}).pop(replica.address, []):
            task.cancel()
        index = getattr(self.policy, "index", None)
        if index is not None:
            index.forget(replica.address)
        await replica.close()

    async def attach(self, request_id: str, prompt: list[int], owner: str
                     ) -> tuple[Replica, RequestStream, ReplicaOutput] | None:
        """Find the replica that holds a resumable request and attach it there: (replica, its stream, its outputs
        so far as one), or None when none holds it. Every replica is asked at once (a request moved on to a
        replica that is not healthy now is still there); one that does not answer within ATTACH_DEADLINE_S
        counts as not holding it."""
        asks = {asyncio.create_task(_first(s)): (r, s)
                for r in self.replicas for s in [r.attach(request_id, prompt, owner)]}
        found, refusal = None, None
        pending = set(asks)
        deadline = asyncio.get_running_loop().time() + ATTACH_DEADLINE_S
        while pending and found is None:
            left = deadline - asyncio.get_running_loop().time()
            done, pending = await asyncio.wait(pending, timeout=max(left, 0), return_when=asyncio.FIRST_COMPLETED)
            if not done:
                log.warning("resuming %s: %d replica(s) did not answer within %.0fs", request_id, len(pending),
                            ATTACH_DEADLINE_S)
                break
            for task in done:
                err = task.exception()
                if err is None and found is None:
                    found = (*asks[task], task.result())
                elif isinstance(err, RequestFailed) and err.code == grpc.StatusCode.INVALID_ARGUMENT:
                    refusal = err
        for task in pending:
            task.cancel()
        for _, stream in asks.values():
            if found is None or stream is not found[1]:
                stream.close()
        if found is None and refusal is not None:
            raise APIError(400, refusal.details, "request_id")
        return found

    def detach(self) -> None:
        for r in self.replicas:
            r.detach()

    async def close(self) -> None:
        await asyncio.gather(*(r.close() for r in self.replicas), return_exceptions=True)

    def queue_full(self) -> bool:
        return bool(self.max_waiting_requests) and self.num_waiting >= self.max_waiting_requests

    def healthy(self) -> list[Replica]:
        """The replicas that take new requests: healthy and not cordoned."""
        return [r for r in self.replicas if r.healthy and not r.cordoned]

    def pick(self, request: EngineRequest, exclude: set[str] | frozenset[str] = frozenset(), pin: str | None = None,
             role: str = "whole") -> Replica | None:
        """A healthy replica for the request (the pinned one while it is healthy: siblings share its cache).
        role: "prefill" (a prefill replica), "decode" or "whole" (a decode or both replica, else any). Its
        adapter narrows the replicas first (lora_affinity); the policy sees its prompt and its blocks' hash
        root (cached blocks are an adapter's, a salt's)."""
        lora_name = request.lora_name
        candidates = [r for r in self.healthy() if r.address not in exclude]
        pinned = [r for r in candidates if r.address == pin]
        if pinned:
            return pinned[0]
        if role == "prefill":
            candidates = [r for r in candidates if r.kv_role == "prefill"]
        else:
            candidates = [r for r in candidates if r.kv_role != "prefill"] or candidates
        candidates = [r for r in candidates if serves(r, lora_name)]
        if not candidates:
            return None
        return self.policy.pick(lora_affinity(candidates, lora_name), request.prompt_token_ids, request.hash_root)

    def disaggregated(self) -> bool:
        """Whether new prompts go to a prefill replica first: one of them and a decode replica are healthy."""
        roles = {r.kv_role for r in self.healthy()}
        return "prefill" in roles and "decode" in roles

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return frozenset(t for r in self.replicas for t in r.eos_token_ids)

    @property
    def scheduling_policies(self) -> set[str]:
        """The --scheduling-policy of every replica whose model info is known."""
        return {r.scheduling_policy for r in self.replicas if r.scheduling_policy}

    @property
    def max_model_len(self) -> int:
        return min((r.max_model_len for r in self.healthy() if r.max_model_len), default=0)


# load (a request running: 1, waiting: 4) a replica that runs a request's adapter, or has a free slot for it, may
# carry above the least loaded replica and still be preferred (as CacheAware's balance_abs)
LORA_LOAD_SLACK = 32


def lora_affinity(replicas: list[Replica], lora_name: str) -> list[Replica]:
    """The replicas a request for `lora_name` should go to (LoRA-aware routing, as llm-d's and Dynamo's): those
    that run the adapter already (no slot to fill, it joins their batches), else those with a free slot under
    --max-loras (it does not wait for a running adapter to end), unless they are loaded past LORA_LOAD_SLACK
    above the least loaded replica; otherwise all of them. The balancing policy picks among them."""
    if not lora_name or not replicas:
        return replicas
    least = min(r.load for r in replicas)
    running = [r for r in replicas if lora_name in r.running_adapters]
    free = running + [r for r in replicas if lora_name not in r.running_adapters
                      and len(r.running_adapters) < r.max_loras]
    for tier in (running, free):
        if tier and min(r.load for r in tier) <= least + LORA_LOAD_SLACK:
            return tier
    return replicas
