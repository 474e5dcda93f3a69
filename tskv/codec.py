"""The batch payload codec: events to msgpack bytes and back.

Two encoders give the same bytes: msgpack-python (always installed) and msgspec (faster, used
when importable, as in every vLLM, SGLang and TokenSpeed install). Only this module knows which
one is active. `TSKV_CODEC=msgpack` forces the required one, for comparison and for debugging.

Decoding accepts the dialects other publishers send (map-encoded events, trailing fields, bytes
hashes, a batch without the rank) and turns every other input into a `WireError`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any

import attrs
import msgpack

from tskv.events import (
    EVENT_TYPES,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    not_an_event,
)


class WireError(ValueError):
    """A payload that is not a KV event batch in any dialect tskv knows; says what was wrong."""


Plain = tuple[float, list[tuple[Any, ...]], "int | None"]


def _plain_event(event: KVEvent) -> tuple[Any, ...]:
    if isinstance(event, EVENT_TYPES):
        return event.wire  # built once, when the event was
    raise not_an_event("event", event)


def to_plain(batch: KVEventBatch) -> Plain:
    """The batch as the tuples and ints the wire array holds (TokenSpeed's positional form)."""
    return (batch.ts, [_plain_event(event) for event in batch.events], batch.attn_dp_rank)


@attrs.frozen
class Codec:
    """One msgpack implementation: plain values to bytes and back. Both give the same bytes."""

    name: str
    pack: Callable[[Any], bytes]
    unpack: Callable[[bytes], Any]

    def encode_batch(self, batch: KVEventBatch) -> bytes:
        return self.pack(to_plain(batch))

    def decode_batch(self, payload: bytes) -> KVEventBatch:
        if not isinstance(payload, (bytes, bytearray, memoryview)):
            raise WireError(f"payload must be bytes, got {type(payload).__name__}")
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
    try:
        import msgspec
    except ImportError:
        return None
    return Codec("msgspec", msgspec.msgpack.Encoder().encode, msgspec.msgpack.Decoder().decode)


def available_codecs() -> dict[str, Codec]:
    """Every codec importable here, by name; the tests run the wire vectors against each."""
    codecs = {"msgpack": _msgpack_codec()}
    fast = _msgspec_codec()
    if fast is not None:
        codecs["msgspec"] = fast
    return codecs


def _choose() -> Codec:
    codecs = available_codecs()
    wanted = os.environ.get("TSKV_CODEC", "")
    if not wanted:
        return codecs.get("msgspec", codecs["msgpack"])
    if wanted not in codecs:
        raise ImportError(
            f"TSKV_CODEC={wanted!r} is not available here; choose one of {sorted(codecs)} "
            "(install tskv[fast] for msgspec)"
        )
    return codecs[wanted]


_ACTIVE = _choose()


def codec_name() -> str:
    """Which encoder tskv uses in this process: "msgspec" or "msgpack"."""
    return _ACTIVE.name


def encode_batch(batch: KVEventBatch) -> bytes:
    """The payload frame for `batch`, byte for byte as TokenSpeed's publisher writes it."""
    return _ACTIVE.encode_batch(batch)


def encode_round(ts: float, events: Iterable[KVEvent], rank: int) -> bytes | None:
    """Encode a round's events straight from the publisher, or None for an empty round.

    The same bytes as `encode_batch(KVEventBatch(ts, events, rank))` without building the
    batch: the publisher's ts and rank are valid by construction, and each event type is
    still checked.
    """
    plain = [_plain_event(event) for event in events]
    return _ACTIVE.pack((ts, plain, rank)) if plain else None


def decode_batch(payload: bytes) -> KVEventBatch:
    """Parse a payload frame from any known publisher; raise `WireError` for anything else."""
    return _ACTIVE.decode_batch(payload)


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


_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size"),
    "BlockRemoved": ("block_hashes",),
    "AllBlocksCleared": (),
}


def _event(index: int, raw: Any) -> KVEvent:
    if isinstance(raw, dict):
        tag = raw.get("type")
        fields = _FIELDS.get(tag) if isinstance(tag, str) else None
        if fields is None:
            raise WireError(f"event {index}: unknown event type {_show(tag)}")
        missing = [name for name in fields if name not in raw and name != "parent_block_hash"]
        if missing:
            raise WireError(f"event {index}: {tag} lacks {', '.join(missing)}")
        values: list[Any] = [raw.get(name) for name in fields]
    elif isinstance(raw, (list, tuple)) and raw:
        tag = raw[0]
        fields = _FIELDS.get(tag) if isinstance(tag, str) else None
        if fields is None:
            raise WireError(f"event {index}: unknown event type {_show(tag)}")
        if len(raw) - 1 < len(fields):
            raise WireError(
                f"event {index}: {tag} needs {len(fields)} fields after its tag, got {len(raw) - 1}"
            )
        values = list(raw[1 : 1 + len(fields)])  # trailing extras (lora_id, medium) dropped
    else:
        raise WireError(f"event {index}: must be a tagged array or map, got {_show(raw)}")
    try:
        if tag == "BlockStored":
            hashes, parent, tokens, block_size = values
            if not isinstance(tokens, (list, tuple)):
                raise WireError(f"event {index}: token_ids must be an array, got {_show(tokens)}")
            return BlockStored(_hashes(hashes, index), _hash(parent), tokens, block_size)
        if tag == "BlockRemoved":
            return BlockRemoved(_hashes(values[0], index))
        return AllBlocksCleared()
    except (TypeError, ValueError) as exc:
        if isinstance(exc, WireError):
            raise
        raise WireError(f"event {index}: {tag}: {exc}") from None


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
