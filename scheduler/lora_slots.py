"""--max-loras on a replica's steps: which waiting request may start now, as far as its LoRA adapter goes.

At most max_loras adapters run at once (the stages' slots). A waiting request whose adapter has no slot (every
slot busy with other adapters) keeps its place in the queue while the requests behind it that can run go ahead
(vLLM's scheduler skips it the same way). It cannot starve: the first such request is promised the slot of one
busy adapter (the one with the fewest running requests), no new request of that adapter starts until its running
ones have ended, and the freed slot then goes to the waiting requests in their order, the promised one first
among those behind it.
"""
from __future__ import annotations

from collections import Counter

from scheduler.request import Request


class LoRASlots:
    def __init__(self) -> None:
        self.freeing: str | None = None  # the busy adapter whose slot a waiting request is promised
        self.promised_to: Request | None = None

    def busy(self, running: list[Request]) -> Counter[str]:
        """A step's start: the adapters running now (and how many requests each); a promise kept or void ends."""
        busy = Counter(r.lora_name for r in running if r.lora_name)
        promised = self.promised_to
        if self.freeing not in busy or promised is None or not promised.status.is_waiting:
            self.freeing = self.promised_to = None
        return busy

    def admits(self, request: Request, busy: Counter[str], max_loras: int) -> bool:
        """Whether the waiting request's adapter lets it start now; False keeps it waiting in its place."""
        name = request.lora_name
        if not name:
            return True
        if name == self.freeing:  # its slot is being freed for a request that waits
            return False
        if name in busy or len(busy) < max_loras:
            return True
        if self.freeing is None:
            self.freeing = min(busy, key=lambda a: (busy[a], a))
            self.promised_to = request
        return False
