"""Why a replica takes no new requests while it still serves the ones it has.

Two things drain a replica: its scheduler was told to stop (SIGTERM), or one of its stages was (the stage says
so in its heartbeat: StageDescription.draining). Either way the replica's readiness turns false, so routers send
new work elsewhere, and a submit that comes anyway is refused as UNAVAILABLE (a router sends it to another
replica); running requests go on. A stage's drain ends when a new instance of it registers.
"""
from __future__ import annotations

import logging

log = logging.getLogger("stagemesh.scheduler")


class Drain:
    def __init__(self) -> None:
        self.stopping = False  # the scheduler itself is shutting down
        self._leaving: dict[int, str] = {}  # stage index -> the instance that drains

    def stage(self, index: int, instance_id: str, draining: bool) -> None:
        """A stage's heartbeat: it drains, or (another instance, or the same one not draining) it serves."""
        leaving = self._leaving.get(index)
        if draining and leaving != instance_id:
            self._leaving[index] = instance_id
            log.info("stage %d is shutting down: the replica takes no new requests until it is back", index)
        elif not draining and leaving is not None:
            del self._leaving[index]
            log.info("stage %d is back: the replica takes new requests again", index)

    @property
    def reason(self) -> str:
        """Why no new request is taken ("" while they are)."""
        if self.stopping:
            return "the scheduler is shutting down"
        if self._leaving:
            return f"stage {min(self._leaving)} is shutting down"
        return ""
