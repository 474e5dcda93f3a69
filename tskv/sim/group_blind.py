"""What a router that counts full attention alone sees of a hybrid worker's stream: group 0's
stores and removals, their group dropped, every other group's events left out (Dynamo's ZMQ
indexer keeps only full, MLA and sink attention's). The demos route with such an index beside
tskv's to show what it would have cost."""

from __future__ import annotations

from collections.abc import Iterable

from tskv.core.events import BlockRemoved, BlockStored, KVEvent, replace
from tskv.core.groups import FULL_KINDS

UNGROUPED = {"group_idx": None, "kv_cache_spec_kind": None, "kv_cache_spec_sliding_window": None}


class GroupBlind:
    """Filters one worker's events as a full-attention-only router reads them."""

    def __init__(self) -> None:
        self.full_groups: set[int] = set()  # the groups its stores said are full attention

    def events(self, events: Iterable[KVEvent]) -> list[KVEvent]:
        seen: list[KVEvent] = []
        for event in events:
            if isinstance(event, BlockStored) and event.group_idx is not None:
                if event.kv_cache_spec_kind not in FULL_KINDS:
                    continue
                self.full_groups.add(event.group_idx)
                seen.append(replace(event, **UNGROUPED))
            elif isinstance(event, BlockRemoved) and event.group_idx is not None:
                if event.group_idx in self.full_groups:
                    seen.append(replace(event, group_idx=None))
            else:
                seen.append(event)
        return seen
