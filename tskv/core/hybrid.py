"""What a hybrid or tiered worker holds, group by group and tier by tier: no I/O.

Most workers hold their blocks in one tier of one full-attention group at the index's block
size; the holdings keep only each key's holders for them, and a query's leading run is their
answer. A worker whose blocks are in several KV cache groups (a hybrid model), in lower tiers
(CPU, disk), or in groups with larger blocks than the index's, gets a `HybridBlocks` too: how many
copies of each key each tier `(medium, group_idx)` holds, the content key of each engine hash
it has stored (the same in every group: vLLM 0.33 hashes a block once and files it per group),
and its groups (`core/groups.py`). From these the index answers what the engine would reuse,
on the device and with its lower tiers (`hit`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from tskv.core import compiled
from tskv.core.block_keys import contents, identities, root_key
from tskv.core.events import BlockRemoved, BlockStored, KVEvent
from tskv.core.groups import GroupSet, Held
from tskv.core.tiers import BlockKeys, Tier, block_id, tier_of

DEVICE_MEDIA = frozenset({"GPU", "HBM", "DEVICE"})  # what the engine's own prefix cache reuses


def is_device(medium: str | None) -> bool:
    """A block in this medium is in the engine's own prefix cache: no medium named (one tier),
    or the GPU's. Every other medium (CPU, CPU_PINNED, STORAGE, DISK, EXTERNAL, ...) is a lower
    tier, from which a hit must first be loaded."""
    return medium is None or medium.upper() in DEVICE_MEDIA


# What a reader process journals of a hybrid worker, for the index's process to mirror:
# ("groups", {index: (kind, block_size, window)}), ("begin", [(medium, group, keys), ...]) once
# the worker turns hybrid (its tiers' contents), (medium, group, +1 or -1, keys), ("clear",).
Op = tuple[Any, ...]


class HybridBlocks:
    """One worker's blocks by tier, its content keys by engine hash, and its groups."""

    def __init__(self, block_size: int, journal: bool = False) -> None:
        self.block_size = block_size
        self.groups = GroupSet(block_size, self._groups_changed)
        self.tiers: dict[Tier, dict[int, int]] = {}  # tier -> key -> copies held there
        self.keys: dict[int, int] = {}  # engine hash -> its key, whatever tier holds it
        self.copies: dict[Any, int] = {}  # a block's copies in its tier beyond the first
        self.ops: list[Op] | None = [] if journal else None

    def _groups_changed(self, groups: GroupSet) -> None:
        if self.ops is not None:
            self.ops.append(("groups", groups.specs()))

    # -- storing and removing: what the holdings' union must take and let go of ----------

    def store(
        self, event: BlockStored, blocks: BlockKeys, learned: Mapping[int, int]
    ) -> HoldsDelta:
        """File the event's blocks in its tier. Hashes and tokens that line up are keyed by
        chaining from the parent, as any worker's. vLLM 0.33 leaves out of a group's hashes the
        blocks it does not keep, while its tokens cover them all: those hashes are found by
        their key elsewhere (another group's copy: the hash is the same in every group), in
        `learned` (the batch's other events), or counted as unplaced, never filed under
        another block's tokens. A group that names itself keeps a copy per store (vLLM stores
        a block again when another group cut a hit short), so one removal lets go of one."""
        scale = self.groups.learn(event)
        tier, hashes = tier_of(event), event.block_hashes
        delta = HoldsDelta()
        if event.group_idx is not None and len(hashes) * event.block_size < len(event.token_ids):
            refs = [self.keys.get(block, learned.get(block)) for block in hashes]
            delta.unplaced = refs.count(None)
        else:
            refs, delta.strings = self.refs(event, scale, learned)
            delta.orphans = refs.count(None)
        copies = event.group_idx is not None
        for block, ref in zip(hashes, refs, strict=True):
            each = block_id(tier, block)
            old = blocks.get(each)
            again = None
            if each in blocks:
                again = stored_again(old, ref, copies, self.copies.get(each, 0))
            if again is not None:
                filing, extra = again
                if extra:
                    self.copies[each] = extra
                if old is None and ref is not None:  # its earlier copies' place is known now
                    blocks[each] = self.keys[block] = ref
                filed = ref if old is None else old
                if filed is not None:
                    for _ in range(filing):
                        delta.taken += self.add(tier, filed)
                continue
            if old is not None:  # another block under this hash: the old one goes
                delta.let_go += self.drop(tier, old, 1 + self.copies.pop(each, 0))
            if ref is None:  # held, as the stream says, but no query can reach it
                blocks[each] = None  # (the old block, if any, let go of above)
                continue
            blocks[each] = ref
            self.keys[block] = ref
            delta.taken += self.add(tier, ref)
        return delta

    def refs(
        self, event: BlockStored, scale: int, learned: Mapping[int, int]
    ) -> tuple[list[int | None], bool]:
        """Each of the event's blocks' key (None: its parent was never seen, or its tokens fall
        short), chained from its parent's, and whether a token id was a string."""
        parent = event.parent_block_hash
        key: int | None
        if parent is None:
            key = root_key(event.lora_name, event.cache_salt)
        else:
            key = self.keys.get(parent, learned.get(parent))
        count = len(event.block_hashes)
        idents = identities(event.extra_keys, event.mm_keys, count, event.lookahead_token_ids)
        if idents is not None and scale > 1:  # an identity names a whole (larger) block
            idents = [
                idents[i // scale] if i % scale == scale - 1 else None for i in range(count * scale)
            ]
        found_contents, strings = contents(event.token_ids, idents, count * scale, self.block_size)
        keys = compiled.chain(key, found_contents)
        if scale == 1:
            return list(keys), strings
        # a larger block is its last index block's key: its hash is that block's (vLLM's
        # `BlockHashListWithBlockSize`), and a chain's key names its whole prefix
        return [keys[i * scale + scale - 1] for i in range(count)], strings

    def remove(self, event: BlockRemoved, blocks: BlockKeys) -> list[int]:
        """Let go of one copy of each block in the event's tier; the keys let go of."""
        tier, let_go = tier_of(event), []
        for block in event.block_hashes:
            each = block_id(tier, block)
            if each not in blocks:
                continue
            ref = blocks[each]
            if ref is None:  # an orphan, or unplaced: nothing held to let go of
                if self.copies.get(each):
                    self.copies[each] -= 1
                else:
                    del blocks[each]
                    self.copies.pop(each, None)
                continue
            if self.copies.get(each):
                self.copies[each] -= 1
            else:
                del blocks[each]
                self.copies.pop(each, None)
                if all(blocks.get(block_id(other, block)) is None for other in self.tiers):
                    self.keys.pop(block, None)  # no tier holds it filed: its key is forgotten
            let_go += self.drop(tier, ref)
        return let_go

    def learn_batch(self, events: Sequence[KVEvent]) -> dict[int, int]:
        """The keys of the hashes a batch's lined-up stores name, for its stores whose hashes
        do not line up with their tokens: the other group's event of the same step may come
        after them. Only read when such a store is in the batch."""
        learned: dict[int, int] = {}
        skipping = any(
            isinstance(event, BlockStored)
            and event.group_idx is not None
            and len(event.block_hashes) * event.block_size < len(event.token_ids)
            for event in events
        )
        if not skipping:
            return learned
        for event in events:
            if isinstance(event, BlockStored) and (
                len(event.block_hashes) * event.block_size >= len(event.token_ids)
            ):
                scale = max(1, event.block_size // self.block_size)
                refs, _ = self.refs(event, scale, learned)
                for block, ref in zip(event.block_hashes, refs, strict=True):
                    if ref is not None:
                        learned[block] = ref
        return learned

    # -- holding ---------------------------------------------------------------------------

    def add(self, tier: Tier, ref: int) -> list[int]:
        """One more copy of a block in `tier`; its keys."""
        keys = [ref]
        counts = self.tiers.setdefault(tier, {})
        for key in keys:
            counts[key] = counts.get(key, 0) + 1
        if self.ops is not None:
            self.ops.append((*tier, 1, keys))
        return keys

    def drop(self, tier: Tier, ref: int, copies: int = 1) -> list[int]:
        """`copies` copies fewer of a block in `tier`; their keys (each once a copy)."""
        keys = [ref] * copies
        counts = self.tiers.get(tier, {})
        for key in keys:
            left = counts.get(key, 0) - 1
            if left > 0:
                counts[key] = left
            else:
                counts.pop(key, None)
        if self.ops is not None:
            self.ops.append((*tier, -1, keys))
        return keys

    def clear(self) -> None:
        self.tiers.clear()
        self.keys.clear()
        self.copies.clear()
        if self.ops is not None:
            self.ops.append(("clear",))

    def begin(self) -> None:
        """Journal the tiers as they are now: the worker just turned hybrid."""
        if self.ops is not None:
            content = [
                (*tier, [key for key, count in counts.items() for _ in range(count)])
                for tier, counts in self.tiers.items()
            ]
            self.ops.append(("begin", content))

    def mirror(self, ops: Iterable[Op]) -> tuple[list[int], list[int]]:
        """Do what another process's view journalled (`take_ops`), for a worker whose blocks
        that process keeps; the keys the union comes to hold, and lets go of, here."""
        taken: list[int] = []
        let_go: list[int] = []
        tiers = self.tiers
        for op in ops:
            if op[0] == "groups":
                self.groups.set_specs(op[1])
            elif op[0] == "begin":  # the union holds these already: its plain runs said so
                tiers.clear()
                for medium, group, keys in op[1]:
                    counts = tiers.setdefault((medium, group), {})
                    for key in keys:
                        counts[key] = counts.get(key, 0) + 1
            elif op[0] == "clear":
                let_go.extend({key for counts in tiers.values() for key in counts})
                tiers.clear()
            else:
                medium, group, sign, keys = op
                counts = tiers.setdefault((medium, group), {})
                for key in keys:
                    before = any(key in held for held in tiers.values())
                    left = counts.get(key, 0) + sign
                    if left > 0:
                        counts[key] = left
                    else:
                        counts.pop(key, None)
                    after = left > 0 or any(key in held for held in tiers.values())
                    if after and not before:
                        taken.append(key)
                    elif before and not after:
                        let_go.append(key)
        return taken, let_go

    def take_ops(self) -> list[Op]:
        ops, self.ops = self.ops or [], ([] if self.ops is not None else None)
        return ops

    # -- the engine's answer -----------------------------------------------------------------

    def hit(self, keys: Sequence[int], longest: int) -> tuple[int, int]:
        """How many of the request's leading blocks (`keys`, at most `longest`) the engine
        would reuse: with every tier, and from the device alone."""
        every = self._holds(lambda medium: True)
        device = self._holds(is_device)
        return self.groups.hit(keys, longest, every), self.groups.hit(keys, longest, device)

    def _holds(self, media: Callable[[str | None], bool]) -> Held:
        """Per group (None: all of them together), the tiers' counts in the media asked."""
        found: Held = {None: []}
        for (medium, group), counts in self.tiers.items():
            if media(medium):
                found[None].append(counts)
                if group is not None:
                    found.setdefault(group, []).append(counts)
        return found


def stored_again(old: Any, ref: Any, grouped: bool, extra: int) -> tuple[int, int] | None:
    """A store of a block its tier has already (`old`: its key, None if it was not filed;
    `extra`: its copies beyond the first), keyed `ref` this time (None: not filed): how many
    copies to file under the key now, and its copies beyond the first afterwards. An event naming
    its group (vLLM 0.33's, whose hashes name content) is one more copy of the same block, and
    files the earlier copies once its key is known; any other event stored again is the same
    block if its key is, else another block under the same hash, which replaces the old
    (None, as for every such replacement)."""
    if not grouped:
        return (0, extra) if old == ref else None
    if not (old == ref or old is None or ref is None):
        return None
    filing = 1 + extra if old is None and ref is not None else 0
    if grouped:
        extra += 1
        filing += (ref if old is None else old) is not None
    return filing, extra


class HoldsDelta:
    """What filing one event did to the holds: the keys the union takes and lets go of (one
    each a copy), and what could not be filed."""

    __slots__ = ("let_go", "orphans", "strings", "taken", "unplaced")

    def __init__(self) -> None:
        self.taken: list[int] = []
        self.let_go: list[int] = []
        self.orphans = 0  # blocks under a parent never seen
        self.unplaced = 0  # hashes of a store that skips blocks, whose place is not known
        self.strings = False


def plain_tiers(blocks: BlockKeys, copies: Mapping[Any, int]) -> dict[Tier, dict[int, int]]:
    """The tiers of a plain worker's blocks (engine hash, or (medium, group, hash), to key;
    and their copies beyond the first)."""
    tiers: dict[Tier, dict[int, int]] = {}
    for block, key in blocks.items():
        if key is None:
            continue
        tier: Tier = (block[0], block[1]) if isinstance(block, tuple) else (None, None)
        counts = tiers.setdefault(tier, {})
        counts[key] = counts.get(key, 0) + 1 + copies.get(block, 0)
    return tiers
