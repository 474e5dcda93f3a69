"""Filing a worker's events in the holdings: which key each stored block has, in which tier,
and what a removal lets go of. No I/O.

A run of consecutive BlockStored events, the usual batch, costs a few dict operations for all of
its blocks together; anything else is filed one event at a time. A worker whose blocks need more
than one full-attention tier (a hybrid model's groups, lower tiers, larger group blocks) gets a
`HybridBlocks` as soon as an event says so, and its events are filed there.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, cast

import attrs

from tskv.core import compiled
from tskv.core.block_keys import PLAIN_ROOT, contents, identities, root_key
from tskv.core.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    UnknownEvent,
    not_an_event,
)
from tskv.core.groups import FULL_KINDS, group_of
from tskv.core.holdings import ABSENT, Holdings, Stored, Worker, WorkerBlocks
from tskv.core.hybrid import HybridBlocks, is_device, plain_tiers, stored_again
from tskv.core.read_batch import CLEARED, REMOVED, ReadBatch, runs_of
from tskv.core.tiers import UNTIERED, BlockId, BlockKeys, Tier, block_id, block_ids, tier_of

FEW_BLOCKS = 8  # an event this short is stored block by block, not as a run


@attrs.frozen
class Filed:
    """What filing a batch came across: a cache reset (the worker's trust, `WorkerView`,
    decides what it means), string token ids, the lookahead the worker's engine hashes with."""

    cleared: bool
    strings: bool
    lookahead: int


PLAIN_FILED = Filed(False, False, 0)  # the usual batch's: shared, not made a batch


def filed(cleared: bool, strings: bool, lookahead: int) -> Filed:
    return Filed(cleared, strings, lookahead) if cleared or strings or lookahead else PLAIN_FILED


RunKeys = list[int | None]  # a run's keys, None for an orphan's


# (LoRA name, cache salt) -> its root key: the compiled core keys a run from here and calls no
# function; `run_keys` learns them as it keys runs in Python, at most MAX_ROOTS
Roots = dict[tuple[str | None, str | None], int]
MAX_ROOTS = 4096
_NAMES = (str, type(None))


class Filing:
    """Files each worker's events in `holdings`, counting what it could not file."""

    def __init__(self, holdings: Holdings) -> None:
        self.holdings = holdings
        self.orphans = 0  # blocks stored under a parent never seen: not matchable
        self.mismatched = 0  # BlockStored events of another block size than the index's
        self.unplaced = 0  # hashes of stores that skip blocks, found in no other group
        self.roots: Roots = {(None, None): PLAIN_ROOT}  # for the compiled core: `run_keys`

    def apply(self, worker: Worker, events: Iterable[KVEvent]) -> Filed:
        """File one batch of `worker`'s events, in order."""
        if type(events) is not list and type(events) is not tuple:
            events = list(events)  # a generator, say: a hybrid worker's batch is read twice
        holdings, size = self.holdings, self.holdings.block_size
        worker_blocks = holdings.blocks_of(worker)
        stored: list[Stored] = []  # consecutive BlockStored, stored together
        learned: dict[int, int] | None = None  # a hybrid batch's keys, once needed
        cleared = strings = False
        for event in events:
            if isinstance(event, BlockStored):
                if worker_blocks.hybrid is not None or needs_hybrid(worker_blocks, event, size):
                    strings = self.store_run(worker_blocks, stored) or strings
                    hybrid = self.make_hybrid(worker, worker_blocks)
                    if learned is None:
                        learned = hybrid.learn_batch(events)
                    strings = self.store_hybrid(worker_blocks, event, learned) or strings
                    continue
                lookahead = event.lookahead_token_ids
                if event.extra_keys is None and event.mm_keys is None and not lookahead:
                    stored.append((event, None))  # plain: cut as its run is keyed
                    continue
                count = len(event.block_hashes)
                idents = identities(event.extra_keys, event.mm_keys, count, lookahead)
                if lookahead:
                    worker_blocks.lookahead = len(lookahead[0])
                found, found_strings = contents(event.token_ids, idents, count, size)
                strings = strings or found_strings
                stored.append((event, found))
                continue
            strings = self.store_run(worker_blocks, stored) or strings
            if isinstance(event, BlockRemoved):
                self.remove(worker_blocks, event)
            elif isinstance(event, AllBlocksCleared):
                holdings.clear(worker_blocks)
                cleared = True
            elif not isinstance(event, UnknownEvent):  # an unknown event changes nothing known
                raise not_an_event("PrefixIndex.apply: event", event)
        strings = self.store_run(worker_blocks, stored) or strings
        return filed(cleared, strings, worker_blocks.lookahead)

    def apply_read(self, worker: Worker, batch: ReadBatch) -> Filed:
        """File a batch the compiled core read (`read_batch`) as `apply` files its events: a
        plain worker's runs keyed from their blocks' content hashes, with no event made. What
        the steps cannot file alone (a worker whose blocks are tiered or hybrid, a run not
        wholly new to the worker) goes through `apply`, from that event on."""
        worker_blocks, core = self.holdings.blocks_of(worker), compiled.core
        size = self.holdings.block_size
        assert core is not None  # a ReadBatch is made only where it is
        if worker_blocks.hybrid is not None or (
            worker_blocks.tier is not None and worker_blocks.tier != UNTIERED
        ):
            return self.apply(worker, batch.events)
        cleared = False
        for start, kind, steps in runs_of(batch.steps):
            if kind == REMOVED:
                self.remove_ids(worker_blocks, steps[0][1])
            elif kind == CLEARED:
                self.holdings.clear(worker_blocks)
                cleared = True
            else:
                worker_blocks.tier = UNTIERED  # as `needs_hybrid` notes a first store
                made = core.read_run(steps, size, worker_blocks.blocks, PLAIN_ROOT)
                if made is not None and add_new(worker_blocks.blocks, made[0], made[1]):
                    self._hold_new(worker_blocks, made[1], made[2], made[3])
                    continue
                rest = self.apply(worker, batch.events[start:])  # nothing changed: from events
                return filed(cleared or rest.cleared, rest.strings, rest.lookahead)
        return filed(cleared, False, worker_blocks.lookahead)

    def _hold_new(
        self, worker_blocks: WorkerBlocks, keys: RunKeys, mismatched: int, orphans: int
    ) -> None:
        """The worker holds a run's keys (`orphans` of them None), its blocks stored in its
        `WorkerBlocks` already."""
        self.orphans += orphans
        self.mismatched += mismatched
        held = [key for key in keys if key is not None] if orphans else keys
        if held:  # else nothing to note: a run of orphans
            self.holdings.hold(worker_blocks, cast("list[int]", held))

    def store_run(self, worker_blocks: WorkerBlocks, run: list[Stored]) -> bool:
        """Store consecutive BlockStored events, and empty `run`; whether a token id was a
        string. The usual run (every block new to the worker, each once) costs a few dict
        operations for all of its blocks together; any other is stored one event at a time."""
        if not run:
            return False
        if len(run) == 1 and len(run[0][0].block_hashes) <= FEW_BLOCKS:  # block by block: less
            strings = self.store(worker_blocks, *run[0])
            run.clear()
            return strings
        ids, keys, mismatched, strings = run_keys(
            run, worker_blocks.blocks, self.holdings.block_size, self.roots
        )
        if add_new(worker_blocks.blocks, ids, keys):
            self._hold_new(worker_blocks, keys, mismatched, keys.count(None))
            run.clear()
            return strings
        for stored, found in run:
            self.store(worker_blocks, stored, found)
        run.clear()
        return strings

    def store(
        self, worker_blocks: WorkerBlocks, event: BlockStored, found: list[Any] | None
    ) -> bool:
        """Store one event block by block; whether a token id was a string."""
        size = self.holdings.block_size
        if event.block_size != size:
            self.mismatched += 1  # its tokens cut into other blocks than queries do
        strings = False
        if found is None:
            found, strings = contents(event.token_ids, None, len(event.block_hashes), size)
        blocks = worker_blocks.blocks
        tier = tier_of(event)
        keys = compiled.chain(first_key(event, tier, blocks), found)
        if keys and keys[-1] is None:
            self.orphans += keys.count(None)
        grouped = event.group_idx is not None
        taken: list[int] = []  # the holds, taken together (`Holdings.hold`)
        for each, key in zip(block_ids(tier, event.block_hashes), keys, strict=True):
            old = blocks.get(each, ABSENT)
            if old != ABSENT:
                again = stored_again(old, key, grouped, worker_blocks.copies.get(each, 0))
                if again is not None:
                    filing, extra = again
                    if extra:
                        worker_blocks.copies[each] = extra
                    if old is None and key is not None:  # its earlier copies are filed now
                        blocks[each] = key
                    held = key if old is None else old
                    if filing and held is not None:
                        self.holdings.hold(worker_blocks, [held] * filing)
                    continue
                if taken:  # held before what is let go of, as the event says
                    self.holdings.hold(worker_blocks, taken)
                    taken = []
                self.holdings.release(
                    worker_blocks, [old] * (1 + worker_blocks.copies.pop(each, 0))
                )
            blocks[each] = key
            if key is not None:
                taken.append(key)
        self.holdings.hold(worker_blocks, taken)  # the one loop that takes holds: `Holdings.hold`
        return strings

    # -- hybrid and tiered workers -------------------------------------------------------

    def make_hybrid(self, worker: Worker, worker_blocks: WorkerBlocks) -> HybridBlocks:
        """Give a plain worker its HybridBlocks, from the blocks it holds now."""
        hybrid = worker_blocks.hybrid
        if hybrid is None:
            hybrid = worker_blocks.hybrid = HybridBlocks(
                self.holdings.block_size, journal=self.holdings.journals
            )
            hybrid.tiers = plain_tiers(worker_blocks.blocks, worker_blocks.copies)
            hybrid.copies, worker_blocks.copies = worker_blocks.copies, {}
            hybrid.keys = {
                (each[-1] if isinstance(each, tuple) else each): key
                for each, key in worker_blocks.blocks.items()
                if key is not None
            }
            hybrid.begin()
            if worker_blocks.first is not None:
                hybrid.groups.set(*worker_blocks.first)
                worker_blocks.first = None
            self.holdings.make_hybrid(worker, worker_blocks)
        return hybrid

    def store_hybrid(
        self, worker_blocks: WorkerBlocks, event: BlockStored, learned: dict[int, int]
    ) -> bool:
        """Store one event of a hybrid worker; whether a token id was a string."""
        assert worker_blocks.hybrid is not None
        if event.block_size != self.holdings.block_size and event.group_idx is None:
            self.mismatched += 1  # its tokens cut into other blocks than queries do
        delta = worker_blocks.hybrid.store(event, worker_blocks.blocks, learned)
        self.orphans += delta.orphans
        self.unplaced += delta.unplaced
        # Taken first: an event naming a hash twice can let go of what it took itself.
        if delta.taken:
            self.holdings.hold(worker_blocks, delta.taken)
        if delta.let_go:
            self.holdings.release(worker_blocks, delta.let_go)
        if event.lookahead_token_ids:
            worker_blocks.lookahead = len(event.lookahead_token_ids[0])
        return delta.strings

    def remove(self, worker_blocks: WorkerBlocks, event: BlockRemoved) -> None:
        """Let go of the worker's blocks the event names in its tier; its copies in other tiers
        stay."""
        if worker_blocks.hybrid is not None:
            self.holdings.release(
                worker_blocks, worker_blocks.hybrid.remove(event, worker_blocks.blocks)
            )
            return
        self.remove_ids(worker_blocks, block_ids(tier_of(event), event.block_hashes))

    def remove_ids(self, worker_blocks: WorkerBlocks, ids: Sequence[BlockId]) -> None:
        """Let go of a plain worker's blocks `ids`: the compiled map pops them in one call,
        unless it declines (an id that is not plain) or a block has copies."""
        blocks = worker_blocks.blocks
        if worker_blocks.copies:
            self.holdings.release(worker_blocks, taken_out(worker_blocks, ids))
            return
        found = None if isinstance(blocks, dict) else blocks.pop_many(ids, ABSENT)
        self.holdings.release(
            worker_blocks, [blocks.pop(i, ABSENT) for i in ids] if found is None else found
        )


def taken_out(worker_blocks: WorkerBlocks, ids: Sequence[BlockId]) -> list[Any]:
    """The keys a plain worker with copies lets go of as its blocks `ids` leave (ABSENT for a
    block it did not hold); a block with copies beyond the first only has one fewer."""
    blocks, copies = worker_blocks.blocks, worker_blocks.copies
    let_go = []
    for each in ids:
        if copies.get(each):
            copies[each] -= 1
            if not copies[each]:
                del copies[each]
            let_go.append(blocks[each])
        else:
            let_go.append(blocks.pop(each, ABSENT))
    return let_go


def needs_hybrid(worker_blocks: WorkerBlocks, event: BlockStored, block_size: int) -> bool:
    """Whether storing `event` takes more than a plain worker's blocks: a second tier, a lower
    tier, a group that is not full attention, or blocks of another size than the index's
    (`block_size`) in a group."""
    tier = tier_of(event)
    if worker_blocks.tier is None:
        worker_blocks.tier = tier
        if event.group_idx is not None:  # its group, learned if the worker turns hybrid
            worker_blocks.first = (event.group_idx, group_of(event))
    elif tier is not worker_blocks.tier and tier != worker_blocks.tier:
        return True
    medium = tier[0]
    if medium is not None and not is_device(medium):
        return True
    if event.group_idx is None:
        return False
    kind = event.kv_cache_spec_kind
    return event.block_size != block_size or (kind is not None and kind not in FULL_KINDS)


def add_new(blocks: BlockKeys, ids: list[BlockId], keys: list[int | None]) -> bool:
    """Store each block's key if none of the blocks is in `blocks` nor twice in `ids`; whether
    it did (if not, `blocks` is as it was). The compiled map does it in one call."""
    before = len(blocks)
    if isinstance(blocks, dict):
        if not blocks.keys().isdisjoint(ids):
            return False
        blocks.update(zip(ids, keys, strict=True))
    else:  # the compiled map, or, where it declines, its entries one call each
        added = blocks.add_new(ids, keys)
        if added is not None:
            return added
        set(ids)  # every id hashed first, as a dict's isdisjoint does: one that raises stores none
        if any(each in blocks for each in ids):
            return False
        for each, key in zip(ids, keys, strict=True):
            blocks[each] = key
    if len(blocks) == before + len(ids):
        return True
    for each in ids:  # a block twice in the run: none of them was here before
        blocks.pop(each, None)
    return False


def run_keys(
    run: list[Stored], blocks: BlockKeys, size: int, roots: Roots
) -> tuple[list[BlockId], list[int | None], int, bool]:
    """The run's blocks in order, their keys, how many of its events cut blocks of another
    size than the index's, and whether a token id was a string. The compiled core keys a
    plain run (no tier, no identity, a root in `roots`) in one call, straight from its token
    ids; a run keyed here teaches `roots` its roots."""
    if compiled.core is not None:
        made = compiled.core.plain_run(run, size, blocks, roots, BlockStored)
        if made is not None:
            return *made, False
    ids: list[BlockId] = []
    keys: list[int | None] = []
    mismatched, strings = 0, False
    for event, found in run:
        mismatched += event.block_size != size
        tier = tier_of(event)
        parent = event.parent_block_hash
        if parent is not None and ids and block_id(tier, parent) == ids[-1]:
            key = keys[-1]  # the event before ends where this one starts
        else:  # if the run stores its parent again, the run goes slowly in store_run
            key = first_key(event, tier, blocks, ids, keys)
            if parent is None and len(roots) < MAX_ROOTS:
                learn_root(roots, event.lora_name, event.cache_salt, key)
        if found is None:
            found, cut_strings = contents(event.token_ids, None, len(event.block_hashes), size)
            strings = strings or cut_strings
        keys.extend(compiled.chain(key, found))
        ids.extend(block_ids(tier, event.block_hashes))
    return ids, keys, mismatched, strings


def learn_root(roots: Roots, lora_name: Any, cache_salt: Any, key: int | None) -> None:
    """Keep a root for the compiled core: only of strings and None, whose hash and equality
    run no Python code where it looks them up."""
    if key is not None and type(lora_name) in _NAMES and type(cache_salt) in _NAMES:
        roots[lora_name, cache_salt] = key


def first_key(
    event: BlockStored,
    tier: Tier,
    blocks: BlockKeys,
    ids: Sequence[BlockId] = (),
    keys: Sequence[int | None] = (),
) -> int | None:
    """The key a stored event's first block hangs from: the root of its LoRA and salt, or
    its parent's key, held already or stored earlier in the run (`ids`, `keys`); None for
    a parent never seen (its blocks are orphans: no query reaches them)."""
    parent = event.parent_block_hash
    if parent is None:
        return root_key(event.lora_name, event.cache_salt)
    parent_id = block_id(tier, parent)
    if parent_id in blocks:
        key: int | None = blocks[parent_id]
        return key
    if parent_id in ids:
        return keys[len(ids) - 1 - ids[::-1].index(parent_id)]
    return None
