"""Every current engine's stream read whole: TensorRT-LLM, SGLang and a later vLLM.

Each engine's events are declared here as msgspec Structs from the field lists its publisher
declares (TensorRT-LLM's `tensorrt_llm/_torch/pyexecutor/kv_cache_events.py`; SGLang's and the
later vLLM's as `shared/vectors/engines_wire.json` records them), checked first against the
vectors' bytes, then published on a plain pyzmq socket as those publishers send them and read
with `open_subscriber` and `tskv listen`.
"""

from __future__ import annotations

import io
import json
import logging
import typing
from types import MappingProxyType
from typing import Any

import msgspec
import pytest
import trio
import zmq

import tskv
from tests.conftest import load_vectors
from tests.zmq_helpers import LOOPBACK
from tskv import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, MMKey, UnknownEvent
from tskv._cli.listen import batch_json
from tskv.core.codec import available_codecs
from tskv.core.frames import live_message
from tskv.shells._trio_zmq import TrioSocket

CASES = load_vectors("engines_wire.json")
CODECS = available_codecs()
ENGINES = sorted({case["engine"] for case in CASES})


def ids(cases: list[dict[str, Any]]) -> list[str]:
    return [f"{case['engine']}: {case['name']}" for case in cases]


# -- what a consumer must get back, from the vector's listing --------------------------------


def expected_event(listed: dict[str, Any]) -> tskv.KVEvent:
    fields = {k: v for k, v in listed.items() if k != "type"}
    if fields.pop("unknown_event", False):
        return UnknownEvent(listed["type"], MappingProxyType(fields["fields"]))
    if "mm_keys" in fields:
        fields["mm_keys"] = [[MMKey(**key) for key in keys] for keys in fields["mm_keys"]]
    if "unknown_fields" in fields:
        fields["unknown_fields"] = MappingProxyType(fields["unknown_fields"])
    kind = {"BlockStored": BlockStored, "BlockRemoved": BlockRemoved}.get(listed["type"])
    return AllBlocksCleared(**fields) if kind is None else kind(**fields)


def expected_batch(case: dict[str, Any]) -> KVEventBatch:
    return KVEventBatch(case["ts"], [expected_event(e) for e in case["events"]], case["rank"])


@pytest.mark.parametrize("codec", sorted(CODECS))
@pytest.mark.parametrize("case", CASES, ids=ids(CASES))
def test_every_engines_payload_decodes_to_exactly_what_a_consumer_must_get(
    codec: str, case: dict[str, Any]
) -> None:
    decoded = CODECS[codec].decode_batch(bytes.fromhex(case["payload_hex"]))
    assert decoded == expected_batch(case)
    # and `tskv listen --json` shows each event as the vector lists it, every field kept
    assert json.loads(batch_json(0, decoded))["events"] == case["events"]


REENCODED = [case for case in CASES if case["engine"] in ("tensorrt-llm", "vllm-later")]


@pytest.mark.parametrize("case", REENCODED, ids=ids(REENCODED))
def test_map_events_in_vllms_order_are_sent_on_byte_for_byte(case: dict[str, Any]) -> None:
    """TensorRT-LLM and vLLM order their fields as tskv's vLLM wire does (SGLang leaves
    lora_name out when unset, so its bytes differ though every value is the same)."""
    payload = bytes.fromhex(case["payload_hex"])
    for codec in CODECS.values():
        assert codec.encode_batch(codec.decode_batch(payload), "vllm") == payload


# -- each engine's own Structs ---------------------------------------------------------------


def _struct(name: str, fields: list[Any], **options: Any) -> type[msgspec.Struct]:
    options.setdefault("tag", name)
    return msgspec.defstruct(name, fields, omit_defaults=True, **options)


def tensorrt_llm() -> tuple[Any, type[msgspec.Struct]]:
    """As tensorrt_llm/_torch/pyexecutor/kv_cache_events.py declares them (read there)."""
    mm_key = _struct(
        "MultimodalKey",
        [("hash", str), ("start_offset", int), ("uuid", str | None, None)],
        tag="mm_key",
    )
    stored = _struct(
        "BlockStored",
        [
            ("block_hashes", list[int]),
            ("parent_block_hash", int | None),
            ("token_ids", list[int | str]),
            ("block_size", int),
            ("lora_id", int | None),
            ("medium", str | None),
            ("lora_name", str | None),
            ("extra_keys", list[Any] | None, None),
            ("group_idx", int | None, None),
            ("kv_cache_spec_kind", str | None, None),
            ("kv_cache_spec_sliding_window", int | None, None),
            ("locality", str | None, None),
            ("mm_keys", list[list[mm_key]] | None, None),  # type: ignore[valid-type]
        ],
    )
    removed = _struct(
        "BlockRemoved",
        [
            ("block_hashes", list[int]),
            ("medium", str | None),
            ("group_idx", int | None, None),
            ("locality", str | None, None),
        ],
    )
    cleared = _struct("AllBlocksCleared", [])
    batch = _struct(
        "EventBatch",
        [("ts", float), ("events", list[Any]), ("data_parallel_rank", int | None, None)],
        tag=None,
        array_like=True,
    )
    return stored | removed | cleared, batch


def always_three_elements() -> type[msgspec.Struct]:
    """The batch as SGLang and vLLM declare it: the rank always sent, nil when unset."""
    return msgspec.defstruct(
        "EventBatch",
        [("ts", float), ("events", list[Any]), ("data_parallel_rank", int | None)],
        array_like=True,
    )


def sglang() -> tuple[Any, type[msgspec.Struct]]:
    """SGLang's map events: vLLM's BlockStored fields before the tier, then its own salt and
    session; lora_name only when set. The batch always has its three elements."""
    stored = _struct(
        "BlockStored",
        [
            ("block_hashes", list[int]),
            ("parent_block_hash", int | None),
            ("token_ids", list[int]),
            ("block_size", int),
            ("lora_id", int | None),
            ("medium", str | None),
            ("lora_name", str | None, None),
            ("cache_salt", str | None, None),
            ("session_id", str | None, None),
        ],
    )
    removed = _struct("BlockRemoved", [("block_hashes", list[int]), ("medium", str | None)])
    cleared = _struct("AllBlocksCleared", [])
    batch = always_three_elements()
    return stored | removed | cleared, batch


def vllm_later() -> tuple[Any, type[msgspec.Struct]]:
    """vLLM's current map events, plus what a later version adds: a field on BlockStored and
    an event type of its own."""
    stored = _struct(
        "BlockStored",
        [
            ("block_hashes", list[int]),
            ("parent_block_hash", int | None),
            ("token_ids", list[int]),
            ("block_size", int),
            ("lora_id", int | None),
            ("medium", str | None),
            ("lora_name", str | None),
            ("future_field", dict[str, Any] | None, None),
        ],
    )
    touched = _struct("BlockTouched", [("block_hashes", list[int]), ("hits", int)])
    removed = _struct("BlockRemoved", [("block_hashes", list[int]), ("medium", str | None)])
    batch = always_three_elements()
    return stored | touched | removed, batch


ENGINE_STRUCTS = {"tensorrt-llm": tensorrt_llm, "sglang": sglang, "vllm-later": vllm_later}


def engine_payload(case: dict[str, Any]) -> bytes:
    """The case's batch built from the engine's Structs and encoded as its publisher does."""
    events_type, batch_type = ENGINE_STRUCTS[case["engine"]]()
    events = []
    for listed in case["events"]:
        fields = {"type": listed["type"]}
        if listed.get("unknown_event"):
            fields.update(listed["fields"])
        else:
            fields.update({k: v for k, v in listed.items() if k != "unknown_fields"})
            fields.update(listed.get("unknown_fields", {}))
        if "mm_keys" in fields:
            fields["mm_keys"] = [[{"type": "mm_key", **k} for k in ks] for ks in fields["mm_keys"]]
        kind = next(k for k in typing.get_args(events_type) if k.__name__ == listed["type"])
        for field in msgspec.structs.fields(kind):  # unlisted is unset: nil where required
            if field.required:
                fields.setdefault(field.encode_name, None)
        events.append(msgspec.convert(fields, events_type))
    return msgspec.msgpack.encode(batch_type(case["ts"], events, case["rank"]))


@pytest.mark.parametrize("case", CASES, ids=ids(CASES))
def test_the_engine_structs_here_give_the_vectors_bytes(case: dict[str, Any]) -> None:
    assert engine_payload(case).hex() == case["payload_hex"]


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_live_engine_stream_is_read_whole_by_the_subscriber_and_listen(
    engine: str,
) -> None:
    """The engine's batches on a plain pyzmq PUB socket, in its framing; a tskv subscriber and
    `tskv listen --json` each get every batch, every event and every field."""
    cases = [case for case in CASES if case["engine"] == engine]
    sock = zmq.Context.instance().socket(zmq.XPUB)  # a PUB that shows us who subscribed
    sock.setsockopt(zmq.XPUB_VERBOSE, 1)
    sock.bind(LOOPBACK)
    endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    pub = TrioSocket(sock)
    listened = io.StringIO()
    try:
        with trio.fail_after(20):
            async with tskv.open_subscriber(endpoint) as sub, trio.open_nursery() as nursery:
                nursery.start_soon(
                    tskv_listen, endpoint, listened, len(cases), name="tskv listen --json"
                )
                for _ in range(2):  # the subscriber's and listen's subscriptions
                    await pub.receive()
                for seq, case in enumerate(cases):
                    await pub.send(live_message(b"", seq, engine_payload(case)))
                got = [await anext_batch(sub) for _ in cases]
        assert got == [(seq, expected_batch(case)) for seq, case in enumerate(cases)]
        assert sub.statistics().undecodable == 0 and sub.statistics().lost == 0
        unknown = [e for case in cases for e in case["events"] if e.get("unknown_event")]
        assert sub.statistics().unknown_events == len(unknown)
        lines = [json.loads(line) for line in listened.getvalue().splitlines()]
        assert [line["events"] for line in lines] == [case["events"] for case in cases]
    finally:
        pub.close()


async def tskv_listen(endpoint: str, out: io.StringIO, count: int) -> None:
    from tskv._cli.listen import listen

    await listen(endpoint, None, "", None, True, out, count)


async def anext_batch(sub: tskv.Subscriber) -> tuple[int, KVEventBatch]:
    return await sub.__anext__()


async def test_an_unknown_event_type_is_counted_each_time_and_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    [case] = [case for case in CASES if case["engine"] == "vllm-later"]
    sock = zmq.Context.instance().socket(zmq.XPUB)
    sock.bind(LOOPBACK)
    pub = TrioSocket(sock)
    try:
        with caplog.at_level(logging.WARNING, logger="tskv"), trio.fail_after(10):
            async with tskv.open_subscriber(sock.getsockopt_string(zmq.LAST_ENDPOINT)) as sub:
                await pub.receive()
                for seq in range(3):
                    await pub.send(live_message(b"", seq, engine_payload(case)))
                batches = [await anext_batch(sub) for _ in range(3)]
                assert sub.statistics().unknown_events == 3
    finally:
        pub.close()
    assert all(isinstance(batch.events[1], UnknownEvent) for _, batch in batches)
    named = [r.getMessage() for r in caplog.records if "'BlockTouched'" in r.getMessage()]
    assert len(named) == 1 and "tskv.UnknownEvent" in named[0]
