"""Expert parallelism across data-parallel replicas: one EP group per layer range, K members.

With `--data-parallel-size K --enable-expert-parallel` (vLLM's data-parallel attention with
expert-parallel MoE) each replica runs attention on its own requests, and the stages of the K
replicas that serve the same layers hold the experts between them: expert e on member
e // (E / K). A MoE layer gathers every member's tokens, each member computes what its experts
add to all of them, and one all-reduce sums the members (docs/dp-ep.md has the picture).

The collectives of the group meet only if every member runs them in the same order, but each
replica's scheduler sends steps only when it has work. So the members step together in *ticks*
(vLLM's DP coordinator and dummy batches): a member with a step to run opens a tick with its token
count; a member with nothing queued opens one with 0 after a short wait; the tick is one
all-gather of the counts, after which every member knows how many rows each puts into every MoE
layer of this forward. A member without a step then runs only the MoE layers' collectives with no
rows of its own (a dummy forward: no attention, no KV), so the busy members' tokens still reach
the experts it holds. When every count is 0 the tick costs that one all-gather and the idle wait
grows (up to IDLE_WAIT_S[1]) so that an idle mesh costs little.

Membership is fixed for the life of the processes: a member that loses a peer (its collectives
fail: gloo reports a closed connection at once) fails its step, and its stage exits with
EXIT_BROKEN so that its supervisor (`stagemesh serve`, a compose restart policy) starts it again;
the restarted members form the group anew. The group's rendezvous store is hosted by member 0
at --data-parallel-address:--data-parallel-rpc-port + the stage index.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from prometheus_client import Counter

from stagemesh.core.deadlines import DEADLINES
from stagemesh.core.errors import StagemeshError

log = logging.getLogger("stagemesh.stage")

TICKS = Counter("stagemesh:ep_ticks", "Ticks of the expert-parallel group across replicas: step (this member "
                "ran a step), dummy (only another member had work), idle (no member had)", ["stage", "kind"])
EXIT_BROKEN = 3  # not 2 (a refused configuration, which `serve` does not restart)
BROKEN_LINGER_S = 1.0  # a broken member keeps answering (with the reason) this long before it exits
IDLE_WAIT_S = (0.0005, 0.02)  # an idle member's wait before a tick: after a busy tick, and at most
FORM_TIMEOUT = timedelta(seconds=DEADLINES.ep_form_s)
GROUP_TIMEOUT = timedelta(seconds=DEADLINES.collective_s)


class EPGroupBroken(StagemeshError):
    """A peer of the EP group is gone: this member cannot run another MoE layer."""


@dataclass(frozen=True)
class EPConfig:
    """Where this stage sits among the data-parallel replicas (stage_worker.cli flags)."""
    dp_rank: int
    dp_size: int
    address: str  # --data-parallel-address: member 0's host
    port: int  # --data-parallel-rpc-port; layer range s uses port + s

    def check(self) -> None:
        if self.dp_size < 2:
            raise StagemeshError("--data-parallel-size must be at least 2 for expert parallelism across replicas")
        if not 0 <= self.dp_rank < self.dp_size:
            raise StagemeshError(f"--data-parallel-rank {self.dp_rank} must be in [0, {self.dp_size})")
        if not 0 < self.port < 65536:
            raise StagemeshError(f"--data-parallel-rpc-port {self.port} is not a port")


class EPGroup:
    """This stage's place in its layer range's EP group, and the tick protocol over it. Every method
    runs on the stage's main thread (stage_worker.main_loop), where the model runs."""

    def __init__(self, cfg: EPConfig, stage_index: int):
        self.cfg, self.stage_index = cfg, stage_index
        self.rank, self.size = cfg.dp_rank, cfg.dp_size
        self.pg: Any = None  # a dist.ProcessGroupGloo once formed (torch's stubs give it none of its collectives)
        self.store: dist.TCPStore | None = None
        self.blocks: list = []  # the stage's SparseMoeBlocks, in forward order (attach)
        self.hidden_size, self.dtype = 0, torch.float32
        self.counts: list[int] | None = None  # rows of each member in the open tick
        self.layers_done = 0
        self.idle_wait = IDLE_WAIT_S[0]
        self.broken: str | None = None

    def attach(self, blocks: list, hidden_size: int, dtype: torch.dtype) -> None:
        """The model's sparse blocks, which a member without rows of its own runs in a dummy forward."""
        self.blocks, self.hidden_size, self.dtype = blocks, hidden_size, dtype

    # -- forming --------------------------------------------------------------------
    def form(self) -> None:
        """Join the group (member 0 hosts its store); blocks until every member has joined."""
        port = self.cfg.port + self.stage_index
        log.info("expert-parallel group of stage %d: member %d of %d, store at %s:%d (member 0 hosts it); waiting "
                 "for every member", self.stage_index, self.rank, self.size, self.cfg.address, port)
        try:
            self.store = dist.TCPStore(self.cfg.address, port, is_master=self.rank == 0, timeout=FORM_TIMEOUT,
                                       wait_for_workers=False)
            self.pg = dist.ProcessGroupGloo(dist.PrefixStore("ep/", self.store), self.rank, self.size,
                                            GROUP_TIMEOUT)
            hello = torch.zeros(self.size, dtype=torch.int64)
            self.pg.allreduce([hello]).wait()  # every member is connected
        except (RuntimeError, OSError) as err:  # a member that went away while the group formed: start again
            raise EPGroupBroken(f"the expert-parallel group of stage {self.stage_index} did not form "
                                 f"(store {self.cfg.address}:{port}): {err}") from None
        log.info("expert-parallel group of stage %d formed: %d members", self.stage_index, self.size)

    # -- ticks ------------------------------------------------------------------------
    def begin(self, num_tokens: int) -> None:
        """Open a tick: this member puts `num_tokens` rows through every MoE layer of this forward."""
        self._check()
        counts = torch.tensor([num_tokens], dtype=torch.int64)
        parts = [torch.empty_like(counts) for _ in range(self.size)]
        self._run(lambda: self.pg.allgather([parts], [counts]).wait())
        self.counts = [int(p) for p in parts]
        self.layers_done = 0
        busy = any(self.counts)
        TICKS.labels(str(self.stage_index), "step" if num_tokens else "dummy" if busy else "idle").inc()
        self.idle_wait = IDLE_WAIT_S[0] if busy else min(self.idle_wait * 2, IDLE_WAIT_S[1])

    def end(self) -> None:
        """Close the tick: the MoE layers this member's forward did not reach run with no rows of its own
        (all of them for a dummy forward, the rest of them for a step that failed part way)."""
        if self.counts is None:
            return
        try:
            if any(self.counts):
                empty = torch.empty((0, self.hidden_size), dtype=self.dtype)
                with torch.inference_mode():
                    for block in self.blocks[self.layers_done:]:
                        block(empty, None)
        finally:
            self.counts = None

    def idle_tick(self) -> None:
        """A member with nothing queued: a tick with no rows, a dummy forward if another member has work."""
        self.begin(0)
        self.end()

    def moe(self, x: torch.Tensor, experts) -> tuple[torch.Tensor, int]:
        """One MoE layer over the group: `experts(all_rows)` is this member's part of every member's rows.
        Returns (this member's rows summed over the members, where its rows start among all of them)."""
        if self.counts is None:
            raise StagemeshError("a MoE layer ran outside a tick of the expert-parallel group")
        counts, rows = self.counts, x.shape[0]
        self.layers_done += 1
        start = sum(counts[:self.rank])
        if not any(counts):
            return x, start
        width = max(counts)
        padded = torch.zeros((width, x.shape[1]), dtype=x.dtype, device=x.device)
        padded[:rows] = x  # a member's dummy forward has no rows where its tick counted some: zeros then
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        self._run(lambda: self.pg.allgather([parts], [padded]).wait())
        everyone = torch.cat([p[:n] for p, n in zip(parts, counts)])
        out = experts(everyone).contiguous()
        self._run(lambda: self.pg.allreduce([out]).wait())
        return out[start:start + rows], start

    def _run(self, collective) -> None:
        try:
            collective()
        except RuntimeError as err:
            self.broken = str(err).splitlines()[0].split(" This is typically")[0]
            self.counts = None
            raise self._broken() from None

    def _check(self) -> None:
        if self.pg is None:
            raise StagemeshError("the expert-parallel group has not formed")
        self.raise_if_broken()

    def raise_if_broken(self) -> None:
        """A broken member lingers a moment before it exits; it must not join a new epoch meanwhile, or the
        scheduler would form a pipeline on a stage about to be gone."""
        if self.broken is not None:
            raise self._broken()

    def _broken(self) -> EPGroupBroken:
        return EPGroupBroken(f"the expert-parallel group of stage {self.stage_index} is broken (a member is gone: "
                             f"{self.broken}); this stage exits so that the group re-forms")
