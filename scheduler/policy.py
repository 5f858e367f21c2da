"""The scheduling policy (vLLM's --scheduling-policy): in what order the waiting and running queues are
kept, and so who gets the token budget first and who is preempted when KV blocks run out; and, across
tenants, their fair share of the steps (--tenant-fair-share: FairShare).

fcfs: arrival order; a preempted request goes back to the front of the waiting queue; the newest running
request is the victim. priority: both queues in (priority, arrival) order, lower values first (vLLM's
order); the lowest-priority running request is the victim, and a waiting request that lacks blocks may
preempt running requests of lower priority than its own (vLLM's V0 priority preemption). Either order holds
within a tenant; which tenant's request comes next is the fair share's. Preemption is the policy's choice of
victims (kv_victim, make_room); the scheduler preempts them (by recompute: Scheduler._preempt).
"""
from __future__ import annotations

import bisect
import math
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator

from scheduler.request import Request
from scheduler.status import Status
from stagemesh.core.errors import StagemeshError
from stagemesh.core.sampling_params import INT32_MAX

POLICIES = ("fcfs", "priority")
MAX_TENANT_NAME = 256
# the VTC paper's cost of service (Sheng et al., OSDI 2024, its h(n_p, n_q) with w_p = 1, w_q = 2): a token
# computed costs 1, a token generated 1 more (a decode step's token is both)
COMPUTED_COST, GENERATED_COST = 1.0, 1.0


def _key(request: Request) -> tuple[int, float]:
    return request.priority_key


class SchedulingPolicy:
    def __init__(self, name: str, fair_share: bool = False):
        if name not in POLICIES:
            raise StagemeshError(f"scheduling-policy must be one of {', '.join(POLICIES)}, got {name!r}")
        self.name = name
        self.by_priority = name == "priority"
        self.fair = FairShare() if fair_share else None

    def check(self, priority: int, tenant: str = "", tenant_weight: float = 1.0) -> None:
        """A request's priority as this policy takes it: a 32-bit integer, and 0 under fcfs (vLLM's refusal);
        its tenant's name and weight (> 0)."""
        if isinstance(priority, bool) or not isinstance(priority, int) or not -INT32_MAX - 1 <= priority <= INT32_MAX:
            raise StagemeshError(f"priority must be a 32-bit integer, got {priority!r}")
        if priority and not self.by_priority:
            raise StagemeshError(f"Got priority {priority} but Priority scheduling is not enabled (this replica "
                                 f"runs --scheduling-policy {self.name})")
        if len(tenant) > MAX_TENANT_NAME or not tenant.isprintable():
            raise StagemeshError(f"a tenant's name must be at most {MAX_TENANT_NAME} printable characters")
        if not (math.isfinite(tenant_weight) and tenant_weight > 0):
            raise StagemeshError(f"a tenant's weight must be > 0, got {tenant_weight!r}")

    def waiting(self, requests: Iterable[Request] = ()) -> WaitingQueue:
        """A waiting queue of this policy, holding `requests` in their order."""
        queue = WaitingQueue(self)
        for request in requests:
            queue.append(request)
        return queue

    def enqueue(self, queue: deque[Request], request: Request, preempted: bool = False) -> None:
        if self.by_priority:
            bisect.insort(queue, request, key=_key)
        elif preempted:  # it was running before the others came
            queue.appendleft(request)
        else:
            queue.append(request)

    def add_running(self, running: list[Request], request: Request) -> None:
        if self.by_priority:  # the budget goes to the first; the victim is the last
            bisect.insort(running, request, key=_key)
        else:
            running.append(request)

    def order(self, requests: list[Request]) -> list[Request]:
        return sorted(requests, key=_key) if self.by_priority else requests

    def victim_for(self, running: list[Request], request: Request) -> Request | None:
        """The running request a waiting `request` without KV blocks may preempt: under the priority policy,
        the lowest-priority one below it that is not in flight (its blocks are in use); None under fcfs."""
        if not self.by_priority:
            return None
        for victim in reversed(running):  # lowest priority first
            if victim.priority_key <= request.priority_key:
                return None
            if not victim.in_flight:
                return victim
        return None

    def kv_victim(self, running: list[Request]) -> Request | None:
        """The request to preempt when a running one lacks KV blocks: the last running request that is not in
        flight (its blocks are not in use): the newest under fcfs, the lowest-priority (then newest) under
        priority, the running queue being in that order; with several tenants, of the one that runs the most for
        its weight (FairShare.kv_victim)."""
        victim = self.fair.kv_victim(running) if self.fair is not None else None
        if victim is not None:
            return victim
        for request in reversed(running):
            if not request.in_flight:
                return request
        return None

    def make_room(self, running: list[Request], head: Request, fits: Callable[[Request], bool],
                  max_num_seqs: int) -> Iterator[Request]:
        """The running requests to preempt before a step is built, one at a time (the caller preempts each
        before the next is chosen), for `head`, the first waiting request. Priority policy: while head's first
        chunk lacks KV blocks (`fits`), running requests of lower priority, the lowest first; head is then
        admitted in this step unless a running request of higher priority takes the room. Fair share: a tenant
        under its share takes a place from one over its own (_fair_victims)."""
        while self.by_priority and not fits(head):
            victim = self.victim_for(running, head)
            if victim is None:
                break
            yield victim
        if self.fair is not None:
            yield from self._fair_victims(self.fair, running, head, fits, max_num_seqs)

    @staticmethod
    def _fair_victims(fair: FairShare, running: list[Request], head: Request, fits: Callable[[Request], bool],
                      max_num_seqs: int) -> Iterator[Request]:
        """Head cannot start (no place left under --max-num-seqs, or no KV blocks): running requests of a tenant
        over its share give it their places (FairShare.victim), preempted now, or, in flight, once their step is
        back (until then not scheduled: Request.yield_slot)."""
        if fair.yielding is None and len(fair.present) < 2:
            return
        held, fair.yielding = fair.yielding, None
        if held is not None and held.status is not Status.RUNNING:
            held = None  # (it ended, or was preempted for blocks)
        while len(running) >= max_num_seqs or not fits(head):
            victim, held = held or fair.victim(running, head, max_num_seqs), None
            if victim is None:
                break
            if victim.in_flight:
                victim.yield_slot, fair.yielding = True, victim
                return
            yield victim
        if held is not None:  # the head starts without its place after all
            held.yield_slot = False

    # -- tenants (FairShare; nothing without it) --------------------------------------------------------
    def arrived(self, request: Request) -> None:
        if self.fair is not None:
            self.fair.arrived(request)

    def left(self, request: Request) -> None:
        if self.fair is not None:
            self.fair.left(request)


class FairShare:
    """Token-weighted fair queueing across tenants: the Virtual Token Counter (Sheng et al., "Fairness in
    Serving Large Language Models", OSDI 2024). Each tenant's counter is the service its requests got
    (COMPUTED_COST per token computed, GENERATED_COST more per token generated) over its weight; the next
    request admitted is the first of the tenant with the least. A tenant that starts competing (its first
    request in the scheduler) is lifted to the least counter of those already here, so that idle time banks no
    credit; with nobody here the counters start over. Work-conserving: a tenant alone gets every step.

    Admission alone leaves a newcomer waiting for a running request to end, which under another tenant's flood
    of long requests is as long as they run (their slots, max_num_seqs, are all taken). So a tenant that
    waits while it runs fewer requests than its weighted share of the slots takes one from the tenant furthest
    over its share (victim): that tenant's newest request is preempted, by recompute, its full blocks kept in
    the prefix cache, so that little is computed again.
    """

    def __init__(self) -> None:
        self.counters: dict[str, float] = {}
        self.weights: dict[str, float] = {}
        self.present: Counter[str] = Counter()  # requests of each tenant in the scheduler
        self.yielding: Request | None = None  # a victim in flight, preempted once its step is back

    def arrived(self, request: Request) -> None:
        tenant = request.tenant
        self.weights[tenant] = request.tenant_weight  # (the latest request's says it)
        if not self.present:
            self.counters.clear()
        elif not self.present[tenant]:
            floor = min(self.counters.get(t, 0.0) for t in self.present)
            self.counters[tenant] = max(self.counters.get(tenant, 0.0), floor)
        self.present[tenant] += 1

    def left(self, request: Request) -> None:
        tenant = request.tenant
        self.present[tenant] -= 1
        if self.present[tenant] <= 0:
            del self.present[tenant]

    def served(self, request: Request, num_tokens: int, sample: bool) -> None:
        """A chunk of `num_tokens` of the request was scheduled; `sample`: it generates a token."""
        cost = num_tokens * COMPUTED_COST + (GENERATED_COST if sample else 0.0)
        tenant = request.tenant
        self.counters[tenant] = self.counters.get(tenant, 0.0) + cost / self.weights.get(tenant, 1.0)

    def counter(self, tenant: str) -> float:
        return self.counters.get(tenant, 0.0)

    def victim(self, running: list[Request], head: Request, max_num_seqs: int) -> Request | None:
        """The running request whose place the waiting `head` takes (None: it waits): when head's tenant runs
        fewer requests than its weighted share of max_num_seqs, the newest request of the tenant that runs the
        most over its own share, if it stays at or above that share without it."""
        if len(self.present) < 2:
            return None
        counts = Counter(r.tenant for r in running)
        if counts[head.tenant] + 1 > self._share(head.tenant, max_num_seqs):
            return None
        over = max(counts, key=lambda t: counts[t] / self.weights.get(t, 1.0), default=None)
        if over is None or over == head.tenant or counts[over] - 1 < self._share(over, max_num_seqs):
            return None
        return next(r for r in reversed(running) if r.tenant == over)

    def kv_victim(self, running: list[Request]) -> Request | None:
        """The request to preempt when a running one lacks KV blocks: the newest one not in flight of the tenant
        that runs the most for its weight (None: every tenant's is in flight, or one tenant runs)."""
        counts = Counter(r.tenant for r in running)
        if len(counts) < 2:
            return None
        for tenant in sorted(counts, key=lambda t: counts[t] / self.weights.get(t, 1.0), reverse=True):
            for r in reversed(running):
                if r.tenant == tenant and not r.in_flight:
                    return r
        return None

    def _share(self, tenant: str, slots: int) -> float:
        total = sum(self.weights.get(t, 1.0) for t in self.present)
        return slots * self.weights.get(tenant, 1.0) / total


class WaitingQueue:
    """The waiting requests: a queue per tenant in the policy's order (one queue for all without a fair share),
    of which the head is the first request of the tenant the fair share serves next. Takes the calls the
    scheduler makes of a deque (waiting[0], popleft, appendleft, extendleft, remove, len, in, iteration)."""

    def __init__(self, policy: SchedulingPolicy):
        self.policy, self.fair = policy, policy.fair
        self._queues: dict[str, deque[Request]] = {}  # tenant -> its requests; only tenants that have some
        self._len = 0

    def _tenant(self, request: Request) -> str:
        return request.tenant if self.fair is not None else ""

    def _queue(self, request: Request) -> deque[Request]:
        tenant = self._tenant(request)
        queue = self._queues.get(tenant)
        if queue is None:
            queue = self._queues[tenant] = deque()
        return queue

    def add(self, request: Request, preempted: bool = False) -> None:
        """In its place under the policy (a preempted request first under fcfs: it ran before the others came)."""
        self.policy.enqueue(self._queue(request), request, preempted)
        self._len += 1

    def append(self, request: Request) -> None:
        self._queue(request).append(request)
        self._len += 1

    def appendleft(self, request: Request) -> None:
        self._queue(request).appendleft(request)
        self._len += 1

    def extendleft(self, requests: Iterable[Request]) -> None:
        for request in requests:
            self.appendleft(request)

    def _head_tenant(self) -> str:
        if len(self._queues) == 1 or self.fair is None:
            return next(iter(self._queues))
        fair = self.fair
        return min(self._queues, key=lambda t: (fair.counter(t), self._queues[t][0].arrival_time))

    def __getitem__(self, index: int) -> Request:
        if index != 0 or not self._queues:
            raise IndexError("only the head of the waiting queue is read")
        return self._queues[self._head_tenant()][0]

    def popleft(self) -> Request:
        tenant = self._head_tenant()
        queue = self._queues[tenant]
        request = queue.popleft()
        if not queue:
            del self._queues[tenant]
        self._len -= 1
        return request

    def remove(self, request: Request) -> None:
        tenant = self._tenant(request)
        queue = self._queues[tenant]
        queue.remove(request)
        if not queue:
            del self._queues[tenant]
        self._len -= 1

    def __contains__(self, request: object) -> bool:
        return isinstance(request, Request) and request in self._queues.get(self._tenant(request), ())

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def oldest_waits(self, now: float) -> dict[str, float]:
        """Per tenant, how long its oldest waiting request has waited (seconds)."""
        oldest: dict[str, float] = {}
        for request in self:
            tenant = request.tenant
            oldest[tenant] = min(oldest.get(tenant, now), request.arrival_time)
        return {tenant: now - arrival for tenant, arrival in oldest.items()}

    def __iter__(self) -> Iterator[Request]:
        for queue in list(self._queues.values()):
            yield from list(queue)
