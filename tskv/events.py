"""The KV-cache events a scheduler reports, and the batch that carries one round of them.

Values are checked when an event is built, so a bad hash or token id fails in the scheduler
that made it (with the field and the value named) instead of in a consumer far away.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable

import attrs

HASH_MIN = -(2**63)
HASH_LIMIT = 2**64
TOKEN_MIN = -(2**31)
TOKEN_LIMIT = 2**31


def _bad_int(field: str, index: int, value: object, lo: int, hi: int) -> ValueError | TypeError:
    where = f"{field}[{index}]"
    if isinstance(value, bool) or not isinstance(value, int):
        return TypeError(f"{where} must be an int, got {value!r} ({type(value).__name__})")
    return ValueError(f"{where} = {value} is outside [{lo}, {hi}); use a value in that range")


def _int_tuple(field: str, values: Iterable[int], lo: int, hi: int) -> tuple[int, ...]:
    """Return `values` as a tuple of ints in [lo, hi), or raise naming the first bad one.

    The common case (plain ints in range) is checked with C-speed builtins, since a long
    prefill carries tens of thousands of token ids per event.
    """
    if isinstance(values, (str, bytes)):
        raise TypeError(f"{field} must be a sequence of ints, got {values!r}")
    try:
        items = tuple(values)
    except TypeError:
        raise TypeError(f"{field} must be a sequence of ints, got {values!r}") from None
    if set(map(type, items)) <= {int} and (not items or (min(items) >= lo and max(items) < hi)):
        return items
    converted = []
    for index, value in enumerate(items):
        if isinstance(value, bool):
            raise _bad_int(field, index, value, lo, hi)
        try:
            as_int = value.__index__()  # numpy integers and friends
        except (AttributeError, TypeError):
            raise _bad_int(field, index, value, lo, hi) from None
        if not lo <= as_int < hi:
            raise _bad_int(field, index, as_int, lo, hi)
        converted.append(as_int)
    return tuple(converted)


def _token_ids(values: Iterable[int]) -> tuple[int, ...]:
    # array('i') range-checks int32 in C; fall back to the naming path on any failure.
    if isinstance(values, (list, tuple)):
        try:
            return tuple(array("i", values).tolist())
        except (TypeError, OverflowError):
            pass
    return _int_tuple("token_ids", values, TOKEN_MIN, TOKEN_LIMIT)


def _block_hashes(values: Iterable[int]) -> tuple[int, ...]:
    return _int_tuple("block_hashes", values, HASH_MIN, HASH_LIMIT)


def _parent_hash(value: int | None) -> int | None:
    if value is None or (type(value) is int and HASH_MIN <= value < HASH_LIMIT):
        return value
    return _int_tuple("parent_block_hash", (value,), HASH_MIN, HASH_LIMIT)[0]


def _int_at_least(field: str, value: object, lowest: int, meaning: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{field} must be an int, got {value!r}")
    if value < lowest:
        raise ValueError(f"{field} = {value} must be at least {lowest} ({meaning})")
    return value


def _block_size(value: int) -> int:
    return _int_at_least("block_size", value, 1, "tokens per block")


@attrs.frozen(slots=True)
class BlockStored:
    """Blocks newly cached, in chain order; `parent_block_hash` is the block before the first.

    `token_ids` need not fill `len(block_hashes) * block_size`: schedulers emit per-page events.
    """

    block_hashes: tuple[int, ...] = attrs.field(converter=_block_hashes)
    parent_block_hash: int | None = attrs.field(converter=_parent_hash)
    token_ids: tuple[int, ...] = attrs.field(converter=_token_ids)
    block_size: int = attrs.field(converter=_block_size)
    # The event as its msgpack array holds it, built once: events are immutable, and building
    # it on every publish was a visible share of a large round's cost.
    wire: tuple[object, ...] = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        wire = ("BlockStored", self.block_hashes, self.parent_block_hash, self.token_ids)
        object.__setattr__(self, "wire", (*wire, self.block_size))


@attrs.frozen(slots=True)
class BlockRemoved:
    """Blocks evicted from the cache."""

    block_hashes: tuple[int, ...] = attrs.field(converter=_block_hashes)
    wire: tuple[object, ...] = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "wire", ("BlockRemoved", self.block_hashes))


@attrs.frozen(slots=True)
class AllBlocksCleared:
    """The whole prefix cache was reset; consumers forget every block of this worker."""

    wire: tuple[object, ...] = attrs.field(
        init=False, default=("AllBlocksCleared",), eq=False, repr=False
    )


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
EVENT_TYPES = (BlockStored, BlockRemoved, AllBlocksCleared)


def _ts(value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"ts must be a float (seconds since the epoch), got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"ts = {value} must be finite (seconds since the epoch)")
    return value


def not_an_event(where: str, value: object) -> TypeError:
    """The error for a foreign object where a KV event belongs, naming the fix."""
    return TypeError(
        f"{where} = {value!r} is not a BlockStored, BlockRemoved or AllBlocksCleared; translate "
        "scheduler objects with tskv.scheduler_kv_event_to_wire_event"
    )


def _events(values: Iterable[KVEvent]) -> tuple[KVEvent, ...]:
    items = tuple(values)
    for index, event in enumerate(items):
        if not isinstance(event, EVENT_TYPES):
            raise not_an_event(f"events[{index}]", event)
    return items


def _rank(value: int | None) -> int | None:
    return None if value is None else _int_at_least("attn_dp_rank", value, 0, "a rank")


@attrs.frozen(slots=True)
class KVEventBatch:
    """One scheduling round's events, stamped with the round's time and the publishing rank."""

    ts: float = attrs.field(converter=_ts)
    events: tuple[KVEvent, ...] = attrs.field(converter=_events)
    attn_dp_rank: int | None = attrs.field(default=None, converter=_rank)
