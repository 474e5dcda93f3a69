"""The subscriber's replay client: the task that owns the DEALER socket, sends each request
the Sequencer makes and puts the replies in the inbox. How long to wait, when to ask a refusing
publisher again and when to give up is `tskv.core.replay_retry`'s to say."""

from __future__ import annotations

import logging

import trio
import zmq

from tskv.core import frames
from tskv.core.actions import RequestReplay, RequestSnapshot
from tskv.core.replay_retry import GiveUp, ReplayAttempt
from tskv.curve.security import ClientSecurity
from tskv.shells._inbox import BadFrames, Inbound, Replayed, ReplayFailed, Request, SnapshotPart
from tskv.shells._trio_zmq import TrioSocket, attach

logger = logging.getLogger(__name__)

SUPERSEDED_EVERY = 64  # replies between two looks for a newer request (a look costs µs)


class ReplayClient:
    """Owns the DEALER; the socket of a request that timed out, or that a newer one superseded,
    is replaced, so late replies die with it."""

    def __init__(
        self,
        context: zmq.Context[zmq.Socket[bytes]],
        endpoint: str,
        timeout: float,
        inbox: trio.MemorySendChannel[Inbound],
        security: ClientSecurity | None,
        probe_timeout: float,
        topic: bytes = b"",
        max_message_bytes: int = -1,
    ) -> None:
        self._topic = topic
        self._max_message_bytes = max_message_bytes  # a reply over it times its request out
        self._security = security
        self._context = context
        self._endpoint = endpoint
        self._timeout = timeout
        self._probe_timeout = probe_timeout
        self._inbox = inbox
        self.refusals = 0
        self._dealer = self._open()
        self._serving: trio.CancelScope | None = None  # the request under way, to give up

    def _open(self) -> TrioSocket:
        sock = self._context.socket(zmq.DEALER)
        try:
            sock.setsockopt(zmq.RCVHWM, 0)  # a replay is bounded by the publisher's buffer
            sock.setsockopt(zmq.MAXMSGSIZE, self._max_message_bytes)
            if self._security is not None:
                self._security.apply(sock)
            attach(sock, self._endpoint, bind=False)
        except BaseException:
            sock.close(linger=0)
            raise
        return TrioSocket(sock)

    def close(self) -> None:
        self._dealer.close()

    def _renew(self) -> None:
        """A new socket, so a new identity: late replies to what was given up die with the old."""
        self._dealer.close()
        self._dealer = self._open()

    def supersede(self) -> None:
        """A newer request is on its way: the one under way is of no use now (the sequencer
        replaced it), and is given up at once rather than when it times out."""
        if self._serving is not None:
            self._serving.cancel()

    @trio.lowlevel.enable_ki_protection
    async def run(self, requests: trio.MemoryReceiveChannel[Request]) -> None:
        async for request in requests:
            if requests.statistics().current_buffer_used:
                continue  # a newer one is queued behind it
            with trio.CancelScope() as scope:
                self._serving = scope
                await self._serve(request, requests)
            self._serving = None
            if scope.cancelled_caught:
                self._renew()  # its late replies die with the old socket

    async def _serve(self, request: Request, requests: trio.MemoryReceiveChannel[Request]) -> None:
        if isinstance(request, RequestSnapshot):
            asking = frames.snapshot_request()
        else:
            asking = frames.tskv_replay_request(request.start_seq)  # the end says the epoch
        await self._dealer.send(asking)
        probe = isinstance(request, RequestReplay) and request.probe
        attempt = ReplayAttempt(self._endpoint, self._timeout, probe, self._probe_timeout)
        taken = 0
        while True:
            with trio.move_on_after(attempt.wait) as waiting:
                message = await self._dealer.receive()
            if waiting.cancelled_caught:
                await self._give_up(request, attempt.timed_out())
                return
            taken += 1
            if taken % SUPERSEDED_EVERY == 0 and requests.statistics().current_buffer_used:
                # The sequencer has moved on (a restart, a snapshot over its limit): this
                # reply could go on for as long as the publisher likes, and is no use now.
                self._renew()
                return
            try:
                reply = frames.parse_replay_reply(message)
            except frames.FrameError as exc:
                await self._inbox.send(BadFrames(f"replay reply: {exc}"))
                continue
            if isinstance(reply, frames.SnapshotPart):
                await self._inbox.send(SnapshotPart(request.request_id, reply))
                continue
            if isinstance(reply, frames.DescriptorReply):  # never asked on this socket
                await self._inbox.send(BadFrames("replay reply: a descriptor, not asked for"))
                continue
            unsubscribed = reply.topic is not None and not reply.topic.startswith(self._topic)
            if unsubscribed and not reply.is_end:
                continue  # a topic not subscribed to: filtered as the SUB socket filters
            if reply.refusal is None:
                await self._inbox.send(Replayed(request.request_id, reply))
                if reply.is_end:
                    return
                continue
            self.refusals += 1
            decision = attempt.refused(trio.current_time(), reply.refusal)
            if isinstance(decision, GiveUp):
                await self._give_up(request, decision)
                return
            await trio.sleep(decision.after)
            if requests.statistics().current_buffer_used:
                return  # a newer request supersedes this one
            await self._dealer.send(asking)

    async def _give_up(self, request: Request, decision: GiveUp) -> None:
        if decision.warning is not None:
            logger.warning("%s", decision.warning)
        if decision.new_socket:
            self._renew()
        await self._inbox.send(ReplayFailed(request.request_id, decision.reason))
