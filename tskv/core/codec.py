"""The batch payload codec: events to msgpack bytes and back, on either wire.

Two wires (`wire_format`): "tokenspeed", TokenSpeed's positional events, byte for byte, and
"vllm", vLLM's events as maps tagged "type". Two encoders give the same bytes: msgspec (used
when `tskv.core._msgspec` says so) and msgpack-python. Encoding builds each event's wire value in
one pass (a tuple, or a dict for vLLM) and hands the round to the encoder in one call; when the
encoder refuses a value, the events are checked one by one to say which field was bad.

Decoding accepts every dialect other publishers send (map-encoded events, trailing positional
fields, bytes hashes, a batch without the rank) and turns every other input into a `WireError`.
With msgspec, TokenSpeed's dialect is decoded straight into the event Structs, checked in C;
anything that does not fit that fast path goes through the general one, which checks in Python.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import Any

import attrs
import msgpack

from tskv.core._msgspec import msgspec
from tskv.core.codec_parity import hashable_keys, refusal
from tskv.core.errors import TskvError, TskvTypeError, Warn, python_warning
from tskv.core.events import (
    ALWAYS_SENT,
    KNOWN_EVENT_TYPES,
    NO_FIELDS,
    OPTIONAL_FIELDS,
    POSITIONAL_OPTIONAL,
    REMOVED_OPTIONAL,
    REMOVED_POSITIONAL,
    REQUIRED,
    STORED_OPTIONAL,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    MMKey,
    UnknownEvent,
    check_event,
    check_events,
    not_an_event,
    set_optional_fields,
)
from tskv.core.wire_format import WireFormat, unknown_wire


class WireError(TskvError, ValueError):
    """A payload that is not a KV event batch in any dialect tskv knows; says what was wrong."""


@attrs.define
class DroppedFields:
    """What the TokenSpeed wire had no slot for (optional or unknown fields, events of an
    unknown type): counted, and said once through `warn` (a publisher passes its logger's)."""

    warn: Warn = python_warning
    events: int = 0
    skipped: int = 0  # of those, events left out whole (their type has no slot either)

    def note(self, event: KVEvent) -> None:
        if not isinstance(event, UnknownEvent) and not set_optional_fields(event):
            return  # an empty mapping given for unknown_fields: nothing is dropped
        if not self.events:
            if isinstance(event, UnknownEvent):
                what = f"events of type {event.type!r} (sent without them)"
            else:
                what = f"{', '.join(set_optional_fields(event))} (events are sent without it)"
            self.warn(
                f"the tokenspeed wire has no slot for {what}; counted in "
                "statistics().events_with_dropped_fields; set wire_format='vllm' to send it. "
                "Said once per publisher."
            )
        self.events += 1


_STORED, _REMOVED, _CLEARED = "BlockStored", "BlockRemoved", ("AllBlocksCleared",)


def tokenspeed_events(events: Iterable[KVEvent], dropped: DroppedFields) -> list[Any]:
    """Each event as TokenSpeed's array: its tag, then its four (or one) fields.

    This runs for every event of every round, so it does only what it must: build the array,
    and notice fields this wire cannot carry. The usual event (a store or removal with nothing
    optional set) is made in one comprehension; anything else goes through `_tokenspeed_event`.
    Values are checked by the encoder (a hash no msgpack int can hold, a container it cannot
    encode: then every event is checked, to name the bad field) and, in strict mode, in full
    before this.
    """
    skipped = dropped.skipped
    plain = [
        (_STORED, event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size)
        if type(event) is BlockStored
        and event.lora_id is None
        and event.medium is None
        and event.lora_name is None
        and event.extra_keys is None
        and event.group_idx is None
        and event.kv_cache_spec_kind is None
        and event.kv_cache_spec_sliding_window is None
        and event.locality is None
        and event.ownership is None
        and event.mm_keys is None
        and event.cache_salt is None
        and event.session_id is None
        and event.lookahead_token_ids is None
        and event.unknown_fields is NO_FIELDS  # identity: a mapping's len costs more
        else (_REMOVED, event.block_hashes)
        if type(event) is BlockRemoved
        and event.medium is None
        and event.group_idx is None
        and event.locality is None
        and event.ownership is None
        and event.unknown_fields is NO_FIELDS
        else _tokenspeed_event(event, dropped, events)
        for event in events
    ]
    if dropped.skipped != skipped:  # events this wire has no slot for at all
        return [value for value in plain if value is not _SKIPPED]
    return plain


_SKIPPED = object()


def _tokenspeed_event(event: object, dropped: DroppedFields, events: Iterable[object]) -> object:
    """An event with something this wire cannot carry (noted, and left out), a cache reset, or
    something not an event."""
    if isinstance(event, UnknownEvent):
        dropped.note(event)
        dropped.skipped += 1
        return _SKIPPED
    kind = type(event)
    if kind is AllBlocksCleared:
        if event.unknown_fields is not NO_FIELDS:  # type: ignore[attr-defined]
            dropped.note(event)  # type: ignore[arg-type]
        return _CLEARED
    if kind is BlockStored:
        dropped.note(event)  # type: ignore[arg-type]
        stored: BlockStored = event  # type: ignore[assignment]
        return (_STORED, *(getattr(stored, name) for name in REQUIRED[BlockStored]))
    if kind is BlockRemoved:
        dropped.note(event)  # type: ignore[arg-type]
        return (_REMOVED, event.block_hashes)  # type: ignore[attr-defined]
    index = next(index for index, item in enumerate(events) if item is event)
    raise not_an_event(f"events[{index}]", event)


def vllm_events(events: Iterable[KVEvent], _: DroppedFields | None = None) -> list[Any]:
    """Each event as vLLM's map: its required fields and lora_id, medium and lora_name always,
    the other optional ones when set, then whatever unknown fields it came with; an unknown
    event as it came."""
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
            for name in _STORED_WHEN_SET:
                if getattr(event, name) is not None:
                    value[name] = getattr(event, name)
            if event.mm_keys is not None:  # as maps, in the place the loop gave it
                value["mm_keys"] = [[_mm_key_map(key) for key in keys] for keys in event.mm_keys]
        elif isinstance(event, BlockRemoved):
            value = {"type": _REMOVED, "block_hashes": event.block_hashes, "medium": event.medium}
            for name in _REMOVED_WHEN_SET:
                if getattr(event, name) is not None:
                    value[name] = getattr(event, name)
        elif isinstance(event, AllBlocksCleared):
            value = {"type": "AllBlocksCleared"}
        elif isinstance(event, UnknownEvent):
            plain.append({"type": event.type, **event.fields})
            continue
        else:
            raise not_an_event(f"events[{len(plain)}]", event)
        if event.unknown_fields:
            for name, field in event.unknown_fields.items():
                value.setdefault(name, field)
        plain.append(value)
    return plain


_STORED_WHEN_SET = tuple(name for name in STORED_OPTIONAL if name not in ALWAYS_SENT)
_REMOVED_WHEN_SET = REMOVED_OPTIONAL[1:]


def mm_key_fields(key: MMKey) -> dict[str, Any]:
    """An `mm_key`'s fields as TensorRT-LLM sends them: its uuid only when set, then whatever
    else it came with."""
    fields: dict[str, Any] = {"hash": key.hash, "start_offset": key.start_offset}
    if key.uuid is not None:
        fields["uuid"] = key.uuid
    for name, field in key.unknown_fields.items():
        fields.setdefault(name, field)
    return fields


def _mm_key_map(key: MMKey) -> dict[str, Any]:
    return {"type": "mm_key", **mm_key_fields(key)}  # tagged, as TensorRT-LLM's Struct is


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
    if type(events) is not list and type(events) is not tuple:
        events = list(events)  # a generator, say: walked again to name a bad value
    if strict:
        check_events(events)
    wire = _WIRES.get(wire_format)
    if wire is None:
        raise unknown_wire(wire_format)
    return wire(events, dropped or _UNATTRIBUTED)


Decoded = tuple[KVEventBatch, int]  # a batch, and how many events of an unknown type it holds


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
            raise TskvTypeError(f"events cannot be encoded: {exc}") from exc

    def encode_batch(
        self, batch: KVEventBatch, wire_format: WireFormat = "tokenspeed", *, strict: bool = False
    ) -> bytes:
        plain = plain_events(batch.events, wire_format, strict=strict)
        return self.pack_batch(batch.ts, plain, batch.attn_dp_rank, batch.events)

    def decode(self, payload: bytes) -> Decoded:
        """The batch, and how many of its events are of a type tskv does not know."""
        if not isinstance(payload, (bytes, bytearray, memoryview)):
            raise WireError(f"payload must be bytes, got {type(payload).__name__}")
        if self.decode_fast is not None:
            try:
                batch = self.decode_fast(payload)
            except Exception:  # the general path below says what was wrong, or reads it
                pass
            else:  # its one field that takes any value: extra_keys
                for event in batch.events:
                    if type(event) is BlockStored and event.extra_keys is not None:
                        _refuse_what_codecs_read_apart(batch)
                        break
                return batch, 0  # the typed decoder knows only tskv's own event types
        try:
            raw = self.unpack(bytes(payload))
        except Exception as exc:  # every decoder failure, whatever its class, is a wire error
            raise WireError(f"payload is not valid msgpack ({exc})") from None
        batch = from_plain(raw)
        _refuse_what_codecs_read_apart(batch)
        return batch, sum(type(event) is UnknownEvent for event in batch.events)

    def decode_batch(self, payload: bytes) -> KVEventBatch:
        return self.decode(payload)[0]


def _refuse_what_codecs_read_apart(batch: KVEventBatch) -> None:
    why = refusal(batch.events)
    if why is not None:
        raise WireError(why)


def _no_ext(code: int, data: object) -> Any:
    """No KV event wire uses msgpack's extension types; each library would hand one over as
    its own class, which the other could not send on, so a payload with one is refused."""
    raise WireError(f"extension type {code} is in no KV event wire")


def _msgpack_codec() -> Codec:
    packer = msgpack.Packer(use_bin_type=True, autoreset=True)

    def unpack(payload: bytes) -> Any:
        try:
            return msgpack.unpackb(payload, raw=False, strict_map_key=False, ext_hook=_no_ext)
        except TypeError:  # an array as a map key, in no wire but allowed in an unknown event
            return msgpack.unpackb(
                payload,
                raw=False,
                strict_map_key=False,
                ext_hook=_no_ext,
                object_pairs_hook=hashable_keys,
            )

    return Codec("msgpack", packer.pack, unpack)


def _msgspec_codec() -> Codec | None:
    if msgspec is None:
        return None
    typed = msgspec.msgpack.Decoder(KVEventBatch).decode
    return Codec(
        "msgspec",
        msgspec.msgpack.Encoder().encode,
        msgspec.msgpack.Decoder(ext_hook=_no_ext).decode,
        typed,
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
    elif wire_format == "vllm":
        plain = vllm_events(events)
    else:
        raise unknown_wire(wire_format)
    if not plain:
        return None
    try:
        return _PACK((ts, plain, rank))
    except (TypeError, ValueError, OverflowError) as exc:
        check_events(events)  # names the field the encoder refused, and raises
        raise TskvTypeError(f"events cannot be encoded: {exc}") from exc


def decode_batch(payload: bytes) -> KVEventBatch:
    """Parse a payload frame from any known publisher; raise `WireError` for anything else."""
    return ACTIVE.decode(payload)[0]


def decode(payload: bytes) -> Decoded:
    """`decode_batch`, and how many of the batch's events are of a type tskv does not know
    (`UnknownEvent`): what the decoding saw, returned with what it made, so that a subscriber
    counts them without walking every batch's events."""
    return ACTIVE.decode(payload)


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


_NAMES = {kind.__name__: (REQUIRED[kind], OPTIONAL_FIELDS[kind]) for kind in KNOWN_EVENT_TYPES}
_KNOWN_KEYS = {
    tag: frozenset(("type", *required, *optional)) for tag, (required, optional) in _NAMES.items()
}
_POSITIONAL = {"BlockStored": POSITIONAL_OPTIONAL, "BlockRemoved": REMOVED_POSITIONAL}
_TYPES = {kind.__name__: kind for kind in KNOWN_EVENT_TYPES}


def _fields(index: int, raw: Any) -> tuple[str, dict[str, Any]] | UnknownEvent:
    """An event's tag and its fields by name, from a map (vLLM) or a tagged array (positional:
    trailing fields take the names vLLM's positional Structs gave them, in order; any further
    ones are kept in `unknown_fields` under their position). An event of an unknown type is
    kept whole."""
    if isinstance(raw, dict):
        if not all(isinstance(key, str) for key in raw):
            raise WireError(f"event {index}: map keys must be strings, got {_show(list(raw))}")
        tag = raw.get("type")
        if not isinstance(tag, str):
            raise WireError(f"event {index}: a map event needs a string 'type', got {_show(tag)}")
        if tag not in _NAMES:
            return UnknownEvent(tag, _read_only({k: v for k, v in raw.items() if k != "type"}))
        required, optional = _NAMES[tag]
        missing = [name for name in required if name not in raw and name != "parent_block_hash"]
        if missing:
            raise WireError(f"event {index}: {tag} lacks {', '.join(missing)}")
        fields = {name: raw.get(name) for name in required}
        for name in optional:
            if name in raw:
                fields[name] = raw[name]
        known = _KNOWN_KEYS[tag]
        if not raw.keys() <= known:
            fields["unknown_fields"] = _read_only({k: v for k, v in raw.items() if k not in known})
        return tag, fields
    if isinstance(raw, (list, tuple)) and raw:
        tag = raw[0]
        if not isinstance(tag, str):
            raise WireError(f"event {index}: an array event starts with its type, got {_show(tag)}")
        if tag not in _NAMES:
            return UnknownEvent(tag, _read_only({str(i): v for i, v in enumerate(raw) if i}))
        required = _NAMES[tag][0]
        if len(raw) - 1 < len(required):
            raise WireError(
                f"event {index}: {tag} needs {len(required)} fields after its tag, "
                f"got {len(raw) - 1}"
            )
        names = required + _POSITIONAL.get(tag, ())
        fields = dict(zip(names, raw[1:], strict=False))
        if len(raw) > len(names) + 1:
            extra = {str(i): raw[i] for i in range(len(names) + 1, len(raw))}
            fields["unknown_fields"] = _read_only(extra)
        return tag, fields
    raise WireError(f"event {index}: must be a tagged array or map, got {_show(raw)}")


def _read_only(fields: dict[str, Any]) -> Mapping[str, Any]:
    return MappingProxyType(fields) if fields else NO_FIELDS


def _mm_keys(index: int, value: Any) -> Any:
    """TensorRT-LLM's multimodal keys: per block, a list of `mm_key` maps."""
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, (list, tuple)) for v in value):
        raise WireError(f"event {index}: mm_keys must be an array of arrays, got {_show(value)}")
    return [[_mm_key(index, key) for key in keys] for keys in value]


_MM_KEY_FIELDS = frozenset(("type", "hash", "start_offset", "uuid"))


def _mm_key(index: int, raw: Any) -> MMKey:
    if not isinstance(raw, dict) or "hash" not in raw or "start_offset" not in raw:
        raise WireError(
            f"event {index}: an mm_key must be a map with hash and start_offset, got {_show(raw)}"
        )
    digest, offset, uuid = raw["hash"], raw["start_offset"], raw.get("uuid")
    if isinstance(digest, bool) or not isinstance(digest, (str, int)):
        raise WireError(f"event {index}: mm_key hash must be a string, got {_show(digest)}")
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise WireError(f"event {index}: mm_key start_offset must be an int >= 0, got {offset!r}")
    if uuid is not None and not isinstance(uuid, str):
        raise WireError(f"event {index}: mm_key uuid must be a string or nil, got {_show(uuid)}")
    unknown = {k: v for k, v in raw.items() if k not in _MM_KEY_FIELDS}
    return MMKey(digest, offset, uuid, _read_only(unknown) if unknown else NO_FIELDS)


def _event(index: int, raw: Any) -> KVEvent:
    found = _fields(index, raw)
    if isinstance(found, UnknownEvent):
        return found
    tag, fields = found
    if "block_hashes" in fields:
        fields["block_hashes"] = _hashes(fields["block_hashes"], index)
    if tag == "BlockStored":
        fields["parent_block_hash"] = _hash(fields["parent_block_hash"])
        if not isinstance(fields["token_ids"], (list, tuple)):
            raise WireError(
                f"event {index}: token_ids must be an array, got {_show(fields['token_ids'])}"
            )
        if fields.get("mm_keys") is not None:
            fields["mm_keys"] = _mm_keys(index, fields["mm_keys"])
    try:
        event: KVEvent = _TYPES[tag](**fields)
        check_event(f"event {index}: {tag}", event)
    except (TypeError, ValueError) as exc:
        raise WireError(str(exc)) from None
    return event


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
