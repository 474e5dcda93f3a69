"""Each worker's blocks by Dynamo's own block hashes, for the two routes of Dynamo's indexer
that speak them (`/query_by_hash`, `/dump`). No I/O.

Dynamo names a block by its `tokens_hash`: XXH3-64 with seed 1337 of the block's token ids as
u32 little-endian, the block alone, and a prefix by the list of those. tskv's index keys a block
by its content under its parent's key and keeps no token ids, so these hashes cannot be made
from it afterwards: this ledger learns them from the same events, beside the index, for a
service that asks for it (`tskv serve --dynamo-hashes`; it costs memory a block the index does
not spend). Its answers count tiers as tskv's `/query` does.

Under a LoRA adapter Dynamo seeds the hash with the adapter name's XXH3 (seed 0) plus 1337,
found by matching `compute_block_hash_for_seq(tokens, size, lora_name=...)` of
ai-dynamo-runtime 1.6.1 and checked against it (tests/interop/test_service_dropin.py). A
cache salt, multimodal items and extra keys it mixes in ways not matched here (it drops a
store with extra keys); a block with any of them (or a token id outside u32, or an engine hash
outside u64) is left out and counted (`left_out`), never guessed.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from tskv.core.block_keys import block_key, blocks_of
from tskv.core.errors import TskvImportError
from tskv.core.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

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
Store = tuple[str, "int | None", int, int]  # (tier, parent engine hash, engine hash, tokens hash)


def dynamo_tier(medium: str | None) -> str:
    """Dynamo's tier for an engine's medium: the GPU's (or none named) is the device's, a CPU's
    host memory, anything else below."""
    if medium is None or medium.upper() == "GPU":
        return DEVICE
    return HOST if medium.upper().startswith("CPU") else DISK


def tokens_hash(tokens: Sequence[int], lora_name: str | None = None) -> int:
    """One block's hash as Dynamo makes it; under a LoRA adapter, seeded with the adapter's
    name's XXH3 (seed 0) plus 1337 (an empty name is none)."""
    if _xxh3 is None:
        raise TskvImportError("Dynamo's block hashes need xxhash: pip install 'tskv-trio[serve]'")
    seed = SEED if not lora_name else (_xxh3(lora_name.encode(), seed=0) + SEED) & U64
    return _xxh3(struct.pack(f"<{len(tokens)}I", *tokens), seed=seed)


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
        # each worker's blocks whose Dynamo hash is not known here (the module's docstring)
        self._left_out: dict[Worker, int] = {}

    def apply(self, worker: Worker, events: Iterable[KVEvent]) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                self._store(worker, event)
            elif isinstance(event, BlockRemoved):
                self._remove(worker, [(h, dynamo_tier(event.medium)) for h in event.block_hashes])
            elif isinstance(event, AllBlocksCleared):
                self.clear(worker)

    def _store(self, worker: Worker, event: BlockStored) -> None:
        held = self._blocks.setdefault(worker, {})
        count = len(event.block_hashes)
        if not _plain(event) or event.block_size != self.block_size:
            self._leave_out(worker, count)
            return
        parent, node, depth = event.parent_block_hash, _ROOT, 0
        if parent is not None:
            found = _node_of(held, parent)
            if found is None:  # Dynamo skips a store whose parent it does not hold
                self._leave_out(worker, count)
                return
            node, depth = found
        tier = dynamo_tier(event.medium)
        blocks = list(blocks_of(event.token_ids, self.block_size))[:count]
        for filed, (engine_hash, tokens) in enumerate(
            zip(event.block_hashes, blocks, strict=False)
        ):
            if type(engine_hash) is not int or not 0 <= engine_hash <= U64:
                self._leave_out(worker, count - filed)
                return
            local = tokens_hash(tokens, event.lora_name)
            node, depth = block_key(node, local), depth + 1
            if (engine_hash, tier) in held:
                self._remove(worker, [(engine_hash, tier)])
            held[engine_hash, tier] = (node, parent, local, depth)
            self._holders.setdefault(node, {}).setdefault(worker, [0, 0])[tier != DEVICE] += 1
            parent = engine_hash
        self._leave_out(worker, count - len(blocks))

    def _leave_out(self, worker: Worker, count: int) -> None:
        if count:
            self._left_out[worker] = self._left_out.get(worker, 0) + count

    @property
    def left_out(self) -> int:
        """Blocks whose Dynamo hash is not known here, of every worker."""
        return sum(self._left_out.values())

    def left_out_of(self, worker: Worker) -> int:
        return self._left_out.get(worker, 0)

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
        self._left_out.pop(worker, None)

    def match(self, hashes: Sequence[int]) -> tuple[dict[Worker, int], dict[Worker, int]]:
        """How many of the prefix's leading blocks each worker holds in any tier, and how many
        of those are past its leading run on the device (the `lower` of tskv's `Match`)."""
        first = next(nodes_of(hashes[:1]), None)
        found = {w: self.held(w, hashes) for w in self._holders.get(first, ())}  # type: ignore[arg-type]
        return {w: n for w, (n, _) in found.items()}, {w: n for w, (_, n) in found.items() if n}

    def held(self, worker: Worker, hashes: Sequence[int]) -> tuple[int, int]:
        """How many of the prefix's leading blocks `worker` holds in any tier, and how many of
        those are past its leading run on the device."""
        total = device = 0
        for depth, node in enumerate(nodes_of(hashes)):
            copies = self._holders.get(node, {}).get(worker)
            if not copies:
                break
            total = depth + 1
            if copies[0] and device == depth:
                device = depth + 1
        return total, total - device

    def stores(self, worker: Worker) -> list[Store]:
        """The worker's blocks as stores Dynamo's tree can apply again, parents first: (tier,
        parent engine hash, engine hash, tokens hash) each."""
        held = sorted(self._blocks.get(worker, {}).items(), key=lambda item: item[1][3])
        return [(tier, parent, engine, local) for (engine, tier), (_, parent, local, _) in held]

    def workers(self) -> list[Worker]:
        return list(self._blocks)


def _plain(event: BlockStored) -> bool:
    """Whether Dynamo's hash of the event's blocks is their token ids' alone."""
    if event.extra_keys or event.mm_keys or event.cache_salt:
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


def answer(ledger: DynamoHashes | None, worker: Worker, hashes: list[int] | None) -> list[Any]:
    """What `ledger` keeps of `worker`, as plain lists (a reader process sends them as they
    are): [left out, [store, ...]] when `hashes` is None (`stores`), else [held, past the
    device's run] for the prefix `hashes` names (`held`); [] where no ledger is kept."""
    if ledger is None:
        return []
    if hashes is None:
        return [ledger.left_out_of(worker), [list(store) for store in ledger.stores(worker)]]
    return list(ledger.held(worker, hashes))


def stored_event(instance: int, rank: int, number: int, store: Store | list[Any]) -> dict[str, Any]:
    """One block as a store event of Dynamo's `/dump`, which its tree applies again."""
    tier, parent, engine, local = store
    block = {"block_hash": engine, "tokens_hash": local, "mm_extra_info": None}
    stored = {"parent_hash": parent, "start_position": None, "blocks": [block]}
    return {
        "worker_id": instance,
        "storage_tier": tier,
        "residency_domain": "worker",
        "event": {"event_id": number, "data": {"stored": stored}, "dp_rank": rank},
    }
