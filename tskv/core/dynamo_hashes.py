"""Each worker's blocks by Dynamo's own block hashes, for the two routes of Dynamo's indexer
that speak them (`/query_by_hash`, `/dump`). No I/O.

Dynamo names a block by its `tokens_hash`: XXH3-64 with seed 1337 of the block's token ids as
u32 little-endian, the block alone, and a prefix by the list of those. tskv's index keys a block
by its content under its parent's key and keeps no token ids, so these hashes cannot be made
from it afterwards: this ledger learns them from the same events, beside the index, for a
service that asks for it (`tskv serve --dynamo-hashes`; it costs memory a block the index does
not spend). Its answers count tiers as tskv's `/query` does.

Dynamo mixes a LoRA name, a cache salt, multimodal items and extra keys into its hash in ways
its code does not document; a block with any of them (or a token id outside u32, or an engine
hash outside u64) is left out here and counted (`left_out`), never guessed.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from tskv.core.block_keys import blocks_of
from tskv.core.errors import TskvImportError
from tskv.core.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, KVEventBatch
from tskv.core.prefix_index import PrefixIndex
from tskv.core.read_batch import ReadBatch

_xxh3: Callable[..., int] | None
try:
    from xxhash import xxh3_64_intdigest as _found

    _xxh3 = _found
except ImportError:  # pragma: no cover - the serve extra installs it
    _xxh3 = None

SEED = 1337  # Dynamo's (lib/kv-router: XXH3_SEED)
U64 = (1 << 64) - 1
_ROOT = hash(("tskv-dynamo-root",))  # the node a chain of block hashes hangs from
DEVICE, HOST, DISK = "device", "host_pinned", "disk"  # Dynamo's storage tiers
Worker = Any


def tier_of(medium: str | None) -> str:
    """Dynamo's tier for an engine's medium: the GPU's (or none named) is the device's, a CPU's
    host memory, anything else below."""
    if medium is None or medium.upper() == "GPU":
        return DEVICE
    return HOST if medium.upper().startswith("CPU") else DISK


def tokens_hash(tokens: Sequence[int]) -> int:
    """One block's hash as Dynamo makes it."""
    if _xxh3 is None:
        raise TskvImportError("Dynamo's block hashes need xxhash: pip install 'tskv-trio[serve]'")
    return _xxh3(struct.pack(f"<{len(tokens)}I", *tokens), seed=SEED)


def nodes_of(hashes: Iterable[int]) -> Iterator[int]:
    """The chain of a prefix's block hashes, one node a block: the same prefix, the same nodes."""
    node = _ROOT
    for each in hashes:
        node = hash((node, each & U64))  # Dynamo's clients send them as i64
        yield node


class DynamoHashes:
    """What each worker holds, as Dynamo's tree would file it: by engine hash and tier, each
    block's node (its prefix), its parent's engine hash and its own tokens hash."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        # worker -> (engine hash, tier) -> (node, parent engine hash, tokens hash, depth)
        self._blocks: dict[Worker, dict[tuple[int, str], tuple[int, int | None, int, int]]] = {}
        # node -> worker -> [copies on the device, copies below it]
        self._holders: dict[int, dict[Worker, list[int]]] = {}
        self.left_out = 0  # blocks whose Dynamo hash is not known here (module docstring)

    def apply(self, worker: Worker, events: Iterable[KVEvent]) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                self._store(worker, event)
            elif isinstance(event, BlockRemoved):
                self._remove(worker, [(h, tier_of(event.medium)) for h in event.block_hashes])
            elif isinstance(event, AllBlocksCleared):
                self.clear(worker)

    def _store(self, worker: Worker, event: BlockStored) -> None:
        held = self._blocks.setdefault(worker, {})
        count = len(event.block_hashes)
        if not _plain(event) or event.block_size != self.block_size:
            self.left_out += count
            return
        parent, node, depth = event.parent_block_hash, _ROOT, 0
        if parent is not None:
            found = _node_of(held, parent)
            if found is None:  # Dynamo skips a store whose parent it does not hold
                self.left_out += count
                return
            node, depth = found
        tier = tier_of(event.medium)
        blocks = list(blocks_of(event.token_ids, self.block_size))[:count]
        for filed, (engine_hash, tokens) in enumerate(
            zip(event.block_hashes, blocks, strict=False)
        ):
            if type(engine_hash) is not int or not 0 <= engine_hash <= U64:
                self.left_out += count - filed
                return
            local = tokens_hash(tokens)
            node, depth = hash((node, local)), depth + 1
            if (engine_hash, tier) in held:
                self._remove(worker, [(engine_hash, tier)])
            held[engine_hash, tier] = (node, parent, local, depth)
            self._holders.setdefault(node, {}).setdefault(worker, [0, 0])[tier != DEVICE] += 1
            parent = engine_hash
        self.left_out += count - len(blocks)

    def _remove(self, worker: Worker, ids: Iterable[tuple[int, str]]) -> None:
        held = self._blocks.get(worker, {})
        for each in ids:
            block = held.pop(each, None)
            if block is None:
                continue
            holders = self._holders[block[0]]
            copies = holders[worker]
            copies[each[1] != DEVICE] -= 1
            if not any(copies):
                del holders[worker]
                if not holders:
                    del self._holders[block[0]]

    def clear(self, worker: Worker) -> None:
        """Forget what `worker` holds, keeping it."""
        self._remove(worker, list(self._blocks.get(worker, ())))

    def drop(self, worker: Worker) -> None:
        self.clear(worker)
        self._blocks.pop(worker, None)

    def match(self, hashes: Sequence[int]) -> tuple[dict[Worker, int], dict[Worker, int]]:
        """How many of the prefix's leading blocks each worker holds in any tier, and how many
        of those are past its leading run on the device (the `lower` of tskv's `Match`)."""
        total: dict[Worker, int] = {}
        device: dict[Worker, int] = {}
        alive: set[Worker] | None = None
        for depth, node in enumerate(nodes_of(hashes)):
            holders = self._holders.get(node)
            if not holders:
                break
            alive = set(holders) if alive is None else alive & holders.keys()
            if not alive:
                break
            for worker in alive:
                total[worker] = depth + 1
                if holders[worker][0] and device.get(worker, 0) == depth:
                    device[worker] = depth + 1
        return total, {w: n - device.get(w, 0) for w, n in total.items() if n > device.get(w, 0)}

    def dump(self, worker: Worker, instance: int, rank: int) -> list[dict[str, Any]]:
        """The worker's blocks as the stores of Dynamo's `/dump` (its tree applies them again),
        parents first, a block each."""
        held = sorted(self._blocks.get(worker, {}).items(), key=lambda item: item[1][3])
        return [
            {
                "worker_id": instance,
                "storage_tier": tier,
                "residency_domain": "worker",
                "event": {
                    "event_id": number,
                    "data": {
                        "stored": {
                            "parent_hash": parent,
                            "start_position": None,
                            "blocks": [
                                {"block_hash": engine, "tokens_hash": local, "mm_extra_info": None}
                            ],
                        }
                    },
                    "dp_rank": rank,
                },
            }
            for number, ((engine, tier), (_, parent, local, _)) in enumerate(held)
        ]

    def workers(self) -> list[Worker]:
        return list(self._blocks)


def _plain(event: BlockStored) -> bool:
    """Whether Dynamo's hash of the event's blocks is their token ids' alone."""
    if event.lora_name or event.extra_keys or event.mm_keys or event.cache_salt:
        return False
    if event.lookahead_token_ids:
        return False
    tokens = event.token_ids
    return all(type(t) is int and 0 <= t <= 0xFFFFFFFF for t in tokens)


def _node_of(
    held: dict[tuple[int, str], tuple[int, int | None, int, int]], engine_hash: int
) -> tuple[int, int] | None:
    for tier in (DEVICE, HOST, DISK):
        block = held.get((engine_hash, tier))
        if block is not None:
            return block[0], block[3]
    return None


class HashedIndex(PrefixIndex):
    """A `PrefixIndex` that keeps `DynamoHashes` of its workers too, in step: every batch it
    applies, every worker it clears or drops. Only an index that applies events itself can keep
    them (not one that mirrors reader processes)."""

    def __init__(self, block_size: int = 16, **options: Any) -> None:
        super().__init__(block_size, **options)
        self.hashes = DynamoHashes(block_size)

    def apply(self, worker: Worker, batch: KVEventBatch | ReadBatch | Iterable[KVEvent]) -> None:
        if isinstance(batch, (KVEventBatch, ReadBatch)):
            events: Iterable[KVEvent] = batch.events  # a ReadBatch's decoded again: its cost
        else:
            events = batch = list(batch)  # read twice
        super().apply(worker, batch)
        self.hashes.apply(worker, events)

    def clear_worker(self, worker: Worker) -> None:
        super().clear_worker(worker)
        self.hashes.clear(worker)

    def clear_workers(self, workers: Iterable[Worker]) -> None:
        workers = list(workers)
        super().clear_workers(workers)
        for worker in workers:
            self.hashes.clear(worker)

    def remove_worker(self, worker: Worker) -> None:
        super().remove_worker(worker)
        self.hashes.drop(worker)
