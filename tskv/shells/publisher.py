"""The Trio publisher: what `open_publisher` yields, and the nursery it runs in.

`publish()` stamps and encodes a round and puts the payload in a memory channel of
`max_queue_size`. Two tasks own the sockets: the publish task (`_publish_task`) takes payloads
off the channel and sends them on the PUB socket; the replay task (`_replay_task`) serves
replay and snapshots on the ROUTER socket, as the I/O-free `ReplayServer` decides. Leaving the
block closes the channel and the publish task drains it under a deadline.

Every background task is protected from KeyboardInterrupt, so Ctrl-C lands in the caller's
code, whose leaving the block then gets the same bounded drain as any other exit.
"""

from __future__ import annotations

import logging
import secrets
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import final

import attrs
import trio
import zmq

from tskv.core import frames
from tskv.core.codec import DroppedFields, codec_name, encode_round
from tskv.core.config import KVEventsConfig
from tskv.core.descriptor import Descriptor, PublishedGroups
from tskv.core.endpoints import host_and_port, offset_endpoint_port, tcp_host
from tskv.core.errors import TskvError, TskvTypeError
from tskv.core.events import EVENT_TYPES, KVEvent
from tskv.core.replay_buffer import ReplayBuffer
from tskv.core.replay_server import ReplayServer, ReplayStatistics
from tskv.core.snapshot import CacheState, SnapshotBuilder
from tskv.core.version import VERSION
from tskv.curve.policy import warn_if_exposed
from tskv.curve.security import ServerSecurity, server_security
from tskv.shells._background import Pacer, background_tasks
from tskv.shells._constructor import NoPublicConstructor
from tskv.shells._monitor import SocketMonitor
from tskv.shells._publish_task import PublishTask, Queued
from tskv.shells._reachability import NO_SUBSCRIBER_HINT, warn_if_unanswered
from tskv.shells._replay_task import ReplayTask
from tskv.shells._trio_zmq import open_socket
from tskv.shells._zap import ZapHandler

logger = logging.getLogger(__name__)

REPLAY_PIPE = 128  # replies ZeroMQ queues per replay client, whatever `hwm` is
RELEASE_WAIT = 1.0  # seconds a closing publisher waits for ZeroMQ to let go of its tcp ports
UNANSWERED_AFTER = 5.0  # seconds a publisher that connects out waits for a subscriber, then says so
MAX_SUBSCRIPTION_BYTES = 4096  # a larger subscription frame disconnects its sender
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
    subscriptions: int
    encrypted: bool
    clients_refused: int  # by the CURVE allow list
    handshakes: int  # connections whose ZeroMQ (and CURVE) handshake succeeded
    handshake_failures: int  # connections whose handshake failed: a wrong key, clear text
    events_with_dropped_fields: int  # optional fields the tokenspeed wire has no slot for
    cached_blocks: int | None  # the blocks the stream says are cached; None: snapshots off
    replay: ReplayStatistics | None  # the replay endpoint's (snapshots included); None: none


@final
class Publisher(metaclass=NoPublicConstructor):
    """What `open_publisher` yields; only `open_publisher` makes one."""

    def __init__(
        self,
        config: KVEventsConfig,
        dp_rank: int,
        queue: trio.MemorySendChannel[Queued],
        publishing: PublishTask,
        replaying: ReplayTask | None,
        buffer: ReplayBuffer,
        state: CacheState | None,
        security: _Security,
    ) -> None:
        self.config = config
        self.dp_rank = dp_rank
        # Where it publishes, as really bound (the rank's offset applied, a port picked for
        # `*`): what a subscriber connects to. A restart on the same ports passes the
        # configured ones (and the same rank) again.
        self.endpoint = publishing.endpoint
        self.replay_endpoint = None if replaying is None else replaying.endpoint
        self.configured_endpoint = config.endpoint
        self.configured_replay_endpoint = config.replay_endpoint
        # this incarnation, said on replay: a subscriber tells a restart on the same ports by it
        self.epoch = None if replaying is None else replaying.epoch
        self._queue = queue
        self._publishing = publishing
        self._replaying = replaying
        self._buffer = buffer
        self._state = state  # what snapshots are made from; None when they are off
        self._security = security
        self._dropped = DroppedFields(logger.warning)
        self._counts = publishing.counts  # publish() counts here, the publish task too
        self._pacer = Pacer()

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
                self._queue.send_nowait(queued)
            except trio.WouldBlock:
                await self._send_waiting(queued)
                return
            except (trio.ClosedResourceError, trio.BrokenResourceError):  # closed, or its task died
                raise self._closed_error() from None
            self._counts.accepted += 1
        if self._pacer.due():
            await self._pacer.yield_now()

    async def _send_waiting(self, queued: Queued) -> None:
        try:
            await self._queue.send(queued)  # backpressure: wait for room, never drop
        except (trio.ClosedResourceError, trio.BrokenResourceError):  # closed, or its task died
            raise self._closed_error() from None
        self._counts.accepted += 1
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
            self._queue.send_nowait((payload, events))
        except (trio.ClosedResourceError, trio.BrokenResourceError):  # closed, or its task died
            raise self._closed_error() from None
        self._counts.accepted += 1

    def _closed_error(self) -> PublisherClosedError:
        return PublisherClosedError(
            "the publisher is closed: publish inside the `async with open_publisher(...)` block"
        )

    def statistics(self) -> PublisherStatistics:
        publishing, security = self._publishing, self._security
        publishing.count_subscriptions()
        counts = self._counts
        return PublisherStatistics(
            codec=codec_name(),
            accepted=counts.accepted,
            queued=self._queue.statistics().current_buffer_used,
            published=counts.published,
            unsent_at_shutdown=counts.unsent,
            oldest_seq=self._buffer.oldest_seq,
            next_seq=self._buffer.next_seq,
            subscriptions=counts.subscriptions,
            encrypted=self.config.encrypted,
            clients_refused=0 if security.zap is None else security.zap.refused,
            handshakes=sum(monitor.handshakes for monitor in security.monitors),
            handshake_failures=sum(monitor.handshake_failures for monitor in security.monitors),
            events_with_dropped_fields=self._dropped.events,
            cached_blocks=None if self._state is None else self._state.blocks,
            replay=None if self._replaying is None else self._replaying.statistics(),
        )

    @property
    def accepted(self) -> int:
        return self._counts.accepted

    async def wait_for_subscriber(self, count: int = 1) -> None:
        """Wait until `count` subscriptions that match this publisher's topic have arrived.

        ZeroMQ drops what a PUB sends before a subscription reaches it (the slow-joiner
        problem); tests and demos wait here instead of sleeping.
        """
        while True:
            self._publishing.watch_subscriptions()
            if self._counts.subscriptions >= count:
                return
            await self._publishing.subscription_change.park()

    def _stop(self) -> None:
        """Accept no more batches; the publish task drains what is queued, bounded in time."""
        self._queue.close()
        self._publishing.stop_by(trio.current_time() + self.config.shutdown_timeout)


@attrs.define
class _Security:
    """What watches the sockets' handshakes: the ZAP handler (CURVE only) and the monitors."""

    zap: ZapHandler | None = None
    monitors: list[SocketMonitor] = attrs.Factory(list)

    def start(self, nursery: trio.Nursery) -> None:
        for monitor in self.monitors:
            nursery.start_soon(monitor.run)
        if self.zap is not None:
            nursery.start_soon(self.zap.run)


def _listed(events: Iterable[KVEvent]) -> list[KVEvent]:
    if isinstance(events, EVENT_TYPES):
        raise TskvTypeError(
            f"publish() takes one round's events as a list, got the single event {events!r:.80}; "
            "pass [event]"
        )
    try:
        return list(events)
    except TypeError:
        raise TskvTypeError(
            f"publish() takes one round's events as a list of KV events, got {events!r:.80}"
        ) from None


def _groups_only(config: KVEventsConfig, replay_endpoint: str | None) -> PublishedGroups | None:
    """Without the cache state, the groups a descriptor names are followed alone: only where
    there is a replay socket to describe on, and a wire that carries groups."""
    if replay_endpoint is None or not config.layout.tiered_state:
        return None
    return PublishedGroups()


def _snapshot_maker(
    state: CacheState, buffer: ReplayBuffer, config: KVEventsConfig, dp_rank: int
) -> Callable[[], SnapshotBuilder]:
    def make() -> SnapshotBuilder:
        frozen = state.freeze(buffer.next_seq)
        return SnapshotBuilder(frozen, time.time(), dp_rank, config.wire_format)

    return make


def _describer(
    config: KVEventsConfig,
    dp_rank: int,
    buffer: ReplayBuffer,
    followed: CacheState | PublishedGroups | None,
    epoch: int,
) -> Callable[[], bytes]:
    """What the publisher says it is, made afresh for each describe request (they are rare)."""

    def describe() -> bytes:
        next_seq = buffer.next_seq
        return Descriptor.with_groups(
            () if followed is None else followed.groups.values(),
            tskv_version=VERSION,
            epoch=epoch,
            wire_format=config.wire_format,
            topic=config.topic,
            dp_rank=dp_rank,
            block_size=config.block_size,
            hash_algorithm=config.hash_algorithm,
            oldest_seq=buffer.oldest_seq,
            newest_seq=next_seq - 1 if buffer.oldest_seq is not None else None,
            snapshots=isinstance(followed, CacheState),
        ).encode()

    return describe


def _check_config(config: object) -> KVEventsConfig:
    if not isinstance(config, KVEventsConfig):
        raise TskvTypeError(
            f"config must be a tskv.KVEventsConfig, got {type(config).__name__} {config!r:.80}; "
            "build one with KVEventsConfig(**mapping), KVEventsConfig.from_mapping(mapping) or "
            "KVEventsConfig.from_json(text)"
        )
    return config


@asynccontextmanager
async def open_publisher(
    config: KVEventsConfig,
    dp_rank: int = 0,
    *,
    context: zmq.Context[zmq.Socket[bytes]] | None = None,
    on_dequeue: Callable[[], object] | None = None,
) -> AsyncIterator[Publisher]:
    """Publish KV event batches until the block ends; yields the `Publisher`.

    Leaving the block sends what is queued within `config.shutdown_timeout` seconds, whether
    the body returned, raised or was cancelled, then closes the sockets (the PUB lingering for
    what is left of that deadline, so ZeroMQ sends what it still holds).

    Args:
      config: every setting (`KVEventsConfig`): the endpoints (offset for `dp_rank`), the
        wire, the replay buffer and limits, snapshots, CURVE.
      dp_rank: the data-parallel rank: tcp ports are offset by it, inproc names suffixed.
      context: the ZeroMQ context to use (default: the process's, or a new one for CURVE,
        since a context has one ZAP endpoint).
      on_dequeue: called in the publish task each time a batch leaves the queue.

    Raises:
      TypeError: `config` is not a `KVEventsConfig`.
      EndpointError: an endpoint cannot be offset for `dp_rank`.
      KeyFileError: a CURVE key file is missing, unreadable or not a key.
      AttachError: a socket cannot bind or connect (an OSError).
    """
    config = _check_config(config)
    endpoint = offset_endpoint_port(config.endpoint, dp_rank)
    replay_endpoint = offset_endpoint_port(config.replay_endpoint, dp_rank)
    assert endpoint is not None
    security = server_security(config)  # the key files are read here, where sockets open
    own_context = context is None and security is not None
    if context is None:
        context = zmq.Context() if own_context else zmq.Context.instance()
    async with AsyncExitStack() as cleanup:
        if own_context:
            cleanup.callback(context.term)
        bound: list[str] = []  # its tcp endpoints, free again once the stack has closed them
        cleanup.push_async_callback(_until_released, bound)
        watch = _watch_security(cleanup, context, security)
        buffer = ReplayBuffer(config.buffer_steps)
        queue, queued = trio.open_memory_channel[Queued](config.max_queue_size)
        keeps_state = config.serves_snapshots(replay_endpoint)
        state = CacheState(tiered=config.layout.tiered_state) if keeps_state else None
        followed = state or _groups_only(config, replay_endpoint)
        sockets = _Sockets(cleanup, context, config, security, watch)
        publishing, pub_monitor = sockets.publish(endpoint, queued, buffer, followed, on_dequeue)
        replaying = None
        if replay_endpoint is not None:
            snapshot = None if state is None else _snapshot_maker(state, buffer, config, dp_rank)
            epoch = secrets.randbits(64)  # this incarnation's: a restart says another
            describe = _describer(config, dp_rank, buffer, followed, epoch)
            replaying = sockets.replay(replay_endpoint, buffer, snapshot, epoch, describe)
        publisher = Publisher._create(
            config, dp_rank, queue, publishing, replaying, buffer, state, watch
        )
        binds = config.binds(endpoint)
        bound.extend([publisher.endpoint] if binds else [])
        bound.extend([publisher.replay_endpoint] if publisher.replay_endpoint else [])
        _announce(publisher, security is not None, binds)
        async with background_tasks() as nursery:
            watch.start(nursery)
            if not binds:
                args = (endpoint, pub_monitor, UNANSWERED_AFTER, "subscriber", NO_SUBSCRIBER_HINT)
                nursery.start_soon(warn_if_unanswered, *args)
            nursery.start_soon(publishing.run)
            if replaying is not None:
                nursery.start_soon(replaying.run)
            try:
                yield publisher
            finally:
                # Then the nursery's cancellation stops the replay and ZAP tasks; the publish
                # task's drain is shielded and bounded by this deadline.
                publisher._stop()


async def _until_released(endpoints: list[str]) -> None:
    """Wait (RELEASE_WAIT at most) until the tcp ports it bound can be bound again. ZeroMQ
    closes a socket's listener in its own thread, a moment after close(): without this, a
    publisher opened again on the same ports at once (a restart in the same process, a test)
    finds them still taken."""
    with trio.move_on_after(RELEASE_WAIT) as waiting:
        waiting.shield = True  # it runs while the block unwinds, cancelled or not
        for endpoint in endpoints:
            while not _bindable(endpoint):  # noqa: ASYNC110 - the OS says, no event does
                await trio.sleep(0.002)


def _bindable(endpoint: str) -> bool:
    """Whether a tcp endpoint's port is free to bind (as ZeroMQ binds it, SO_REUSEADDR set)."""
    host = tcp_host(endpoint)
    port = host_and_port(endpoint)[1]
    if host is None or port is None or not port.isdigit():
        return True  # ipc and inproc names are free once closed; a `*` port never was fixed
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("" if host in ("*", "0.0.0.0") else host, int(port)))
        except OSError:
            return False
    return True


def _announce(publisher: Publisher, encrypted: bool, binds: bool) -> None:
    """Log where it publishes; warn when clear text is open to other machines."""
    if not encrypted:
        exposed = [publisher.endpoint] + [e for e in [publisher.replay_endpoint] if e]
        warn_if_exposed(exposed, publisher.config.buffer_steps)
    logger.info(
        "publishing KV events on %s (%s, replay: %s, rank %d, configured as %s and %s, %s)",
        publisher.endpoint,
        "bound" if binds else "connecting out",
        publisher.replay_endpoint,
        publisher.dp_rank,
        publisher.configured_endpoint,
        publisher.configured_replay_endpoint,
        "CURVE" if encrypted else "clear text",
    )


def _watch_security(
    cleanup: AsyncExitStack,
    context: zmq.Context[zmq.Socket[bytes]],
    security: ServerSecurity | None,
) -> _Security:
    watch = _Security()
    if security is not None:
        watch.zap = ZapHandler(context, security)  # bound before any CURVE socket accepts
        cleanup.callback(watch.zap.close)
    return watch


@attrs.frozen
class _Sockets:
    """Opens the publisher's sockets, each closed (and its monitor too) when the block ends."""

    cleanup: AsyncExitStack
    context: zmq.Context[zmq.Socket[bytes]]
    config: KVEventsConfig
    security: ServerSecurity | None
    watch: _Security

    def _monitored(self, sock: zmq.Socket[bytes], label: str) -> None:
        monitor = SocketMonitor(sock, label, CURVE_HINT if self.security else CLEAR_HINT)
        self.cleanup.callback(monitor.close)  # if the socket fails to open
        self.watch.monitors.append(monitor)

    def _closed_after_its_monitor(self, close: Callable[[], object]) -> SocketMonitor:
        """Close the socket just opened once its monitor is stopped. Closed first, the socket
        can no longer stop it, and what its teardown still reports (a disconnect, a handshake
        under way) goes to a monitor nobody reads: libzmq's I/O thread then blocks on it, and
        every socket of the context with it (seen with gdb)."""
        monitor = self.watch.monitors[-1]
        self.cleanup.callback(close)
        self.cleanup.callback(monitor.close)  # the stack unwinds newest first: this goes first
        return monitor

    def publish(
        self,
        endpoint: str,
        queued: trio.MemoryReceiveChannel[Queued],
        buffer: ReplayBuffer,
        state: CacheState | PublishedGroups | None,
        on_dequeue: Callable[[], object] | None,
    ) -> tuple[PublishTask, SocketMonitor]:
        config = self.config
        pub, address = open_socket(
            self.context,
            zmq.XPUB,
            endpoint,
            config.binds(endpoint),
            config.hwm,
            self.security,
            MAX_SUBSCRIPTION_BYTES,
            self._monitored,
        )
        task = PublishTask(pub, address, config.topic.encode(), queued, buffer, state, on_dequeue)
        return task, self._closed_after_its_monitor(task.close)

    def replay(
        self,
        endpoint: str,
        buffer: ReplayBuffer,
        snapshot: Callable[[], SnapshotBuilder] | None,
        epoch: int,
        describe: Callable[[], bytes],
    ) -> ReplayTask:
        router, address = open_socket(
            self.context,
            zmq.ROUTER,
            endpoint,
            True,
            REPLAY_PIPE,
            self.security,
            frames.MAX_REQUEST_BYTES,
            self._monitored,
        )
        self._closed_after_its_monitor(router.close)
        reply_topic = self.config.layout.reply_topic
        server = ReplayServer(
            buffer, self.config, reply_topic, trio.current_time, snapshot, epoch, describe
        )
        return ReplayTask(router, address, server)
