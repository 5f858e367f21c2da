"""Where a request stands in the scheduler (vLLM's RequestStatus), and the one place that says what each
status means for scheduling.

A waiting request is in one of several states: queued (WAITING, or PREEMPTED: it ran, gave its blocks back and
is computed again), kept in its place but passed over (WAITING_FOR_GRAMMAR while the last stage compiles its
constraint, scheduler.grammar_wait; WAITING_FOR_LORA_SLOT while every adapter slot is busy, scheduler.lora_slots),
or out of the queue while its blocks are filled from elsewhere (WAITING_FOR_REMOTE_KV: pulled from a prefill
replica, scheduler.kv_transfer, or loaded from a KV tier, scheduler.tiers).
"""
from __future__ import annotations

import enum


class Status(enum.Enum):
    WAITING = "waiting"
    PREEMPTED = "preempted"
    WAITING_FOR_GRAMMAR = "waiting_for_grammar"  # vLLM's WAITING_FOR_FSM
    WAITING_FOR_LORA_SLOT = "waiting_for_lora_slot"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"  # vLLM's WAITING_FOR_REMOTE_KVS
    RUNNING = "running"
    FINISHED = "finished"

    @property
    def is_waiting(self) -> bool:
        """Not running yet (or again) and not finished: in the waiting queue, or out of it while its KV loads."""
        return self not in (Status.RUNNING, Status.FINISHED)

    @property
    def admissible(self) -> bool:
        """Whether the head of the waiting queue may be admitted now. A grammar wait ends by an event
        (Scheduler.wait_for_grammar); a LoRA slot wait is looked at again every step, the slots having changed."""
        return self in (Status.WAITING, Status.PREEMPTED, Status.WAITING_FOR_LORA_SLOT)

    def after_restart(self) -> Status:
        """Its status once the pipeline broke under it (Request.restart): waiting again, still for its grammar
        if it was (the constraint's compile outlives the epoch: scheduler.step_loop)."""
        return self if self is Status.WAITING_FOR_GRAMMAR else Status.WAITING
