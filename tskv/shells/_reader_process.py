"""A watcher's reader processes, from the index's side: each one kept running, told which
workers to follow, and heard.

Each reader process (`_reader_child`) follows some of the workers exactly as a watcher does in
one process, in an index of its own, and sends the index's process what the router needs
(`core.reader_messages`). The two talk over the reader's stdin and stdout: a pipe only this
process and its child hold, so nothing else can speak on it. A reader that dies is started
again, and its workers are stale until their snapshots are in again.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from typing import Any, Protocol

import attrs
import trio

import tskv
from tskv.core.applied import AppliedFigures
from tskv.core.backoff import Backoff
from tskv.core.errors import TskvError
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
    frame,
    news,
)
from tskv.shells._background import Pacer, only

logger = logging.getLogger(__name__)

RESTART_BACKOFF = (0.5, 10.0)  # first and longest wait before a reader that ended starts again
# where tskv is imported from here, so the child imports the same one, installed or not
_PACKAGE_HOME = os.path.dirname(os.path.dirname(os.path.abspath(tskv.__file__)))


class Mirror(Protocol):
    """Where a reader's reports go: `_reader_mirror.ReaderMirror`."""

    def report(self, worker: Worker, report: Report) -> None: ...

    def reader_lost(self, workers: list[Worker]) -> None: ...


@attrs.frozen
class ReaderStatus:
    """One reader process, as `Watcher.readers` reports it."""

    pid: int | None  # None while it is being started again
    workers: int
    cpu_seconds: float  # its CPU time (user and system) when it last reported
    restarts: int
    dropped_losses: int = 0  # loss reports it could not queue (their on_loss calls): see the log
    dropped_logs: int = 0  # log records it could not queue


@attrs.define
class ReaderCounts:
    """A reader's running counts, over every process it has started, in the one object they
    change in, which `Reader.status()` freezes with its pid and workers."""

    cpu_seconds: float = 0.0  # the running process's, when it last reported
    restarts: int = 0
    dropped_losses: int = 0
    dropped_logs: int = 0
    applied: AppliedFigures = attrs.Factory(AppliedFigures)  # the running process's, as said
    applied_before: AppliedFigures = attrs.Factory(AppliedFigures)  # the ended ones'

    def frozen(self, pid: int | None, workers: int) -> ReaderStatus:
        return ReaderStatus(
            pid, workers, self.cpu_seconds, self.restarts, self.dropped_losses, self.dropped_logs
        )

    def all_applied(self) -> AppliedFigures:
        """What every process of the reader applied, the running one's as it last said."""
        return self.applied_before.plus(self.applied)

    def ended(self) -> None:
        """The running process ended: what it applied is kept, and the next starts at zero."""
        self.restarts += 1
        self.applied_before = self.all_applied()
        self.applied = AppliedFigures()


class Reader:
    """One reader process, kept running, and the workers it follows."""

    def __init__(
        self, mirror: Mirror, block_size: int, snapshots_at_once: int, dynamo_hashes: bool = False
    ) -> None:
        self._mirror = mirror
        self._command = [
            sys.executable,
            "-c",
            "from tskv.shells._reader_child import main; main()",
            str(block_size),
            str(snapshots_at_once),
            str(logging.getLogger("tskv").getEffectiveLevel()),
            str(int(dynamo_hashes)),  # its index keeps Dynamo's block hashes too
        ]
        self.wanted: dict[int, tuple[Worker, Follow]] = {}  # slot -> worker, what it follows
        self._sent: set[int] = set()  # the slots the running process follows
        self._changed = trio.lowlevel.ParkingLot()
        self._questions: dict[int, tuple[trio.Event, AskHashes, list[Hashes]]] = {}
        self._asked = 0
        self.pid: int | None = None
        self.counts = ReaderCounts()

    def status(self) -> ReaderStatus:
        return self.counts.frozen(self.pid, len(self.wanted))

    def applied(self) -> AppliedFigures:
        """What this reader's processes applied, the ended ones' included."""
        return self.counts.all_applied()

    def add(self, worker: Worker, follow: Follow) -> None:
        self.wanted[follow.slot] = (worker, follow)
        self._changed.unpark_all()

    def remove(self, slot: int) -> None:
        self.wanted.pop(slot, None)
        self._changed.unpark_all()

    async def engine_hashes(self, slot: int) -> set[int]:
        """The engine's hashes of the blocks the reader's index holds for `slot`."""
        return {int(block) for block in await self.ask(AskHashes(0, slot))}

    async def ask(self, question: AskHashes) -> list[Any]:
        """The reader's answer to `question` (numbered here), with its next frame."""
        self._asked += 1
        question = attrs.evolve(question, question=self._asked)
        answer: tuple[trio.Event, AskHashes, list[Hashes]] = (trio.Event(), question, [])
        self._questions[question.question] = answer
        self._changed.unpark_all()
        try:
            await answer[0].wait()
        finally:
            self._questions.pop(question.question, None)
        if not answer[2]:
            raise TskvError(
                f"reader process {self.pid} ended before it answered; it is started again, "
                "ask once the worker is current (watcher.wait_for_seq)"
            )
        return answer[2][0].hashes

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Keep the process running; each time it ends, its workers are stale until followed
        again from their snapshots."""
        backoff = Backoff(*RESTART_BACKOFF)
        while True:
            began = trio.current_time()
            await self._run_once(task_status)
            task_status = trio.TASK_STATUS_IGNORED
            self.counts.ended()
            if trio.current_time() - began > RESTART_BACKOFF[1]:
                backoff.reset()  # it had been running well
            wait = backoff.next()
            logger.warning(
                "reader process %s ended; its %d workers are stale until it is started again "
                "in %.1f s and their snapshots are in",
                self.pid,
                len(self.wanted),
                wait,
            )
            self.pid = None
            for event, _, _ in self._questions.values():
                event.set()  # unanswered: it is gone
            self._mirror.reader_lost([worker for worker, _ in self.wanted.values()])
            await trio.sleep(wait)

    async def _run_once(self, task_status: trio.TaskStatus[None]) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [_PACKAGE_HOME, env.get("PYTHONPATH")]))
        process = await trio.lowlevel.open_process(
            self._command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
        )
        assert process.stdin is not None and process.stdout is not None
        self.pid, self._sent = process.pid, set()
        task_status.started()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._send_commands, process.stdin)
                await self._receive(process.stdout)
                nursery.cancel_scope.cancel()
        except BaseException as exc:
            if not only(exc, trio.BrokenResourceError):
                raise  # else it is gone: started again by `run`
        finally:
            with trio.CancelScope(shield=True):
                process.kill()
                await process.wait()

    async def _send_commands(self, stdin: trio.abc.SendStream) -> None:
        """Bring the process's workers to `wanted` whenever it changes, and ask its questions."""
        asked: set[int] = set()
        while True:
            for slot in sorted(self._sent - self.wanted.keys()):
                await stdin.send_all(frame(Unfollow(slot)))
                self._sent.discard(slot)
            for slot in [slot for slot in self.wanted if slot not in self._sent]:
                if slot in self.wanted:  # not removed while the last one was written
                    await stdin.send_all(frame(self.wanted[slot][1]))
                    self._sent.add(slot)
            for number in [number for number in self._questions if number not in asked]:
                asked.add(number)
                await stdin.send_all(frame(self._questions[number][1]))
            if self._sent == self.wanted.keys() and asked >= self._questions.keys():
                await self._changed.park()

    async def _receive(self, stdout: trio.abc.ReceiveStream) -> None:
        # A frame carries up to a thousand batches' news: applied in one go, it held the
        # index's loop, and the queries a router answers there, for tens of ms.
        pacer = Pacer()
        reader = FrameReader()
        while chunk := await stdout.receive_some(1 << 20):
            pacer.waited()  # other tasks ran while it was read: the next report need not yield
            for frame_news in news(reader.feed(chunk)):
                await self._take(frame_news, pacer)

    async def _take(self, frame_news: News, pacer: Pacer) -> None:
        self.counts.cpu_seconds = frame_news.cpu_seconds
        self.counts.applied = frame_news.applied
        self._note_dropped(frame_news)
        for item in frame_news.items:
            if pacer.due():
                await pacer.yield_now()  # a report is applied whole, or not yet
            if isinstance(item, Report):
                entry = self.wanted.get(item.slot)
                if entry is not None:  # else removed while this was on its way
                    self._mirror.report(entry[0], item)
            elif isinstance(item, LogLine):
                logging.getLogger(item.name).log(
                    item.level, "%s (reader process %s)", item.text, self.pid
                )
            elif item.question in self._questions:
                event, _, answer = self._questions[item.question]
                answer.append(item)
                event.set()

    def _note_dropped(self, frame_news: News) -> None:
        if not (frame_news.dropped_losses or frame_news.dropped_logs):
            return
        self.counts.dropped_losses += frame_news.dropped_losses
        self.counts.dropped_logs += frame_news.dropped_logs
        logger.warning(
            "reader process %s fell behind the index's process and dropped %d loss reports "
            "(their on_loss calls; the index and the figures have them) and %d log records; "
            "counted in watcher.readers",
            self.pid,
            frame_news.dropped_losses,
            frame_news.dropped_logs,
        )
