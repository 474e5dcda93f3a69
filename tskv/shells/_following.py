"""Following one worker's stream for a watcher, wherever the watcher keeps its record.

The loop subscribes (from the worker's snapshot when it has a replay endpoint), hands every
batch, loss and silence to a `Record`, and subscribes again with a backoff when its subscriber
fails. The record is the watcher itself; in a reader process, an outbox that tells that
process's own watcher and then sends the worker's new state to the index's process.
"""

from __future__ import annotations

from typing import Protocol

import trio
import zmq

from tskv.core.config import SubscriberConfig
from tskv.core.events import KVEventBatch
from tskv.core.losses import Loss
from tskv.core.prefix_index import Worker
from tskv.shells.subscriber import subscribe

RETRY_BACKOFF = (0.5, 10.0)  # first and longest wait before a failed worker is tried again


class Record(Protocol):
    """Where a followed worker's news goes."""

    def watching(self, worker: Worker) -> bool: ...

    async def room(self) -> None:
        """Return when the record can take another batch (a reader's outbox may be full)."""

    def applied(self, worker: Worker, seq: int, batch: KVEventBatch) -> None: ...

    def lost(self, worker: Worker, loss: Loss) -> None: ...

    def silence(self, worker: Worker, silent: bool) -> None: ...

    def failed(self, worker: Worker, error: str, retry_in: float) -> None: ...

    def resubscribed(self, worker: Worker) -> None: ...


@trio.lowlevel.enable_ki_protection  # Ctrl-C belongs to the caller's code
async def follow(
    record: Record,
    worker: Worker,
    endpoint: str,
    replay_endpoint: str | None,
    config: SubscriberConfig,
    context: zmq.Context[zmq.Socket[bytes]] | None,
) -> None:
    """Follow `worker` until cancelled, or until a failure finds it no longer watched."""
    backoff, longest = RETRY_BACKOFF
    while True:
        try:
            async with subscribe(
                endpoint,
                replay_endpoint,
                config,
                on_loss=lambda loss: record.lost(worker, loss),
                on_silence=lambda silent: record.silence(worker, silent),
                context=context,
            ) as sub:
                async for seq, batch in sub:
                    await record.room()
                    record.applied(worker, seq, batch)
        except Exception as exc:  # one worker's failure is its own
            record.failed(worker, f"{type(exc).__name__}: {exc}", backoff)
        if not record.watching(worker):
            return
        record.resubscribed(worker)
        await trio.sleep(backoff)
        backoff = min(backoff * 2, longest)
