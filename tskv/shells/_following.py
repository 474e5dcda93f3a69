"""Following one worker's stream for a watcher, wherever the watcher keeps its record.

The loop opens the worker's stream (`_stream`, as a subscriber does: from the worker's snapshot
when it has a replay endpoint), hands every batch, loss and silence to a `Record`, and opens it
again with a backoff when it fails; while it waits with nothing queued, the watcher's pump
applies a live batch in its stead (`deliver_now`). The record is the watcher itself; in a
reader process, an outbox that tells that process's own watcher and then sends the worker's
new state to the index's process.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Protocol, cast

import attrs
import trio
import zmq

from tskv.core.actions import Deliver
from tskv.core.backoff import Backoff
from tskv.core.config import SubscriberConfig
from tskv.core.events import KVEventBatch
from tskv.core.losses import Loss
from tskv.core.prefix_index import BlockIndex, Worker
from tskv.core.read_batch import ReadBatch, reader
from tskv.shells._live_pump import LivePump
from tskv.shells._snapshot_parts import SnapshotParts
from tskv.shells._stream import Stream, open_stream

RETRY_BACKOFF = (0.5, 10.0)  # first and longest wait before a failed worker is tried again
SNAPSHOTS_AT_ONCE = 4  # workers of one process bootstrapping from a snapshot at a time


class Bootstraps:
    """Turns for bootstrapping from a snapshot: at most `limit` workers in this process at once.

    A snapshot of 50,000 blocks is about 0.2 s of CPU and 3 MB of payloads until it is
    applied; 64 at once took longer in all, and held all of them at once. A turn ends with
    the worker's first batch, a loss or silence report, or its subscriber's end, and lapses
    after `longest` seconds, so a publisher that never answers holds no one up for long.
    """

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._ends: dict[object, float] = {}  # turn -> when it lapses
        self._lot = trio.lowlevel.ParkingLot()

    async def take(self, turn: object, longest: float) -> None:
        while True:
            now = trio.current_time()
            for other, end in list(self._ends.items()):
                if end <= now:
                    del self._ends[other]
            if len(self._ends) < self._limit:
                self._ends[turn] = now + longest
                return
            with trio.move_on_at(min(self._ends.values())):
                await self._lot.park()

    def done(self, turn: object) -> None:
        if self._ends.pop(turn, None) is not None:
            self._lot.unpark()


class Record(Protocol):
    """Where a followed worker's news goes."""

    index: BlockIndex  # what its batches are filed in

    def watching(self, worker: Worker) -> bool: ...

    async def room(self) -> None:
        """Return when the record can take another batch (a reader's outbox may be full)."""

    def has_room(self) -> bool:
        """Whether `room` would return at once."""

    def applied(self, worker: Worker, seq: int, batch: KVEventBatch | ReadBatch) -> None: ...

    async def restored(self, worker: Worker, seq: int, snapshot: SnapshotParts) -> None:
        """Apply a snapshot part by part as `snapshot` decodes them."""

    def lost(self, worker: Worker, loss: Loss) -> None: ...

    def silence(self, worker: Worker, silent: bool) -> None: ...

    def synced(self, worker: Worker) -> None:
        """Its stream, read from its start, holds nothing: its cache is known to be empty."""

    def failed(self, worker: Worker, error: str, retry_in: float) -> None: ...

    def resubscribed(self, worker: Worker) -> None: ...


@attrs.frozen(eq=False)  # a turn is itself, for `Bootstraps`
class _Turn:
    """One subscription of a worker: its news goes to the record, and the first of it (a
    batch, a loss, a silence) ends the worker's turn to bootstrap."""

    record: Record
    worker: Worker
    bootstraps: Bootstraps

    def lost(self, loss: Loss) -> None:
        self.bootstraps.done(self)
        self.record.lost(self.worker, loss)

    def silence(self, silent: bool) -> None:
        self.bootstraps.done(self)
        self.record.silence(self.worker, silent)

    def synced(self) -> None:
        self.bootstraps.done(self)
        self.record.synced(self.worker)

    def applied(self, seq: int, batch: KVEventBatch | ReadBatch) -> None:
        """A live batch the pump delivered in the follower's stead."""
        self.bootstraps.done(self)
        self.record.applied(self.worker, seq, batch)


def deliver_now(
    stream: Stream, has_room: Callable[[], bool], turn: _Turn, messages: list[list[bytes]]
) -> bool | None:
    """The pump's way in, for a follower parked on an empty inbox: live `messages` sequenced
    and their batches applied here and now, where the follower would have been woken to do the
    same (a task switch a batch). False when something is left for the follower (news other
    than a batch, or no room): the pump wakes it. None, doing nothing, when there is no room to
    begin with."""
    if not has_room():
        return None
    stream.take_live(messages)
    ready = stream.ready
    while ready and type(ready[0]) is Deliver and has_room():
        item = cast(Deliver, ready.popleft())
        batch = stream.decoded(item)
        if batch is not None:
            turn.applied(item.seq, batch)
    return not ready


@trio.lowlevel.enable_ki_protection  # Ctrl-C belongs to the caller's code
async def follow(
    record: Record,
    worker: Worker,
    endpoint: str,
    replay_endpoint: str | None,
    config: SubscriberConfig,
    context: zmq.Context[zmq.Socket[bytes]] | None,
    bootstraps: Bootstraps,
    pump: LivePump | None = None,  # the watcher's, to read the live socket with the others'
) -> None:
    """Follow `worker` until cancelled, or until a failure finds it no longer watched."""
    backoff = Backoff(*RETRY_BACKOFF)
    read = reader(record.index.block_size)  # plain batches filed without making their events
    while True:
        turn = _Turn(record, worker, bootstraps)
        try:
            if config.start_seq == "snapshot":
                await bootstraps.take(turn, 2 * config.replay_timeout)
            async with open_stream(
                endpoint, replay_endpoint, config, on_loss=turn.lost, on_silence=turn.silence,
                on_synced=turn.synced, context=context, pump=pump, read=read,
            ) as stream:  # fmt: skip
                if stream.feed is not None:  # the pump may apply a live batch in our stead
                    stream.feed.inline = partial(deliver_now, stream, record.has_room, turn)
                while (delivery := await stream.next_delivery()) is not None:
                    bootstraps.done(turn)
                    await record.room()
                    seq, batch = delivery
                    if isinstance(batch, SnapshotParts):
                        await record.restored(worker, seq, batch)
                    else:
                        record.applied(worker, seq, batch)
                    # Not kept while waiting for the next: many quiet workers' last batches
                    # would add up, and a snapshot's payloads are MBs.
                    del delivery, batch
        except Exception as exc:  # one worker's failure is its own
            wait = backoff.next()
            record.failed(worker, f"{type(exc).__name__}: {exc}", wait)
        else:
            wait = backoff.next()  # the subscriber ended (its channel closed): again, later
        finally:
            bootstraps.done(turn)
        if not record.watching(worker):
            return
        record.resubscribed(worker)
        await trio.sleep(wait)
