"""A publisher killed again and again, in every order its news can reach the subscriber: no
batch is ever lost silently.

A crash loop interleaves what the subscriber hears in ways no timing test covers: the old
generation's last batches still queued on the SUB socket, the new generation's first ones (or
only its later ones: a PUB drops what it sends before the subscription arrives), the connection
dropping and coming back, and replay answers (with or without an epoch) given by whichever
generation is up when the request arrives. This drives the I/O-free `Sequencer` through such
interleavings, chosen by hypothesis from a model of the publishers, and checks what a consumer
is told against what was published.
"""

from __future__ import annotations

from collections import deque

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tskv.core.actions import Action, Deliver, RequestReplay, RequestSnapshot, Silence, Synced
from tskv.core.losses import Loss, LossReason
from tskv.core.sequencer import Sequencer


class Generation:
    """One incarnation of the publisher: its epoch (None: one that says none, as
    TokenSpeed's), and every batch it published, all still in its replay buffer."""

    def __init__(self, index: int, epoch: int | None) -> None:
        self.index = index
        self.epoch = epoch
        self.published: list[bytes] = []

    def publish(self) -> tuple[int, bytes]:
        seq = len(self.published)
        payload = f"g{self.index}s{seq}".encode()
        self.published.append(payload)
        return seq, payload


def origin(payload: bytes) -> tuple[int, int]:
    generation, seq = payload[1:].split(b"s")
    return int(generation), int(seq)


class CrashLoop(RuleBasedStateMachine):
    @initialize(says_epoch=st.booleans())
    def start(self, says_epoch: bool) -> None:
        """A subscriber that follows the stream from its seq 0 (a live-only one owes nothing
        for what came before the first batch it heard)."""
        self.says_epoch = says_epoch
        self.epochs = iter(range(1000, 10**6))
        self.generations = [self._new_generation()]
        self.sequencer = Sequencer(True, 0, snapshots=False)
        self.wire: deque[tuple[int, bytes]] = deque()  # live messages on their way
        self.connection: deque[bool] = deque()  # drops (False) and returns (True) to be told
        self.request: RequestReplay | None = None
        self.answer: deque[tuple[int, bytes]] | None = None  # a reply being read, a batch a step
        self.answered_by: Generation | None = None
        self.told: list[Deliver | Loss] = []  # what the consumer is told, in order
        self._carry_out(self.sequencer.start())

    def _new_generation(self) -> Generation:
        epoch = next(self.epochs) if self.says_epoch else None
        return Generation(len(getattr(self, "generations", [])), epoch)

    @property
    def current(self) -> Generation:
        return self.generations[-1]

    def _carry_out(self, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, (Deliver, Loss)):
                self.told.append(action)
            elif isinstance(action, RequestReplay):
                self.request, self.answer = action, None  # it replaces the one under way
            elif isinstance(action, RequestSnapshot):
                raise AssertionError("snapshots are off")
            else:
                assert isinstance(action, (Silence, Synced))

    # -- the publishers -----------------------------------------------------------------------

    @rule(reaches=st.booleans())
    def publish(self, reaches: bool) -> None:
        """A batch, which reaches the subscriber or not (its HWM, a subscription not yet in)."""
        message = self.current.publish()
        if reaches:
            self.wire.append(message)

    @precondition(lambda self: len(self.generations) < 6)
    @rule()
    def kill_and_restart(self) -> None:
        """kill -9, then a new publisher on the same endpoints. The SUB connection drops and
        comes back, which the socket's monitor tells in order, but at any point among the
        messages (it has a socket of its own)."""
        self.generations.append(self._new_generation())
        self.connection.extend([False, True])

    # -- what the subscriber hears, one thing at a time ----------------------------------------

    @precondition(lambda self: self.wire)
    @rule()
    def live_arrives(self) -> None:
        seq, payload = self.wire.popleft()
        self._carry_out(self.sequencer.live(seq, payload))

    @precondition(lambda self: self.connection)
    @rule()
    def connection_news(self) -> None:
        up = self.connection.popleft()
        self._carry_out(self.sequencer.reconnected() if up else self.sequencer.disconnected())

    @rule()
    def quiet(self) -> None:
        self._carry_out(self.sequencer.quiet())

    @precondition(lambda self: self.request is not None)
    @rule(whole=st.booleans())
    def replay_answers(self, whole: bool) -> None:
        """The generation up now answers the request under way: a batch, or all of it."""
        request = self.request
        assert request is not None
        if self.answer is None or self.answered_by is not self.current:
            # asked again on a new connection: the publisher up now answers from the start
            start = request.start_seq
            self.answered_by = self.current
            self.answer = deque(
                (seq, payload) for seq, payload in enumerate(self.current.published) if seq >= start
            )
        while self.answer:
            seq, payload = self.answer.popleft()
            self._carry_out(self.sequencer.replayed(request.request_id, seq, payload))
            if not whole or self.request is not request:
                return
        if self.request is request:
            self.request = None
            epoch = self.answered_by.epoch if self.answered_by else None
            self._carry_out(self.sequencer.replay_ended(request.request_id, epoch))

    @precondition(lambda self: self.request is not None)
    @rule()
    def replay_times_out(self) -> None:
        request = self.request
        assert request is not None
        self.request = None
        self._carry_out(self.sequencer.replay_failed(request.request_id))

    # -- what must hold ----------------------------------------------------------------------

    @invariant()
    def each_stretch_is_in_order(self) -> None:
        """Between two restarts the consumer sees increasing seqs, never one twice."""
        last = -1
        for item in self.told:
            if isinstance(item, Loss) and item.reason is LossReason.RESTART:
                last = -1 if item.new_seq is None else item.new_seq - 1
            elif isinstance(item, Deliver):
                assert item.seq > last, (item.seq, last)
                last = item.seq

    def teardown(self) -> None:
        """Let everything in flight arrive and every question be answered, then check."""
        self._settle()
        final = self.current
        final.publish()  # the stream goes on: whatever the subscriber missed shows now
        self.wire.append((len(final.published) - 1, final.published[-1]))
        self._settle()
        self._carry_out(self.sequencer.quiet())
        self._settle()
        self._nothing_lost_silently()

    def _settle(self) -> None:
        for _ in range(1000):
            if self.connection:
                self.connection_news()
            elif self.wire:
                self.live_arrives()
            elif self.request is not None:
                self.replay_answers(True)
            else:
                return
        raise AssertionError("the subscriber kept asking")

    def _nothing_lost_silently(self) -> None:
        """Since the last restart reported, each batch of the generation up now delivered or
        inside a loss reported since, and nothing of another generation delivered: what an
        earlier generation left in the consumer's view, that restart told it to forget. (An
        earlier generation's batches cannot be owed: one killed before a batch of it reached
        anyone is gone without a trace, and its cache with it.)"""
        restarts = [
            n for n, item in enumerate(self.told)
            if isinstance(item, Loss) and item.reason is LossReason.RESTART
        ]  # fmt: skip
        since = self.told[restarts[-1] + 1 :] if restarts else self.told
        skipped = 0
        if restarts:
            last_restart = self.told[restarts[-1]]
            assert isinstance(last_restart, Loss)
            skipped = last_restart.new_seq or 0
        final = self.current
        seen: set[int] = set()
        for item in since:
            if isinstance(item, Deliver):
                generation, seq = origin(item.payload)
                assert generation == final.index, (
                    f"batch {seq} of generation {generation} delivered as generation "
                    f"{final.index}'s"
                )
                seen.add(seq)
            else:
                assert item.last_seq is not None
                seen.update(range(item.first_seq, item.last_seq + 1))
        missing = set(range(skipped, len(final.published))) - seen
        assert not missing, f"generation {final.index}'s batches {sorted(missing)} lost silently"


def test_a_restart_found_while_the_connection_is_down_is_not_undone_on_reconnect() -> None:
    """Hypothesis's find, replayed: a batch delivered, the connection drops, a killed
    generation's batch (seq 0 again) arrives and starts a new sequence, then the connection
    comes back. The probe on reconnect compared replay with the batch delivered before the
    drop, which matched the publisher up now, so the new sequence's first batch (the dead
    generation's) stayed in the view as the live one's."""
    loop = CrashLoop()
    loop.start(says_epoch=False)
    loop.publish(reaches=True)  # generation 0's batch 0, on its way
    for _ in range(4):
        loop.kill_and_restart()
    loop.publish(reaches=True)  # generation 4's batch 0, on its way too
    while loop.connection:
        loop.connection_news()
    loop.kill_and_restart()  # generation 5
    loop.publish(reaches=False)
    loop.replay_answers(whole=False)  # generation 5's batch 0, delivered
    loop.connection_news()  # down
    loop.live_arrives()  # generation 0's: seq 0, already delivered
    loop.live_arrives()  # generation 4's: a restart, and delivered as seq 0
    loop.connection_news()  # up: the probe
    loop.quiet()
    loop.teardown()  # raised: "batch 0 of generation 4 delivered as generation 5's"


CrashLoop.TestCase.settings = settings(max_examples=2000, stateful_step_count=50, deadline=None)
TestCrashLoops = CrashLoop.TestCase
