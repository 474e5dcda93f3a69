"""The KV-cache events a scheduler reports, and the batch that carries one round of them.

A scheduler builds new events every round, so building one costs what a msgspec Struct costs
(with msgspec installed they are Structs; without it, slotted attrs classes with the same
fields): the values you pass are kept as they are, nothing is copied or walked. They are checked
when the round is published: each event's kind always, whatever the encoder cannot hold (then
`check_events` names the field), and every value in strict mode (`KVEventsConfig.strict`), which
tests and tskv.testing turn on; docs/performance.md gives what each costs. A decoder checks
everything, always.
"""

from __future__ import annotations

import math
import sys
import typing
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import attrs

from tskv._checks import int_at_least
from tskv._msgspec import msgspec

if TYPE_CHECKING:
    from typing_extensions import dataclass_transform
elif sys.version_info >= (3, 11):
    from typing import dataclass_transform
else:  # the decorator only informs type checkers

    def dataclass_transform(**_: object) -> Callable[[T], T]:
        return lambda decorated: decorated


T = TypeVar("T")

HASH_MIN = -(2**63)
HASH_LIMIT = 2**64
TOKEN_MIN = -(2**31)
TOKEN_LIMIT = 2**31


def _meta(**constraints: int) -> object:
    """Bounds msgspec checks while decoding (and nothing else does: without msgspec the
    decoder checks the same bounds itself)."""
    return None if msgspec is None else msgspec.Meta(**constraints)


Token = Annotated[int, _meta(ge=TOKEN_MIN, le=TOKEN_LIMIT - 1)]
BlockSize = Annotated[int, _meta(ge=1)]
Index = Annotated[int, _meta(ge=0)]


@dataclass_transform(frozen_default=True)
def _record(
    *, tag: bool = False, forbid_unknown_fields: bool = False
) -> Callable[[type[T]], type[T]]:
    """Make a class of annotated fields a frozen record: a msgspec Struct (array-like, as the
    wire is) when msgspec is used, else a slotted attrs class. One declaration, both worlds."""

    def make(cls: type[T]) -> type[T]:
        if msgspec is None:
            if "__post_init__" in cls.__dict__:
                cls.__attrs_post_init__ = cls.__dict__["__post_init__"]  # type: ignore[attr-defined]
            return attrs.frozen(slots=True)(cls)
        hints = typing.get_type_hints(cls, include_extras=True)
        fields = [
            (name, hints[name], cls.__dict__[name]) if name in cls.__dict__ else (name, hints[name])
            for name in cls.__annotations__
        ]
        namespace = {
            key: value for key, value in cls.__dict__.items() if key in ("__doc__", "__post_init__")
        }
        made: type[T] = msgspec.defstruct(
            cls.__name__,
            fields,
            module=cls.__module__,
            namespace=namespace,
            frozen=True,
            array_like=True,
            gc=False,  # events hold ints and strings: they can be in no reference cycle
            tag=tag or None,
            forbid_unknown_fields=forbid_unknown_fields,
            repr_omit_defaults=True,
        )
        return made

    return make


@_record(tag=True)
class BlockStored:
    """Blocks newly cached, in chain order; `parent_block_hash` is the block before the first.

    `token_ids` need not fill `len(block_hashes) * block_size`: schedulers emit per-page events.
    The fields after `block_size` are optional (unset is None) and in vLLM's order: the storage
    tier, LoRA, per-block extra keys, the KV cache group of hybrid models, locality. Only the
    vLLM wire carries them (`KVEventsConfig.wire_format`).
    """

    block_hashes: Sequence[int]
    parent_block_hash: int | None
    token_ids: Sequence[Token]
    block_size: BlockSize
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: Sequence[Sequence[Any] | None] | None = None
    group_idx: Index | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None


@_record(tag=True)
class BlockRemoved:
    """Blocks evicted from the cache (optionally: from which tier, group and locality)."""

    block_hashes: Sequence[int]
    medium: str | None = None
    group_idx: Index | None = None
    locality: str | None = None


@_record(tag=True)
class AllBlocksCleared:
    """The whole prefix cache was reset; consumers forget every block of this worker."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
EVENT_TYPES = (BlockStored, BlockRemoved, AllBlocksCleared)
STORED_OPTIONAL = (
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
)
REMOVED_OPTIONAL = ("medium", "group_idx", "locality")
FIELDS: dict[type, tuple[str, ...]] = {
    BlockStored: ("block_hashes", "parent_block_hash", "token_ids", "block_size", *STORED_OPTIONAL),
    BlockRemoved: ("block_hashes", *REMOVED_OPTIONAL),
    AllBlocksCleared: (),
}
OPTIONAL = frozenset(STORED_OPTIONAL)


def event_fields(event: KVEvent) -> dict[str, Any]:
    """An event's fields by name, the optional ones only when set (as vLLM's maps have them)."""
    return {
        name: getattr(event, name)
        for name in FIELDS[type(event)]
        if name not in OPTIONAL or getattr(event, name) is not None
    }


def _set(record: object, name: str, value: object) -> None:
    """Set a field of a frozen record while it is being made."""
    if msgspec is None:
        object.__setattr__(record, name, value)
    else:
        msgspec.structs.force_setattr(record, name, value)


@_record(forbid_unknown_fields=True)
class KVEventBatch:
    """One scheduling round's events, stamped with the round's time and the publishing rank."""

    ts: float
    events: Sequence[KVEvent]
    attn_dp_rank: Index | None = None

    def __post_init__(self) -> None:  # once per batch, so it may check what is O(1)
        ts = self.ts
        if type(ts) is not float:
            if isinstance(ts, bool) or not isinstance(ts, (int, float)):
                raise TypeError(f"ts must be a float (seconds since the epoch), got {ts!r}")
            _set(self, "ts", float(ts))
        if not math.isfinite(self.ts):
            raise ValueError(f"ts = {self.ts} must be finite (seconds since the epoch)")
        if type(self.events) not in (list, tuple):
            _set(self, "events", list(self.events))  # a generator, say: keep what it gave
        rank = self.attn_dp_rank
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 0):
            raise (TypeError if not isinstance(rank, int) else ValueError)(
                f"attn_dp_rank = {rank!r} must be a non-negative int (a rank) or None"
            )


def not_an_event(where: str, value: object) -> TypeError:
    """The error for a foreign object where a KV event belongs, naming the fix."""
    return TypeError(
        f"{where} = {value!r} is not a BlockStored, BlockRemoved or AllBlocksCleared; translate "
        "scheduler objects with tskv.scheduler_kv_event_to_wire_event"
    )


# -- checking every value: strict mode, decoding, and naming what an encoder refused ----------


def _bad_int(where: str, value: object, lo: int, hi: int) -> ValueError | TypeError:
    if isinstance(value, bool) or not isinstance(value, int):
        return TypeError(f"{where} must be an int, got {value!r} ({type(value).__name__})")
    return ValueError(f"{where} = {value} is outside [{lo}, {hi}); use a value in that range")


def _ints(where: str, values: object, lo: int, hi: int) -> None:
    if type(values) not in (list, tuple):
        raise TypeError(f"{where} must be a list or tuple of ints, got {values!r}; pass list(...)")
    assert isinstance(values, (list, tuple))
    if set(map(type, values)) <= {int} and (not values or (min(values) >= lo and max(values) < hi)):
        return  # the usual case, at C speed
    for index, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value < hi:
            raise _bad_int(f"{where}[{index}]", value, lo, hi)


def _optional(where: str, value: object, kind: type | tuple[type, ...]) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, kind)):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise TypeError(f"{where} = {value!r} must be {names} or None")


def check_event(where: str, event: object) -> None:
    """Check every value of one event, naming the first bad one (`where` says which event)."""
    if isinstance(event, BlockStored):
        _ints(f"{where}.block_hashes", event.block_hashes, HASH_MIN, HASH_LIMIT)
        if event.parent_block_hash is not None:
            _ints(f"{where}.parent_block_hash", [event.parent_block_hash], HASH_MIN, HASH_LIMIT)
        _ints(f"{where}.token_ids", event.token_ids, TOKEN_MIN, TOKEN_LIMIT)
        int_at_least(f"{where}.block_size", event.block_size, 1, type_error=TypeError)
        _optional(f"{where}.lora_id", event.lora_id, int)
        _optional(f"{where}.lora_name", event.lora_name, str)
        _optional(f"{where}.kv_cache_spec_kind", event.kv_cache_spec_kind, str)
        _optional(f"{where}.kv_cache_spec_sliding_window", event.kv_cache_spec_sliding_window, int)
        extra = event.extra_keys
        _optional(f"{where}.extra_keys", extra, (list, tuple))
        for index, keys in enumerate(extra or ()):
            _optional(f"{where}.extra_keys[{index}]", keys, (list, tuple))
    elif isinstance(event, BlockRemoved):
        _ints(f"{where}.block_hashes", event.block_hashes, HASH_MIN, HASH_LIMIT)
    elif not isinstance(event, AllBlocksCleared):
        raise not_an_event(where, event)
    if not isinstance(event, AllBlocksCleared):
        _optional(f"{where}.medium", event.medium, str)
        _optional(f"{where}.locality", event.locality, str)
        if event.group_idx is not None:
            int_at_least(f"{where}.group_idx", event.group_idx, 0, type_error=TypeError)


def check_events(events: Iterable[object]) -> None:
    """Check every value of every event (strict mode): a hash or token id a consumer would
    refuse or misread fails here, naming the event, the field, the index and the value."""
    for index, event in enumerate(events):
        check_event(f"events[{index}]", event)
