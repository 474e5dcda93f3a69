"""The publisher's memory of recent batches: a bounded ring of (seq, payload), O(1) by seq."""

from __future__ import annotations

from tskv.core.errors import ConfigError


class ReplayBuffer:
    """The last `capacity` payloads, addressed by their seq.

    Seqs are appended in order with no holes (the publish task assigns them), so a slot is
    `seq % capacity` and the oldest seq still held is `next_seq - len`.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ConfigError(f"replay buffer capacity = {capacity} must be at least 1")
        self.capacity = capacity
        self._slots: list[bytes] = [b""] * capacity
        self.next_seq = 0
        self._size = 0

    def __len__(self) -> int:
        return self._size

    @property
    def oldest_seq(self) -> int | None:
        return self.next_seq - self._size if self._size else None

    def append(self, payload: bytes) -> int:
        """Store the next batch and return the seq it gets."""
        seq = self.next_seq
        self._slots[seq % self.capacity] = payload
        self.next_seq = seq + 1
        if self._size < self.capacity:
            self._size += 1
        return seq

    def get(self, seq: int) -> bytes | None:
        """The payload of `seq`, or None if it was evicted or not yet assigned."""
        if self.next_seq - self._size <= seq < self.next_seq:
            return self._slots[seq % self.capacity]
        return None

    def first_at_or_after(self, start_seq: int) -> int:
        """Where a replay from `start_seq` begins: the oldest held seq if start is older."""
        return max(start_seq, self.next_seq - self._size)
