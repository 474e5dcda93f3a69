"""A batch the compiled core read straight from its payload, for the index to file without
making its events. No I/O.

Decoding a plain batch makes an int object per token id and an event object per event, and
the index then cuts the ids into blocks and hashes them: most of what a watcher's subscriber
spends on a batch, and most of a snapshot's bootstrap. `reader` gives the watcher's
subscribers a decoder that hands a plain TokenSpeed-wire batch to the compiled core instead
(`read_plain` in `_compiled.c`): each stored block comes out as the hash of its contents, and
`Filing.apply_read` keys it from there. The core accepts a subset of what `decode_batch`
accepts and reads it the same; whatever it declines (the vLLM wire, optional fields, a
malformed payload) is decoded as always, and so is everything on the pure-Python path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs

from tskv.core import compiled
from tskv.core.codec import decode, decode_batch
from tskv.core.events import KVEvent, KVEventBatch

# A step is one event as the core read it: (STORED, hashes, parent, contents, block_size),
# contents the 8-byte content hashes of its whole blocks; (REMOVED, hashes); (CLEARED,).
STORED, REMOVED, CLEARED = 0, 1, 2
Step = tuple[Any, ...]


@attrs.define
class ReadBatch:
    """A plain batch as the compiled core read it: its steps, one per event, in order. Not
    frozen: a watcher makes one a batch, and a frozen attrs class costs several times as much
    to make."""

    ts: float
    attn_dp_rank: int | None
    steps: list[Step]
    payload: bytes

    @property
    def events(self) -> Sequence[KVEvent]:
        """Its events, decoded from the payload: for what the steps cannot file alone (a
        worker whose view is hybrid, a run not wholly new)."""
        return decode_batch(self.payload).events


def runs_of(steps: list[Step]) -> Iterator[tuple[int, int, list[Step]]]:
    """The steps as filing takes them: each run of consecutive stores together, any other
    step alone; each with the index of its first step and its kind."""
    start = 0
    while start < len(steps):
        kind, end = steps[start][0], start + 1
        while kind == STORED and end < len(steps) and steps[end][0] == STORED:
            end += 1
        yield start, kind, steps[start:end]
        start = end


# What a subscriber decodes a payload with: the batch, and how many of its events are of a
# type tskv does not know (a batch the core read has none: it reads only plain known events)
Reader = Callable[[bytes], "tuple[KVEventBatch | ReadBatch, int]"]


def reader(block_size: int) -> Reader:
    """How a watcher's subscriber decodes the payloads for an index of `block_size`: a
    `ReadBatch` when the compiled core reads it, else `codec.decode` (which raises
    `WireError` for what no dialect holds)."""
    core = compiled.core
    if core is None:
        return decode
    read_plain = core.read_plain

    def read(payload: bytes) -> tuple[KVEventBatch | ReadBatch, int]:
        made = read_plain(payload, block_size)
        if made is None:
            return decode(payload)
        ts, rank, steps = made
        return ReadBatch(ts, rank, steps, payload), 0

    return read
