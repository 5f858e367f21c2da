"""Rebalancing (--rebalance-interval): running requests move from a loaded replica to an idle one, with their KV.

Least-load balancing places a request where the load is lowest when it arrives and cannot move it after: a
replica that comes up (restarted, scaled out) while another runs long streams stays idle until they end. Every
interval the router compares the replicas that are ready and serve whole requests (--kv-role both): when the
busiest runs at least --rebalance-min-gap more requests than the least loaded has running and waiting, it asks
the busiest (Scheduler.Migrate) to hand on half the gap. Those requests end "migrated" there, between two steps,
and each goes on through router.dispatch as a draining replica's do: on another replica (never the one it left),
with its KV under the scheduler's --migration-policy kv (read over the KV transfer of disaggregated prefill: the
replica that takes it must name the busy one with --kv-peer, as `stagemesh serve` gives every replica the
others), computed again otherwise; the router counts each (stagemesh:migrated_requests_total{how}). After a move
the next look waits an interval more, for the replicas' figures to show it."""
from __future__ import annotations

import asyncio
import logging

from router.replica_set import ReplicaSet
from router.replicas import Replica

log = logging.getLogger("stagemesh.router")


def plan(replicas: list[Replica], min_gap: int) -> tuple[Replica, int] | None:
    """(the replica to hand requests on, how many), or None while the replicas are balanced within min_gap."""
    ready = [r for r in replicas if r.healthy and not r.cordoned and not r.forgotten and r.kv_role == "both"]
    if len(ready) < 2:
        return None
    busiest = max(ready, key=lambda r: (r.num_running, -r.num_waiting))
    idlest = min(ready, key=lambda r: r.num_running + r.num_waiting)
    gap = busiest.num_running - (idlest.num_running + idlest.num_waiting)
    if gap < min_gap:  # (min_gap >= 2: never the same replica)
        return None
    return busiest, gap // 2


async def rebalance_loop(replicas: ReplicaSet, interval_s: float, min_gap: int) -> None:
    """Look every interval_s, and move what plan() says, until cancelled."""
    log.info("rebalancing: every %gs, running requests move from a replica that runs %d or more than another "
             "(--rebalance-interval, --rebalance-min-gap)", interval_s, min_gap)
    while True:
        await asyncio.sleep(interval_s)
        step = plan(replicas.replicas, min_gap)
        if step is None:
            continue
        replica, n = step
        moved = await replica.migrate(n)
        if moved:
            log.info("rebalancing: %s handed on %d of its %d running request(s)", replica.address, moved,
                     replica.num_running)
            await asyncio.sleep(interval_s)  # (the figures show the move first)
