"""Leaving `open_publisher` is bounded in every case: measured, with generous bounds."""

from __future__ import annotations

import logging
import time

import pytest
import trio
import trio.testing
import zmq

import tskv
from tests.zmq_helpers import LOOPBACK, inproc_name, raw_socket, receive_batch
from tskv import BlockRemoved, KVEventsConfig

BOUND = 3.0  # the drain deadline is 1 s; the slack is for a loaded CI machine, not the code


def config(**changes: object) -> KVEventsConfig:
    values: dict[str, object] = {"endpoint": LOOPBACK, "replay_endpoint": LOOPBACK}
    values.update(changes)
    return KVEventsConfig(**values)  # type: ignore[arg-type]


def fill(publisher: tskv.Publisher) -> int:
    """Queue batches without a checkpoint until the channel is full."""
    queued = 0
    try:
        while True:
            publisher.publish_nowait([BlockRemoved([queued])])
            queued += 1
    except trio.WouldBlock:
        return queued


async def test_nothing_queued_returns_at_once() -> None:
    async with tskv.open_publisher(config()) as publisher:
        await trio.testing.wait_all_tasks_blocked()
        started = time.monotonic()
    assert time.monotonic() - started < 0.5
    assert publisher.statistics().unsent_at_shutdown == 0


async def test_full_queue_and_no_subscriber_drains_within_the_bound() -> None:
    async with tskv.open_publisher(config(max_queue_size=20_000)) as publisher:
        queued = fill(publisher)
        started = time.monotonic()
    elapsed = time.monotonic() - started
    stats = publisher.statistics()
    assert queued >= 20_000
    assert elapsed < BOUND
    assert stats.published + stats.unsent_at_shutdown == queued  # every batch accounted for


async def test_a_drain_past_its_deadline_is_reported_not_hidden(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.ERROR, logger="tskv"):
        async with tskv.open_publisher(
            config(max_queue_size=5000, shutdown_timeout=0.0)
        ) as publisher:
            queued = fill(publisher)
    stats = publisher.statistics()
    assert stats.unsent_at_shutdown > 0
    assert stats.published + stats.unsent_at_shutdown == queued == stats.accepted
    assert f"closed with {stats.unsent_at_shutdown} accepted batches unsent" in caplog.text


async def test_queued_batches_are_delivered_on_a_normal_exit() -> None:
    endpoint = inproc_name("drain")
    # The SUB outlives the publisher: it connects first (inproc allows that) and reads after.
    async with raw_socket(zmq.SUB, endpoint) as sub:
        sub.sock.setsockopt(zmq.SUBSCRIBE, b"")
        async with tskv.open_publisher(KVEventsConfig(endpoint=endpoint, max_queue_size=500)) as p:
            with trio.fail_after(10):
                await p.wait_for_subscriber()
            queued = fill(p)
        seqs = [(await receive_batch(sub))[1] for _ in range(queued)]
    assert seqs == list(range(queued))
    assert p.statistics().published == queued


async def test_body_raising_still_drains_and_the_error_comes_out_unwrapped() -> None:
    started = 0.0
    with pytest.raises(KeyError, match="boom"):
        async with tskv.open_publisher(config(max_queue_size=20_000)) as publisher:
            fill(publisher)
            started = time.monotonic()
            raise KeyError("boom")
    assert time.monotonic() - started < BOUND
    assert publisher.statistics().queued == 0


async def test_cancelled_surrounding_scope_still_gets_the_bounded_drain() -> None:
    with trio.CancelScope() as scope:
        async with tskv.open_publisher(config(max_queue_size=20_000)) as publisher:
            queued = fill(publisher)
            started = time.monotonic()
            scope.cancel()
            await trio.sleep_forever()
    assert scope.cancelled_caught
    assert time.monotonic() - started < BOUND
    stats = publisher.statistics()
    assert stats.published + stats.unsent_at_shutdown == queued
    assert stats.published > 0  # the drain ran although the caller was cancelled


async def test_shutdown_during_a_replay_in_progress() -> None:
    cfg = config(hwm=5, buffer_steps=5000)
    async with tskv.open_publisher(cfg) as publisher:
        for n in range(5000):
            await publisher.publish([BlockRemoved([n])])
        assert publisher.replay_endpoint is not None
        dealer_cm = raw_socket(zmq.DEALER, publisher.replay_endpoint)
        dealer = await dealer_cm.__aenter__()
        dealer.sock.setsockopt(zmq.RCVHWM, 5)
        await dealer.send([b"", (0).to_bytes(8, "big")])
        await dealer.receive()  # the replay has begun and the client is not reading on
        started = time.monotonic()
    assert time.monotonic() - started < BOUND
    assert publisher.statistics().replay.completed == 0
    await dealer_cm.__aexit__(None, None, None)


def test_shutdown_timeout_must_be_sane() -> None:
    with pytest.raises(ValueError, match="shutdown_timeout = -1"):
        config(shutdown_timeout=-1)
