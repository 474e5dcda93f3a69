"""A watcher's reader process, from its own side: a watcher over some workers, in an index of
its own, whose news goes to the index's process.

It runs a `Watcher` whose record has an `Outbox` as its listener: after each piece of news the
outbox queues the worker's new state, and sends what is queued to the index's process in one
`News` frame (under load a frame carries many batches, and the index's process wakes once for
all). The frame goes as the watcher's live pump ends the pass that brought news (its next
pass, if any, is READER_GATHER away); news from elsewhere (a snapshot's part, a loss) goes at
the end of the next pass while the pump is busy, else once no news has come for FRAME_QUIET
seconds, or FRAME_DELAY after the first. So under load the outbox wakes with the pump, never
on a timer of its own: a wakeup costs more CPU here than filing a batch. Everything the
outbox queues is bounded: a worker's news since its last report (batches, a loss, a silence,
a failure) goes as one report, sealed when it holds MERGED_BATCHES batches or a snapshot's part;
the followers wait while OUTBOX_BATCHES are unsent; and past MAX_LOSSES loss reports or
MAX_LOGS log records it drops the callbacks and lines, counting them in the frame (the index and
the figures keep every loss).

`main()` runs it, given BLOCK_SIZE, SNAPSHOTS_AT_ONCE and LOG_LEVEL as arguments; its stdin and
stdout are the pipe to the index's process (`_reader_process`).
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import time
from collections.abc import Callable

import attrs
import trio

from tskv.core.applied import AppliedFigures
from tskv.core.config import SubscriberConfig
from tskv.core.dynamo_hashes import answer as dynamo_answer
from tskv.core.journal_index import JournalIndex
from tskv.core.losses import Loss
from tskv.core.prefix_index import Worker
from tskv.core.reader_messages import (
    AskHashes,
    Follow,
    FrameReader,
    Hashes,
    LogLine,
    News,
    Report,
    Unfollow,
    commands,
    frame,
)
from tskv.core.worker_view import WorkerFigures
from tskv.shells._background import only
from tskv.shells._live_pump import GATHER, PUMP_AVAILABLE, LivePump
from tskv.shells.watcher import watch

OUTBOX_BATCHES = 1_000  # batches (and snapshot parts) unsent before the followers wait
MAX_LOSSES = 1_000  # loss reports queued, for `on_loss`, before more are dropped (counted)
MAX_LOGS = 1_000  # log records queued before more are dropped (counted)
# A batch waits at most this for its pass and then for its frame: a router's own watcher
# gathers 2 ms (GATHER), and a reader's 10 ms cost it a fifth less CPU in the fleet bench.
READER_GATHER = 0.01
FRAME_PASSES = 2  # under load a frame goes every this many of the pump's passes
FRAME_QUIET = 2 * GATHER  # news from elsewhere while the pump is idle: gathered this long
FRAME_DELAY = 0.02
# A report carries a worker's batches since its last one, at most this many: the index's
# process pays a fixed cost to read, check and file each report beside its holds, and applies
# each whole between its queries, so a few batches share one report and no report is long.
MERGED_BATCHES = 8


@attrs.define
class _Open:
    """A worker's news since its last report: the latest figures, the losses, a failure, and
    how many batches its holds come from."""

    figures: WorkerFigures
    losses: list[Loss] = attrs.Factory(list)
    failure: tuple[str, float] | None = None
    batches: int = 0


@attrs.define
class FrameCounts:
    """What the outbox has queued since its last frame, counted in one object the frame takes
    with it (the dropped counts go in the frame; the next frame starts from a new one)."""

    batches: int = 0  # batch news: `room` waits past OUTBOX_BATCHES
    losses: int = 0  # loss reports queued
    dropped_losses: int = 0  # loss reports past MAX_LOSSES: their callbacks dropped
    dropped_logs: int = 0  # log records past MAX_LOGS


class Outbox:
    """The reader's record's listener (`_index_record.Listener`): each worker's new state,
    bounded, sent to the index's process as it can take it."""

    def __init__(self, index: JournalIndex, pump: LivePump | None = None) -> None:
        self._index = index
        self._pump = pump
        if pump is not None:
            pump.after_pass = self._pass_ended
        self._due = False  # the frame's passes ended, or the outbox filled: send it
        self._passes = 0  # the pump's passes ended with news queued
        self._send_now = trio.lowlevel.ParkingLot()
        self._sealed: list[Report] = []  # reports ahead of their workers' open news, in order
        self._open: dict[int, _Open] = {}  # slot -> what its next report will say
        self._logs: list[LogLine] = []
        self._answers: list[Hashes] = []
        self._counts = FrameCounts()
        self._has_news = trio.lowlevel.ParkingLot()
        self._has_room = trio.lowlevel.ParkingLot()
        # what this process applied so far, sent with each frame: its watcher's, once made
        self.applied: Callable[[], AppliedFigures] = AppliedFigures

    async def room(self) -> None:
        while not self.has_room():
            await self._has_room.park()

    def has_room(self) -> bool:
        return self._counts.batches < OUTBOX_BATCHES

    def noted(
        self,
        worker: Worker,
        figures: WorkerFigures,
        *,
        batch: bool = False,
        loss: Loss | None = None,
        failure: tuple[str, float] | None = None,
    ) -> None:
        assert isinstance(worker, int)  # a reader's watcher names its workers by their slots
        entry = self._open.get(worker)
        if entry is None:
            entry = self._open[worker] = _Open(figures)
        entry.figures = figures
        if loss is not None:
            if self._counts.losses < MAX_LOSSES:
                entry.losses.append(loss)
                self._counts.losses += 1
            else:
                self._counts.dropped_losses += 1
        if failure is not None:
            entry.failure = failure  # failures come a backoff apart: the latest is the news
        if batch:
            entry.batches += 1
            self._counts.batches += 1
            if entry.batches >= MERGED_BATCHES:
                self._seal(worker)
            if self._counts.batches >= OUTBOX_BATCHES:
                self._send_soon()
        if self._has_news:  # most batches find the sender waiting for a pass, not here
            self._has_news.unpark_all()

    def _seal(self, worker: int) -> None:
        """The worker's news so far as one report, ahead of its later news: the index's
        process applies a report whole, between its queries."""
        entry = self._open.pop(worker)
        self._sealed.append(self._report(worker, entry.figures, entry.losses, entry.failure))

    async def part_noted(self, worker: Worker, figures: WorkerFigures) -> None:
        """A snapshot's part goes as its own report, so that the index's process mirrors the
        snapshot in steps between its queries (whole, 50,000 blocks held its loop 25-50 ms)."""
        self.noted(worker, figures, batch=True)
        assert isinstance(worker, int)
        if worker in self._open:  # else sealed as it filled
            self._seal(worker)
        await self.room()

    def _report(
        self,
        slot: int,
        figures: WorkerFigures,
        losses: list[Loss],
        failure: tuple[str, float] | None,
    ) -> Report:
        index = self._index
        runs, ops = index.take_changes(slot)
        strings, lookahead = index.seen_strings, index.lookahead(slot)
        blocks = index.blocks_by_medium(slot) or {}
        return Report(slot, figures, runs, strings, losses, failure, ops, lookahead, blocks)

    def log(self, record: logging.LogRecord) -> None:
        if len(self._logs) < MAX_LOGS:
            self._logs.append(LogLine(record.name, record.levelno, record.getMessage()))
        else:
            self._counts.dropped_logs += 1
        self._has_news.unpark_all()

    def answer(self, question: AskHashes) -> None:
        if question.dynamo:
            said = dynamo_answer(self._index.dynamo, question.slot, question.block_hashes)
        else:
            said = list(self._index.engine_hashes(question.slot))
        self._answers.append(Hashes(question.question, said))
        self._has_news.unpark_all()

    def _pending(self) -> int:
        return len(self._sealed) + len(self._open) + len(self._logs) + len(self._answers)

    def _pass_ended(self) -> None:
        if self._pending():
            self._passes += 1
            assert self._pump is not None
            if self._passes >= FRAME_PASSES or not self._pump.busy:
                self._send_soon()

    def _send_soon(self) -> None:
        self._due = True
        self._send_now.unpark_all()

    async def send_all(self, stream: trio.abc.SendStream) -> None:
        while True:
            if not self._pending():
                await self._has_news.park()
            await self._gathered()
            await stream.send_all(frame(self._news()))
            self._has_room.unpark_all()

    async def _gathered(self) -> None:
        """Wait while more news is on its way, so that it goes in the same frame. What a pass
        brought goes as it ends: the next one, if any, is READER_GATHER away."""
        pump = self._pump
        while not self._due and pump is not None and pump.busy:
            await self._send_now.park()
        if self._due:
            return
        deadline = trio.current_time() + FRAME_DELAY
        waited = -1
        while waited < self._pending() and self._counts.batches < OUTBOX_BATCHES:
            if trio.current_time() >= deadline:
                break
            waited = self._pending()
            await trio.sleep(FRAME_QUIET)

    def _news(self) -> News:
        """Everything queued, as one frame, and the queue emptied."""
        reports = self._sealed + [
            self._report(slot, entry.figures, entry.losses, entry.failure)
            for slot, entry in self._open.items()
        ]
        self._open = {}
        items: list[Report | LogLine | Hashes] = [*reports, *self._logs, *self._answers]
        counts = self._counts
        dropped = counts.dropped_losses, counts.dropped_logs
        made = News(time.process_time(), items, *dropped, self.applied())
        self._sealed, self._logs, self._answers = [], [], []
        self._counts = FrameCounts()
        self._due = False
        self._passes = 0
        return made


class _Forward(logging.Handler):
    """The reader's log records, re-logged by the index's process under the same names."""

    def __init__(self, outbox: Outbox) -> None:
        super().__init__()
        self._outbox = outbox

    def emit(self, record: logging.LogRecord) -> None:
        self._outbox.log(record)


async def _serve(
    block_size: int, at_once: int, level: int, dynamo: bool, stdin: int, stdout: int
) -> None:
    index = JournalIndex(block_size, dynamo_hashes=dynamo)
    pump = LivePump(READER_GATHER) if PUMP_AVAILABLE else None
    outbox = Outbox(index, pump)
    tskv_logger = logging.getLogger("tskv")
    tskv_logger.addHandler(_Forward(outbox))
    tskv_logger.setLevel(level)
    tskv_logger.propagate = False
    async with (
        watch(
            index, SubscriberConfig(), snapshots_at_once=at_once, listener=outbox, pump=pump
        ) as watcher,
        trio.open_nursery() as nursery,
    ):
        outbox.applied = lambda: watcher.applied
        nursery.start_soon(outbox.send_all, trio.lowlevel.FdStream(stdout))
        pipe, reader = trio.lowlevel.FdStream(stdin), FrameReader()
        while chunk := await pipe.receive_some(1 << 20):
            for command in commands(reader.feed(chunk)):
                if isinstance(command, Follow):
                    endpoints = (command.endpoint, command.replay_endpoint)
                    watcher.add(command.slot, *endpoints, **command.settings)
                elif isinstance(command, Unfollow):
                    watcher.remove(command.slot)
                else:
                    outbox.answer(command)
        nursery.cancel_scope.cancel()  # the index's process closed our stdin: it is done


def main() -> None:
    block_size, at_once, level, dynamo = (int(argument) for argument in sys.argv[-4:])
    stdin, stdout = os.dup(0), os.dup(1)
    os.dup2(2, 1)  # a stray print must not corrupt the frames
    sys.stdout = sys.stderr
    # This process is ours: its imports never die, and each batch makes objects by the
    # hundred, so the default collector would scan the same modules again and again.
    gc.freeze()
    gc.set_threshold(10_000, 20, 20)
    try:
        trio.run(_serve, block_size, at_once, level, bool(dynamo), stdin, stdout)
    except BaseException as exc:
        if not only(exc, trio.BrokenResourceError, KeyboardInterrupt):
            raise  # else the index's process is gone
