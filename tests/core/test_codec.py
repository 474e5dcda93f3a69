"""The payload codec: both wires byte for byte against other publishers' encoders, every dialect
decoded with every field kept, and nothing but WireError out of any input."""

from __future__ import annotations

import concurrent.futures
import logging
import os
import subprocess
import sys
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tskv
from tests.conftest import load_vectors
from tests.strategies import batches
from tskv import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    UnknownEvent,
    WireError,
    decode_batch,
)
from tskv.core.codec import DroppedFields, available_codecs, decode, encode_batch, encode_round
from tskv.core.codec_parity import MAX_NESTING
from tskv.core.events import FIELDS, OPTIONAL_FIELDS, event_fields

TOKENSPEED = load_vectors("tokenspeed_wire.json")
VLLM = load_vectors("vllm_wire.json")
DIALECTS = load_vectors("other_dialects.json")
CODECS = available_codecs()
KINDS = {kind.__name__: kind for kind in FIELDS}


def listed_events(case: dict[str, Any]) -> list[tskv.KVEvent]:
    """The case's events, with exactly the fields it lists."""
    return [
        KINDS[event["type"]](**{k: v for k, v in event.items() if k != "type"})
        for event in case["events"]
    ]


def expected_batch(case: dict[str, Any]) -> KVEventBatch:
    rank = case["attn_dp_rank"] if "attn_dp_rank" in case else case["data_parallel_rank"]
    return KVEventBatch(case["ts"], listed_events(case), rank)


def ids(cases: list[dict[str, Any]]) -> list[str]:
    return [case["name"] for case in cases]


MSGPACK_ONLY = pytest.mark.skipif(
    os.environ.get("TSKV_CODEC") == "msgpack", reason="this run is the world without msgspec"
)


@MSGPACK_ONLY
def test_both_codecs_are_installed_for_the_test_session() -> None:
    # The tests session installs msgspec so both encoders run against every vector.
    assert set(CODECS) == {"msgpack", "msgspec"}


@pytest.mark.parametrize("codec", sorted(CODECS))
@pytest.mark.parametrize("case", TOKENSPEED, ids=ids(TOKENSPEED))
def test_encode_gives_tokenspeed_bytes_exactly(codec: str, case: dict[str, Any]) -> None:
    assert CODECS[codec].encode_batch(expected_batch(case)).hex() == case["payload_hex"]


@pytest.mark.parametrize("codec", sorted(CODECS))
@pytest.mark.parametrize("case", VLLM, ids=ids(VLLM))
def test_encode_gives_vllm_bytes_exactly(codec: str, case: dict[str, Any]) -> None:
    payload = CODECS[codec].encode_batch(expected_batch(case), "vllm")
    assert payload.hex() == case["payload_hex"]


@pytest.mark.parametrize("case", TOKENSPEED, ids=ids(TOKENSPEED))
def test_public_encode_batch_and_the_publishers_path_match_the_vectors(
    case: dict[str, Any],
) -> None:
    batch = expected_batch(case)
    assert tskv.encode_batch(batch).hex() == case["payload_hex"]
    payload = encode_round(batch.ts, batch.events, case["attn_dp_rank"])
    assert payload is None if not batch.events else payload.hex() == case["payload_hex"]


@pytest.mark.parametrize("case", VLLM, ids=ids(VLLM))
def test_the_vllm_wire_through_the_publishers_path(case: dict[str, Any]) -> None:
    batch = expected_batch(case)
    payload = encode_round(batch.ts, batch.events, case["data_parallel_rank"], "vllm")
    assert payload is None if not batch.events else payload.hex() == case["payload_hex"]


@pytest.mark.parametrize("codec", sorted(CODECS))
@pytest.mark.parametrize("case", TOKENSPEED + VLLM, ids=ids(TOKENSPEED + VLLM))
def test_every_decoder_gives_back_every_field(codec: str, case: dict[str, Any]) -> None:
    payload = bytes.fromhex(case["payload_hex"])
    assert CODECS[codec].decode_batch(payload) == expected_batch(case)


REQUIRED = {"BlockStored": 4, "BlockRemoved": 1, "AllBlocksCleared": 0}


def raw_optional_fields(raw: Any) -> dict[str, Any]:
    """The optional fields other publishers put in an event, read from the msgpack itself."""
    tag = raw["type"] if isinstance(raw, dict) else raw[0]
    names = FIELDS[KINDS[tag]]
    optional = names[REQUIRED[tag] :]
    if isinstance(raw, dict):
        return {k: v for k, v in raw.items() if k in optional}
    return dict(zip(optional, raw[1 + REQUIRED[tag] :], strict=False))


@pytest.mark.parametrize("codec", sorted(CODECS))
@pytest.mark.parametrize("case", DIALECTS, ids=ids(DIALECTS))
def test_other_dialects_decode_with_their_optional_fields_kept(
    codec: str, case: dict[str, Any]
) -> None:
    payload = bytes.fromhex(case["payload_hex"])
    decoded = CODECS[codec].decode_batch(payload)
    expected = expected_batch(case)
    assert (decoded.ts, decoded.attn_dp_rank) == (expected.ts, expected.attn_dp_rank)
    raw_events = msgpack.unpackb(payload, strict_map_key=False)[1]
    assert len(decoded.events) == len(expected.events) == len(raw_events)
    for got, listed, raw in zip(decoded.events, expected.events, raw_events, strict=True):
        fields = event_fields(got)
        assert {k: fields[k] for k in event_fields(listed)} == event_fields(listed)
        kept = {k: v for k, v in raw_optional_fields(raw).items() if v is not None}
        assert {k: v for k, v in fields.items() if k not in event_fields(listed)} == kept


@settings(max_examples=300)
@given(batches(optional=True))
def test_the_vllm_wire_round_trips_every_field_through_each_codec(batch: KVEventBatch) -> None:
    payloads = {name: codec.encode_batch(batch, "vllm") for name, codec in CODECS.items()}
    assert len(set(payloads.values())) == 1, "encoders disagree"
    for codec in CODECS.values():
        decoded = codec.decode_batch(payloads["msgpack"])
        assert decoded == batch
        # unknown fields and events included: what was read is sent on byte for byte
        assert codec.encode_batch(decoded, "vllm") == payloads["msgpack"]


@settings(max_examples=300)
@given(batches())
def test_the_tokenspeed_wire_round_trips_through_each_codec(batch: KVEventBatch) -> None:
    payloads = {name: codec.encode_batch(batch) for name, codec in CODECS.items()}
    assert len(set(payloads.values())) == 1, "encoders disagree"
    for codec in CODECS.values():
        assert codec.decode_batch(payloads["msgpack"]) == batch


def test_optional_fields_on_the_tokenspeed_wire_are_dropped_counted_and_said_once() -> None:
    said: list[str] = []
    dropped = DroppedFields(said.append)
    events = [BlockStored([1], None, [1], 1, medium="CPU"), BlockRemoved([1], group_idx=2)]
    for _ in range(3):
        payload = encode_round(1.0, events, 0, dropped=dropped)
    assert payload == encode_round(1.0, [BlockStored([1], None, [1], 1), BlockRemoved([1])], 0)
    assert dropped.events == 6
    [message] = said
    assert "no slot for medium" in message and "wire_format='vllm'" in message


def test_without_a_counter_of_its_own_a_drop_is_a_python_warning_not_a_log_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    batch = KVEventBatch(1.0, [BlockStored([1], None, [1], 1, cache_salt="t")], 0)
    with caplog.at_level(logging.DEBUG), pytest.warns(tskv.TskvWarning, match="cache_salt"):
        tskv.encode_batch(batch, "tokenspeed", dropped=DroppedFields())
    assert caplog.records == []  # the core never logs


def test_what_the_tokenspeed_wire_cannot_carry_is_dropped_counted_and_said_once() -> None:
    salted = BlockStored([1], None, ["<image>"], 1, cache_salt="t", unknown_fields={"new": 1})
    events = [UnknownEvent("BlockTouched", {"hits": 3}), salted, AllBlocksCleared({"why": "x"})]
    said: list[str] = []
    dropped = DroppedFields(said.append)
    payload = encode_round(1.0, events, 0, dropped=dropped)
    assert payload is not None
    assert msgpack.unpackb(payload) == [1.0, [["BlockStored", [1], None, ["<image>"], 1],
                                               ["AllBlocksCleared"]], 0]  # fmt: skip
    assert dropped.events == 3
    [message] = said
    assert "no slot for events of type 'BlockTouched'" in message


def test_positional_events_keep_what_follows_their_known_fields() -> None:
    known = [["BlockStored", [1], None, [2], 1, None, "GPU", None, None, None, None, None, None]]
    payload = pack([1.0, [[*known[0], "later", 7], ["BlockRemoved", [1], None, None, None, 9]], 0])
    for codec in CODECS.values():
        stored, removed = codec.decode_batch(payload).events
        assert isinstance(stored, BlockStored) and stored.medium == "GPU"
        assert stored.unknown_fields == {"13": "later", "14": 7}
        assert isinstance(removed, BlockRemoved) and removed.unknown_fields == {"5": 9}
    unknown = codec.decode_batch(pack([1.0, [["BlockPinned", [1], 3]], 0])).events[0]
    assert unknown == UnknownEvent("BlockPinned", {"1": [1], "2": 3})


def test_rank_none_round_trips_as_nil() -> None:
    batch = KVEventBatch(1.0, [], None)
    payload = tskv.encode_batch(batch)
    assert msgpack.unpackb(payload) == [1.0, [], None]
    assert tskv.decode_batch(payload) == batch


@MSGPACK_ONLY
def test_codec_choice_is_visible_and_can_be_forced() -> None:
    assert tskv.codec_name() == "msgspec"
    event = "tskv.BlockStored([1], None, [], 1)"
    code = f"import tskv; print(tskv.codec_name(), type({event}).__mro__[1].__name__)"
    env = {**os.environ, "TSKV_CODEC": "msgpack"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.split() == ["msgpack", "object"], out.stderr  # not a msgspec Struct
    env["TSKV_CODEC"] = "nonsense"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode != 0 and "TSKV_CODEC='nonsense'" in out.stderr


STORED_MAP = {"type": "BlockStored", "block_hashes": [1], "token_ids": [1], "block_size": 1}


def pack(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


@pytest.mark.parametrize(
    ("payload", "says"),
    [
        (b"", "not valid msgpack"),
        (b"\xc1", "not valid msgpack"),
        (pack([1.0, [], 0]) + b"\x00", "not valid msgpack"),
        (pack({"ts": 1.0}), "batch must be an array"),
        (pack([1.0]), "batch must be an array"),
        (pack([1.0, [], 0, 0]), "batch must be an array"),
        (pack(["x", [], 0]), "ts must be a number"),
        (pack([float("nan"), [], 0]), "ts = nan"),
        (pack([1.0, {}, 0]), "events must be an array"),
        (pack([1.0, [], "0"]), "attn_dp_rank"),
        (pack([1.0, [], -1]), "attn_dp_rank = -1"),
        (pack([1.0, [[7, 1]], 0]), "starts with its type"),
        (pack([1.0, [[]], 0]), "tagged array or map"),
        (pack([1.0, [7], 0]), "tagged array or map"),
        (pack([1.0, [["BlockStored", [1], None, [1]]], 0]), "needs 4 fields"),
        (pack([1.0, [["BlockStored", [1], None, [1], 0]], 0]), "block_size = 0"),
        (pack([1.0, [["BlockStored", 1, None, [1], 1]], 0]), "block_hashes must be an array"),
        (pack([1.0, [["BlockStored", [1], None, 5, 1]], 0]), "token_ids must be an array"),
        (pack([1.0, [["BlockStored", [1], None, [2**40], 1]], 0]), r"token_ids\[0\]"),
        (pack([1.0, [["BlockRemoved", [1.5]]], 0]), r"block_hashes\[0\] must be an int"),
        (pack([1.0, [["BlockRemoved", ["a"]]], 0]), r"block_hashes\[0\] must be an int"),
        (pack([1.0, [["BlockRemoved", [1], 7]], 0]), "medium = 7 must be str"),
        (pack([1.0, [["BlockStored", [1], None, [1], 1, "x"]], 0]), "lora_id = 'x' must be int"),
        (pack([1.0, [{"type": "BlockRemoved"}], 0]), "BlockRemoved lacks block_hashes"),
        (
            pack([1.0, [{"type": "BlockRemoved", "block_hashes": [1], "group_idx": -1}], 0]),
            "group_idx = -1",
        ),
        (pack([1.0, [{"kind": "BlockRemoved"}], 0]), "needs a string 'type'"),
        (pack([1.0, [{"type": 3}], 0]), "needs a string 'type'"),
        (
            pack([1.0, [{**STORED_MAP, "mm_keys": [[{"hash": "h"}]]}], 0]),
            "mm_key must be a map with hash and start_offset",
        ),
        (pack([1.0, [{**STORED_MAP, "token_ids": [1.5]}], 0]), r"token_ids\[0\] must be an int"),
        (pack([1.0, [{**STORED_MAP, "cache_salt": 5}], 0]), "cache_salt = 5 must be str"),
        (pack([1.0, [{**STORED_MAP, "mm_keys": 5}], 0]), "mm_keys must be an array of arrays"),
    ],
)
def test_bad_payloads_raise_wire_error_saying_what(payload: bytes, says: str) -> None:
    for codec in CODECS.values():
        with pytest.raises(WireError, match=says):
            codec.decode_batch(payload)


def test_an_extension_type_anywhere_is_refused_by_every_codec() -> None:
    """Found by the mutation fuzzer: an ext inside an unknown event's fields came back as
    msgpack.ExtType from one codec and msgspec.msgpack.Ext from the other."""
    payload = msgpack.packb(
        [1.0, [["SomethingNew", msgpack.ExtType(0, b"\x00")]], None], use_bin_type=True
    )
    for codec in CODECS.values():
        with pytest.raises(WireError, match="extension type 0 is in no KV event wire"):
            codec.decode_batch(payload)


def test_an_array_as_a_map_key_reads_alike_in_both_codecs() -> None:
    """An unknown event's map keyed by arrays (in no wire, but msgpack allows it): msgspec
    reads such a key as a tuple, nested arrays too, and the msgpack codec must agree, not
    refuse. A map as a key no dict can hold: refused by both."""
    keyed = {(1, (2, 3)): 4, 5: [6]}  # msgpack writes a tuple as an array
    payload = msgpack.packb([1.0, [["SomethingNew", keyed]], None], use_bin_type=True)
    for codec in CODECS.values():
        (event,) = codec.decode_batch(payload).events
        assert isinstance(event, UnknownEvent) and dict(event.fields) == {"1": keyed}
    decodes_or_wire_error(payload)  # the codecs agree, and it is sent on unchanged
    map_key = b"\x81\x81\x01\x02\x05"  # {{1: 2}: 5}
    head = msgpack.packb(1.0) + b"\x91\x92" + msgpack.packb("SomethingNew")
    for codec in CODECS.values():
        with pytest.raises(WireError, match="not valid msgpack"):
            codec.decode_batch(b"\x93" + head + map_key + b"\xc0")


@pytest.mark.parametrize(
    "where",
    ["unknown event", "unknown field", "extra_keys", "mm_key field", "a key", "positional"],
)
@pytest.mark.parametrize(  # its three forms: 4 bytes, 8 (nanoseconds), 12 (before 1970)
    "stamp", [msgpack.Timestamp(1, 0), msgpack.Timestamp(1, 500), msgpack.Timestamp(-5, 7)]
)
def test_a_msgpack_timestamp_is_refused_alike_wherever_values_pass_through(
    where: str, stamp: msgpack.Timestamp
) -> None:
    """msgspec reads the timestamp extension as a datetime (to the microsecond, rounding) and
    msgpack as a Timestamp (to the nanosecond): refused by both, as other extensions are,
    where no field's check would refuse it. Each of its three encodings (4, 8, 12 bytes)."""
    stored = ["BlockStored", [1], None, [5] * 16, 16, None, None, None]
    event = {
        "unknown event": ["SomethingNew", [stamp]],
        "unknown field": [*stored, None, None, None, None, None, None, {"x": stamp}],
        "extra_keys": [*stored, [[stamp]]],
        "mm_key field": {
            "type": "BlockStored",
            "block_hashes": [1],
            "parent_block_hash": None,
            "token_ids": [5] * 16,
            "block_size": 16,
            "mm_keys": [[{"hash": "h", "start_offset": 0, "more": stamp}]],
        },
        "a key": ["SomethingNew", {(1, stamp): 2}],
        "positional": ["SomethingNew", stamp],
    }[where]
    payload = msgpack.packb([1.0, [event], None], use_bin_type=True)
    for codec in CODECS.values():
        with pytest.raises(WireError, match="extension type -1"):
            codec.decode_batch(payload)
    decodes_or_wire_error(payload)


@pytest.mark.parametrize("depth", [MAX_NESTING - 2, MAX_NESTING + 5, 995, 1010])
@pytest.mark.parametrize("where", ["unknown event", "extra_keys"])
def test_deep_values_are_refused_alike_past_the_nesting_limit(where: str, depth: int) -> None:
    """msgspec stops at Python's recursion limit (less its caller's depth), msgpack at 1,024
    levels: past MAX_NESTING both refuse a value that passes through, so they never disagree
    on one nested between the two limits."""
    head = b"\x93" + msgpack.packb(1.0) + b"\x91"
    if where == "unknown event":
        event = b"\x92" + msgpack.packb("SomethingNew")
    else:  # a BlockStored's ninth positional field
        stored = ["BlockStored", [1], None, [5] * 16, 16, None, None, None]
        event = b"\x99" + msgpack.packb(stored)[1:]
    payload = head + event + b"\x91" * depth + b"\x01" + b"\xc0"
    decodes_or_wire_error(payload)
    for codec in CODECS.values():
        if depth < MAX_NESTING:
            codec.decode_batch(payload)
        else:
            with pytest.raises(WireError):
                codec.decode_batch(payload)


def test_wire_error_is_a_value_error_and_non_bytes_is_refused() -> None:
    assert issubclass(WireError, ValueError)
    with pytest.raises(WireError, match="must be bytes"):
        tskv.decode_batch("93")  # type: ignore[arg-type]


def decodes_or_wire_error(payload: bytes) -> None:
    results = []
    for codec in CODECS.values():
        try:
            results.append(codec.decode_batch(payload))
        except WireError:
            results.append(None)
    # repr, not ==: a NaN kept in an unknown field is not equal to itself
    assert all(repr(result) == repr(results[0]) for result in results), "decoders disagree"
    if results[0] is not None:  # what decodes is a batch tskv can send on unchanged
        sent = tskv.encode_batch(results[0], "vllm")
        assert tskv.encode_batch(tskv.decode_batch(sent), "vllm") == sent


@settings(max_examples=3000)
@given(st.binary(max_size=200))
def test_random_bytes_never_raise_anything_but_wire_error(payload: bytes) -> None:
    decodes_or_wire_error(payload)


VALID = [bytes.fromhex(case["payload_hex"]) for case in TOKENSPEED + VLLM + DIALECTS]


@settings(max_examples=3000)
@given(
    st.sampled_from(VALID),
    st.lists(st.tuples(st.integers(0, 400), st.integers(0, 255)), min_size=1, max_size=6),
    st.integers(0, 400),
)
def test_mutated_payloads_never_raise_anything_but_wire_error(
    payload: bytes, flips: list[tuple[int, int]], cut: int
) -> None:
    mutated = bytearray(payload)
    for position, value in flips:
        mutated[position % len(mutated)] = value
    decodes_or_wire_error(bytes(mutated))
    decodes_or_wire_error(bytes(mutated[: cut % (len(mutated) + 1)]))


msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=12)
    | st.binary(max_size=12)
    | st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "type", "GPU"]),
    lambda inner: (
        st.lists(inner, max_size=8)
        | st.dictionaries(
            st.sampled_from(
                ["type", "block_hashes", "token_ids", "block_size", "medium", "group_idx"]
            ),
            inner,
            max_size=5,
        )
    ),
    max_leaves=30,
)


@settings(max_examples=2000)
@given(msgpack_values)
def test_well_formed_msgpack_of_any_shape_is_a_batch_or_wire_error(value: Any) -> None:
    decodes_or_wire_error(pack(value))
    decodes_or_wire_error(pack([1.0, [value], 0]))
    decodes_or_wire_error(pack([1.0, [["BlockStored", [1], None, [2], 4, value]], 0]))


async def test_a_subscriber_with_vllm_shaped_structs_reads_a_live_vllm_wire_stream() -> None:
    """A consumer written as vLLM 0.33's is (map events tagged "type", decoded with msgspec
    into Structs whose fields are vLLM's), reading tskv's stream on the vLLM wire."""
    import msgspec
    import trio

    from tests.zmq_helpers import LOOPBACK, subscribed

    stored = msgspec.defstruct(
        "VllmBlockStored",
        [
            ("block_hashes", list[int]),
            ("parent_block_hash", int | None),
            ("token_ids", list[int]),
            ("block_size", int),
            ("lora_id", int | None),
            ("medium", str | None),
            ("lora_name", str | None),
            ("extra_keys", list[Any] | None, None),
            ("group_idx", int | None, None),
            ("kv_cache_spec_kind", str | None, None),
            ("kv_cache_spec_sliding_window", int | None, None),
            ("locality", str | None, None),
            ("ownership", str | None, None),
            ("session_id", str | None, None),
            ("lookahead_token_ids", list[list[int]] | None, None),
        ],
        tag="BlockStored",
        tag_field="type",
    )
    removed = msgspec.defstruct(
        "VllmBlockRemoved",
        [
            ("block_hashes", list[int]),
            ("medium", str | None),
            ("group_idx", int | None, None),
            ("locality", str | None, None),
            ("ownership", str | None, None),
        ],
        tag="BlockRemoved",
        tag_field="type",
    )
    cleared = msgspec.defstruct(
        "VllmAllBlocksCleared", [], tag="AllBlocksCleared", tag_field="type"
    )
    batch_type = msgspec.defstruct(
        "VllmBatch",
        [
            ("ts", float),
            ("events", list[stored | removed | cleared]),
            ("data_parallel_rank", int | None),
        ],  # type: ignore[valid-type]
        array_like=True,
    )
    decode = msgspec.msgpack.Decoder(batch_type).decode
    rounds = [
        [BlockStored([n, n + 1], n - 1 if n else None, list(range(8)), 4, medium="GPU")]
        + ([BlockRemoved([n - 1], medium="CPU", group_idx=1)] if n % 3 == 0 else [])
        + ([AllBlocksCleared()] if n == 7 else [])
        for n in range(20)
    ]
    config = tskv.KVEventsConfig(endpoint=LOOPBACK, wire_format="vllm", replay_endpoint=None)
    async with tskv.open_publisher(config) as publisher, subscribed(publisher) as sub:
        for events in rounds:
            await publisher.publish(events)
        received = []
        with trio.fail_after(10):
            for _ in rounds:
                received.append(decode((await sub.receive())[2]))
    for got, sent in zip(received, rounds, strict=True):
        assert got.data_parallel_rank == 0
        assert [msgspec.structs.asdict(event) for event in got.events] == [
            event_fields_with_defaults(event) for event in sent
        ]


def event_fields_with_defaults(event: tskv.KVEvent) -> dict[str, Any]:
    """An event as vLLM's Structs hold it: every field of vLLM's, the unset ones None."""
    return {name: getattr(event, name) for name in FIELDS[type(event)] if name not in NOT_VLLM}


NOT_VLLM = ("mm_keys", "cache_salt")  # TensorRT-LLM's and SGLang's additions


# The TokenSpeed encoder's hot loop names the optional fields by hand (a comprehension that
# reads attributes costs less than walking a list); these prove it names every one the field
# list has, so a field added to events.OPTIONAL_FIELDS and forgotten there fails here.
SAMPLE_VALUES: dict[str, Any] = {
    "lora_id": 3,
    "medium": "CPU",
    "lora_name": "adapter",
    "extra_keys": [["k"]],
    "group_idx": 1,
    "kv_cache_spec_kind": "full",
    "kv_cache_spec_sliding_window": 128,
    "locality": "local",
    "mm_keys": [[tskv.MMKey(7, 0)]],
    "cache_salt": "tenant",
    "session_id": "s-1",
    "ownership": "cpu-offload",
    "lookahead_token_ids": [[16, 17]],
}


def one_field_set(kind: type, name: str) -> tskv.KVEvent:
    if kind is BlockStored:
        return BlockStored([1], None, list(range(16)), 16, **{name: SAMPLE_VALUES[name]})
    return BlockRemoved([1], **{name: SAMPLE_VALUES[name]})


@pytest.mark.parametrize(
    ("kind", "name"),
    [(kind, name) for kind in (BlockStored, BlockRemoved) for name in OPTIONAL_FIELDS[kind]],
)
def test_every_optional_field_leaves_the_tokenspeed_fast_path_and_reaches_the_vllm_wire(
    kind: type, name: str
) -> None:
    event = one_field_set(kind, name)
    dropped = DroppedFields(lambda message: None)
    encode_round(0.0, [event], 0, "tokenspeed", dropped=dropped)
    assert dropped.events == 1, f"{kind.__name__}.{name} took the fast path and was lost"
    payload = encode_round(0.0, [event], 0, "vllm")
    assert payload is not None
    [decoded] = decode_batch(payload).events
    assert getattr(decoded, name) == SAMPLE_VALUES[name]


def test_decoding_returns_how_many_unknown_events_it_saw_whatever_else_decodes() -> None:
    """What the decoder saw comes back with what it made, as h11's parser returns events: no
    count kept in the module, which another decode meanwhile (another thread, a nested call)
    would move between a caller's before and after."""

    odd = [UnknownEvent("BlockPinned", {"1": 3}), BlockRemoved([1]), UnknownEvent("X", {})]
    with_unknown = encode_batch(KVEventBatch(1.0, odd), "vllm")
    plain = encode_batch(KVEventBatch(1.0, [BlockRemoved([2])]))

    def decode_many(payload: bytes, expected: int) -> list[int]:
        return [count for _, count in (decode(payload) for _ in range(2_000)) if count != expected]

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        wrong = [
            pool.submit(decode_many, payload, expected)
            for payload, expected in [(with_unknown, 2), (plain, 0)] * 2
        ]
        assert [future.result() for future in wrong] == [[]] * 4
    batch, count = decode(with_unknown)
    assert count == 2 and batch.events == odd
