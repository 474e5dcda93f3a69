"""Where a cached block lives: its tier, `(medium, group_idx)`, the one definition of it.

An engine caches a block once per tier: per storage medium (vLLM's GPU, CPU and STORAGE,
SGLang's GPU, CPU_PINNED, DISK and EXTERNAL) and, on hybrid models, per KV cache group (vLLM
0.33 names the group of every store and removal). A removal names the tier it leaves, so a
sliding-window group letting go of a block never touches the copy the full-attention group
still holds. The publisher's cache state, the prefix index and its holdings all file blocks by
this one value.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

if TYPE_CHECKING:
    from tskv.core._compiled import BlockMap

Tier = tuple[str | None, int | None]  # (medium, group_idx); None where the event names neither
UNTIERED: Tier = (None, None)  # an event that names no tier: TokenSpeed's wire, older engines
# How a worker's view names one of its blocks: the engine's hash, with its tier when the event
# names one (a block is held once per tier).
BlockId = int | tuple[str | None, int | None, int]
# A worker's blocks, BlockId -> key (None: an orphan): a dict, or the compiled `BlockMap`, which
# keeps the usual entry in 16 bytes where a dict of ints takes about 100
BlockKeys: TypeAlias = "dict[BlockId, Any] | BlockMap"


class Tiered(Protocol):
    """What `tier_of` reads of an event: any stored or removed event, of any wire."""

    @property
    def medium(self) -> str | None: ...

    @property
    def group_idx(self) -> int | None: ...


def tier_of(event: Tiered) -> Tier:
    """The tier a BlockStored or BlockRemoved names; `UNTIERED` itself when it names none, so a
    caller may test it with `is`."""
    medium, group = event.medium, event.group_idx
    if medium is None and group is None:
        return UNTIERED
    return (medium, group)


def block_id(tier: Tier, block: int) -> BlockId:
    return block if tier is UNTIERED or tier == UNTIERED else (*tier, block)


def block_ids(tier: Tier, hashes: Sequence[int]) -> Sequence[BlockId]:
    return hashes if tier is UNTIERED or tier == UNTIERED else [(*tier, block) for block in hashes]
