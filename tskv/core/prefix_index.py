"""Which worker holds the longest prefix of a request: the KV-aware router's index, no I/O.

The index files a block under its content key (`block_keys`), not the engine's hash, so a
query needs only the request's token ids and identity, whatever hashing scheme the engine uses.
The engine's hashes are kept per worker only to resolve parents and removals. For each key the
index keeps a bit mask of the workers holding it, so a query is one dict lookup and one AND per
block, for all workers at once.

Keys are Python `hash()` values of ints and tuples of them (`block_keys` digests strings,
bytes and None first), so every process of one Python build computes the same ones: a watcher's
reader processes index blocks that this process matches. Two different prefixes share a key
with odds of about n²/2⁶⁴ for n cached blocks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs

from tskv.core._checks import int_at_least, number_at_least
from tskv.core.block_keys import (
    block_identity,
    blocks_of,
    chain,
    contents,
    identities,
    int_tokens,
    root_key,
)
from tskv.core.errors import ConfigError, TskvLookupError, TskvTypeError
from tskv.core.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    MMKey,
    UnknownEvent,
    not_an_event,
)
from tskv.core.holdings import Holdings, Stored
from tskv.core.holdings import Worker as Worker  # the index's users name it from here
from tskv.core.predictions import MAX_ENTRIES, Predictions
from tskv.core.tiers import tier_of
from tskv.core.worker_view import Changes, ViewChange, WorkerView

MAX_PREDICTED = MAX_ENTRIES


class Match(dict[Worker, int]):
    """What `PrefixIndex.match` answers: worker -> how many leading blocks of the request it
    holds (workers that hold none are absent); `stale`: the workers whose view is known to be
    incomplete right now, whose counts a router should not trust; `predicted`: for workers whose
    count includes blocks only predicted (`PrefixIndex.predict`), how many of them are."""

    __slots__ = ("predicted", "stale")

    def __init__(
        self,
        counts: dict[Worker, int],
        stale: frozenset[Worker],
        predicted: dict[Worker, int] | None = None,
    ) -> None:
        super().__init__(counts)
        self.stale = stale
        self.predicted = {} if predicted is None else predicted

    def best(self, trusted_only: bool = True) -> tuple[Worker | None, int]:
        """The worker with the most leading blocks, and how many (None, 0 if none holds any)."""
        candidates = [(n, w) for w, n in self.items() if not (trusted_only and w in self.stale)]
        if not candidates:
            return None, 0
        count, worker = max(candidates, key=lambda item: item[0])
        return worker, count


def _leading_counts(
    holders: Callable[[int, int], int],
    token_ids: Sequence[int | str],
    lora_name: str | None,
    extra_keys: Sequence[Any] | None,
    cache_salt: str | None,
    mm_keys: Sequence[Sequence[MMKey]] | None,
    size: int,
    workers_of: Callable[[int], tuple[Worker, ...]],
) -> dict[Worker, int]:
    """For each worker, how many leading full blocks of the request `holders` says it holds."""
    counts: dict[Worker, int] = {}
    key = root_key(lora_name, cache_salt)
    plain = extra_keys is None and mm_keys is None
    active = -1  # every worker, until the first block says otherwise
    blocks = len(token_ids) // size
    # Block by block: most queries stop after a few blocks, so the rest is never copied.
    for depth, chunk in enumerate(blocks_of(token_ids, size)):
        if plain:
            key = hash((key, chunk))
        else:
            identity = block_identity(extra_keys, mm_keys, depth)
            key = hash((key, chunk if identity is None else (chunk, identity)))
        held = active & holders(key, 0)
        if held != active:  # some workers' prefixes end here
            if depth:
                counts.update(dict.fromkeys(workers_of(active & ~held), depth))
            if not held:
                return counts
            active = held
    if blocks and active > 0:
        counts.update(dict.fromkeys(workers_of(active), blocks))
    return counts


def _either(
    real: Callable[[int, int], int], predicted: Callable[[int, int], int]
) -> Callable[[int, int], int]:
    """The workers holding a key really or by a prediction."""

    def holders(key: int, default: int) -> int:
        return real(key, default) | predicted(key, default)

    return holders


@attrs.frozen
class IndexStatistics:
    """What the index holds, and what it could not use."""

    workers: int
    stale: int  # workers whose view is not to be trusted right now
    blocks: int  # distinct blocks (by content) held by any worker
    orphans: int  # blocks stored under a parent this index never saw: not matchable
    mismatched: int  # BlockStored events whose block_size differs from the index's
    predicted: int  # (worker, block) predictions in force


class PrefixIndex:
    """A prefix index over many workers' KV event streams."""

    def __init__(
        self,
        block_size: int = 16,
        *,
        clock: Callable[[], float] = time.monotonic,
        max_predicted: int = MAX_PREDICTED,
        record_changes: bool = False,
    ) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ConfigError(
                f"block_size = {block_size!r} must be a positive int (tokens a block)"
            )
        int_at_least("max_predicted", max_predicted, 0)
        self.block_size = block_size
        self._predictions = Predictions(clock, max_predicted)  # their time to live is `clock`'s
        self._holdings = Holdings(block_size, self._predictions)
        if record_changes:
            self._holdings.journal = {}
        self._views: dict[Worker, WorkerView] = {}  # each worker's trust, `worker_view`
        self._stale: set[Worker] = set()  # the workers whose view is stale, for answers
        self._strings = False  # a string token id was seen: queries' string ones are digested

    # -- the stream's side ------------------------------------------------------------------

    def apply(self, worker: Worker, batch: KVEventBatch | Iterable[KVEvent]) -> None:
        """Apply one batch of `worker`'s events, in order. An AllBlocksCleared makes the
        worker's view whole again (from there on the index knows its whole cache), unless a
        snapshot is being applied (`worker_view`)."""
        events = batch.events if isinstance(batch, KVEventBatch) else batch
        size, holdings = self.block_size, self._holdings
        view = holdings.view(worker)
        stored: list[Stored] = []  # consecutive BlockStored, stored together
        for event in events:
            if isinstance(event, BlockStored):
                count = len(event.block_hashes)
                idents = None
                if event.extra_keys is not None or event.mm_keys is not None:
                    idents = identities(event.extra_keys, event.mm_keys, count)
                found, strings = contents(event.token_ids, idents, count, size)
                self._strings = self._strings or strings
                stored.append((event, found))
                continue
            holdings.store_run(view, stored)
            if isinstance(event, BlockRemoved):
                holdings.remove(view, tier_of(event), event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                holdings.clear(view)
                self.carry_out(worker, self.worker_view(worker).reset_applied())
            elif not isinstance(event, UnknownEvent):  # an unknown event changes nothing known
                raise not_an_event("PrefixIndex.apply: event", event)
        holdings.store_run(view, stored)

    def take_changes(self, worker: Worker) -> list[list[int]]:
        """The keys `worker` came to hold and let go of since last asked, as runs (taken, let
        go of, taken...), for another process's index to mirror with `apply_changes`; kept
        only by an index made with `record_changes=True`."""
        view = self._holdings.views.get(worker)
        return [] if view is None else self._holdings.take_changes(view)

    def apply_changes(
        self, worker: Worker, runs: Sequence[Sequence[int]], *, strings: bool = False
    ) -> None:
        """Mirror another index's `take_changes` for `worker`, whose blocks that index keeps
        (a watcher's reader process); `strings`: that index has seen string token ids."""
        self._strings = self._strings or strings
        self._holdings.apply_changes(self._holdings.view(worker), runs)

    def mark_stale(self, worker: Worker) -> None:
        """The worker's view is incomplete (a loss was reported) until `mark_current` or an
        AllBlocksCleared (a snapshot starts with one)."""
        self.carry_out(worker, self.worker_view(worker).marked(True))

    def mark_current(self, worker: Worker) -> None:
        """The worker's view is whole again."""
        self.carry_out(worker, self.worker_view(worker).marked(False))

    def worker_view(self, worker: Worker) -> WorkerView:
        """The worker's trust, which decides when it is stale; a watcher's followers tell it
        what happened and the index carries out what it returns (`carry_out`)."""
        view = self._views.get(worker)
        if view is None:
            self._holdings.view(worker)  # a worker known only by its trust is known
            view = self._views[worker] = WorkerView()
        return view

    def carry_out(self, worker: Worker, changes: Changes) -> None:
        """Do what the worker's view decided: forget its blocks, mark it stale or current."""
        for change in changes:
            if change is ViewChange.CLEAR:
                self.clear_worker(worker)
            elif change is ViewChange.STALE:
                self._stale.add(worker)
            else:
                self._stale.discard(worker)

    def clear_worker(self, worker: Worker) -> None:
        """Forget what `worker` holds (its engine restarted with an empty cache), keeping it."""
        view = self._holdings.views.get(worker)
        if view is not None:
            self._holdings.clear(view)

    def clear_workers(self, workers: Iterable[Worker]) -> None:
        """`clear_worker` for many at once: for workers whose blocks are kept elsewhere, one
        pass over every key for all of them."""
        self._holdings.clear(
            *[self._holdings.views[w] for w in workers if w in self._holdings.views]
        )

    def remove_worker(self, worker: Worker) -> None:
        self._holdings.drop(worker)
        self._views.pop(worker, None)
        self._stale.discard(worker)

    # -- the router's side ------------------------------------------------------------------

    def match(
        self,
        token_ids: Sequence[int | str],
        *,
        lora_name: str | None = None,
        extra_keys: Sequence[Any] | None = None,
        cache_salt: str | None = None,
        mm_keys: Sequence[Sequence[MMKey]] | None = None,
    ) -> Match:
        """For each worker, how many of the request's leading full blocks it holds. The
        request's identity beside its tokens (LoRA, salt, per-block extra and multimodal keys)
        must be given as its engine would see it, or its blocks are other blocks."""
        if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Sequence):
            raise TskvTypeError(
                f"token_ids = {token_ids!r:.60} must be a sequence of token ids (a list of ints)"
            )
        if self._strings:
            token_ids, _ = int_tokens(token_ids)
        request = (token_ids, lora_name, extra_keys, cache_salt, mm_keys)
        answer = (self.block_size, self._holdings.bits.workers_of)
        real = _leading_counts(self._holdings.holders.get, *request, *answer)
        if self._predictions.masks:
            self._predictions.expire()
        if not self._predictions.masks:  # the usual case: one walk, on the real blocks only
            return Match(real, frozenset(self._stale))
        either = _either(self._holdings.holders.get, self._predictions.masks.get)
        counts = _leading_counts(either, *request, *answer)
        predicted = {w: n - real.get(w, 0) for w, n in counts.items() if n > real.get(w, 0)}
        return Match(counts, frozenset(self._stale), predicted)

    def predict(
        self,
        worker: Worker,
        token_ids: Sequence[int | str],
        ttl: float,
        *,
        lora_name: str | None = None,
        extra_keys: Sequence[Any] | None = None,
        cache_salt: str | None = None,
        mm_keys: Sequence[Sequence[MMKey]] | None = None,
    ) -> None:
        """Record that `worker` will soon hold this request's full blocks (it was just routed
        there): `match` counts them for it, marked in `Match.predicted`, for `ttl` seconds of the
        index's clock, or until its real BlockStored arrives, a BlockRemoved of them or a cache
        reset. Blocks it already holds are left as they are."""
        number_at_least("ttl", ttl, 0, above=True)
        bit, holders = self._holdings.view(worker).bit, self._holdings.holders
        size = self.block_size
        count = len(token_ids) // size
        idents = identities(extra_keys, mm_keys, count)
        found, _ = contents(token_ids, idents, count, size)
        keys = chain(root_key(lora_name, cache_salt), found)
        fresh = [key for key in keys if key is not None and not holders.get(key, 0) & bit]
        self._predictions.add(bit, fresh, ttl)

    # -- what the index holds ---------------------------------------------------------------

    @property
    def workers(self) -> list[Worker]:
        return list(self._holdings.views)

    @property
    def seen_strings(self) -> bool:
        """Whether a string token id was ever stored (queries then digest theirs)."""
        return self._strings

    @property
    def stale(self) -> frozenset[Worker]:
        return frozenset(self._stale)

    def engine_hashes(self, worker: Worker) -> set[int]:
        """The engine's hashes of the blocks `worker` holds, as its stream says."""
        view = self._holdings.views.get(worker)
        if view is None:
            return set()
        if view.mirrored:
            raise TskvLookupError(
                f"worker {worker!r}'s blocks are kept by a watcher's reader process; "
                "ask the watcher: await watcher.engine_hashes(worker)"
            )
        return {block if isinstance(block, int) else block[-1] for block in view.blocks}

    def __len__(self) -> int:
        """Distinct blocks (by content) held by any worker."""
        return len(self._holdings.holders)

    def statistics(self) -> IndexStatistics:
        return IndexStatistics(
            workers=len(self._holdings.views),
            stale=len(self._stale),
            predicted=len(self._predictions),
            blocks=len(self._holdings.holders),
            orphans=self._holdings.orphans,
            mismatched=self._holdings.mismatched,
        )
