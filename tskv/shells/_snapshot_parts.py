"""A snapshot handed over as its parts, each decoded only when its turn comes.

A subscriber's user gets a snapshot as one batch. The watcher's followers take it part by part
and apply each before the next is decoded, so a worker's cache is never held decoded whole
(50,000 blocks are about 35 MB of event objects, against 3 MB of payloads), and indexing a part
while its objects are still in the CPU's caches is cheaper than indexing a whole snapshot
decoded beforehand (docs/performance.md#one-router-over-a-fleet).
"""

from __future__ import annotations

from collections.abc import Callable

from tskv.core.codec import WireError, decode
from tskv.core.events import KVEvent, KVEventBatch
from tskv.core.read_batch import ReadBatch, Reader
from tskv.shells._background import Pacer


class SnapshotParts:
    """A snapshot's parts, decoded one at a time as they are iterated.
    Other tasks run between parts, never cancelled there (the snapshot is out of the
    sequencer's hands). A part that does not decode ends the iteration early, after `failed`
    has reported the loss; `completed` runs as the last part is decoded, before it is handed
    over. `complete` says whether every part was."""

    def __init__(
        self,
        payloads: list[bytes],
        pacer: Pacer,
        failed: Callable[[WireError], None],
        completed: Callable[[], None],
        read: Reader = decode,  # the subscriber's
    ) -> None:
        self._payloads = payloads
        self._read = read
        self._pacer = pacer
        self._failed = failed
        self._completed = completed
        self._taken = 0
        self._broken = False

    @property
    def complete(self) -> bool:
        return self._taken == len(self._payloads)

    def __aiter__(self) -> SnapshotParts:
        return self

    async def __anext__(self) -> KVEventBatch | ReadBatch:
        if self._broken or self.complete:
            raise StopAsyncIteration
        if self._taken and self._pacer.due():
            await self._pacer.yield_now()
        try:
            part, _ = self._read(self._payloads[self._taken])  # a part holds known events
        except WireError as exc:
            self._broken = True
            self._failed(exc)
            raise StopAsyncIteration from None
        self._taken += 1
        if self.complete:
            self._completed()
        return part

    async def whole(self) -> KVEventBatch | None:
        """Every part as one batch (it clears, then stores every cached block); None if a
        part did not decode."""
        events: list[KVEvent] = []
        first: KVEventBatch | ReadBatch | None = None
        async for part in self:
            if first is None:
                first = part
            events.extend(part.events)
        if first is None or not self.complete:
            return None
        return KVEventBatch(first.ts, events, first.attn_dp_rank)
