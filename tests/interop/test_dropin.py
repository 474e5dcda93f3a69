"""tskv's ZmqEventPublisher drops in for TokenSpeed's, point by point: the same threaded script
runs against TokenSpeed's own publisher module and against tskv's, with TokenSpeed's own event
objects, and each behaviour is checked on both.

TokenSpeed's module is loaded from its PyPI wheel (`tokenspeed==0.1.1`,
`tokenspeed/runtime/pd/kv_events.py`: it imports only msgspec, pyzmq and pydantic), which
`nox -s tests` downloads without its dependencies and names in TSKV_TOKENSPEED_WHEEL. The
wheel's one file is executed as a module of its own; nothing of it is kept in this repository.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
import time
import zipfile
from typing import Any

import pytest
import trio
import zmq

import tskv
from tests.tokenspeed import LOADED, MODULE_IN_WHEEL
from tests.zmq_helpers import free_loopback_port
from tskv.core.frames import parse_replay_reply, replay_request

pytestmark = pytest.mark.skipif(isinstance(LOADED, str), reason=str(LOADED))
TS: Any = LOADED
IMPLEMENTATIONS = ["tokenspeed", "tskv"]


def module(name: str) -> Any:
    return TS if name == "tokenspeed" else tskv


def tokenspeed_batches() -> list[Any]:
    """A round's batches as a TokenSpeed scheduler builds them: its own Structs, no rank, and
    an empty round among them."""
    batches = []
    for n in range(20):
        events = [TS.BlockStored([n + 100], n + 99 if n else None, [1000 + n] * 4, 4)]
        if n % 5 == 4:
            events.append(TS.BlockRemoved([n + 98]))
        batches.append(TS.KVEventBatch(ts=1_700_000_000.0 + n, events=events if n != 7 else []))
    return batches


def replayed(endpoint: str) -> list[tuple[int, bytes]]:
    """Everything the replay endpoint holds, from seq 0."""
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    try:
        dealer.connect(endpoint)
        dealer.send_multipart(replay_request(0))
        got = []
        while True:
            assert dealer.poll(10_000), "the replay endpoint did not answer"
            reply = parse_replay_reply(dealer.recv_multipart())
            if reply.is_end:  # type: ignore[union-attr]
                return got
            got.append((reply.seq, reply.payload))  # type: ignore[union-attr]
    finally:
        dealer.close(linger=0)


def run_script(name: str) -> tuple[list[tuple[int, bytes]], list[Any]]:
    """The script: build the publisher as TokenSpeed's docs do, publish TokenSpeed's batches,
    read back what replay holds, shut down."""
    replay = f"tcp://127.0.0.1:{free_loopback_port()}"
    # TokenSpeed's rule connects this PUB (an explicit host): to nothing, as replay is read here
    live = f"tcp://127.0.0.1:{free_loopback_port()}"
    publisher = module(name).ZmqEventPublisher(
        attn_dp_rank=2, endpoint=live, replay_endpoint=replay
    )
    batches = tokenspeed_batches()
    for batch in batches:
        publisher.publish(batch)
    replay = tskv.offset_endpoint_port(replay, 2)  # each rank on its own port: base + rank
    assert replay is not None
    try:
        # Both send from a thread of their own, and TokenSpeed's says nothing of its progress:
        # ask replay until everything is in it, polling with a deadline.
        deadline = time.monotonic() + 30
        while len(held := replayed(replay)) < len(batches) and time.monotonic() < deadline:
            time.sleep(0.01)
        return held, batches
    finally:
        publisher.shutdown()


def test_the_same_script_gives_the_same_stream_byte_for_byte() -> None:
    """TokenSpeed's event objects are taken as they are, the empty round is sent with a seq
    of its own, and the rank is filled in, on the caller's batch objects too."""
    ours, our_batches = run_script("tskv")
    theirs, their_batches = run_script("tokenspeed")
    assert [seq for seq, _ in theirs] == list(range(20))
    assert ours == theirs
    assert [b.attn_dp_rank for b in our_batches] == [b.attn_dp_rank for b in their_batches]
    assert {b.attn_dp_rank for b in our_batches} == {2}
    assert tskv.decode_batch(ours[7][1]).events == []  # the empty round, as TokenSpeed sends it


SCRIPT = """
import select, sys
{load}
publisher = ZmqEventPublisher(0, endpoint={endpoint!r})
warmup = 0
while not select.select([sys.stdin], [], [], 0.01)[0]:  # until the test says it receives
    publisher.publish(KVEventBatch(ts=0.0, events=[BlockRemoved([warmup])]))
    warmup += 1
for n in range(2000):
    publisher.publish(KVEventBatch(ts=1.0, events=[BlockStored([n], None, [n, n], 2)]))
# returns without shutdown(): the queued batches must still go out
"""


@pytest.mark.parametrize("name", IMPLEMENTATIONS)
def test_a_script_that_returns_without_shutdown_delivers_everything(name: str) -> None:
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    if name == "tokenspeed":
        load = textwrap.dedent(f"""
            import importlib.util, zipfile
            spec = importlib.util.spec_from_loader("tokenspeed_kv_events", loader=None)
            ts = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = ts
            exec(zipfile.ZipFile({os.environ["TSKV_TOKENSPEED_WHEEL"]!r}).read(
                {MODULE_IN_WHEEL!r}), ts.__dict__)
            ZmqEventPublisher, KVEventBatch = ts.ZmqEventPublisher, ts.KVEventBatch
            BlockStored, BlockRemoved = ts.BlockStored, ts.BlockRemoved
        """)
    else:
        load = "from tskv import ZmqEventPublisher, KVEventBatch, BlockStored, BlockRemoved"
    script = SCRIPT.format(load=load, endpoint=f"tcp://127.0.0.1:{port}")
    process = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert sub.poll(20_000), "the script's publisher never reached the subscriber"
        assert process.stdin is not None
        process.stdin.write("go\n")
        process.stdin.flush()
        stored = 0
        while sub.poll(10_000):
            payload = sub.recv_multipart()[2]
            stored += isinstance(tskv.decode_batch(payload).events[0], tskv.BlockStored)
            if stored == 2000:
                break
        assert process.wait(30) == 0, process.stderr.read() if process.stderr else ""
        assert stored == 2000
    finally:
        process.kill()
        sub.close(linger=0)


@pytest.mark.parametrize("name", IMPLEMENTATIONS)
def test_publish_after_shutdown_raises_a_runtime_error(name: str) -> None:
    publisher = module(name).ZmqEventPublisher(0, endpoint="tcp://127.0.0.1:*")
    publisher.shutdown()
    with pytest.raises(RuntimeError):
        publisher.publish(TS.KVEventBatch(ts=1.0, events=[]))


@pytest.mark.parametrize("name", IMPLEMENTATIONS)
@pytest.mark.parametrize("config", ["", None, '{"enable_kv_cache_events": false}'])
def test_no_config_or_events_off_makes_a_null_publisher(name: str, config: str | None) -> None:
    made = module(name).EventPublisherFactory.create(config, 0)
    assert type(made).__name__ == "NullEventPublisher"
    assert isinstance(made, module(name).EventPublisher)
    made.publish(TS.KVEventBatch(ts=1.0, events=[]))
    made.shutdown()


@pytest.mark.parametrize("name", IMPLEMENTATIONS)
def test_a_socket_that_cannot_bind_is_a_zmq_error(name: str) -> None:
    taken = zmq.Context.instance().socket(zmq.PUB)
    try:
        port = taken.bind_to_random_port("tcp://127.0.0.1")
        with pytest.raises(zmq.ZMQError):
            module(name).ZmqEventPublisher(
                0, endpoint="tcp://127.0.0.1:*", replay_endpoint=f"tcp://127.0.0.1:{port}"
            )
    finally:
        taken.close(linger=0)


def test_tokenspeeds_names_are_all_there_and_mean_the_same() -> None:
    ours, theirs = tskv.ZmqEventPublisher, TS.ZmqEventPublisher
    assert ours.SHUTDOWN_TIMEOUT == theirs.SHUTDOWN_TIMEOUT
    assert ours.END_SEQ == theirs.END_SEQ
    for endpoint, rank in [("tcp://*:5557", 0), ("tcp://*:5557", 3), ("inproc://kv", 2)]:
        assert ours.offset_endpoint_port(endpoint, rank) == theirs.offset_endpoint_port(
            endpoint, rank
        )
    assert issubclass(ours, tskv.EventPublisher) and issubclass(
        tskv.NullEventPublisher, tskv.EventPublisher
    )
    text = '{"enable_kv_cache_events": true, "endpoint": "tcp://*:6000", "topic": "kv"}'
    mine, yours = tskv.KVEventsConfig.from_cli(text), TS.KVEventsConfig.from_cli(text)
    assert (mine.endpoint, mine.topic, mine.enable_kv_cache_events) == (
        yours.endpoint,
        yours.topic,
        yours.enable_kv_cache_events,
    )
    for factory in (tskv.EventPublisherFactory, TS.EventPublisherFactory):
        with pytest.raises(KeyError):
            factory.register_publisher("zmq", tskv.NullEventPublisher)


def test_every_public_name_of_tokenspeeds_module_is_in_tskv() -> None:
    """The names TokenSpeed's module defines (not those it imports), walked in its wheel's
    file, each found in tskv; and what its event loop imports from it."""
    defined = [
        name
        for name, value in vars(TS).items()
        if not name.startswith("_") and getattr(value, "__module__", None) == TS.__name__
    ]
    assert {"EventBatch", "KVCacheEvent", "scheduler_kv_events_to_wire_events"} <= set(defined)
    assert [name for name in defined if not hasattr(tskv, name)] == []
    wheel = zipfile.ZipFile(os.environ["TSKV_TOKENSPEED_WHEEL"])
    loop = ast.parse(wheel.read("tokenspeed/runtime/engine/event_loop.py"))
    imported = [
        alias.name
        for node in ast.walk(loop)
        if isinstance(node, ast.ImportFrom) and node.module == "tokenspeed.runtime.pd.kv_events"
        for alias in node.names
    ]
    assert "scheduler_kv_events_to_wire_events" in imported
    assert [name for name in imported if not hasattr(tskv, name)] == []


def test_the_names_added_for_the_drop_in_mean_what_tokenspeeds_do() -> None:
    class Native:  # what TokenSpeed's C++ scheduler binding hands over
        def __init__(self, kind: str, **fields: Any) -> None:
            self.kind = kind
            self.__dict__.update(fields)

    drained = [
        Native(
            "BlockStored",
            block_hashes=[1, 2],
            parent_block_hash=None,
            token_ids=[5] * 8,
            block_size=4,
        ),
        Native("BlockRemoved", block_hashes=[1]),
    ]
    ours = tskv.scheduler_kv_events_to_wire_events(drained)
    theirs = TS.scheduler_kv_events_to_wire_events(drained)
    batch = tskv.encode_batch(tskv.EventBatch(ts=1.0, events=ours, attn_dp_rank=0))
    assert batch == TS.msgspec.msgpack.encode(
        TS.KVEventBatch(ts=1.0, events=theirs, attn_dp_rank=0)
    )
    assert all(isinstance(event, tskv.KVCacheEvent) for event in ours)
    assert all(isinstance(event, TS.KVCacheEvent) for event in theirs)
    assert not isinstance(object(), tskv.KVCacheEvent)
    assert isinstance(tskv.KVEventBatch(1.0, []), tskv.EventBatch)
    with pytest.raises(TypeError):
        TS.scheduler_kv_events_to_wire_events([Native("Other")])
    with pytest.raises(TypeError):
        tskv.scheduler_kv_events_to_wire_events([Native("Other")])


def test_a_registered_publisher_is_built_by_name() -> None:
    built: list[dict[str, Any]] = []

    class Recording(tskv.EventPublisher):
        def __init__(self, attn_dp_rank: int = 0, **options: Any) -> None:
            super().__init__(attn_dp_rank)
            built.append(options)

        def publish(self, events: Any) -> None:
            pass

        def shutdown(self) -> None:
            pass

    tskv.EventPublisherFactory.register_publisher("recording-dropin-test", Recording)
    config = '{"enable_kv_cache_events": true, "publisher": "recording-dropin-test", "hwm": 7}'
    made = tskv.EventPublisherFactory.create(config, 3)
    assert isinstance(made, Recording) and made.attn_dp_rank == 3 and built[0]["hwm"] == 7


async def test_tokenspeeds_publisher_answers_a_describe_request_with_the_end_alone() -> None:
    """It reads the request as a replay past its newest seq: tskv's clients learn it says
    nothing of itself, and follow it as before."""
    replay = f"tcp://127.0.0.1:{free_loopback_port()}"
    publisher = TS.ZmqEventPublisher(
        attn_dp_rank=0, endpoint=f"tcp://127.0.0.1:{free_loopback_port()}", replay_endpoint=replay
    )
    try:
        publisher.publish(tokenspeed_batches()[0])
        with trio.fail_after(10):
            assert await tskv.describe_publisher(replay) is None
    finally:
        await trio.to_thread.run_sync(publisher.shutdown)
