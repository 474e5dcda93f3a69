"""Connection events of one socket, so failures that ZeroMQ keeps to itself get seen.

A CURVE handshake that fails (a wrong server key, a clear-text peer, a refused client key) or
a publisher that never answers leaves both ends silent: ZeroMQ retries quietly forever. A
monitor task reads the socket's event stream, counts handshakes that succeed and fail, and logs
failures (rate-limited) with what the user can do about them.

The opposite happens too: a working connection that ZeroMQ ends for a protocol error (a
message over the socket's MAXMSGSIZE, or bytes that are not ZMTP) is never retried, and a
subscriber would hear nothing more, for good. ZeroMQ says `CONNECT_RETRIED` right after any
disconnect it will retry; when that does not come, a connecting socket's monitor connects it
again itself.

A connecting subscriber's monitor also tells its subscriber (through its inbox) when the
connection drops and comes back, so a publisher that exited is known at once and one that
restarted is checked; and when a handshake is refused for good: the peer refused this side's
key, the security did not match, or it failed REFUSALS_FINAL times in a row with no detail
(a wrong server key looks like that). A single undetailed failure is not final: a peer that
goes away mid-handshake causes one. Telling never waits on the subscriber's consumer, which may
not be reading: the monitor keeps counting and logging, and what it has yet to tell is owed,
bounded (a drop and a return at most, the latest kept; or the refusal, which ends it all).
"""

from __future__ import annotations

import contextlib
import logging
import math
import secrets
from typing import cast

import trio
import zmq
from zmq.utils.monitor import parse_monitor_message

from tskv.shells._inbox import Connection, HandshakeRefused, Inbound
from tskv.shells._ratelimit import LogLimiter
from tskv.shells._trio_zmq import TrioSocket

logger = logging.getLogger(__name__)

_FAILED = {
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
    zmq.EVENT_HANDSHAKE_FAILED_AUTH,
}
_EVENTS = cast(int, zmq.EVENT_HANDSHAKE_SUCCEEDED)
for _event in (*_FAILED, zmq.EVENT_DISCONNECTED, zmq.EVENT_CONNECT_RETRIED):
    _EVENTS |= cast(int, _event)
RETRIED_WITHIN = 1.0  # seconds; libzmq's I/O thread says CONNECT_RETRIED microseconds after
REFUSALS_FINAL = 3  # undetailed handshake failures in a row that are a refusal for good
# pyzmq names a monitor's inproc endpoint after the socket's fd, and fds are reused: a socket
# opened while a closed one's monitor endpoint still lingers failed with "Address already in
# use". A random name of our own does not repeat, and needs no counter kept by the module.


class SocketMonitor:
    """Watches one socket from before it binds or connects; `run` is its task.

    `hint` finishes the log line for a failed handshake: what this side's user should check.
    `reattach`: the endpoint the socket connects to, connected again when ZeroMQ will not;
    `dropped_hint` says why that happens, for the log. `inbox`: where a connecting subscriber
    hears of its connection (`Connection`, `HandshakeRefused`).
    """

    def __init__(
        self,
        sock: zmq.Socket[bytes],
        label: str,
        hint: str,
        reattach: str | None = None,
        dropped_hint: str = "",
        inbox: trio.MemorySendChannel[Inbound] | None = None,
    ) -> None:
        self.label = label
        self._inbox = inbox
        self.hint = hint
        self.handshakes = 0
        self.handshake_failures = 0
        self.reattached = 0  # working connections ZeroMQ ended for good, connected again here
        self._reattach = reattach
        self._dropped_hint = dropped_hint
        self._owed: list[Connection | HandshakeRefused] = []  # notices not yet in the inbox
        self._owing = trio.Event()
        self.answered = trio.Event()  # set at the first successful handshake
        self.stopped = False  # the socket no longer reports to this monitor
        self._watched = sock
        address = f"inproc://tskv-monitor-{secrets.token_hex(8)}"
        self._events = TrioSocket(sock.get_monitor_socket(_EVENTS, address))
        self._log = LogLimiter()

    @trio.lowlevel.enable_ki_protection  # Ctrl-C belongs to the caller's code, not here
    async def run(self) -> None:
        if self._inbox is None:
            await self._watch()
            return
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._deliver, self._inbox)
            await self._watch()

    async def _watch(self) -> None:
        working = False  # the connection's handshake succeeded (a refused one is not retried)
        dropped = False  # a working connection ended, and ZeroMQ has not said it will retry it
        refused = 0  # handshakes failed since the last that succeeded
        while True:
            with trio.move_on_after(RETRIED_WITHIN if dropped else math.inf) as waiting:
                event = parse_monitor_message(await self._events.receive())
            if waiting.cancelled_caught:
                dropped = False
                self._attach_again()
                continue
            kind = event["event"]
            if kind == zmq.EVENT_DISCONNECTED:
                if working and self._inbox is not None:
                    self._tell(Connection(up=False))
                dropped, working = working and self._reattach is not None, False
            elif kind == zmq.EVENT_CONNECT_RETRIED:
                dropped = False
            elif kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                working, refused = True, 0
                self.handshakes += 1
                self.answered.set()
                if self.handshakes > 1 and self._inbox is not None:
                    self._tell(Connection(up=True))
            elif kind in _FAILED:
                self.handshake_failures += 1
                refused += 1
                peer = event["endpoint"].decode(errors="replace")
                # a subscriber raises the refusal, saying the same: its log would repeat it
                log = self._log.warning if self._inbox is None else logger.debug
                log(
                    "%s: handshake with %s failed (%s); %s (%d failed so far)",
                    self.label,
                    peer,
                    _describe(kind),
                    self.hint,
                    self.handshake_failures,
                )
                final = kind != zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL or refused >= REFUSALS_FINAL
                if final and self._inbox is not None:
                    times = f", {refused} times in a row" if refused > 1 else ""
                    why = f"{_describe(kind)}{times}"
                    refused_for_good = f"the handshake with {peer} failed ({why}); {self.hint}"
                    self._tell(HandshakeRefused(refused_for_good))
                    self._inbox = None  # said once: the subscriber raises it

    def _tell(self, notice: Connection | HandshakeRefused) -> None:
        """Owe `notice` to the inbox. Drops and returns alternate, so a run of them that the
        consumer has not taken yet comes down to its last one or two: the connection's state
        now, and whether it was lost on the way. A refusal makes the rest moot."""
        if isinstance(notice, HandshakeRefused) or len(self._owed) == 2:
            self._owed.clear()
        self._owed.append(notice)
        self._owing.set()

    @trio.lowlevel.enable_ki_protection
    async def _deliver(self, inbox: trio.MemorySendChannel[Inbound]) -> None:
        while True:
            await self._owing.wait()
            self._owing = trio.Event()
            while self._owed:
                await inbox.send(self._owed.pop(0))

    def _attach_again(self) -> None:
        assert self._reattach is not None
        self.reattached += 1
        self._log.warning(
            "%s: ZeroMQ dropped the connection and will not retry it (%s); connecting again "
            "(%d so far)",
            self.label,
            self._dropped_hint,
            self.reattached,
        )
        with contextlib.suppress(zmq.ZMQError):  # no longer in ZeroMQ's list
            self._watched.disconnect(self._reattach)
        self._watched.connect(self._reattach)

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
