"""vLLM 0.33's stream read whole: hybrid KV cache groups, skipped blocks, lookahead hashing,
ownership, sessions, offload tiers.

vLLM 0.33's event Structs are declared here from the field list its wheel declares
(`vllm/distributed/kv_events.py`: the batch array-like with the rank omitted when unset, the
events maps tagged "type" with defaults omitted, block hashes ints or bytes), checked first
against `shared/vectors/vllm033_wire.json`'s bytes, then published on real sockets and read with
`open_subscriber`, `tskv listen --json` and `open_watcher`.
"""

from __future__ import annotations

import io
import json
from typing import Any

import msgspec
import pytest
import trio
import zmq

import tskv
from tests.conftest import load_vectors
from tests.zmq_helpers import LOOPBACK
from tskv import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from tskv._cli.listen import batch_json
from tskv.core.codec import available_codecs
from tskv.core.frames import live_message
from tskv.shells._trio_zmq import TrioSocket

CASES = load_vectors("vllm033_wire.json")
CODECS = available_codecs()
Hash = int | bytes  # vLLM's ExternalBlockHash


def struct(name: str, fields: list[Any], **options: Any) -> type[msgspec.Struct]:
    return msgspec.defstruct(name, fields, omit_defaults=True, gc=False, **options)


STORED = struct(
    "BlockStored",
    [
        ("block_hashes", list[Hash]),
        ("parent_block_hash", Hash | None),
        ("token_ids", list[int]),
        ("block_size", int),
        ("lora_id", int | None),
        ("medium", str | None),
        ("lora_name", str | None),
        ("extra_keys", list[tuple[Any, ...] | None] | None, None),
        ("group_idx", int | None, None),
        ("kv_cache_spec_kind", str | None, None),
        ("kv_cache_spec_sliding_window", int | None, None),
        ("locality", str | None, None),
        ("ownership", str | None, None),
        ("session_id", str | None, None),
        ("lookahead_token_ids", list[list[int]] | None, None),
    ],
    tag=True,
)
REMOVED = struct(
    "BlockRemoved",
    [
        ("block_hashes", list[Hash]),
        ("medium", str | None),
        ("group_idx", int | None, None),
        ("locality", str | None, None),
        ("ownership", str | None, None),
    ],
    tag=True,
)
CLEARED = struct("AllBlocksCleared", [], tag=True)
BATCH = struct(
    "EventBatch",
    [("ts", float), ("events", list[Any]), ("data_parallel_rank", int | None, None)],
    array_like=True,
)


def listed_hashes(listed: dict[str, Any], name: str) -> Any:
    value = listed.get(name)
    if not listed.get("hashes_are_bytes_hex") or value is None:
        return value
    return [bytes.fromhex(h) for h in value] if isinstance(value, list) else bytes.fromhex(value)


def vllm_payload(case: dict[str, Any]) -> bytes:
    """The case's batch built from vLLM 0.33's Structs, encoded as its publisher does."""
    events = []
    for listed in case["events"]:
        fields = {k: v for k, v in listed.items() if k not in ("type", "hashes_are_bytes_hex")}
        for name in ("block_hashes", "parent_block_hash"):
            if name in fields:
                fields[name] = listed_hashes(listed, name)
        kind = {"BlockStored": STORED, "BlockRemoved": REMOVED}.get(listed["type"], CLEARED)
        for field in msgspec.structs.fields(kind):  # unlisted is unset: nil where required
            if field.required:
                fields.setdefault(field.name, None)
        if "extra_keys" in fields:
            fields["extra_keys"] = [None if k is None else tuple(k) for k in fields["extra_keys"]]
        events.append(kind(**fields))
    return msgspec.msgpack.encode(BATCH(case["ts"], events, case["rank"]))


def consumer_hash(value: Any) -> Any:
    """A hash as a consumer reads it: a bytes hash by its last 8 bytes, big-endian (wire.md)."""
    return int.from_bytes(value[-8:], "big") if isinstance(value, bytes) else value


def expected_batch(case: dict[str, Any]) -> KVEventBatch:
    events: list[tskv.KVEvent] = []
    for listed in case["events"]:
        fields = {k: v for k, v in listed.items() if k not in ("type", "hashes_are_bytes_hex")}
        if "block_hashes" in fields:
            raw = listed_hashes(listed, "block_hashes")
            fields["block_hashes"] = [consumer_hash(h) for h in raw]
        if fields.get("parent_block_hash") is not None:
            fields["parent_block_hash"] = consumer_hash(listed_hashes(listed, "parent_block_hash"))
        kind = {"BlockStored": BlockStored, "BlockRemoved": BlockRemoved}.get(listed["type"])
        events.append(AllBlocksCleared() if kind is None else kind(**fields))
    return KVEventBatch(case["ts"], events, case["rank"])


def ids(cases: list[dict[str, Any]]) -> list[str]:
    return [case["name"] for case in cases]


@pytest.mark.parametrize("case", CASES, ids=ids(CASES))
def test_vllm_033s_structs_here_give_the_vectors_bytes(case: dict[str, Any]) -> None:
    assert vllm_payload(case).hex() == case["payload_hex"]


@pytest.mark.parametrize("codec", sorted(CODECS))
@pytest.mark.parametrize("case", CASES, ids=ids(CASES))
def test_every_case_decodes_to_exactly_what_a_consumer_must_get(
    codec: str, case: dict[str, Any]
) -> None:
    decoded = CODECS[codec].decode_batch(bytes.fromhex(case["payload_hex"]))
    assert decoded == expected_batch(case)


SENT_ON = [
    case
    for case in CASES
    if case["rank"] is not None and not any(e.get("hashes_are_bytes_hex") for e in case["events"])
]


@pytest.mark.parametrize("case", SENT_ON, ids=ids(SENT_ON))
def test_tskvs_vllm_wire_sends_each_case_on_with_every_value(case: dict[str, Any]) -> None:
    """tskv's vLLM wire sends what vLLM 0.33 sends, value for value; byte for byte too but
    for one header: msgspec gives a Struct of 16 or more fields (0.33's BlockStored) a map16
    header however few are set, where tskv writes the smallest (every decoder reads both)."""
    payload = bytes.fromhex(case["payload_hex"])
    for codec in CODECS.values():
        sent = codec.encode_batch(codec.decode_batch(payload), "vllm")
        assert codec.decode_batch(sent) == codec.decode_batch(payload)
        if not any(event["type"] == "BlockStored" for event in case["events"]):
            assert sent == payload


async def test_a_live_vllm_033_stream_is_read_whole_by_the_subscriber_and_listen() -> None:
    """Every case's batch on a plain pyzmq PUB in vLLM's framing: a subscriber and `tskv
    listen --json` each get every event and every field."""
    sock, pub = vllm_publisher()
    listened = io.StringIO()
    endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    try:
        with trio.fail_after(20):
            async with tskv.open_subscriber(endpoint) as sub, trio.open_nursery() as nursery:
                nursery.start_soon(tskv_listen, endpoint, listened, len(CASES))
                for _ in range(2):  # the subscriber's and listen's subscriptions
                    await pub.receive()
                for seq, case in enumerate(CASES):
                    await pub.send(live_message(b"", seq, vllm_payload(case)))
                got = [await sub.__anext__() for _ in CASES]
        assert got == [(seq, expected_batch(case)) for seq, case in enumerate(CASES)]
        assert sub.statistics().undecodable == 0 and sub.statistics().lost == 0
        lines = [json.loads(line) for line in listened.getvalue().splitlines()]
        assert [json.loads(batch_json(seq, batch)) for seq, batch in got] == lines
    finally:
        pub.close()


def vllm_publisher() -> tuple[zmq.Socket[bytes], TrioSocket]:
    sock = zmq.Context.instance().socket(zmq.XPUB)  # a PUB that shows us who subscribed
    sock.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscriber's, the same topic or not
    sock.bind(LOOPBACK)
    return sock, TrioSocket(sock)


MODELS = {  # each model's cases, in the order its engine sent them
    "sliding-window": CASES[:2],
    "mamba": CASES[2:3],
    "offloading": CASES[4:5],
}


@pytest.mark.parametrize("processes", [0, 1], ids=["here", "in-a-reader"])
async def test_a_watchers_index_answers_as_each_vllm_033_engine_would_reuse(
    processes: int,
) -> None:
    """Each model's stream, from its own publisher, followed by one watcher (in its process,
    or through a reader process): the window group's skipped blocks are filed under the full
    group's keys and one copy let go by group; the Mamba case's chain hangs from a parent this
    consumer never saw (it joined mid-stream), so its blocks are orphans and its state
    unplaced, counted; a block held only in storage is a lower tier's."""
    index = tskv.PrefixIndex(16)
    publishers = {model: vllm_publisher() for model in MODELS}
    try:
        with trio.fail_after(30):
            async with tskv.open_watcher(index, processes=processes) as watcher:
                for model, (sock, pub) in publishers.items():
                    watcher.add(model, sock.getsockopt_string(zmq.LAST_ENDPOINT))
                    await pub.receive()
                for model, (_, pub) in publishers.items():
                    for seq, case in enumerate(MODELS[model]):
                        await pub.send(live_message(b"", seq, vllm_payload(case)))
                    await watcher.wait_for_seq(model, len(MODELS[model]) - 1)
                window_hashes = await watcher.engine_hashes("sliding-window")
        assert window_hashes == {101, 102, 103, 104}
        assert index.groups("sliding-window")[1] == tskv.CacheGroup("sliding_window", 16, 64)
        assert index.groups("mamba")[1] == tskv.CacheGroup("mamba", 16)
        first = list(range(1000, 1064))
        # a window of 64 tokens needs 4 blocks before a hit: group 1 kept 2 and let go of one
        assert index.match([*first, 0]) == {}
        stored = index.match([*range(4000, 4016), 0])
        assert stored == {"offloading": 1} and stored.on_device("offloading") == 0
        assert stored.lower == {"offloading": 1}  # in STORAGE only: loaded before reuse
        if not processes:  # the counts live in the index that filed the events
            statistics = index.statistics()
            assert (statistics.orphans, statistics.unplaced) == (3, 1)
    finally:
        for _, pub in publishers.values():
            pub.close()


async def tskv_listen(endpoint: str, out: io.StringIO, count: int) -> None:
    from tskv._cli.listen import listen

    await listen(endpoint, None, "", None, True, out, count)
