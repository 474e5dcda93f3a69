"""tskv's events as Dynamo's radix tree applies them (`RadixTree.apply_event`'s JSON), so the
benchmark and the interop tests feed Dynamo's index exactly what tskv's receives."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from tskv.core.events import BlockRemoved, BlockStored, KVEvent


def dynamo_event(event_id: int, event: KVEvent, local_hashes: Sequence[int] = ()) -> bytes:
    """One event as Dynamo's JSON; `local_hashes` are a store's blocks' hashes of their tokens
    by Dynamo's own hash (`dynamo.llm.compute_block_hash_for_seq`), one per block."""
    if isinstance(event, BlockStored):
        blocks = [
            {"block_hash": block, "tokens_hash": tokens}
            for block, tokens in zip(event.block_hashes, local_hashes, strict=True)
        ]
        data: dict[str, Any] = {
            "stored": {"parent_hash": event.parent_block_hash, "blocks": blocks}
        }
    elif isinstance(event, BlockRemoved):
        data = {"removed": {"block_hashes": list(event.block_hashes)}}
    else:
        data = {"cleared": None}
    return json.dumps({"event_id": event_id, "data": data}).encode()
