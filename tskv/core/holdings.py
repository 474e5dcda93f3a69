"""What each worker holds, by content key: the index's state, no I/O.

Every block a worker holds is in its `WorkerBlocks` (the engine's hash, with its tier, to its
key), and each key has a bit mask of the workers holding it; `filing` keeps the two in step as
events arrive. A worker holding one key in two tiers (or twice in one) holds it until its last copy
goes. A reader process's holdings keep no holders (`Journal`): they journal every copy taken
and let go of, and the index's process, which mirrors the journal (`Mirror`) and looks every
key up anyway, counts a worker's copies there. A reader then keeps only its workers' block
maps.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

from tskv.core import compiled
from tskv.core.errors import TskvTypeError
from tskv.core.events import BlockStored
from tskv.core.groups import CacheGroup
from tskv.core.hybrid import HybridBlocks, Op
from tskv.core.predictions import Predictions
from tskv.core.tiers import BlockId, BlockKeys, Tier

if TYPE_CHECKING:
    from tskv.core._compiled import KeyTable

Worker = Hashable  # e.g. ("worker-a", 0): a name or endpoint, and the data-parallel rank
MASK_CACHE = 4096  # masks whose workers are remembered for answers
SHORT_RUN = 8  # keys a dict takes one by one: making a dict of them costs more
ABSENT = -1  # hash() never returns -1, so no key is ever this
# an event, and its blocks' `block_keys.contents`; None for a plain event's (no identity), cut
# from its token ids only as its run is keyed
Stored = tuple[BlockStored, list[Any] | None]


# Content key -> mask of the workers holding it: a dict, or the compiled `KeyTable`, which keeps
# it in 16 bytes a key where a dict of ints takes about 100 (tskv/core/_compiled.pyi types it)
HolderMap: TypeAlias = "dict[int, int] | KeyTable"


def block_keys_map() -> BlockKeys:
    """A new, empty map of a worker's blocks: the compiled one where this process uses it."""
    return {} if compiled.core is None else compiled.core.BlockMap()


class Bits:
    """Which bit stands for which worker, and the workers of a mask, for answers: the same few
    masks (who holds a popular prefix) come up in query after query, and walking 64 bits in
    Python costs more than the rest of one. `by_position[i]` is the worker of bit 1 << i (None
    for a free bit), for the compiled core's answers."""

    def __init__(self) -> None:
        self._by_bit: dict[int, Worker] = {}
        self._free: list[int] = []
        self._next = 1
        self._mask_workers: dict[int, tuple[Worker, ...]] = {}
        self.by_position: tuple[Worker | None, ...] = ()

    def take(self, worker: Worker) -> int:
        if self._free:
            bit = self._free.pop()
        else:
            bit, self._next = self._next, self._next << 1
        self._by_bit[bit] = worker
        self._changed()  # a bit may have changed hands
        return bit

    def give_back(self, bit: int) -> None:
        del self._by_bit[bit]
        self._free.append(bit)
        self._changed()

    def _changed(self) -> None:
        self._mask_workers.clear()
        self.by_position = tuple(
            self._by_bit.get(1 << i) for i in range(self._next.bit_length() - 1)
        )

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


class WorkerBlocks:
    """One worker's blocks as the holdings keep them: its bit in the keys' masks, its blocks by
    engine hash, and what a plain worker needs no more of until it turns hybrid."""

    __slots__ = (
        "bit",
        "blocks",
        "copies",
        "extra_refs",
        "first",
        "hybrid",
        "lookahead",
        "mirrored",
        "tier",
    )

    def __init__(self, bit: int) -> None:
        self.bit = bit
        self.mirrored = False  # its blocks are kept elsewhere: only its holds come here
        self.tier: Tier | None = None  # the one tier its blocks are in, while it is plain
        self.first: tuple[int, CacheGroup] | None = None  # that tier's group, when named
        self.hybrid: HybridBlocks | None = None  # its groups and tiers, once it needs them
        self.lookahead = 0  # tokens after a block its engine's hash covers (vLLM's lookahead)
        # engine hash (and tier) -> key; a hybrid worker's larger blocks: their keys
        self.blocks = block_keys_map()
        # a block's copies in its tier beyond the first: an event that names its group keeps
        # one per store (vLLM stores a block again when another group cut a hit short)
        self.copies: dict[BlockId, int] = {}
        # key -> how many more of this worker's blocks have it, beyond the first (rare: a block
        # in two tiers). The worker's bit in the key's mask stands for the first.
        self.extra_refs: dict[int, int] = {}

    def by_medium(self) -> dict[str | None, int] | None:
        """How many blocks it holds in each storage medium (None where a reader keeps them)."""
        if self.mirrored:
            return None
        if self.hybrid is None:
            medium = None if self.tier is None else self.tier[0]
            return {medium: len(self.blocks)} if self.blocks else {}
        held: dict[str | None, int] = {}
        for (medium, _), keys in self.hybrid.tiers.items():
            if keys:
                held[medium] = held.get(medium, 0) + len(keys)
        return held


def note_run(
    journal: dict[int, list[list[int]]], bit: int, let_go: int, keys: Sequence[int]
) -> None:
    """Add to the worker's runs of holds taken (0) or let go of (1)."""
    runs = journal.setdefault(bit, [])
    if runs and (len(runs) - 1) % 2 == let_go:
        runs[-1].extend(keys)
    else:
        if len(runs) % 2 != let_go:
            runs.append([])  # the runs start with one of holds taken
        runs.append(list(keys))


def run_keys(run: Sequence[int]) -> Sequence[int]:
    """A run's keys as ints. Bytes are packed keys, 8 bytes each in this machine's order, as a
    reader's report carries them (the compiled table reads those in place); any other sequence
    is the keys themselves."""
    if type(run) is not bytes:
        return run
    if len(run) % 8:
        raise TskvTypeError(f"a run of packed keys is 8 bytes a key, not {len(run)} bytes")
    keys: list[int] = memoryview(run).cast("q").tolist()
    return keys


def every_copy(worker_blocks: WorkerBlocks) -> list[int]:
    """The key of each copy of each block the worker holds."""
    keys = [key for key in worker_blocks.blocks.values() if key is not None]
    for each, extra in worker_blocks.copies.items():
        key = worker_blocks.blocks.get(each)
        if key is not None:
            keys.extend([key] * extra)
    return keys


class Holdings:
    """Each worker's blocks and bit: what every index keeps. How a worker's holds on keys are
    kept is a subclass's: `Holders` (the index's own: each key's holders) or `Journal` (a
    reader process's: sent on to the index that mirrors them, `Mirror`)."""

    journals = False  # whether holds are journalled (a hybrid worker's are then its ops)

    def __init__(self, block_size: int, predictions: Predictions) -> None:
        self.block_size = block_size
        self.workers: dict[Worker, WorkerBlocks] = {}
        self.known: tuple[Worker, ...] = ()  # the workers', made again when one comes or goes
        self.bits = Bits()
        self.hybrids: dict[Worker, WorkerBlocks] = {}  # the workers with a HybridBlocks
        self.predictions = predictions  # a real block replaces its prediction
        # what the index does when its workers, or which of them are hybrid, change (a
        # PrefixIndex tells its Matcher, and opens or closes its fast path)
        self.on_answers_changed: Callable[[], None] | None = None

    def blocks_of(self, worker: Worker) -> WorkerBlocks:
        worker_blocks = self.workers.get(worker)
        if worker_blocks is None:
            worker_blocks = self.workers[worker] = WorkerBlocks(self.bits.take(worker))
            self._workers_changed()
        return worker_blocks

    def make_hybrid(self, worker: Worker, worker_blocks: WorkerBlocks) -> None:
        """`worker`'s blocks are kept as a hybrid model's (`worker_blocks.hybrid`) from here on."""
        self.hybrids[worker] = worker_blocks
        self._answers_changed()

    def _workers_changed(self) -> None:
        self.known = tuple(self.workers)
        self._answers_changed()

    def _answers_changed(self) -> None:
        if self.on_answers_changed is not None:
            self.on_answers_changed()

    def __len__(self) -> int:
        """Distinct keys held by any worker (0 where no holders are kept: a journal)."""
        return 0

    def hold(self, worker_blocks: WorkerBlocks, keys: Sequence[int]) -> None:
        """The worker holds each key (once more, if it held it already)."""
        raise NotImplementedError

    def release(self, worker_blocks: WorkerBlocks, keys: Iterable[int | None]) -> None:
        """Let go of the worker's hold on each key (None, or ABSENT: it held nothing)."""
        raise NotImplementedError

    def clear(self, *workers: WorkerBlocks) -> None:
        """Forget what the workers hold."""
        raise NotImplementedError

    def drop(self, worker: Worker) -> int | None:
        """Forget `worker` altogether; its bit, if it had one."""
        worker_blocks = self.workers.pop(worker, None)
        if worker_blocks is None:
            return None
        self.hybrids.pop(worker, None)
        self.clear(worker_blocks)
        self.bits.give_back(worker_blocks.bit)
        self._workers_changed()
        return worker_blocks.bit


def emptied(worker_blocks: WorkerBlocks) -> None:
    """The worker's blocks forgotten, its holds let go of already."""
    worker_blocks.blocks.clear()
    worker_blocks.copies.clear()
    if worker_blocks.hybrid is not None:
        worker_blocks.hybrid.clear()


class Holders(Holdings):
    """The index's own holdings: each key's holders (a mask of workers' bits), kept in step with
    the workers' blocks, here or in a reader process (`Mirror`)."""

    def __init__(self, block_size: int, predictions: Predictions) -> None:
        super().__init__(block_size, predictions)
        # the compiled table where this process has it (the mirror uses its bulk operations)
        core = compiled.core
        self.table: KeyTable | None = None if core is None else core.KeyTable()
        self.holders: HolderMap = {} if self.table is None else self.table  # key -> worker mask

    def __len__(self) -> int:
        return len(self.holders)

    def hold(self, worker_blocks: WorkerBlocks, keys: Sequence[int]) -> None:
        holders, bit, predicted = self.holders, worker_blocks.bit, self.predictions.masks
        if predicted and not predicted.keys().isdisjoint(keys):
            for key in keys:
                if key in predicted:  # the prediction came true
                    self.predictions.drop(bit, key)
        added = None if self.table is None else self.table.add_new(keys, bit)  # in one call
        if added is None and len(keys) > SHORT_RUN:  # the dict, or a mask past 64 bits
            new = dict.fromkeys(keys, bit)
            added = len(new) == len(keys) and holders.keys().isdisjoint(new)
            if added:
                holders.update(new)
        if added:  # content no worker held: the usual block
            return
        extra_refs = worker_blocks.extra_refs
        for key in keys:
            mask = holders.get(key, 0)
            if mask & bit:
                extra_refs[key] = extra_refs.get(key, 0) + 1
            else:
                holders[key] = mask | bit

    def release(self, worker_blocks: WorkerBlocks, keys: Iterable[int | None]) -> None:
        table = self.table
        if (
            table is not None
            and isinstance(keys, list)
            and not worker_blocks.extra_refs
            and not self.predictions.masks
            and table.let_go(keys, worker_blocks.bit) is not None  # None: a mask past 64 bits
        ):
            return  # the usual case, in one call
        holders, extra, keep = self.holders, worker_blocks.extra_refs, ~worker_blocks.bit
        predicted = self.predictions.masks
        for key in keys:
            if key is None or key == ABSENT:
                continue
            if predicted and key in predicted:  # removed: no prediction of it holds either
                self.predictions.drop(worker_blocks.bit, key)
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

    def clear(self, *workers: WorkerBlocks) -> None:
        """Forget what the workers hold. Which keys mirrored workers hold is known elsewhere,
        so for those every key is looked at, once for all of them."""
        mirrored = 0
        for worker_blocks in workers:
            self.predictions.forget(worker_blocks.bit)
            worker_blocks.extra_refs.clear()  # each distinct key let go of once, whatever count
            if worker_blocks.mirrored:
                mirrored |= worker_blocks.bit
                if worker_blocks.hybrid is not None:
                    worker_blocks.hybrid.tiers.clear()
                continue
            self.release(
                worker_blocks, {key for key in worker_blocks.blocks.values() if key is not None}
            )
            emptied(worker_blocks)
        if not mirrored:
            return
        holders, keep = self.holders, ~mirrored
        if self.table is not None and mirrored < 1 << 64:
            self.table.clear_bits(mirrored)  # 3.2M keys: one compiled pass, not a Python loop
            return
        for key in [key for key, mask in holders.items() if mask & mirrored]:
            mask = holders[key] & keep
            if mask:
                holders[key] = mask
            else:
                del holders[key]


class Journal(Holdings):
    """A reader process's holdings: no holders, but each worker's copies taken and let go of
    since last asked, in order (`take_changes`), for the index's process to mirror (`Mirror`),
    which looks every key up anyway."""

    journals = True

    def __init__(self, block_size: int, predictions: Predictions) -> None:
        super().__init__(block_size, predictions)
        # bit -> runs of keys: taken, let go of, taken... (a hybrid worker's are in its ops)
        self.journal: dict[int, list[list[int]]] = {}

    def hold(self, worker_blocks: WorkerBlocks, keys: Sequence[int]) -> None:
        if worker_blocks.hybrid is None and keys:
            note_run(self.journal, worker_blocks.bit, 0, keys)

    def release(self, worker_blocks: WorkerBlocks, keys: Iterable[int | None]) -> None:
        if worker_blocks.hybrid is None:
            let_go = [key for key in keys if key is not None and key != ABSENT]
            if let_go:
                note_run(self.journal, worker_blocks.bit, 1, let_go)

    def clear(self, *workers: WorkerBlocks) -> None:
        """Forget what the workers hold, every copy journalled: the mirror counts them."""
        for worker_blocks in workers:
            self.release(worker_blocks, every_copy(worker_blocks))
            emptied(worker_blocks)

    def drop(self, worker: Worker) -> int | None:
        bit = super().drop(worker)
        if bit is not None:
            self.journal.pop(bit, None)  # whoever asks for its changes has let it go
        return bit

    def take_changes(self, worker_blocks: WorkerBlocks) -> tuple[list[list[int]], list[Op]]:
        """The worker's holds taken and let go of since last asked, as runs, and a hybrid
        worker's tier changes (`HybridBlocks.take_ops`)."""
        runs = self.journal.pop(worker_blocks.bit, [])
        return runs, [] if worker_blocks.hybrid is None else worker_blocks.hybrid.take_ops()


class Mirror:
    """A reader process's journal applied to the index's holders: for a worker whose blocks
    are kept there, every copy it took and let go of, counted as `Holders` counts its own."""

    def __init__(self, holders: Holders) -> None:
        self.holders = holders

    def apply(
        self,
        worker: Worker,
        worker_blocks: WorkerBlocks,
        runs: Sequence[Sequence[int]],
        ops: Sequence[Op],
    ) -> None:
        holders = self.holders
        worker_blocks.mirrored = True
        table = holders.table
        if table is not None and worker_blocks.bit < 1 << 64 and not holders.predictions.masks:
            # hold and release, in one compiled loop
            table.mirror(worker_blocks.bit, runs, worker_blocks.extra_refs)
        else:
            for number, run in enumerate(runs):
                if number % 2:
                    holders.release(worker_blocks, run_keys(run))
                else:
                    holders.hold(worker_blocks, run_keys(run))
        if ops:
            if worker_blocks.hybrid is None:
                worker_blocks.hybrid = HybridBlocks(holders.block_size)
                holders.make_hybrid(worker, worker_blocks)
            if any(op[0] == "begin" for op in ops):  # its tiers count every copy from here
                worker_blocks.extra_refs.clear()
            taken, let_go = worker_blocks.hybrid.mirror(ops)
            holders.release(worker_blocks, let_go)
            holders.hold(worker_blocks, taken)
