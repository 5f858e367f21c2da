"""Activation handoff between consecutive stages, behind one small interface.

`nccl`: torch.distributed send/recv between the stages' TP-rank-0s in the
epoch's world (NCCL on CUDA, gloo on CPU). `grpc`: the sender calls the next
stage's PushActivations; the receiver waits in a mailbox keyed by step id.
Stages process steps in order, so both match steps by id.
"""
from __future__ import annotations

import threading
import time
from collections import deque

import torch
import torch.distributed as dist

from stagemesh.errors import StagemeshError
from stagemesh.service_options import channel
from stagemesh.v1 import stage_pb2, stage_pb2_grpc
from stagemesh.wire import tensor_from_pb, tensor_to_pb

PUSH_DEADLINE_S = 30.0


class HandoffAborted(StagemeshError):
    """The epoch ended while a stage waited for activations."""


class DistHandoff:
    # Sends in flight before the oldest is waited for. A blocking send would hold this stage
    # until the next one posts its receive, i.e. until it finishes its current micro-batch:
    # gloo's send completes only then, and the pipeline would run in lock step.
    MAX_PENDING_SENDS = 4

    def __init__(self, prev_rank: int | None, next_rank: int | None, device: torch.device):
        self.prev_rank, self.next_rank, self.device = prev_rank, next_rank, device
        self._pending: deque[tuple[dist.Work, torch.Tensor]] = deque()  # the tensor lives until its send is done

    def send(self, epoch: int, step_id: int, hidden: torch.Tensor) -> int:
        hidden = hidden.contiguous()
        self._pending.append((dist.isend(hidden, dst=self.next_rank), hidden))
        while self._pending and (len(self._pending) > self.MAX_PENDING_SENDS or self._pending[0][0].is_completed()):
            self._pending.popleft()[0].wait()
        return hidden.numel() * hidden.element_size()

    def recv(self, epoch: int, step_id: int, shape: tuple[int, ...], dtype: torch.dtype,
             timeout: float) -> torch.Tensor:
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(buf, src=self.prev_rank)
        return buf

    def abort(self) -> None:
        self._pending.clear()  # a dead peer breaks the gloo/NCCL connection, which raises in recv

    close = abort


class GrpcHandoff:
    """The receiving end keeps a bounded mailbox: activations for the next `window` steps of its epoch only
    (each checked against the step limits before it gets here), so what it holds is bounded by the window
    times the largest step; they go when their step is taken, a later step is, or the epoch ends."""

    def __init__(self, next_address: str | None, device: torch.device, epoch: int = 0, first_step_id: int = 0,
                 window: int = 16):
        self.device = device
        self._stub = None
        if next_address:
            self._channel = channel(next_address)
            self._stub = stage_pb2_grpc.StageStub(self._channel)
        self._epoch, self._next = epoch, first_step_id  # the next step whose activations recv() takes
        self._window = window
        self._mailbox: dict[int, stage_pb2.PushActivationsRequest] = {}
        self._cond = threading.Condition()
        self._aborted = False

    def send(self, epoch: int, step_id: int, hidden: torch.Tensor) -> int:
        msg = tensor_to_pb(hidden)
        self._stub.PushActivations(stage_pb2.PushActivationsRequest(epoch=epoch, step_id=step_id, hidden_states=msg),
                                   timeout=PUSH_DEADLINE_S)
        return len(msg.data)

    def deliver(self, request: stage_pb2.PushActivationsRequest) -> None:
        step = request.step_id
        with self._cond:
            if self._aborted or request.epoch != self._epoch:
                raise StagemeshError(f"activations for epoch {request.epoch}: the stage is not in that epoch")
            if not self._next <= step < self._next + self._window or step in self._mailbox:
                raise StagemeshError(f"activations for step {step}: this stage takes steps {self._next} to "
                                     f"{self._next + self._window - 1}, each once")
            self._mailbox[step] = request
            self._cond.notify_all()

    def recv(self, epoch: int, step_id: int, shape: tuple[int, ...], dtype: torch.dtype,
             timeout: float) -> torch.Tensor:
        deadline = time.monotonic() + timeout
        with self._cond:
            while step_id not in self._mailbox:
                left = deadline - time.monotonic()
                if self._aborted:
                    raise HandoffAborted("the pipeline epoch ended")
                if left <= 0:
                    raise StagemeshError(f"no activations from the previous stage for step {step_id} in {timeout:.0f}s")
                self._cond.wait(left)
            request = self._mailbox.pop(step_id)
            self._next = max(self._next, step_id + 1)
            for old in [s for s in self._mailbox if s < self._next]:
                del self._mailbox[old]
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
        if self._stub is not None:
            self._channel.close()
