"""Keeping a PrefixIndex current from many workers' streams, in Trio.

One task per worker runs an `open_subscriber` (bootstrapping from the worker's snapshot when it
has a replay endpoint) and applies every batch to the shared index. The index is told, per
worker, when its view stops being complete (a loss was reported, or the worker went silent: its
quiet stream's probe went unanswered) and when it is complete again (a snapshot or a cache
reset was applied, the stream was followed from its seq 0, or a silent worker answered with
nothing lost), so a router can see which answers not to trust. A worker's failure (its
endpoint unreachable, its subscriber raising) is logged, marks it stale, and is retried with a
backoff; it never stops the other workers. Workers come and go while it runs.

With `processes=N` the workers are followed in reader processes (`_reader_process`), each a
watcher like this one with an index of its own; this one mirrors what they report.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, final

import attrs
import trio
import zmq

from tskv.core._checks import int_at_least
from tskv.core.config import ConfigError, SubscriberConfig
from tskv.core.endpoints import check_endpoint
from tskv.core.events import KVEventBatch
from tskv.core.losses import Loss
from tskv.core.prefix_index import PrefixIndex, Worker
from tskv.core.worker_view import CURRENT, STALE, ViewChange, WorkerView
from tskv.shells._background import background_tasks
from tskv.shells._constructor import NoPublicConstructor
from tskv.shells._following import SNAPSHOTS_AT_ONCE, Bootstraps, Record, follow
from tskv.shells._reader_process import Reader, ReaderStatus, Report
from tskv.shells._snapshot_parts import SnapshotParts, restore

logger = logging.getLogger(__name__)


@attrs.frozen
class WorkerStatus:
    """How one watched worker is doing, at the moment `Watcher.status` was asked."""

    endpoint: str
    replay_endpoint: str | None
    batches: int = 0  # applied to the index
    losses: int = 0  # loss reports (snapshots and restarts included)
    failures: int = 0  # times its subscriber failed and was started again
    last_error: str | None = None
    last_seq: int | None = None
    silent: bool = False  # its publisher did not answer a probe of its quiet stream
    config: SubscriberConfig = attrs.Factory(SubscriberConfig)  # its subscriber's settings


@attrs.define
class _Watched:
    """A watched worker's task state; `Watcher.status` hands out a frozen copy."""

    endpoint: str
    replay_endpoint: str | None
    scope: trio.CancelScope
    config: SubscriberConfig
    slot: int
    view: WorkerView = attrs.Factory(WorkerView)
    changed: trio.lowlevel.ParkingLot = attrs.Factory(trio.lowlevel.ParkingLot)
    counted: tuple[int, int, int] = (0, 0, 0)  # batches, losses, failures of readers gone
    batches: int = 0
    losses: int = 0
    failures: int = 0
    last_error: str | None = None
    last_seq: int | None = None
    silent: bool = False

    def status(self) -> WorkerStatus:
        return WorkerStatus(
            self.endpoint,
            self.replay_endpoint,
            self.batches,
            self.losses,
            self.failures,
            self.last_error,
            self.last_seq,
            self.silent,
            self.config,
        )


@final
class Watcher(metaclass=NoPublicConstructor):
    """What `open_watcher` yields: add and remove workers while it runs."""

    def __init__(
        self,
        index: PrefixIndex,
        nursery: trio.Nursery,
        on_loss: Callable[[Worker, Loss], object] | None,
        config: SubscriberConfig,
        context: zmq.Context[zmq.Socket[bytes]] | None,
        snapshots_at_once: int = SNAPSHOTS_AT_ONCE,
    ) -> None:
        self.index = index
        self._nursery = nursery
        self._on_loss = on_loss
        self.config = config  # every worker's subscriber settings, less what `add` changes
        self._context = context
        self._watched: dict[Worker, _Watched] = {}
        self._readers: list[Reader] = []  # none: each worker is followed by a task here
        self._slots = 0  # how a reader process names a worker: its `add`'s number
        self.record: Record = self  # who is told each worker's news (a reader's outbox)
        self._bootstraps = Bootstraps(snapshots_at_once)

    def add(
        self,
        worker: Worker,
        endpoint: str,
        replay_endpoint: str | None = None,
        **subscriber_settings: Any,
    ) -> None:
        """Start following `worker`'s stream; it is stale in the index until its view is whole.
        `subscriber_settings` (e.g. this worker's `curve_server_key`) change the watcher's
        `config` for this worker; they are checked here, so a bad one raises now."""
        if worker in self._watched:
            raise ValueError(f"worker {worker!r} is already watched; remove it first")
        check_endpoint(endpoint)
        if replay_endpoint is not None:
            check_endpoint(replay_endpoint)
        config = _worker_config(_changed(self.config, subscriber_settings), replay_endpoint)
        if self._readers and endpoint.startswith("inproc://"):
            raise ValueError(
                f"endpoint {endpoint!r} is in this process, where a reader process cannot reach "
                "it: use ipc:// or tcp://127.0.0.1 endpoints, or open the watcher with processes=0"
            )
        self._slots += 1
        watched = _Watched(endpoint, replay_endpoint, trio.CancelScope(), config, self._slots)
        self._watched[worker] = watched
        self.index.mark_stale(worker)
        if self._readers:
            self.index.apply_changes(worker, [])  # its blocks are kept by a reader
            reader = min(self._readers, key=lambda reader: len(reader.wanted))
            settings = attrs.asdict(config)
            del settings["start_seq"]  # the reader's watcher sets it as this one does
            reader.add(watched.slot, worker, endpoint, replay_endpoint, settings)
        else:
            self._nursery.start_soon(self._follow_here, worker, watched)

    def remove(self, worker: Worker) -> None:
        """Stop following `worker` and drop it from the index."""
        watched = self._watched.pop(worker, None)
        if watched is not None:
            watched.scope.cancel()
            watched.changed.unpark_all()  # its waiters learn it is gone
            for reader in self._readers:
                reader.remove(watched.slot)
        self.index.remove_worker(worker)

    def status(self, worker: Worker) -> WorkerStatus:
        return self._watched[worker].status()

    def _change(self, worker: Worker, changes: tuple[ViewChange, ...]) -> None:
        for change in changes:
            if change is ViewChange.CLEAR:
                self.index.clear_worker(worker)
            elif change is ViewChange.STALE:
                self.index.mark_stale(worker)
            else:
                self.index.mark_current(worker)

    @property
    def workers(self) -> list[Worker]:
        return list(self._watched)

    @property
    def readers(self) -> tuple[ReaderStatus, ...]:
        """The reader processes (`open_watcher(processes=N)`): none when the workers are
        followed in this process."""
        return tuple(reader.status() for reader in self._readers)

    async def wait_for_seq(self, worker: Worker, seq: int) -> None:
        """Wait until `worker`'s batch `seq` (or a later one) has been applied to the index."""
        await self._wait(worker, lambda w: w.last_seq is not None and w.last_seq >= seq)

    async def wait_for_loss(self, worker: Worker, count: int = 1) -> None:
        """Wait until `count` losses of `worker` have been reported."""
        await self._wait(worker, lambda w: w.losses >= count)

    async def wait_for_silence(self, worker: Worker, silent: bool = True) -> None:
        """Wait until `worker`'s publisher is silent (or, with `silent=False`, answers)."""
        await self._wait(worker, lambda w: w.silent == silent)

    async def wait_for_failure(self, worker: Worker, count: int = 1) -> None:
        """Wait until `worker`'s subscriber has failed `count` times (its `last_error` says
        why)."""
        await self._wait(worker, lambda w: w.failures >= count)

    async def _wait(self, worker: Worker, done: Callable[[_Watched], bool]) -> None:
        watched = self._watched[worker]  # a KeyError names a worker never added
        while not done(watched):
            await watched.changed.park()  # woken by this worker's news only
            if self._watched.get(worker) is not watched:
                raise KeyError(f"worker {worker!r} was removed while waited for")

    async def _follow_here(self, worker: Worker, watched: _Watched) -> None:
        with watched.scope:
            endpoints = (watched.endpoint, watched.replay_endpoint)
            config, context = watched.config, self._context
            await follow(self.record, worker, *endpoints, config, context, self._bootstraps)

    # -- what the workers' followers report (`_following.Record`), here or from a reader ----

    def watching(self, worker: Worker) -> bool:
        return worker in self._watched

    async def room(self) -> None:
        pass  # the index is applied to at once

    def applied(self, worker: Worker, seq: int, batch: KVEventBatch) -> None:
        if worker in self._watched:  # else removed while this batch was on its way
            self.index.apply(worker, batch)  # an AllBlocksCleared in it makes the view whole
            self._delivered(worker, seq)

    async def restored(
        self,
        worker: Worker,
        seq: int,
        snapshot: SnapshotParts,
        between: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        if await restore(self.index, worker, snapshot, lambda: worker in self._watched, between):
            self._delivered(worker, seq)

    def _delivered(self, worker: Worker, seq: int) -> None:
        watched = self._watched[worker]
        if watched.view.from_start:
            self._change(worker, watched.view.delivered(seq))
        watched.batches += 1
        watched.last_seq = seq
        watched.changed.unpark_all()

    def lost(self, worker: Worker, loss: Loss) -> None:
        watched = self._watched.get(worker)
        if watched is None:
            return
        watched.losses += 1
        watched.changed.unpark_all()
        if self._on_loss is not None:
            self._on_loss(worker, loss)
        self._change(worker, watched.view.lost(loss))

    def silence(self, worker: Worker, silent: bool) -> None:
        watched = self._watched.get(worker)
        if watched is None:
            return
        watched.silent = silent
        watched.changed.unpark_all()
        self._change(worker, watched.view.silence(silent, worker in self.index.stale))

    def failed(self, worker: Worker, error: str, retry_in: float, log: bool = True) -> None:
        watched = self._watched.get(worker)
        if watched is None:
            return
        watched.failures += 1
        watched.last_error = error
        watched.changed.unpark_all()
        if log:
            _log_failure(worker, watched, error, retry_in)

    def resubscribed(self, worker: Worker) -> None:
        watched = self._watched.get(worker)
        if watched is not None:
            self._change(worker, watched.view.resubscribed())

    def watched(self, worker: Worker) -> _Watched | None:
        return self._watched.get(worker)

    # -- what reader processes report: a worker's state, decided there ----------------------

    def mirrored(self, worker: Worker, report: Report) -> None:
        watched = self._watched.get(worker)
        if watched is None:
            return
        self.index.apply_changes(worker, report.changes, strings=report.strings)
        self._change(worker, STALE if report.stale else CURRENT)
        batches, losses, failures = watched.counted
        watched.batches = batches + report.batches
        watched.losses = losses + report.losses
        watched.failures = failures + report.failures
        watched.last_error = report.last_error or watched.last_error
        watched.last_seq, watched.silent = report.last_seq, report.silent
        watched.changed.unpark_all()
        if report.loss is not None and self._on_loss is not None:
            self._on_loss(worker, report.loss)
        if report.failure is not None:
            _log_failure(worker, watched, *report.failure)

    def reader_lost(self, workers: list[Worker]) -> None:
        """Their reader process ended: what the index holds of them is forgotten, and they are
        stale until the next one's snapshots are in."""
        self.index.clear_workers(workers)
        for worker in workers:
            watched = self._watched.get(worker)
            if watched is None:
                continue
            self.index.mark_stale(worker)
            watched.failures += 1
            watched.last_error = "its reader process ended"
            watched.counted = (watched.batches, watched.losses, watched.failures)
            watched.changed.unpark_all()

    async def engine_hashes(self, worker: Worker) -> set[int]:
        """The engine's hashes of the blocks `worker` holds, as its stream says (asked of its
        reader process, which keeps them, when there is one)."""
        watched = self._watched[worker]  # a KeyError names a worker never added
        for reader in self._readers:
            if watched.slot in reader.wanted:
                return await reader.engine_hashes(watched.slot)
        return self.index.engine_hashes(worker)


WATCHER_SETS = frozenset({"start_seq", "on_loss", "on_silence"})


def _log_failure(worker: Worker, watched: _Watched, error: str, retry: float) -> None:
    logger.warning(
        "watching %r on %s failed (%s); trying again in %.1f s",
        worker,
        watched.endpoint,
        error,
        retry,
    )


def _changed(config: SubscriberConfig, settings: dict[str, Any]) -> SubscriberConfig:
    ours = sorted(WATCHER_SETS & settings.keys())
    if ours:
        raise TypeError(
            f"the watcher sets {', '.join(ours)} itself (each worker starts from its "
            "snapshot); pass on_loss=f(worker, loss) to open_watcher for the losses"
        )
    return config.but(**settings)


def _worker_config(config: SubscriberConfig, replay_endpoint: str | None) -> SubscriberConfig:
    return config.but(start_seq="snapshot" if replay_endpoint else None)


@asynccontextmanager
async def open_watcher(
    index: PrefixIndex,
    *,
    on_loss: Callable[[Worker, Loss], object] | None = None,
    context: zmq.Context[zmq.Socket[bytes]] | None = None,
    processes: int = 0,
    snapshots_at_once: int = SNAPSHOTS_AT_ONCE,
    **subscriber_settings: Any,
) -> AsyncIterator[Watcher]:
    """Keep `index` current from the workers added to the yielded `Watcher`, until the block
    ends.

    Args:
      index: the `PrefixIndex` to keep current; each worker's view is marked stale while it
        cannot be vouched for.
      on_loss: called as `on_loss(worker, loss)` for every loss report.
      context: the ZeroMQ context every worker's subscriber uses (none with `processes`).
      processes: follow the workers in this many reader processes, which receive, sequence,
        decode and hash every batch and send the index's process only what it applies; 0 (the
        default) follows them in this process. One reader process keeps about as many
        workers as one watcher process does (docs/routing.md says how many), and the index's
        own process then keeps several times more. POSIX only; workers must publish on ipc://
        or tcp://, not inproc://.
      **subscriber_settings: `SubscriberConfig` settings for every worker's subscriber (e.g.
        `replay_timeout`, `quiet_interval`, the CURVE keys); `Watcher.add` may change them for
        one worker. The watcher starts each worker from its snapshot itself (`start_seq`) and
        sets `on_loss` and `on_silence` itself.

    Raises:
      TypeError: a setting that is not a subscriber setting (the closest one is named), or one
        the watcher sets itself; a `context` given with `processes`.
      ConfigError: a setting out of range (a ValueError).
    """
    config = _changed(SubscriberConfig(), subscriber_settings)
    int_at_least("processes", processes, 0, ConfigError)
    int_at_least("snapshots_at_once", snapshots_at_once, 1, ConfigError)
    if processes and context is not None:
        raise TypeError(
            "context cannot be shared with reader processes (each makes its own); "
            "pass processes=0 to use this context"
        )
    if processes and sys.platform == "win32":
        raise ValueError(f"processes = {processes}: reader processes need POSIX; use 0 on Windows")
    async with background_tasks() as nursery:
        watcher = Watcher._create(index, nursery, on_loss, config, context, snapshots_at_once)
        for _ in range(processes):
            reader = Reader(watcher, index.block_size, snapshots_at_once)
            await nursery.start(reader.run)
            watcher._readers.append(reader)
        yield watcher
