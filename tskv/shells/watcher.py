"""Keeping a PrefixIndex current from many workers' streams, in Trio.

One task per worker runs an `open_subscriber` (bootstrapping from the worker's snapshot when it
has a replay endpoint) and applies every batch to the shared index. The index is told, per
worker, when its view stops being complete (a loss was reported, or the worker went silent: its
quiet stream's probe went unanswered) and when it is complete again (a snapshot or a cache
reset was applied, the stream was followed from its seq 0, or a silent worker answered with
nothing lost), so a router can see which answers not to trust. A worker's failure (its
endpoint unreachable, its subscriber raising) is logged, marks it stale, and is retried with a
backoff; it never stops the other workers. Workers come and go while it runs.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, final

import attrs
import trio
import zmq

from tskv.core.config import SubscriberConfig
from tskv.core.endpoints import check_endpoint
from tskv.core.events import KVEventBatch
from tskv.core.losses import Loss
from tskv.core.prefix_index import PrefixIndex, Worker
from tskv.core.worker_view import ViewChange, WorkerView
from tskv.shells._background import background_tasks
from tskv.shells._constructor import NoPublicConstructor
from tskv.shells.subscriber import subscribe

logger = logging.getLogger(__name__)

RETRY_BACKOFF = (0.5, 10.0)  # first and longest wait before a failed worker is tried again


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
    view: WorkerView = attrs.Factory(WorkerView)
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
    ) -> None:
        self.index = index
        self._nursery = nursery
        self._on_loss = on_loss
        self.config = config  # every worker's subscriber settings, less what `add` changes
        self._context = context
        self._watched: dict[Worker, _Watched] = {}
        self._changed = trio.lowlevel.ParkingLot()

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
        watched = _Watched(endpoint, replay_endpoint, trio.CancelScope(), config)
        self._watched[worker] = watched
        self.index.mark_stale(worker)
        self._nursery.start_soon(self._follow, worker, watched)

    def remove(self, worker: Worker) -> None:
        """Stop following `worker` and drop it from the index."""
        watched = self._watched.pop(worker, None)
        if watched is not None:
            watched.scope.cancel()
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

    async def wait_for_seq(self, worker: Worker, seq: int) -> None:
        """Wait until `worker`'s batch `seq` (or a later one) has been applied to the index."""
        while True:
            last = self._watched[worker].last_seq
            if last is not None and last >= seq:
                return
            await self._changed.park()

    async def wait_for_loss(self, worker: Worker, count: int = 1) -> None:
        """Wait until `count` losses of `worker` have been reported."""
        while self._watched[worker].losses < count:
            await self._changed.park()

    async def wait_for_silence(self, worker: Worker, silent: bool = True) -> None:
        """Wait until `worker`'s publisher is silent (or, with `silent=False`, answers)."""
        while self._watched[worker].silent != silent:
            await self._changed.park()

    @trio.lowlevel.enable_ki_protection  # Ctrl-C belongs to the caller's code
    async def _follow(self, worker: Worker, watched: _Watched) -> None:
        backoff, longest = RETRY_BACKOFF
        with watched.scope:
            while True:
                try:
                    await self._subscribe(worker, watched)
                except Exception as exc:  # one worker's failure is its own
                    watched.failures += 1
                    watched.last_error = f"{type(exc).__name__}: {exc}"
                    logger.warning(
                        "watching %r on %s failed (%s); trying again in %.1f s",
                        worker,
                        watched.endpoint,
                        watched.last_error,
                        backoff,
                    )
                if worker not in self._watched:
                    return
                self._change(worker, watched.view.resubscribed())
                await trio.sleep(backoff)
                backoff = min(backoff * 2, longest)

    async def _subscribe(self, worker: Worker, watched: _Watched) -> None:

        def on_loss(loss: Loss) -> None:
            watched.losses += 1
            self._changed.unpark_all()
            if worker not in self._watched:
                return
            if self._on_loss is not None:
                self._on_loss(worker, loss)
            self._change(worker, watched.view.lost(loss))

        def on_silence(silent: bool) -> None:
            watched.silent = silent
            self._changed.unpark_all()
            if worker not in self._watched:
                return
            self._change(worker, watched.view.silence(silent, worker in self.index.stale))

        async with subscribe(
            watched.endpoint,
            watched.replay_endpoint,
            watched.config,
            on_loss=on_loss,
            on_silence=on_silence,
            context=self._context,
        ) as sub:
            async for seq, batch in sub:
                self._apply(worker, watched, seq, batch)

    def _apply(self, worker: Worker, watched: _Watched, seq: int, batch: KVEventBatch) -> None:
        if worker not in self._watched:
            return  # removed while this batch was on its way
        self.index.apply(worker, batch)  # an AllBlocksCleared in it makes the view whole
        if watched.view.from_start:
            self._change(worker, watched.view.delivered(seq))
        watched.batches += 1
        watched.last_seq = seq
        self._changed.unpark_all()


WATCHER_SETS = frozenset({"start_seq", "on_loss", "on_silence"})


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
    **subscriber_settings: Any,
) -> AsyncIterator[Watcher]:
    """Keep `index` current from the workers added to the yielded `Watcher`, until the block
    ends.

    Args:
      index: the `PrefixIndex` to keep current; each worker's view is marked stale while it
        cannot be vouched for.
      on_loss: called as `on_loss(worker, loss)` for every loss report.
      context: the ZeroMQ context every worker's subscriber uses.
      **subscriber_settings: `SubscriberConfig` settings for every worker's subscriber (e.g.
        `replay_timeout`, `quiet_interval`, the CURVE keys); `Watcher.add` may change them for
        one worker. The watcher starts each worker from its snapshot itself (`start_seq`) and
        sets `on_loss` and `on_silence` itself.

    Raises:
      TypeError: a setting that is not a subscriber setting (the closest one is named), or one
        the watcher sets itself.
      ConfigError: a setting out of range (a ValueError).
    """
    config = _changed(SubscriberConfig(), subscriber_settings)
    async with background_tasks() as nursery:
        yield Watcher._create(index, nursery, on_loss, config, context)
