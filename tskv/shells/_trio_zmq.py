"""A Trio face for one pyzmq socket, owned by one task.

ZeroMQ signals readiness through one edge-like fd per socket: it becomes readable when the
socket's EVENTS may have changed, and reading EVENTS re-arms it. So every operation is tried
first with NOBLOCK, and only when it would block do we wait on the fd, re-reading EVENTS after
each wake-up. Waiting before trying loses wake-ups when messages are already queued.

Checkpoints follow Trio's socket methods: a cancellation check before, a shielded yield after a
success, so each call is a full checkpoint and a cancelled call never sent or took a message.
ZeroMQ multipart messages are atomic, so a message is either wholly sent or not at all.
"""

from __future__ import annotations

import errno
from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast

import trio
import zmq

from tskv.core.errors import TskvError

Frames = Sequence[Any]

# Plain ints: combining pyzmq's enum flags per call costs more than the send or receive itself.
_MORE = int(zmq.NOBLOCK) | int(zmq.SNDMORE)
_LAST = int(zmq.NOBLOCK)
_POLLIN = int(zmq.POLLIN)
_EVENTS = int(zmq.EVENTS)


ZERO_COPY_BYTES = 65536  # pyzmq copies smaller frames anyway; zero-copy pays above this


class TrioSocket:
    """Async send and receive of whole multipart messages; one task per socket, always."""

    def __init__(self, sock: zmq.Socket[bytes]) -> None:
        self.sock = sock
        self._fd = cast(int, sock.getsockopt(zmq.FD))
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise trio.ClosedResourceError("this ZeroMQ socket was closed")

    async def wait(self, flag: int) -> None:
        """Wait until EVENTS has `flag` (zmq.POLLIN or zmq.POLLOUT)."""
        self._check_open()
        wanted = int(flag)  # a pyzmq enum flag: `&` on it is Python code
        while not cast(int, self.sock.getsockopt(_EVENTS)) & wanted:
            try:
                await trio.lowlevel.wait_readable(self._fd)
            except trio.ClosedResourceError:
                raise trio.ClosedResourceError(
                    "this ZeroMQ socket was closed while a task was waiting on it"
                ) from None
            self._check_open()

    def send_nowait(self, frames: Frames, copy: bool = True) -> None:
        """Send a whole message now, or raise trio.WouldBlock having sent nothing."""
        self._check_open()
        send = self.sock.send
        last = len(frames) - 1
        try:
            # Only the first frame can be refused: ZeroMQ takes the rest of a message it began.
            send(frames[0], _MORE if last else _LAST, copy=copy)
        except zmq.Again:
            raise trio.WouldBlock from None
        for index in range(1, last):
            send(frames[index], _MORE, copy=copy)
        if last:
            send(frames[last], _LAST, copy=copy)

    async def send(self, frames: Frames, copy: bool = True) -> None:
        await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            try:
                self.send_nowait(frames, copy)
            except trio.WouldBlock:
                await self.wait(zmq.POLLOUT)
            else:
                break
        await trio.lowlevel.cancel_shielded_checkpoint()

    def receive_nowait(self) -> list[bytes]:
        """Take a whole message now, or raise trio.WouldBlock having taken nothing."""
        self._check_open()
        try:
            return self.sock.recv_multipart(flags=_LAST)
        except zmq.Again:
            raise trio.WouldBlock from None

    def receive_waiting(self, limit: int, *, signalled: bool = False) -> list[list[bytes]]:
        """The messages waiting now, at most `limit`, perhaps none. Asks EVENTS before each
        receive instead of letting the last one fail: pyzmq's zmq.Again costs twice as much
        as reading EVENTS, and a subscriber at a worker's pace takes one message a wake-up.
        `signalled`: the socket just said a message came (its fd, or EVENTS), which nearly
        always holds (in the fleet bench 32 of 15,700 passes found none), so the first receive
        is tried without asking; one that fails asks EVENTS all the same, which the fd needs to
        signal again. Each frame is taken as a zmq.Frame, whose `more` says whether another
        follows: `recv_multipart` asks RCVMORE after each, a call into libzmq a frame more.
        """
        self._check_open()
        sock = self.sock
        taken: list[list[bytes]] = []
        if signalled:
            try:
                first: zmq.Frame | None = sock.recv(_LAST, copy=False)
            except zmq.Again:
                first = None
            if first is not None:
                taken.append(self._rest(first))
        while len(taken) < limit and cast(int, sock.getsockopt(_EVENTS)) & _POLLIN:
            taken.append(self._rest(sock.recv(_LAST, copy=False)))
        return taken

    def _rest(self, frame: zmq.Frame) -> list[bytes]:
        """The message `frame` begins, whole."""
        message = [frame.bytes]
        while frame.more:
            frame = self.sock.recv(_LAST, copy=False)
            message.append(frame.bytes)
        return message

    def receive_frames_nowait(self) -> list[zmq.Frame]:
        """Like receive_nowait, as zmq.Frame objects: they carry the message's properties."""
        self._check_open()
        try:
            return self.sock.recv_multipart(flags=_LAST, copy=False)
        except zmq.Again:
            raise trio.WouldBlock from None

    async def receive(self) -> list[bytes]:
        await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            try:
                frames = self.receive_nowait()
            except trio.WouldBlock:
                await self.wait(zmq.POLLIN)
            else:
                break
        await trio.lowlevel.cancel_shielded_checkpoint()
        return frames

    def close(self, linger_ms: int = 0) -> None:
        """Wake any waiter with ClosedResourceError, then close, letting ZeroMQ send what it
        still holds for at most `linger_ms` (its default, forever, would make context
        termination hang on an absent peer)."""
        if self._closed:
            return
        self._closed = True
        trio.lowlevel.notify_closing(self._fd)
        self.sock.close(linger=linger_ms)


def bound_endpoint(sock: zmq.Socket[bytes]) -> str:
    """The address the socket really uses (a tcp port 0 or * resolved by the OS)."""
    value = sock.getsockopt(zmq.LAST_ENDPOINT)
    return value.decode() if isinstance(value, bytes) else str(value)


class AttachError(TskvError, OSError, zmq.ZMQError):  # type: ignore[misc]  # strerror: str | None vs str
    """A socket that cannot bind or connect. An OSError, as it always was here, and a
    zmq.ZMQError, which is what TokenSpeed's callers catch around its constructor."""


_ATTACH_FIXES = {
    errno.EADDRINUSE: (
        "; another process (or another socket of this one) holds that port: stop it, or use "
        "another port (tcp://127.0.0.1:* lets the OS pick a free one)"
    ),
    errno.EADDRNOTAVAIL: (
        "; no interface of this machine has that address: use one it has (127.0.0.1 for "
        "this machine alone)"
    ),
    errno.EACCES: "; a port below 1024 needs privileges: use a higher one",
}


def attach(sock: zmq.Socket[bytes], endpoint: str, bind: bool) -> str:
    """Bind or connect `sock` to `endpoint` and return the address really used."""
    if "[" in endpoint or "::" in endpoint:
        sock.setsockopt(zmq.IPV6, 1)
    try:
        if bind:
            sock.bind(endpoint)
        else:
            sock.connect(endpoint)
    except zmq.ZMQError as exc:
        action = "bind" if bind else "connect"
        fix = _ATTACH_FIXES.get(exc.errno or 0, "")
        raise AttachError(exc.errno, f"cannot {action} {endpoint!r}: {exc.strerror}{fix}") from exc
    return bound_endpoint(sock) if bind else endpoint


class Secures(Protocol):
    """CURVE settings that can be put on a socket (the server and client sides)."""

    def apply(self, sock: zmq.Socket[bytes]) -> None: ...


def open_socket(
    context: zmq.Context[zmq.Socket[bytes]],
    kind: int,
    endpoint: str,
    bind: bool,
    hwm: int,
    security: Secures | None = None,
    max_message_size: int = -1,
    prepare: Callable[[zmq.Socket[bytes], str], object] | None = None,
) -> tuple[TrioSocket, str]:
    """A publisher-side socket, set up as tskv needs it, bound or connected.

    An XPUB is a PUB on the wire that also reports every subscription, so a publisher can wait
    for subscribers instead of sleeping. A ROUTER gets ROUTER_MANDATORY: without it, replies
    to a slow client are silently dropped at the high-water mark, truncating its replay.
    `max_message_size` bounds what a peer may send (a larger message disconnects it);
    `prepare(sock, label)` runs just before the socket binds or connects (to attach a monitor).
    """
    sock = context.socket(kind)
    try:
        sock.setsockopt(zmq.SNDHWM, hwm)
        sock.setsockopt(zmq.MAXMSGSIZE, max_message_size)
        if security is not None:
            security.apply(sock)
        if kind == zmq.XPUB:
            sock.setsockopt(zmq.XPUB_VERBOSER, 1)
        if kind == zmq.ROUTER:
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if prepare is not None:
            prepare(sock, f"{'replay' if kind == zmq.ROUTER else 'publisher'} {endpoint}")
        address = attach(sock, endpoint, bind)
    except BaseException:
        sock.close(linger=0)
        raise
    return TrioSocket(sock), address
