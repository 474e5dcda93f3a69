"""The Trio subscriber: live batches in order, gaps repaired from replay, losses reported.

`open_subscriber` checks its settings, opens the stream (`_stream`: the sockets, the tasks
and the I/O-free `Sequencer` that decides) and hands out a `Subscriber` to iterate.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Literal, final

import zmq

from tskv.core.config import MAX_MESSAGE_BYTES, SubscriberConfig
from tskv.core.delivery import MAX_SNAPSHOT_BYTES
from tskv.core.events import KVEventBatch
from tskv.core.losses import Loss
from tskv.core.sequencer import MAX_HELD
from tskv.shells._constructor import NoPublicConstructor
from tskv.shells._snapshot_parts import SnapshotParts
from tskv.shells._stream import Stream, SubscriberStatistics, open_stream

__all__ = ["Subscriber", "SubscriberStatistics", "open_subscriber"]


@final
class Subscriber(metaclass=NoPublicConstructor):
    """What `open_subscriber` yields (and only it makes one): iterate it for `(seq, batch)`."""

    def __init__(self, stream: Stream) -> None:
        self._stream = stream
        self.config = stream.config  # the settings it runs with
        self.endpoint = stream.endpoint  # as really bound, when the subscriber binds

    def statistics(self) -> SubscriberStatistics:
        return self._stream.statistics()

    def __aiter__(self) -> Subscriber:
        return self

    async def __anext__(self) -> tuple[int, KVEventBatch]:
        """The next batch. Always a cancellation point; it lets other tasks run when it must
        wait, and otherwise at least every 64 batches or 0.5 ms (`Pacer`), as
        publish() does: a schedule point per batch would cost more than decoding it."""
        while True:
            delivery = await self._stream.next_delivery()
            if delivery is None:
                raise StopAsyncIteration
            seq, batch = delivery
            if isinstance(batch, KVEventBatch):  # decoded with `codec.decode`: never a ReadBatch
                return seq, batch
            assert isinstance(batch, SnapshotParts)
            whole = await batch.whole()
            if whole is not None:  # else a part did not decode, and the loss is reported
                return seq, whole


@asynccontextmanager
async def open_subscriber(
    endpoint: str,
    replay_endpoint: str | None = None,
    topic: str = "",
    start_seq: int | Literal["snapshot"] | None = None,
    *,
    snapshots: bool = True,
    on_loss: Callable[[Loss], object] | None = None,
    replay_timeout: float = 5.0,
    hwm: int = 100_000,
    max_held: int = MAX_HELD,
    max_snapshot_bytes: int = MAX_SNAPSHOT_BYTES,
    max_message_bytes: int = MAX_MESSAGE_BYTES,
    quiet_interval: float | None = 2.0,
    on_silence: Callable[[bool], object] | None = None,
    warn_unanswered_after: float = 5.0,
    curve_server_key: str | None = None,
    curve_secret_key: str | None = None,
    context: zmq.Context[zmq.Socket[bytes]] | None = None,
) -> AsyncIterator[Subscriber]:
    """Subscribe to a KV event stream; iterate the result for `(seq, batch)` in seq order.

    Gaps are repaired from `replay_endpoint`. What cannot be repaired is never hidden: it is
    counted, logged, and passed to `on_loss(loss)` just before the next batch is delivered.
    The settings are checked as a `tskv.SubscriberConfig` before any socket opens.

    Args:
      endpoint: the publisher's PUB endpoint (a `*` in it makes this side bind).
      replay_endpoint: its replay endpoint; without one, gaps are reported, not repaired.
      topic: only batches whose topic starts with this.
      start_seq: fetch batches from this seq on from replay first (a late joiner's bootstrap);
        `"snapshot"` starts from the publisher's snapshot of its whole cache instead (one batch
        that clears, then stores every cached block); None: live only.
      snapshots: restore a hole replay can no longer fill from a snapshot, reported to `on_loss`
        with reason SNAPSHOT just before that batch (a publisher without them: EVICTED).
      on_loss: called with each `Loss`, just before the next batch is delivered.
      replay_timeout: seconds a replay request may go unanswered (or keep being refused).
      hwm: the SUB socket's receive high-water mark.
      max_held: live batches held while a gap is repaired (later ones are fetched from replay
        once it drains, or reported lost when replay has them no more).
      max_snapshot_bytes: a snapshot larger than this (its parts as they arrive) is given up,
        with a warning, and none is asked for again: a repair's hole is reported as TOO_LARGE,
        a bootstrap goes on from replay. The default, 256 MiB, is about 3.5M blocks of 16
        tokens (75 B each on the wire); decoded, a snapshot takes several times that.
      max_message_bytes: the largest message the SUB and replay sockets take (64 MiB). ZeroMQ
        drops the connection of a publisher that sends a larger one; the subscriber connects
        again, with a warning, and that batch is repaired from replay or reported lost.
      quiet_interval: with a replay endpoint, a stream quiet this long is probed (None: never):
        batches lost at the very end, and a publisher that restarted and went quiet, are found
        out; a probe unanswered for as long again means the publisher is silent.
      on_silence: called with True when the publisher goes silent, False when it answers.
      warn_unanswered_after: seconds after connecting with no publisher answering before a
        warning says so (and why, when it can tell).
      curve_server_key: an encrypted publisher's public certificate file.
      curve_secret_key: this subscriber's secret certificate file (without one, an ephemeral
        key pair is used, which a publisher that allows any client accepts).
      context: the ZeroMQ context (default: the process's).

    Raises:
      EndpointError: an endpoint is not a ZeroMQ address.
      ConfigError: a setting is out of range (a ValueError).
      ValueError: a `start_seq` without a replay endpoint to fetch it from.
      KeyFileError: a CURVE key file is missing, unreadable or not a key.
      AttachError: the SUB socket cannot bind or connect (an OSError).
    """
    config = SubscriberConfig(
        topic=topic,
        start_seq=start_seq,
        snapshots=snapshots,
        replay_timeout=replay_timeout,
        hwm=hwm,
        max_held=max_held,
        max_snapshot_bytes=max_snapshot_bytes,
        max_message_bytes=max_message_bytes,
        quiet_interval=quiet_interval,
        warn_unanswered_after=warn_unanswered_after,
        curve_server_key=curve_server_key,
        curve_secret_key=curve_secret_key,
    )
    async with open_stream(
        endpoint, replay_endpoint, config, on_loss=on_loss, on_silence=on_silence, context=context
    ) as stream:
        yield Subscriber._create(stream)
