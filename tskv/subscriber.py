"""The Trio subscriber: live batches in order, gaps repaired from replay, losses reported.

Two tasks move bytes (one owns the SUB socket, one the DEALER replay socket) into one inbox;
the consumer's own task feeds the inbox to the I/O-free `Sequencer` and delivers what it says,
so a consumer that stops iterating makes the SUB fall behind, and ZeroMQ's high-water mark,
not unbounded memory, takes the strain (the gap is then repaired from replay).
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import attrs
import trio
import zmq

from tskv import frames
from tskv._background import background_tasks
from tskv._ratelimit import LogLimiter
from tskv._trio_zmq import TrioSocket, attach
from tskv.codec import WireError, decode_batch
from tskv.endpoints import check_endpoint
from tskv.events import KVEventBatch
from tskv.security import ClientSecurity
from tskv.sequencer import Action, Deliver, Loss, LossReason, RequestReplay, Sequencer

logger = logging.getLogger("tskv")

INBOX_SIZE = 1024


@attrs.frozen
class SubscriberStatistics:
    received: int  # live messages taken off the SUB socket
    delivered: int  # batches handed to the consumer
    repaired: int  # of those, how many came from replay
    lost: int  # seqs reported lost (a restart's unknown count is not included)
    losses: int  # loss reports, restarts included
    restarts: int
    undecodable: int
    replay_requests: int


@attrs.frozen
class _Live:
    seq: int
    payload: bytes


@attrs.frozen
class _Replayed:
    request_id: int
    reply: frames.ReplayReply


@attrs.frozen
class _ReplayFailed:
    request_id: int


@attrs.frozen
class _BadFrames:
    error: str


_Inbound = _Live | _Replayed | _ReplayFailed | _BadFrames


def _log_loss(loss: Loss) -> None:
    if loss.reason is LossReason.RESTART:
        logger.warning(
            "publisher restarted: expected seq %d, got seq %d", loss.first_seq, loss.new_seq
        )
    else:
        logger.warning("lost batches %d..%d (%s)", loss.first_seq, loss.last_seq, loss.reason.value)


class Subscriber:
    """What `open_subscriber` yields: iterate it for `(seq, batch)` in order."""

    def __init__(
        self,
        sequencer: Sequencer,
        inbox: trio.MemoryReceiveChannel[_Inbound],
        requests: trio.MemorySendChannel[RequestReplay],
        on_loss: Callable[[Loss], object] | None,
        endpoint: str,
    ) -> None:
        self.endpoint = endpoint  # as really bound, when the subscriber binds
        self._sequencer = sequencer
        self._inbox = inbox
        self._requests = requests
        self._on_loss = on_loss
        self._ready: deque[tuple[int, KVEventBatch] | Loss] = deque()
        self._bad_log = LogLimiter(interval=1.0)
        self._received = 0
        self._delivered = 0
        self._repaired = 0
        self._lost = 0
        self._losses = 0
        self._restarts = 0
        self._undecodable = 0
        self._replay_requests = 0

    def statistics(self) -> SubscriberStatistics:
        return SubscriberStatistics(
            received=self._received,
            delivered=self._delivered,
            repaired=self._repaired,
            lost=self._lost,
            losses=self._losses,
            restarts=self._restarts,
            undecodable=self._undecodable,
            replay_requests=self._replay_requests,
        )

    def __aiter__(self) -> Subscriber:
        return self

    async def __anext__(self) -> tuple[int, KVEventBatch]:
        while True:
            while self._ready:
                item = self._ready.popleft()
                if isinstance(item, Loss):
                    self._report(item)
                    continue
                await trio.lowlevel.checkpoint()
                return item
            try:
                inbound = await self._inbox.receive()
            except (trio.EndOfChannel, trio.ClosedResourceError):
                raise StopAsyncIteration from None
            self._apply(self._feed(inbound))

    def _feed(self, inbound: _Inbound) -> list[Action]:
        if isinstance(inbound, _Live):
            self._received += 1
            return self._sequencer.live(inbound.seq, inbound.payload)
        if isinstance(inbound, _Replayed):
            if inbound.reply.is_end:
                return self._sequencer.replay_ended(inbound.request_id)
            return self._sequencer.replayed(
                inbound.request_id, inbound.reply.seq, inbound.reply.payload
            )
        if isinstance(inbound, _ReplayFailed):
            return self._sequencer.replay_failed(inbound.request_id)
        self._undecodable += 1
        self._bad_log.warning("ignoring a message that is not a KV event batch: %s", inbound.error)
        return []

    def _apply(self, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, Deliver):
                try:
                    batch = decode_batch(action.payload)
                except WireError as exc:
                    self._undecodable += 1
                    self._bad_log.warning("batch %d does not decode: %s", action.seq, exc)
                    self._ready.append(Loss(action.seq, action.seq, LossReason.UNDECODABLE))
                    continue
                self._delivered += 1
                self._repaired += action.from_replay
                self._ready.append((action.seq, batch))
            elif isinstance(action, Loss):
                self._ready.append(action)
            else:
                self._replay_requests += 1
                self._requests.send_nowait(action)  # unbounded: at most one per gap

    def _report(self, loss: Loss) -> None:
        self._losses += 1
        if loss.reason is LossReason.RESTART:
            self._restarts += 1
        else:
            self._lost += loss.count or 0
        _log_loss(loss)
        if self._on_loss is not None:
            self._on_loss(loss)


async def _read_live(sub: TrioSocket, inbox: trio.MemorySendChannel[_Inbound]) -> None:
    while True:
        message = await sub.receive()
        try:
            _, seq, payload = frames.parse_live_message(message)
        except frames.FrameError as exc:
            await inbox.send(_BadFrames(str(exc)))
            continue
        await inbox.send(_Live(seq, payload))


class _ReplayClient:
    """Owns the DEALER; a timed-out request's socket is replaced, so late replies die with it."""

    def __init__(
        self,
        context: zmq.Context[zmq.Socket[bytes]],
        endpoint: str,
        timeout: float,
        inbox: trio.MemorySendChannel[_Inbound],
        security: ClientSecurity | None,
    ) -> None:
        self._security = security
        self._context = context
        self._endpoint = endpoint
        self._timeout = timeout
        self._inbox = inbox
        self._dealer = self._open()

    def _open(self) -> TrioSocket:
        sock = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.RCVHWM, 0)  # a replay is bounded by the publisher's buffer
        if self._security is not None:
            self._security.apply(sock)
        attach(sock, self._endpoint, bind=False)
        return TrioSocket(sock)

    def close(self) -> None:
        self._dealer.close()

    async def run(self, requests: trio.MemoryReceiveChannel[RequestReplay]) -> None:
        async for request in requests:
            await self._serve(request)

    async def _serve(self, request: RequestReplay) -> None:
        await self._dealer.send(frames.replay_request(request.start_seq))
        while True:
            # Only the endpoint's silence counts against the timeout, not a slow consumer.
            with trio.move_on_after(self._timeout) as waiting:
                message = await self._dealer.receive()
            if waiting.cancelled_caught:
                logger.warning(
                    "replay endpoint %s sent nothing for %.1f s", self._endpoint, self._timeout
                )
                self._dealer.close()
                self._dealer = self._open()
                await self._inbox.send(_ReplayFailed(request.request_id))
                return
            try:
                reply = frames.parse_replay_reply(message)
            except frames.FrameError as exc:
                await self._inbox.send(_BadFrames(f"replay reply: {exc}"))
                continue
            await self._inbox.send(_Replayed(request.request_id, reply))
            if reply.is_end:
                return


@asynccontextmanager
async def open_subscriber(
    endpoint: str,
    replay_endpoint: str | None = None,
    topic: str = "",
    start_seq: int | None = None,
    *,
    on_loss: Callable[[Loss], object] | None = None,
    replay_timeout: float = 5.0,
    hwm: int = 100_000,
    curve_server_key: str | None = None,
    curve_secret_key: str | None = None,
    context: zmq.Context[zmq.Socket[bytes]] | None = None,
) -> AsyncIterator[Subscriber]:
    """Subscribe to a KV event stream; iterate the result for `(seq, batch)` in seq order.

    Gaps are repaired from `replay_endpoint`. What cannot be repaired is never hidden: it is
    counted, logged, and passed to `on_loss(loss)` just before the next batch is delivered.
    `start_seq` fetches earlier batches from replay first (a late joiner's bootstrap).
    For an encrypted publisher, `curve_server_key` is its public certificate file and
    `curve_secret_key` this subscriber's secret certificate file (without one, an ephemeral
    key pair is used, which a publisher that allows any client accepts).
    """
    check_endpoint(endpoint)
    if replay_endpoint is not None:
        check_endpoint(replay_endpoint)
    if start_seq is not None and (not isinstance(start_seq, int) or start_seq < 0):
        raise ValueError(f"start_seq = {start_seq!r} must be a non-negative int")
    if not (math.isfinite(replay_timeout) and replay_timeout > 0):
        raise ValueError(f"replay_timeout = {replay_timeout} must be a positive number of seconds")
    if curve_secret_key is not None and curve_server_key is None:
        raise ValueError("curve_secret_key needs curve_server_key (the publisher's public key)")
    security = (
        None
        if curve_server_key is None
        else ClientSecurity.from_files(curve_server_key, curve_secret_key)
    )
    sequencer = Sequencer(replay_endpoint is not None, start_seq)
    first_actions = sequencer.start()
    context = context or zmq.Context.instance()
    sock = context.socket(zmq.SUB)
    try:
        sock.setsockopt(zmq.RCVHWM, hwm)
        sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        if security is not None:
            security.apply(sock)
        # Bind only to a wildcard: a publisher that connects out (no * in its endpoint) needs a
        # subscriber that binds, and an explicit address means "connect to the publisher".
        address = attach(sock, endpoint, bind="*" in endpoint)
    except BaseException:
        sock.close(linger=0)
        raise
    sub = TrioSocket(sock)
    inbox_send, inbox_receive = trio.open_memory_channel[_Inbound](INBOX_SIZE)
    requests_send, requests_receive = trio.open_memory_channel[RequestReplay](math.inf)
    replay: _ReplayClient | None = None
    try:
        if replay_endpoint is not None:
            replay = _ReplayClient(context, replay_endpoint, replay_timeout, inbox_send, security)
        subscriber = Subscriber(sequencer, inbox_receive, requests_send, on_loss, address)
        subscriber._apply(first_actions)
        async with background_tasks() as nursery:
            nursery.start_soon(_read_live, sub, inbox_send)
            if replay is not None:
                nursery.start_soon(replay.run, requests_receive)
            yield subscriber
    finally:
        sub.close()
        if replay is not None:
            replay.close()
