"""One request as the engine takes it, from the router down to the scheduler's own Request: built once by
the router (router.choices.plan, after max_tokens is settled) and passed whole through every layer, to the
wire (stagemesh.core.wire.engine_request_to_pb / engine_request_from_pb) and back. A layer that needs a
variant (a continuation after a failover, the two halves of a disaggregated request) makes one with
dataclasses.replace. A new per-request field is a field here, a field of the same name in SubmitRequest
(protos/stagemesh/v1/scheduler.proto: scalars travel by name) and whatever reads it.

Imports no torch and no protobuf: the router, the client and the scheduler use it.
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

from stagemesh.core.block_hash import adapter_root
from stagemesh.core.sampling_params import SamplingParams
from stagemesh.core.step import TokenLogprob


@dataclass(frozen=True)
class KVSourceInfo:
    """Disaggregated prefill: where a prompt's KV is held (the prefill replica's scheduler, its request, blocks
    and stages), as the prefill replica reports it and a decode replica fetches it."""
    scheduler_address: str
    request_id: str
    epoch: int
    block_ids: tuple[int, ...]
    block_size: int
    num_tokens: int
    stages: tuple[tuple[str, int, int], ...]  # (address, layer start, layer end) per stage
    read_ticket: bytes = b""  # what its stages ask of a reader of these blocks (stagemesh.core.kv_ticket)


@dataclass(frozen=True)
class EngineRequest:
    request_id: str  # unique per replica
    prompt_token_ids: Sequence[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)  # max_tokens settled (>= 1)
    # a continuation: the tokens it already generated on a replica that failed (or the first token, on the
    # decode half of a disaggregated request); it goes on from prompt + these
    generated_token_ids: Sequence[int] = ()
    priority: int = 0  # vLLM's: lower is served first (--scheduling-policy priority)
    lora_name: str = ""  # its LoRA adapter ("": the base model)
    prefill_only: bool = False  # disaggregated prefill, prefill half: end after the first token, its KV held
    kv_source: KVSourceInfo | None = None  # ... decode half: its prompt's KV is held there, to be fetched
    resumable: bool = False  # its replica keeps it for another router if its own goes away (router.resume)
    traceparent: str = ""  # its W3C trace context ("": tracing off)
    tracestate: str = ""
    # vLLM's cache_salt: its prefix-cache blocks are shared only with requests of the same salt ("": none)
    cache_salt: str = ""
    # a continuation's logprobs of generated_token_ids, one each (sampling.logprobs set): kept with its outputs
    # for a router that resumes it
    generated_logprobs: Sequence[TokenLogprob] = ()
    owner: str = ""  # resumable: a digest of its client's credential; a resume must present the same

    @property
    def hash_root(self) -> int | None:
        """The parent of its prompt's first block hash (stagemesh.core.block_hash; None: no parent): what keeps
        one adapter's or one salt's cached blocks from another's. As vLLM's, the salt goes into the first block's
        hash only; every later block chains on it. The router's KV index predicts hits with the same root."""
        root = adapter_root(self.lora_name)
        if not self.cache_salt:
            return root
        key = b"salt\0" + struct.pack("<Q", root or 0) + self.cache_salt.encode()
        return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
