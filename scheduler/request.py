"""A request as the scheduler tracks it, and what it reports back to callers."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from scheduler.status import Status
from stagemesh.core.engine_request import EngineRequest
from stagemesh.core.pooling import Pooled
from stagemesh.core.sampling_params import SamplingParams
from stagemesh.core.step import PromptLogprobs, SampledToken, TokenLogprob

if TYPE_CHECKING:
    from stagemesh.core.engine_request import KVSourceInfo


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    seq_id: int = -1  # the stages' id of its current admission (new on every re-admission)
    status: Status = Status.WAITING  # where it stands, and so what the scheduler does with it (scheduler.status)
    in_flight: int = 0  # steps scheduled whose results are not back
    # output tokens scheduled whose ids are not known yet (vLLM's name): steps in flight that sample one; a
    # step run ahead of them computes PLACEHOLDER in their place (stage_worker.step_executor.RunAhead fills it in)
    num_output_placeholders: int = 0
    # speculative decoding: the draft tokens its next decode step carries (scheduler.speculation)
    spec_token_ids: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    num_recoveries: int = 0  # pipelines that broke under it (it was kept and recomputed: handover.requeue_all)
    num_prompt_logprobs: int = 0  # prompt logprobs delivered (positions 1.. of the prompt)
    priority: int = 0  # under --scheduling-policy priority: lower is served first
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    # disaggregated prefill (scheduler.kv_transfer): end after the first token, its KV held for a decode replica
    prefill_only: bool = False
    kv_source: KVSourceInfo | None = None  # its prompt's KV is held on a prefill replica, to be pulled
    tiers_checked: bool = False  # this admission looked its prompt up in the KV tiers (scheduler.tiers)
    lora_name: str = ""  # the LoRA adapter it runs with ("": the base model)
    tenant: str = ""  # who sent it, and its weight: the fair share across tenants (scheduler.policy.FairShare)
    tenant_weight: float = 1.0
    # it gives its place to another tenant's request (FairShare.victim) once its step in flight is back: not
    # scheduled until it is preempted
    yield_slot: bool = False
    # prompt + output, kept up to date by append_output (the scheduler reads it every step)
    all_token_ids: list[int] = field(init=False, repr=False)
    hash_root: int | None = field(default=None, repr=False)  # its prefix-cache blocks' root (EngineRequest's)

    def __post_init__(self) -> None:
        self.all_token_ids = self.prompt_token_ids + self.output_token_ids

    @classmethod
    def of(cls, r: EngineRequest) -> Request:
        """The scheduler's request for an engine request: the one place one is built from the other."""
        request = cls(r.request_id, list(r.prompt_token_ids), r.sampling, list(r.generated_token_ids),
                      priority=r.priority, prefill_only=r.prefill_only, lora_name=r.lora_name, hash_root=r.hash_root,
                      tenant=r.tenant, tenant_weight=r.tenant_weight)
        if r.generated_token_ids:  # a continuation: its prompt logprobs were delivered where it ran before
            request.num_prompt_logprobs = len(r.prompt_token_ids) - 1
        return request

    def restart(self) -> None:
        """Back to waiting with nothing computed, its generated tokens kept: the pipeline broke under it
        (scheduler.handover.requeue_all). Its prompt is computed again here, even if a prefill replica held its KV."""
        self.status, self.seq_id = self.status.after_restart(), -1
        self.num_computed_tokens = self.in_flight = self.num_output_placeholders = 0
        self.spec_token_ids = []
        self.kv_source = None
        self.tiers_checked = self.yield_slot = False

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def priority_key(self) -> tuple[int, float]:
        """The order of the priority policy (vLLM's): lower priority value first, then earlier arrival."""
        return self.priority, self.arrival_time

    def stop_reason(self, token_id: int, eos_token_ids: tuple[int, ...], max_model_len: int
                    ) -> tuple[str | None, int | None]:
        """Whether the output token just appended ends the request: ("stop", the token), ("length", None)
        or (None, None)."""
        p = self.sampling
        enough = len(self.output_token_ids) >= p.min_tokens
        if enough and not p.ignore_eos and token_id in eos_token_ids:
            return "stop", token_id
        if enough and token_id in p.stop_token_ids:
            return "stop", token_id
        if len(self.output_token_ids) >= p.max_tokens or self.num_tokens >= max_model_len:
            return "length", None
        return None, None

    def new_prompt_logprobs(self, scores: PromptLogprobs | None) -> RequestOutput | None:
        """The prompt logprobs a chunk brought that the request has not had yet (a preempted request's
        prompt is scored again when it is recomputed)."""
        if scores is None:
            return None
        skip = self.num_prompt_logprobs + 1 - scores.start  # positions 1.. delivered so far
        if skip < 0 or skip >= len(scores.entries):
            return None
        self.num_prompt_logprobs += len(scores.entries) - skip
        return RequestOutput(self.request_id, prompt_logprobs=scores.entries[skip:],
                             prompt_logprobs_start=scores.start + skip,
                             num_prompt_tokens=len(self.prompt_token_ids))


@dataclass(frozen=True)
class HeldKV:
    """A prefilled request's KV, held for a decode replica: its blocks, the tokens they hold, and (filled in by
    the driver) the epoch they belong to and the stages (address, first layer, end layer) that hold them."""
    block_ids: list[int]
    num_tokens: int
    epoch: int = -1
    stages: tuple[tuple[str, int, int], ...] = ()


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[SampledToken] = field(default_factory=list)
    # "stop" | "length" | "abort" | "error" | "prefilled" (prefill_only) | "migrated" (on to another replica)
    finish_reason: str | None = None
    stop_token_id: int | None = None
    error: str | None = None
    # with finish_reason "error": whether the request's own data failed it (True: an invalid-argument
    # error, never retried elsewhere) or the pipeline did (False: the replica is unavailable)
    own_fault: bool = False
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    # logprobs of prompt tokens prompt_logprobs_start, ... (in order, before the first token)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs_start: int = 0
    queue_seconds: float | None = None  # arrival to first scheduling, on the request's first output
    held_kv: HeldKV | None = None  # "prefilled" (or "migrated" with its KV): where its KV waits
    # with finish_reason "error": its prompt's KV could not be loaded from its prefill replica and the
    # kv_load_failure_policy is fail (FAILED_PRECONDITION: the router may prefill it again)
    kv_load_failed: bool = False
    pooled: Pooled | None = None  # a pooling request's pooled prompt, on its last output

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
