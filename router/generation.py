"""One generation through a replica: dispatch (with one retry before the first
token), detokenize incrementally, apply stop strings, collect logprobs."""
from __future__ import annotations

import uuid
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import AsyncIterator

import grpc

from router.errors import APIError, bad_request
from router.observe import RequestRecord
from router.openai_protocol import GenerateRequest
from router.replicas import ReplicaSet
from router.submit_stream import RequestFailed
from router.tokenization import IncrementalDetokenizer, StopStrings, Tokenizer
from stagemesh.sampling_params import InvalidParameter
from stagemesh.v1 import scheduler_pb2

REASONS = {scheduler_pb2.FINISH_REASON_STOP: "stop", scheduler_pb2.FINISH_REASON_LENGTH: "length",
           scheduler_pb2.FINISH_REASON_ABORT: "abort"}
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)


@dataclass
class Delta:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # TokenLogprob messages
    finish_reason: str | None = None


@dataclass
class Generation:
    request_id: str
    prompt_ids: list[int]
    completion_tokens: int = 0
    cached_tokens: int = 0
    record: RequestRecord | None = None


async def prompt_ids_for(req: GenerateRequest, tokenizer: Tokenizer) -> list[int]:
    """The request's prompt as token ids (tokenized off the event loop); its token ids checked against the
    vocabulary, the prompt's and the stop token ids'."""
    try:
        req.sampling.check_vocab(tokenizer.vocab_size)
    except InvalidParameter as err:
        raise bad_request(str(err), err.param) from None
    if req.chat:
        tokenizer.check_length(sum(len(m["content"]) for m in req.messages), "messages")
        try:
            return await tokenizer.run(tokenizer.apply_chat_template, req.messages)
        except APIError:
            raise
        except Exception as err:  # a template that rejects the conversation
            raise bad_request(f"the chat template could not render these messages: {err}", "messages") from None
    if req.prompt_ids is not None:
        bad = [t for t in req.prompt_ids if not 0 <= t < tokenizer.vocab_size]
        if bad:
            raise bad_request(f"token id {bad[0]} is outside the vocabulary of {tokenizer.vocab_size}", "prompt")
        return list(req.prompt_ids)
    tokenizer.check_length(len(req.prompt_text), "prompt")
    return await tokenizer.run(tokenizer.encode, req.prompt_text)


def fit_max_tokens(req: GenerateRequest, prompt_len: int, max_model_len: int) -> None:
    """Default max_tokens to the room left (as vLLM); refuse what cannot fit, with the numbers."""
    if not req.max_tokens_given:
        room = max_model_len - prompt_len
        if room < 1:
            raise bad_request(f"This model's maximum context length is {max_model_len} tokens. However, your prompt "
                              f"has {prompt_len} tokens, which leaves no room for a completion.",
                              "messages" if req.chat else "prompt")
        from dataclasses import replace

        req.sampling = replace(req.sampling, max_tokens=room)
        return
    total = prompt_len + req.sampling.max_tokens
    if total > max_model_len:
        raise bad_request(f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                          f"{total} tokens ({prompt_len} in the {'messages' if req.chat else 'prompt'}, "
                          f"{req.sampling.max_tokens} in the completion). Please reduce the length.", "max_tokens")


async def generate(req: GenerateRequest, gen: Generation, replicas: ReplicaSet,
                   tokenizer: Tokenizer) -> AsyncIterator[Delta]:
    """Deltas of text (and ids, logprobs) until the request finishes."""
    detok = IncrementalDetokenizer(tokenizer, req.skip_special_tokens)
    stops = StopStrings(req.stop)
    gen.record = record = RequestRecord(gen.request_id, len(gen.prompt_ids))
    outcome = "abort"  # unless the request finished: the client went away (or the handler was cancelled)
    try:
        # closed as soon as this generator ends, so that a request left unfinished is aborted at once
        async with aclosing(_stream(req, gen, replicas)) as replies:
            async for reply in replies:
                if reply.num_prompt_tokens:
                    gen.cached_tokens = reply.num_cached_tokens
                gen.completion_tokens += len(reply.token_ids)
                record.tokens(len(reply.token_ids))
                text = stops.feed(detok.add(list(reply.token_ids)))
                reason = REASONS.get(reply.finish_reason)
                if stops.stopped is not None:
                    record.done(gen.completion_tokens, "stop")  # before the last delta: callers stop reading there
                    yield Delta(text, list(reply.token_ids), list(reply.logprobs), "stop")
                    return  # the scheduler aborts the request
                if reason is not None:
                    text += stops.flush()
                    record.done(gen.completion_tokens, reason)
                yield Delta(text, list(reply.token_ids), list(reply.logprobs), reason)
                if reason is not None:
                    return
    except APIError as err:
        outcome = "error" if err.status >= 500 else "rejected"
        raise
    finally:
        record.done(gen.completion_tokens, outcome)  # no-op when the request finished above


async def _stream(req: GenerateRequest, gen: Generation, replicas: ReplicaSet):
    if replicas.queue_full():
        raise APIError(429, f"the server is busy: {replicas.num_waiting} requests are already waiting for their "
                            f"first token (--max-waiting-requests {replicas.max_waiting_requests})",
                       code="rate_limit_exceeded", retry_after=1)
    replicas.num_waiting += 1
    waiting = True
    tried: set[str] = set()
    last_error: RequestFailed | None = None
    try:
        while True:
            replica = replicas.pick(gen.prompt_ids, tried)
            if replica is None and last_error is not None:
                raise _api_error(last_error)  # nowhere else to try
            if replica is None:
                reasons = "; ".join(f"{r.address}: {r.reason}" for r in replicas.replicas) or "no replicas configured"
                raise APIError(503, f"no replica can serve this request right now ({reasons})", code="unavailable",
                               retry_after=2)
            tried.add(replica.address)
            if gen.record is not None:
                gen.record.replica = replica.address
            stream = replica.submit(gen.request_id, gen.prompt_ids, req.sampling)
            try:
                async for reply in stream:
                    if waiting:
                        replicas.num_waiting, waiting = replicas.num_waiting - 1, False
                    yield reply
                return
            except RequestFailed as err:
                if err.code == grpc.StatusCode.UNAVAILABLE:
                    replica.mark_failed(f"a request failed there: {err.details}")
                if err.code in RETRYABLE and waiting and len(tried) < 2:
                    last_error = err
                    continue  # failed (or its queue was full) before its first token: once more, elsewhere
                raise _api_error(err) from None
            finally:
                stream.close()  # unfinished (client gone, stop string): the scheduler aborts it
    finally:
        if waiting:
            replicas.num_waiting -= 1


def _api_error(err: RequestFailed) -> APIError:
    code, details = err.code, err.details
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return bad_request(details)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return APIError(429, f"the server is busy: {details}", code="rate_limit_exceeded", retry_after=1)
    if code == grpc.StatusCode.UNAVAILABLE:
        return APIError(503, f"the replica failed: {details}", code="unavailable", retry_after=2)
    return APIError(500, f"{code.name}: {details}", code="internal_error")


def new_request_id(chat: bool) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
