"""Events of a type tskv does not know: delivered as `UnknownEvent`, counted, and each new type
named once in the log (at most MAX_TYPES_LOGGED of them: a peer could invent any number)."""

from __future__ import annotations

import logging

from tskv.core.events import KVEventBatch, UnknownEvent
from tskv.core.read_batch import ReadBatch

logger = logging.getLogger("tskv.shells.subscriber")

MAX_TYPES_LOGGED = 64


class UnknownEvents:
    """Events of a type tskv does not know, counted for `statistics()` and each new type logged
    once: a publisher newer than this consumer is news, not an error."""

    def __init__(self) -> None:
        self.count = 0
        self._types: set[str] = set()

    def note(self, seq: int, batch: KVEventBatch | ReadBatch) -> None:
        """Count a batch's unknown events, and name each new type once in the log."""
        for event in batch.events:
            if not isinstance(event, UnknownEvent):
                continue
            self.count += 1
            if event.type in self._types or len(self._types) > MAX_TYPES_LOGGED:
                continue
            self._types.add(event.type)
            if len(self._types) > MAX_TYPES_LOGGED:
                logger.warning(
                    "more than %d unknown event types: no more are named", MAX_TYPES_LOGGED
                )
                continue
            logger.warning(
                "batch %d has an event of a type tskv does not know, %r: delivered as "
                "tskv.UnknownEvent with its fields, and counted (logged once per type)",
                seq,
                event.type,
            )
