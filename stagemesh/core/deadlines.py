"""Every deadline the services put on their internal RPCs and waits, in one place (seconds).

A service that takes a deadline from its command line (the scheduler's
--forward-timeout) replaces that field (dataclasses.replace) and passes the
object on; everything else reads DEADLINES. STAGEMESH_DEADLINES replaces fields for
every service started with it: "collective_s=300,store_s=60" (slow links, long loads).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace

from stagemesh.core.errors import StagemeshError


@dataclass(frozen=True)
class Deadlines:
    forward_s: float = 120.0  # scheduler -> stage: one step (--forward-timeout)
    join_s: float = 300.0  # scheduler -> stage: JoinPipeline, a world forming
    probe_s: float = 2.0  # scheduler -> stage: Describe of a stage that should be up
    probe_starting_s: float = 5.0  # ... of a stage that may be (re)starting (waits for it to listen)
    register_s: float = 10.0  # stage -> scheduler: RegisterStage, the stage's heartbeat
    push_activations_s: float = 30.0  # stage -> next stage: PushActivations (grpc handoff)
    handoff_recv_s: float = 120.0  # a stage waits for the previous stage's activations or the last one's tokens
    step_turn_s: float = 30.0  # a Forward that came early waits for the steps before it
    store_s: float = 20.0  # joining the epoch's torch.distributed store (a half-formed world gives up this soon)
    collective_s: float = 120.0  # one collective or point-to-point transfer of the epoch's world
    ep_form_s: float = 600.0  # the expert-parallel group across replicas forming (members load at their own pace)
    # decode scheduler -> its stages: PullKV, a prefill's KV fetched (its ReadKV calls, and its GetKVPeers, too)
    kv_pull_s: float = 60.0
    # a PullKV given a bound (the decode scheduler's --kv-load-timeout) reads within it; its RPC deadline is the
    # bound plus this, for the write into the stage's blocks, which waits for the step the stage is running
    kv_write_s: float = 10.0
    # decode scheduler -> prefill scheduler: ReleaseKV of the blocks it held; GetModelInfo for its stages (KV peers)
    kv_release_s: float = 5.0
    # scheduler -> stage: StoreKV (blocks into the host tier, disk writes queued) and LoadKV (files read, blocks
    # filled between steps) of the KV tiers
    kv_store_s: float = 60.0
    kv_load_s: float = 60.0
    # router -> scheduler -> stage: an adapter loaded at run time (read from disk and checked on every TP rank)
    lora_load_s: float = 120.0

    @property
    def channel_linger_s(self) -> float:
        """How long a replaced stage's channel stays open: until every call on it is past its deadline."""
        return max(self.forward_s, self.join_s) + 5


def from_env(value: str | None) -> Deadlines:
    """Deadlines with the fields STAGEMESH_DEADLINES names replaced ("name=seconds,..."); a name that is not a
    deadline, or a time that is not a positive number, is refused with what it should be."""
    deadlines = Deadlines()
    if not value:
        return deadlines
    names = [f.name for f in fields(Deadlines)]
    changes = {}
    for item in value.split(","):
        name, _, seconds = item.strip().partition("=")
        try:
            changes[name] = float(seconds)
        except ValueError:
            changes[name] = float("nan")
        if name not in names or not changes[name] > 0:
            raise StagemeshError(f"STAGEMESH_DEADLINES: {item.strip()!r} is not name=seconds with a positive time "
                                 f"and a name among {', '.join(names)}")
    return replace(deadlines, **changes)


DEADLINES = from_env(os.environ.get("STAGEMESH_DEADLINES"))
