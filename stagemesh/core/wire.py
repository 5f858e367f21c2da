"""Conversions between domain types and protobuf messages shared by services (tensors: tensor_wire).

A message is written in place, into the field of the message it travels in, rather than built apart and
copied there (protobuf copies a sub-message on assignment). Imports no torch: the router and the client use it.
"""
from __future__ import annotations

from dataclasses import fields

from stagemesh.core.engine_request import EngineRequest, KVSourceInfo
from stagemesh.core.sampling_params import SamplingParams, StructuredOutputs
from stagemesh.v1 import common_pb2, scheduler_pb2, stage_pb2


def sampling_to_pb(p: SamplingParams, out: common_pb2.SamplingParams | None = None) -> common_pb2.SamplingParams:
    """`p` as a message: written into `out` (an empty field of the message it travels in) where given."""
    msg = common_pb2.SamplingParams() if out is None else out
    msg.temperature, msg.top_p, msg.top_k, msg.min_p = p.temperature, p.top_p, p.top_k, p.min_p
    msg.repetition_penalty, msg.presence_penalty = p.repetition_penalty, p.presence_penalty
    msg.frequency_penalty, msg.max_tokens, msg.min_tokens = p.frequency_penalty, p.max_tokens, p.min_tokens
    msg.ignore_eos, msg.logprobs = p.ignore_eos, -1 if p.logprobs is None else p.logprobs
    msg.stop_token_ids.extend(p.stop_token_ids)
    msg.allowed_token_ids.extend(p.allowed_token_ids)
    for word in p.bad_words_token_ids:
        msg.bad_words.add(token_ids=word)
    if p.seed is not None:
        msg.seed = p.seed
    if p.prompt_logprobs is not None:
        msg.prompt_logprobs = p.prompt_logprobs
    for token_id, bias in p.logit_bias:
        msg.logit_bias[token_id] = bias
    if p.structured is not None:
        s, so = p.structured, msg.structured_outputs
        if s.kind == "json_object":
            so.json_object = True
        elif s.kind == "choice":
            so.choice.choices.extend(s.choices)
        else:
            setattr(so, s.kind, s.text)
        if s.any_whitespace is not None:
            so.any_whitespace = s.any_whitespace
    return msg


def structured_from_pb(msg: common_pb2.StructuredOutputs) -> StructuredOutputs | None:
    kind = msg.WhichOneof("kind")
    if kind is None:
        return None
    any_whitespace = msg.any_whitespace if msg.HasField("any_whitespace") else None
    if kind == "json_object":
        return StructuredOutputs("json_object", any_whitespace=any_whitespace) if msg.json_object else None
    if kind == "choice":
        return StructuredOutputs("choice", choices=tuple(msg.choice.choices))
    return StructuredOutputs(kind, getattr(msg, kind), any_whitespace=any_whitespace)


def sampling_fields_from_pb(msg: common_pb2.SamplingParams) -> dict:
    """SamplingParams' keyword values from a message, unset fields read as their defaults: the router's gRPC
    frontend hands them to its request builder, which checks them as it checks HTTP's. max_tokens is read as
    it is: on the scheduler's wire it is settled (>= 1, a 0 is refused); the frontend reads its own 0 (as many
    as the context leaves) before this."""
    return dict(
        temperature=msg.temperature,
        top_p=msg.top_p or 1.0,
        top_k=msg.top_k if msg.top_k > 0 else -1,
        min_p=msg.min_p,
        repetition_penalty=msg.repetition_penalty or 1.0,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        seed=msg.seed if msg.HasField("seed") else None,
        max_tokens=msg.max_tokens,
        min_tokens=msg.min_tokens,
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        logprobs=None if msg.logprobs < 0 else msg.logprobs,
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
        logit_bias=tuple(sorted(msg.logit_bias.items())),
        allowed_token_ids=tuple(msg.allowed_token_ids),
        bad_words_token_ids=tuple(tuple(w.token_ids) for w in msg.bad_words),
        structured=structured_from_pb(msg.structured_outputs) if msg.HasField("structured_outputs") else None,
    )


def sampling_from_pb(msg: common_pb2.SamplingParams) -> SamplingParams:
    return SamplingParams(**sampling_fields_from_pb(msg))


# EngineRequest's fields that travel as SubmitRequest's scalar fields of the same name (a new one needs no
# code here); the others are written by hand below
_SCALARS = tuple(f.name for f in fields(EngineRequest) if f.type in ("str", "int", "bool")
                 and f.name not in ("traceparent", "tracestate"))


def engine_request_to_pb(r: EngineRequest, out: scheduler_pb2.StreamSubmit) -> scheduler_pb2.StreamSubmit:
    """`r` written into a StreamSubmit (its trace context beside the SubmitRequest: the stream is shared)."""
    m = out.request
    for name in _SCALARS:
        setattr(m, name, getattr(r, name))
    m.prompt_token_ids.extend(r.prompt_token_ids)
    m.generated_token_ids.extend(r.generated_token_ids)
    sampling_to_pb(r.sampling, m.sampling)
    if r.kv_source is not None:
        kv_source_to_pb(r.kv_source, m.kv_transfer)
    out.traceparent, out.tracestate = r.traceparent, r.tracestate
    return out


def engine_request_from_pb(msg: scheduler_pb2.StreamSubmit) -> EngineRequest:
    """The request a StreamSubmit carries; its sampling is checked (SamplingParams), the rest where it is used."""
    m = msg.request
    return EngineRequest(
        prompt_token_ids=list(m.prompt_token_ids), sampling=sampling_from_pb(m.sampling),
        generated_token_ids=list(m.generated_token_ids),
        kv_source=kv_source_from_pb(m.kv_transfer) if m.HasField("kv_transfer") else None,
        traceparent=msg.traceparent, tracestate=msg.tracestate, **{name: getattr(m, name) for name in _SCALARS})


def kv_source_to_pb(k: KVSourceInfo, out: scheduler_pb2.KVTransferParams) -> scheduler_pb2.KVTransferParams:
    out.scheduler_address, out.request_id, out.epoch = k.scheduler_address, k.request_id, k.epoch
    out.block_ids.extend(k.block_ids)
    out.block_size, out.num_tokens = k.block_size, k.num_tokens
    out.stages.extend(stage_pb2.KVSource(address=a, layer_start=s, layer_end=e) for a, s, e in k.stages)
    return out


def kv_source_from_pb(p: scheduler_pb2.KVTransferParams) -> KVSourceInfo:
    """As it came: its sizes are checked where a decode replica takes it (scheduler.service)."""
    return KVSourceInfo(p.scheduler_address, p.request_id, p.epoch, tuple(p.block_ids), p.block_size, p.num_tokens,
                        tuple((s.address, s.layer_start, s.layer_end) for s in p.stages))
