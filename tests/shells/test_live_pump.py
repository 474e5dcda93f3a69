"""A watcher's live pump: one task reading many real sockets (inproc PAIRs here)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing
import zmq

from tests.zmq_helpers import pairs
from tskv.shells._inbox import Inbound, Live
from tskv.shells._live_pump import GATHER, PUMP_AVAILABLE, Clock, Feed, LivePump
from tskv.shells._trio_zmq import TrioSocket

pytestmark = pytest.mark.skipif(not PUMP_AVAILABLE, reason="the pump needs select.epoll")


async def collect(feed: Feed, count: int, into: list[bytes]) -> None:
    """Take `count` messages from the feed, as its subscriber does."""
    while len(into) < count:
        item = await feed.receive()
        assert isinstance(item, Live)
        into.extend(message[0] for message in item.messages)


@asynccontextmanager
async def one_feed(size: int) -> AsyncIterator[tuple[LivePump, zmq.Socket[bytes], Feed]]:
    """A running pump over one PAIR into an inbox of `size`: (the pump, the sending end, its
    feed)."""
    pump = LivePump()
    async with pairs(1) as sockets, trio.open_nursery() as nursery:
        nursery.start_soon(pump.run)
        ((sending, receiving),) = sockets
        yield pump, sending, pump.add(receiving, trio.open_memory_channel[Inbound](size), Clock())
        nursery.cancel_scope.cancel()


async def test_one_task_moves_every_sockets_messages_in_order_several_a_wakeup() -> None:
    pump = LivePump()
    async with pairs(8) as sockets, trio.open_nursery() as nursery:
        nursery.start_soon(pump.run)
        for sending, _ in sockets[:4]:  # queued before the pump knows the socket
            for index in range(100):
                sending.send(b"%d" % index)
        got: list[list[bytes]] = [[] for _ in sockets]
        async with trio.open_nursery() as consumers:
            for (_, receiving), into in zip(sockets, got, strict=True):
                feed = pump.add(receiving, trio.open_memory_channel[Inbound](4), Clock())
                consumers.start_soon(collect, feed, 300, into)
            for index in range(300):
                for number, (sending, _) in enumerate(sockets):
                    if index >= 100 or number >= 4:
                        sending.send(b"%d" % index)
                if index % 50 == 0:
                    await trio.lowlevel.checkpoint()
        nursery.cancel_scope.cancel()
    assert got == [[b"%d" % index for index in range(300)] for _ in sockets]
    assert pump.messages == 8 * 300
    assert pump.wakeups < pump.messages / 2  # messages waiting together are taken together


async def test_a_full_inbox_holds_its_socket_back_without_spinning_or_losing() -> None:
    async with one_feed(1) as (_, sending, feed):
        got: list[bytes] = []
        for index in range(1_000):
            sending.send(b"%d" % index)
            if index % 100 == 99:
                with trio.fail_after(10):  # a pump that spun on the held socket never blocks
                    await trio.testing.wait_all_tasks_blocked()
                assert feed.held
        with trio.fail_after(10):
            await collect(feed, 1_000, got)
    assert got == [b"%d" % index for index in range(1_000)]


async def test_a_feed_taken_out_is_read_no_more_and_the_others_go_on() -> None:
    pump = LivePump()
    async with pairs(2) as sockets, trio.open_nursery() as nursery:
        nursery.start_soon(pump.run)
        feeds = [
            pump.add(receiving, trio.open_memory_channel[Inbound](4), Clock())
            for _, receiving in sockets
        ]
        feeds[0].close()
        for sending, _ in sockets:
            sending.send(b"after")
        got: list[bytes] = []
        with trio.fail_after(10):
            await collect(feeds[1], 1, got)
            await trio.testing.wait_all_tasks_blocked()
        assert got == [b"after"]
        assert pump.messages == 1  # the pump passed over both, and moved only the one
        assert sockets[0][1].receive_nowait() == [b"after"]  # still on its socket, untaken
        nursery.cancel_scope.cancel()


async def test_a_socket_that_fails_ends_its_own_subscriber_with_the_error() -> None:
    pump = LivePump()
    doomed: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    async with pairs(1) as healthy, trio.open_nursery() as nursery:
        nursery.start_soon(pump.run)
        async with pairs(1, doomed) as failing:
            bad = pump.add(failing[0][1], trio.open_memory_channel[Inbound](4), Clock())
            good = pump.add(healthy[0][1], trio.open_memory_channel[Inbound](4), Clock())
            await trio.testing.wait_all_tasks_blocked()
            terminating = trio.Event()

            async def terminate() -> None:  # blocks until the doomed sockets are closed
                terminating.set()
                await trio.to_thread.run_sync(doomed.term)

            nursery.start_soon(terminate)
            await terminating.wait()
            with trio.fail_after(10), pytest.raises(zmq.ContextTerminated):
                await bad.receive()  # the pump gave it up: its subscriber learns why
            bad.close()
        healthy[0][0].send(b"still")
        got: list[bytes] = []
        with trio.fail_after(10):
            await collect(good, 1, got)
        assert got == [b"still"] and good.failure is None
        nursery.cancel_scope.cancel()


async def test_messages_for_a_waiting_subscriber_are_delivered_by_the_pump_itself() -> None:
    """A watcher's follower parked on an empty inbox would be woken for each batch: the pump
    hands the messages to the feed's `inline` instead. What inline leaves undone wakes the
    subscriber with an empty item; what it declines, and anything for a subscriber that is
    not waiting, goes to the inbox as ever, in order."""
    async with one_feed(4) as (pump, sending, feed):
        taken: list[bytes] = []
        answers: list[bool | None] = [True]  # what inline says next

        def inline(messages: list[list[bytes]]) -> bool | None:
            if answers[0] is not None:
                taken.extend(message[0] for message in messages)
            return answers[0]

        feed.inline = inline
        sending.send(b"queued")  # no one waits on the inbox: it goes there
        await trio.testing.wait_all_tasks_blocked()
        assert not taken
        item = await feed.receive()
        assert isinstance(item, Live) and item.messages == [[b"queued"]]

        async def receive_one(into: list[Inbound]) -> None:
            into.append(await feed.receive())

        for answer, sent, woken in [
            (True, b"inline", []),
            (False, b"left", [Live([])]),
            (None, b"declined", [Live([[b"declined"]])]),
        ]:
            answers[0] = answer
            got: list[Inbound] = []
            async with trio.open_nursery() as waiting:
                waiting.start_soon(receive_one, got)
                await trio.testing.wait_all_tasks_blocked()
                sending.send(sent)
                await trio.testing.wait_all_tasks_blocked()
                if not woken:
                    assert not got  # still waiting: the pump delivered it
                    waiting.cancel_scope.cancel()
            assert got == woken
        assert taken == [b"inline", b"left"]
        assert pump.messages == 4


async def test_a_failure_delivering_inline_ends_that_subscriber_with_it() -> None:
    async with one_feed(4) as (_, sending, feed):

        def inline(messages: list[list[bytes]]) -> bool | None:
            raise RuntimeError("applying failed")

        feed.inline = inline
        sending.send(b"batch")
        with trio.fail_after(10), pytest.raises(RuntimeError, match="applying failed"):
            await feed.receive()  # waiting when it came: the pump's failure is its own
        assert feed.failure is not None


@asynccontextmanager
async def pumping(
    count: int,
) -> AsyncIterator[tuple[LivePump, list[tuple[zmq.Socket[bytes], TrioSocket]]]]:
    """A running pump over `count` PAIRs, each into an inbox of its own, every task blocked."""
    pump = LivePump()
    async with pairs(count) as sockets, trio.open_nursery() as nursery:
        for _, receiving in sockets:
            pump.add(receiving, trio.open_memory_channel[Inbound](64), Clock())
        nursery.start_soon(pump.run)
        await trio.testing.wait_all_tasks_blocked()
        yield pump, sockets
        nursery.cancel_scope.cancel()


async def test_while_messages_keep_coming_a_pass_is_made_every_gather_not_every_message(
    mock_clock: trio.testing.MockClock,
) -> None:
    """Workers publishing one after another woke the pump once a message, at the cost of a
    wakeup each; once messages come less than GATHER apart, the next pass is made GATHER
    later, whatever came meanwhile, and once one finds nothing the pump waits on the sockets
    again. (Trio's clock stands still here unless the test moves it; the sockets are real.)"""
    async with pumping(8) as (pump, sockets):
        for index in range(2):  # close together (the clock stands still): gathering begins
            wakeups = pump.wakeups
            sockets[index][0].send(b"first")
            await trio.testing.wait_all_tasks_blocked()
            assert (pump.messages, pump.wakeups) == (index + 1, wakeups + 1)  # woken by it
        for index in range(40):
            sockets[index % 8][0].send(b"%d" % index)
        await trio.testing.wait_all_tasks_blocked()
        assert pump.messages == 2  # gathering: no pass until GATHER has passed
        mock_clock.jump(GATHER)
        await trio.testing.wait_all_tasks_blocked()
        assert (pump.messages, pump.wakeups) == (42, wakeups + 2)  # all of them in one pass
        mock_clock.jump(GATHER)
        await trio.testing.wait_all_tasks_blocked()
        assert pump.wakeups == wakeups + 3  # a pass that found nothing: back to the sockets
        sockets[5][0].send(b"later")
        await trio.testing.wait_all_tasks_blocked()
        assert (pump.messages, pump.wakeups) == (43, wakeups + 4)  # at once, the clock still


async def test_messages_far_apart_are_each_taken_as_they_come_with_no_pass_after(
    mock_clock: trio.testing.MockClock,
) -> None:
    """A few workers, or one at a modest rate: a pass GATHER after each message would find
    nothing and cost a wakeup more than the message's own."""
    async with pumping(2) as (pump, sockets):
        wakeups = pump.wakeups
        for index in range(20):
            sockets[index % 2][0].send(b"%d" % index)
            await trio.testing.wait_all_tasks_blocked()
            assert pump.messages == index + 1  # taken at once
            mock_clock.jump(10 * GATHER)  # the next comes 20 ms later
            await trio.testing.wait_all_tasks_blocked()
        assert pump.wakeups == wakeups + 20  # one a message, none on the timer
