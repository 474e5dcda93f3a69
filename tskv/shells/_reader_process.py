"""A watcher's reader processes: following many workers, off the index's core.

Each reader process runs a watcher of its own over some of the workers, with an index of its
own: receiving, sequencing, decoding and keying every batch, and every decision about a
worker's view, happen there, exactly as in one process. After each piece of news it sends the
index's process what the router needs: the keys the worker came to hold and let go of
(`PrefixIndex.take_changes`), whether its view is stale, and its status. The index's process
mirrors the holds (`apply_changes`) and answers queries. The two talk over the reader's stdin
and stdout (length-prefixed msgpack frames): a pipe only this process and its child hold, so
nothing else can speak on it. A reader that dies is started again, and its workers are stale
until their snapshots are in again.

`main()` is the child's side, given BLOCK_SIZE, SNAPSHOTS_AT_ONCE and LOG_LEVEL as arguments.
"""

from __future__ import annotations

import logging
import os
import struct
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from typing import Any, Protocol

import attrs
import msgpack
import trio

import tskv
from tskv.core._msgspec import msgspec
from tskv.core.errors import TskvError
from tskv.core.events import KVEventBatch
from tskv.core.losses import Loss, LossReason
from tskv.core.prefix_index import PrefixIndex, Worker
from tskv.shells._background import Pacer
from tskv.shells._snapshot_parts import SnapshotParts

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

logger = logging.getLogger(__name__)

_LENGTH = struct.Struct("<I")
OUTBOX_BATCHES = 1_000  # batches a reader holds unsent before its subscribers wait
# A reader sends its news once none has come for FRAME_QUIET seconds, or FRAME_DELAY after the
# first: under load a frame carries many batches, and the index's process wakes once for all.
FRAME_QUIET = 0.002
FRAME_DELAY = 0.02
RESTART_BACKOFF = (0.5, 10.0)
# where tskv is imported from here, so the child imports the same one, installed or not
_PACKAGE_HOME = os.path.dirname(os.path.dirname(os.path.abspath(tskv.__file__)))

if msgspec is not None:
    _pack, _unpack = msgspec.msgpack.Encoder().encode, msgspec.msgpack.Decoder().decode
else:
    _pack, _unpack = msgpack.Packer().pack, msgpack.unpackb


def only(error: BaseException, *kinds: type[BaseException]) -> bool:
    """Whether `error` (or every error in its group) is one of `kinds`."""
    if isinstance(error, BaseExceptionGroup):
        return all(only(inner, *kinds) for inner in error.exceptions)
    return isinstance(error, kinds)


async def _write(stream: trio.abc.SendStream, value: object) -> None:
    """One msgpack frame: tuples of ints, strings and lists (a `Loss` goes as its fields, a
    `SubscriberConfig` as its settings)."""
    frame = _pack(value)
    await stream.send_all(_LENGTH.pack(len(frame)) + frame)


async def _frames(stream: trio.abc.ReceiveStream) -> AsyncIterator[Any]:
    """The values written by `_write` on the other end, until it closes."""
    buffer = bytearray()
    while True:
        chunk = await stream.receive_some(1 << 20)
        if not chunk:
            return
        buffer += chunk
        start = 0
        while len(buffer) - start >= _LENGTH.size:
            (length,) = _LENGTH.unpack_from(buffer, start)
            end = start + _LENGTH.size + length
            if end > len(buffer):
                break
            yield _unpack(bytes(memoryview(buffer)[start + _LENGTH.size : end]))
            start = end
        del buffer[:start]


@attrs.frozen
class Report:
    """A worker's state after some news, as its reader sends it."""

    batches: int
    losses: int
    failures: int
    last_error: str | None
    last_seq: int | None
    silent: bool
    stale: bool
    changes: list[list[int]]  # its holds taken and let go of (`PrefixIndex.take_changes`)
    strings: bool  # the reader's index has seen string token ids
    loss: Loss | None  # the loss this news was, for `on_loss`
    failure: tuple[str, float] | None  # the failure this news was, to log: error, retry in


def _report_out(slot: Worker, report: Report) -> tuple[Any, ...]:
    """A report as the pipe carries it (`_report_in` reads it back)."""
    loss, lost = report.loss, None
    if loss is not None:
        lost = (loss.first_seq, loss.last_seq, loss.reason.value, loss.new_seq)
    state = (report.batches, report.losses, report.failures, report.last_error, report.last_seq)
    flags = (report.silent, report.stale, report.changes, report.strings)
    return ("report", slot, *state, *flags, lost, report.failure)


def _report_in(message: list[Any]) -> Report:
    batches, losses, failures, last_error, last_seq, silent, stale, changes, strings = message[2:11]
    lost, failure = message[11:]
    loss = None
    if lost is not None:
        first_seq, last_seq_lost, reason, new_seq = lost
        loss = Loss(first_seq, last_seq_lost, LossReason(reason), new_seq)
    return Report(
        batches,
        losses,
        failures,
        last_error,
        last_seq,
        silent,
        stale,
        changes,
        strings,
        loss,
        None if failure is None else (failure[0], failure[1]),
    )


# -- the index's side ---------------------------------------------------------------------


class Mirror(Protocol):
    """The watcher, as its readers report to it."""

    def mirrored(self, worker: Worker, report: Report) -> None: ...

    def reader_lost(self, workers: list[Worker]) -> None: ...


@attrs.frozen
class ReaderStatus:
    """One reader process, as `Watcher.readers` reports it."""

    pid: int | None  # None while it is being started again
    workers: int
    cpu_seconds: float  # its CPU time (user and system) when it last reported
    restarts: int


class Reader:
    """One reader process, kept running, and the workers it follows."""

    def __init__(self, mirror: Mirror, block_size: int, snapshots_at_once: int) -> None:
        self._mirror = mirror
        self._command = [
            sys.executable,
            "-c",
            f"from {__name__} import main; main()",
            str(block_size),
            str(snapshots_at_once),
            str(logging.getLogger("tskv").getEffectiveLevel()),
        ]
        self.wanted: dict[int, tuple[Worker, tuple[Any, ...]]] = {}  # slot -> worker, add's args
        self._sent: set[int] = set()  # the slots the running process follows
        self._changed = trio.lowlevel.ParkingLot()
        self._questions: dict[int, tuple[trio.Event, list[Any]]] = {}  # number -> [slot, answer]
        self._asked = 0
        self.pid: int | None = None
        self.cpu_seconds = 0.0
        self.restarts = 0

    def status(self) -> ReaderStatus:
        return ReaderStatus(self.pid, len(self.wanted), self.cpu_seconds, self.restarts)

    def add(self, slot: int, worker: Worker, *args: Any) -> None:
        self.wanted[slot] = (worker, args)
        self._changed.unpark_all()

    def remove(self, slot: int) -> None:
        self.wanted.pop(slot, None)
        self._changed.unpark_all()

    async def engine_hashes(self, slot: int) -> set[int]:
        """The engine's hashes of the blocks the reader's index holds for `slot`."""
        self._asked += 1
        asked = self._asked
        answer: tuple[trio.Event, list[Any]] = (trio.Event(), [slot])
        self._questions[asked] = answer
        self._changed.unpark_all()
        try:
            await answer[0].wait()
        finally:
            self._questions.pop(asked, None)
        if len(answer[1]) < 2:
            raise TskvError(
                f"reader process {self.pid} ended before it answered; it is started again, "
                "ask once the worker is current (watcher.wait_for_seq)"
            )
        return {int(block) for block in answer[1][1]}

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Keep the process running; each time it ends, its workers are stale until followed
        again from their snapshots."""
        backoff, longest = RESTART_BACKOFF
        while True:
            began = trio.current_time()
            await self._run_once(task_status)
            task_status = trio.TASK_STATUS_IGNORED
            self.restarts += 1
            if trio.current_time() - began > longest:
                backoff = RESTART_BACKOFF[0]  # it had been running well
            logger.warning(
                "reader process %s ended; its %d workers are stale until it is started again "
                "in %.1f s and their snapshots are in",
                self.pid,
                len(self.wanted),
                backoff,
            )
            self.pid = None
            for event, _ in self._questions.values():
                event.set()  # unanswered: it is gone
            self._mirror.reader_lost([worker for worker, _ in self.wanted.values()])
            await trio.sleep(backoff)
            backoff = min(backoff * 2, longest)

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
                await _write(stdin, ("remove", slot))
                self._sent.discard(slot)
            for slot in [slot for slot in self.wanted if slot not in self._sent]:
                if slot in self.wanted:  # not removed while the last one was written
                    endpoint, replay_endpoint, settings = self.wanted[slot][1]
                    await _write(stdin, ("add", slot, endpoint, replay_endpoint, settings))
                    self._sent.add(slot)
            for question in [q for q in self._questions if q not in asked]:
                asked.add(question)
                await _write(stdin, ("engine_hashes", question, self._questions[question][1][0]))
            if self._sent == self.wanted.keys() and asked >= self._questions.keys():
                await self._changed.park()

    async def _receive(self, stdout: trio.abc.ReceiveStream) -> None:
        mirror = self._mirror
        # A frame carries up to OUTBOX_BATCHES batches' news: applied in one go, it held the
        # index's loop, and the queries a router answers there, for tens of ms.
        pacer = Pacer()
        async for cpu_seconds, messages in _frames(stdout):
            self.cpu_seconds = cpu_seconds
            for message in messages:
                if pacer.due():
                    await pacer.yield_now()  # a report is applied whole, or not yet
                kind = message[0]
                if kind == "report":
                    entry = self.wanted.get(message[1])
                    if entry is not None:  # else removed while this was on its way
                        mirror.mirrored(entry[0], _report_in(message))
                elif kind == "log":
                    _, name, level, text = message
                    logging.getLogger(name).log(level, "%s (reader process %s)", text, self.pid)
                else:  # "engine_hashes": the answer to a question
                    _, question, hashes = message
                    if question in self._questions:
                        event, answer = self._questions[question]
                        answer.append(hashes)
                        event.set()


# -- the reader's side --------------------------------------------------------------------


class _Outbox:
    """The reader's own watcher's record (`_following.Record`): it tells that watcher, then
    queues the worker's new state for the index's process, sent as it can take it."""

    def __init__(self, watcher: Any, index: PrefixIndex) -> None:
        self._watcher = watcher  # tskv.shells.watcher.Watcher (imported late: it imports us)
        self._index = index
        self._pending: list[tuple[Any, ...]] = []
        self._batches = 0  # of `_pending`
        self._has_news = trio.lowlevel.ParkingLot()
        self._has_room = trio.lowlevel.ParkingLot()

    def put(self, message: tuple[Any, ...]) -> None:
        self._pending.append(message)
        self._has_news.unpark_all()

    def _report(
        self, slot: Worker, loss: Loss | None = None, failure: tuple[str, float] | None = None
    ) -> None:
        """Queue `slot`'s state (a slot is the int this reader's watcher names a worker by)."""
        watched = self._watcher.watched(slot)
        if watched is None:
            return
        index = self._index
        report = Report(
            watched.batches,
            watched.losses,
            watched.failures,
            watched.last_error,
            watched.last_seq,
            watched.silent,
            slot in index.stale,
            index.take_changes(slot),
            index.seen_strings,
            loss,
            failure,
        )
        self.put(_report_out(slot, report))

    def watching(self, worker: Worker) -> bool:
        return bool(self._watcher.watching(worker))

    async def room(self) -> None:
        while self._batches >= OUTBOX_BATCHES:
            await self._has_room.park()

    def applied(self, worker: Worker, seq: int, batch: KVEventBatch) -> None:
        self._watcher.applied(worker, seq, batch)
        self._report_batch(worker)

    def _report_batch(self, worker: Worker) -> None:
        """Queue a report of a batch (or a snapshot's part) applied: counted for `room`."""
        self._batches += 1
        self._report(worker)

    async def restored(self, worker: Worker, seq: int, snapshot: SnapshotParts) -> None:
        """Reported a part at a time (stale until the last): the index's process mirrors it
        in steps between its queries, not in one go (25-50 ms at 50,000 blocks)."""

        async def reported() -> None:
            self._report_batch(worker)
            await self.room()

        await self._watcher.restored(worker, seq, snapshot, reported)
        self._report_batch(worker)

    def lost(self, worker: Worker, loss: Loss) -> None:
        self._watcher.lost(worker, loss)
        self._report(worker, loss=loss)

    def silence(self, worker: Worker, silent: bool) -> None:
        self._watcher.silence(worker, silent)
        self._report(worker)

    def failed(self, worker: Worker, error: str, retry_in: float) -> None:
        self._watcher.failed(worker, error, retry_in, log=False)  # the index's process logs it
        self._report(worker, failure=(error, retry_in))

    def resubscribed(self, worker: Worker) -> None:
        self._watcher.resubscribed(worker)
        self._report(worker)

    def log(self, record: logging.LogRecord) -> None:
        self.put(("log", record.name, record.levelno, record.getMessage()))

    async def send_all(self, stream: trio.abc.SendStream) -> None:
        while True:
            if not self._pending:
                await self._has_news.park()
            deadline = trio.current_time() + FRAME_DELAY
            waited = -1
            while waited < len(self._pending) < OUTBOX_BATCHES and trio.current_time() < deadline:
                waited = len(self._pending)
                await trio.sleep(FRAME_QUIET)
            messages, self._pending, self._batches = self._pending, [], 0
            await _write(stream, (time.process_time(), messages))
            self._has_room.unpark_all()


class _Forward(logging.Handler):
    """The reader's log records, re-logged by the index's process under the same names."""

    def __init__(self, outbox: _Outbox) -> None:
        super().__init__()
        self._outbox = outbox

    def emit(self, record: logging.LogRecord) -> None:
        self._outbox.log(record)


async def _serve(block_size: int, at_once: int, level: int, stdin: int, stdout: int) -> None:
    from tskv.shells.watcher import open_watcher

    index = PrefixIndex(block_size, record_changes=True)
    async with open_watcher(index, snapshots_at_once=at_once) as watcher:
        outbox = _Outbox(watcher, index)
        watcher.record = outbox
        tskv_logger = logging.getLogger("tskv")
        tskv_logger.addHandler(_Forward(outbox))
        tskv_logger.setLevel(level)
        tskv_logger.propagate = False
        async with trio.open_nursery() as nursery:
            nursery.start_soon(outbox.send_all, trio.lowlevel.FdStream(stdout))
            async for command in _frames(trio.lowlevel.FdStream(stdin)):
                if command[0] == "add":
                    _, slot, endpoint, replay_endpoint, settings = command
                    watcher.add(slot, endpoint, replay_endpoint, **settings)
                elif command[0] == "remove":
                    watcher.remove(command[1])
                else:  # "engine_hashes": the question's number, and of which worker
                    _, question, slot = command
                    outbox.put(("engine_hashes", question, list(index.engine_hashes(slot))))
            nursery.cancel_scope.cancel()  # the index's process closed our stdin: it is done


def main() -> None:
    block_size, at_once, level = (int(argument) for argument in sys.argv[-3:])
    stdin, stdout = os.dup(0), os.dup(1)
    os.dup2(2, 1)  # a stray print must not corrupt the frames
    sys.stdout = sys.stderr
    try:
        trio.run(_serve, block_size, at_once, level, stdin, stdout)
    except BaseException as exc:
        if not only(exc, trio.BrokenResourceError, KeyboardInterrupt):
            raise  # else the index's process is gone
