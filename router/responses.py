"""OpenAI response bodies: whole answers, stream chunks, usage, logprobs."""
from __future__ import annotations

import json

from router.generation import Delta, Generation
from router.openai_protocol import GenerateRequest
from router.tokenization import Tokenizer


def sse(obj: dict) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()


def usage(gen: Generation) -> dict:
    out = {"prompt_tokens": len(gen.prompt_ids), "completion_tokens": gen.completion_tokens,
           "total_tokens": len(gen.prompt_ids) + gen.completion_tokens}
    if gen.cached_tokens:
        out["prompt_tokens_details"] = {"cached_tokens": gen.cached_tokens}
    return out


def _head(req: GenerateRequest, gen: Generation, created: int, chunk: bool) -> dict:
    kind = ("chat.completion" if req.chat else "text_completion") + (".chunk" if chunk and req.chat else "")
    return {"id": gen.request_id, "object": kind, "created": created, "model": req.model}


def _chat_logprobs(entries, tokenizer: Tokenizer) -> dict:
    def item(token_id: int, logprob: float) -> dict:
        text = tokenizer.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [{**item(e.token_id, e.logprob),
                         "top_logprobs": [item(t, lp) for t, lp in zip(e.top_token_ids, e.top_logprobs)]}
                        for e in entries]}


def _completion_logprobs(entries, tokenizer: Tokenizer, offset: int) -> dict:
    tokens, offsets = [], []
    for e in entries:
        tokens.append(tokenizer.token_text(e.token_id))
        offsets.append(offset)
        offset += len(tokens[-1])
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{tokenizer.token_text(t): lp for t, lp in zip(e.top_token_ids, e.top_logprobs)}
                             for e in entries],
            "text_offset": offsets}


def _logprobs(req, entries, tokenizer, offset=0):
    if not req.logprobs:
        return None
    return _chat_logprobs(entries, tokenizer) if req.chat else _completion_logprobs(entries, tokenizer, offset)


async def collect(req: GenerateRequest, gen: Generation, deltas, created: int, tokenizer: Tokenizer) -> dict:
    text, ids, entries, reason = "", [], [], None
    async for d in deltas:
        text, reason = text + d.text, d.finish_reason or reason
        ids.extend(d.token_ids)
        entries.extend(d.logprobs)
    if req.echo and not req.chat:
        text = (req.prompt_text or tokenizer.decode(gen.prompt_ids)) + text
    choice = {"index": 0, "finish_reason": reason, "logprobs": _logprobs(req, entries, tokenizer)}
    if req.chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    if req.return_token_ids:
        choice["token_ids"] = ids
    return {**_head(req, gen, created, chunk=False), "choices": [choice], "usage": usage(gen)}


def stream_head(req: GenerateRequest, gen: Generation, created: int) -> list[dict]:
    if not req.chat:
        return []
    return [{**_head(req, gen, created, True),
             "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}]


def stream_chunk(req: GenerateRequest, gen: Generation, created: int, d: Delta, tokenizer: Tokenizer) -> dict:
    choice = {"index": 0, "finish_reason": d.finish_reason, "logprobs": _logprobs(req, d.logprobs, tokenizer)}
    if req.chat:
        choice["delta"] = {"content": d.text} if d.text or not d.finish_reason else {}
    else:
        choice["text"] = d.text
    if req.return_token_ids:
        choice["token_ids"] = d.token_ids
    body = {**_head(req, gen, created, True), "choices": [choice]}
    if req.include_usage:
        body["usage"] = None
    return body


def usage_chunk(req: GenerateRequest, gen: Generation, created: int) -> dict:
    return {**_head(req, gen, created, True), "choices": [], "usage": usage(gen)}
