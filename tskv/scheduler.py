"""Translation from a scheduler's native KV events (objects with a `kind`) to wire events."""

from __future__ import annotations

from typing import Any

from tskv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


def scheduler_kv_event_to_wire_event(event: Any) -> KVEvent:
    """Translate by `kind`, never by shape: a new kind must fail loudly, not pass as another."""
    kind = getattr(event, "kind", None)
    if kind == "BlockStored":
        return BlockStored(
            event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size
        )
    if kind == "BlockRemoved":
        return BlockRemoved(event.block_hashes)
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    raise TypeError(
        f"unknown scheduler KV event kind {kind!r} on {type(event).__name__}; tskv knows "
        "BlockStored, BlockRemoved and AllBlocksCleared"
    )


def drain_scheduler_kv_events(scheduler: Any, enabled: bool) -> list[Any]:
    """The scheduler's pending native events, or [] without touching it when events are off."""
    if not enabled:
        return []
    drain = getattr(scheduler, "drain_kv_events", None)
    if drain is None:
        raise RuntimeError(
            f"{type(scheduler).__name__} has no Scheduler.drain_kv_events(); KV events need a "
            "scheduler binding that exposes it, or disable them (enable_kv_cache_events=false)"
        )
    return list(drain())
