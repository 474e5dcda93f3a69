"""The batch payload codec: events to msgpack bytes and back, on either wire.

Two wires (`wire_format`): "tokenspeed", TokenSpeed's positional events, byte for byte, and
"vllm", vLLM's events as maps tagged "type". Two encoders give the same bytes: msgspec (used when
`tskv._msgspec` says so) and msgpack-python. Encoding builds each event's wire value in one pass
(a tuple, or a dict for vLLM) and hands the round to the encoder in one call; when the encoder
refuses a value, the events are checked one by one to say which field was bad.

Decoding accepts every dialect other publishers send (map-encoded events, trailing positional
fields, bytes hashes, a batch without the rank) and turns every other input into a `WireError`.
With msgspec, TokenSpeed's dialect is decoded straight into the event Structs, checked in C;
anything that does not fit that fast path goes through the general one, which checks in Python.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any, Literal

import attrs
import msgpack

from tskv._msgspec import msgspec
from tskv.events import (
    EVENT_TYPES,
    REMOVED_OPTIONAL,
    STORED_OPTIONAL,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    check_event,
    check_events,
    not_an_event,
)

logger = logging.getLogger("tskv")

WireFormat = Literal["tokenspeed", "vllm"]
WIRE_FORMATS: tuple[WireFormat, ...] = ("tokenspeed", "vllm")


class WireError(ValueError):
    """A payload that is not a KV event batch in any dialect tskv knows; says what was wrong."""


@attrs.define
class DroppedFields:
    """Optional event fields the TokenSpeed wire had no slot for: counted, and logged once."""

    events: int = 0

    def note(self, event: KVEvent) -> None:
        if not self.events:
            names = STORED_OPTIONAL if isinstance(event, BlockStored) else REMOVED_OPTIONAL
            set_names = [name for name in names if getattr(event, name) is not None]
            logger.warning(
                "the tokenspeed wire has no slot for %s: events are sent without it (counted in "
                "statistics().events_with_dropped_fields); set wire_format='vllm' to send it. "
                "Logged once per publisher.",
                ", ".join(set_names),
            )
        self.events += 1


_STORED, _REMOVED, _CLEARED = "BlockStored", "BlockRemoved", ("AllBlocksCleared",)


def tokenspeed_events(events: Iterable[KVEvent], dropped: DroppedFields) -> list[Any]:
    """Each event as TokenSpeed's array: its tag, then its four (or one) fields.

    This runs for every event of every round, so it does only what it must: build the array,
    and notice optional fields this wire cannot carry. Values are checked by the encoder (a hash
    no msgpack int can hold, a container it cannot encode: then every event is checked, to name
    the bad field) and, in strict mode, in full before this.
    """
    plain: list[Any] = []
    append = plain.append
    for event in events:
        kind = type(event)
        if kind is BlockStored:
            stored: BlockStored = event  # type: ignore[assignment]
            if not (
                stored.lora_id is None
                and stored.medium is None
                and stored.lora_name is None
                and stored.extra_keys is None
                and stored.group_idx is None
                and stored.kv_cache_spec_kind is None
                and stored.kv_cache_spec_sliding_window is None
                and stored.locality is None
            ):
                dropped.note(stored)
            append(
                (
                    _STORED,
                    stored.block_hashes,
                    stored.parent_block_hash,
                    stored.token_ids,
                    stored.block_size,
                )
            )
        elif kind is BlockRemoved:
            removed: BlockRemoved = event  # type: ignore[assignment]
            if not (
                removed.medium is None and removed.group_idx is None and removed.locality is None
            ):
                dropped.note(removed)
            append((_REMOVED, removed.block_hashes))
        elif kind is AllBlocksCleared:
            append(_CLEARED)
        else:
            raise not_an_event(f"events[{len(plain)}]", event)
    return plain


def vllm_events(events: Iterable[KVEvent], _: DroppedFields | None = None) -> list[Any]:
    """Each event as vLLM's map: its fields without a default always, the others when set."""
    plain: list[Any] = []
    for event in events:
        if isinstance(event, BlockStored):
            value: dict[str, Any] = {
                "type": _STORED,
                "block_hashes": event.block_hashes,
                "parent_block_hash": event.parent_block_hash,
                "token_ids": event.token_ids,
                "block_size": event.block_size,
                "lora_id": event.lora_id,
                "medium": event.medium,
                "lora_name": event.lora_name,
            }
            for name in STORED_OPTIONAL[3:]:
                if getattr(event, name) is not None:
                    value[name] = getattr(event, name)
        elif isinstance(event, BlockRemoved):
            value = {"type": _REMOVED, "block_hashes": event.block_hashes, "medium": event.medium}
            for name in REMOVED_OPTIONAL[1:]:
                if getattr(event, name) is not None:
                    value[name] = getattr(event, name)
        elif isinstance(event, AllBlocksCleared):
            value = {"type": "AllBlocksCleared"}
        else:
            raise not_an_event(f"events[{len(plain)}]", event)
        plain.append(value)
    return plain


_WIRES: dict[str, Callable[[Iterable[KVEvent], DroppedFields], list[Any]]] = {
    "tokenspeed": tokenspeed_events,
    "vllm": vllm_events,
}


_UNATTRIBUTED = DroppedFields()  # for encode_batch calls that bring no counter of their own


def plain_events(
    events: Iterable[KVEvent],
    wire_format: WireFormat = "tokenspeed",
    *,
    strict: bool = False,
    dropped: DroppedFields | None = None,
) -> list[Any]:
    """The events as the plain values the wire's msgpack array holds."""
    if strict:
        check_events(events)
    return _WIRES[wire_format](events, dropped or _UNATTRIBUTED)


@attrs.frozen
class Codec:
    """One msgpack implementation: plain values to bytes, and bytes to a batch."""

    name: str
    pack: Callable[[Any], bytes]
    unpack: Callable[[bytes], Any]
    decode_fast: Callable[[bytes], KVEventBatch] | None = None  # TokenSpeed's dialect, typed

    def pack_batch(
        self, ts: float, plain: list[Any], rank: int | None, events: Iterable[KVEvent]
    ) -> bytes:
        try:
            return self.pack((ts, plain, rank))
        except (TypeError, ValueError, OverflowError) as exc:
            check_events(events)  # names the field the encoder refused, and raises
            raise TypeError(f"events cannot be encoded: {exc}") from exc

    def encode_batch(
        self, batch: KVEventBatch, wire_format: WireFormat = "tokenspeed", *, strict: bool = False
    ) -> bytes:
        plain = plain_events(batch.events, wire_format, strict=strict)
        return self.pack_batch(batch.ts, plain, batch.attn_dp_rank, batch.events)

    def decode_batch(self, payload: bytes) -> KVEventBatch:
        if not isinstance(payload, (bytes, bytearray, memoryview)):
            raise WireError(f"payload must be bytes, got {type(payload).__name__}")
        if self.decode_fast is not None:
            try:
                return self.decode_fast(payload)
            except Exception:  # the general path below says what was wrong, or reads it
                pass
        try:
            raw = self.unpack(bytes(payload))
        except Exception as exc:  # every decoder failure, whatever its class, is a wire error
            raise WireError(f"payload is not valid msgpack ({exc})") from None
        return from_plain(raw)


def _msgpack_codec() -> Codec:
    packer = msgpack.Packer(use_bin_type=True, autoreset=True)

    def unpack(payload: bytes) -> Any:
        return msgpack.unpackb(payload, raw=False, strict_map_key=False)

    return Codec("msgpack", packer.pack, unpack)


def _msgspec_codec() -> Codec | None:
    if msgspec is None:
        return None
    typed = msgspec.msgpack.Decoder(KVEventBatch).decode
    return Codec(
        "msgspec", msgspec.msgpack.Encoder().encode, msgspec.msgpack.Decoder().decode, typed
    )


def available_codecs() -> dict[str, Codec]:
    """Every codec this process can use, by name; the tests run the wire vectors against each."""
    codecs = {"msgpack": _msgpack_codec()}
    fast = _msgspec_codec()
    if fast is not None:
        codecs["msgspec"] = fast
    return codecs


ACTIVE = _msgspec_codec() or _msgpack_codec()
_PACK = ACTIVE.pack


def codec_name() -> str:
    """Which encoder tskv uses in this process: "msgspec" or "msgpack"."""
    return ACTIVE.name


def encode_batch(
    batch: KVEventBatch,
    wire_format: WireFormat = "tokenspeed",
    *,
    strict: bool = False,
    dropped: DroppedFields | None = None,
) -> bytes:
    """The payload frame for `batch`, byte for byte as TokenSpeed's (or vLLM's) publisher
    writes it. Optional event fields the TokenSpeed wire cannot carry are dropped, logged once
    (and counted in `dropped`)."""
    plain = plain_events(batch.events, wire_format, strict=strict, dropped=dropped)
    return ACTIVE.pack_batch(batch.ts, plain, batch.attn_dp_rank, batch.events)


def encode_round(
    ts: float,
    events: Iterable[KVEvent],
    rank: int,
    wire_format: WireFormat = "tokenspeed",
    *,
    strict: bool = False,
    dropped: DroppedFields | None = None,
) -> bytes | None:
    """Encode a round's events straight from the publisher, or None for an empty round: the
    same bytes as `encode_batch(KVEventBatch(ts, events, rank))` without building the batch.
    Every round goes through here, so it is `plain_events` and `pack_batch` written flat."""
    if type(events) is not list and type(events) is not tuple:
        events = list(events)  # a generator, say: kept, to name a bad value if need be
    if strict:
        check_events(events)
    if wire_format == "tokenspeed":
        plain = tokenspeed_events(events, dropped or _UNATTRIBUTED)
    else:
        plain = vllm_events(events)
    if not plain:
        return None
    try:
        return _PACK((ts, plain, rank))
    except (TypeError, ValueError, OverflowError) as exc:
        check_events(events)  # names the field the encoder refused, and raises
        raise TypeError(f"events cannot be encoded: {exc}") from exc


def decode_batch(payload: bytes) -> KVEventBatch:
    """Parse a payload frame from any known publisher; raise `WireError` for anything else."""
    return ACTIVE.decode_batch(payload)


# -- the general decoding path: every dialect, every value checked in Python ----------------


def from_plain(raw: Any) -> KVEventBatch:
    """Build a batch from decoded msgpack values, checking every field."""
    if not isinstance(raw, (list, tuple)) or len(raw) not in (2, 3):
        raise WireError(f"batch must be an array [ts, events, attn_dp_rank], got {_show(raw)}")
    ts, events = raw[0], raw[1]
    rank = raw[2] if len(raw) == 3 else None
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        raise WireError(f"batch ts must be a number, got {_show(ts)}")
    if not isinstance(events, (list, tuple)):
        raise WireError(f"batch events must be an array, got {_show(events)}")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
        raise WireError(f"batch attn_dp_rank must be an int or nil, got {_show(rank)}")
    decoded = [_event(index, event) for index, event in enumerate(events)]
    try:
        return KVEventBatch(ts, decoded, rank)
    except (TypeError, ValueError) as exc:
        raise WireError(f"batch: {exc}") from None


def _hash(value: Any) -> Any:
    # Some publishers send a hash as bytes (a digest); consumers use its last 8 bytes.
    if isinstance(value, (bytes, bytearray)):
        return int.from_bytes(value[-8:], "big")
    return value


def _hashes(value: Any, index: int) -> Any:
    if not isinstance(value, (list, tuple)):
        raise WireError(f"event {index}: block_hashes must be an array, got {_show(value)}")
    if set(map(type, value)) <= {int}:
        return value  # the usual case, checked at C speed
    return [_hash(item) for item in value]


_REQUIRED = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size"),
    "BlockRemoved": ("block_hashes",),
    "AllBlocksCleared": (),
}
_OPTIONAL = {
    "BlockStored": STORED_OPTIONAL,
    "BlockRemoved": REMOVED_OPTIONAL,
    "AllBlocksCleared": (),
}
_TYPES = {event_type.__name__: event_type for event_type in EVENT_TYPES}


def _fields(index: int, raw: Any) -> tuple[str, dict[str, Any]]:
    """An event's tag and its fields by name, from a map (vLLM) or a tagged array (positional:
    trailing fields take the optional fields' names in order, as vLLM's positional Structs had
    them; any further ones are dropped)."""
    if isinstance(raw, dict):
        if not all(isinstance(key, str) for key in raw):
            raise WireError(f"event {index}: map keys must be strings, got {_show(list(raw))}")
        tag = raw.get("type")
        if not isinstance(tag, str) or tag not in _REQUIRED:
            raise WireError(f"event {index}: unknown event type {_show(tag)}")
        missing = [
            name for name in _REQUIRED[tag] if name not in raw and name != "parent_block_hash"
        ]
        if missing:
            raise WireError(f"event {index}: {tag} lacks {', '.join(missing)}")
        names = _REQUIRED[tag] + _OPTIONAL[tag]
        return tag, {name: raw.get(name) for name in names}
    if isinstance(raw, (list, tuple)) and raw:
        tag = raw[0]
        if not isinstance(tag, str) or tag not in _REQUIRED:
            raise WireError(f"event {index}: unknown event type {_show(tag)}")
        required = _REQUIRED[tag]
        if len(raw) - 1 < len(required):
            raise WireError(
                f"event {index}: {tag} needs {len(required)} fields after its tag, "
                f"got {len(raw) - 1}"
            )
        return tag, dict(zip(required + _OPTIONAL[tag], raw[1:], strict=False))
    raise WireError(f"event {index}: must be a tagged array or map, got {_show(raw)}")


def _event(index: int, raw: Any) -> KVEvent:
    tag, fields = _fields(index, raw)
    if "block_hashes" in fields:
        fields["block_hashes"] = _hashes(fields["block_hashes"], index)
    if tag == "BlockStored":
        fields["parent_block_hash"] = _hash(fields["parent_block_hash"])
        if not isinstance(fields["token_ids"], (list, tuple)):
            raise WireError(
                f"event {index}: token_ids must be an array, got {_show(fields['token_ids'])}"
            )
    try:
        event: KVEvent = _TYPES[tag](**fields)
        check_event(f"event {index}: {tag}", event)
    except (TypeError, ValueError) as exc:
        raise WireError(str(exc)) from None
    return event


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
