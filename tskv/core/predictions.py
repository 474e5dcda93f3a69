"""Speculative entries: blocks a router expects a worker to store, counted before they are.

A router that has just sent a request to a worker knows that worker will soon hold the
request's blocks, but no BlockStored says so until the prefill is done. A burst of sibling
requests arriving meanwhile would find no one holding their shared prefix and be spread over
the fleet. A prediction records the blocks for that worker until the real BlockStored replaces
it, a removal or cache reset forgets it, or its time to live runs out. Memory is bounded
whatever the router predicts: past `max_entries`, the oldest predictions go first.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable

MAX_ENTRIES = 100_000  # (worker, block) predictions kept at most


class Predictions:
    """Predicted blocks by key, as bit masks of workers, the way the index keeps real ones."""

    def __init__(self, clock: Callable[[], float], max_entries: int = MAX_ENTRIES) -> None:
        self.masks: dict[int, int] = {}  # key -> bit mask of the workers predicted to hold it
        self._clock = clock
        self._max = max_entries
        self._expiry: dict[tuple[int, int], float] = {}  # (bit, key) -> when it lapses
        self._queue: list[tuple[float, int, int, int]] = []  # (expiry, order, bit, key)
        self._order = 0
        self._by_bit: dict[int, set[int]] = {}

    def __len__(self) -> int:
        return len(self._expiry)

    def add(self, bit: int, keys: Iterable[int], ttl: float) -> None:
        now = self._clock()
        expiry = now + ttl
        self.expire(now)
        for key in keys:
            if (bit, key) not in self._expiry:
                self.masks[key] = self.masks.get(key, 0) | bit
                self._by_bit.setdefault(bit, set()).add(key)
            self._expiry[bit, key] = expiry
            self._order += 1
            heapq.heappush(self._queue, (expiry, self._order, bit, key))
        while len(self._expiry) > self._max:  # the oldest go first
            self._pop_oldest()
        if len(self._queue) > 2 * len(self._expiry) + 64:  # refreshed entries left behind
            self._queue = [(e, o, b, k) for e, o, b, k in self._queue if self._current(e, b, k)]
            heapq.heapify(self._queue)

    def expire(self, now: float | None = None) -> None:
        """Forget the predictions whose time to live has run out."""
        queue = self._queue
        if not queue:
            return
        now = self._clock() if now is None else now
        while queue and queue[0][0] <= now:
            expiry, _, bit, key = heapq.heappop(queue)
            if self._current(expiry, bit, key):
                self.drop(bit, key)

    def _pop_oldest(self) -> None:
        while self._queue:
            expiry, _, bit, key = heapq.heappop(self._queue)
            if self._current(expiry, bit, key):
                self.drop(bit, key)
                return

    def _current(self, expiry: float, bit: int, key: int) -> bool:
        return self._expiry.get((bit, key)) == expiry

    def drop(self, bit: int, key: int) -> None:
        """The real block arrived (or left): the prediction has served its turn."""
        if self._expiry.pop((bit, key), None) is None:
            return
        mask = self.masks[key] & ~bit
        if mask:
            self.masks[key] = mask
        else:
            del self.masks[key]
        keys = self._by_bit[bit]
        keys.discard(key)
        if not keys:
            del self._by_bit[bit]

    def forget(self, bit: int) -> None:
        """The worker's cache was cleared, or the worker removed: none of its predictions hold."""
        for key in list(self._by_bit.get(bit, ())):
            self.drop(bit, key)
