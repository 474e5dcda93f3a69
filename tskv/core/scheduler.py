"""Translation to tskv's events: from a scheduler's native KV events (objects with a `kind`),
and from another publisher's event objects (TokenSpeed's Structs: tagged, same field names)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from tskv.core.errors import TskvRuntimeError, TskvTypeError
from tskv.core.events import (
    EVENT_TYPES,
    REMOVED_OPTIONAL,
    STORED_OPTIONAL,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    not_an_event,
)

_PER_INSTANCE = ("__dict__",)  # marks a class whose instances carry attributes of their own
_CARRIES: dict[str, dict[type, tuple[str, ...]]] = {"BlockStored": {}, "BlockRemoved": {}}


def _carried(event: Any, kind: str, names: tuple[str, ...]) -> tuple[str, ...]:
    """Which optional fields (medium, LoRA, ...) a native event's class carries: looked at
    once per class, so classes without any cost nothing per event."""
    known = _CARRIES[kind]
    carried = known.get(type(event))
    if carried is None:
        if hasattr(event, "__dict__"):
            carried = _PER_INSTANCE
        else:
            carried = tuple(name for name in names if hasattr(event, name))
        known[type(event)] = carried
    return carried


def _optional(event: Any, carried: tuple[str, ...], names: tuple[str, ...]) -> dict[str, Any]:
    if carried is _PER_INSTANCE:
        return {name: event.__dict__[name] for name in names if name in event.__dict__}
    return {name: getattr(event, name) for name in carried}


def scheduler_kv_event_to_wire_event(event: Any) -> KVEvent:
    """Translate by `kind`, never by shape: a new kind must fail loudly, not pass as another."""
    kind = getattr(event, "kind", None)
    if kind == "BlockStored":
        carried = _carried(event, kind, STORED_OPTIONAL)
        if not carried:
            return BlockStored(
                event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size
            )
        return BlockStored(
            event.block_hashes,
            event.parent_block_hash,
            event.token_ids,
            event.block_size,
            **_optional(event, carried, STORED_OPTIONAL),
        )
    if kind == "BlockRemoved":
        carried = _carried(event, kind, REMOVED_OPTIONAL)
        if not carried:
            return BlockRemoved(event.block_hashes)
        return BlockRemoved(event.block_hashes, **_optional(event, carried, REMOVED_OPTIONAL))
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    raise TskvTypeError(
        f"unknown scheduler KV event kind {kind!r} on {type(event).__name__}; tskv knows "
        "BlockStored, BlockRemoved and AllBlocksCleared"
    )


def scheduler_kv_events_to_wire_events(events: Iterable[Any]) -> list[KVEvent]:
    """`scheduler_kv_event_to_wire_event` of each, in order (TokenSpeed's event loop calls this
    on what it drained)."""
    return [scheduler_kv_event_to_wire_event(event) for event in events]


def drain_scheduler_kv_events(scheduler: Any, enabled: bool) -> list[Any]:
    """The scheduler's pending native events, or [] without touching it when events are off."""
    if not enabled:
        return []
    drain = getattr(scheduler, "drain_kv_events", None)
    if drain is None:
        raise TskvRuntimeError(
            f"{type(scheduler).__name__} has no Scheduler.drain_kv_events(); KV events need a "
            "scheduler binding that exposes it, or disable them (enable_kv_cache_events=false)"
        )
    return list(drain())


def _tag(event: Any) -> object:
    """A foreign event's type name: its msgspec tag (TokenSpeed's Structs are tagged with
    their class name), else its class name."""
    config = getattr(type(event), "__struct_config__", None)
    tag = getattr(config, "tag", None)
    return tag if isinstance(tag, str) else type(event).__name__


def foreign_event_to_wire_event(event: Any, where: str = "event") -> KVEvent:
    """An event object of another publisher's (TokenSpeed's `BlockStored`, ...) as tskv's:
    by its tag, never by shape, its fields taken as they are (no token is walked)."""
    if isinstance(event, EVENT_TYPES):
        return event
    tag = _tag(event)
    try:
        if tag == "BlockStored":
            return BlockStored(
                event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size
            )
        if tag == "BlockRemoved":
            return BlockRemoved(event.block_hashes)
        if tag == "AllBlocksCleared":
            return AllBlocksCleared()
    except AttributeError as exc:
        raise TskvTypeError(
            f"{where} = {event!r} is a {tag} without TokenSpeed's fields ({exc})"
        ) from None
    raise not_an_event(where, event)


def foreign_batch(batch: Any) -> tuple[float, list[KVEvent], int | None]:
    """A batch object of another publisher's (TokenSpeed's `KVEventBatch`: ts, events,
    attn_dp_rank), as tskv's parts."""
    if isinstance(batch, KVEventBatch):
        return batch.ts, list(batch.events), batch.attn_dp_rank
    try:
        ts, events, rank = batch.ts, batch.events, getattr(batch, "attn_dp_rank", None)
    except AttributeError:
        raise TskvTypeError(
            f"publish() takes a KVEventBatch (tskv's or TokenSpeed's: ts, events, "
            f"attn_dp_rank), got {batch!r:.80}"
        ) from None
    if isinstance(events, (str, bytes)) or not hasattr(events, "__iter__"):
        raise TskvTypeError(f"batch.events = {events!r:.60} must be a list of KV events")
    converted = [
        foreign_event_to_wire_event(event, f"events[{index}]") for index, event in enumerate(events)
    ]
    return ts, converted, rank
