"""What the msgpack and msgspec codecs would read differently from the same payload, settled,
so that tskv reads a payload alike with msgspec and without it. No I/O.

Both read every value any KV event wire sends the same way. They part only on values no wire
sends, which reach tskv where values are kept as they came (unknown events and fields,
`extra_keys`, an mm_key's fields): an array as a map key, a msgpack timestamp, nesting past
one library's limit and within the other's. The hypothesis tests of `test_codec.py` decode
random and mutated payloads with both and hold them to the same answer.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from typing import Any

import msgpack

from tskv.core.events import BlockStored, KVEvent, MMKey, UnknownEvent


def hashable_keys(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    """A map whose keys may be arrays, read as msgspec reads it: an array key (and any array
    inside it) as a tuple. A map key stays a dict, which no map can take: refused, as there."""
    return {_frozen(key): value for key, value in pairs}


def _frozen(key: Any) -> Any:
    return tuple(_frozen(item) for item in key) if type(key) is list else key


_TIMESTAMPS = (datetime.datetime, msgpack.Timestamp)  # msgspec's reading of one, and msgpack's
MAX_NESTING = 100  # arrays and maps within a value that passes through unchecked


def refusal(events: Sequence[KVEvent]) -> str | None:
    """Why the two codecs would read these events differently, or None: what is refused
    where values pass through unchecked (unknown events and fields, extra_keys, mm_keys'
    fields; the checked fields refuse both already), so that either codec hands over the
    same batch or neither does:
    - a msgpack timestamp (extension type -1): msgspec reads it as a datetime, to the
      microsecond, msgpack as a msgpack.Timestamp, to the nanosecond. No KV event wire uses
      it, so it is refused as every other extension type is;
    - nesting deeper than MAX_NESTING: msgspec's decoder stops at Python's recursion limit
      (less the caller's depth), msgpack's at 1,024 levels."""
    for index, event in enumerate(events):
        if isinstance(event, UnknownEvent):
            pending: list[Any] = [event.fields]
        elif isinstance(event, BlockStored):
            if event.extra_keys is None and event.mm_keys is None and not event.unknown_fields:
                continue  # the usual event: nothing passed through
            pending = [event.extra_keys, event.mm_keys, event.unknown_fields]
        elif event.unknown_fields:
            pending = [event.unknown_fields]
        else:
            continue
        why = _values_refusal(pending)
        if why is not None:
            return f"event {index}: {why}"
    return None


def _values_refusal(values: list[Any]) -> str | None:
    pending = [(value, 0) for value in values]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, (list, tuple, Mapping, MMKey)):
            if depth == MAX_NESTING:
                return f"values nested over {MAX_NESTING} deep"
            if isinstance(item, MMKey):
                item = item.unknown_fields
            inner = (*item.keys(), *item.values()) if isinstance(item, Mapping) else item
            pending.extend((each, depth + 1) for each in inner)
        elif isinstance(item, _TIMESTAMPS):
            return "extension type -1 (a timestamp) is in no KV event wire"
    return None
