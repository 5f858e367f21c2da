"""A request's prompts as token ids: the chat template rendered, texts tokenized (off the event loop),
prompts truncated as asked, bad words tokenized, every token id checked against the vocabulary."""
from __future__ import annotations

from dataclasses import replace

from router.errors import APIError, bad_request
from router.request import ChatOptions, GenerateRequest
from router.tokenization import Tokenizer
from stagemesh.core.sampling_params import MAX_NUM_BAD_WORDS, InvalidParameter, too_many_bad_words


async def prepare(req: GenerateRequest, tokenizer: Tokenizer, max_model_len: int) -> list[list[int]]:
    """Token ids of each prompt (a chat's one rendered prompt); sets req.sampling's bad words."""
    try:
        req.sampling.check_vocab(tokenizer.vocab_size)
    except InvalidParameter as err:
        raise bad_request(str(err), err.param) from None
    if req.sampling.structured is not None:  # a constraint that cannot compile is the client's 400, with why
        try:
            structured = tokenizer.grammars.resolve(req.sampling.structured)
            await tokenizer.grammars.check(structured)
            req.sampling = replace(req.sampling, structured=structured)
        except InvalidParameter as err:
            raise bad_request(str(err).replace("structured_outputs", req.structured_param), req.structured_param) \
                from None
    if req.bad_words:
        await _ban_words(req, tokenizer)
    if req.chat:
        assert req.chat_options is not None  # (the request builder sets them for a chat)
        prompts = [await render(req.chat_options, tokenizer, req.add_special_tokens)]
    else:
        prompts = [await _completion_prompt(p, tokenizer, req.add_special_tokens) for p in req.prompts]
    if any(not ids for ids in prompts):  # (a text of whitespace a tokenizer drops): vLLM's 400
        raise bad_request("The decoder prompt cannot be empty (it has no tokens)", "messages" if req.chat else "prompt")
    return [truncate(req, ids, max_model_len) for ids in prompts]


async def _ban_words(req: GenerateRequest, tokenizer: Tokenizer) -> None:
    """req.sampling's bad words as token sequences, bounded as vLLM bounds them (MAX_NUM_BAD_WORDS sequences),
    the bound checked before any word is tokenized where the count alone breaks it."""
    words = [w for w in req.bad_words if w.strip()]
    try:
        if len(words) > MAX_NUM_BAD_WORDS:  # each word is one sequence at least
            raise InvalidParameter("bad_words", too_many_bad_words(len(words)))
        tokenizer.check_length(sum(map(len, words)), "bad_words")
        ids = await tokenizer.run(bad_words_token_ids, tokenizer, words)
        req.sampling = replace(req.sampling, bad_words_token_ids=ids)
    except InvalidParameter as err:  # too many, too many tokens, outside the vocabulary
        raise bad_request(str(err), "bad_words") from None


async def render(options: ChatOptions, tokenizer: Tokenizer, add_special_tokens: bool = False) -> list[int]:
    """A conversation through the chat template (the request's own, if it gives one), as token ids. The
    messages' length is checked before the render, the rendered text's (by the render itself, which stops
    past it) before it is tokenized."""
    tokenizer.check_length(sum(len(m["content"] or "") for m in options.messages), "messages")
    try:
        text = await tokenizer.render_chat(options)
    except APIError:
        raise
    except Exception as err:  # a template that rejects the conversation (raise_exception), or breaks
        raise bad_request(f"the chat template could not render these messages: {type(err).__name__}: {err}",
                          "messages") from None
    return await tokenizer.run(tokenizer.encode, text, add_special_tokens)


async def _completion_prompt(prompt, tokenizer: Tokenizer, add_special_tokens: bool) -> list[int]:
    if prompt.token_ids is not None:
        bad = [t for t in prompt.token_ids if not 0 <= t < tokenizer.vocab_size]
        if bad:
            raise bad_request(f"token id {bad[0]} is outside the vocabulary of {tokenizer.vocab_size}", "prompt")
        return list(prompt.token_ids)
    tokenizer.check_length(len(prompt.text), "prompt")
    return await tokenizer.run(tokenizer.encode, prompt.text, add_special_tokens)


def truncate(req: GenerateRequest, ids: list[int], max_model_len: int) -> list[int]:
    """truncate_prompt_tokens: the last k tokens (truncation_side "left", the default) or the first k."""
    k = req.truncate_prompt_tokens
    if k is None:
        return ids
    k = max_model_len if k == -1 else k
    if k > max_model_len:
        raise bad_request(f"'truncate_prompt_tokens' {k} is more than the model's maximum context length "
                          f"{max_model_len}", "truncate_prompt_tokens")
    return ids[-k:] if req.truncation_side == "left" else ids[:k]


def bad_words_token_ids(tokenizer: Tokenizer, words: list[str]) -> tuple[tuple[int, ...], ...]:
    """Each bad word as tokens, as it would start a text and, where that tokenizes differently, as it
    would follow a space (vLLM bans both)."""
    out = []
    for word in words:
        word = word.lstrip()
        if not word:
            continue
        alone = tuple(tokenizer.encode(word, add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word, add_special_tokens=False))
        out += [ids for ids in dict.fromkeys((alone, spaced)) if ids]
        if len(out) > MAX_NUM_BAD_WORDS:  # no need to tokenize the rest
            raise InvalidParameter("bad_words", too_many_bad_words(len(out)))
    return tuple(out)
