"""Activation handoff between consecutive stages, behind one small interface (Handoff).

`nccl`: torch.distributed send/recv between the stages' TP-rank-0s in the
epoch's world (NCCL on CUDA, gloo on CPU). `grpc`: the sender calls the next
stage's PushActivations; the receiver waits in a mailbox keyed by step id.
Stages process steps in order, so both match steps by id.

The same channel carries the sampled tokens that a step scheduled ahead needs
back from the last stage to the first (stage_worker.step_executor.RunAhead): a send on the
world from the last stage's rank 0 to the first's, or a PushActivations call
on the first stage with sampled_tokens instead of activations.
"""
from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from typing import cast

import torch
import torch.distributed as dist

from stagemesh.core.deadlines import DEADLINES
from stagemesh.core.errors import StagemeshError
from stagemesh.core.service_options import channel
from stagemesh.v1 import stage_pb2, stage_pb2_grpc
from stagemesh.core.tensor_wire import tensor_from_pb, tensor_to_pb



class HandoffAborted(StagemeshError):
    """The epoch ended while a stage waited for activations."""


class Handoff(ABC):
    """What a stage's step path asks of a handoff. Steps are taken in order, so both ends name a step by id."""

    # True: activations and tokens reach this stage in PushActivations calls, which the servicer hands to
    # deliver(); False: they come over the epoch's world, and such a call is refused
    receives_pushes: bool = False

    @abstractmethod
    def send(self, step_id: int, hidden: torch.Tensor) -> int:
        """The step's activations to the next stage; returns the bytes sent."""

    @abstractmethod
    def recv(self, step_id: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The step's activations from the previous stage (blocks until they come)."""

    @abstractmethod
    def send_tokens(self, step_id: int, tokens: list[int]) -> None:
        """Last stage of several: the sampled tokens a step run ahead needs, to the first stage."""

    @abstractmethod
    def recv_tokens(self, step_id: int, count: int) -> list[int]:
        """First stage of several: the tokens for the placeholders of a step run ahead."""

    def advance(self, step_id: int) -> None:  # noqa: B027 - a no-op unless tokens arrive ahead (grpc)
        """The first stage takes `step_id`: what arrived for the steps before it will not be needed."""

    def deliver(self, request: stage_pb2.PushActivationsRequest) -> None:
        """A PushActivations call's activations or tokens (only where receives_pushes)."""
        raise StagemeshError("this stage takes activations over the epoch's world, not in PushActivations")

    @abstractmethod
    def abort(self) -> None:
        """The epoch ends: whatever waits in recv or recv_tokens raises."""

    @abstractmethod
    def close(self) -> None:
        """Release the handoff's channels (after abort)."""


class DistHandoff(Handoff):
    # Sends in flight before the oldest is waited for. A blocking send would hold this stage
    # until the next one posts its receive, i.e. until it finishes its current micro-batch:
    # gloo's send completes only then, and the pipeline would run in lock step.
    MAX_PENDING_SENDS = 4

    def __init__(self, prev_rank: int | None, next_rank: int | None, device: torch.device,
                 tokens_rank: int | None = None):
        # tokens_rank: on the last stage the first stage's rank 0, on the first the last stage's (PP > 1)
        self.prev_rank, self.next_rank, self.device, self.tokens_rank = prev_rank, next_rank, device, tokens_rank
        self._pending: deque[tuple[dist.Work, torch.Tensor]] = deque()  # the tensor lives until its send is done

    # step ids name the step on the grpc handoff; on the world, messages between two ranks keep their order
    def send(self, step_id: int, hidden: torch.Tensor) -> int:
        return self._send(hidden.contiguous(), self.next_rank)

    def _send(self, tensor: torch.Tensor, dst: int | None) -> int:
        # (isend gives None only to a rank outside the group; the world holds every rank)
        self._pending.append((cast(dist.Work, dist.isend(tensor, dst=dst)), tensor))
        while self._pending and (len(self._pending) > self.MAX_PENDING_SENDS or self._pending[0][0].is_completed()):
            self._pending.popleft()[0].wait()
        return tensor.numel() * tensor.element_size()

    def recv(self, step_id: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(buf, src=self.prev_rank)
        return buf

    def send_tokens(self, step_id: int, tokens: list[int]) -> None:
        self._send(torch.tensor(tokens, dtype=torch.int32, device=self.device), self.tokens_rank)

    def recv_tokens(self, step_id: int, count: int) -> list[int]:
        buf = torch.empty(count, dtype=torch.int32, device=self.device)
        dist.recv(buf, src=self.tokens_rank)
        return buf.tolist()

    def abort(self) -> None:
        self._pending.clear()  # a dead peer breaks the gloo/NCCL connection, which raises in recv

    def close(self) -> None:
        self.abort()


class GrpcHandoff(Handoff):
    """The receiving end keeps a bounded mailbox: activations for the next `window` steps of its epoch only
    (each checked against the step limits before it gets here), so what it holds is bounded by the window
    times the largest step; they go when their step is taken, a later step is, or the epoch ends."""

    receives_pushes = True

    def __init__(self, next_address: str | None, device: torch.device, epoch: int = 0, window: int = 16,
                 first_address: str | None = None):
        # next_address: the next stage's (None on the last); first_address: the first stage's, on the last
        # stage of several (the tokens for steps run ahead go there)
        self.device = device
        self._channels = {a: channel(a) for a in {next_address, first_address} if a}
        self._next_stub = stage_pb2_grpc.StageStub(self._channels[next_address]) if next_address else None
        self._first_stub = stage_pb2_grpc.StageStub(self._channels[first_address]) if first_address else None
        self._epoch, self._next = epoch, 0  # the next step whose activations or tokens this stage takes
        self._window = window
        self._mailbox: dict[int, stage_pb2.PushActivationsRequest] = {}
        self._cond = threading.Condition()
        self._aborted = False

    def send(self, step_id: int, hidden: torch.Tensor) -> int:
        msg = tensor_to_pb(hidden)
        request = stage_pb2.PushActivationsRequest(epoch=self._epoch, step_id=step_id, hidden_states=msg)
        assert self._next_stub is not None  # (the last stage sends no activations)
        self._next_stub.PushActivations(request, timeout=DEADLINES.push_activations_s)
        return len(msg.data)

    def send_tokens(self, step_id: int, tokens: list[int]) -> None:
        if self._first_stub is None:
            raise StagemeshError("no first stage's address to return sampled tokens to (JoinPipeline's "
                                 "first_stage_address)")
        self._first_stub.PushActivations(stage_pb2.PushActivationsRequest(epoch=self._epoch, step_id=step_id,
                                                                          sampled_tokens=tokens),
                                         timeout=DEADLINES.push_activations_s)

    def deliver(self, request: stage_pb2.PushActivationsRequest) -> None:
        """Activations (or, on the first stage, sampled tokens) for a step of the next `window`."""
        step = request.step_id
        with self._cond:
            if self._aborted or request.epoch != self._epoch:
                raise StagemeshError(f"activations for epoch {request.epoch}: the stage is not in that epoch")
            if not self._next <= step < self._next + self._window or step in self._mailbox:
                raise StagemeshError(f"activations for step {step}: this stage takes steps {self._next} to "
                                     f"{self._next + self._window - 1}, each once")
            self._mailbox[step] = request
            self._cond.notify_all()

    def advance(self, step_id: int) -> None:  # noqa: B027 - a no-op unless tokens arrive ahead (grpc)
        """The first stage takes `step_id` (tokens for the steps before it will not be needed)."""
        with self._cond:
            self._take_up_to(step_id)

    def _take_up_to(self, step_id: int) -> None:
        self._next = max(self._next, step_id + 1)
        for old in [s for s in self._mailbox if s < self._next]:
            del self._mailbox[old]

    def _wait(self, step_id: int, what: str) -> stage_pb2.PushActivationsRequest:
        deadline = time.monotonic() + DEADLINES.handoff_recv_s
        with self._cond:
            while step_id not in self._mailbox:
                left = deadline - time.monotonic()
                if self._aborted:
                    raise HandoffAborted("the pipeline epoch ended")
                if left <= 0:
                    raise StagemeshError(f"no {what} for step {step_id} in {DEADLINES.handoff_recv_s:.0f}s")
                self._cond.wait(left)
            request = self._mailbox.pop(step_id)
            self._take_up_to(step_id)
        return request

    def recv_tokens(self, step_id: int, count: int) -> list[int]:
        tokens = list(self._wait(step_id, "sampled tokens from the last stage").sampled_tokens)
        if len(tokens) != count:
            raise StagemeshError(f"step {step_id} has {count} tokens scheduled ahead; the last stage sent "
                                 f"{len(tokens)}")
        return tokens

    def recv(self, step_id: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        request = self._wait(step_id, "activations from the previous stage")
        hidden = tensor_from_pb(request.hidden_states, self.device)
        if tuple(hidden.shape) != tuple(shape):
            raise StagemeshError(f"activations of step {step_id} have shape {tuple(hidden.shape)}, expected {shape}")
        return hidden.to(dtype)

    def abort(self) -> None:
        with self._cond:
            self._aborted = True
            self._mailbox.clear()
            self._cond.notify_all()

    def close(self) -> None:
        for ch in self._channels.values():
            ch.close()
