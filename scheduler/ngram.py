"""Prompt lookup (vLLM's ngram method): draft tokens copied from the request's own tokens.

The longest suffix of the tokens, between prompt_lookup_min and prompt_lookup_max tokens long, that
occurs earlier in them; the tokens that followed its earliest occurrence are the drafts (vLLM's rule).
The search runs in C: the tokens as 4-byte words, found with bytes.find (a hit at an offset that is
not a multiple of 4 straddles two tokens and is skipped).
"""
from __future__ import annotations

from array import array


class NgramProposer:
    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k drafts to follow `tokens` (fewer where the match is near the end; none without one)."""
        total = len(tokens)
        if k <= 0 or total <= self.min_n:
            return []
        data = array("i", tokens).tobytes()
        end = (total - 1) * 4  # a match must leave a token after it, so never the suffix itself
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            at = _find_aligned(data, data[(total - n) * 4:], end)
            if at >= 0:
                start = at + n
                return tokens[start:start + k]
        return []


def _find_aligned(data: bytes, needle: bytes, end: int) -> int:
    """The first token index where `needle` occurs in data[:end], or -1."""
    at = data.find(needle, 0, end)
    while at >= 0 and at % 4:
        at = data.find(needle, at + 1, end)
    return at // 4 if at >= 0 else -1
