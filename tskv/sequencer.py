"""The subscriber's bookkeeping, without I/O: which seq comes next, what to ask replay for,
and what to report as lost.

Fed live messages and replay replies in the order they arrive, it returns actions in the
order the consumer must see them: batches to deliver (strictly increasing seq, no duplicates),
losses to report, and replay requests to send. The Trio shell in `subscriber.py` only moves
bytes between sockets and this object.
"""

from __future__ import annotations

import enum

import attrs


class LossReason(str, enum.Enum):
    """Why batches were not delivered."""

    EVICTED = "evicted"  # replay answered, but the publisher's buffer no longer held them
    NO_REPLAY = "no-replay"  # the subscriber has no replay endpoint to ask
    REPLAY_TIMEOUT = "replay-timeout"  # the replay endpoint did not answer in time
    UNDECODABLE = "undecodable"  # the batch arrived but its payload was not a batch
    INTERRUPTED = "interrupted"  # a repair was under way when the publisher restarted
    RESTART = "restart"  # the publisher started a new sequence


@attrs.frozen
class Loss:
    """Batches `first_seq`..`last_seq` (inclusive) the consumer will never see.

    For a restart, `last_seq` is None (what the old publisher sent after `first_seq - 1` is
    unknown) and `new_seq` is where the new sequence starts: a consumer should forget what it
    knew of this publisher's cache, as the restarted engine's cache is new too.
    """

    first_seq: int
    last_seq: int | None
    reason: LossReason
    new_seq: int | None = None

    @property
    def count(self) -> int | None:
        return None if self.last_seq is None else self.last_seq - self.first_seq + 1


@attrs.frozen
class Deliver:
    seq: int
    payload: bytes
    from_replay: bool


@attrs.frozen
class RequestReplay:
    start_seq: int
    request_id: int


Action = Deliver | Loss | RequestReplay


class Sequencer:
    """Gap detection and repair for one publisher's stream."""

    def __init__(self, has_replay: bool, start_seq: int | None = None) -> None:
        self.has_replay = has_replay
        self.expected: int | None = start_seq  # the next seq to deliver
        self.last_live: int | None = None
        self.pending: dict[int, bytes] = {}  # live batches held while a gap is repaired
        self.request_id = 0
        self.repairing = False
        self._expected_at_request: int | None = None

    def start(self) -> list[Action]:
        """Actions to take before any message: a bootstrap replay when a start seq was given."""
        if self.expected is None:
            return []
        if not self.has_replay:
            raise ValueError(
                f"start_seq = {self.expected} needs a replay endpoint to fetch past batches from"
            )
        return [self._request()]

    def _request(self) -> RequestReplay:
        assert self.expected is not None
        self.request_id += 1
        self.repairing = True
        self._expected_at_request = self.expected
        return RequestReplay(self.expected, self.request_id)

    def _deliver(self, seq: int, payload: bytes, from_replay: bool) -> Deliver:
        self.expected = seq + 1
        return Deliver(seq, payload, from_replay)

    def _drain_pending(self, actions: list[Action]) -> None:
        """Deliver held live batches that now follow on without a hole."""
        while self.expected in self.pending:
            seq = self.expected
            actions.append(self._deliver(seq, self.pending.pop(seq), False))

    def _advance_to(self, target: int, reason: LossReason, actions: list[Action]) -> None:
        """Move on to `target`: deliver the held batches on the way, report the holes."""
        assert self.expected is not None
        while self.expected < target:
            if self.expected in self.pending:
                self._drain_pending(actions)
                continue
            next_held = min((seq for seq in self.pending if seq < target), default=target)
            actions.append(Loss(self.expected, next_held - 1, reason))
            self.expected = next_held

    def _give_up_to_next_pending(self, reason: LossReason, actions: list[Action]) -> None:
        """Report the hole before the next held batch as lost, and deliver from there."""
        if self.pending:
            self._advance_to(min(self.pending), reason, actions)
        self._drain_pending(actions)

    def live(self, seq: int, payload: bytes) -> list[Action]:
        actions: list[Action] = []
        if self.last_live is not None and seq <= self.last_live:
            return self._restart(seq, payload)
        self.last_live = seq
        if self.expected is None:
            return [self._deliver(seq, payload, False)]
        if seq < self.expected:
            return actions  # before the requested start, or already delivered from replay
        if seq == self.expected:
            actions.append(self._deliver(seq, payload, False))
            self._drain_pending(actions)
            return actions
        self.pending[seq] = payload
        if self.repairing:
            return actions
        if self.has_replay:
            return [self._request()]
        self._give_up_to_next_pending(LossReason.NO_REPLAY, actions)
        return actions

    def _restart(self, seq: int, payload: bytes) -> list[Action]:
        actions: list[Action] = []
        # What was held from the old sequence still goes out, in order, with its holes named.
        while self.pending:
            self._give_up_to_next_pending(LossReason.INTERRUPTED, actions)
        self.repairing = False  # replies to an old request describe the old sequence
        self.request_id += 1
        assert self.expected is not None
        actions.append(Loss(self.expected, None, LossReason.RESTART, new_seq=seq))
        self.last_live = seq
        actions.append(self._deliver(seq, payload, False))
        return actions

    def replayed(self, request_id: int, seq: int, payload: bytes) -> list[Action]:
        actions: list[Action] = []
        if request_id != self.request_id or not self.repairing:
            return actions  # a reply to a request given up on
        assert self.expected is not None
        if seq < self.expected:
            return actions
        self.pending.pop(seq, None)  # held live too: the replayed copy goes out instead
        # Replay skipping ahead means the buffer lost what came before, but not what we hold.
        self._advance_to(seq, LossReason.EVICTED, actions)
        actions.append(self._deliver(seq, payload, True))
        self._drain_pending(actions)
        return actions

    def replay_ended(self, request_id: int) -> list[Action]:
        actions: list[Action] = []
        if request_id != self.request_id or not self.repairing:
            return actions
        self.repairing = False
        assert self.expected is not None
        if not self.pending:
            return actions
        if self.expected != self._expected_at_request:
            # Progress was made, but batches published after the request are still missing:
            # ask again from where we are.
            actions.append(self._request())
            return actions
        self._give_up_to_next_pending(LossReason.EVICTED, actions)
        if self.pending:
            actions.append(self._request())  # a further hole, after the one just given up
        return actions

    def replay_failed(self, request_id: int) -> list[Action]:
        """The replay endpoint did not answer in time: what it should have filled is lost."""
        actions: list[Action] = []
        if request_id != self.request_id or not self.repairing:
            return actions
        self.repairing = False
        while self.pending:
            self._give_up_to_next_pending(LossReason.REPLAY_TIMEOUT, actions)
        return actions
