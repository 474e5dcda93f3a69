"""A reader process's outbox: when its frames go, with a real live pump over real sockets
(inproc PAIRs) and Trio's clock standing still unless the test moves it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing
import zmq

from tests.zmq_helpers import pairs
from tskv.core.journal_index import JournalIndex
from tskv.core.losses import Loss, LossReason
from tskv.core.prefix_index import PrefixIndex
from tskv.core.reader_messages import FrameReader, News, Report, news
from tskv.core.worker_view import WorkerFigures
from tskv.shells._inbox import Inbound
from tskv.shells._live_pump import PUMP_AVAILABLE, Clock, LivePump
from tskv.shells._reader_child import (
    FRAME_DELAY,
    FRAME_PASSES,
    FRAME_QUIET,
    MERGED_BATCHES,
    READER_GATHER,
    Outbox,
)

pytestmark = pytest.mark.skipif(not PUMP_AVAILABLE, reason="the pump needs select.epoll")


class Sent:
    """The frames the outbox wrote, read as the index's process reads them."""

    def __init__(self, stream: trio.testing.MemorySendStream) -> None:
        self._stream = stream
        self._reader = FrameReader()
        self.frames: list[News] = []

    def take(self) -> list[News]:
        """The frames written since last asked."""
        try:
            data = self._stream.get_data_nowait()
        except trio.WouldBlock:  # nothing written
            return []
        new = news(self._reader.feed(data))
        self.frames.extend(new)
        return new


@asynccontextmanager
async def reader_side() -> AsyncIterator[tuple[zmq.Socket[bytes], Outbox, Sent]]:
    """A reader's pump over one PAIR whose messages are delivered inline, each noted in the
    outbox as a batch of worker 0 (its figures counting them), as a reader's watcher does:
    (the sending end, the outbox, what it sent)."""
    pump = LivePump(READER_GATHER)
    outbox = Outbox(JournalIndex(16), pump)
    stream = trio.testing.MemorySendStream()
    async with pairs(1) as sockets, trio.open_nursery() as nursery:
        ((sending, receiving),) = sockets
        feed = pump.add(receiving, trio.open_memory_channel[Inbound](8), Clock())

        delivered = 0

        def deliver(messages: list[list[bytes]]) -> bool:
            nonlocal delivered
            for _ in messages:
                delivered += 1
                outbox.noted(0, WorkerFigures(batches=delivered), batch=True)
            return True

        feed.inline = deliver
        nursery.start_soon(feed.receive)  # its subscriber waits: the pump delivers inline
        nursery.start_soon(pump.run)
        nursery.start_soon(outbox.send_all, stream)
        await trio.testing.wait_all_tasks_blocked()
        yield sending, outbox, Sent(stream)
        nursery.cancel_scope.cancel()


async def test_under_load_frames_go_with_the_pumps_passes_never_on_a_timer(
    mock_clock: trio.testing.MockClock,
) -> None:
    """Under load the outbox sends in the pump's wakeups, every FRAME_PASSES passes, never
    on a timer of its own: a wakeup cost more CPU than filing a batch, and a timer of the
    outbox's woke the reader again between the pump's passes."""
    assert FRAME_PASSES == 2  # what the steps below count on
    async with reader_side() as (sending, outbox, sent):
        sending.send(b"batch")
        await trio.testing.wait_all_tasks_blocked()
        # at once, the clock still: the pump, not gathering, expects no more soon
        assert [len(frame.items) for frame in sent.take()] == [1]
        sending.send(b"batch")  # close after (the clock stands still): gathering begins
        await trio.testing.wait_all_tasks_blocked()
        assert sent.take() == []  # one pass of two
        for _ in range(5):
            sending.send(b"batch")
        outbox.noted(1, WorkerFigures(losses=1))  # news from elsewhere: a loss, say
        await trio.testing.wait_all_tasks_blocked()
        assert sent.take() == []  # no pass yet: the pump gathers
        mock_clock.jump(READER_GATHER)
        await trio.testing.wait_all_tasks_blocked()
        (frame,) = sent.take()  # the second pass: all of it in one frame, a report a worker
        reports = [item for item in frame.items if isinstance(item, Report)]
        assert [(report.slot, report.figures.batches) for report in reports] == [(0, 7), (1, 0)]
        mock_clock.jump(READER_GATHER)
        await trio.testing.wait_all_tasks_blocked()
        assert sent.take() == []  # a pass that found nothing: nothing to send


async def test_news_while_the_pump_is_idle_goes_after_a_quiet_spell(
    mock_clock: trio.testing.MockClock,
) -> None:
    """A snapshot's parts, or losses, with no live stream: gathered on the outbox's own timer,
    so that the index's process wakes once for many."""
    async with reader_side() as (_, outbox, sent):
        for worker in range(3):
            outbox.noted(worker, WorkerFigures(), batch=True)
            await trio.testing.wait_all_tasks_blocked()
        assert sent.take() == []
        mock_clock.jump(FRAME_QUIET)
        await trio.testing.wait_all_tasks_blocked()
        assert sent.take() == []  # news came during that wait: one more
        mock_clock.jump(FRAME_QUIET)
        await trio.testing.wait_all_tasks_blocked()
        assert [len(frame.items) for frame in sent.take()] == [3]


async def test_a_workers_news_since_its_last_report_goes_as_one(
    mock_clock: trio.testing.MockClock,
) -> None:
    """A loss, a failure and the batches after them go in one report, with the latest
    figures; the next report says none of them again; news of a worker with no batch to come
    goes in a report of its own."""
    async with reader_side() as (_, outbox, sent):
        lost = Loss(4, 6, LossReason.NO_REPLAY)
        outbox.noted(3, WorkerFigures(losses=1), loss=lost)
        outbox.noted(3, WorkerFigures(losses=1, failures=1), failure=("refused", 0.5))
        outbox.noted(3, WorkerFigures(batches=1, losses=1, failures=1), batch=True)
        outbox.noted(3, WorkerFigures(batches=2, losses=1, failures=1), batch=True)
        other = Loss(9, None, LossReason.RESTART, new_seq=0)
        outbox.noted(5, WorkerFigures(losses=1), loss=other)
        await trio.testing.wait_all_tasks_blocked()
        mock_clock.jump(FRAME_DELAY)
        await trio.testing.wait_all_tasks_blocked()
        (frame,) = sent.take()
        reports = [item for item in frame.items if isinstance(item, Report)]
        assert [(report.slot, report.figures.batches) for report in reports] == [(3, 2), (5, 0)]
        assert [(report.losses, report.failure) for report in reports] == [
            ([lost], ("refused", 0.5)),
            ([other], None),
        ]
        outbox.noted(3, WorkerFigures(batches=3, losses=1, failures=1), batch=True)
        await trio.testing.wait_all_tasks_blocked()
        mock_clock.jump(FRAME_DELAY)
        await trio.testing.wait_all_tasks_blocked()
        ((report,),) = [frame.items for frame in sent.take()]
        assert isinstance(report, Report)
        assert (report.figures.batches, report.losses, report.failure) == (3, [], None)


async def test_a_report_seals_at_its_batch_limit_and_at_a_snapshots_part(
    mock_clock: trio.testing.MockClock,
) -> None:
    """The index's process applies a report whole between its queries: a worker's report
    carries at most MERGED_BATCHES batches, and a snapshot's part goes as the end of one,
    its holds with it; the holds of all the reports are those the worker took, in order."""
    async with reader_side() as (_, outbox, sent):
        index = PrefixIndex(16)  # the index's process's, mirroring the reports
        journal = outbox._index._holdings  # the reader's index's journal of holds
        worker = journal.blocks_of(7)  # the worker's view, as a reader's record makes it
        for number in range(1, 2 * MERGED_BATCHES + 3):
            journal.hold(worker, [number])  # a hold taken a batch, journalled
            outbox.noted(7, WorkerFigures(batches=number), batch=True)
            outbox.noted(8, WorkerFigures(batches=number), batch=True)
        journal.release(worker, [1, 2])  # a part lets go of two, say
        await outbox.part_noted(7, WorkerFigures(batches=2 * MERGED_BATCHES + 2))
        await trio.testing.wait_all_tasks_blocked()
        mock_clock.jump(FRAME_DELAY)
        await trio.testing.wait_all_tasks_blocked()
        reports = [item for frame in sent.take() for item in frame.items]
        assert all(isinstance(report, Report) for report in reports)
        counted = [(report.slot, report.figures.batches) for report in reports]  # type: ignore[union-attr]
        last = 2 * MERGED_BATCHES + 2
        assert [count for slot, count in counted if slot == 7] == [
            MERGED_BATCHES,
            2 * MERGED_BATCHES,
            last,
        ]
        assert [count for slot, count in counted if slot == 8] == [
            MERGED_BATCHES,
            2 * MERGED_BATCHES,
            last,
        ]
        for report in reports:
            index.apply_changes(report.slot, report.changes)  # type: ignore[union-attr]
        assert len(index) == last - 2  # worker 7 holds 3 to `last`: letting go of them empties it
        index.apply_changes(7, [[], list(range(3, last + 1))])
        assert len(index) == 0
