"""The cache a publisher's stream describes, and the snapshot that restores it: no I/O.

`CacheState` follows every batch the publisher sends: for each cached block, the encoded
payload of the batch that stored it (which the replay buffer holds anyway). A block costs one
dict entry from an int to a bytes object, so the garbage collector never walks the state, the
events themselves are not kept, and a scheduler may reuse its lists. `SnapshotBuilder` turns a
frozen copy of that state into batches that clear and then store every cached block, parents
before children, decoding each payload again only when a snapshot needs it, a bounded amount
of work per batch so the replay task that sends them never holds up live batches.
docs/wire.md#snapshots specifies what goes on the wire.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from itertools import chain, groupby
from operator import attrgetter, itemgetter
from typing import Any

from tskv.core.codec import DroppedFields, decode_batch, encode_round
from tskv.core.events import (
    EVENT_TYPES,
    PER_BLOCK,
    STORED_OPTIONAL,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    replace,
)
from tskv.core.tiers import UNTIERED, Tier, tier_of
from tskv.core.wire_format import WireFormat

PART_BLOCKS = 1024  # blocks per snapshot batch: about 64 KB on the wire for 16-token blocks

Blocks = dict[int, bytes]  # hash -> the payload that stored it, in the order lives began
GONE_OUT = b""  # a frozen copy's payload for a block its snapshot has sent (no payload is empty)


class CacheState:
    """The blocks the stream says are cached: stored, not removed since, nor cleared.

    Memory follows the cache, not history: a removed block's entry goes, and a payload is kept
    only while one of its blocks is cached. `tiered` says whether the wire carries the tier
    (vLLM's does; on TokenSpeed's a block stored in two tiers is one block to every consumer,
    so it is one here too).
    """

    def __init__(self, *, tiered: bool = True) -> None:
        self.tiered = tiered
        self.tiers: dict[Tier, Blocks] = {}
        # tier -> hash -> copies beyond the first: a store naming its group that finds the
        # block cached is a second copy (vLLM keeps one per computation), removed one by one
        self.copies: dict[Tier, dict[int, int]] = {}
        # group index -> its latest store, emptied: a snapshot declares every group it knows,
        # so a consumer learns a hybrid model's groups even where one holds nothing
        self.groups: dict[int, BlockStored] = {}

    def apply(self, payload: bytes, events: Sequence[KVEvent]) -> None:
        """Follow one batch: its events, and the payload they were encoded into.

        This runs for every published batch, so it is written for speed: a plain loop of dict
        stores beats `dict.update(zip(...))` for the short events schedulers emit (measured:
        docs/performance.md#snapshots).
        """
        tiers = self.tiers
        tiered = self.tiered
        untiered = tiers.get(UNTIERED)  # the usual tier, looked up once a batch
        for event in events:
            kind = type(event)
            if kind not in EVENT_TYPES:  # a subclass: follow it as the kind it is
                kind = next(base for base in EVENT_TYPES if isinstance(event, base))
            if kind is BlockStored:
                stored: BlockStored = event  # type: ignore[assignment]
                tier = tier_of(stored) if tiered else UNTIERED
                if tier is not UNTIERED:
                    blocks = tiers.setdefault(tier, {})
                elif untiered is None:
                    blocks = untiered = tiers[UNTIERED] = {}
                else:
                    blocks = untiered
                if stored.group_idx is not None and tiered:
                    self._count_copies(tier, blocks, stored.block_hashes)
                    self._note_group(stored)
                for block in stored.block_hashes:
                    blocks[block] = payload
            elif kind is BlockRemoved:
                removed: BlockRemoved = event  # type: ignore[assignment]
                tier = tier_of(removed) if tiered else UNTIERED
                found = tiers.get(tier) if tier is not UNTIERED else untiered
                if found:
                    pop = found.pop
                    copies = self.copies.get(tier)
                    for block in removed.block_hashes:
                        if copies and copies.get(block):
                            copies[block] -= 1  # another copy stays
                            if not copies[block]:
                                del copies[block]
                        else:
                            pop(block, None)
            elif kind is AllBlocksCleared:
                tiers.clear()
                self.copies.clear()
                untiered = None
            # an UnknownEvent changes nothing tskv knows how to follow

    def _note_group(self, stored: BlockStored) -> None:
        known = self.groups.get(stored.group_idx)  # type: ignore[arg-type]
        if known is None or _GROUP(known) != _GROUP(stored):
            declared = replace(
                stored, block_hashes=[], parent_block_hash=None, token_ids=[], **_NO_BLOCKS
            )
            self.groups[stored.group_idx] = declared  # type: ignore[index]

    def _count_copies(self, tier: Tier, blocks: Blocks, hashes: Sequence[int]) -> None:
        if blocks.keys().isdisjoint(hashes):
            return  # the usual store: every block new
        copies = self.copies.setdefault(tier, {})
        for block in hashes:
            if block in blocks:
                copies[block] = copies.get(block, 0) + 1

    @property
    def blocks(self) -> int:
        return sum(map(len, self.tiers.values()))

    def freeze(self, next_seq: int) -> FrozenState:
        """A copy that later batches do not change, of the state after every batch before
        `next_seq`. `dict.copy`, not `dict(...)`: `copy` clones the table at C speed while at
        most a third of its slots are deleted ones (27-60 ms at a million blocks), where
        `dict(...)` does so only with none; a dict that has churned longer is copied entry by
        entry either way (about 100 ms at a million blocks)."""
        tiers = [
            (tier if self.tiered else None, blocks.copy()) for tier, blocks in self.tiers.items()
        ]
        copies = {tier: dict(counts) for tier, counts in self.copies.items() if counts}
        return FrozenState(next_seq, tiers, copies, list(self.groups.values()))


class FrozenState:
    """The state as of `next_seq`: what one snapshot describes, and only one (making it marks
    the blocks that have gone out). A tier of None is every tier (the wire does not carry
    them)."""

    def __init__(
        self,
        next_seq: int,
        tiers: list[tuple[Tier | None, Blocks]],
        copies: dict[Tier, dict[int, int]] | None = None,
        groups: list[BlockStored] | None = None,
    ) -> None:
        self.next_seq = next_seq
        self.tiers = tiers
        self.copies = copies or {}  # tier -> hash -> copies beyond the first
        self.groups = groups or []  # each group's declaration: a store of no block


class SnapshotBuilder:
    """The payloads of one snapshot, made one at a time as the replay task asks for them."""

    def __init__(
        self,
        state: FrozenState,
        ts: float,
        rank: int,
        wire_format: WireFormat,
        part_blocks: int = PART_BLOCKS,
    ) -> None:
        self.next_seq = state.next_seq
        self._ts = ts
        self._rank = rank
        self._wire_format = wire_format
        self._parts = _parts(state.tiers, part_blocks, state.copies, state.groups)
        self.parts_made = 0

    def next_payload(self) -> bytes | None:
        """The next batch of the snapshot, or None when it is complete."""
        events = next(self._parts, None)
        if events is None:
            return None
        self.parts_made += 1
        payload = encode_round(
            self._ts, events, self._rank, self._wire_format, dropped=_SAID_WHEN_PUBLISHED
        )
        assert payload is not None  # a part holds at least one event
        return payload


# What the wire cannot carry of a cached block was counted and said when its batch was
# published; a snapshot sends the same blocks again, and says nothing new.
_SAID_WHEN_PUBLISHED = DroppedFields(lambda message: None)


def _parts(
    tiers: list[tuple[Tier | None, Blocks]],
    part_blocks: int,
    copies: dict[Tier, dict[int, int]] | None = None,
    groups: Sequence[BlockStored] = (),
) -> Iterator[list[KVEvent]]:
    """The snapshot's events, cut into parts of about `part_blocks` blocks; the first part
    starts with AllBlocksCleared (so an empty cache is one part holding only that).

    Runs that go on one another's chain are sent as one event: an engine stores a request's
    blocks over many rounds, an event or more each, and a consumer pays per event as well as
    per block (a 40-block chain stored 4 blocks a round is indexed about 1.5 times as fast
    whole).
    """
    part: list[KVEvent] = [AllBlocksCleared(), *groups]
    links: list[BlockStored] = []  # the runs of the event being made, each continuing the last
    size = 0
    for tier, blocks in sorted(tiers, key=_group_first):
        for run in _stores(blocks, tier, (copies or {}).get(tier) if tier is not None else None):
            if links and not _continues(links[-1], run):
                part.append(_joined(links))
                links = []
            links.append(run)
            size += len(run.block_hashes)
            if size >= part_blocks:
                part.append(_joined(links))
                yield part
                part, links, size = [], [], 0
    if links:
        part.append(_joined(links))
    if part:
        yield part


_GROUP = attrgetter("block_size", "kv_cache_spec_kind", "kv_cache_spec_sliding_window", "medium")
_NO_BLOCKS = dict.fromkeys(PER_BLOCK)  # a declaration's per-block fields: none


def _group_first(tier: tuple[Tier | None, Blocks]) -> int:
    """Tiers by KV cache group (none first): a group that keeps every block (full attention,
    group 0 in vLLM) goes out before one that skips some, whose hashes a consumer places by the
    keys the first gave it. Within a group, tiers keep their order."""
    name = tier[0]
    return -1 if name is None or name[1] is None else name[1]


# What a run must share with the one before it to go out in one event with it: every field but
# the chain (hashes, parent, tokens) and the per-block ones, which are joined.
_ALIKE = attrgetter(
    "block_size", *(name for name in STORED_OPTIONAL if name not in PER_BLOCK), "unknown_fields"
)
_PER_BLOCK = attrgetter(*PER_BLOCK)
_UNSET = (None,) * len(PER_BLOCK)


def _continues(before: BlockStored, run: BlockStored) -> bool:
    """Whether `run` goes on `before`'s chain, as one event could say: its parent is the last
    block before, whose blocks all have their tokens, and the rest alike."""
    hashes = before.block_hashes
    if (
        run.parent_block_hash != hashes[-1]
        or len(before.token_ids) != len(hashes) * before.block_size
        or _ALIKE(before) != _ALIKE(run)
    ):
        return False
    if _PER_BLOCK(before) == _UNSET == _PER_BLOCK(run):  # the usual event: nothing per block
        return True
    return all(_per_block(before, name) == _per_block(run, name) != "short" for name in PER_BLOCK)


def _per_block(event: BlockStored, name: str) -> str:
    """How a per-block field can be joined: unset, one value a block, or not one a block (a
    value of another length stays with its own event)."""
    values = getattr(event, name)
    if values is None:
        return "unset"
    return "each" if len(values) == len(event.block_hashes) else "short"


def _joined(links: list[BlockStored]) -> BlockStored:
    """One event storing what the runs of `links` store, in order."""
    first = links[0]
    if len(links) == 1:
        return first
    joined: dict[str, list[Any]] = {
        name: list(chain.from_iterable(getattr(run, name) for run in links))
        for name in ("block_hashes", "token_ids", *PER_BLOCK)
        if getattr(first, name) is not None
    }
    return replace(first, **joined)


def _stores(
    blocks: Blocks, tier: Tier | None, copies: dict[int, int] | None = None
) -> Iterator[BlockStored]:
    """One BlockStored per run of cached blocks that one event stored, parents first.

    The dict's order is the order in which each block's current life began, so a parent
    almost always comes before its children. The exception (a parent removed and stored again
    while its child stayed cached) is held back until the parent has gone out. What has gone
    out is marked in the frozen copy itself (its payload set to GONE_OUT: a value change, which
    iterating allows), not in a set of its own: at a million blocks such a set's resizes, the
    garbage collector's walks over it and its release each held up live batches for tens of ms.
    """
    again = {block: blocks[block] for block, count in (copies or {}).items() if count > 0}
    waiting: dict[int, list[BlockStored]] = {}  # parent hash -> runs held back for it
    ready: deque[BlockStored] = deque()
    for run in _runs(blocks, tier):
        parent = run.parent_block_hash
        if parent is not None and blocks.get(parent):  # cached, and not yet gone out
            waiting.setdefault(parent, []).append(run)
            continue
        ready.append(run)
        while ready:
            out = ready.popleft()
            for block in out.block_hashes:
                blocks[block] = GONE_OUT
            if waiting:
                for block in out.block_hashes:
                    ready.extend(waiting.pop(block, ()))
            yield out
    for runs in waiting.values():  # a cycle of parents cannot be ordered; send them anyway
        yield from runs
    for block, payload in again.items():  # each further copy as a store of its own, after all
        for run in _cut([block], _tier_stores(payload, tier)):
            for _ in range((copies or {})[block]):
                yield run


def _runs(blocks: Blocks, tier: Tier | None) -> Iterator[BlockStored]:
    """Consecutive cached blocks stored by the same event, as one BlockStored each.

    The cached blocks a batch stored sit together in the dict (their lives began with it), so
    each batch is decoded once. In the usual batch all of them are still cached, in its order:
    its events are then the runs as they are, with no block looked at on its own. A block is
    marked gone out only after its run is made, so every payload read here is still there.
    """
    for payload, group in groupby(blocks.items(), itemgetter(1)):
        cached = [block for block, _ in group]
        stores = _tier_stores(payload, tier)
        if cached == list(chain.from_iterable(event.block_hashes for event in stores)):
            yield from stores
        else:
            yield from _cut(cached, stores)


def _tier_stores(payload: bytes, tier: Tier | None) -> list[BlockStored]:
    """The batch's stores in `tier` (None: in every tier)."""
    return [
        event
        for event in decode_batch(payload).events
        if isinstance(event, BlockStored) and (tier is None or tier_of(event) == tier)
    ]


def _cut(cached: list[int], stores: list[BlockStored]) -> Iterator[BlockStored]:
    """The runs of one batch's cached blocks when some were removed or stored twice: each
    block's current life is the last event of the batch that stores it."""
    storer: dict[int, int] = {}
    for index, event in enumerate(stores):
        storer.update(dict.fromkeys(event.block_hashes, index))
    position, count = 0, len(cached)
    while position < count:
        index = storer[cached[position]]
        hashes = stores[index].block_hashes
        start = hashes.index(cached[position])
        end = start + 1
        position += 1
        while (
            position < count
            and end < len(hashes)
            and cached[position] == hashes[end]
            and storer[cached[position]] == index
        ):
            end += 1
            position += 1
        yield _slice(stores[index], start, end)


def _slice(event: BlockStored, start: int, end: int) -> BlockStored:
    """The part of `event` storing blocks start..end-1: every other field kept, the per-block
    ones (`PER_BLOCK`) cut with the blocks."""
    hashes = event.block_hashes
    if start == 0 and end == len(hashes):
        return event
    size = event.block_size
    per_block: dict[str, list[object]] = {}
    for name in PER_BLOCK:
        values = getattr(event, name)
        if values is not None and len(values) == len(hashes):
            per_block[name] = list(values[start:end])
    if len(hashes) * size < len(event.token_ids):
        # a store that skips blocks (vLLM's masked ones): which tokens a hash has is not on
        # the wire, so the part keeps every token and the parent, as the store came
        return replace(event, block_hashes=list(hashes[start:end]), **per_block)
    return replace(
        event,
        block_hashes=list(hashes[start:end]),
        parent_block_hash=event.parent_block_hash if start == 0 else hashes[start - 1],
        token_ids=list(event.token_ids[start * size : end * size]),
        **per_block,
    )
