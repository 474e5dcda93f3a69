"""One task that reads every live SUB socket of a watcher, each wake-up taking what is waiting
on all the sockets that signalled.

A task per socket cost a wake-up, an epoll re-arm and two EVENTS reads per message. Here the
sockets' ZeroMQ fds sit in one epoll set of our own, Trio waits on that set's fd, and one pass
drains every socket it names, so messages that arrive together (workers publishing in step, a
reader that fell behind) are taken together, for the price of one wake-up.

Messages that come one after another (workers publishing in turn, each a wakeup of its own,
which costs more CPU in Trio than taking the message) are gathered: while they come less than
`gather` apart (the time between them is tracked, half the last pass's and half what it was),
the pump makes its next pass `gather` after the last, whatever signalled meanwhile, so that a
pass takes one message or more; a pass that finds nothing puts it back on the sockets. A
message waits at most `gather` for its pass (GATHER in a router's own watcher; a reader
process, whose frames wait anyway, gathers longer), and messages further apart (a few workers,
or a quiet stream) are each taken as it comes, a wakeup each: a timer pass would most often
find nothing, and cost one more.

A watcher's follower that waits on an empty inbox is not woken for its messages: the feed's
`inline` (`_following.deliver_now`) sequences them and applies their batches in the pump's pass,
as the follower would have, one task switch less a batch (about a twentieth of a reader's CPU
at 64 workers); such a pass lets other tasks run every 0.5 ms (`Pacer`). Otherwise each
socket's messages go to its subscriber's inbox as one `Live` item, never waiting: when the inbox
is full, they are kept aside and the socket is taken out of the set (its fd would otherwise
signal on every pass) until the subscriber takes an item from its `Feed`. Linux only
(`select.epoll`); elsewhere, and for a lone subscriber, each socket has its own reader task.
"""

from __future__ import annotations

import select
from collections.abc import Callable
from typing import cast

import trio
import zmq

from tskv.shells._background import Pacer
from tskv.shells._inbox import Inbound, Live
from tskv.shells._trio_zmq import TrioSocket

LIVE_BURST = 64  # live messages taken off one socket in one go
GATHER = 0.002  # seconds between passes while messages keep coming (a router's own watcher)
PUMP_AVAILABLE = hasattr(select, "epoll")


class Clock:
    """When a subscriber's live stream last brought a message (Trio's clock)."""

    def __init__(self) -> None:
        self.heard = trio.current_time()

    def take(self, sub: TrioSocket) -> list[list[bytes]]:
        """What waits on `sub` (at most a burst, perhaps nothing), noting when it came; asked
        when its fd or EVENTS just signalled."""
        messages = sub.receive_waiting(LIVE_BURST, signalled=True)
        if messages:
            self.heard = trio.current_time()
        return messages


@trio.lowlevel.enable_ki_protection  # Ctrl-C belongs to the caller's code, not here
async def read_alone(sub: TrioSocket, inbox: trio.MemorySendChannel[Inbound], clock: Clock) -> None:
    """A lone subscriber's reader (no pump): every message waiting at once, as one item.
    Sending to the inbox is a checkpoint; a wake-up that finds nothing makes its own, so the
    loop never spins without yielding."""
    while True:
        await sub.wait(zmq.POLLIN)
        messages = clock.take(sub)
        if messages:
            await inbox.send(Live(messages))
        else:  # EVENTS said a message was there and none was
            await trio.lowlevel.checkpoint()


class Feed(trio.abc.ReceiveChannel[Inbound]):
    """One subscriber's socket in the pump, and its inbox as the subscriber takes from it:
    taking an item lets a feed held back go on, and a socket the pump gave up raises why."""

    def __init__(
        self,
        pump: LivePump,
        sub: TrioSocket,
        inbox: tuple[trio.MemorySendChannel[Inbound], trio.MemoryReceiveChannel[Inbound]],
        clock: Clock,
    ) -> None:
        self._pump = pump
        self.sub = sub
        self.fd = cast(int, sub.sock.getsockopt(zmq.FD))
        self.inbox, self._taking = inbox
        self.clock = clock
        self.kept: list[list[bytes]] | None = None  # taken off the socket, the inbox full
        self.held = False  # out of the epoll set until its subscriber takes an item
        self.failure: Exception | None = None  # why the pump gave this socket up
        # a watcher's: delivers live messages in the follower's stead (`deliver_now`)
        self.inline: Callable[[list[list[bytes]]], bool | None] | None = None

    def idle(self) -> bool:
        """Its subscriber waits on an empty inbox: nothing it took is still on its way."""
        statistics = self._taking.statistics()
        return statistics.tasks_waiting_receive > 0 and not statistics.current_buffer_used

    async def receive(self) -> Inbound:
        try:
            item = await self._taking.receive()
        except trio.EndOfChannel:
            if self.failure is not None:
                raise self.failure from None
            raise
        if self.held:
            self._pump._resume(self)
        return item

    async def aclose(self) -> None:
        await self._taking.aclose()

    def close(self) -> None:
        """Out of the pump, before its socket closes (an epoll set must not hold a closed fd)."""
        self._pump._remove(self)


class LivePump:
    """Reads the live sockets of every subscriber added, in one task (`run`), in passes
    `gather` apart while messages keep coming. `after_pass` is called at the end of each pass:
    a reader process's outbox sends its frame then, in the pump's wakeup, not on a timer of its
    own. `busy`: a pass is under way or the next is due within `gather`."""

    def __init__(self, gather: float = GATHER) -> None:
        self.gather = gather
        self.after_pass: Callable[[], object] | None = None
        self.busy = False
        self._poller = select.epoll()
        self._feeds: dict[int, Feed] = {}  # fd -> its feed
        self._again: dict[Feed, None] = {}  # feeds to try on the next pass, whatever epoll says
        self._waiting: trio.CancelScope | None = None
        self.wakeups = 0  # passes made: messages / wakeups is what one pass saves
        self.messages = 0
        self._pacer = Pacer()  # a pass that delivers batches itself lets others run between

    def add(
        self,
        sub: TrioSocket,
        inbox: tuple[trio.MemorySendChannel[Inbound], trio.MemoryReceiveChannel[Inbound]],
        clock: Clock,
    ) -> Feed:
        """Read `sub` here, into `inbox`; its subscriber takes from the feed returned."""
        feed = Feed(self, sub, inbox, clock)
        self._poller.register(feed.fd, select.EPOLLIN)
        self._feeds[feed.fd] = feed
        self._wake(feed)  # messages may be waiting already: its fd signalled before it was in
        return feed

    def _remove(self, feed: Feed) -> None:
        if self._feeds.get(feed.fd) is feed:
            del self._feeds[feed.fd]
            if not feed.held and not self._poller.closed:  # else out of the set already
                self._poller.unregister(feed.fd)
        self._again.pop(feed, None)

    def _resume(self, feed: Feed) -> None:
        if self._feeds.get(feed.fd) is feed and not self._poller.closed:
            feed.held = False
            self._poller.register(feed.fd, select.EPOLLIN)
            self._wake(feed)

    def _wake(self, feed: Feed) -> None:
        self._again[feed] = None
        if self._waiting is not None:
            self._waiting.cancel()

    @trio.lowlevel.enable_ki_protection  # Ctrl-C belongs to the caller's code
    async def run(self) -> None:
        gather = self.gather
        gathering, spacing, last = False, gather, None  # spacing: seconds between messages
        try:
            while True:
                if self._again:
                    await trio.lowlevel.checkpoint()  # the subscribers run between passes
                else:
                    with trio.CancelScope() as self._waiting:
                        if gathering:
                            await trio.sleep(gather)
                        else:
                            await trio.lowlevel.wait_readable(self._poller.fileno())
                    self._waiting = None
                self.busy = True
                self._pacer.waited()
                self.wakeups += 1
                ready, self._again = self._again, {}
                for fd, _ in self._poller.poll(0):
                    ready[self._feeds[fd]] = None
                before = self.messages
                for feed in ready:
                    if self._pacer.due():
                        await self._pacer.yield_now()
                    if self._feeds.get(feed.fd) is feed:  # not removed meanwhile
                        self._pass(feed)
                if taken := self.messages - before:
                    now = trio.current_time()
                    if last is not None:
                        spacing = (spacing + (now - last) / taken) / 2
                    last = now
                gathering = taken > 0 and spacing < gather
                self.busy = gathering or bool(self._again)
                if self.after_pass is not None:
                    self.after_pass()
        finally:
            self._poller.close()

    def _pass(self, feed: Feed) -> None:
        """Move what waits on `feed`'s socket to its inbox. A feed whose inbox is full keeps
        what it took and is held back; one whose burst was whole is tried again next pass."""
        try:
            messages, feed.kept = feed.kept or feed.clock.take(feed.sub), None
            if not messages:
                return
            delivered = None
            if feed.inline is not None and feed.idle():
                delivered = feed.inline(messages)
            try:
                if delivered is None:
                    feed.inbox.send_nowait(Live(messages))
                elif not delivered:  # the rest is its subscriber's: it waits, so this fits
                    feed.inbox.send_nowait(Live([]))
            except trio.WouldBlock:  # never after delivering: the inbox was empty
                feed.kept, feed.held = messages, True
                self._poller.unregister(feed.fd)
                return
            self.messages += len(messages)
            if len(messages) == LIVE_BURST:
                self._again[feed] = None
        except Exception as exc:  # this subscriber's socket failed, not the others'
            feed.failure = exc
            self._remove(feed)
            feed.inbox.close()  # its subscriber ends, and raises the failure
