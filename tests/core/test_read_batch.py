"""The compiled core's reading of plain batches (`read_batch`, `read_plain` in _compiled.c)
files every batch as decoding it and applying its events does, and reads nothing the decoder
would refuse or read otherwise: the decoder and `Filing.apply` are the reference."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.strategies import examples
from tskv.core import codec, compiled, read_batch
from tskv.core.codec import DroppedFields, WireError, decode_batch, encode_batch
from tskv.core.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    UnknownEvent,
)
from tskv.core.journal_index import JournalIndex
from tskv.core.prefix_index import BlockIndex
from tskv.core.read_batch import CLEARED, REMOVED, STORED, ReadBatch, reader

_compiled = pytest.importorskip("tskv.core._compiled", reason="the compiled core is not built here")
core_reads = pytest.mark.skipif(compiled.core is None, reason="the pure path decodes every payload")
VECTORS = Path(__file__).resolve().parents[1] / "vectors"

pool = st.integers(0, 11).map(lambda n: (n * 0x9E3779B97F4A7C15) % 2**64)  # hashes that meet
tokens = st.one_of(st.integers(0, 9), st.integers(-(2**31), 2**31 - 1))


@st.composite
def plain_events(draw: st.DrawFn) -> KVEvent:
    """Events of a few workers' caches whose hashes meet often: stores chained to a block
    held, earlier in the batch, unknown or none; removals of what may be held; resets; and
    now and then an event the core declines (a tier, a LoRA, a string token, an unknown type)."""
    kind = draw(st.sampled_from(["stored"] * 6 + ["removed"] * 2 + ["cleared", "other"]))
    if kind == "removed":
        return BlockRemoved(draw(st.lists(pool, max_size=5)))
    if kind == "cleared":
        return AllBlocksCleared()
    stored = BlockStored(
        draw(st.lists(pool, min_size=1, max_size=6)),
        draw(st.none() | pool),
        draw(st.lists(tokens, max_size=14)),
        draw(st.sampled_from([2, 2, 2, 3, 1])),  # mostly the index's size below
    )
    if kind == "stored":
        return stored
    fields = stored.block_hashes, stored.parent_block_hash, stored.token_ids, stored.block_size
    return draw(
        st.sampled_from(
            [
                BlockStored(*fields, medium="CPU"),
                BlockStored(*fields[:3], 4, medium="GPU", group_idx=0),
                BlockStored(*fields, lora_name="adapter"),
                BlockStored(*fields[:2], ["<image>", *stored.token_ids], 2),
                BlockRemoved(list(stored.block_hashes), medium="CPU"),
                UnknownEvent("Offloaded", {}),
            ]
        )
    )


streams = st.lists(
    st.tuples(
        st.integers(0, 2),  # the worker
        st.lists(plain_events(), max_size=6),
        st.sampled_from(["tokenspeed"] * 3 + ["vllm"]),
    ),
    max_size=10,
)


def state(index: BlockIndex) -> Any:
    """Everything the index holds, comparable: each key's holders, each worker's blocks and
    their extra holds, its trust and what it could not use."""
    holdings = index._holdings
    views = {
        worker: (
            sorted(view.blocks.items(), key=repr),
            dict(view.extra_refs),
            dict(view.copies),
            view.tier,
            view.hybrid is not None,
        )
        for worker, view in holdings.workers.items()
    }
    stale = {worker: index.worker_view(worker).stale for worker in holdings.workers}
    holders = getattr(holdings, "holders", {})  # a JournalIndex keeps none
    return sorted(holders.items()), views, stale, index.statistics()


@core_reads
@given(streams)
@settings(max_examples=examples(300))
def test_read_batches_leave_the_index_as_decoded_ones_do(stream: Any) -> None:
    decoded, read = JournalIndex(2), JournalIndex(2)
    read_payload = reader(2)
    for worker, events, wire in stream:
        quiet = DroppedFields(lambda _: None)  # TokenSpeed's wire drops the optional fields
        payload = encode_batch(KVEventBatch(1.0, events), wire, dropped=quiet)
        batch = decode_batch(payload)
        decoded.apply(worker, batch)
        made, unknown = read_payload(payload)
        read.apply(worker, made)
        assert unknown == sum(isinstance(event, UnknownEvent) for event in batch.events)
        assert state(read) == state(decoded)
        assert read.take_changes(worker) == decoded.take_changes(worker)


@core_reads
def test_a_plain_tokenspeed_batch_is_read_and_anything_else_decoded() -> None:
    plain = [BlockStored([1, 2], None, list(range(4)), 2), BlockRemoved([1]), AllBlocksCleared()]
    read_payload = reader(2)
    made, unknown = read_payload(encode_batch(KVEventBatch(2.5, plain, 3)))
    assert isinstance(made, ReadBatch) and unknown == 0
    assert (made.ts, made.attn_dp_rank) == (2.5, 3)
    assert [step[0] for step in made.steps] == [STORED, REMOVED, CLEARED]
    assert made.events == plain  # decoded from its payload when asked
    for other in (
        encode_batch(KVEventBatch(2.5, plain), "vllm"),
        encode_batch(KVEventBatch(2.5, [BlockStored([1], None, [1, 2], 2, lora_id=4)]), "vllm"),
    ):
        assert isinstance(read_payload(other)[0], KVEventBatch)
    with pytest.raises(WireError):
        read_payload(b"\x92\xa1x")


def test_the_pure_path_decodes_every_payload(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compiled, "core", None)
    assert read_batch.reader(16) is codec.decode


# -- what the core reads is what the decoder reads ---------------------------------------------


def _int(value: int, draw: st.DrawFn) -> bytes:
    """`value` in a msgpack int form chosen at random among those that hold it: the core
    must read every width a publisher's encoder may pick."""
    forms: list[tuple[str, int]] = []
    if 0 <= value <= 0x7F or -32 <= value < 0:
        forms.append(("fix", 0))
    for head, fmt, low, high in (
        (0xCC, ">B", 0, 2**8), (0xCD, ">H", 0, 2**16), (0xCE, ">I", 0, 2**32),
        (0xCF, ">Q", 0, 2**64), (0xD0, ">b", -(2**7), 2**7), (0xD1, ">h", -(2**15), 2**15),
        (0xD2, ">i", -(2**31), 2**31), (0xD3, ">q", -(2**63), 2**63),
    ):  # fmt: skip
        if low <= value < high:
            forms.append((fmt, head))
    fmt, head = draw(st.sampled_from(forms))
    return struct.pack(">b", value) if fmt == "fix" else bytes([head]) + struct.pack(fmt, value)


def _array(count: int, draw: st.DrawFn) -> bytes:
    form = draw(st.sampled_from(["fix", "16", "32"] if count < 16 else ["16", "32"]))
    if form == "fix":
        return bytes([0x90 | count])
    return (
        b"\xdc" + struct.pack(">H", count) if form == "16" else b"\xdd" + struct.pack(">I", count)
    )


def _pack(value: Any, draw: st.DrawFn) -> bytes:
    """A msgpack encoding of `value` whose every int, array and float takes a form drawn."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        if isinstance(value, str) and draw(st.booleans()):
            text = value.encode()
            return b"\xd9" + bytes([len(text)]) + text  # str8, where fixstr would do
        return msgpack.packb(value)
    if isinstance(value, int):
        return _int(value, draw)
    if isinstance(value, float):
        fits = not math.isfinite(value) or abs(value) < 2**127  # float32 holds it, perhaps
        if (
            fits
            and struct.unpack(">f", struct.pack(">f", value))[0] == value
            and draw(st.booleans())
        ):
            return b"\xca" + struct.pack(">f", value)
        return b"\xcb" + struct.pack(">d", value)
    if isinstance(value, (list, tuple)):
        return _array(len(value), draw) + b"".join(_pack(item, draw) for item in value)
    return msgpack.packb(value)


@st.composite
def payloads(draw: st.DrawFn) -> bytes:
    """Batches in every encoding a publisher may pick, with values at and past what the wire
    allows, and now and then broken: a byte changed, cut short, or more after the end."""
    fields = [
        draw(st.one_of(st.floats(), st.integers(-(2**63), 2**64 - 1), st.booleans())),
        draw(
            st.lists(
                st.one_of(
                    st.tuples(
                        st.just("BlockStored"),
                        st.lists(st.integers(-(2**63), 2**64 - 1) | st.booleans(), max_size=4),
                        st.none() | st.integers(-(2**63), 2**64 - 1),
                        st.lists(
                            st.integers(-(2**31) - 1, 2**31) | st.text(max_size=1), max_size=9
                        ),
                        st.integers(-1, 3),
                    ).map(list),
                    st.tuples(st.just("BlockRemoved"), st.lists(st.integers(0, 9), max_size=3)),
                    st.just(["AllBlocksCleared"]),
                    st.lists(st.sampled_from(["BlockStored", "BlockRemoved", 1, None]), max_size=6),
                ),
                max_size=4,
            )
        ),
    ]
    if draw(st.booleans()):
        fields.append(draw(st.none() | st.integers(-2, 2**64 - 1)))
    payload = bytearray(_pack(fields, draw))
    damage = draw(st.sampled_from(["none"] * 4 + ["byte", "cut", "more"]))
    if damage == "byte":
        payload[draw(st.integers(0, len(payload) - 1))] = draw(st.integers(0, 255))
    elif damage == "cut":
        del payload[draw(st.integers(0, len(payload) - 1)) :]
    elif damage == "more":
        payload += b"\xc0"
    return bytes(payload)


def as_read(event: KVEvent, size: int) -> tuple[Any, ...] | None:
    """The step the core makes of a plain event; None for an event it must not read."""
    if type(event) is AllBlocksCleared and not event.unknown_fields:
        return (CLEARED,)
    if type(event) is BlockRemoved and event == BlockRemoved(list(event.block_hashes)):
        return (REMOVED, list(event.block_hashes))
    if type(event) is not BlockStored:
        return None
    fields = event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size
    if event != BlockStored(*fields):  # an optional field is set
        return None
    tokens, count = list(event.token_ids), len(event.block_hashes)
    whole = min(count, len(tokens) // size)
    contents = b"".join(
        struct.pack("=q", hash(tuple(tokens[n * size : (n + 1) * size]))) for n in range(whole)
    )
    hashes = list(event.block_hashes)
    return (STORED, hashes, event.parent_block_hash, contents, event.block_size)


def check_read_as_decoded(payload: bytes, size: int) -> bool:
    """The core reads `payload` as the decoder does, or leaves it to the decoder; whether it
    read it."""
    made = _compiled.read_plain(payload, size)
    try:
        batch = decode_batch(payload)
    except WireError:
        assert made is None
        return False
    if made is None:
        return False
    ts, rank, steps = made
    assert (ts, rank) == (batch.ts, batch.attn_dp_rank)
    assert type(ts) is float
    assert steps == [as_read(event, size) for event in batch.events]
    return True


@given(payloads(), st.integers(1, 3))
@settings(max_examples=examples(1_000))
def test_the_core_reads_any_payload_as_the_decoder_or_declines(payload: bytes, size: int) -> None:
    check_read_as_decoded(payload, size)


def test_every_wire_vector_is_read_as_decoded_and_the_plain_ones_are_read() -> None:
    read = 0
    for path in [*sorted(VECTORS.glob("*_wire.json")), VECTORS / "other_dialects.json"]:
        for case in json.loads(path.read_text())["cases"]:
            for name, value in case.items():
                if name.startswith("payload") and name.endswith("hex"):
                    read += check_read_as_decoded(bytes.fromhex(value), 16)
    assert read >= 3  # TokenSpeed's own vectors among them


@pytest.mark.parametrize(
    ("payload", "size", "error"),
    [(b"", 0, ValueError), (b"", -3, ValueError), (b"", "16", TypeError)],
)
def test_a_bad_size_is_refused(payload: bytes, size: Any, error: type) -> None:
    with pytest.raises(error):
        _compiled.read_plain(payload, size)


@pytest.mark.parametrize("payload", [None, "text", 12, memoryview(b"\x92\x00\x90")])
def test_what_is_not_bytes_is_left_to_the_decoder_or_read_as_bytes(payload: Any) -> None:
    made = _compiled.read_plain(payload, 16)
    assert made == ((0.0, None, []) if isinstance(payload, memoryview) else None)


def test_read_run_refuses_what_read_plain_never_makes() -> None:
    """A step read_plain never makes is refused; a worker's blocks that are not a BlockMap of
    plain ids (or a root that is not an exact int) are declined, for filing to key in Python."""
    blocks = _compiled.BlockMap()
    with pytest.raises(TypeError):
        _compiled.read_run([(STORED, [1], None)], 2, blocks, 0)
    with pytest.raises(TypeError):
        _compiled.read_run([(STORED, [True], None, b"", 2)], 2, blocks, 0)  # an int subclass
    with pytest.raises(TypeError):
        _compiled.read_run("not a list", 2, blocks, 0)
    steps = [(STORED, [1], None, b"", 2)]
    assert _compiled.read_run(steps, 2, blocks, 0) == ([1], [None], 0, 1)
    assert _compiled.read_run(steps, 2, {}, 0) is None
    blocks[object()] = 1  # an id whose hash is its own: the map is no longer plain
    assert _compiled.read_run(steps, 2, blocks, 0) is None
