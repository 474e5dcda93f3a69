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
from typing import Any, Literal, final

import attrs
import trio

from tskv.core.endpoints import check_endpoint
from tskv.core.events import KVEventBatch
from tskv.core.losses import Loss
from tskv.core.prefix_index import PrefixIndex, Worker
from tskv.core.worker_view import ViewChange, WorkerView
from tskv.shells._background import background_tasks
from tskv.shells._constructor import NoPublicConstructor
from tskv.shells.subscriber import open_subscriber

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


@attrs.define
class _Watched:
    """A watched worker's task state; `Watcher.status` hands out a frozen copy."""

    endpoint: str
    replay_endpoint: str | None
    scope: trio.CancelScope
    options: dict[str, Any]
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
        )


@final
class Watcher(metaclass=NoPublicConstructor):
    """What `open_watcher` yields: add and remove workers while it runs."""

    def __init__(
        self,
        index: PrefixIndex,
        nursery: trio.Nursery,
        on_loss: Callable[[Worker, Loss], object] | None,
        subscriber_options: dict[str, Any],
    ) -> None:
        if {"on_loss", "start_seq", "on_silence"} & subscriber_options.keys():
            raise TypeError(
                "the watcher sets on_loss, on_silence and start_seq itself; pass "
                "on_loss=f(worker, loss) to open_watcher instead"
            )
        self.index = index
        self._nursery = nursery
        self._on_loss = on_loss
        self._options = subscriber_options
        self._watched: dict[Worker, _Watched] = {}
        self._changed = trio.lowlevel.ParkingLot()

    def add(
        self,
        worker: Worker,
        endpoint: str,
        replay_endpoint: str | None = None,
        **subscriber_options: Any,
    ) -> None:
        """Start following `worker`'s stream; it is stale in the index until its view is whole.
        `subscriber_options` (e.g. this worker's `curve_server_key`) add to the watcher's."""
        if worker in self._watched:
            raise ValueError(f"worker {worker!r} is already watched; remove it first")
        check_endpoint(endpoint)
        if replay_endpoint is not None:
            check_endpoint(replay_endpoint)
        options = {**self._options, **subscriber_options}
        watched = _Watched(endpoint, replay_endpoint, trio.CancelScope(), options)
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
        start: Literal["snapshot"] | None = "snapshot" if watched.replay_endpoint else None

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

        async with open_subscriber(
            watched.endpoint,
            watched.replay_endpoint,
            start_seq=start,
            on_loss=on_loss,
            on_silence=on_silence,
            **watched.options,
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


@asynccontextmanager
async def open_watcher(
    index: PrefixIndex,
    *,
    on_loss: Callable[[Worker, Loss], object] | None = None,
    **subscriber_options: Any,
) -> AsyncIterator[Watcher]:
    """Keep `index` current from the workers added to the yielded `Watcher`, until the block
    ends. `on_loss(worker, loss)` hears every loss report; `subscriber_options` go to every
    `open_subscriber` (e.g. `replay_timeout`, the CURVE keys, `context`)."""
    async with background_tasks() as nursery:
        yield Watcher._create(index, nursery, on_loss, subscriber_options)
