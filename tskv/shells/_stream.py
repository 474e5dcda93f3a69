"""One publisher's stream, sockets to ordered batches: what the public `Subscriber` and a
watcher's followers share.

Two tasks move bytes (one owns the SUB socket, one the DEALER replay socket) into one inbox
(a watcher's streams share one task over all their SUB sockets, `_live_pump`, which also does
a waiting follower's part for a live batch); the consumer's own task feeds the inbox to the
I/O-free `Sequencer` and delivers what it says, so a consumer that stops reading makes the SUB
fall behind, and ZeroMQ's high-water mark, not unbounded memory, takes the strain (the gap is
then repaired from replay).
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import final

import attrs
import trio
import zmq

from tskv.core import frames
from tskv.core.actions import (
    Action,
    Deliver,
    DeliverSnapshot,
    RequestReplay,
    Silence,
    SnapshotTooLarge,
    Synced,
)
from tskv.core.codec import WireError, decode
from tskv.core.config import SubscriberConfig
from tskv.core.endpoints import check_endpoint, should_bind
from tskv.core.errors import HandshakeError
from tskv.core.events import KVEventBatch
from tskv.core.losses import Loss, LossCounts, LossReason
from tskv.core.read_batch import ReadBatch, Reader
from tskv.core.sequencer import Sequencer
from tskv.curve.security import ClientSecurity
from tskv.shells._background import Pacer, background_tasks
from tskv.shells._inbox import (
    BadFrames,
    Connection,
    HandshakeRefused,
    Inbound,
    Live,
    Quiet,
    Replayed,
    ReplayFailed,
    Request,
    SnapshotPart,
)
from tskv.shells._live_pump import Clock, Feed, LivePump, read_alone
from tskv.shells._monitor import SocketMonitor
from tskv.shells._ratelimit import LogLimiter
from tskv.shells._reachability import warn_if_unanswered
from tskv.shells._replay_client import ReplayClient
from tskv.shells._snapshot_parts import SnapshotParts
from tskv.shells._subscriber_sockets import open_sub, replay_client
from tskv.shells._unknown_events import UnknownEvents

# the subscriber's name: its log lines are a subscriber's, whichever reads the stream
logger = logging.getLogger("tskv.shells.subscriber")

INBOX_SIZE = 4  # items in the inbox; a live item holds up to LIVE_BURST messages


@attrs.frozen
class SubscriberStatistics:
    """A subscriber's counts at one moment (`Subscriber.statistics()`), frozen so a caller can
    keep and compare them."""

    received: int  # live messages taken off the SUB socket
    delivered: int  # batches handed to the consumer
    repaired: int  # of those, how many replay gave to fill a hole (not a start_seq start)
    lost: int  # seqs reported lost (a restart's unknown count is not included)
    replaced: int  # seqs not delivered one by one but restored by a snapshot (not in `lost`)
    snapshots: int  # snapshots delivered, a bootstrap's included
    losses: int  # loss reports, restarts included
    restarts: int
    undecodable: int
    unknown_events: int  # events of a type tskv does not know, delivered as UnknownEvent
    replay_requests: int
    replay_refusals: int  # requests the publisher refused (its limits) and this side retried
    held: int  # live batches held right now while a gap is repaired (at most max_held)
    handshakes: int  # connections whose ZeroMQ (and CURVE) handshake succeeded
    handshake_failures: int  # connections whose handshake failed: wrong keys, clear text
    probes: int  # replay requests made because the stream was quiet (in `replay_requests`)
    silences: int  # times the publisher stopped answering a probe (it answers again: `silent`)
    silent: bool  # the publisher is silent right now: its view is not to be trusted


@attrs.define
class SubscriberCounts:
    """A subscriber's running counts, in the one object every count changes in, which
    `statistics()` freezes with what is read live (as trio's MemoryChannelState is kept)."""

    received: int = 0
    delivered: int = 0
    repaired: int = 0
    snapshots: int = 0
    undecodable: int = 0
    replay_requests: int = 0
    probes: int = 0
    silences: int = 0
    losses: LossCounts = attrs.Factory(LossCounts)
    unknown: UnknownEvents = attrs.Factory(UnknownEvents)

    def frozen(
        self,
        *,
        replay_refusals: int,
        held: int,
        handshakes: int,
        handshake_failures: int,
        silent: bool,
    ) -> SubscriberStatistics:
        """These counts, with the figures read at the moment, frozen."""
        losses = self.losses
        return SubscriberStatistics(
            received=self.received,
            delivered=self.delivered,
            repaired=self.repaired,
            lost=losses.lost,
            replaced=losses.replaced,
            snapshots=self.snapshots,
            losses=losses.losses,
            restarts=losses.restarts,
            undecodable=self.undecodable,
            unknown_events=self.unknown.count,
            replay_requests=self.replay_requests,
            probes=self.probes,
            silences=self.silences,
            replay_refusals=replay_refusals,
            held=held,
            handshakes=handshakes,
            handshake_failures=handshake_failures,
            silent=silent,
        )


Delivery = tuple[int, KVEventBatch | ReadBatch | SnapshotParts]  # a seq, and what came with it


@final
class Stream:
    """One publisher's stream as the I/O-free `Sequencer` orders it, from what the socket tasks
    put in its inbox: what `Subscriber` iterates, and a watcher's follower reads one batch (or a
    snapshot's parts) at a time. It decides nothing itself; it moves items between the inbox,
    the sequencer, the replay requests and its consumer, counting them."""

    def __init__(
        self,
        config: SubscriberConfig,
        sequencer: Sequencer,
        inbox: trio.abc.ReceiveChannel[Inbound],
        requests: trio.MemorySendChannel[Request],
        on_loss: Callable[[Loss], object] | None,
        endpoint: str,
        monitors: list[SocketMonitor],
        replay: ReplayClient | None,
        on_silence: Callable[[bool], object] | None = None,
        on_synced: Callable[[], object] | None = None,
        read: Reader = decode,
    ) -> None:
        self.config = config  # the settings it runs with
        self.endpoint = endpoint  # as really bound, when the subscriber binds
        self._monitors = monitors
        self._replay = replay
        self._sequencer = sequencer
        self._inbox = inbox
        self._requests = requests
        self._on_loss = on_loss
        self._on_silence = on_silence
        self._on_synced = on_synced
        self.ready: deque[Deliver | DeliverSnapshot | Loss | Silence | Synced] = deque()
        self._bad_log = LogLimiter(interval=1.0)
        self._counts = SubscriberCounts()
        self._pacer = Pacer()
        self._read = read  # a watcher's reads plain batches without making their events
        self.feed: Feed | None = None  # a watcher's pump's end for this stream, if it has one

    def statistics(self) -> SubscriberStatistics:
        return self._counts.frozen(
            replay_refusals=0 if self._replay is None else self._replay.refusals,
            held=len(self._sequencer.order.pending),
            handshakes=sum(monitor.handshakes for monitor in self._monitors),
            handshake_failures=sum(monitor.handshake_failures for monitor in self._monitors),
            silent=self._sequencer.silent,
        )

    async def next_delivery(self) -> Delivery | None:
        """The next batch, or a snapshot as its parts, to decode one at a time; None at the
        end. Always a cancellation point; it lets other tasks run when it must wait, and
        otherwise at least every 64 batches or 0.5 ms (`Pacer`), as publish() does: a schedule
        point per batch would cost more than decoding it."""
        await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            while self.ready:
                item = self.ready.popleft()
                if isinstance(item, Loss):
                    self._report(item)
                    continue
                if isinstance(item, Silence):
                    self._report_silence(item)
                    continue
                if isinstance(item, Synced):
                    if self._on_synced is not None:
                        self._on_synced()
                    continue
                if isinstance(item, DeliverSnapshot):
                    return item.seq, self._snapshot_parts(item)
                batch = self.decoded(item)
                if batch is None:
                    continue
                if self._pacer.due():
                    await self._pacer.yield_now()
                return item.seq, batch
            try:
                inbound = await self._inbox.receive()
            except (trio.EndOfChannel, trio.ClosedResourceError):
                return None
            self._pacer.waited()
            if isinstance(inbound, Live):
                for message in inbound.messages:
                    self._apply(self._take_live(message))
            elif isinstance(inbound, HandshakeRefused):
                raise HandshakeError(inbound.message)
            else:
                self._apply(self._feed(inbound))

    def decoded(self, item: Deliver) -> KVEventBatch | ReadBatch | None:
        """The batch `item` carries, counted; None if it does not decode (reported lost).
        Decoded only when delivered, one at a time: a burst decoded ahead would keep thousands
        of lists alive for the garbage collector to walk again and again."""
        try:
            batch, unknown = self._read(item.payload)
        except WireError as exc:
            self._counts.undecodable += 1
            self._bad_log.warning("batch %d does not decode: %s", item.seq, exc)
            self._report(Loss(item.seq, item.seq, LossReason.UNDECODABLE))
            return None
        if unknown:
            self._counts.unknown.note(item.seq, batch)
        self._counts.delivered += 1
        self._counts.repaired += item.repaired
        return batch

    def take_started(self) -> None:
        """What the sequencer does first (a bootstrap's replay or snapshot request)."""
        self._apply(self._sequencer.start())

    def take_live(self, messages: list[list[bytes]]) -> None:
        """Sequence live `messages` the pump read in the consumer's stead."""
        for message in messages:
            self._apply(self._take_live(message))

    def _snapshot_parts(self, item: DeliverSnapshot) -> SnapshotParts:
        """The snapshot's parts; once the last decodes, the batches it replaces are reported
        (and if one does not, everything up to its seq is)."""

        def failed(exc: WireError) -> None:
            self._counts.undecodable += 1
            self._bad_log.warning("snapshot after seq %d does not decode: %s", item.seq, exc)
            start = 0 if item.replaced is None else item.replaced
            self._report(Loss(start, item.seq, LossReason.UNDECODABLE))

        def completed() -> None:
            if item.replaced is not None:
                self._report(Loss(item.replaced, item.seq, LossReason.SNAPSHOT))
            self._counts.snapshots += 1
            self._counts.delivered += 1

        return SnapshotParts(item.payloads, self._pacer, failed, completed, self._read)

    def _take_live(self, message: list[bytes]) -> list[Action]:
        self._counts.received += 1
        try:
            _, seq, payload = frames.parse_live_message(message)
        except frames.FrameError as exc:
            return self._feed(BadFrames(str(exc)))
        return self._sequencer.live(seq, payload)

    def _feed(
        self,
        inbound: Replayed | SnapshotPart | ReplayFailed | BadFrames | Quiet | Connection,
    ) -> list[Action]:
        if isinstance(inbound, SnapshotPart):
            part = inbound.part
            return self._sequencer.snapshot_part(
                inbound.request_id, part.next_seq, part.index, part.payload
            )
        if isinstance(inbound, Replayed):
            if inbound.reply.is_end:
                return self._sequencer.replay_ended(inbound.request_id, inbound.reply.epoch)
            return self._sequencer.replayed(
                inbound.request_id, inbound.reply.seq, inbound.reply.payload
            )
        if isinstance(inbound, ReplayFailed):
            return self._sequencer.replay_failed(inbound.request_id, inbound.reason)
        if isinstance(inbound, Quiet):
            return self._sequencer.quiet()
        if isinstance(inbound, Connection):
            if inbound.up:
                return self._sequencer.reconnected()
            return self._sequencer.disconnected()
        self._counts.undecodable += 1
        self._bad_log.warning("ignoring a message that is not a KV event batch: %s", inbound.error)
        return []

    def _apply(self, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, (Deliver, DeliverSnapshot, Loss, Silence, Synced)):
                self.ready.append(action)
            elif isinstance(action, SnapshotTooLarge):
                _log_too_large(self.endpoint, self.config.max_snapshot_bytes, action.size)
            else:
                self._counts.replay_requests += 1
                self._counts.probes += isinstance(action, RequestReplay) and action.probe
                if self._replay is not None:
                    self._replay.supersede()  # a new request replaces the one under way
                self._requests.send_nowait(action)  # unbounded: at most one per gap or quiet

    def _report_silence(self, silence: Silence) -> None:
        self._counts.silences += silence.silent
        _log_silence(self.endpoint, silence)
        if self._on_silence is not None:
            self._on_silence(silence.silent)

    def _report(self, loss: Loss) -> None:
        self._counts.losses.add(loss)
        logger.warning("%s (%s)", loss.describe(), self.endpoint)
        if self._on_loss is not None:
            self._on_loss(loss)


def _log_too_large(endpoint: str, limit: int, size: int) -> None:
    logger.warning(
        "the snapshot from %s is over max_snapshot_bytes = %d (%d bytes so far): given up, and "
        "no more are asked for (what they would restore is reported lost); raise "
        "max_snapshot_bytes if the publisher's cache is that large",
        endpoint,
        limit,
        size,
    )


def _log_silence(endpoint: str, silence: Silence) -> None:
    if not silence.silent:
        logger.warning("the publisher on %s answers again", endpoint)
        return
    logger.warning(
        "the publisher on %s %s %s: it may be gone (its view is not to be trusted until it "
        "answers again)",
        endpoint,
        "dropped its connection" if silence.disconnected else "did not answer a probe",
        "before its first batch" if silence.last_seq is None else f"after seq {silence.last_seq}",
    )


@trio.lowlevel.enable_ki_protection  # Ctrl-C belongs to the caller's code, not here
async def _probe_when_quiet(
    live: Clock, interval: float, inbox: trio.MemorySendChannel[Inbound]
) -> None:
    """Say when the live stream has been quiet for `interval`, and again each interval it stays
    so: the sequencer then asks replay what it missed. A busy stream costs one clock read per
    burst (in the reader) and a wake-up per interval here."""
    while True:
        await trio.sleep_until(live.heard + interval)
        if trio.current_time() >= live.heard + interval:
            live.heard = trio.current_time()  # the next probe one interval after this one
            await inbox.send(Quiet())


@asynccontextmanager
async def open_stream(
    endpoint: str,
    replay_endpoint: str | None,
    config: SubscriberConfig,
    *,
    on_loss: Callable[[Loss], object] | None = None,
    on_silence: Callable[[bool], object] | None = None,
    on_synced: Callable[[], object] | None = None,
    context: zmq.Context[zmq.Socket[bytes]] | None = None,
    pump: LivePump | None = None,
    read: Reader = decode,
) -> AsyncIterator[Stream]:
    """The sockets and tasks of one publisher's stream, its settings checked already as a
    `SubscriberConfig`. `on_synced()` is called when the stream, read from its start, turns
    out to hold nothing (the publisher's cache is empty). With a `pump` (a watcher's), the SUB
    socket is read there with the other workers' sockets (`Stream.feed`); `read` decodes its
    payloads (a watcher's: `read_batch.reader`)."""
    check_endpoint(endpoint)
    if replay_endpoint is not None:
        check_endpoint(replay_endpoint)
    security = None
    if config.curve_server_key is not None:
        security = ClientSecurity.from_files(config.curve_server_key, config.curve_secret_key)
    sequencer = _sequencer(config, replay_endpoint is not None)
    context = context or zmq.Context.instance()
    binds = should_bind(endpoint, subscriber=True)
    inbox_send, inbox_receive = trio.open_memory_channel[Inbound](INBOX_SIZE)
    sub, monitor, address = open_sub(context, endpoint, binds, config, security, inbox_send)
    requests_send, requests_receive = trio.open_memory_channel[Request](math.inf)
    replay: ReplayClient | None = None
    live = Clock()
    feed: Feed | None = None
    try:
        if pump is not None:
            feed = pump.add(sub, (inbox_send, inbox_receive), live)
        if replay_endpoint is not None:
            replay = replay_client(context, replay_endpoint, config, inbox_send, security)
        stream = Stream(
            config, sequencer, feed or inbox_receive, requests_send, on_loss, address, [monitor],
            replay, on_silence, on_synced, read,
        )  # fmt: skip
        stream.feed = feed
        stream.take_started()
        async with background_tasks() as nursery:
            nursery.start_soon(monitor.run)
            if not binds:
                after = config.warn_unanswered_after
                nursery.start_soon(warn_if_unanswered, endpoint, monitor, after)
            if feed is None:
                nursery.start_soon(read_alone, sub, inbox_send, live)
            if replay is not None:
                nursery.start_soon(replay.run, requests_receive)
                if config.quiet_interval is not None:
                    interval = config.quiet_interval
                    nursery.start_soon(_probe_when_quiet, live, interval, inbox_send)
            yield stream
    finally:
        if feed is not None:
            feed.close()  # out of the pump before its socket closes
        monitor.close()
        sub.close()
        if replay is not None:
            replay.close()


def _sequencer(config: SubscriberConfig, has_replay: bool) -> Sequencer:
    return Sequencer(
        has_replay,
        config.start_seq,
        snapshots=config.snapshots,
        max_held=config.max_held,
        max_snapshot_bytes=config.max_snapshot_bytes,
    )
