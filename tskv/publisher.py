"""The Trio publisher: a publish task and a replay task in one nursery, sharing a bounded queue.

`publish()` stamps and encodes a round and puts the payload in a memory channel of
`max_queue_size`; the publish task owns the PUB socket, assigns seqs, keeps each payload in the
replay buffer before sending it, and sends every queued batch it can between checkpoints. The
replay task owns the ROUTER socket and answers replay requests a slice at a time, so a long
replay never holds up live batches. Leaving the block drains the queue under a deadline.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import AsyncExitStack, asynccontextmanager

import attrs
import trio
import zmq

from tskv import frames
from tskv._background import background_tasks
from tskv._ratelimit import LogLimiter
from tskv._trio_zmq import TrioSocket, open_socket
from tskv.codec import codec_name, encode_round
from tskv.config import KVEventsConfig
from tskv.endpoints import offset_endpoint_port, should_bind
from tskv.events import KVEvent
from tskv.replay_buffer import ReplayBuffer
from tskv.replay_limits import RequestGate
from tskv.security import ZapHandler, warn_if_exposed

logger = logging.getLogger("tskv")

SEND_BURST = 1024  # batches sent between two checkpoints of the publish task
REPLAY_SLICE = 64  # replies sent to one client before the replay task yields
ZERO_COPY_BYTES = 65536  # pyzmq copies smaller frames anyway; zero-copy pays above this
REPLAY_BACKOFF = 0.001  # a ROUTER may report POLLOUT while a slow client's pipe is full
YIELD_EVERY = 64  # publish() yields to other tasks at least this often...
YIELD_AFTER = 0.0005  # ...and at least this often (seconds), whichever comes first


class PublisherClosedError(trio.ClosedResourceError):
    """publish() after the publisher's `async with` block was left."""


@attrs.frozen
class PublisherStatistics:
    """A snapshot of what the publisher has done; every batch is accounted for."""

    codec: str
    queued: int
    published: int
    oldest_seq: int | None
    next_seq: int
    replay_requests: int
    replays_completed: int
    replays_abandoned: int
    replays_refused: int
    batches_replayed: int
    invalid_requests: int
    unsent_at_shutdown: int
    subscriptions: int
    encrypted: bool
    clients_refused: int  # by the CURVE allow list


@attrs.define
class _ReplayJob:
    client: bytes
    next_seq: int
    stop_seq: int  # the newest seq when the request came (or the per-request cap): ends there
    last_progress: float


class Publisher:
    """What `open_publisher` yields. Create it through `open_publisher`, not directly."""

    def __init__(
        self,
        config: KVEventsConfig,
        dp_rank: int,
        pub: TrioSocket,
        endpoint: str,
        router: TrioSocket | None,
        replay_endpoint: str | None,
        replay_client_timeout: float,
    ) -> None:
        self.config = config
        self.dp_rank = dp_rank
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self._pub = pub
        self._router = router
        self._topic = config.topic.encode()
        self._buffer = ReplayBuffer(config.buffer_steps)
        self._send, self._receive = trio.open_memory_channel[bytes](config.max_queue_size)
        self._replay_client_timeout = replay_client_timeout
        self._invalid_log = LogLimiter()
        self._refusal_log = LogLimiter()
        self._gate = RequestGate(config.replay_limits(), trio.current_time)
        self._zap: ZapHandler | None = None
        self._replays_refused = 0
        self._published = 0
        self._replay_requests = 0
        self._replays_completed = 0
        self._replays_abandoned = 0
        self._batches_replayed = 0
        self._invalid_requests = 0
        self._unsent_at_shutdown = 0
        self._unyielded = 0
        self._yielded_at = time.perf_counter()
        self._subscriptions = 0
        self._subscription_change = trio.lowlevel.ParkingLot()
        # Shielded so the queue still drains when the caller's scope is cancelled; its deadline
        # is set when the block is left, which bounds the drain.
        self._publish_scope = trio.CancelScope(shield=True)
        # Called once per batch taken off the queue; the threaded facade counts its slots here.
        self._on_dequeue: Callable[[], object] | None = None

    # -- the scheduler's side ---------------------------------------------------------------

    def _encode(self, events: Iterable[KVEvent]) -> bytes | None:
        return encode_round(time.time(), events, self.dp_rank)

    async def publish(self, events: Iterable[KVEvent]) -> None:
        """Queue one round's events as a batch; waits while `max_queue_size` batches are queued.

        An empty round publishes nothing (it would only burn a seq). Every call is a
        cancellation point; it yields to other tasks when it must wait, and otherwise at least
        every YIELD_EVERY calls or YIELD_AFTER seconds: yielding on every call would cost more
        than the publish itself, and a scheduler publishing once per round yields elsewhere.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        payload = self._encode(events)
        if payload is not None:
            try:
                self._send.send_nowait(payload)
            except trio.WouldBlock:
                await self._send_waiting(payload)
                return
            except trio.ClosedResourceError:
                raise self._closed_error() from None
        self._unyielded += 1
        if self._unyielded >= YIELD_EVERY or time.perf_counter() - self._yielded_at > YIELD_AFTER:
            await self._yield()

    async def _yield(self) -> None:
        self._unyielded = 0
        await trio.lowlevel.cancel_shielded_checkpoint()
        self._yielded_at = time.perf_counter()

    async def _send_waiting(self, payload: bytes) -> None:
        try:
            await self._send.send(payload)  # backpressure: wait for room, never drop
        except trio.ClosedResourceError:
            raise self._closed_error() from None
        self._unyielded = 0
        self._yielded_at = time.perf_counter()

    def publish_nowait(self, events: Iterable[KVEvent]) -> None:
        """Queue one round now, or raise trio.WouldBlock if `max_queue_size` batches are queued."""
        payload = self._encode(events)
        if payload is None:
            return
        try:
            self._send.send_nowait(payload)
        except trio.ClosedResourceError:
            raise self._closed_error() from None

    def _closed_error(self) -> PublisherClosedError:
        return PublisherClosedError(
            "the publisher is closed: publish inside the `async with open_publisher(...)` block"
        )

    def statistics(self) -> PublisherStatistics:
        return PublisherStatistics(
            codec=codec_name(),
            queued=self._send.statistics().current_buffer_used,
            published=self._published,
            oldest_seq=self._buffer.oldest_seq,
            next_seq=self._buffer.next_seq,
            replay_requests=self._replay_requests,
            replays_completed=self._replays_completed,
            replays_abandoned=self._replays_abandoned,
            replays_refused=self._replays_refused,
            batches_replayed=self._batches_replayed,
            invalid_requests=self._invalid_requests,
            unsent_at_shutdown=self._unsent_at_shutdown,
            subscriptions=self._subscriptions,
            encrypted=self.config.curve_secret_key is not None,
            clients_refused=0 if self._zap is None else self._zap.refused,
        )

    # -- the publish task -------------------------------------------------------------------

    def _queue_payload_nowait(self, payload: bytes) -> None:
        """Queue an already encoded batch (the threaded facade encodes in its caller's thread)."""
        try:
            self._send.send_nowait(payload)
        except trio.ClosedResourceError:
            raise self._closed_error() from None

    async def _emit(self, payload: bytes) -> None:
        if self._on_dequeue is not None:
            self._on_dequeue()
        seq = self._buffer.append(payload)  # before sending: a failed send stays replayable
        message = frames.live_message(self._topic, seq, payload)
        copy = len(payload) < ZERO_COPY_BYTES
        try:
            self._pub.send_nowait(message, copy)
        except trio.WouldBlock:  # PUB drops at its HWM rather than block; this is a fallback
            await self._pub.send(message, copy)
        self._published += 1

    def _take_subscriptions(self) -> None:
        """Count (un)subscriptions the XPUB socket reports, and wake tasks waiting for one."""
        changed = False
        while True:
            try:
                message = self._pub.receive_nowait()
            except trio.WouldBlock:
                break
            if message and message[0][:1] in (b"\x00", b"\x01"):
                prefix = message[0][1:]
                if self._topic.startswith(prefix):
                    self._subscriptions += 1 if message[0][0] == 1 else -1
                    changed = True
        if changed:
            self._subscription_change.unpark_all()

    async def _next_payload(self) -> bytes:
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
            got: list[bytes | None] = []  # None: the channel was closed
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._take_one, got, nursery.cancel_scope)
                nursery.start_soon(self._watch_socket, nursery.cancel_scope)
            if got:
                if got[0] is None:
                    raise trio.EndOfChannel
                return got[0]

    async def _take_one(self, got: list[bytes | None], race: trio.CancelScope) -> None:
        try:
            got.append(await self._receive.receive())
        except trio.EndOfChannel:
            got.append(None)
        race.cancel()

    async def _watch_socket(self, race: trio.CancelScope) -> None:
        await self._pub.wait(zmq.POLLIN)
        race.cancel()

    async def _run_publish(self) -> None:
        try:
            with self._publish_scope:
                while True:
                    try:
                        payload = await self._next_payload()
                    except trio.EndOfChannel:
                        break
                    await self._emit(payload)
                    for _ in range(SEND_BURST - 1):
                        try:
                            payload = self._receive.receive_nowait()
                        except (trio.WouldBlock, trio.EndOfChannel):
                            break
                        await self._emit(payload)
                    else:
                        await trio.lowlevel.checkpoint()  # a full burst: let other tasks run
        finally:
            left = self._receive.statistics().current_buffer_used  # before close discards them
            self._receive.close()
        if left:
            self._unsent_at_shutdown += left
            logger.error(
                "publisher shutdown deadline passed with %d batches still queued; they were "
                "not sent (raise shutdown_timeout to give the drain longer)",
                left,
            )

    async def wait_for_subscriber(self, count: int = 1) -> None:
        """Wait until `count` subscriptions that match this publisher's topic have arrived.

        ZeroMQ drops what a PUB sends before a subscription reaches it (the slow-joiner
        problem); tests and demos wait here instead of sleeping.
        """
        while self._subscriptions < count:
            await self._subscription_change.park()

    def _begin_shutdown(self, timeout: float) -> None:
        self._send.close()
        self._publish_scope.deadline = trio.current_time() + timeout

    # -- the replay task --------------------------------------------------------------------

    def _take_request(
        self, message: list[zmq.Frame], jobs: dict[bytes, _ReplayJob], router: TrioSocket
    ) -> None:
        try:
            client, start_seq = frames.parse_replay_request([frame.bytes for frame in message])
        except frames.FrameError as exc:
            self._invalid_requests += 1
            self._invalid_log.warning("ignoring invalid replay request: %s", exc)
            return
        self._replay_requests += 1
        refusal = self._gate.refusal(_client_key(message[0], client), len(jobs), client in jobs)
        if refusal is not None:
            self._replays_refused += 1
            self._refusal_log.warning("refused a replay request: %s", refusal)
            jobs.pop(client, None)
            with contextlib.suppress(trio.WouldBlock, zmq.ZMQError):  # the end marker, at once
                router.send_nowait(frames.replay_end(client))
            return
        # A client asking again replaces its earlier replay: it wants this one now.
        first = self._buffer.first_at_or_after(start_seq)
        jobs[client] = _ReplayJob(
            client, first, self._gate.stop_seq(first, self._buffer.next_seq), trio.current_time()
        )

    def _serve_slice(self, job: _ReplayJob, router: TrioSocket) -> bool | None:
        """Send up to REPLAY_SLICE replies; True when done, False if stalled, None if progress."""
        sent = 0
        while sent < REPLAY_SLICE:
            # Batches evicted while the replay ran are skipped; the client sees the hole.
            job.next_seq = self._buffer.first_at_or_after(job.next_seq)
            payload = self._buffer.get(job.next_seq) if job.next_seq < job.stop_seq else None
            if payload is None:
                message = frames.replay_end(job.client)
            else:
                message = frames.replay_reply(job.client, job.next_seq, payload)
            router.send_nowait(message)  # raises WouldBlock on a full pipe (ROUTER_MANDATORY)
            job.last_progress = trio.current_time()
            if payload is None:
                return True
            job.next_seq += 1
            self._batches_replayed += 1
            sent += 1
        return None

    async def _run_replay(self, router: TrioSocket) -> None:
        jobs: dict[bytes, _ReplayJob] = {}
        while True:
            if not jobs:
                await router.wait(zmq.POLLIN)
            while True:
                try:
                    message = router.receive_frames_nowait()
                except trio.WouldBlock:
                    break
                self._take_request(message, jobs, router)
            stalled = 0
            for job in list(jobs.values()):
                try:
                    done = self._serve_slice(job, router)
                except trio.WouldBlock:
                    done = False
                except zmq.ZMQError as exc:
                    if exc.errno != errno.EHOSTUNREACH:
                        raise
                    logger.info("replay client %s left before its replay ended", job.client.hex())
                    self._replays_abandoned += 1
                    del jobs[job.client]
                    continue
                if done:
                    self._replays_completed += 1
                    del jobs[job.client]
                elif done is False:
                    stalled += 1
                    if trio.current_time() - job.last_progress > self._replay_client_timeout:
                        logger.warning(
                            "replay client %s took nothing for %.1f s; abandoning its replay at "
                            "seq %d",
                            job.client.hex(),
                            self._replay_client_timeout,
                            job.next_seq,
                        )
                        self._replays_abandoned += 1
                        del jobs[job.client]
            if jobs and stalled == len(jobs):
                await trio.sleep(REPLAY_BACKOFF)
            else:
                await trio.lowlevel.checkpoint()  # live batches go out between slices


def _client_key(frame: zmq.Frame, identity: bytes) -> bytes:
    """Whom a replay request counts against: the CURVE key the ZAP handler vouched for, else
    the peer's address (a new connection does not reset the limit), else the socket identity."""
    for name in ("User-Id", "Peer-Address"):
        try:
            value = frame.get(name)
        except zmq.ZMQError:
            continue
        if value:
            return f"{name}:{value}".encode()
    return identity


@asynccontextmanager
async def open_publisher(
    config: KVEventsConfig,
    dp_rank: int = 0,
    *,
    shutdown_timeout: float = 1.0,
    replay_client_timeout: float = 5.0,
    context: zmq.Context[zmq.Socket[bytes]] | None = None,
) -> AsyncIterator[Publisher]:
    """Publish KV event batches on `config.endpoint` (offset for `dp_rank`) until the block ends.

    Leaving the block sends what is queued within `shutdown_timeout` seconds, whether the body
    returned, raised or was cancelled, then closes both sockets without lingering.
    `replay_client_timeout` is how long a replay waits for a client that takes nothing.
    """
    if not (math.isfinite(shutdown_timeout) and shutdown_timeout >= 0):
        raise ValueError(f"shutdown_timeout = {shutdown_timeout} must be a finite number >= 0")
    endpoint = offset_endpoint_port(config.endpoint, dp_rank)
    replay_endpoint = offset_endpoint_port(config.replay_endpoint, dp_rank)
    assert endpoint is not None
    security = config.server_security()
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
        pub, address = open_socket(
            context, zmq.XPUB, endpoint, should_bind(endpoint), config.hwm, security
        )
        cleanup.callback(pub.close)
        router: TrioSocket | None = None
        replay_address: str | None = None
        if replay_endpoint is not None:
            router, replay_address = open_socket(
                context, zmq.ROUTER, replay_endpoint, True, config.hwm, security
            )
            cleanup.callback(router.close)
        if security is None:
            warn_if_exposed([a for a in (address, replay_address) if a], config.buffer_steps)
        publisher = Publisher(
            config, dp_rank, pub, address, router, replay_address, replay_client_timeout
        )
        publisher._zap = zap
        logger.info(
            "publishing KV events on %s (replay: %s, rank %d, %s)",
            address,
            replay_address,
            dp_rank,
            "CURVE" if security else "clear text",
        )
        async with background_tasks() as nursery:
            if zap is not None:
                nursery.start_soon(zap.run)
            nursery.start_soon(publisher._run_publish)
            if router is not None:
                nursery.start_soon(publisher._run_replay, router)
            try:
                yield publisher
            finally:
                # Then the nursery's cancellation stops the replay and ZAP tasks; the publish
                # task's drain is shielded and bounded by this deadline.
                publisher._begin_shutdown(shutdown_timeout)
