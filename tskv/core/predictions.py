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
        self._owner: dict[tuple[int, int], int] = {}  # (bit, key) -> the `add` it lapses with
        # One entry per `add`: a request's blocks lapse together. An entry whose keys were
        # predicted again later lapses only for those it still owns.
        self._queue: list[tuple[float, int, int, list[int]]] = []  # (expiry, order, bit, keys)
        self._order = 0
        self._queued = 0  # keys in the queue's entries, superseded ones included
        self._by_bit: dict[int, set[int]] = {}
        # told when predictions come into force (none were) and when none remain: the index's
        # fast path walks the real blocks only
        self.on_in_force_changed: Callable[[], None] | None = None

    def __len__(self) -> int:
        return len(self._owner)

    def add(self, bit: int, keys: Iterable[int], ttl: float) -> None:
        now = self._clock()
        expiry = now + ttl
        self.expire(now)
        masks, owner = self.masks, self._owner
        none_in_force = not masks
        mine = self._by_bit.setdefault(bit, set())
        added = list(keys)
        self._order += 1
        for key in added:
            if (bit, key) not in owner:
                masks[key] = masks.get(key, 0) | bit
                mine.add(key)
            owner[bit, key] = self._order
        if none_in_force and masks:
            self._in_force_changed()
        if not mine:
            del self._by_bit[bit]
        self._push(expiry, self._order, bit, added)
        while len(owner) > self._max:  # the oldest go first
            self._lapse(heapq.heappop(self._queue), self._max)
        if self._queued > 2 * max(len(owner), self._max) + 1024:
            self._compact()  # predicted again and again: the superseded entries go

    def _push(self, expiry: float, order: int, bit: int, keys: list[int]) -> None:
        self._queued += len(keys)
        heapq.heappush(self._queue, (expiry, order, bit, keys))

    def _compact(self) -> None:
        entries, self._queue, self._queued = self._queue, [], 0
        for expiry, order, bit, keys in entries:
            alive = [key for key in keys if self._owner.get((bit, key)) == order]
            if alive:
                self._push(expiry, order, bit, alive)

    def expire(self, now: float | None = None) -> None:
        """Forget the predictions whose time to live has run out."""
        queue = self._queue
        if not queue:
            return
        now = self._clock() if now is None else now
        while queue and queue[0][0] <= now:
            self._lapse(heapq.heappop(queue))

    def _lapse(self, entry: tuple[float, int, int, list[int]], keep: int = -1) -> None:
        """Drop an `add`'s predictions still its own (until only `keep` remain, if given);
        what is left of it goes back in the queue."""
        expiry, order, bit, keys = entry
        for index, key in enumerate(keys):
            if keep >= 0 and len(self._owner) <= keep:
                heapq.heappush(self._queue, (expiry, order, bit, keys[index:]))
                return
            if self._owner.get((bit, key)) == order:
                self.drop(bit, key)

    def drop(self, bit: int, key: int) -> None:
        """The real block arrived (or left): the prediction has served its turn."""
        if self._owner.pop((bit, key), None) is None:
            return
        mask = self.masks[key] & ~bit
        if mask:
            self.masks[key] = mask
        else:
            del self.masks[key]
            if not self.masks:
                self._in_force_changed()
        keys = self._by_bit[bit]
        keys.discard(key)
        if not keys:
            del self._by_bit[bit]

    def _in_force_changed(self) -> None:
        if self.on_in_force_changed is not None:
            self.on_in_force_changed()

    def forget(self, bit: int) -> None:
        """The worker's cache was cleared, or the worker removed: none of its predictions hold."""
        for key in list(self._by_bit.get(bit, ())):
            self.drop(bit, key)
