"""The test oracle: what a KV-aware router knows of one worker, rebuilt from its events."""

from __future__ import annotations

from collections.abc import Sequence

import trio

from tskv.core.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


class CacheView:
    """What a KV-aware router knows of one worker: the blocks its events say it holds."""

    def __init__(self) -> None:
        self.blocks: set[int] = set()
        self.last_seq: int | None = None
        self.batches = 0
        self.changed = trio.lowlevel.ParkingLot()

    def apply(self, seq: int, events: Sequence[KVEvent]) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                self.blocks.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                self.blocks.difference_update(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self.blocks.clear()
        self.last_seq = seq
        self.batches += 1
        self.changed.unpark_all()
