"""One sequence's generation: its replies from the replicas (router.dispatch, which also keeps it going when
its replica fails) made into deltas of text: detokenized incrementally, cut at stop strings, with their logprobs
and prompt logprobs."""
from __future__ import annotations

from contextlib import aclosing
from dataclasses import dataclass, field, replace
from typing import AsyncGenerator

from router.dispatch import Generation, dispatch
from router.errors import APIError
from router.observe import RequestRecord
from router.replica_set import ReplicaSet
from router.request import GenerateRequest
from router.submit_stream import ReplicaOutput
from router.tokenization import IncrementalDetokenizer, StopStrings, Tokenizer
from stagemesh.core.step import TokenLogprob

@dataclass
class Delta:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop string, or a stop token id other than EOS
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # of prompt tokens start, start + 1, ...
    prompt_logprobs_start: int = 0


async def generate(req: GenerateRequest, gen: Generation, replicas: ReplicaSet,
                   tokenizer: Tokenizer) -> AsyncGenerator[Delta, None]:
    """Deltas of text (and ids, logprobs) until the request finishes."""
    detok = IncrementalDetokenizer(tokenizer, req.skip_special_tokens, req.spaces_between_special_tokens,
                                   list(gen.prompt_ids))
    stops = StopStrings(req.stop, req.include_stop_str_in_output)
    eos = replicas.eos_token_ids
    gen.record = record = RequestRecord(gen.request_id, len(gen.prompt_ids), gen.sampling.max_tokens,
                                        gen.request.tenant)
    outcome = "abort"  # unless the request finished: the client went away (or the handler was cancelled)
    try:
        # closed as soon as this generator ends, so that a request left unfinished is aborted at once
        replies_of = dispatch(gen, replicas)
        if req.stream_interval > 1:
            replies_of = every(replies_of, req.stream_interval)
        async with aclosing(replies_of) as replies:
            async for reply in replies:
                if reply.token_ids or reply.finish_reason:  # the prompt is computed: siblings may follow
                    gen.started.set()
                delta = _delta(reply, req, gen, record, replicas)
                if not req.echo_only:
                    delta.text = _text(delta, detok, stops)
                    gen.completion_tokens += len(delta.token_ids)
                if stops.stopped is not None:
                    delta.finish_reason, delta.stop_reason = "stop", stops.stopped
                    record.done(gen.completion_tokens, "stop")  # before the last delta: callers stop reading there
                    yield delta
                    return  # the scheduler aborts the request
                if delta.finish_reason is not None:
                    delta.text += stops.flush()
                    if reply.stop_token_id is not None and reply.stop_token_id not in eos:
                        delta.stop_reason = reply.stop_token_id
                    record.done(gen.completion_tokens, delta.finish_reason)
                yield delta
                if delta.finish_reason is not None:
                    return
    except APIError as err:
        outcome = "error" if err.status >= 500 else "rejected"
        raise
    finally:
        gen.started.set()
        record.done(gen.completion_tokens, outcome)  # no-op when the request finished above


async def every(replies: AsyncGenerator[ReplicaOutput, None], interval: int) -> AsyncGenerator[ReplicaOutput, None]:
    """vLLM's --stream-interval: the replies gathered into one every `interval` tokens; the first goes out at once
    (the time to first token stays), the last with its finish. Tokens gathered when the request fails go out
    before the failure."""
    held: ReplicaOutput | None = None
    sent = False
    async with aclosing(replies):
        try:
            async for reply in replies:
                held = reply if held is None else _merged(held, reply)
                if not sent or reply.finish_reason or len(held.token_ids) >= interval:
                    sent, out, held = sent or bool(held.token_ids), held, None
                    yield out
        except APIError:
            if held is not None:
                yield held
            raise


def _merged(first: ReplicaOutput, later: ReplicaOutput) -> ReplicaOutput:
    """One output with both one's tokens and logprobs: the prompt figures of the first, the finish of the later."""
    return replace(first, token_ids=first.token_ids + later.token_ids, logprobs=first.logprobs + later.logprobs,
                   finish_reason=later.finish_reason, stop_token_id=later.stop_token_id,
                   prompt_logprobs=first.prompt_logprobs + later.prompt_logprobs,
                   prompt_logprobs_start=first.prompt_logprobs_start if first.prompt_logprobs
                   else later.prompt_logprobs_start,
                   queue_seconds=first.queue_seconds or later.queue_seconds, kv_transfer=later.kv_transfer)


def _text(delta: Delta, detok: IncrementalDetokenizer, stops: StopStrings) -> str:
    """The delta's text after the stop strings. A reply of several tokens (a resumed stream's backlog, accepted
    drafts) is read token by token when there are stop strings: the tokens after the one that completed a stop
    string are dropped with their logprobs, so that the stream ends where it would have ended token by token."""
    if len(delta.token_ids) < 2 or not stops.stops:
        return stops.feed(detok.add(delta.token_ids))
    text = ""
    for i, token in enumerate(delta.token_ids):
        text += stops.feed(detok.add([token]))
        if stops.stopped is not None:
            delta.token_ids, delta.logprobs = delta.token_ids[:i + 1], delta.logprobs[:i + 1]
            break
    return text


def _delta(reply: ReplicaOutput, req: GenerateRequest, gen: Generation, record: RequestRecord,
           replicas: ReplicaSet) -> Delta:
    """A reply's tokens, logprobs and prompt logprobs; the timing figures it carries go to the record."""
    if reply.num_prompt_tokens and not gen.replays:  # (a continuation's cached tokens are not the prompt's)
        gen.cached_tokens = reply.num_cached_tokens
    if reply.queue_seconds:
        record.queued(reply.queue_seconds)
    echo_only = req.echo_only
    record.tokens(0 if echo_only else len(reply.token_ids))
    reason = reply.finish_reason
    if echo_only and reason is not None:
        reason = "length"  # the one token generated to score the prompt is not part of the answer
    return Delta("", [] if echo_only else reply.token_ids, [] if echo_only else reply.logprobs, reason,
                 prompt_logprobs=reply.prompt_logprobs, prompt_logprobs_start=reply.prompt_logprobs_start)
