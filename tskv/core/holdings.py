"""What each worker holds, by content key: the index's state, no I/O.

Every block a worker holds is in its view (the engine's hash, with its tier, to its key), and
each key has a bit mask of the workers holding it. Storing and removing keep the two in step;
a run of consecutive BlockStored events, the usual batch, costs a few dict operations for all
of its blocks together. A worker holding one key in two tiers (or twice in one) holds it until
its last copy goes.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from typing import Any, cast

from tskv.core.block_keys import chain, root_key
from tskv.core.events import BlockStored
from tskv.core.predictions import Predictions
from tskv.core.tiers import UNTIERED, Tier, tier_of

Worker = Hashable  # e.g. ("worker-a", 0): a name or endpoint, and the data-parallel rank
MASK_CACHE = 4096  # masks whose workers are remembered for answers
FEW_BLOCKS = 8  # an event this short is stored block by block, not as a run
_ABSENT = -1  # hash() never returns -1, so no key is ever this
# The engine's hash; with its tier when the event names one (a block is held once per tier)
BlockId = int | tuple[str | None, int | None, int]
Stored = tuple[BlockStored, list[Any]]  # an event, and its blocks' `block_keys.contents`


def block_id(tier: Tier, block: int) -> BlockId:
    return block if tier is UNTIERED else (*tier, block)


def block_ids(tier: Tier, hashes: Sequence[int]) -> Sequence[BlockId]:
    return hashes if tier is UNTIERED else [(*tier, block) for block in hashes]


class _Bits:
    """Which bit stands for which worker, and the workers of a mask, for answers: the same few
    masks (who holds a popular prefix) come up in query after query, and walking 64 bits in
    Python costs more than the rest of one."""

    def __init__(self) -> None:
        self._by_bit: dict[int, Worker] = {}
        self._free: list[int] = []
        self._next = 1
        self._mask_workers: dict[int, tuple[Worker, ...]] = {}

    def take(self, worker: Worker) -> int:
        if self._free:
            bit = self._free.pop()
        else:
            bit, self._next = self._next, self._next << 1
        self._by_bit[bit] = worker
        self._mask_workers.clear()  # a bit may have changed hands
        return bit

    def give_back(self, bit: int) -> None:
        del self._by_bit[bit]
        self._free.append(bit)
        self._mask_workers.clear()

    def workers_of(self, mask: int) -> tuple[Worker, ...]:
        workers = self._mask_workers.get(mask)
        if workers is None:
            if len(self._mask_workers) >= MASK_CACHE:
                self._mask_workers.clear()
            found: list[Worker] = []
            rest = mask
            while rest:
                low = rest & -rest
                found.append(self._by_bit[low])
                rest ^= low
            workers = self._mask_workers[mask] = tuple(found)
        return workers


class _WorkerView:
    __slots__ = ("bit", "blocks", "extra_refs", "mirrored")

    def __init__(self, bit: int) -> None:
        self.bit = bit
        self.mirrored = False  # its blocks are kept elsewhere: only its holds come here
        self.blocks: dict[BlockId, int | None] = {}  # engine hash (and tier) -> key
        # key -> how many more of this worker's blocks have it, beyond the first (rare: a block
        # in two tiers). The worker's bit in the key's mask stands for the first.
        self.extra_refs: dict[int, int] = {}


def _note(journal: dict[int, list[list[int]]], bit: int, let_go: int, keys: Sequence[int]) -> None:
    """Add to the worker's runs of holds taken (0) or let go of (1)."""
    runs = journal.setdefault(bit, [])
    if runs and (len(runs) - 1) % 2 == let_go:
        runs[-1].extend(keys)
    else:
        if len(runs) % 2 != let_go:
            runs.append([])  # the runs start with one of holds taken
        runs.append(list(keys))


class Holdings:
    """Each worker's view and each key's holders, kept in step."""

    def __init__(self, block_size: int, predictions: Predictions) -> None:
        self.block_size = block_size
        self.holders: dict[int, int] = {}  # key -> bit mask of the workers holding it
        self.views: dict[Worker, _WorkerView] = {}
        self.bits = _Bits()
        self.orphans = 0  # blocks stored under a parent never seen: not matchable
        self.mismatched = 0  # BlockStored events of another block size than the index's
        self._predictions = predictions  # a real block replaces its prediction
        # bit -> the worker's holds taken and let go of since last asked, in order: runs of
        # keys, taken, let go of, taken... (a reader process sends them on: `take_changes`)
        self.journal: dict[int, list[list[int]]] | None = None

    def view(self, worker: Worker) -> _WorkerView:
        view = self.views.get(worker)
        if view is None:
            view = self.views[worker] = _WorkerView(self.bits.take(worker))
        return view

    def store_run(self, view: _WorkerView, run: list[Stored]) -> None:
        """Store consecutive BlockStored events, and empty `run`. The usual run (every block new
        to the worker, each once) costs a few dict operations for all of its blocks together;
        any other is stored one event at a time."""
        if not run:
            return
        if len(run) == 1 and len(run[0][0].block_hashes) <= FEW_BLOCKS:  # block by block: less
            self.store(view, *run[0])
            run.clear()
            return
        blocks = view.blocks
        ids: list[BlockId] = []  # the run's blocks, in order, and their keys
        keys: list[int | None] = []
        mismatched = 0
        for event, contents in run:
            mismatched += event.block_size != self.block_size
            tier = tier_of(event)
            parent = event.parent_block_hash
            if parent is not None and ids and block_id(tier, parent) == ids[-1]:
                key = keys[-1]  # the event before ends where this one starts
            else:  # if the run stores its parent again, the run goes slowly below
                key = self._first_key(event, tier, blocks, ids, keys)
            keys.extend(chain(key, contents))
            ids.extend(block_ids(tier, event.block_hashes))
        if blocks.keys().isdisjoint(ids):
            before = len(blocks)
            blocks.update(zip(ids, keys, strict=True))
            if len(blocks) == before + len(ids):
                orphans = keys.count(None)
                self.orphans += orphans
                self.mismatched += mismatched
                held = [key for key in keys if key is not None] if orphans else keys
                self.hold(view, cast("list[int]", held))
                run.clear()
                return
            for each in ids:  # a block twice in the run: none of them was here before
                blocks.pop(each, None)
        for stored, found in run:
            self.store(view, stored, found)
        run.clear()

    @staticmethod
    def _first_key(
        event: BlockStored,
        tier: Tier,
        blocks: dict[BlockId, int | None],
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
            return blocks[parent_id]
        if parent_id in ids:
            return keys[len(ids) - 1 - ids[::-1].index(parent_id)]
        return None

    def store(self, view: _WorkerView, event: BlockStored, contents: Sequence[Any]) -> None:
        if event.block_size != self.block_size:
            self.mismatched += 1  # its tokens cut into other blocks than queries do
        blocks = view.blocks
        tier = tier_of(event)
        keys = chain(self._first_key(event, tier, blocks), contents)
        if keys and keys[-1] is None:
            self.orphans += keys.count(None)
        holders, bit, extra_refs = self.holders, view.bit, view.extra_refs
        predicted, journal = self._predictions.masks, self.journal
        for each, key in zip(block_ids(tier, event.block_hashes), keys, strict=True):
            old = blocks.get(each, _ABSENT)
            if old != _ABSENT:
                if old == key:
                    continue  # stored again: nothing changes
                self.release(view, (old,))
            blocks[each] = key
            if key is None:
                continue
            if predicted and key in predicted:  # the prediction came true
                self._predictions.drop(bit, key)
            mask = holders.get(key, 0)
            if mask & bit:
                extra_refs[key] = extra_refs.get(key, 0) + 1
            else:
                holders[key] = mask | bit
                if journal is not None:  # in order with what `release` notes
                    _note(journal, bit, 0, (key,))

    def hold(self, view: _WorkerView, keys: Sequence[int]) -> None:
        """The worker holds each key (once more, if it held it already)."""
        holders, bit, predicted = self.holders, view.bit, self._predictions.masks
        if predicted and not predicted.keys().isdisjoint(keys):
            for key in keys:
                if key in predicted:  # the prediction came true
                    self._predictions.drop(bit, key)
        new = dict.fromkeys(keys, bit)
        if len(new) == len(keys) and holders.keys().isdisjoint(new):
            holders.update(new)  # content no worker held: the usual block
            if self.journal is not None:
                _note(self.journal, bit, 0, keys)
            return
        if view.mirrored:  # its reader sends only holds taken: none is held already
            get = holders.get
            for key in keys:
                holders[key] = get(key, 0) | bit
            return
        extra_refs = view.extra_refs
        taken = []
        for key in keys:
            mask = holders.get(key, 0)
            if mask & bit:
                extra_refs[key] = extra_refs.get(key, 0) + 1
            else:
                holders[key] = mask | bit
                taken.append(key)
        if self.journal is not None:
            _note(self.journal, bit, 0, taken)

    def release(self, view: _WorkerView, keys: Iterable[int | None]) -> None:
        """Let go of the worker's hold on each key (None, or _ABSENT: it held nothing)."""
        holders, extra, keep = self.holders, view.extra_refs, ~view.bit
        predicted = self._predictions.masks
        let_go: list[int] = []
        for key in keys:
            if key is None or key == _ABSENT:
                continue
            if predicted and key in predicted:  # removed: no prediction of it holds either
                self._predictions.drop(view.bit, key)
            if extra and key in extra:  # another of this worker's blocks still has it
                if extra[key] > 1:
                    extra[key] -= 1
                else:
                    del extra[key]
                continue
            mask = holders[key] & keep
            if mask:
                holders[key] = mask
            else:
                del holders[key]
            let_go.append(key)
        if self.journal is not None:
            _note(self.journal, view.bit, 1, let_go)

    def take_changes(self, view: _WorkerView) -> list[list[int]]:
        return [] if self.journal is None else self.journal.pop(view.bit, [])

    def apply_changes(self, view: _WorkerView, runs: Sequence[Sequence[int]]) -> None:
        """Take and let go of holds as `take_changes` gave them, for a worker whose blocks are
        kept elsewhere."""
        view.mirrored = True
        for number, keys in enumerate(runs):
            if number % 2:
                self.release(view, keys)
            else:
                self.hold(view, keys)

    def remove(self, view: _WorkerView, tier: Tier, hashes: Sequence[int]) -> None:
        """Let go of the worker's blocks `hashes` in `tier`; its copies in other tiers stay."""
        pop = view.blocks.pop
        self.release(view, [pop(each, _ABSENT) for each in block_ids(tier, hashes)])

    def clear(self, *views: _WorkerView) -> None:
        """Forget what the workers hold. Which keys mirrored workers hold is known elsewhere,
        so for those every key is looked at, once for all of them."""
        mirrored = 0
        for view in views:
            self._predictions.forget(view.bit)
            if view.mirrored:
                mirrored |= view.bit
                continue
            view.extra_refs.clear()  # so each distinct key is let go of once, whatever the count
            self.release(view, set(view.blocks.values()))
            view.blocks.clear()
        if not mirrored:
            return
        holders, keep = self.holders, ~mirrored
        for key in [key for key, mask in holders.items() if mask & mirrored]:
            mask = holders[key] & keep
            if mask:
                holders[key] = mask
            else:
                del holders[key]

    def drop(self, worker: Worker) -> int | None:
        """Forget `worker` altogether; its bit, if it had one."""
        view = self.views.pop(worker, None)
        if view is None:
            return None
        self.clear(view)
        if self.journal is not None:
            self.journal.pop(view.bit, None)  # whoever asks for its changes has let it go
        self.bits.give_back(view.bit)
        return view.bit
