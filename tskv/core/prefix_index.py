"""Which worker holds the longest prefix of a request: the KV-aware router's index, no I/O.

The index keys a block by its content, not by the engine's hash: a block's key is Python's
hash of its parent's key and its own token ids; at the root, the LoRA name and the cache salt
(SGLang's and vLLM's per-tenant namespace); per block, the extra keys and the multimodal keys
(TensorRT-LLM's `mm_keys`: each item's content hash and where it starts) when the engine sends
them. Everything that makes a block's identity in its engine is in its key, so one tenant's
query never matches another tenant's salted blocks. It works whatever hashing scheme the
engine uses (TokenSpeed's FNV, vLLM's SHA-256 or xxHash, the simulator's), and a query needs
only the request's token ids and that identity. The engine's hashes are kept per worker only
to resolve parents and removals. For each key the index keeps a bit mask of the workers
holding it, so a query is one dict lookup and one AND per block, for all workers at once.

Keys are Python `hash()` values: 64 bits, stable within a process (ints and tuples of them do
not depend on PYTHONHASHSEED; a LoRA name or a salt does, which is fine as the index lives in one
process). Two different prefixes share a key with odds of about n²/2⁶⁴ for n cached blocks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

import attrs

from tskv.core._checks import int_at_least, number_at_least
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
from tskv.core.predictions import MAX_ENTRIES, Predictions

Worker = Hashable  # e.g. ("worker-a", 0): a name or endpoint, and the data-parallel rank
_ROOT = "tskv-prefix-root"
MASK_CACHE = 4096  # masks whose workers are remembered for answers
MAX_PREDICTED = MAX_ENTRIES
_ABSENT = -1  # hash() never returns -1, so no key is ever this
BlockId = int | tuple[str, int]  # the engine's hash; with its tier when it names one


def root_key(lora_name: str | None, cache_salt: str | None = None) -> int:
    """The key a chain hangs from: prefixes cached under different LoRA adapters, or under
    different cache salts, differ."""
    if cache_salt is None:
        return hash((_ROOT, lora_name))
    return hash((_ROOT, lora_name, cache_salt))


def _frozen(value: Any) -> Any:
    """Extra keys as something hashable (they arrive as lists from the wire)."""
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(item) for item in value)
    if isinstance(value, dict):
        return tuple(sorted((key, _frozen(item)) for key, item in value.items()))
    return value


def block_identity(
    extra_keys: Sequence[Any] | None, mm_keys: Sequence[Sequence[MMKey]] | None, index: int
) -> Any:
    """What, beside its tokens, makes block `index` what it is: its extra keys and its
    multimodal items (content hash and offset; the uuid only names the item). None when it
    has neither, so such a block's key is the plain one."""
    extra = extra_keys[index] if extra_keys is not None and index < len(extra_keys) else None
    items = mm_keys[index] if mm_keys is not None and index < len(mm_keys) else None
    if not items:
        return None if extra is None else _frozen(extra)
    return (_frozen(extra), tuple((item.hash, item.start_offset) for item in items))


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
    __slots__ = ("bit", "blocks", "extra_refs")

    def __init__(self, bit: int) -> None:
        self.bit = bit
        self.blocks: dict[BlockId, int | None] = {}  # engine hash (and tier) -> key
        # key -> how many more of this worker's blocks have it, beyond the first (rare: a block
        # in two tiers). The worker's bit in the key's mask stands for the first.
        self.extra_refs: dict[int, int] = {}


def plain_keys(key: int, tokens: Sequence[int | str], count: int, size: int) -> list[int | None]:
    """Keys of `count` full blocks with no extra or multimodal keys, under parent `key`: the
    usual event, and the usual request."""
    keys: list[int | None] = []
    chunks = tuple(tokens)  # slicing a tuple is cheaper than unpacking list slices
    for start in range(0, count * size, size):
        key = hash((key, chunks[start : start + size]))
        keys.append(key)
    return keys


def keys_slowly(
    key: int | None,
    tokens: Sequence[int | str],
    extra: Sequence[Any] | None,
    mm: Sequence[Sequence[MMKey]] | None,
    count: int,
    size: int,
) -> list[int | None]:
    """Keys of blocks with extra or multimodal keys, short token lists, or no known parent:
    None from the first block no query can reach (no parent known, or tokens missing) on."""
    keys: list[int | None] = []
    chunks = tuple(tokens)
    for index in range(count):
        chunk = chunks[index * size : (index + 1) * size]
        if key is None or len(chunk) != size:
            key = None
            keys.append(key)
            continue
        identity = block_identity(extra, mm, index)
        key = hash((key, chunk)) if identity is None else hash((key, chunk, identity))
        keys.append(key)
    return keys


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
    depth = 0
    for depth in range(len(token_ids) // size):
        # Block by block: most queries stop after a few blocks, so the rest is never copied.
        chunk = tuple(token_ids[depth * size : (depth + 1) * size])
        identity = None if plain else block_identity(extra_keys, mm_keys, depth)
        key = hash((key, chunk)) if identity is None else hash((key, chunk, identity))
        held = active & holders(key, 0)
        if held != active and depth:  # some workers' prefixes end here
            counts.update(dict.fromkeys(workers_of(active & ~held), depth))
        active = held
        if not active:
            break
    else:
        if active > 0:
            counts.update(dict.fromkeys(workers_of(active), depth + 1))
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
    ) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size = {block_size!r} must be a positive int (tokens a block)")
        int_at_least("max_predicted", max_predicted, 0)
        self.block_size = block_size
        self._predictions = Predictions(clock, max_predicted)  # their time to live is `clock`'s
        self._holders: dict[int, int] = {}  # key -> bit mask of the workers holding it
        self._views: dict[Worker, _WorkerView] = {}
        self._bits = _Bits()
        self._stale: set[Worker] = set()
        self._orphans = 0
        self._mismatched = 0

    # -- the stream's side ------------------------------------------------------------------

    def _view(self, worker: Worker) -> _WorkerView:
        view = self._views.get(worker)
        if view is None:
            view = self._views[worker] = _WorkerView(self._bits.take(worker))
        return view

    def apply(self, worker: Worker, batch: KVEventBatch | Iterable[KVEvent]) -> None:
        """Apply one batch of `worker`'s events, in order. An AllBlocksCleared makes the
        worker's view complete again (from there on the index knows its whole cache)."""
        view = self._view(worker)
        events = batch.events if isinstance(batch, KVEventBatch) else batch
        for event in events:
            if isinstance(event, BlockStored):
                self._store(view, event)
            elif isinstance(event, BlockRemoved):
                self._remove(view, event.medium, event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self._clear(view)
                self._stale.discard(worker)
            elif not isinstance(event, UnknownEvent):  # an unknown event changes nothing known
                raise not_an_event("PrefixIndex.apply: event", event)

    def _store(self, view: _WorkerView, event: BlockStored) -> None:
        size = self.block_size
        if event.block_size != size:
            self._mismatched += 1  # its tokens cut into other blocks than queries do
        tier = event.medium
        blocks, holders, bit = view.blocks, self._holders, view.bit
        parent = event.parent_block_hash
        key: int | None
        if parent is None:
            key = root_key(event.lora_name, event.cache_salt)
        else:
            key = blocks.get(parent if tier is None else (tier, parent))
        tokens = event.token_ids
        extra, mm = event.extra_keys, event.mm_keys
        hashes = event.block_hashes
        keys: list[int | None]
        if key is not None and extra is None and mm is None and len(tokens) >= len(hashes) * size:
            keys = plain_keys(key, tokens, len(hashes), size)  # the usual event
        else:
            keys = keys_slowly(key, tokens, extra, mm, len(hashes), size)
            self._orphans += keys.count(None)
        extra_refs = view.extra_refs
        predicted = self._predictions.masks
        for block, key in zip(hashes, keys, strict=True):
            block_id: BlockId = block if tier is None else (tier, block)
            old = blocks.get(block_id, _ABSENT)
            if old != _ABSENT:
                if old == key:
                    continue  # stored again: nothing changes
                self._release(view, (old,))
            blocks[block_id] = key
            if key is not None:
                if predicted and key in predicted:  # the prediction came true
                    self._predictions.drop(bit, key)
                mask = holders.get(key, 0)
                if mask & bit:
                    extra_refs[key] = extra_refs.get(key, 0) + 1
                else:
                    holders[key] = mask | bit

    def _release(self, view: _WorkerView, keys: Iterable[int | None]) -> None:
        """Let go of the worker's hold on each key (None, or _ABSENT: it held nothing)."""
        holders, extra, keep = self._holders, view.extra_refs, ~view.bit
        predicted = self._predictions.masks
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

    def _remove(self, view: _WorkerView, tier: str | None, hashes: Sequence[int]) -> None:
        pop = view.blocks.pop
        if tier is None:
            self._release(view, [pop(block, _ABSENT) for block in hashes])
        else:
            self._release(view, [pop((tier, block), _ABSENT) for block in hashes])

    def _clear(self, view: _WorkerView) -> None:
        self._predictions.forget(view.bit)
        view.extra_refs.clear()  # so each distinct key is let go of once, whatever the count
        self._release(view, set(view.blocks.values()))
        view.blocks.clear()

    def mark_stale(self, worker: Worker) -> None:
        """The worker's view is incomplete (a loss was reported) until `mark_current` or an
        AllBlocksCleared (a snapshot starts with one)."""
        self._view(worker)
        self._stale.add(worker)

    def mark_current(self, worker: Worker) -> None:
        self._stale.discard(worker)

    def clear_worker(self, worker: Worker) -> None:
        """Forget what `worker` holds (its engine restarted with an empty cache), keeping it."""
        view = self._views.get(worker)
        if view is not None:
            self._clear(view)

    def remove_worker(self, worker: Worker) -> None:
        view = self._views.pop(worker, None)
        if view is None:
            return
        self._clear(view)
        self._bits.give_back(view.bit)
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
            raise TypeError(
                f"token_ids = {token_ids!r:.60} must be a sequence of token ids (a list of ints)"
            )
        request = (token_ids, lora_name, extra_keys, cache_salt, mm_keys)
        answer = (self.block_size, self._bits.workers_of)
        real = _leading_counts(self._holders.get, *request, *answer)
        if self._predictions.masks:
            self._predictions.expire()
        if not self._predictions.masks:  # the usual case: one walk, on the real blocks only
            return Match(real, frozenset(self._stale))
        either = _either(self._holders.get, self._predictions.masks.get)
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
        bit, holders, size = self._view(worker).bit, self._holders, self.block_size
        root, count = root_key(lora_name, cache_salt), len(token_ids) // size
        if extra_keys is None and mm_keys is None:
            keys = plain_keys(root, token_ids, count, size)
        else:
            keys = keys_slowly(root, token_ids, extra_keys, mm_keys, count, size)
        fresh = [key for key in keys if key is not None and not holders.get(key, 0) & bit]
        self._predictions.add(bit, fresh, ttl)

    # -- what the index holds ---------------------------------------------------------------

    @property
    def workers(self) -> list[Worker]:
        return list(self._views)

    @property
    def stale(self) -> frozenset[Worker]:
        return frozenset(self._stale)

    def engine_hashes(self, worker: Worker) -> set[int]:
        """The engine's hashes of the blocks `worker` holds, as its stream says."""
        view = self._views.get(worker)
        if view is None:
            return set()
        return {block if isinstance(block, int) else block[1] for block in view.blocks}

    def __len__(self) -> int:
        """Distinct blocks (by content) held by any worker."""
        return len(self._holders)

    def statistics(self) -> IndexStatistics:
        return IndexStatistics(
            workers=len(self._views),
            stale=len(self._stale),
            predicted=len(self._predictions),
            blocks=len(self._holders),
            orphans=self._orphans,
            mismatched=self._mismatched,
        )
