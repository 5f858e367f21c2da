"""Conversions between domain types and protobuf messages shared by services (tensors: tensor_wire).

A message is written in place, into the field of the message it travels in, rather than built apart and
copied there (protobuf copies a sub-message on assignment). Imports no torch: the router and the client use it.
"""
from __future__ import annotations

from dataclasses import fields

from stagemesh.core.engine_request import EngineRequest, KVSourceInfo
from stagemesh.core.sampling_params import SCALAR_FIELDS, SamplingParams, StructuredOutputs
from stagemesh.core.step import TokenLogprob
from stagemesh.v1 import common_pb2, scheduler_pb2, stage_pb2


# SamplingParams' numbers and switches travel as the SamplingParams message's fields of the same name: a new
# one needs no code here. The rest are written by hand: token-id lists, logit_bias, bad words, the constraint,
# and logprobs (None travels as -1).
_PLAIN = tuple(name for name in SCALAR_FIELDS if name != "logprobs")
# proto3 reads an unset field as 0: for these 0 is no value of the field, and reads as "off" (the default)
_ZERO_IS_OFF = {"top_p": 1.0, "repetition_penalty": 1.0}


def sampling_to_pb(p: SamplingParams, out: common_pb2.SamplingParams | None = None) -> common_pb2.SamplingParams:
    """`p` as a message: written into `out` (an empty field of the message it travels in) where given."""
    msg = common_pb2.SamplingParams() if out is None else out
    for name in _PLAIN:
        value = getattr(p, name)
        if value is not None:  # (None: an optional field left unset)
            setattr(msg, name, value)
    msg.logprobs = -1 if p.logprobs is None else p.logprobs
    msg.stop_token_ids.extend(p.stop_token_ids)
    msg.allowed_token_ids.extend(p.allowed_token_ids)
    for word in p.bad_words_token_ids:
        msg.bad_words.add(token_ids=word)
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
    """SamplingParams' keyword values from a message, unset fields read as their defaults, an unset optional one
    left out (SamplingParams' default, or the model's where the router's gRPC frontend reads it): the frontend
    hands them to its request builder, which checks them as it checks HTTP's. max_tokens is read as
    it is: on the scheduler's wire it is settled (>= 1, a 0 is refused); the frontend reads its own 0 (as many
    as the context leaves) before this."""
    values = {name: value for name in _PLAIN if (value := _plain_from_pb(msg, name)) is not None}
    if "top_k" in values:
        values["top_k"] = msg.top_k if msg.top_k > 0 else -1  # (0 or any negative: off)
    return dict(
        values,
        stop_token_ids=tuple(msg.stop_token_ids),
        logprobs=None if msg.logprobs < 0 else msg.logprobs,
        logit_bias=tuple(sorted(msg.logit_bias.items())),
        allowed_token_ids=tuple(msg.allowed_token_ids),
        bad_words_token_ids=tuple(tuple(w.token_ids) for w in msg.bad_words),
        structured=structured_from_pb(msg.structured_outputs) if msg.HasField("structured_outputs") else None,
    )


def _plain_from_pb(msg: common_pb2.SamplingParams, name: str):
    if msg.DESCRIPTOR.fields_by_name[name].has_presence and not msg.HasField(name):
        return None  # an optional field (seed, prompt_logprobs) left unset
    value = getattr(msg, name)
    return _ZERO_IS_OFF[name] if name in _ZERO_IS_OFF and not value else value


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
    for e in r.generated_logprobs:
        m.generated_logprobs.add(token_id=e.token_id, logprob=e.logprob, rank=e.rank, top_token_ids=e.top_token_ids,
                                 top_logprobs=e.top_logprobs)
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
        generated_logprobs=[TokenLogprob(e.token_id, e.logprob, e.rank, list(e.top_token_ids), list(e.top_logprobs))
                            for e in m.generated_logprobs],
        kv_source=kv_source_from_pb(m.kv_transfer) if m.HasField("kv_transfer") else None,
        traceparent=msg.traceparent, tracestate=msg.tracestate, **{name: getattr(m, name) for name in _SCALARS})


def kv_source_to_pb(k: KVSourceInfo, out: scheduler_pb2.KVTransferParams) -> scheduler_pb2.KVTransferParams:
    out.scheduler_address, out.request_id, out.epoch = k.scheduler_address, k.request_id, k.epoch
    out.block_ids.extend(k.block_ids)
    out.block_size, out.num_tokens = k.block_size, k.num_tokens
    out.stages.extend(stage_pb2.KVSource(address=a, layer_start=s, layer_end=e) for a, s, e in k.stages)
    out.read_ticket = k.read_ticket
    return out


def kv_source_from_pb(p: scheduler_pb2.KVTransferParams) -> KVSourceInfo:
    """As it came: its sizes are checked where a decode replica takes it (scheduler.service)."""
    return KVSourceInfo(p.scheduler_address, p.request_id, p.epoch, tuple(p.block_ids), p.block_size, p.num_tokens,
                        tuple((s.address, s.layer_start, s.layer_end) for s in p.stages), p.read_ticket)
