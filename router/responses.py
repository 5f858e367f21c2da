"""OpenAI response bodies, whole or streamed, in vLLM's shapes: choices (prompt x n), usage, logprobs,
prompt logprobs, echo, stop_reason, token ids."""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

from router.dispatch import Generation
from router.generation import Delta
from router.harmony import HarmonySplit
from router.reasoning import Splitter
from router.request import GenerateRequest
from router.tools import HarmonyParser, read_calls
from router.tokenization import Tokenizer
from stagemesh.core.step import TokenLogprob


# json.dumps(obj, ensure_ascii=False) builds an encoder a call; a chunk a token reuses one (the same text)
_encode = json.JSONEncoder(ensure_ascii=False).encode


def sse(obj: dict, event_id: str | None = None) -> bytes:
    return _event(_encode(obj), event_id)


def sse_done(event_id: str | None = None) -> bytes:
    """The stream's end (OpenAI's `data: [DONE]`)."""
    return _event("[DONE]", event_id)


def _event(data: str, event_id: str | None) -> bytes:
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}data: {data}\n\n".encode()


def token_logprobs(entries: list[TokenLogprob], token_text) -> list[dict]:
    """OpenAI's per-token logprobs (chat's logprobs.content, the Responses API's output_text.logprobs):
    token, logprob, bytes and the top alternatives."""
    def item(token_id: int, logprob: float) -> dict:
        text = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in zip(e.top_token_ids,
                                                                                          e.top_logprobs)]}
            for e in entries]


@dataclass
class Choice:
    """What one choice has said so far, to build its whole answer or its next chunk."""
    gen: Generation
    echo: str = ""  # text sent before the generated text (completions echo, chat's continued message)
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    offset: int = 0  # characters of this choice's text already covered by logprobs' text_offset
    opened: bool = False  # a stream has sent its first chunk
    sent: int = 0  # characters of content a stream has sent (tool calls: content may be held back)
    prompt_ids_due: bool = False  # a completions stream still owes this choice's prompt_token_ids
    split: Splitter | None = None  # under --reasoning-parser: the text's thinking split off as it comes
    content: str = ""  # the answer: the text less its reasoning (all of it without a reasoning parser)
    reasoning_tokens: int = 0  # generated while the answer thought (its reasoning and the tag that ends it)

    def add(self, d: Delta) -> tuple[str, str]:
        """Take a delta; return the (reasoning, content) text it adds (the reasoning "" without a parser)."""
        self.text += d.text
        self.token_ids += d.token_ids
        self.logprobs += d.logprobs
        self.prompt_logprobs += d.prompt_logprobs
        self.finish_reason = d.finish_reason or self.finish_reason
        self.stop_reason = d.stop_reason if d.stop_reason is not None else self.stop_reason
        if self.split is None:
            self.content += d.text
            return "", d.text
        thinking = self.split.thinking()
        if isinstance(self.split, HarmonySplit):  # (cut short, a call still open is none: router.harmony)
            cut = d.finish_reason == "length" or isinstance(d.stop_reason, str)
            reasoning, content = self.split.feed(d.text, bool(d.finish_reason), cut)
        else:
            reasoning, content = self.split.feed(d.text, bool(d.finish_reason))
        self.reasoning_tokens += len(d.token_ids) if thinking and self.split.opened else 0
        self.content += content
        return reasoning, content

    def reasoning(self, include: bool = True) -> dict:
        """The message's reasoning fields under a reasoning parser (vLLM's `reasoning` and its older name), None
        when the answer did not think or include_reasoning is false; {} without a parser."""
        if self.split is None:
            return {}
        text = self.split.result()[0] if include else None
        return {"reasoning": text, "reasoning_content": text}


class Answer:
    """The response of one request: its choices, usage, and how each piece is written."""

    def __init__(self, req: GenerateRequest, request_id: str, created: int, gens: list[Generation],
                 tokenizer: Tokenizer, echo_texts: list[str]):
        self.req, self.id, self.created, self.tokenizer = req, request_id, created, tokenizer
        self.choices = [Choice(g, echo_texts[g.index // req.n] if req.echo else "",
                               split=req.reasoning.splitter() if req.reasoning else None) for g in gens]
        self.by_gen = {id(c.gen): c for c in self.choices}
        self.firsts: dict[int, Choice] = {}  # each prompt's first choice: the one that has its prompt logprobs
        for c in self.choices:
            self.firsts.setdefault(c.gen.index // req.n, c)

    # -- whole answers ---------------------------------------------------------------
    def add(self, gen: Generation, d: Delta) -> Choice:
        choice = self.by_gen[id(gen)]
        choice.add(d)
        return choice

    def body(self) -> dict:
        req = self.req
        out = {**self._head(chunk=False), "choices": [self._choice(c) for c in self.choices], "usage": self.usage()}
        if req.chat and req.sampling.prompt_logprobs is not None:
            out["prompt_logprobs"] = self._prompt_logprobs(self.firsts[0])
        if req.chat and req.return_token_ids:
            out["prompt_token_ids"] = self.choices[0].gen.prompt_ids
        return out

    def _calls(self, c: Choice) -> tuple[str | None, list] | None:
        harmony = c.split if isinstance(c.split, HarmonySplit) else None
        return read_calls(self.req.tool_plan, c.content, c.finish_reason, harmony)

    def _finish_reason(self, c: Choice, made: tuple | None) -> str | None:
        # OpenAI's: "tool_calls" when the model chose to call (required, auto); a named call ends with "stop"
        plan = self.req.tool_plan
        return "tool_calls" if made and made[1] and plan is not None and plan.mode != "named" else c.finish_reason

    def _choice(self, c: Choice) -> dict:
        req = self.req
        made = self._calls(c) if req.chat else None
        choice: dict[str, object]
        choice = {"index": c.gen.index, "finish_reason": self._finish_reason(c, made), "stop_reason": c.stop_reason}
        thought = c.reasoning(bool(req.reasoning and req.reasoning.include))
        if made:  # (a forced call cut short: no content and no calls)
            choice["message"] = {"role": "assistant", "content": made[0], **thought,
                                 **({"tool_calls": [t.to_dict() for t in made[1]]} if made[1] else {})}
            choice["logprobs"] = self._chat_logprobs(c.logprobs) if req.logprobs else None
        elif req.chat:
            content = c.echo + c.content
            choice["message"] = {"role": "assistant", "content": (content or None) if thought else content, **thought}
            choice["logprobs"] = self._chat_logprobs(c.logprobs) if req.logprobs else None
        else:
            choice["text"] = c.echo + c.text
            choice["logprobs"] = self._completion_logprobs(c, c.token_ids, c.logprobs, echo=True) \
                if req.logprobs else None
            if req.sampling.prompt_logprobs is not None:
                choice["prompt_logprobs"] = self._prompt_logprobs(self.firsts[c.gen.index // req.n])
        if req.return_token_ids:
            choice["token_ids"] = c.token_ids
            if not req.chat:
                choice["prompt_token_ids"] = c.gen.prompt_ids
        return choice

    def usage(self) -> dict:
        prompts = [c.gen for c in self.firsts.values()]
        prompt = sum(len(g.prompt_ids) for g in prompts)
        completion = sum(c.gen.completion_tokens for c in self.choices)
        out: dict[str, object]
        out = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
        # the prompt's cached tokens, once per prompt as its tokens are (a sibling choice finds the prompt its
        # first choice computed in the cache: counting it again would pass prompt_tokens)
        cached = sum(g.cached_tokens for g in prompts)
        if cached:
            out["prompt_tokens_details"] = {"cached_tokens": cached}
        if self.req.reasoning is not None:  # (vLLM's, with a reasoning parser)
            out["completion_tokens_details"] = {"reasoning_tokens": sum(c.reasoning_tokens for c in self.choices)}
        return out

    # -- streamed answers ------------------------------------------------------------------
    def chunks(self, gen: Generation, d: Delta) -> list[dict]:
        """The stream chunks for a delta of one choice (its opening chunk first, the first time)."""
        c = self.by_gen[id(gen)]
        if not d.token_ids and not d.finish_reason and not d.text:  # prompt logprobs only: kept for the echo
            c.prompt_logprobs += d.prompt_logprobs
            return []
        c.prompt_logprobs += d.prompt_logprobs
        d.prompt_logprobs = []
        out = []
        if not c.opened:
            c.opened = True
            out += self._opening(c)
        logprobs = None
        if self.req.logprobs:
            logprobs = self._chat_logprobs(d.logprobs) if self.req.chat else \
                self._completion_logprobs(c, d.token_ids, d.logprobs, echo=False)
        reasoning, text = c.add(d)
        plan = self.req.tool_plan
        harmony = c.split if self.req.chat and plan is not None and plan.mode == "auto" \
            and isinstance(plan.parser, HarmonyParser) and isinstance(c.split, HarmonySplit) else None
        carrier: Delta | None = d  # the chunk that carries this delta's token ids (the first one sent)
        if self.req.chat and reasoning and self.req.reasoning is not None and self.req.reasoning.include:
            out.append(self._chunk({"index": c.gen.index, "delta": {"reasoning": reasoning, "reasoning_content":
                                    reasoning}, "logprobs": logprobs, "finish_reason": None}, d, c))
            logprobs, carrier = None, None
            if not text and not d.finish_reason and not (harmony and harmony.call_deltas):
                return out
        if harmony is not None:
            return out + self._harmony_chunks(c, harmony, d, text, logprobs, carrier)
        if self.req.chat and plan is not None and plan.mode != "none":
            return out + self._tool_chunks(c, d, logprobs, carrier)
        if self.req.chat:
            delta = {"content": text} if text or not d.finish_reason else {}
            out.append(self._chunk({"index": c.gen.index, "delta": delta, "logprobs": logprobs,
                                    "finish_reason": d.finish_reason, "stop_reason": d.stop_reason}, carrier, c))
        else:
            choice = {"index": c.gen.index, "text": d.text, "logprobs": logprobs, "finish_reason": d.finish_reason,
                      "stop_reason": d.stop_reason}
            if c.prompt_ids_due:
                choice["prompt_token_ids"], c.prompt_ids_due = c.gen.prompt_ids, False
            out.append(self._chunk(choice, d, c))
        return out

    def _harmony_chunks(self, c: Choice, harmony: HarmonySplit, d: Delta, text: str, logprobs,
                        carrier: Delta | None) -> list[dict]:
        """gpt-oss's calls (the openai parser) stream as vLLM streams them: a call's id, type and name as soon as
        its message's header is read (arguments ""), then its arguments as they come, beside the final channel's
        content; the finish is "tool_calls" once a call was made. A delta that adds nothing to show (a header's
        tokens) goes out empty only when the client asked for its tokens' logprobs or ids."""
        delta: dict[str, object] = {"content": text} if text else {}
        plan = self.req.tool_plan
        calls = [t for t in harmony.take_call_deltas() if plan is None or plan.parallel or t["index"] == 0]
        if calls:
            delta["tool_calls"] = calls
        finish = d.finish_reason
        if finish is not None and harmony.made_calls():
            finish = "tool_calls"
        if not delta and finish is None and not (carrier is not None and d.token_ids
                                                 and (self.req.logprobs or self.req.return_token_ids)):
            return []
        return [self._chunk({"index": c.gen.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish,
                             "stop_reason": d.stop_reason}, carrier, c)]

    def _tool_chunks(self, c: Choice, d: Delta, logprobs, carrier: Delta | None) -> list[dict]:
        """Calls stream as OpenAI's tool-call deltas: each whole call (id, name, arguments) in one delta once the
        output is complete, then the finish. Under "auto" the text before a call streams as content as it comes
        (held back only where a call may begin); under required / named there is none. The tokens of held text
        go out as empty deltas only when the client asked for their logprobs or ids."""
        plan, out = self.req.tool_plan, []
        assert plan is not None  # (the chunks of a request with tools)
        if plan.mode == "auto" and not d.finish_reason:
            assert plan.parser is not None and not isinstance(plan.parser, HarmonyParser)  # (its own: above)
            safe = plan.parser.may_start(c.content)
            if safe > c.sent:
                out.append(self._chunk({"index": c.gen.index, "delta": {"content": c.content[c.sent:safe]},
                                        "logprobs": logprobs, "finish_reason": None}, carrier, c))
                c.sent = safe
                return out
        if carrier is not None and (self.req.logprobs or self.req.return_token_ids) \
                and (d.token_ids or not d.finish_reason):
            out.append(self._chunk({"index": c.gen.index, "delta": {}, "logprobs": logprobs, "finish_reason": None},
                                   d, c))
        if not d.finish_reason:
            return out
        made = self._calls(c)
        delta: dict[str, object]
        if made:
            content, calls = made
            delta = {"tool_calls": [t.to_dict(i) for i, t in enumerate(calls)]} if calls else {}
            if content and len(content) > c.sent:
                delta["content"] = content[c.sent:]
        else:
            delta = {"content": c.content[c.sent:]}
        if delta:  # (nothing for a forced call cut short: the finish says so)
            out.append(self._chunk({"index": c.gen.index, "delta": delta, "logprobs": None, "finish_reason": None},
                                   None, c))
        out.append(self._chunk({"index": c.gen.index, "delta": {}, "logprobs": None,
                                "finish_reason": self._finish_reason(c, made), "stop_reason": d.stop_reason}, None, c))
        return out

    def _opening(self, c: Choice) -> list[dict]:
        """A choice's first chunk(s): chat's role, the echo; with return_token_ids the prompt's ids ride on
        the first chunk, as vLLM documents (chat: on the chunk; completions: on its choice)."""
        req = self.req
        if req.chat:
            chunk = self._chunk({"index": c.gen.index, "delta": {"role": "assistant", "content": c.echo},
                                 "logprobs": None, "finish_reason": None}, None, c)
            if req.return_token_ids:
                chunk["prompt_token_ids"] = c.gen.prompt_ids
            return [chunk]
        if not c.echo:
            c.prompt_ids_due = req.return_token_ids
            return []
        logprobs = self._completion_logprobs(c, [], [], echo=True) if req.logprobs else None
        choice = {"index": c.gen.index, "text": c.echo, "logprobs": logprobs, "finish_reason": None}
        if req.return_token_ids:
            choice["prompt_token_ids"] = c.gen.prompt_ids
        return [self._chunk(choice, None, c)]

    def _chunk(self, choice: dict, d: Delta | None, c: Choice) -> dict:
        req = self.req
        if req.return_token_ids:
            choice["token_ids"] = list(d.token_ids) if d is not None else []
        body = {**self._head(chunk=True), "choices": [choice]}
        if req.include_usage:
            body["usage"] = self.usage() if req.continuous_usage else None
        return body

    def usage_chunk(self) -> dict:
        return {**self._head(chunk=True), "choices": [], "usage": self.usage()}

    def _head(self, chunk: bool) -> dict:
        kind = ("chat.completion" if self.req.chat else "text_completion") + (".chunk" if chunk and self.req.chat
                                                                              else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.req.model}

    # -- logprobs ---------------------------------------------------------------------------
    def _token(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self.req.return_tokens_as_token_ids else self.tokenizer.token_text(token_id)

    def _chat_logprobs(self, entries: list[TokenLogprob]) -> dict:
        return {"content": token_logprobs(entries, self._token)}

    def _completion_logprobs(self, c: Choice, token_ids: list[int], entries: Sequence[TokenLogprob | None], echo: bool
                             ) -> dict:
        """tokens / token_logprobs / top_logprobs / text_offset; with echo the prompt's tokens first (the very
        first with no logprob), offsets counted over the choice's whole text."""
        tokens: list[str]
        values: list[float | None]
        tops: list[dict | None]
        offsets: list[int]
        tokens, values, tops, offsets = [], [], [], []
        if echo and c.echo:
            scored = self.firsts[c.gen.index // self.req.n].prompt_logprobs
            for i, token_id in enumerate(c.gen.prompt_ids):
                e = scored[i - 1] if 0 < i <= len(scored) else None
                self._one(tokens, values, tops, offsets, c, token_id, e)
        for token_id, e in zip(token_ids, entries or [None] * len(token_ids)):
            self._one(tokens, values, tops, offsets, c, token_id, e)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    def _one(self, tokens, values, tops, offsets, c: Choice, token_id: int, e: TokenLogprob | None) -> None:
        text = self._token(token_id)
        tokens.append(text)
        offsets.append(c.offset)
        c.offset += len(self.tokenizer.token_text(token_id))
        values.append(e.logprob if e is not None else None)
        if e is None:
            tops.append(None)
            return
        top = {self._token(t): lp for t, lp in zip(e.top_token_ids, e.top_logprobs)}
        top.setdefault(text, e.logprob)  # the token itself, as vLLM adds it (up to N + 1 entries)
        tops.append(top)

    def _prompt_logprobs(self, first: Choice) -> list:
        """vLLM's prompt_logprobs: None for the first prompt token, then {token id: {logprob, rank,
        decoded_token}} with the token itself and the top N."""
        out: list[dict | None] = [None]
        for e in first.prompt_logprobs:
            entry = {str(t): {"logprob": lp, "rank": rank, "decoded_token": self._token(t)}
                     for rank, (t, lp) in enumerate(zip(e.top_token_ids, e.top_logprobs), start=1)}
            entry[str(e.token_id)] = {"logprob": e.logprob, "rank": e.rank, "decoded_token": self._token(e.token_id)}
            out.append(entry)
        return out
