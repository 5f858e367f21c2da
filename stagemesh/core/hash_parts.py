"""Block hashes per KV tier, cut into parts small enough for one gRPC message each: a replica's snapshot
(Scheduler.GetKVSnapshot) and a router's index of it (RouterControl.GetKVIndex) can hold millions of blocks,
past gRPC's 4 MiB default for one message, so both are streamed in these parts and joined by the caller."""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

# a hash is a varint of at most 10 bytes: 200,000 of them stay under 2 MiB, half gRPC's default limit
MAX_HASHES_PER_PART = 200_000


def tier_parts(tiers: Sequence[tuple[str, Sequence[int]]], limit: int = MAX_HASHES_PER_PART
               ) -> Iterator[list[tuple[str, Sequence[int]]]]:
    """Each part: (medium, hashes) slices of the tiers in order, at most `limit` hashes in all; one part (maybe
    empty) at least."""
    part: list[tuple[str, Sequence[int]]] = []
    room = limit
    for medium, hashes in tiers:
        start = 0
        while True:
            take = hashes[start:start + room]
            if take or not hashes:
                part.append((medium, take))
            start += len(take)
            room -= len(take)
            if start >= len(hashes):
                break
            yield part
            part, room = [], limit
    yield part



def joined_tiers(messages: Iterable) -> tuple[list, dict[str, list[int]]]:
    """A caller's side: the parts of a streamed snapshot (messages with `tiers` of `medium` and `block_hashes`,
    and `more`), read to the last; (the messages, medium -> its hashes in order)."""
    parts: list = []
    joined: dict[str, list[int]] = {}
    for message in messages:
        parts.append(message)
        for tier in message.tiers:
            joined.setdefault(tier.medium, []).extend(tier.block_hashes)
        if not message.more:
            break
    return parts, joined
