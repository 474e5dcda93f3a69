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

import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any, final

import attrs
import trio
import zmq

from tskv.core._checks import int_at_least
from tskv.core.applied import AppliedFigures
from tskv.core.config import SubscriberConfig
from tskv.core.descriptor import Descriptor, mismatch
from tskv.core.dynamo_hashes import answer as dynamo_answer
from tskv.core.endpoints import check_endpoint
from tskv.core.errors import ConfigError, TskvError, TskvLookupError, TskvTypeError
from tskv.core.losses import Loss
from tskv.core.prefix_index import BlockIndex, PrefixIndex, Worker
from tskv.core.reader_messages import AskHashes, Follow
from tskv.core.worker_view import WorkerFigures
from tskv.shells._background import background_tasks
from tskv.shells._constructor import NoPublicConstructor
from tskv.shells._following import SNAPSHOTS_AT_ONCE, Bootstraps, follow
from tskv.shells._index_record import IndexRecord, Listener
from tskv.shells._live_pump import PUMP_AVAILABLE, LivePump
from tskv.shells._reader_mirror import ReaderMirror
from tskv.shells._reader_process import Reader, ReaderStatus
from tskv.shells._watched import Roster, Watched, log_mismatch, logger
from tskv.shells.describe import describe_publisher


@attrs.frozen(kw_only=True)
class WorkerStatus(WorkerFigures):
    """How one watched worker is doing, at the moment `Watcher.status` was asked: its figures
    (`WorkerFigures`), where it publishes and its subscriber's settings."""

    endpoint: str
    replay_endpoint: str | None
    config: SubscriberConfig = attrs.Factory(SubscriberConfig)  # its subscriber's settings
    descriptor: Descriptor | None = None  # what its publisher said it is (tskv's publishers)
    mismatch: str | None = None  # why its blocks cannot match the index's (a block size, a hash)


QUIET_INTERVAL = 1.0  # a watched worker's quiet stream is probed this often: dead in 2 s
DESCRIBE_RETRY, DESCRIBE_RETRY_MAX = 1.0, 60.0  # seconds between describe requests unanswered
REPLAY_TIMEOUT = 2.0  # and a repair it stops answering is given up (the worker stale) as soon
OnStatus = Callable[[Worker, WorkerStatus], object]


@final
class Watcher(metaclass=NoPublicConstructor):
    """What `open_watcher` yields: add and remove workers while it runs, and ask how each is
    doing."""

    def __init__(
        self,
        index: BlockIndex,
        nursery: trio.Nursery,
        on_loss: Callable[[Worker, Loss], object] | None,
        config: SubscriberConfig,
        context: zmq.Context[zmq.Socket[bytes]] | None,
        snapshots_at_once: int = SNAPSHOTS_AT_ONCE,
        listener: Listener | None = None,
        on_status: OnStatus | None = None,
    ) -> None:
        self.index = index
        self._on_status = on_status
        self._nursery = nursery
        self.config = config  # every worker's subscriber settings, less what `add` changes
        self._context = context
        self._roster: Roster = {}
        self._record = IndexRecord(index, self._roster, on_loss, listener)
        # reader processes' reports, mirrored into the router's index (a reader's own watcher
        # keeps a JournalIndex, which mirrors nothing)
        self._mirror = (
            ReaderMirror(index, self._roster, on_loss) if isinstance(index, PrefixIndex) else None
        )
        self._readers: list[Reader] = []  # none: each worker is followed by a task here
        self._slots = 0  # how a reader process names a worker: its `add`'s number
        self._bootstraps = Bootstraps(snapshots_at_once)
        self._pump: LivePump | None = None  # reads the live sockets of the workers here
        # a reader process's watcher (its record has a listener) leaves asking what each
        # publisher is to the index's process, which acts on the answer
        self._describes = listener is None

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
        if worker in self._roster:
            raise ConfigError(f"worker {worker!r} is already watched; remove it first")
        check_endpoint(endpoint)
        if replay_endpoint is not None:
            check_endpoint(replay_endpoint)
        config = _worker_config(_changed(self.config, subscriber_settings), replay_endpoint)
        if self._readers and endpoint.startswith("inproc://"):
            raise ConfigError(
                f"endpoint {endpoint!r} is in this process, where a reader process cannot reach "
                "it: use ipc:// or tcp://127.0.0.1 endpoints, or open the watcher with processes=0"
            )
        self._slots += 1
        watched = Watched(endpoint, replay_endpoint, config, self._slots)
        if self._on_status is not None:
            watched.on_turn = partial(self._turned, worker, watched)
        self._roster[worker] = watched
        self.index.carry_out(worker, self.index.worker_view(worker).watched())
        if self._readers:
            assert self._mirror is not None  # `watch` gives readers only to a PrefixIndex
            self._mirror.index.apply_changes(worker, [])  # its blocks are kept by a reader
            reader = min(self._readers, key=lambda reader: len(reader.wanted))
            settings = attrs.asdict(config)
            del settings["start_seq"]  # the reader's watcher sets it as this one does
            reader.add(worker, Follow(watched.slot, endpoint, replay_endpoint, settings))
        else:
            self._nursery.start_soon(self._follow_here, worker, watched)
        if replay_endpoint is not None and self._describes:
            self._nursery.start_soon(self._describe, worker, watched)
        else:
            watched.described.set()  # nowhere to ask

    def remove(self, worker: Worker) -> None:
        """Stop following `worker` and drop it from the index. Raises `TskvLookupError` (a
        KeyError) for a worker not watched, naming those that are."""
        watched = self._watched(worker)
        del self._roster[worker]
        watched.scope.cancel()
        watched.changed.unpark_all()  # its waiters learn it is gone
        for reader in self._readers:
            reader.remove(watched.slot)
        if self._mirror is not None:
            self._mirror.forget(worker)
        self.index.remove_worker(worker)

    def status(self, worker: Worker) -> WorkerStatus:
        """How `worker` is doing now: its figures (batches, losses, failures, the last error,
        the last seq applied, `silent`, `stale`), where it publishes and its subscriber's
        settings. Raises `TskvLookupError` for a worker not watched."""
        watched = self._watched(worker)
        return WorkerStatus(
            **attrs.asdict(watched.figures, recurse=False),
            endpoint=watched.endpoint,
            replay_endpoint=watched.replay_endpoint,
            config=watched.config,
            descriptor=watched.descriptor,
            mismatch=watched.mismatch,
        )

    def _watched(self, worker: Worker) -> Watched:
        watched = self._roster.get(worker)
        if watched is None:
            known = ", ".join(repr(worker) for worker in list(self._roster)[:20]) or "none"
            more = f" and {len(self._roster) - 20} more" if len(self._roster) > 20 else ""
            raise TskvLookupError(
                f"worker {worker!r} is not watched (watched: {known}{more}); add it first"
            )
        return watched

    def _turned(self, worker: Worker, watched: Watched) -> None:
        """`worker` turned stale, current, silent or back: its `on_status` is told."""
        if self._roster.get(worker) is watched and self._on_status is not None:
            self._on_status(worker, self.status(worker))

    @property
    def applied(self) -> AppliedFigures:
        """What was applied to the index, by this process and its reader processes: how late
        each batch was from its timestamp (a histogram), and the events by kind."""
        figures = self._record.applied_so_far.figures()
        for reader in self._readers:
            figures = figures.plus(reader.applied())
        return figures

    def blocks_by_medium(self, worker: Worker) -> dict[str | None, int]:
        """How many blocks `worker` holds in each storage medium (None: the event named
        none), as the index or, with reader processes, its reader says."""
        held = self.index.blocks_by_medium(worker)
        if held is None and self._mirror is not None:
            return self._mirror.blocks.get(worker, {})
        return {} if held is None else held

    @property
    def workers(self) -> list[Worker]:
        """The workers watched now, in the order they were added."""
        return list(self._roster)

    @property
    def readers(self) -> tuple[ReaderStatus, ...]:
        """The reader processes (`open_watcher(processes=N)`): none when the workers are
        followed in this process."""
        return tuple(reader.status() for reader in self._readers)

    async def wait_for_seq(self, worker: Worker, seq: int) -> None:
        """Wait until `worker`'s batch `seq` (or a later one) has been applied to the index."""
        await self._wait(worker, lambda f: f.last_seq is not None and f.last_seq >= seq)

    async def wait_for_loss(self, worker: Worker, count: int = 1) -> None:
        """Wait until `count` losses of `worker` have been reported."""
        await self._wait(worker, lambda f: f.losses >= count)

    async def wait_for_silence(self, worker: Worker, silent: bool = True) -> None:
        """Wait until `worker`'s publisher is silent (or, with `silent=False`, answers)."""
        await self._wait(worker, lambda f: f.silent == silent)

    async def described(self, worker: Worker) -> WorkerStatus:
        """`worker`'s status once its publisher has been asked what it is (at `add`): its
        `descriptor` (None where the publisher says nothing, as every one but tskv's) and its
        `mismatch`, if its block size or hash cannot match the index's."""
        watched = self._watched(worker)
        await watched.described.wait()
        return self.status(worker)

    async def wait_for_failure(self, worker: Worker, count: int = 1) -> None:
        """Wait until `worker`'s subscriber has failed `count` times (its `last_error` says
        why)."""
        await self._wait(worker, lambda f: f.failures >= count)

    async def _wait(self, worker: Worker, done: Callable[[WorkerFigures], bool]) -> None:
        watched = self._watched(worker)
        while not done(watched.figures):
            await watched.changed.park()  # woken by this worker's news only
            if self._roster.get(worker) is not watched:
                raise TskvLookupError(f"worker {worker!r} was removed while waited for")

    async def _follow_here(self, worker: Worker, watched: Watched) -> None:
        with watched.scope:
            endpoints = (watched.endpoint, watched.replay_endpoint)
            config, context, turns = watched.config, self._context, self._bootstraps
            await follow(self._record, worker, *endpoints, config, context, turns, self._pump)

    async def _describe(self, worker: Worker, watched: Watched) -> None:
        """Ask the worker's publisher what it is, beside following it: one whose block size or
        hash differs from the index's or its other workers' would match nothing, silently. A
        publisher that does not say (any but tskv's) is followed as it is; one that does not
        answer (not up yet) is asked again, less and less often, until it answers or the worker
        is removed. `described` is set after the first try."""
        wait = DESCRIBE_RETRY
        try:
            while self._roster.get(worker) is watched and not await self._ask(worker, watched):
                watched.described.set()
                await trio.sleep(wait)
                wait = min(2 * wait, DESCRIBE_RETRY_MAX)
        finally:
            watched.described.set()

    async def _ask(self, worker: Worker, watched: Watched) -> bool:
        """One describe request; False when it went unanswered (or could not be made)."""
        config = watched.config
        assert watched.replay_endpoint is not None
        with trio.move_on_after(config.replay_timeout):
            try:
                said = await describe_publisher(
                    watched.replay_endpoint,
                    curve_server_key=config.curve_server_key,
                    curve_secret_key=config.curve_secret_key,
                    context=self._context,
                )
            except (TskvError, ValueError, OSError) as exc:
                logger.info("worker %r did not say what it is: %s", worker, exc)
                return False
            if said is not None and self._roster.get(worker) is watched:
                self._described(worker, watched, said)
            return True
        return False

    def _described(self, worker: Worker, watched: Watched, said: Descriptor) -> None:
        watched.descriptor = said
        others = (
            other.descriptor
            for other in self._roster.values()
            if other is not watched and other.descriptor is not None
        )
        watched.mismatch = mismatch(said, self.index.block_size, others)
        if watched.mismatch is not None:
            log_mismatch(worker, watched, watched.mismatch)
            if watched.on_turn is not None:
                watched.on_turn()

    async def dynamo_hashes(self, worker: Worker, block_hashes: list[int] | None) -> list[Any]:
        """What the index keeps of `worker` by Dynamo's block hashes (an index made with
        `dynamo_hashes=True`), as `tskv.core.dynamo_hashes.answer` gives it: its blocks as
        stores (`block_hashes` None), or how many of the prefix `block_hashes` names it holds;
        asked of its reader process when there is one."""
        watched = self._watched(worker)
        reader = self._reader_of(watched)
        if reader is not None:
            return await reader.ask(AskHashes(0, watched.slot, True, block_hashes))
        return dynamo_answer(self.index.dynamo, worker, block_hashes)

    async def engine_hashes(self, worker: Worker) -> set[int]:
        """The engine's hashes of the blocks `worker` holds, as its stream says (asked of its
        reader process, which keeps them, when there is one)."""
        watched = self._watched(worker)
        reader = self._reader_of(watched)
        if reader is not None:
            return await reader.engine_hashes(watched.slot)
        return self.index.engine_hashes(worker)

    def _reader_of(self, watched: Watched) -> Reader | None:
        """The reader process that follows the worker, if one does (else it is followed here)."""
        return next((r for r in self._readers if watched.slot in r.wanted), None)


WATCHER_SETS = frozenset({"start_seq", "on_loss", "on_silence"})


def _changed(config: SubscriberConfig, settings: dict[str, Any]) -> SubscriberConfig:
    ours = sorted(WATCHER_SETS & settings.keys())
    if ours:
        raise TskvTypeError(
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
    on_status: OnStatus | None = None,
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
      on_status: called as `on_status(worker, status)` (a `WorkerStatus`) whenever a worker
        turns stale or current, goes silent or answers again: a router that keeps its own
        list of workers to route to updates it here instead of polling `status`.
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
        sets `on_loss` and `on_silence` itself. Its `quiet_interval` is 1 s and its
        `replay_timeout` 2 s unless given (a subscriber's are 2 s and 5 s): a worker that hangs
        or is cut off is silent (or, in the middle of a repair, stale) within 2 s, one that
        exits at once.

    Raises:
      TypeError: a setting that is not a subscriber setting (the closest one is named), or one
        the watcher sets itself; a `context` given with `processes`.
      ConfigError: a setting out of range (a ValueError).
    """
    defaults = SubscriberConfig(quiet_interval=QUIET_INTERVAL, replay_timeout=REPLAY_TIMEOUT)
    config = _changed(defaults, subscriber_settings)
    int_at_least("processes", processes, 0, ConfigError)
    if processes and context is not None:
        raise TskvTypeError(
            "context cannot be shared with reader processes (each makes its own); "
            "pass processes=0 to use this context"
        )
    if processes and sys.platform == "win32":
        raise ConfigError(f"processes = {processes}: reader processes need POSIX; use 0 on Windows")
    async with watch(
        index,
        config,
        on_loss,
        context,
        processes,
        snapshots_at_once=snapshots_at_once,
        on_status=on_status,
    ) as watcher:
        yield watcher


@asynccontextmanager
async def watch(
    index: BlockIndex,
    config: SubscriberConfig,
    on_loss: Callable[[Worker, Loss], object] | None = None,
    context: zmq.Context[zmq.Socket[bytes]] | None = None,
    processes: int = 0,
    *,
    snapshots_at_once: int = SNAPSHOTS_AT_ONCE,
    listener: Listener | None = None,
    on_status: OnStatus | None = None,
    pump: LivePump | None = None,
) -> AsyncIterator[Watcher]:
    """`open_watcher` with its settings checked; a reader process's own watcher gives its
    record a `listener` (its outbox), and its own `pump`, which gathers longer."""
    int_at_least("snapshots_at_once", snapshots_at_once, 1, ConfigError)
    async with background_tasks() as nursery:
        watcher = Watcher._create(
            index, nursery, on_loss, config, context, snapshots_at_once, listener, on_status
        )
        if processes and watcher._mirror is None:
            raise ConfigError(
                f"processes = {processes}: reader processes report to a PrefixIndex, not a "
                f"{type(index).__name__}"
            )
        for _ in range(processes):
            assert watcher._mirror is not None
            dynamo = index.dynamo is not None  # its readers keep Dynamo's hashes too
            reader = Reader(watcher._mirror, index.block_size, snapshots_at_once, dynamo)
            await nursery.start(reader.run)
            watcher._readers.append(reader)
        if not processes and PUMP_AVAILABLE:
            watcher._pump = LivePump() if pump is None else pump
            nursery.start_soon(watcher._pump.run)
        yield watcher
