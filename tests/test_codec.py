from __future__ import annotations

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
from tskv import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, WireError
from tskv.codec import available_codecs

TOKENSPEED = load_vectors("tokenspeed_wire.json")
DIALECTS = load_vectors("other_dialects.json")
CODECS = available_codecs()


def expected_batch(case: dict[str, Any]) -> KVEventBatch:
    events: list[tskv.KVEvent] = []
    for event in case["events"]:
        kind = event["type"]
        if kind == "BlockStored":
            events.append(
                BlockStored(
                    event["block_hashes"],
                    event["parent_block_hash"],
                    event["token_ids"],
                    event["block_size"],
                )
            )
        elif kind == "BlockRemoved":
            events.append(BlockRemoved(event["block_hashes"]))
        else:
            assert kind == "AllBlocksCleared"
            events.append(AllBlocksCleared())
    return KVEventBatch(case["ts"], events, case["attn_dp_rank"])


def test_both_codecs_are_installed_for_the_test_session() -> None:
    # The tests session installs msgspec so both encoders run against every vector.
    assert set(CODECS) == {"msgpack", "msgspec"}


@pytest.mark.parametrize("codec", sorted(CODECS))
@pytest.mark.parametrize("case", TOKENSPEED, ids=[case["name"] for case in TOKENSPEED])
def test_encode_gives_tokenspeed_bytes_exactly(codec: str, case: dict[str, Any]) -> None:
    assert CODECS[codec].encode_batch(expected_batch(case)).hex() == case["payload_hex"]


@pytest.mark.parametrize("case", TOKENSPEED, ids=[case["name"] for case in TOKENSPEED])
def test_public_encode_batch_matches_vectors(case: dict[str, Any]) -> None:
    assert tskv.encode_batch(expected_batch(case)).hex() == case["payload_hex"]


@pytest.mark.parametrize(
    "case", TOKENSPEED + DIALECTS, ids=[case["name"] for case in TOKENSPEED + DIALECTS]
)
def test_decode_gives_back_the_listed_events(case: dict[str, Any]) -> None:
    assert tskv.decode_batch(bytes.fromhex(case["payload_hex"])) == expected_batch(case)


@pytest.mark.parametrize("codec", sorted(CODECS))
@pytest.mark.parametrize(
    "case", TOKENSPEED + DIALECTS, ids=[case["name"] for case in TOKENSPEED + DIALECTS]
)
def test_every_decoder_reads_every_dialect(codec: str, case: dict[str, Any]) -> None:
    payload = bytes.fromhex(case["payload_hex"])
    assert CODECS[codec].decode_batch(payload) == expected_batch(case)


@settings(max_examples=300)
@given(batches)
def test_round_trip_through_each_codec(batch: KVEventBatch) -> None:
    payloads = {name: codec.encode_batch(batch) for name, codec in CODECS.items()}
    assert len(set(payloads.values())) == 1, "encoders disagree"
    assert tskv.decode_batch(payloads["msgpack"]) == batch


def test_rank_none_round_trips_as_nil() -> None:
    batch = KVEventBatch(1.0, [], None)
    payload = tskv.encode_batch(batch)
    assert msgpack.unpackb(payload) == [1.0, [], None]
    assert tskv.decode_batch(payload) == batch


def test_codec_choice_is_visible_and_can_be_forced() -> None:
    assert tskv.codec_name() == "msgspec"
    code = "import tskv; print(tskv.codec_name())"
    env = {**os.environ, "TSKV_CODEC": "msgpack"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "msgpack", out.stderr
    env["TSKV_CODEC"] = "nonsense"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode != 0 and "TSKV_CODEC='nonsense'" in out.stderr


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
        (pack([1.0, [["Nope"]], 0]), "unknown event type 'Nope'"),
        (pack([1.0, [[]], 0]), "tagged array or map"),
        (pack([1.0, [7], 0]), "tagged array or map"),
        (pack([1.0, [["BlockStored", [1], None, [1]]], 0]), "needs 4 fields"),
        (pack([1.0, [["BlockStored", [1], None, [1], 0]], 0]), "block_size = 0"),
        (pack([1.0, [["BlockStored", 1, None, [1], 1]], 0]), "block_hashes must be an array"),
        (pack([1.0, [["BlockStored", [1], None, 5, 1]], 0]), "token_ids must be an array"),
        (pack([1.0, [["BlockStored", [1], None, [2**40], 1]], 0]), r"token_ids\[0\]"),
        (pack([1.0, [["BlockRemoved", [1.5]]], 0]), r"block_hashes\[0\] must be an int"),
        (pack([1.0, [["BlockRemoved", ["a"]]], 0]), r"block_hashes\[0\] must be an int"),
        (pack([1.0, [{"type": "BlockRemoved"}], 0]), "BlockRemoved lacks block_hashes"),
        (pack([1.0, [{"kind": "BlockRemoved"}], 0]), "unknown event type None"),
    ],
)
def test_bad_payloads_raise_wire_error_saying_what(payload: bytes, says: str) -> None:
    with pytest.raises(WireError, match=says):
        tskv.decode_batch(payload)


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
    assert all(result == results[0] for result in results), "decoders disagree"
    if results[0] is not None:  # what decodes is a batch tskv can send on unchanged
        assert tskv.decode_batch(tskv.encode_batch(results[0])) == results[0]


@settings(max_examples=3000)
@given(st.binary(max_size=200))
def test_random_bytes_never_raise_anything_but_wire_error(payload: bytes) -> None:
    decodes_or_wire_error(payload)


VALID = [bytes.fromhex(case["payload_hex"]) for case in TOKENSPEED + DIALECTS]


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
    | st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "type"]),
    lambda inner: (
        st.lists(inner, max_size=6)
        | st.dictionaries(st.sampled_from(["type", "block_hashes", "token_ids"]), inner, max_size=4)
    ),
    max_leaves=30,
)


@settings(max_examples=2000)
@given(msgpack_values)
def test_well_formed_msgpack_of_any_shape_is_a_batch_or_wire_error(value: Any) -> None:
    decodes_or_wire_error(pack(value))
    decodes_or_wire_error(pack([1.0, [value], 0]))


@pytest.mark.parametrize("case", TOKENSPEED, ids=[case["name"] for case in TOKENSPEED])
def test_the_publishers_direct_path_gives_the_same_bytes(case: dict[str, Any]) -> None:
    from tskv.codec import encode_round

    batch = expected_batch(case)
    payload = encode_round(batch.ts, batch.events, case["attn_dp_rank"])
    assert payload is None if not batch.events else payload.hex() == case["payload_hex"]
