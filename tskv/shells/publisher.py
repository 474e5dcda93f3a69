"""The Trio publisher: a publish task and a replay task in one nursery, sharing a bounded queue.

`publish()` stamps and encodes a round and puts the payload in a memory channel of
`max_queue_size`; the publish task owns the PUB socket, assigns seqs, keeps each payload in the
replay buffer before sending it, and sends every queued batch it can between checkpoints. The
replay task owns the ROUTER socket and carries out what the I/O-free `ReplayServer` decides, a
bounded amount of work between checkpoints, so no client can hold up live batches. Leaving the
block drains the queue under a deadline.

Every background task is protected from KeyboardInterrupt, so Ctrl-C lands in the caller's
code, whose leaving the block then gets the same bounded drain as any other exit.
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager

import attrs
import trio
import zmq

from tskv.core import frames
from tskv.core.codec import DroppedFields, codec_name, encode_round
from tskv.core.config import KVEventsConfig
from tskv.core.endpoints import offset_endpoint_port
from tskv.core.errors import TskvError
from tskv.core.events import EVENT_TYPES, KVEvent
from tskv.core.replay_buffer import ReplayBuffer
from tskv.core.replay_limits import Peer
from tskv.core.replay_server import Outcome, Received, ReplayServer
from tskv.core.snapshot import CacheState, SnapshotBuilder
from tskv.curve.policy import warn_if_exposed
from tskv.curve.security import server_security
from tskv.shells._background import Pacer, background_tasks
from tskv.shells._constructor import NoPublicConstructor
from tskv.shells._monitor import SocketMonitor
from tskv.shells._ratelimit import LogLimiter
from tskv.shells._trio_zmq import TrioSocket, open_socket
from tskv.shells._zap import ZapHandler

logger = logging.getLogger(__name__)

Queued = tuple[bytes, Sequence[KVEvent]]  # a batch's payload, and its events for the state
SEND_BURST = 1024  # batches sent between two checkpoints of the publish task
REQUESTS_PER_TURN = 64  # replay requests read between two checkpoints of the replay task...
SENDS_PER_TURN = 256  # ...and replies sent: a flood of either cannot hold up live batches
SUBSCRIPTIONS_PER_TURN = 1024  # (un)subscriptions counted at once; the rest wait a turn
REPLAY_PIPE = 128  # replies ZeroMQ queues per replay client, whatever `hwm` is
MAX_SUBSCRIPTION_BYTES = 4096  # a larger subscription frame disconnects its sender
ZERO_COPY_BYTES = 65536  # pyzmq copies smaller frames anyway; zero-copy pays above this
CURVE_HINT = (
    "a subscriber needs this publisher's public key (curve_server_key) and, with "
    "curve_clients, a key on the allow list; a clear-text subscriber cannot connect"
)
CLEAR_HINT = "this publisher speaks clear text: a subscriber given curve_server_key cannot connect"


class PublisherClosedError(TskvError, trio.ClosedResourceError, RuntimeError):
    """publish() after the publisher's `async with` block was left (or after shutdown()). A
    RuntimeError too, as TokenSpeed's publisher raises."""


@attrs.frozen
class PublisherStatistics:
    """What the publisher has done so far. Every accepted batch is accounted for:
    accepted == published + queued + unsent_at_shutdown."""

    codec: str
    accepted: int
    queued: int
    published: int
    unsent_at_shutdown: int
    oldest_seq: int | None
    next_seq: int
    replay_requests: int
    replays_completed: int
    replays_abandoned: int
    replays_refused: int
    replays_superseded: int  # ended by the same client's next request
    replays_running: int  # requests == refused + completed + abandoned + superseded + running
    batches_replayed: int
    invalid_requests: int
    subscriptions: int
    encrypted: bool
    clients_refused: int  # by the CURVE allow list
    handshakes: int  # connections whose ZeroMQ (and CURVE) handshake succeeded
    handshake_failures: int  # connections whose handshake failed: a wrong key, clear text
    events_with_dropped_fields: int  # optional fields the tokenspeed wire has no slot for
    snapshot_requests: int  # of replay_requests, how many asked for a snapshot
    snapshots_served: int  # sent whole (counted in replays_completed too)
    snapshot_parts: int
    cached_blocks: int | None  # the blocks the stream says are cached; None: snapshots off


class Publisher(metaclass=NoPublicConstructor):
    """What `open_publisher` yields; only `open_publisher` makes one."""

    def __init__(
        self,
        config: KVEventsConfig,
        dp_rank: int,
        pub: TrioSocket,
        endpoint: str,
        replay: tuple[TrioSocket, str, ReplayServer] | None,
        buffer: ReplayBuffer,
        state: CacheState | None,
        monitors: list[SocketMonitor],
        zap: ZapHandler | None,
        on_dequeue: Callable[[], object] | None,
    ) -> None:
        self.config = config
        self.dp_rank = dp_rank
        self.endpoint = endpoint
        self.replay_endpoint = None if replay is None else replay[1]
        self._pub = pub
        self._replay = replay
        self._buffer = buffer
        self._state = state  # what snapshots are made from; None when they are off
        self._monitors = monitors
        self._zap = zap
        self._on_dequeue = on_dequeue  # the threaded facade counts its slots with it
        self._topic = config.topic.encode()
        self._dropped = DroppedFields()
        self._send, self._receive = trio.open_memory_channel[Queued](config.max_queue_size)
        self._invalid_log = LogLimiter()
        self._refusal_log = LogLimiter()
        self._accepted = 0
        self._published = 0
        self._unsent = 0
        self._pacer = Pacer()
        self._subscriptions = 0
        self._subscription_change = trio.lowlevel.ParkingLot()
        self._in_hand: list[Queued | None] = []  # what the idle race has taken off the queue
        # Shielded so the queue still drains when the caller's scope is cancelled; its deadline
        # is set when the block is left, which bounds the drain.
        self._publish_scope = trio.CancelScope(shield=True)

    # -- the scheduler's side ---------------------------------------------------------------

    def _encode(self, events: Iterable[KVEvent]) -> Queued | None:
        config = self.config
        if type(events) is not list and type(events) is not tuple:
            events = _listed(events)  # a generator, say: the state needs the events too
        payload = encode_round(
            time.time(),
            events,
            self.dp_rank,
            config.wire_format,
            strict=config.strict,
            dropped=self._dropped,
        )
        return None if payload is None else (payload, events)

    @trio.lowlevel.enable_ki_protection  # a batch is either accepted or not, never half
    async def publish(self, events: Iterable[KVEvent]) -> None:
        """Queue one round's events as a batch; waits while `max_queue_size` batches are queued.

        An empty round publishes nothing (it would only burn a seq). Every call is a
        cancellation point; it yields to other tasks when it must wait, and otherwise at least
        every 64 calls or 0.5 ms (`Pacer`): yielding on every call would cost more
        than the publish itself, and a scheduler publishing once per round yields elsewhere.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        queued = self._encode(events)
        if queued is not None:
            try:
                self._send.send_nowait(queued)
            except trio.WouldBlock:
                await self._send_waiting(queued)
                return
            except (trio.ClosedResourceError, trio.BrokenResourceError):  # closed, or its task died
                raise self._closed_error() from None
            self._accepted += 1
        if self._pacer.due():
            await self._pacer.yield_now()

    async def _send_waiting(self, queued: Queued) -> None:
        try:
            await self._send.send(queued)  # backpressure: wait for room, never drop
        except (trio.ClosedResourceError, trio.BrokenResourceError):  # closed, or its task died
            raise self._closed_error() from None
        self._accepted += 1
        self._pacer.waited()

    @trio.lowlevel.enable_ki_protection
    def publish_nowait(self, events: Iterable[KVEvent]) -> None:
        """Queue one round now, or raise trio.WouldBlock if `max_queue_size` batches are queued."""
        queued = self._encode(events)
        if queued is not None:
            self.publish_encoded_nowait(*queued)

    @trio.lowlevel.enable_ki_protection
    def publish_encoded_nowait(self, payload: bytes, events: Sequence[KVEvent]) -> None:
        """Queue a batch payload encoded elsewhere (the threaded facade encodes in its caller's
        thread) with the events it encodes, or raise trio.WouldBlock if `max_queue_size`
        batches are queued."""
        try:
            self._send.send_nowait((payload, events))
        except (trio.ClosedResourceError, trio.BrokenResourceError):  # closed, or its task died
            raise self._closed_error() from None
        self._accepted += 1

    def _closed_error(self) -> PublisherClosedError:
        return PublisherClosedError(
            "the publisher is closed: publish inside the `async with open_publisher(...)` block"
        )

    def statistics(self) -> PublisherStatistics:
        replay = None if self._replay is None else self._replay[2].statistics
        return PublisherStatistics(
            codec=codec_name(),
            accepted=self._accepted,
            queued=self._send.statistics().current_buffer_used,
            published=self._published,
            unsent_at_shutdown=self._unsent,
            oldest_seq=self._buffer.oldest_seq,
            next_seq=self._buffer.next_seq,
            replay_requests=0 if replay is None else replay.requests,
            replays_completed=0 if replay is None else replay.completed,
            replays_abandoned=0 if replay is None else replay.abandoned,
            replays_refused=0 if replay is None else replay.refused,
            replays_superseded=0 if replay is None else replay.superseded,
            replays_running=0 if self._replay is None else self._replay[2].active,
            batches_replayed=0 if replay is None else replay.batches,
            invalid_requests=0 if replay is None else replay.invalid,
            subscriptions=self._subscriptions,
            encrypted=self.config.encrypted,
            clients_refused=0 if self._zap is None else self._zap.refused,
            handshakes=sum(monitor.handshakes for monitor in self._monitors),
            handshake_failures=sum(monitor.handshake_failures for monitor in self._monitors),
            events_with_dropped_fields=self._dropped.events,
            snapshot_requests=0 if replay is None else replay.snapshots,
            snapshots_served=0 if replay is None else replay.snapshots_completed,
            snapshot_parts=0 if replay is None else replay.snapshot_parts,
            cached_blocks=None if self._state is None else self._state.blocks,
        )

    async def wait_for_subscriber(self, count: int = 1) -> None:
        """Wait until `count` subscriptions that match this publisher's topic have arrived.

        ZeroMQ drops what a PUB sends before a subscription reaches it (the slow-joiner
        problem); tests and demos wait here instead of sleeping.
        """
        while self._subscriptions < count:
            await self._subscription_change.park()

    # -- the publish task -------------------------------------------------------------------

    def _emit(self, queued: Queued) -> list[bytes] | None:
        """Send one batch now; its message back if the PUB would block (a PUB drops at its HWM
        rather than block, so that is only a fallback)."""
        payload, events = queued
        seq = self._buffer.append(payload)  # before sending: a failed send stays replayable
        message = frames.live_message(self._topic, seq, payload)
        try:
            self._pub.send_nowait(message, len(payload) < ZERO_COPY_BYTES)
        except trio.WouldBlock:
            return message
        except BaseException:
            self._unsent += 1
            raise
        finally:
            # After the send, so following the state never delays a batch; in the same step as
            # the seq, so a snapshot (taken between steps) is the state at a seq.
            if self._state is not None:
                self._state.apply(payload, events)
        self._published += 1
        return None

    async def _emit_blocked(self, message: list[bytes]) -> None:
        try:
            await self._pub.send(message)
        except BaseException:
            self._unsent += 1
            raise
        self._published += 1

    def _take_subscriptions(self) -> None:
        """Count (un)subscriptions the XPUB socket reports, and wake tasks waiting for one."""
        changed = False
        for message in self._pub.receive_waiting(SUBSCRIPTIONS_PER_TURN):  # no zmq.Again per batch
            change = frames.parse_subscription(message[0], self._topic)
            self._subscriptions += change
            changed |= change != 0
        if changed:
            self._subscription_change.unpark_all()

    async def _next_payload(self) -> Queued:
        """The next queued payload; while idle, also keep track of subscriptions.

        Only this task touches the PUB socket, so it alone waits on the socket's fd: two child
        tasks race the channel against the fd and whichever finishes first cancels the other.
        """
        while True:
            self._take_subscriptions()
            try:
                return self._receive.receive_nowait()
            except trio.WouldBlock:
                pass
            # A busy producer usually queues the next batch while we yield once; only when the
            # queue stays empty is the (costlier) race worth setting up.
            await trio.lowlevel.checkpoint()
            try:
                return self._receive.receive_nowait()
            except trio.WouldBlock:
                pass
            got = self._in_hand = []  # None: the channel was closed
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._take_one, got, nursery.cancel_scope)
                nursery.start_soon(self._watch_socket, nursery.cancel_scope)
            self._in_hand = []
            if got:
                if got[0] is None:
                    raise trio.EndOfChannel
                return got[0]

    @trio.lowlevel.enable_ki_protection  # a child task is protected only if its own code is
    async def _take_one(self, got: list[Queued | None], race: trio.CancelScope) -> None:
        try:
            got.append(await self._receive.receive())
        except trio.EndOfChannel:
            got.append(None)
        race.cancel()

    @trio.lowlevel.enable_ki_protection
    async def _watch_socket(self, race: trio.CancelScope) -> None:
        await self._pub.wait(zmq.POLLIN)
        race.cancel()

    def _dequeued(self, queued: Queued) -> Queued:
        if self._on_dequeue is not None:
            self._on_dequeue()
        return queued

    @trio.lowlevel.enable_ki_protection
    async def run_publish(self) -> None:
        try:
            with self._publish_scope:
                while True:
                    try:
                        queued = self._dequeued(await self._next_payload())
                    except trio.EndOfChannel:
                        break
                    blocked = self._emit(queued)
                    if blocked is not None:
                        await self._emit_blocked(blocked)
                    for _ in range(SEND_BURST - 1):
                        try:
                            queued = self._dequeued(self._receive.receive_nowait())
                        except (trio.WouldBlock, trio.EndOfChannel):
                            break
                        blocked = self._emit(queued)
                        if blocked is not None:
                            await self._emit_blocked(blocked)
                    else:
                        await trio.lowlevel.checkpoint()  # a full burst: let other tasks run
        finally:
            # However this task ends, what is still queued is counted before close drops it, and
            # so is a batch taken off the queue by a race that ended in an error.
            left = self._receive.statistics().current_buffer_used
            self._receive.close()
            self._unsent += left + sum(queued is not None for queued in self._in_hand)
            self._log_close()

    def _log_close(self) -> None:
        logger.info(
            "publisher on %s closed: %d batches accepted, %d published, %d unsent",
            self.endpoint,
            self._accepted,
            self._published,
            self._unsent,
        )
        if self._unsent:
            logger.error(
                "publisher on %s closed with %d accepted batches unsent (the shutdown deadline "
                "passed, or the publisher failed); raise shutdown_timeout to give the drain "
                "longer",
                self.endpoint,
                self._unsent,
            )

    def begin_shutdown(self) -> None:
        """Accept no more batches; the publish task drains what is queued, bounded in time."""
        self._send.close()
        self._publish_scope.deadline = trio.current_time() + self.config.shutdown_timeout

    # -- the replay task --------------------------------------------------------------------

    @trio.lowlevel.enable_ki_protection
    async def run_replay(self) -> None:
        assert self._replay is not None
        router, _, server = self._replay
        while True:
            wait = server.wait_time()
            if wait is None:
                await router.wait(zmq.POLLIN)
            elif wait > 0:
                with trio.move_on_after(wait):
                    await router.wait(zmq.POLLIN)
            for _ in range(REQUESTS_PER_TURN):
                try:
                    message = router.receive_frames_nowait()
                except trio.WouldBlock:
                    break
                self._log_request(server.receive([f.bytes for f in message], _peer(message)))
            for _ in range(SENDS_PER_TURN):
                out = server.next_send()
                if out is None:
                    break
                try:
                    router.send_nowait(out.frames, len(out.frames[-1]) < ZERO_COPY_BYTES)
                except trio.WouldBlock:  # the client's pipe is full (ROUTER_MANDATORY)
                    abandoned = server.blocked(out)
                except zmq.ZMQError as exc:
                    if exc.errno != errno.EHOSTUNREACH:
                        raise
                    abandoned = server.gone(out)
                else:
                    server.sent(out)
                    continue
                if abandoned is not None:
                    logger.warning(
                        "abandoned the replay to client %s at seq %d: it %s",
                        abandoned.client.hex(),
                        abandoned.next_seq,
                        abandoned.why,
                    )
            await trio.lowlevel.checkpoint()  # live batches go out between turns

    def _log_request(self, received: Received) -> None:
        if received.outcome is Outcome.REFUSED:
            self._refusal_log.warning("refused a replay request: %s", received.detail)
        elif received.outcome is Outcome.INVALID:
            self._invalid_log.warning("ignoring invalid replay request: %s", received.detail)


def _peer(message: list[zmq.Frame]) -> Peer:
    """Who sent a request: its connection, the CURVE key the ZAP handler vouched for, and its
    address, as the ROUTER reports them."""
    properties: dict[str, str | None] = {}
    for name in ("User-Id", "Peer-Address"):
        try:
            value = message[0].get(name)
        except zmq.ZMQError:  # not known for this transport (inproc has no address)
            value = None
        properties[name] = str(value) if value else None
    return Peer(message[0].bytes, properties["User-Id"], properties["Peer-Address"])


def _snapshot_maker(
    state: CacheState, buffer: ReplayBuffer, config: KVEventsConfig, dp_rank: int
) -> Callable[[], SnapshotBuilder]:
    def make() -> SnapshotBuilder:
        frozen = state.freeze(buffer.next_seq)
        return SnapshotBuilder(frozen, time.time(), dp_rank, config.wire_format)

    return make


def _listed(events: Iterable[KVEvent]) -> list[KVEvent]:
    if isinstance(events, EVENT_TYPES):
        raise TypeError(
            f"publish() takes one round's events as a list, got the single event {events!r:.80}; "
            "pass [event]"
        )
    try:
        return list(events)
    except TypeError:
        raise TypeError(
            f"publish() takes one round's events as a list of KV events, got {events!r:.80}"
        ) from None


@asynccontextmanager
async def open_publisher(
    config: KVEventsConfig,
    dp_rank: int = 0,
    *,
    context: zmq.Context[zmq.Socket[bytes]] | None = None,
    on_dequeue: Callable[[], object] | None = None,
) -> AsyncIterator[Publisher]:
    """Publish KV event batches on `config.endpoint` (offset for `dp_rank`) until the block ends.

    Leaving the block sends what is queued within `config.shutdown_timeout` seconds, whether
    the body returned, raised or was cancelled, then closes both sockets without lingering.
    `on_dequeue` is called in the publish task each time a batch leaves the queue.
    """
    if not isinstance(config, KVEventsConfig):
        raise TypeError(
            f"config must be a tskv.KVEventsConfig, got {type(config).__name__} {config!r:.80}; "
            "build one with KVEventsConfig(**mapping), KVEventsConfig.from_mapping(mapping) or "
            "KVEventsConfig.from_json(text)"
        )
    endpoint = offset_endpoint_port(config.endpoint, dp_rank)
    replay_endpoint = offset_endpoint_port(config.replay_endpoint, dp_rank)
    assert endpoint is not None
    security = server_security(config)  # the key files are read here, where sockets open
    own_context = context is None and security is not None
    if context is None:
        # A context has one ZAP endpoint, so an encrypted publisher gets a context of its own.
        context = zmq.Context() if own_context else zmq.Context.instance()
    async with AsyncExitStack() as cleanup:
        if own_context:
            cleanup.callback(context.term)
        zap = None
        if security is not None:
            zap = ZapHandler(context, security)  # bound before any CURVE socket accepts
            cleanup.callback(zap.close)
        monitors: list[SocketMonitor] = []

        def monitored(sock: zmq.Socket[bytes], label: str) -> None:
            monitor = SocketMonitor(sock, label, CURVE_HINT if security else CLEAR_HINT)
            cleanup.callback(monitor.close)
            monitors.append(monitor)

        pub, address = open_socket(
            context,
            zmq.XPUB,
            endpoint,
            config.binds(endpoint),
            config.hwm,
            security,
            MAX_SUBSCRIPTION_BYTES,
            monitored,
        )
        cleanup.callback(pub.close)
        buffer = ReplayBuffer(config.buffer_steps)
        replay = None
        # Snapshots are served on the replay socket: without one, the state is not kept.
        state = None
        if config.snapshots and replay_endpoint is not None:
            state = CacheState(tiered=config.wire_format == "vllm")  # only vLLM's carries tiers
        if replay_endpoint is not None:
            router, replay_address = open_socket(
                context,
                zmq.ROUTER,
                replay_endpoint,
                True,
                REPLAY_PIPE,
                security,
                frames.MAX_REQUEST_BYTES,
                monitored,
            )
            cleanup.callback(router.close)
            # vLLM's replies carry the topic frame; TokenSpeed's do not.
            reply_topic = config.topic.encode() if config.wire_format == "vllm" else None
            snapshot = None if state is None else _snapshot_maker(state, buffer, config, dp_rank)
            server = ReplayServer(buffer, config, reply_topic, trio.current_time, snapshot)
            replay = (router, replay_address, server)
        if security is None:
            exposed = [address] + ([replay[1]] if replay else [])
            warn_if_exposed(exposed, config.buffer_steps)
        publisher = Publisher._create(
            config, dp_rank, pub, address, replay, buffer, state, monitors, zap, on_dequeue
        )
        logger.info(
            "publishing KV events on %s (replay: %s, rank %d, %s)",
            address,
            publisher.replay_endpoint,
            dp_rank,
            "CURVE" if security else "clear text",
        )
        async with background_tasks() as nursery:
            for monitor in monitors:
                nursery.start_soon(monitor.run)
            if zap is not None:
                nursery.start_soon(zap.run)
            nursery.start_soon(publisher.run_publish)
            if replay is not None:
                nursery.start_soon(publisher.run_replay)
            try:
                yield publisher
            finally:
                # Then the nursery's cancellation stops the replay and ZAP tasks; the publish
                # task's drain is shielded and bounded by this deadline.
                publisher.begin_shutdown()
