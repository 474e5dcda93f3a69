"""The drop-in threaded publisher, from plain threads, with a plain blocking pyzmq SUB."""

from __future__ import annotations

import threading
import time

import pytest
import zmq

import tskv
from tskv import (
    BlockRemoved,
    EventPublisherFactory,
    KVEventBatch,
    NullEventPublisher,
    PublisherClosedError,
    ZmqEventPublisher,
)
from tskv.core.frames import parse_live_message

LOOPBACK = "tcp://127.0.0.1:*"


def batch(n: int, rank: int | None = None) -> KVEventBatch:
    return KVEventBatch(float(n), [BlockRemoved([n])], rank)


def blocking_sub(endpoint: str) -> zmq.Socket[bytes]:
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.IPV6, 1)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 10_000)
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(endpoint)
    return sub


def wait_subscribed(publisher: ZmqEventPublisher) -> None:
    deadline = time.monotonic() + 10
    while publisher.statistics().subscriptions < 1:  # this is a sync test: poll the counter
        assert time.monotonic() < deadline, "subscription never arrived"
        time.sleep(0.005)


def test_batches_from_many_threads_all_arrive_in_seq_order() -> None:
    # IPv6 loopback with port 0: rank 3 keeps port 0 and the OS picks one.
    publisher = ZmqEventPublisher(3, endpoint="tcp://[::1]:0", replay_endpoint="tcp://[::1]:0")
    sub = blocking_sub(publisher.endpoint)
    try:
        wait_subscribed(publisher)

        def produce(base: int) -> None:
            for n in range(base, base + 250):
                publisher.publish(batch(n))

        threads = [threading.Thread(target=produce, args=(k * 1000,)) for k in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        received = [parse_live_message(sub.recv_multipart()) for _ in range(1000)]
    finally:
        publisher.shutdown()
        sub.close()
    assert [seq for _, seq, _ in received] == list(range(1000))
    decoded = [tskv.decode_batch(payload) for _, _, payload in received]
    assert sorted(b.events[0].block_hashes[0] for b in decoded) == sorted(
        k * 1000 + n for k in range(4) for n in range(250)
    )
    assert {b.attn_dp_rank for b in decoded} == {3}  # filled in when the batch had none


def test_a_batch_with_its_own_rank_keeps_it() -> None:
    publisher = ZmqEventPublisher(0, endpoint=LOOPBACK)
    sub = blocking_sub(publisher.endpoint)
    try:
        wait_subscribed(publisher)
        publisher.publish(batch(1, rank=5))
        _, _, payload = parse_live_message(sub.recv_multipart())
    finally:
        publisher.shutdown()
        sub.close()
    assert tskv.decode_batch(payload).attn_dp_rank == 5


def test_shutdown_with_a_full_queue_and_no_subscriber_is_bounded_and_joins() -> None:
    publisher = ZmqEventPublisher(0, endpoint=LOOPBACK, max_queue_size=50_000)
    for n in range(50_000):
        publisher.publish(batch(n))
    started = time.monotonic()
    publisher.shutdown()
    elapsed = time.monotonic() - started
    stats = publisher.statistics()
    assert elapsed < 3.0  # the bound is 1 s; the rest is slack for a loaded machine
    assert not any(t.name.startswith("tskv-publisher") for t in threading.enumerate())
    assert stats.published + stats.unsent_at_shutdown + stats.queued == 50_000


def test_publish_waits_for_a_slot_instead_of_raising_queue_full() -> None:
    publisher = ZmqEventPublisher(0, endpoint=LOOPBACK, max_queue_size=2)
    try:
        for n in range(2000):  # far more than the queue holds: each waits for a slot
            publisher.publish(batch(n))
    finally:
        publisher.shutdown()
    assert publisher.statistics().published == 2000


def test_shutdown_is_idempotent_and_publish_after_it_raises() -> None:
    publisher = ZmqEventPublisher(0, endpoint=LOOPBACK)
    publisher.shutdown()
    publisher.shutdown()
    with pytest.raises(PublisherClosedError, match="after shutdown"):
        publisher.publish(batch(1))


def test_a_bad_endpoint_fails_in_the_constructor() -> None:
    with pytest.raises(ValueError, match="cannot offset ipc endpoint"):
        ZmqEventPublisher(1, endpoint="ipc:///tmp/tskv-test")
    first = ZmqEventPublisher(0, endpoint="tcp://[::1]:0")
    try:
        with pytest.raises(OSError, match="cannot bind"):
            ZmqEventPublisher(0, endpoint=first.endpoint)  # the port is taken
    finally:
        first.shutdown()


def test_the_factory_refuses_a_publisher_nobody_registered_naming_those_that_are() -> None:
    config = '{"enable_kv_cache_events": true, "publisher": "kafka"}'
    with pytest.raises(tskv.ConfigError, match=r"publisher = 'kafka': use \"null\" or ") as told:
        EventPublisherFactory.create(config, 0)  # every name registered in this process, sorted
    assert '"zmq"' in str(told.value) and "register_publisher" in str(told.value)
    assert isinstance(  # a name the factory does not know, but events are off: nothing built
        EventPublisherFactory.create(config.replace("true", "false"), 0), NullEventPublisher
    )


def test_factory_follows_the_config() -> None:
    assert isinstance(EventPublisherFactory.create(None, 2), NullEventPublisher)
    assert isinstance(
        EventPublisherFactory.create('{"publisher": "zmq", "enable_kv_cache_events": false}', 1),
        NullEventPublisher,
    )
    assert not EventPublisherFactory.is_enabled(None)
    config = '{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:*", "topic": "kv"}'
    assert EventPublisherFactory.is_enabled(config)
    publisher = EventPublisherFactory.create(config, attn_dp_rank=0)
    try:
        assert isinstance(publisher, ZmqEventPublisher)
        assert publisher.endpoint.startswith("tcp://127.0.0.1:")
    finally:
        publisher.shutdown()
    null = NullEventPublisher(attn_dp_rank=1)
    null.publish(batch(1))
    null.shutdown()
