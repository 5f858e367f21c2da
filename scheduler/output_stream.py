"""A request's outputs on their way to its gRPC stream.

The step loop puts outputs without waiting; the stream takes them as fast as
its caller reads. Outputs that piled up behind a slow reader are merged into
one (a SubmitResponse carries any number of tokens), so a reader that falls
behind costs one stream write per read rather than one per token.
"""
from __future__ import annotations

import asyncio
from collections import deque

from scheduler.request import RequestOutput


class OutputStream:
    def __init__(self) -> None:
        self._pending: deque[RequestOutput] = deque()
        self._ready = asyncio.Event()

    def put(self, out: RequestOutput) -> None:
        self._pending.append(out)
        self._ready.set()

    async def get(self) -> RequestOutput:
        """The next output: everything pending merged, except that an error comes on its own (its tokens
        before it are still delivered)."""
        await self._ready.wait()
        out = self._pending.popleft()
        while self._pending and not out.finished and self._pending[0].finish_reason != "error":
            out = merged(out, self._pending.popleft())
        if not self._pending:
            self._ready.clear()
        return out


def merged(first: RequestOutput, later: RequestOutput) -> RequestOutput:
    """One output with the tokens of both; the prompt figures of the first, the finish of the later."""
    return RequestOutput(first.request_id, first.new_token_ids + later.new_token_ids,
                         first.new_logprobs + later.new_logprobs, later.finish_reason, later.stop_token_id,
                         later.error, later.own_fault, first.num_prompt_tokens, first.num_cached_tokens,
                         first.prompt_logprobs + later.prompt_logprobs,
                         first.prompt_logprobs_start if first.prompt_logprobs else later.prompt_logprobs_start,
                         first.queue_seconds if first.queue_seconds is not None else later.queue_seconds,
                         later.held_kv, later.kv_load_failed, later.pooled or first.pooled)
