"""The scheduling policy (vLLM's --scheduling-policy): in what order the waiting and running queues are
kept, and so who gets the token budget first and who is preempted when KV blocks run out.

fcfs: arrival order; a preempted request goes back to the front of the waiting queue; the newest running
request is the victim. priority: both queues in (priority, arrival) order, lower values first (vLLM's
order); the lowest-priority running request is the victim, and a waiting request that lacks blocks may
preempt running requests of lower priority than its own (vLLM's V0 priority preemption).
"""
from __future__ import annotations

import bisect
from collections import deque

from scheduler.request import Request
from stagemesh.core.errors import StagemeshError
from stagemesh.core.sampling_params import INT32_MAX

POLICIES = ("fcfs", "priority")


def _key(request: Request) -> tuple[int, float]:
    return request.priority_key


class SchedulingPolicy:
    def __init__(self, name: str):
        if name not in POLICIES:
            raise StagemeshError(f"scheduling-policy must be one of {', '.join(POLICIES)}, got {name!r}")
        self.name = name
        self.by_priority = name == "priority"

    def check(self, priority: int) -> None:
        """A request's priority as this policy takes it: a 32-bit integer, and 0 under fcfs (vLLM's refusal)."""
        if isinstance(priority, bool) or not isinstance(priority, int) or not -INT32_MAX - 1 <= priority <= INT32_MAX:
            raise StagemeshError(f"priority must be a 32-bit integer, got {priority!r}")
        if priority and not self.by_priority:
            raise StagemeshError(f"Got priority {priority} but Priority scheduling is not enabled (this replica "
                                 f"runs --scheduling-policy {self.name})")

    def enqueue(self, waiting: deque[Request], request: Request, preempted: bool = False) -> None:
        if self.by_priority:
            bisect.insort(waiting, request, key=_key)
        elif preempted:  # it was running before the others came
            waiting.appendleft(request)
        else:
            waiting.append(request)

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
