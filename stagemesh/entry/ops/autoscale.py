"""The autoscaler of `stagemesh serve --autoscale-max-replicas N`: it reads every replica's load from its scheduler
(GetStats: requests waiting, KV cache usage) and adds or removes one replica at a time, with hysteresis.

Grow when, sustained for --autoscale-scale-up-window seconds, the requests waiting per replica pass
--autoscale-target-waiting or the mean KV cache usage passes --autoscale-target-kv-usage. Shrink when, sustained
for --autoscale-scale-down-window seconds, one replica fewer would still be under half of both targets (the
waiting requests spread over one replica fewer, the KV usage scaled up by n / (n - 1)). Nothing happens within
--autoscale-cooldown seconds of the last change (the autoscaler's or an operator's), nor while an operation runs;
the replicas stay within --autoscale-min-replicas and --autoscale-max-replicas. Every decision is logged with its
reason."""
from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass

log = logging.getLogger("stagemesh.serve")


@dataclass(frozen=True)
class AutoscaleConfig:
    min_replicas: int
    max_replicas: int
    target_waiting: float = 4.0  # requests waiting per replica
    target_kv_usage: float = 0.8  # mean KV cache usage, 0..1
    up_window_s: float = 30.0
    down_window_s: float = 300.0
    cooldown_s: float = 60.0
    interval_s: float = 2.0


@dataclass(frozen=True)
class Load:
    """The serving replicas' figures at one look."""
    replicas: int
    waiting: int  # requests waiting, over all replicas
    kv_usage: float  # mean KV cache usage

    def describe(self) -> str:
        return (f"{self.waiting / max(self.replicas, 1):.1f} request(s) waiting per replica, KV cache "
                f"{self.kv_usage:.0%} used, over {self.replicas} replica(s)")


@dataclass(frozen=True)
class Decision:
    replicas: int
    reason: str


class AutoscalePolicy:
    """Pure: figures and a clock in, a decision out (ops.autoscale.Autoscaler runs it)."""

    def __init__(self, cfg: AutoscaleConfig):
        self.cfg = cfg
        self.high_since: float | None = None
        self.low_since: float | None = None
        self.changed_at = -math.inf

    def changed(self, now: float) -> None:
        """The replicas changed (by this policy or by hand): the cooldown starts, the windows start over."""
        self.changed_at, self.high_since, self.low_since = now, None, None

    def decide(self, now: float, load: Load) -> Decision | None:
        c, n = self.cfg, load.replicas
        if n < c.min_replicas or n > c.max_replicas:
            target = min(max(n, c.min_replicas), c.max_replicas)
            return Decision(target, f"{n} replica(s) is outside --autoscale-min-replicas {c.min_replicas} and "
                                    f"--autoscale-max-replicas {c.max_replicas}")
        high = load.waiting / n > c.target_waiting or load.kv_usage > c.target_kv_usage
        low = n > 1 and load.waiting / (n - 1) < c.target_waiting / 2 and \
            load.kv_usage * n / (n - 1) < c.target_kv_usage / 2
        high_for = self._sustained("high_since", high, now)
        low_for = self._sustained("low_since", low, now)
        if now - self.changed_at < c.cooldown_s:
            return None
        if n < c.max_replicas and high_for >= c.up_window_s:
            return Decision(n + 1, f"{load.describe()}: above the target ({c.target_waiting:g} waiting per replica "
                                   f"or {c.target_kv_usage:.0%} KV) for {high_for:.0f}s")
        if n > c.min_replicas and low_for >= c.down_window_s:
            return Decision(n - 1, f"{load.describe()}: one replica fewer would stay under half the target for "
                                   f"{low_for:.0f}s")
        return None

    def _sustained(self, name: str, holds: bool, now: float) -> float:
        """For how long the condition has held (-1: it does not), keeping when it started in `name`."""
        since = getattr(self, name) if holds else None
        since = now if holds and since is None else since
        setattr(self, name, since)
        return -1.0 if since is None else now - since


class Autoscaler:
    """The policy on a thread of its own: every interval, read the load and start a scale when it decides."""

    def __init__(self, cfg: AutoscaleConfig, read_load, start_scale, busy):
        """read_load() -> Load | None (None: a replica did not answer: no decision); start_scale(n, reason)
        starts the scale; busy() -> whether an operation runs."""
        self.policy = AutoscalePolicy(cfg)
        self.read_load, self.start_scale, self.busy = read_load, start_scale, busy
        self.stop_event = threading.Event()
        self.last_load: Load | None = None
        self.last_decision: str = ""
        self._replicas: int | None = None

    def run(self) -> None:
        log.info("autoscaler: %s", self.policy.cfg)
        while not self.stop_event.wait(self.policy.cfg.interval_s):
            try:
                self.tick(time.monotonic())
            except Exception:  # noqa: BLE001 - a bug must not end autoscaling: the next tick tries again
                log.exception("autoscaler: a tick failed")

    def tick(self, now: float) -> None:
        if self.busy():
            return
        load = self.read_load()
        if load is None:
            return
        self.last_load = load
        if self._replicas is not None and load.replicas != self._replicas:  # by hand, or the last decision's
            self.policy.changed(now)
        self._replicas = load.replicas
        decision = self.policy.decide(now, load)
        if decision is None:
            return
        self.last_decision = f"{load.replicas} -> {decision.replicas}: {decision.reason}"
        log.info("autoscaler: scaling from %d to %d replica(s): %s", load.replicas, decision.replicas,
                 decision.reason)
        self.start_scale(decision.replicas, f"autoscaler: {decision.reason}")
        self.policy.changed(now)

    def describe(self) -> dict:
        c = self.policy.cfg
        return {"min_replicas": c.min_replicas, "max_replicas": c.max_replicas, "target_waiting": c.target_waiting,
                "target_kv_usage": c.target_kv_usage, "last_decision": self.last_decision or None,
                "load": None if self.last_load is None else self.last_load.describe()}
