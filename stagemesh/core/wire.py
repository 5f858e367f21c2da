"""Conversions between domain types and protobuf messages shared by services.

Tensors cross processes as raw bytes with dtype and shape: never pickled.
"""
from __future__ import annotations

import numpy as np
import torch

from stagemesh.core.errors import StagemeshError
from stagemesh.core.sampling_params import SamplingParams, StructuredOutputs
from stagemesh.v1 import common_pb2

_DTYPES = {
    name: getattr(torch, name)
    for name in ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")
}


def tensor_to_pb(t: torch.Tensor) -> common_pb2.Tensor:
    t = t.detach().contiguous().cpu()
    name = str(t.dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise StagemeshError(f"dtype {name} cannot cross the wire")
    # view as bytes (bfloat16 has no numpy dtype)
    data = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return common_pb2.Tensor(dtype=name, shape=list(t.shape), data=data)


def tensor_from_pb(msg: common_pb2.Tensor, device: str | torch.device = "cpu") -> torch.Tensor:
    dtype = _DTYPES.get(msg.dtype)
    if dtype is None:
        raise StagemeshError(f"unknown tensor dtype {msg.dtype!r} on the wire")
    shape = tuple(msg.shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    expected = int(np.prod(shape, dtype=np.int64)) * itemsize if shape else itemsize
    if len(msg.data) != expected:
        raise StagemeshError(f"tensor of shape {shape} {msg.dtype} needs {expected} bytes, got {len(msg.data)}")
    if expected == 0:
        return torch.empty(shape, dtype=dtype, device=device)
    raw = torch.frombuffer(bytearray(msg.data), dtype=torch.uint8)
    return raw.view(dtype).reshape(shape).to(device)


def sampling_to_pb(p: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p,
        repetition_penalty=p.repetition_penalty, presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty, max_tokens=p.max_tokens, min_tokens=p.min_tokens,
        stop_token_ids=list(p.stop_token_ids), ignore_eos=p.ignore_eos,
        logprobs=-1 if p.logprobs is None else p.logprobs, allowed_token_ids=list(p.allowed_token_ids),
        bad_words=[common_pb2.TokenSequence(token_ids=w) for w in p.bad_words_token_ids],
    )
    if p.seed is not None:
        msg.seed = p.seed
    if p.prompt_logprobs is not None:
        msg.prompt_logprobs = p.prompt_logprobs
    for token_id, bias in p.logit_bias:
        msg.logit_bias[token_id] = bias
    if p.structured is not None:
        s, out = p.structured, msg.structured_outputs
        if s.kind == "json_object":
            out.json_object = True
        elif s.kind == "choice":
            out.choice.choices.extend(s.choices)
        else:
            setattr(out, s.kind, s.text)
    return msg


def structured_from_pb(msg: common_pb2.StructuredOutputs) -> StructuredOutputs | None:
    kind = msg.WhichOneof("kind")
    if kind is None:
        return None
    if kind == "json_object":
        return StructuredOutputs("json_object") if msg.json_object else None
    if kind == "choice":
        return StructuredOutputs("choice", choices=tuple(msg.choice.choices))
    return StructuredOutputs(kind, getattr(msg, kind))


def sampling_from_pb(msg: common_pb2.SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=msg.temperature,
        top_p=msg.top_p or 1.0,
        top_k=msg.top_k if msg.top_k > 0 else -1,
        min_p=msg.min_p,
        repetition_penalty=msg.repetition_penalty or 1.0,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        seed=msg.seed if msg.HasField("seed") else None,
        max_tokens=msg.max_tokens or 16,
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
