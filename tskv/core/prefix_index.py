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
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from tskv.core import compiled
from tskv.core._checks import int_at_least, number_at_least
from tskv.core.block_keys import PLAIN_ROOT, int_tokens, request_contents, root_key, walk_keys
from tskv.core.dynamo_hashes import DynamoHashes
from tskv.core.errors import ConfigError, TskvLookupError, TskvTypeError
from tskv.core.events import (
    KVEvent,
    KVEventBatch,
    MMKey,
)
from tskv.core.filing import Filing
from tskv.core.groups import CacheGroup, checked_groups
from tskv.core.holdings import Bits, HolderMap, Holders, Holdings, Mirror
from tskv.core.holdings import Worker as Worker  # the index's users name it from here
from tskv.core.hybrid import Op
from tskv.core.predictions import MAX_ENTRIES, Predictions
from tskv.core.read_batch import ReadBatch
from tskv.core.worker_view import Changes, ViewChange, WorkerView

if TYPE_CHECKING:
    from tskv.core._compiled import Matcher

MAX_BLOCK_SIZE = 1 << 20  # tokens a block; engines use at most a few hundred
MAX_PREDICTED = MAX_ENTRIES


class Match(dict[Worker, int]):
    """What `PrefixIndex.match` answers: worker -> how many leading blocks of the request its
    engine would reuse (workers that hold none are absent); `stale`: the workers whose view is
    known to be incomplete right now, whose counts a router should not trust; `predicted`: for
    workers whose count includes blocks only predicted (`PrefixIndex.predict`), how many of them
    are; `lower`: for workers whose count includes blocks held only in lower tiers (CPU, disk:
    loaded before they are reused), how many of them are; `block_size`: tokens a block;
    `workers`: every worker the index knew when it answered (holding blocks or not), which a
    policy chooses among."""

    __slots__ = ("block_size", "lower", "predicted", "stale", "workers")

    def __init__(
        self,
        counts: dict[Worker, int],
        stale: frozenset[Worker],
        predicted: dict[Worker, int] | None = None,
        lower: dict[Worker, int] | None = None,
        block_size: int | None = None,
        workers: tuple[Worker, ...] | None = None,
    ) -> None:
        super().__init__(counts)
        self.stale = stale
        self.predicted = {} if predicted is None else predicted
        self.lower = {} if lower is None else lower
        self.block_size = block_size
        self.workers = (
            (*counts, *(w for w in stale if w not in counts)) if workers is None else workers
        )

    def on_device(self, worker: Worker) -> int:
        """How many of `worker`'s leading blocks its engine holds on the device itself."""
        return self.get(worker, 0) - self.lower.get(worker, 0)

    def best(self, trusted_only: bool = True) -> tuple[Worker | None, int]:
        """The worker with the most leading blocks, and how many (None, 0 if none holds any)."""
        candidates = [(n, w) for w, n in self.items() if not (trusted_only and w in self.stale)]
        if not candidates:
            return None, 0
        count, worker = max(candidates, key=lambda item: item[0])
        return worker, count


def _matcher_for(holdings: Holders) -> Matcher | None:
    """The compiled core's `Matcher` for an index, where this process has the core: a usual
    query (`PrefixIndex.match` decides which are) in one call, which walks, counts and makes
    the `Match` as a copy of the usual answer the index gives it (`PrefixIndex._answers_changed`);
    it declines (None) token ids that are not a list of exact ints, which the general path
    keys (a string as its digest)."""
    if holdings.table is None or compiled.core is None:
        return None
    matcher: Matcher = compiled.core.Matcher(holdings.table, holdings.block_size)
    return matcher


# Where a walk looks a key up: the real holders, and the predicted ones (or None)
Lookup = tuple[HolderMap, dict[int, int] | None]
# A walk's answer: (depth, the workers holding every block so far) each time those change, the
# last with none where nobody holds a block; and the request's number of blocks
Walked = tuple[list[tuple[int, int]], int]


def _leading_counts(
    holders: Lookup,
    token_ids: Sequence[int | str],
    lora_name: str | None,
    extra_keys: Sequence[Any] | None,
    cache_salt: str | None,
    mm_keys: Sequence[Sequence[MMKey]] | None,
    size: int,
    bits: Bits,
    lookahead: int = 0,
    keys_out: list[int] | None = None,
) -> dict[Worker, int]:
    """For each worker, how many leading full blocks of the request `holders` says it holds,
    the blocks keyed with the `lookahead` tokens after each (a block without them all has no
    key: the request's end); `keys_out` gets the keys walked, the first one nobody holds too.
    The plain walk (no identities, no lookahead) is compiled where `compiled.core` is."""
    key = root_key(lora_name, cache_salt)
    plain = extra_keys is None and mm_keys is None and not lookahead
    walked: Walked | None = None
    if plain and compiled.core is not None:  # None: a token id it leaves to the pure walk
        walked = compiled.core.walk(*holders, key, token_ids, size, keys_out)
    if walked is None:
        request = (token_ids, extra_keys, mm_keys)
        walked = _walk(holders, key, request, size, lookahead, keys_out)
    return counts_of(walked, bits)


def counts_of(walked: Walked, bits: Bits) -> dict[Worker, int]:
    """A walk's changes as each worker's count of leading blocks (the compiled `leading` makes
    the same counts, in the same order)."""
    changes, blocks = walked
    workers_of = bits.workers_of
    counts: dict[Worker, int] = {}
    active = -1  # every worker, until the first block says otherwise
    for depth, held in changes:  # some workers' prefixes end at `depth`
        if depth:
            counts.update(dict.fromkeys(workers_of(active & ~held), depth))
        if not held:
            return counts
        active = held
    if blocks and active > 0:
        counts.update(dict.fromkeys(workers_of(active), blocks))
    return counts


def _walk(
    holders: Lookup,
    root: int,
    request: tuple[Sequence[int | str], Sequence[Any] | None, Sequence[Sequence[MMKey]] | None],
    size: int,
    lookahead: int,
    keys_out: list[int] | None,
) -> Walked:
    """The walk in Python, the reference, over `block_keys.walk_keys`' keys."""
    token_ids, extra_keys, mm_keys = request
    real, predicted = holders
    get = real.get if predicted is None else _either(real.get, predicted.get)
    changes: list[tuple[int, int]] = []
    active = -1
    blocks = max(0, (len(token_ids) - lookahead) // size)
    for depth, key in enumerate(walk_keys(root, token_ids, size, extra_keys, mm_keys, lookahead)):
        if keys_out is not None:
            keys_out.append(key)
        held = active & get(key, 0)
        if held != active:
            changes.append((depth, held))
            if not held:
                break
            active = held
    return changes, blocks


# A query: its token ids, LoRA name, extra keys, cache salt and multimodal keys; and how counts
# are answered: the index's block size, and which worker each bit of a mask stands for.
Request = tuple[
    Sequence[int | str],
    str | None,
    Sequence[Any] | None,
    str | None,
    Sequence[Sequence[MMKey]] | None,
]
Answer = tuple[int, Bits]


def _walked_match(
    holdings: Holders, lookaheads: set[int], stale: frozenset[Worker], request: Request
) -> Match:
    """The general path of `PrefixIndex.match`: the walk (one a lookahead size, and each
    hybrid worker's engine answer, where there are such workers), then the walk over the
    predictions too where some are in force."""
    size, predictions = holdings.block_size, holdings.predictions
    answer: Answer = (size, holdings.bits)
    lower: dict[Worker, int] = {}
    if holdings.hybrids or lookaheads:
        real, lower = _engine_answers(holdings, lookaheads, request, answer)
    else:
        real = _leading_counts((holdings.holders, None), *request, *answer)
    if predictions.masks:
        predictions.expire()
    if not predictions.masks:  # one walk, on the real blocks only
        return Match(real, stale, None, lower, size, holdings.known)
    counts = {**real}
    for worker, count in _leading_counts(
        (holdings.holders, predictions.masks), *request, *answer
    ).items():
        counts[worker] = max(count, real.get(worker, 0))
    predicted = {w: n - real.get(w, 0) for w, n in counts.items() if n > real.get(w, 0)}
    return Match(counts, stale, predicted, lower, size, holdings.known)


def _engine_answers(
    holdings: Holders,
    lookaheads: set[int],
    request: Request,
    answer: Answer,
) -> tuple[dict[Worker, int], dict[Worker, int]]:
    """Each worker's count when some have hybrid groups, lower tiers or lookahead hashing: a
    walk per lookahead size (a worker's blocks are keyed with its own), then each hybrid
    worker's engine answer from its groups' holdings, within its leading run where a group
    needs every block before a hit; and how many of each count only lower tiers hold."""
    token_ids, size = request[0], answer[0]
    keys_by: dict[int, list[int]] = {}
    counts: dict[Worker, int] = {}
    for lookahead in (0, *sorted(lookaheads)):
        keys: list[int] = []
        walked = _leading_counts(
            (holdings.holders, None), *request, *answer, lookahead=lookahead, keys_out=keys
        )
        keys_by[lookahead] = keys
        for worker, count in walked.items():
            counts[worker] = max(count, counts.get(worker, 0))
    lower: dict[Worker, int] = {}
    for worker, worker_blocks in holdings.hybrids.items():
        hybrid = worker_blocks.hybrid
        assert hybrid is not None
        longest = max(0, (len(token_ids) - worker_blocks.lookahead) // size)
        if len(hybrid.groups.rules()) > 1:  # the engine computes a prompt's last token: vLLM's cap
            longest = min(longest, (len(token_ids) - 1) // size)
        reach = min(counts.get(worker, 0), longest) if hybrid.groups.prefix_closed() else longest
        keys = keys_by.get(worker_blocks.lookahead, [])
        if len(keys) < reach:
            keys = _request_keys(request, size, worker_blocks.lookahead, reach)
        every, device = hybrid.hit(keys, reach)
        if every:
            counts[worker] = every
        else:
            counts.pop(worker, None)
        if every > device:
            lower[worker] = every - device
    return counts, lower


def _request_keys(request: Request, size: int, lookahead: int, count: int) -> list[int]:
    """The request's first `count` block keys (fewer, if it has fewer blocks)."""
    token_ids, lora_name, extra_keys, cache_salt, mm_keys = request
    root, found = request_contents(
        token_ids, size, count, lora_name, cache_salt, extra_keys, mm_keys, lookahead
    )
    return [key for key in compiled.chain(root, found) if key is not None]


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
    unplaced: int = 0  # hashes of stores that skip blocks, found in no other group: not filed
    unknown_groups: int = 0  # KV cache groups whose kind (or window) tskv does not know


def checked_block_size(block_size: object) -> int:
    """`block_size` as an index takes it, or the ConfigError naming the range."""
    if (
        isinstance(block_size, bool)
        or not isinstance(block_size, int)
        or not 1 <= block_size <= MAX_BLOCK_SIZE
    ):
        raise ConfigError(
            f"block_size = {block_size!r} must be an int from 1 to {MAX_BLOCK_SIZE} (tokens "
            "a block)"
        )
    return block_size


class BlockIndex:
    """Many workers' blocks as their KV event streams say, and whether each is to be trusted:
    what every index keeps. `PrefixIndex` answers queries from it; a watcher's reader process
    keeps a `JournalIndex`, which sends its holds on to the `PrefixIndex` that mirrors them."""

    def __init__(self, holdings: Holdings, predictions: Predictions, dynamo_hashes: bool) -> None:
        self.block_size = holdings.block_size
        # Dynamo's block hashes of the blocks, kept beside them where asked for (`tskv serve
        # --dynamo-hashes`): learned from the same events, cleared and dropped with them
        self.dynamo = DynamoHashes(holdings.block_size) if dynamo_hashes else None
        self._predictions = predictions
        self._holdings = holdings
        self._filing = Filing(holdings)
        self._views: dict[Worker, WorkerView] = {}  # each worker's trust, `worker_view`
        self._stale: set[Worker] = set()  # the workers whose view is stale, for answers
        self._strings = False  # a string token id was seen: queries' string ones are digested
        self._lookaheads: set[int] = set()  # lookahead sizes some worker's hashes cover

    # -- the stream's side ------------------------------------------------------------------

    def apply(self, worker: Worker, batch: KVEventBatch | ReadBatch | Iterable[KVEvent]) -> None:
        """Apply one batch of `worker`'s events, in order. An AllBlocksCleared makes the
        worker's view whole again (from there on the index knows its whole cache), unless a
        snapshot is being applied (`worker_view`)."""
        if self.dynamo is not None:  # the events read twice (a ReadBatch's decoded again)
            if not isinstance(batch, (KVEventBatch, ReadBatch)):
                batch = list(batch)
            self.dynamo.apply(worker, batch if isinstance(batch, list) else batch.events)
        if isinstance(batch, ReadBatch):  # a watcher's: the compiled core read it
            filed = self._filing.apply_read(worker, batch)
        else:
            events = batch.events if isinstance(batch, KVEventBatch) else batch
            filed = self._filing.apply(worker, events)
        self._strings = self._strings or filed.strings
        self._add_lookahead(filed.lookahead)
        if filed.cleared:
            self.carry_out(worker, self.worker_view(worker).reset_applied())

    def set_groups(self, worker: Worker, groups: Mapping[int, CacheGroup]) -> None:
        """Tell the index `worker`'s KV cache groups, by group index, for an engine whose
        events do not say their kinds (or not their windows: chunked local attention's chunk
        is never sent). What is told stands; what events say fills in the rest."""
        checked = checked_groups(groups, self.block_size)
        hybrid = self._filing.make_hybrid(worker, self._holdings.blocks_of(worker))
        for index, group in checked.items():
            hybrid.groups.set(index, group, told=True)

    def lookahead(self, worker: Worker) -> int:
        """How many tokens after each block `worker`'s engine hashes with it (0: none)."""
        worker_blocks = self._holdings.workers.get(worker)
        return 0 if worker_blocks is None else worker_blocks.lookahead

    def groups(self, worker: Worker) -> dict[int, CacheGroup]:
        """The KV cache groups the index knows `worker` has, learned or told (none: a plain
        worker, one group of full attention, or its events never named one)."""
        worker_blocks = self._holdings.workers.get(worker)
        hybrid = None if worker_blocks is None else worker_blocks.hybrid
        return {} if hybrid is None else dict(hybrid.groups.groups)

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
            self._holdings.blocks_of(worker)  # a worker known only by its trust is known
            view = self._views[worker] = WorkerView()
        return view

    def carry_out(self, worker: Worker, changes: Changes) -> None:
        """Do what the worker's view decided: forget its blocks, mark it stale or current."""
        for change in changes:
            if change is ViewChange.CLEAR:
                self.clear_worker(worker)
            else:
                self._set_stale(worker, change is ViewChange.STALE)

    def clear_worker(self, worker: Worker) -> None:
        """Forget what `worker` holds (its engine restarted with an empty cache), keeping it."""
        self.clear_workers((worker,))

    def clear_workers(self, workers: Iterable[Worker]) -> None:
        """`clear_worker` for many at once: for workers whose blocks are kept elsewhere, one
        pass over every key for all of them."""
        known = [worker for worker in workers if worker in self._holdings.workers]
        self._holdings.clear(*[self._holdings.workers[worker] for worker in known])
        if self.dynamo is not None:
            for worker in known:
                self.dynamo.clear(worker)

    def remove_worker(self, worker: Worker) -> None:
        self._holdings.drop(worker)
        if self.dynamo is not None:
            self.dynamo.drop(worker)
        self._views.pop(worker, None)
        self._set_stale(worker, False)

    def _add_lookahead(self, lookahead: int) -> None:
        """A worker's engine hashes `lookahead` tokens after each block (0: none)."""
        if lookahead and lookahead not in self._lookaheads:
            self._lookaheads.add(lookahead)
            self._answers_changed()

    def _set_stale(self, worker: Worker, stale: bool) -> None:
        """The one place the stale workers change: answers carry them."""
        if (worker in self._stale) != stale:
            (self._stale.add if stale else self._stale.discard)(worker)
            self._answers_changed()

    def _answers_changed(self) -> None:
        """What a query's answer depends on changed: the workers, the stale ones, which are
        hybrid, the lookaheads (nothing to do here; a `PrefixIndex` tells its Matcher)."""

    # -- what the index holds ---------------------------------------------------------------

    @property
    def workers(self) -> list[Worker]:
        return list(self._holdings.workers)

    @property
    def seen_strings(self) -> bool:
        """Whether a string token id was ever stored (queries then digest theirs)."""
        return self._strings

    @property
    def stale(self) -> frozenset[Worker]:
        return frozenset(self._stale)

    def engine_hashes(self, worker: Worker) -> set[int]:
        """The engine's hashes of the blocks `worker` holds, as its stream says."""
        worker_blocks = self._holdings.workers.get(worker)
        if worker_blocks is None:
            return set()
        if worker_blocks.mirrored:
            raise TskvLookupError(
                f"worker {worker!r}'s blocks are kept by a watcher's reader process; "
                "ask the watcher: await watcher.engine_hashes(worker)"
            )
        return {block if isinstance(block, int) else block[-1] for block in worker_blocks.blocks}

    def blocks_by_medium(self, worker: Worker) -> dict[str | None, int] | None:
        """How many blocks `worker` holds in each storage medium (None: the event named none),
        its groups' copies counted apart (None where a reader process keeps them)."""
        worker_blocks = self._holdings.workers.get(worker)
        return {} if worker_blocks is None else worker_blocks.by_medium()

    def __len__(self) -> int:
        """Distinct blocks (by content) held by any worker (0 in a `JournalIndex`: the index
        that mirrors it counts them)."""
        return len(self._holdings)

    def statistics(self) -> IndexStatistics:
        return IndexStatistics(
            workers=len(self._holdings.workers),
            stale=len(self._stale),
            predicted=len(self._predictions),
            blocks=len(self._holdings),
            orphans=self._filing.orphans,
            mismatched=self._filing.mismatched,
            unplaced=self._filing.unplaced,
            unknown_groups=sum(
                worker_blocks.hybrid.groups.unknown
                for worker_blocks in self._holdings.hybrids.values()
                if worker_blocks.hybrid is not None
            ),
        )


class PrefixIndex(BlockIndex):
    """A prefix index over many workers' KV event streams: which worker holds the longest
    prefix of a request."""

    def __init__(
        self,
        block_size: int = 16,
        *,
        clock: Callable[[], float] = time.monotonic,
        max_predicted: int = MAX_PREDICTED,
        dynamo_hashes: bool = False,
    ) -> None:
        int_at_least("max_predicted", max_predicted, 0)
        predictions = Predictions(clock, max_predicted)  # their time to live is `clock`'s
        holdings = Holders(checked_block_size(block_size), predictions)
        super().__init__(holdings, predictions, dynamo_hashes)
        self._holders = holdings
        self._mirror = Mirror(holdings)
        self._matcher = _matcher_for(holdings)
        # The fast path's one state: the Matcher while a query with no per-block identity is a
        # usual one (no worker hybrid, none hashing with lookahead, no predictions in force)
        self._fast: Matcher | None = None
        holdings.on_answers_changed = self._answers_changed
        predictions.on_in_force_changed = self._fast_path_changed
        self._answers_changed()

    def _answers_changed(self) -> None:
        """Give the Matcher the workers and what each usual answer copies, a `Match` made by its
        constructor; and open or close the fast path."""
        if self._matcher is not None:
            holdings = self._holdings
            usual = Match({}, frozenset(self._stale), None, None, self.block_size, holdings.known)
            self._matcher.set_answer(holdings.bits.by_position, usual)
        self._fast_path_changed()

    def _fast_path_changed(self) -> None:
        """Called wherever a condition of the fast path changes (see `_fast`)."""
        general = self._holdings.hybrids or self._lookaheads or self._predictions.masks
        self._fast = None if general else self._matcher

    def apply_changes(
        self,
        worker: Worker,
        runs: Sequence[Sequence[int]],
        ops: Sequence[Op] = (),
        *,
        strings: bool = False,
        lookahead: int = 0,
    ) -> None:
        """Mirror another index's `take_changes` for `worker`, whose blocks that index keeps
        (a watcher's reader process); a run may also come as bytes, its keys packed 8 bytes
        each in this machine's order; `strings`: that index has seen string token ids;
        `lookahead`: the worker's engine hashes that many tokens after each block."""
        self._strings = self._strings or strings
        worker_blocks = self._holdings.blocks_of(worker)
        worker_blocks.lookahead = lookahead
        self._add_lookahead(lookahead)
        self._mirror.apply(worker, worker_blocks, runs, ops)

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
        fast = self._fast  # the Matcher, where the fast path is open (`_fast_path_changed`)
        if fast is not None and extra_keys is None and mm_keys is None:
            plain = lora_name is None and cache_salt is None
            key = PLAIN_ROOT if plain else root_key(lora_name, cache_salt)
            answer: Match | None = fast(key, token_ids)  # None: what it cannot read in C
            if answer is not None:
                return answer
        if type(token_ids) is not list and (  # a list, the usual: no check against the ABC
            isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Sequence)
        ):
            raise TskvTypeError(
                f"token_ids = {token_ids!r:.60} must be a sequence of token ids (a list of ints)"
            )
        if self._strings:
            token_ids, _ = int_tokens(token_ids)
        request: Request = (token_ids, lora_name, extra_keys, cache_salt, mm_keys)
        return _walked_match(self._holders, self._lookaheads, frozenset(self._stale), request)

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
        bit, holders = self._holdings.blocks_of(worker).bit, self._holders.holders
        size = self.block_size
        count = len(token_ids) // size
        request = (token_ids, lora_name, extra_keys, cache_salt, mm_keys)
        keys = _request_keys(request, size, 0, count)
        fresh = [key for key in keys if not holders.get(key, 0) & bit]
        self._predictions.add(bit, fresh, ttl)
