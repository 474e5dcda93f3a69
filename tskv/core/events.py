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

import abc
import math
import sys
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import attrs

from tskv.core._checks import int_at_least
from tskv.core._msgspec import msgspec
from tskv.core.errors import TskvError, TskvTypeError, TskvValueError

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
NO_FIELDS: Mapping[str, Any] = MappingProxyType({})  # `unknown_fields` when nothing unknown came


class _NotPositional:
    """What msgspec's typed decoder is told the fields no positional dialect carries are: no
    wire value decodes as one, so a positional event long enough to reach them leaves the fast
    path for the general one, which keeps its extra values in `unknown_fields`."""


@dataclass_transform(frozen_default=True)
def _record(
    *,
    tag: bool = False,
    forbid_unknown_fields: bool = False,
    decode_as: Mapping[str, Any] | None = None,
) -> Callable[[type[T]], type[T]]:
    """Make a class of annotated fields a frozen record: a msgspec Struct (array-like, as the
    wire is) when msgspec is used, else a slotted attrs class. One declaration, both worlds.
    `decode_as` gives msgspec's typed decoder other types than the annotations for some fields."""

    def make(cls: type[T]) -> type[T]:
        if msgspec is None:
            if "__post_init__" in cls.__dict__:
                cls.__attrs_post_init__ = cls.__dict__["__post_init__"]  # type: ignore[attr-defined]
            return attrs.frozen(slots=True)(cls)
        hints = {**typing.get_type_hints(cls, include_extras=True), **(decode_as or {})}
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


@attrs.frozen
class MMKey:
    """One multimodal segment in a block (TensorRT-LLM's `mm_key`): the content hash of the
    image or other item, where in the block it starts, and the request's label for it."""

    hash: str | int
    start_offset: int
    uuid: str | None = None
    unknown_fields: Mapping[str, Any] = NO_FIELDS


_UNPOSITIONAL = {
    "ownership": _NotPositional | None,
    "mm_keys": _NotPositional | None,
    "cache_salt": _NotPositional | None,
    "session_id": _NotPositional | None,
    "lookahead_token_ids": _NotPositional | None,
    "unknown_fields": _NotPositional,
}


@_record(tag=True, decode_as=_UNPOSITIONAL)
class BlockStored:
    """Blocks newly cached, in chain order; `parent_block_hash` is the block before the first.

    `token_ids` need not fill `len(block_hashes) * block_size`: schedulers emit per-page events,
    and vLLM 0.33 leaves out of `block_hashes` the blocks a group does not keep (a sliding
    window's, a Mamba group's) while `token_ids` covers every block from the first new one to
    the last. A token id may be a string (TensorRT-LLM's placeholder for a multimodal item). The
    fields after `block_size` are optional (unset is None): vLLM's, in its order (the storage
    tier, LoRA, per-block extra keys, the KV cache group of hybrid models with its kind and
    window, locality, the offloading tier that stored it), then TensorRT-LLM's per-block
    multimodal keys and SGLang's cache salt (a tenant's namespace: the same tokens under two
    salts are two blocks), the session that stored it (both send it), and vLLM's lookahead
    tokens (per block, the tokens after it that its hash covers). `unknown_fields` holds, read
    only, whatever else a publisher sent. Only the vLLM wire carries these
    (`KVEventsConfig.wire_format`).
    """

    block_hashes: Sequence[int]
    parent_block_hash: int | None
    token_ids: Sequence[Token | str]
    block_size: BlockSize
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: Sequence[Sequence[Any] | None] | None = None
    group_idx: Index | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    mm_keys: Sequence[Sequence[MMKey]] | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    lookahead_token_ids: Sequence[Sequence[Token]] | None = None
    unknown_fields: Mapping[str, Any] = NO_FIELDS


@_record(tag=True, decode_as=_UNPOSITIONAL)
class BlockRemoved:
    """Blocks evicted from the cache (optionally: from which tier, group, locality and
    offloading tier)."""

    block_hashes: Sequence[int]
    medium: str | None = None
    group_idx: Index | None = None
    locality: str | None = None
    ownership: str | None = None
    unknown_fields: Mapping[str, Any] = NO_FIELDS


@_record(tag=True, decode_as=_UNPOSITIONAL)
class AllBlocksCleared:
    """The whole prefix cache was reset; consumers forget every block of this worker."""

    unknown_fields: Mapping[str, Any] = NO_FIELDS


@attrs.frozen
class UnknownEvent:
    """An event of a type tskv does not know (a newer engine's), kept in its place in the batch
    with every field it came with (a positional one's values keyed by position: "1", "2", ...).
    The vLLM wire sends it on as it came; TokenSpeed's has no slot for it."""

    type: str
    fields: Mapping[str, Any] = NO_FIELDS


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared | UnknownEvent
KNOWN_EVENT_TYPES = (BlockStored, BlockRemoved, AllBlocksCleared)
EVENT_TYPES = (*KNOWN_EVENT_TYPES, UnknownEvent)
# The optional fields in wire order: vLLM's positional generations carried the first eight,
# in this order, after the required ones; the rest only ever come in maps.
STORED_OPTIONAL = (
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
    "mm_keys",
    "cache_salt",
    "session_id",
    "lookahead_token_ids",
)
POSITIONAL_OPTIONAL = STORED_OPTIONAL[:8]
REMOVED_OPTIONAL = ("medium", "group_idx", "locality", "ownership")
REMOVED_POSITIONAL = REMOVED_OPTIONAL[:3]  # what positional generations carried after the hashes
ALWAYS_SENT = ("lora_id", "medium", "lora_name")  # vLLM's maps carry these even when nil
# One entry per stored block (per hash, not per token block): they go with the blocks they name.
PER_BLOCK = ("extra_keys", "mm_keys", "lookahead_token_ids")
REQUIRED: dict[type, tuple[str, ...]] = {
    BlockStored: ("block_hashes", "parent_block_hash", "token_ids", "block_size"),
    BlockRemoved: ("block_hashes",),
    AllBlocksCleared: (),
}
OPTIONAL_FIELDS: dict[type, tuple[str, ...]] = {
    BlockStored: STORED_OPTIONAL,
    BlockRemoved: REMOVED_OPTIONAL,
    AllBlocksCleared: (),
}
FIELDS: dict[type, tuple[str, ...]] = {
    kind: REQUIRED[kind] + OPTIONAL_FIELDS[kind] for kind in KNOWN_EVENT_TYPES
}
OPTIONAL = frozenset(STORED_OPTIONAL)


def event_fields(event: KVEvent) -> dict[str, Any]:
    """An event's fields by name, the optional ones only when set (as vLLM's maps have them),
    and `unknown_fields` when any came."""
    if isinstance(event, UnknownEvent):
        return dict(event.fields)
    fields = {
        name: getattr(event, name)
        for name in FIELDS[type(event)]
        if name not in OPTIONAL or getattr(event, name) is not None
    }
    if event.unknown_fields:
        fields["unknown_fields"] = dict(event.unknown_fields)
    return fields


def set_optional_fields(event: BlockStored | BlockRemoved | AllBlocksCleared) -> list[str]:
    """The names of the optional fields `event` has set, `unknown_fields` among them."""
    names = [name for name in OPTIONAL_FIELDS[type(event)] if getattr(event, name) is not None]
    return [*names, "unknown_fields"] if event.unknown_fields else names


def replace(event: T, **changes: Any) -> T:
    """A copy of a record with some fields changed (every other field kept, new ones too)."""
    if msgspec is None:
        return attrs.evolve(event, **changes)  # type: ignore[misc]
    return msgspec.structs.replace(event, **changes)  # type: ignore[no-any-return]


def _set(record: object, name: str, value: object) -> None:
    """Set a field of a frozen record while it is being made."""
    if msgspec is None:
        object.__setattr__(record, name, value)
    else:
        msgspec.structs.force_setattr(record, name, value)


@_record(
    forbid_unknown_fields=True,
    # the fast path decodes TokenSpeed's dialect only; an unknown event takes the general one
    decode_as={"events": Sequence[BlockStored | BlockRemoved | AllBlocksCleared]},
)
class KVEventBatch:
    """One scheduling round's events, stamped with the round's time and the publishing rank."""

    ts: float
    events: Sequence[KVEvent]
    attn_dp_rank: Index | None = None

    def __post_init__(self) -> None:  # once per batch, so it may check what is O(1)
        ts = self.ts
        if type(ts) is not float:
            if isinstance(ts, bool) or not isinstance(ts, (int, float)):
                raise TskvTypeError(f"ts must be a float (seconds since the epoch), got {ts!r}")
            _set(self, "ts", float(ts))
        if not math.isfinite(self.ts):
            raise TskvValueError(f"ts = {self.ts} must be finite (seconds since the epoch)")
        if type(self.events) not in (list, tuple):
            _set(self, "events", list(self.events))  # a generator, say: keep what it gave
        rank = self.attn_dp_rank
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 0):
            wrong: type[TskvError] = TskvValueError if isinstance(rank, int) else TskvTypeError
            raise wrong(f"attn_dp_rank = {rank!r} must be a non-negative int (a rank) or None")


class KVCacheEvent(abc.ABC):  # noqa: B024 - a name to test against, nothing to implement
    """What every KV cache event is, for `isinstance` (TokenSpeed's name for their base
    class): `BlockStored`, `BlockRemoved`, `AllBlocksCleared` and `UnknownEvent` are
    registered as its subclasses."""


for _event_type in EVENT_TYPES:
    KVCacheEvent.register(_event_type)

EventBatch = KVEventBatch  # TokenSpeed's name for the batch its KVEventBatch refines


def not_an_event(where: str, value: object) -> TskvTypeError:
    """The error for a foreign object where a KV event belongs, naming the fix."""
    return TskvTypeError(
        f"{where} = {value!r:.120} is not a tskv BlockStored, BlockRemoved or AllBlocksCleared; "
        "translate a scheduler's own objects (with a `kind`) with "
        "tskv.scheduler_kv_event_to_wire_event, and TokenSpeed's event Structs with "
        "tskv.foreign_event_to_wire_event (tskv.ZmqEventPublisher takes those as they are)"
    )


# -- checking every value: strict mode, decoding, and naming what an encoder refused ----------


def _bad_int(where: str, value: object, lo: int, hi: int) -> TskvValueError | TskvTypeError:
    if isinstance(value, bool) or not isinstance(value, int):
        return TskvTypeError(f"{where} must be an int, got {value!r} ({type(value).__name__})")
    return TskvValueError(f"{where} = {value} is outside [{lo}, {hi}); use a value in that range")


def _ints(where: str, values: object, lo: int, hi: int, strings: bool = False) -> None:
    """Ints in [lo, hi) (or, with `strings`, strings too: TensorRT-LLM's placeholder tokens)."""
    if type(values) not in (list, tuple):
        raise TskvTypeError(
            f"{where} must be a list or tuple of ints, got {values!r}; pass list(...)"
        )
    assert isinstance(values, (list, tuple))
    if set(map(type, values)) <= {int} and (not values or (min(values) >= lo and max(values) < hi)):
        return  # the usual case, at C speed
    for index, value in enumerate(values):
        if strings and type(value) is str:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value < hi:
            raise _bad_int(f"{where}[{index}]", value, lo, hi)


def _mapping(where: str, value: object) -> None:
    if not isinstance(value, Mapping) or not all(isinstance(key, str) for key in value):
        raise TskvTypeError(f"{where} = {value!r} must be a mapping of field names (str) to values")


def _mm_keys(where: str, value: object) -> None:
    if value is None:
        return
    if type(value) not in (list, tuple):
        raise TskvTypeError(
            f"{where} = {value!r} must be a list (per block) of lists of tskv.MMKey"
        )
    assert isinstance(value, (list, tuple))
    for index, keys in enumerate(value):
        if type(keys) not in (list, tuple) or not all(isinstance(k, MMKey) for k in keys):
            raise TskvTypeError(f"{where}[{index}] = {keys!r} must be a list of tskv.MMKey")


def _optional(where: str, value: object, kind: type | tuple[type, ...]) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, kind)):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise TskvTypeError(f"{where} = {value!r} must be {names} or None")


def check_event(where: str, event: object) -> None:
    """Check every value of one event, naming the first bad one (`where` says which event)."""
    if isinstance(event, BlockStored):
        _ints(f"{where}.block_hashes", event.block_hashes, HASH_MIN, HASH_LIMIT)
        if event.parent_block_hash is not None:
            _ints(f"{where}.parent_block_hash", [event.parent_block_hash], HASH_MIN, HASH_LIMIT)
        _ints(f"{where}.token_ids", event.token_ids, TOKEN_MIN, TOKEN_LIMIT, strings=True)
        int_at_least(f"{where}.block_size", event.block_size, 1, type_error=TskvTypeError)
        _optional(f"{where}.lora_id", event.lora_id, int)
        _optional(f"{where}.lora_name", event.lora_name, str)
        _optional(f"{where}.kv_cache_spec_kind", event.kv_cache_spec_kind, str)
        _optional(f"{where}.kv_cache_spec_sliding_window", event.kv_cache_spec_sliding_window, int)
        extra = event.extra_keys
        _optional(f"{where}.extra_keys", extra, (list, tuple))
        for index, keys in enumerate(extra or ()):
            _optional(f"{where}.extra_keys[{index}]", keys, (list, tuple))
        _mm_keys(f"{where}.mm_keys", event.mm_keys)
        _optional(f"{where}.cache_salt", event.cache_salt, str)
        _optional(f"{where}.session_id", event.session_id, str)
        _optional(f"{where}.ownership", event.ownership, str)
        lookahead = event.lookahead_token_ids
        _optional(f"{where}.lookahead_token_ids", lookahead, (list, tuple))
        for index, tokens in enumerate(lookahead or ()):
            _ints(f"{where}.lookahead_token_ids[{index}]", tokens, TOKEN_MIN, TOKEN_LIMIT)
    elif isinstance(event, BlockRemoved):
        _ints(f"{where}.block_hashes", event.block_hashes, HASH_MIN, HASH_LIMIT)
        _optional(f"{where}.ownership", event.ownership, str)
    elif isinstance(event, UnknownEvent):
        if not isinstance(event.type, str):
            raise TskvTypeError(
                f"{where}.type = {event.type!r} must be the event's type name (str)"
            )
        _mapping(f"{where}.fields", event.fields)
        return
    elif not isinstance(event, AllBlocksCleared):
        raise not_an_event(where, event)
    _mapping(f"{where}.unknown_fields", event.unknown_fields)
    if not isinstance(event, AllBlocksCleared):
        _optional(f"{where}.medium", event.medium, str)
        _optional(f"{where}.locality", event.locality, str)
        if event.group_idx is not None:
            int_at_least(f"{where}.group_idx", event.group_idx, 0, type_error=TskvTypeError)


def check_events(events: Iterable[object]) -> None:
    """Check every value of every event (strict mode): a hash or token id a consumer would
    refuse or misread fails here, naming the event, the field, the index and the value."""
    for index, event in enumerate(events):
        check_event(f"events[{index}]", event)
