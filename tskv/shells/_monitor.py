"""Connection events of one socket, so failures that ZeroMQ keeps to itself get seen.

A CURVE handshake that fails (a wrong server key, a clear-text peer, a refused client key) or
a publisher that never answers leaves both ends silent: ZeroMQ retries quietly forever. A
monitor task reads the socket's event stream, counts handshakes that succeed and fail, and logs
failures (rate-limited) with what the user can do about them.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from typing import cast

import trio
import zmq
from zmq.utils.monitor import parse_monitor_message

from tskv.shells._ratelimit import LogLimiter
from tskv.shells._trio_zmq import TrioSocket

logger = logging.getLogger(__name__)

_FAILED = {
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
    zmq.EVENT_HANDSHAKE_FAILED_AUTH,
}
_EVENTS = cast(int, zmq.EVENT_HANDSHAKE_SUCCEEDED)
for _event in _FAILED:
    _EVENTS |= cast(int, _event)
# pyzmq names a monitor's inproc endpoint after the socket's fd, and fds are reused: a socket
# opened while a closed one's monitor endpoint still lingers failed with "Address already in
# use". A name of our own never repeats.
_MONITOR_NAMES = itertools.count()


class SocketMonitor:
    """Watches one socket from before it binds or connects; `run` is its task.

    `hint` finishes the log line for a failed handshake: what this side's user should check.
    """

    def __init__(self, sock: zmq.Socket[bytes], label: str, hint: str) -> None:
        self.label = label
        self.hint = hint
        self.handshakes = 0
        self.handshake_failures = 0
        self.answered = trio.Event()  # set at the first successful handshake
        self.stopped = False  # the socket no longer reports to this monitor
        self._watched = sock
        address = f"inproc://tskv-monitor-{next(_MONITOR_NAMES)}"
        self._events = TrioSocket(sock.get_monitor_socket(_EVENTS, address))
        self._log = LogLimiter()

    @trio.lowlevel.enable_ki_protection  # Ctrl-C belongs to the caller's code, not here
    async def run(self) -> None:
        while True:
            event = parse_monitor_message(await self._events.receive())
            kind = event["event"]
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.handshakes += 1
                self.answered.set()
            elif kind in _FAILED:
                self.handshake_failures += 1
                peer = event["endpoint"].decode(errors="replace")
                self._log.warning(
                    "%s: handshake with %s failed (%s); %s (%d failed so far)",
                    self.label,
                    peer,
                    _describe(kind),
                    self.hint,
                    self.handshake_failures,
                )

    def close(self) -> None:
        """Stop the socket reporting, then close this end; call it before closing the socket
        (closed, the socket cannot be stopped, and the events of its teardown block libzmq)."""
        if not self.stopped:
            with contextlib.suppress(zmq.ZMQError):  # the watched socket is closed already
                self._watched.disable_monitor()
                self.stopped = True
        self._events.close()


def _describe(kind: int) -> str:
    if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return "the peer refused this side's key"
    if kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        return "protocol or security mismatch"
    return "no detail from ZeroMQ"
