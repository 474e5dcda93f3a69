"""The publish task: the one task that owns the PUB (XPUB) socket.

It takes payloads off the queue `publish()` fills, assigns each its seq by appending it to the
replay buffer *before* sending it (so a failed send is still replayable), sends every queued
batch it can between checkpoints, follows each sent batch in the cache state snapshots are made
from, and counts subscriptions. When the publisher's block is left it drains what is queued,
shielded from the caller's cancellation and bounded by the shutdown deadline.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Sequence

import attrs
import trio
import zmq

from tskv.core import frames
from tskv.core.descriptor import PublishedGroups
from tskv.core.events import KVEvent
from tskv.core.replay_buffer import ReplayBuffer
from tskv.core.snapshot import CacheState
from tskv.shells._trio_zmq import ZERO_COPY_BYTES, TrioSocket

logger = logging.getLogger(__name__)

Queued = tuple[bytes, Sequence[KVEvent]]  # a batch's payload, and its events for the state
SEND_BURST = 1024  # batches sent between two checkpoints
SUBSCRIPTIONS_PER_TURN = 1024  # (un)subscriptions counted at once; the rest wait a turn


@attrs.define
class PublisherCounts:
    """A publisher's running counts, in the one object `publish()` and the publish task change,
    which `Publisher.statistics()` freezes with what it reads live (queued, seqs, monitors)."""

    accepted: int = 0  # batches publish() took
    published: int = 0  # sent
    unsent: int = 0  # accepted and never sent: the shutdown deadline passed, or a failure
    subscriptions: int = 0  # matching the topic, as the XPUB socket reported them


class PublishTask:
    """Owns the PUB socket and the queue's receiving end; `run` is the task."""

    def __init__(
        self,
        pub: TrioSocket,
        endpoint: str,
        topic: bytes,
        queue: trio.MemoryReceiveChannel[Queued],
        buffer: ReplayBuffer,
        state: CacheState | PublishedGroups | None,
        on_dequeue: Callable[[], object] | None,
    ) -> None:
        self.endpoint = endpoint
        self._pub = pub
        self._topic = topic
        self._queue = queue
        self._buffer = buffer
        # what snapshots are made from, or only the groups a descriptor names; None: neither
        self._state = state
        self._on_dequeue = on_dequeue  # the threaded facade counts its slots with it
        self.counts = PublisherCounts()
        self.subscription_change = trio.lowlevel.ParkingLot()
        self._in_hand: list[Queued | None] = []  # what the idle race has taken off the queue
        self._waiting_on_queue: trio.CancelScope | None = None  # idle, watching no socket
        self._thread = threading.get_ident()  # a ZeroMQ socket is used from one thread only
        # Shielded so the queue still drains when the caller's scope is cancelled; its deadline
        # is set when the block is left, which bounds the drain.
        self._scope = trio.CancelScope(shield=True)

    def stop_by(self, deadline: float) -> None:
        """The block was left: drain what is queued until `deadline` (Trio's clock)."""
        self._scope.deadline = deadline

    def close(self) -> None:
        """Close the PUB socket; ZeroMQ may go on sending what it holds until the deadline: a
        batch handed to it is not yet on the wire, and closing without lingering dropped the
        last ones of a drain."""
        left = self._scope.deadline - trio.current_time()
        self._pub.close(linger_ms=max(0, int(left * 1000)) if left != math.inf else 0)

    @trio.lowlevel.enable_ki_protection
    async def run(self) -> None:
        """Send until the queue is closed and empty (or the deadline passes)."""
        try:
            with self._scope:
                await self._send_all()
        finally:
            # However this task ends, what is still queued is counted before close drops it, and
            # so is a batch taken off the queue by a race that ended in an error.
            left = self._queue.statistics().current_buffer_used
            self._queue.close()
            self.counts.unsent += left + sum(queued is not None for queued in self._in_hand)
            self._log_close()

    async def _send_all(self) -> None:
        while True:
            try:
                queued = self._dequeued(await self._next_payload())
            except trio.EndOfChannel:
                return
            blocked = self._emit(queued)
            if blocked is not None:
                await self._emit_blocked(blocked)
            for _ in range(SEND_BURST - 1):  # written out: an await per batch would cost
                try:
                    queued = self._dequeued(self._queue.receive_nowait())
                except (trio.WouldBlock, trio.EndOfChannel):
                    break
                blocked = self._emit(queued)
                if blocked is not None:
                    await self._emit_blocked(blocked)
            else:
                await trio.lowlevel.checkpoint()  # a full burst: let other tasks run

    def _dequeued(self, queued: Queued) -> Queued:
        if self._on_dequeue is not None:
            self._on_dequeue()
        return queued

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
            self.counts.unsent += 1
            raise
        finally:
            # After the send, so following the state never delays a batch; in the same step as
            # the seq, so a snapshot (taken between steps) is the state at a seq.
            if self._state is not None:
                self._state.apply(payload, events)
        self.counts.published += 1
        return None

    async def _emit_blocked(self, message: list[bytes]) -> None:
        try:
            await self._pub.send(message)
        except BaseException:
            self.counts.unsent += 1
            raise
        self.counts.published += 1

    def _take_subscriptions(self) -> None:
        """Count (un)subscriptions the XPUB socket reports, and wake tasks waiting for one."""
        changed = False
        for message in self._pub.receive_waiting(SUBSCRIPTIONS_PER_TURN):  # no zmq.Again per batch
            change = frames.parse_subscription(message[0], self._topic)
            self.counts.subscriptions += change
            changed |= change != 0
        if changed:
            self.subscription_change.unpark_all()

    def count_subscriptions(self) -> None:
        """Count the subscriptions that have arrived, when idle on the queue alone (otherwise
        this task counts them itself: before each batch, and when the socket wakes it)."""
        if self._waiting_on_queue is not None and threading.get_ident() == self._thread:
            self._take_subscriptions()  # the socket is open and no task waits on it

    def watch_subscriptions(self) -> None:
        """A task is about to wait for a subscription: count what has arrived, and have an
        idle publish task watch the socket from now on, not the queue alone."""
        self.count_subscriptions()
        if self._waiting_on_queue is not None:
            self._waiting_on_queue.cancel()

    async def _next_payload(self) -> Queued:
        """The next queued payload; while idle, also keep track of subscriptions.

        Only this task waits on the PUB socket's fd: while a task waits for a subscription, two
        child tasks race the channel against the fd and whichever finishes first cancels the
        other. Otherwise it waits on the channel alone, and others may count subscriptions.
        """
        while True:
            self._take_subscriptions()
            try:
                return self._queue.receive_nowait()
            except trio.WouldBlock:
                pass
            # A busy producer usually queues the next batch while we yield once; only when the
            # queue stays empty is the (costlier) race worth setting up.
            await trio.lowlevel.checkpoint()
            try:
                return self._queue.receive_nowait()
            except trio.WouldBlock:
                pass
            if not self.subscription_change.statistics().tasks_waiting:
                # No one waits for a subscription, so wait on the queue alone: the race costs
                # a nursery and two tasks, and a publisher at a scheduler's pace is idle before
                # every batch. A task that starts waiting for one cancels this
                # (`watch_subscriptions`).
                try:
                    with trio.CancelScope() as self._waiting_on_queue:
                        return await self._queue.receive()
                finally:
                    self._waiting_on_queue = None
                continue
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
            got.append(await self._queue.receive())
        except trio.EndOfChannel:
            got.append(None)
        race.cancel()

    @trio.lowlevel.enable_ki_protection
    async def _watch_socket(self, race: trio.CancelScope) -> None:
        await self._pub.wait(zmq.POLLIN)
        race.cancel()

    def _log_close(self) -> None:
        counts = self.counts
        logger.info(
            "publisher on %s closed: %d batches accepted, %d published, %d unsent",
            self.endpoint,
            counts.accepted,
            counts.published,
            counts.unsent,
        )
        if counts.unsent:
            logger.error(
                "publisher on %s closed with %d accepted batches unsent (the shutdown deadline "
                "passed, or the publisher failed); raise shutdown_timeout to give the drain "
                "longer",
                self.endpoint,
                counts.unsent,
            )
