"""What a publisher says it is, on request: no engine's stream says which block size or hash it
uses, so a router that mixes workers of two configurations matches nothing and cannot tell why.

A tskv publisher answers a describe request (`frames.describe_request`) with one `Descriptor`,
a msgpack map; a publisher that knows none ends the request at once, and its consumer goes on
as before. `mismatch` is the check a watcher makes with it. No I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs
import msgpack

from tskv.core.codec import WireError
from tskv.core.events import BlockStored, KVEvent

# vLLM's names for its prefix-cache hashes (`--prefix-caching-hash-algo`); any other string is
# taken as given (TokenSpeed's FNV-1a, a proprietary one).
HASH_ALGORITHMS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
MAX_DESCRIPTOR_BYTES = 64 << 10  # a descriptor of 1,000 groups is ~60 KB; a larger one is refused
MAX_GROUPS = 1024


@attrs.frozen
class GroupInfo:
    """One KV cache group as the stream named it (vLLM's hybrid models have several)."""

    index: int
    kind: str | None  # vLLM's kv_cache_spec_kind: "full_attention", "sliding_window", ...
    block_size: int
    sliding_window: int | None  # tokens, for a window's kinds

    @classmethod
    def of(cls, stored: BlockStored) -> GroupInfo:
        assert stored.group_idx is not None
        return cls(
            int(stored.group_idx),
            stored.kv_cache_spec_kind,
            stored.block_size,
            stored.kv_cache_spec_sliding_window,
        )


class PublishedGroups:
    """The groups a stream has named so far, for a publisher that keeps no cache state (the
    state's own `groups` serve one that does); followed as the state is, batch by batch."""

    def __init__(self) -> None:
        self.groups: dict[int, BlockStored] = {}

    def apply(self, payload: bytes, events: Sequence[KVEvent]) -> None:
        for event in events:
            if isinstance(event, BlockStored) and event.group_idx is not None:
                known = self.groups.get(int(event.group_idx))
                if known is None or GroupInfo.of(known) != GroupInfo.of(event):
                    self.groups[int(event.group_idx)] = event


@attrs.frozen
class Descriptor:
    """A publisher's answer to "what are you?". Every field but the version may be None where
    the publisher does not know it (a block size not configured, an empty buffer)."""

    tskv_version: str
    epoch: int | None
    wire_format: str
    topic: str
    dp_rank: int
    block_size: int | None  # tokens per block, where configured
    hash_algorithm: str | None  # where configured: one of HASH_ALGORITHMS, or the publisher's name
    groups: tuple[GroupInfo, ...]  # the KV cache groups published so far, by index
    oldest_seq: int | None  # the replay buffer's oldest batch
    newest_seq: int | None  # ...and newest
    snapshots: bool  # whether snapshot requests are served
    unknown_fields: Mapping[str, Any] = attrs.field(factory=dict)  # a later tskv's additions

    @classmethod
    def with_groups(cls, groups: Iterable[BlockStored], **fields: Any) -> Descriptor:
        infos = sorted((GroupInfo.of(stored) for stored in groups), key=lambda g: g.index)
        return cls(groups=tuple(infos[:MAX_GROUPS]), **fields)

    def encode(self) -> bytes:
        fields = attrs.asdict(self, recurse=False, filter=lambda a, _: a.name != "unknown_fields")
        fields["groups"] = [attrs.asdict(group) for group in self.groups]
        packed: bytes = msgpack.packb(fields)
        return packed

    @classmethod
    def decode(cls, payload: bytes) -> Descriptor:
        """Read a descriptor; a field of the wrong type, or a payload that is not one, is a
        WireError naming it. Fields a later tskv adds are kept in `unknown_fields`."""
        if len(payload) > MAX_DESCRIPTOR_BYTES:
            raise WireError(f"descriptor of {len(payload)} bytes, over {MAX_DESCRIPTOR_BYTES}")
        try:
            data = msgpack.unpackb(payload, strict_map_key=True)
        except Exception as exc:  # msgpack raises several kinds for broken input
            raise WireError(f"descriptor is not msgpack: {exc}") from None
        if not isinstance(data, dict):
            raise WireError(f"descriptor must be a map, got {type(data).__name__}")
        known = {field.name for field in attrs.fields(cls)} - {"unknown_fields"}
        values: dict[str, Any] = {name: data.get(name) for name in known}
        _check(values, "tskv_version", str, optional=False)
        _check(values, "wire_format", str, optional=False)
        _check(values, "topic", str, optional=False)
        _check(values, "dp_rank", int, optional=False)
        _check(values, "snapshots", bool, optional=False)
        for name in ("epoch", "block_size", "oldest_seq", "newest_seq"):
            _check(values, name, int)
        _check(values, "hash_algorithm", str)
        groups = values["groups"]
        if not isinstance(groups, list) or len(groups) > MAX_GROUPS:
            raise WireError(f"descriptor's groups must be a list of at most {MAX_GROUPS}")
        values["groups"] = tuple(_group(group) for group in groups)
        unknown = {key: value for key, value in data.items() if key not in known}
        return cls(**values, unknown_fields=unknown)

    def summary(self) -> dict[str, Any]:
        """The descriptor as plain values (JSON, a log line)."""
        fields = attrs.asdict(self)
        fields["groups"] = [attrs.asdict(group) for group in self.groups]
        if not self.unknown_fields:
            del fields["unknown_fields"]
        return fields


def _check(values: dict[str, Any], name: str, kind: type, optional: bool = True) -> None:
    value = values[name]
    if value is None and optional:
        return
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise WireError(f"descriptor's {name} must be {kind.__name__}, got {value!r:.40}")


def _group(data: object) -> GroupInfo:
    if not isinstance(data, dict):
        raise WireError(f"descriptor's group must be a map, got {data!r:.40}")
    names = ("index", "kind", "block_size", "sliding_window")
    values: dict[str, Any] = {name: data.get(name) for name in names}
    _check(values, "index", int, optional=False)
    _check(values, "block_size", int, optional=False)
    _check(values, "kind", str)
    _check(values, "sliding_window", int)
    return GroupInfo(**values)


def mismatch(descriptor: Descriptor, block_size: int, others: Iterable[Descriptor]) -> str | None:
    """Why a worker that says `descriptor` cannot be matched beside an index of `block_size`
    and its other workers' descriptors, naming both values; None when nothing says it differs
    (a field a publisher does not say is never a mismatch)."""
    said = descriptor.block_size
    if said is not None and said != block_size:
        return f"its block size is {said}, the index's is {block_size}"
    for other in others:
        if said is not None and other.block_size is not None and other.block_size != said:
            return f"its block size is {said}, another worker's is {other.block_size}"
        mine, theirs = descriptor.hash_algorithm, other.hash_algorithm
        if mine is not None and theirs is not None and mine != theirs:
            return f"its hash algorithm is {mine}, another worker's is {theirs}"
    return None
