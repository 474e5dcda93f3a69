"""What the consumer never sees, and why: the loss reports the subscriber gives `on_loss`, their
wording for a person, and their counting as the statistics show it."""

from __future__ import annotations

import enum

import attrs


class LossReason(str, enum.Enum):
    """Why batches were not delivered."""

    EVICTED = "evicted"  # replay answered, but the publisher's buffer no longer held them
    NO_REPLAY = "no-replay"  # the subscriber has no replay endpoint to ask
    REPLAY_TIMEOUT = "replay-timeout"  # the replay endpoint did not answer in time
    REFUSED = "refused"  # the replay endpoint kept refusing (its limits) until the timeout
    UNDECODABLE = "undecodable"  # the batch arrived but its payload was not a batch
    INTERRUPTED = "interrupted"  # a repair was under way when the publisher restarted
    RESTART = "restart"  # the publisher started a new sequence (or the seq jumped absurdly)
    SNAPSHOT = "snapshot"  # not lost: replaced by the snapshot delivered next, which has them
    OVERRUN = "overrun"  # the live stream ran max_held batches past a repair: the hole went
    TOO_LARGE = "too-large"  # the snapshot that would restore them was over max_snapshot_bytes


@attrs.frozen
class Loss:
    """Batches `first_seq` to `last_seq` (inclusive) the consumer will never see.

    For a restart, `last_seq` is None (what the old publisher sent after `first_seq - 1` is
    unknown) and `new_seq` is where delivery goes on in the new sequence: a consumer should
    forget what it knew of this publisher's cache, as the restarted engine's cache is new too.
    """

    first_seq: int
    last_seq: int | None
    reason: LossReason
    new_seq: int | None = None

    @property
    def count(self) -> int | None:
        return None if self.last_seq is None else self.last_seq - self.first_seq + 1

    def describe(self) -> str:
        """One line for a person: the log's wording and `tskv listen`'s."""
        if self.reason is LossReason.RESTART:
            return f"publisher restarted: expected seq {self.first_seq}, now at seq {self.new_seq}"
        span = f"seq {self.first_seq}..{self.last_seq} ({self.reason.value})"
        if self.reason is LossReason.SNAPSHOT:
            return f"{span}: no longer buffered, restored by the snapshot that follows"
        return f"lost {span}"


@attrs.define
class LossCounts:
    """Loss reports, counted as the statistics show them: a restart's unknown count is not in
    `lost`, and what a snapshot stands in for is `replaced`, not lost."""

    losses: int = 0
    restarts: int = 0
    lost: int = 0
    replaced: int = 0

    def add(self, loss: Loss) -> None:
        self.losses += 1
        if loss.reason is LossReason.RESTART:
            self.restarts += 1
        elif loss.reason is LossReason.SNAPSHOT:
            self.replaced += loss.count or 0
        else:
            self.lost += loss.count or 0
