"""The replay task: the one task that owns the publisher's ROUTER socket.

It reads requests, hands each to the I/O-free `ReplayServer`, and sends what the server gives
back, a bounded amount of work between checkpoints, so no client (and no flood of requests)
can hold up live batches, or the scheduler whose loop this runs in. The bound is in time as well
as in messages: a snapshot part is encoded when it is sent (2-5 ms for 1,024 blocks), so 256 of
them in one turn would hold the loop for a second. A client whose pipe is full or who is gone
is the server's to decide about; this task only reports what it abandons.
"""

from __future__ import annotations

import errno
import logging
import time

import trio
import zmq

from tskv.core.replay_limits import Peer
from tskv.core.replay_server import Outcome, Received, ReplayServer, ReplayStatistics
from tskv.shells._ratelimit import LogLimiter
from tskv.shells._trio_zmq import ZERO_COPY_BYTES, TrioSocket

logger = logging.getLogger(__name__)

REQUESTS_PER_TURN = 64  # replay requests read between two checkpoints...
SENDS_PER_TURN = 256  # ...and replies sent: a flood of either cannot hold up live batches...
TURN_SECONDS = 0.002  # ...and a turn ends once it has taken this long (after the message at hand)


class ReplayTask:
    """Owns the ROUTER socket and the server that decides for it; `run` is the task."""

    def __init__(self, router: TrioSocket, endpoint: str, server: ReplayServer) -> None:
        self.endpoint = endpoint  # as really bound
        self._router = router
        self._server = server
        self._invalid_log = LogLimiter()
        self._refusal_log = LogLimiter()

    def statistics(self) -> ReplayStatistics:
        return self._server.statistics()

    @property
    def epoch(self) -> int | None:
        return self._server.epoch

    @trio.lowlevel.enable_ki_protection
    async def run(self) -> None:
        router, server = self._router, self._server
        while True:
            wait = server.wait_time()
            if wait is None:
                await router.wait(zmq.POLLIN)
            elif wait > 0:
                with trio.move_on_after(wait):
                    await router.wait(zmq.POLLIN)
            ends = time.perf_counter() + TURN_SECONDS  # a snapshot request copies the state
            for _ in range(REQUESTS_PER_TURN):
                try:
                    message = router.receive_frames_nowait()
                except trio.WouldBlock:
                    break
                self._log_request(server.receive([f.bytes for f in message], _peer(message)))
                if time.perf_counter() > ends:
                    break
            ends = time.perf_counter() + TURN_SECONDS
            for _ in range(SENDS_PER_TURN):
                if not self._send_next() or time.perf_counter() > ends:
                    break
            await trio.lowlevel.checkpoint()  # live batches go out between turns

    def _send_next(self) -> bool:
        """Send the server's next reply; False when it has none ready."""
        server = self._server
        out = server.next_send()
        if out is None:
            return False
        try:
            self._router.send_nowait(out.frames, len(out.frames[-1]) < ZERO_COPY_BYTES)
        except trio.WouldBlock:  # the client's pipe is full (ROUTER_MANDATORY)
            abandoned = server.blocked(out)
        except zmq.ZMQError as exc:
            if exc.errno != errno.EHOSTUNREACH:
                raise
            abandoned = server.gone(out)
        else:
            server.sent(out)
            return True
        if abandoned is not None:
            logger.warning(
                "abandoned the replay to client %s at seq %d: it %s",
                abandoned.client.hex(),
                abandoned.next_seq,
                abandoned.why,
            )
        return True

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
