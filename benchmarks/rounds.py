"""The rounds a scheduler builds, every round anew: the shapes, the event makers for tskv and
for TokenSpeed's own Structs, and the churning rounds the snapshot figures need."""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import cache
from types import ModuleType
from typing import Any

import tskv
from tskv.core.events import BlockRemoved, BlockStored, KVEvent


def _fast_path() -> ModuleType | None:
    """msgspec, when tskv uses it here (the references then run on the encoder tskv runs; a
    child started with TSKV_CODEC=msgpack measures a machine without it)."""
    if tskv.codec_name() != "msgspec":
        return None
    import msgspec as module

    return module


msgspec = _fast_path()
Row = dict[str, Any]

BLOCK = 16  # tokens a block: the index's figures and the fleet's
SHAPES = {"small": (10, 4, 64), "large": (200, 4, 64), "huge": (1, 2048, 32_768)}


ROUNDS = {"small": 20_000, "large": 2_000, "huge": 300}


SCRAMBLE = 0x9E3779B97F4A7C15  # odd: n -> n * SCRAMBLE & HASH_MASK is one-to-one on 63 bits


HASH_MASK = (1 << 63) - 1


class NativeEvent:
    """What a scheduler binding hands over: an object with a kind and the block's data."""

    __slots__ = ("block_hashes", "block_size", "kind", "parent_block_hash", "token_ids")

    def __init__(self, hashes: list[int], parent: int | None, tokens: list[int]) -> None:
        self.kind = "BlockStored"
        self.block_hashes, self.parent_block_hash, self.token_ids = hashes, parent, tokens
        self.block_size = 16


def scheduler_state(shape: str) -> list[tuple[list[int], int | None, list[int]]]:
    """The hashes, parents and token lists a round's events are built from: the scheduler's
    own data, made once (every publisher is handed the same lists). Hashes spread over 63
    bits and token ids above 256, as real ones are: Python shares the ints below 257, so ids
    0..63 would spare every decoder the int objects a real round costs it."""
    events, hashes, tokens = SHAPES[shape]
    chain = [(block + 1) * SCRAMBLE & HASH_MASK for block in range(events * hashes)]
    return [
        (
            chain[n * hashes : (n + 1) * hashes],
            chain[n * hashes - 1] if n else None,
            list(range(1000 + n * tokens, 1000 + (n + 1) * tokens)),
        )
        for n in range(events)
    ]


@cache
def tokenspeed_types() -> tuple[Any, Any, Any]:
    """TokenSpeed's event types as msgspec Structs (array-like, tagged), its batch, and a typed
    decoder for its batches, written here to the same shape."""
    import msgspec

    stored = msgspec.defstruct(
        "Stored",
        [
            ("block_hashes", list[int]),
            ("parent_block_hash", int | None),
            ("token_ids", list[int]),
            ("block_size", int),
        ],
        array_like=True,
        tag="BlockStored",
    )
    batch = msgspec.defstruct(
        "Batch",
        [("ts", float), ("events", list[stored]), ("attn_dp_rank", int | None, None)],  # type: ignore[valid-type]
        array_like=True,
    )
    return stored, batch, msgspec.msgpack.Decoder(batch)


def round_makers(shape: str) -> dict[str, Callable[[], Any]]:
    """Callables that build one round's new events each time they are called."""
    state = scheduler_state(shape)
    native = [NativeEvent(*item) for item in state]
    makers: dict[str, Callable[[], Any]] = {
        "tskv": lambda: [BlockStored(h, p, t, 16) for h, p, t in state],
        "tskv from scheduler objects": lambda: [
            tskv.scheduler_kv_event_to_wire_event(event) for event in native
        ],
    }
    if msgspec is not None:
        stored, batch, _ = tokenspeed_types()

        def translate(event: Any) -> Any:  # as TokenSpeed's own translation does, by kind
            if event.kind == "BlockStored":
                return stored(
                    event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size
                )
            raise TypeError(event.kind)

        makers["TokenSpeed Structs"] = lambda: batch(
            time.time(), [stored(h, p, t, 16) for h, p, t in state], 0
        )
        makers["TokenSpeed from scheduler objects"] = lambda: batch(
            time.time(), [translate(event) for event in native], 0
        )
    return makers


CACHED = {"small": 10_000, "large": 100_000, "huge": 100_000}  # blocks cached in steady state


def blocks_per_round(shape: str) -> int:
    events, hashes, _ = SHAPES[shape]
    return events * hashes


def fill_rounds(shape: str) -> int:
    """Churning rounds after which the cache is full and has turned over once: a steady state."""
    return 2 * CACHED[shape] // blocks_per_round(shape) + 1


def churn_maker(
    shape: str, cached: int | None = None, worker: int = 0
) -> Callable[[], list[KVEvent]]:
    """Rounds as a busy cache makes them: every block new (fresh hashes and token lists, token
    ids above 256 as real ones are, so each is an int object of its own), and once the cache is
    full, as many old blocks removed as were stored. Hashes are spread over 63 bits as an
    engine's are: counting ones would land in neighbouring dict slots and flatter the state."""
    events, hashes, tokens = SHAPES[shape]
    per_round = blocks_per_round(shape)
    window = -(-(cached or CACHED[shape]) // per_round)  # rounds a block stays cached
    counter = iter(range(1 << 62))
    mask = HASH_MASK
    first_token = 1000 + worker * 10_000_000  # each worker's blocks its own content

    def make() -> list[KVEvent]:
        base = next(counter) * per_round
        made: list[KVEvent] = []
        parent = None
        for n in range(events):
            first = base + n * hashes
            made.append(
                BlockStored(
                    [block * SCRAMBLE & mask for block in range(first, first + hashes)],
                    parent,
                    list(range(first_token + base, first_token + base + tokens)),
                    16,
                )
            )
            parent = (first + hashes - 1) * SCRAMBLE & mask
        old = base - window * per_round
        if old >= 0:
            made.append(
                BlockRemoved([block * SCRAMBLE & mask for block in range(old, old + per_round)])
            )
        return made

    return make
