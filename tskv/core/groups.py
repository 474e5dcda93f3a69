"""A hybrid model's KV cache groups, and the prefix a worker's engine would reuse from them: no
I/O.

A hybrid model keeps one KV cache group per layer kind (full attention beside a sliding window,
or beside Mamba), each with its own blocks. A prefix is reusable only as far as every group can
serve it, each by its own rule, as vLLM 0.33 decides (`HybridKVCacheCoordinator
.find_longest_cache_hit` and each `SingleTypeKVCacheManager.find_longest_cache_hit` in its
wheel): full, MLA and sink attention need every block before the hit; a sliding window of W
tokens the `ceil((W - 1) / block_size)` blocks just before it (every block, when the hit is
shorter); Mamba the state at the hit's last block; chunked local attention the blocks of the
hit's current chunk. Each rule here says, for a candidate length, the longest length at most that
long its group accepts; the engine's hit is the longest length every group accepts (a fixpoint:
lengths only shrink). Encoder-only and cross attention are not prefix-cached and constrain
nothing. A group whose kind tskv does not know (none sent, or a new one) constrains nothing
either: the index counts it (`IndexStatistics.unknown_groups`) so its user can tell the index
the group (`PrefixIndex.set_groups`).

Not modelled: EAGLE's dropped last block, vLLM's fine-grained partial hits inside a block, and
decode context parallelism; a hit is in whole blocks of every group.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from tskv.core._checks import int_at_least
from tskv.core.errors import ConfigError
from tskv.core.events import BlockStored

FULL_KINDS = frozenset({"full_attention", "mla_attention", "sink_full_attention"})
WINDOW_KINDS = frozenset({"sliding_window", "sliding_window_mla"})
MAMBA = "mamba"
CHUNKED = "chunked_local_attention"
UNCACHED_KINDS = frozenset({"encoder_only_attention", "cross_attention"})
KNOWN_KINDS = FULL_KINDS | WINDOW_KINDS | UNCACHED_KINDS | {MAMBA, CHUNKED}


def _kind(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, str):
        raise ConfigError(f"kind = {value!r}: a KV cache spec kind, e.g. 'full_attention'")


def _window(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None:
        int_at_least("window", value, 1, ConfigError)


def _block_size(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    int_at_least("block_size", value, 1, ConfigError)


@attrs.frozen
class CacheGroup:
    """One KV cache group of a worker's model: its kind (vLLM's `kv_cache_spec_kind`), its block
    size in tokens, and its window in tokens (a sliding window's; the chunk of chunked local
    attention, which vLLM does not send)."""

    kind: str = attrs.field(default="full_attention", validator=_kind)
    block_size: int = attrs.field(default=16, validator=_block_size)
    window: int | None = attrs.field(default=None, validator=_window)

    @property
    def known(self) -> bool:
        """Whether tskv knows this group's rule (its kind, and its window where it needs one)."""
        if self.kind in WINDOW_KINDS or self.kind == CHUNKED:
            return self.window is not None
        return self.kind in KNOWN_KINDS

    @property
    def constrains(self) -> bool:
        """Whether the group's rule can shorten a hit (known, and prefix-cached)."""
        return self.known and self.kind not in UNCACHED_KINDS

    @property
    def prefix_closed(self) -> bool:
        """A hit needs every block before it: no hit reaches past the group's leading run."""
        return self.kind in FULL_KINDS


def group_of(event: BlockStored) -> CacheGroup:
    """The group a store names, as vLLM 0.33 annotates it (an unnamed kind: "unknown")."""
    kind = event.kv_cache_spec_kind or "unknown"
    window = event.kv_cache_spec_sliding_window
    return CacheGroup(kind, event.block_size, window if window and window > 0 else None)


def checked_groups(groups: Mapping[int, CacheGroup], block_size: int) -> dict[int, CacheGroup]:
    """`groups` by group index, each checked against the index's block size (a group's block
    must be a whole number of the index's blocks)."""
    checked: dict[int, CacheGroup] = {}
    for index, group in groups.items():
        int_at_least("group index", index, 0, ConfigError)
        if not isinstance(group, CacheGroup):
            raise ConfigError(f"group {index} = {group!r}: give a tskv.CacheGroup")
        check_block_size(index, group.block_size, block_size)
        checked[index] = group
    return checked


def check_block_size(index: int | None, size: int, block_size: int) -> None:
    if size % block_size:
        raise ConfigError(
            f"KV cache group {index} has blocks of {size} tokens, not a multiple of the "
            f"index's {block_size}: make the PrefixIndex's block_size a divisor of every "
            f"group's (e.g. PrefixIndex(block_size={math.gcd(size, block_size)}))"
        )


# A group's rule: given whether each of its blocks is held (by group block) and a candidate
# length x (in group blocks), the longest length <= x the group accepts.
Rule = Callable[[Sequence[bool], int], int]


def _full(held: Sequence[bool], x: int) -> int:
    run = 0
    while run < x and held[run]:
        run += 1
    return run


def _window_rule(needed: int) -> Rule:
    needed = max(needed, 1)  # vLLM counts a block before it checks: a hit ends on a held block

    def accept(held: Sequence[bool], x: int) -> int:
        for length in range(x, 0, -1):
            start = max(0, length - needed)
            if all(held[start:length]):
                return length
        return 0

    return accept


def _mamba(held: Sequence[bool], x: int) -> int:
    for length in range(x, 0, -1):
        if held[length - 1]:
            return length
    return 0


def _chunked_rule(chunk: int, block_size: int) -> Rule:
    def accept(held: Sequence[bool], x: int) -> int:
        start = (x * block_size // chunk * chunk) // block_size  # the current chunk's first block
        length = start
        while length < x and held[length]:
            length += 1
        return length

    return accept


def rule(group: CacheGroup) -> Rule | None:
    """The group's rule, or None when it constrains nothing (not prefix-cached, or unknown)."""
    if not group.constrains:
        return None
    if group.kind in FULL_KINDS:
        return _full
    if group.kind in WINDOW_KINDS:
        assert group.window is not None
        return _window_rule(math.ceil((group.window - 1) / group.block_size))
    if group.kind == MAMBA:
        return _mamba
    assert group.window is not None  # chunked local attention
    return _chunked_rule(group.window, group.block_size)


def engine_hit(groups: Sequence[tuple[int, Rule, Callable[[int], bool]]], longest: int) -> int:
    """The longest hit (in the index's blocks, at most `longest`) every group accepts. Each
    group is (its block in the index's blocks, its rule, whether it holds the index block at a
    position, the last of its block's). Full-attention groups come first: their leading run
    bounds the rest quickly, as vLLM orders them."""
    held: list[list[bool]] = []
    for scale, _, holds in groups:
        count = longest // scale
        held.append([holds(block * scale + scale - 1) for block in range(count)])
    hit = longest
    while True:
        before = hit
        for (scale, accept, _), blocks in zip(groups, held, strict=True):
            hit = accept(blocks, hit // scale) * scale
        if hit == before:
            return hit


Held = dict[int | None, list[dict[int, int]]]  # per group (None: any), tiers' key -> copies


class GroupSet:
    """A worker's KV cache groups, learned from its events or told by its user, and the hit
    they allow. `changed` hears every change (a reader process journals them)."""

    def __init__(self, block_size: int, changed: Callable[[GroupSet], None]) -> None:
        self.block_size = block_size  # the index's
        self.groups: dict[int, CacheGroup] = {}
        self.told: set[int] = set()  # groups its user gave (`PrefixIndex.set_groups`): kept
        self._changed = changed
        self._rules: list[tuple[int, int, Rule]] | None = None  # (group, scale, rule), cached

    def learn(self, event: BlockStored) -> int:
        """Learn the event's group from it (unless its user told it), and return how many of
        the index's blocks one of the event's blocks is. Refuses, before anything changes, a
        group whose blocks are not a whole number of the index's."""
        index, size = event.group_idx, event.block_size
        if index is None:
            return 1  # no group: cut as the index cuts (a size of its own is `mismatched`)
        check_block_size(index, size, self.block_size)
        if index not in self.told:
            learned = group_of(event)
            if self.groups.get(index) != learned:
                self.set(index, learned)
        return self.groups[index].block_size // self.block_size

    def set(self, index: int, group: CacheGroup, told: bool = False) -> None:
        self.groups[index] = group
        if told:
            self.told.add(index)
        self._rules = None
        self._changed(self)

    def specs(self) -> dict[int, tuple[str, int, int | None]]:
        return {i: (g.kind, g.block_size, g.window) for i, g in self.groups.items()}

    def set_specs(self, specs: Mapping[int, Sequence[Any]]) -> None:
        """The groups as `specs` gave them (another process's)."""
        self.groups = {int(i): CacheGroup(*spec) for i, spec in specs.items()}
        self._rules = None

    @property
    def unknown(self) -> int:
        return sum(not group.known for group in self.groups.values())

    def rules(self) -> list[tuple[int, int, Rule]]:
        """(group, scale, rule) of each group that constrains a hit, full attention first."""
        if self._rules is None:
            found = []
            for index, group in sorted(self.groups.items()):
                accept = rule(group)
                if accept is not None:
                    found.append((not group.prefix_closed, index, group, accept))
            found.sort(key=lambda item: item[:2])
            self._rules = [
                (index, group.block_size // self.block_size, accept)
                for _, index, group, accept in found
            ]
        return self._rules

    def prefix_closed(self) -> bool:
        """Whether no hit can pass the worker's leading run of keys held anywhere: a group
        needs every block before the hit, and its blocks are the index's (a larger block is
        held by its last index block's key alone)."""
        rules = self.rules()
        return not rules or any(
            self.groups[index].prefix_closed and scale == 1 for index, scale, _ in rules
        )

    def hit(self, keys: Sequence[int], longest: int, held: Held) -> int:
        """The longest hit, at most `longest` of the request's `keys`, that every group whose
        rule is known accepts from what `held` says it holds; with none known, the leading
        run held in any group."""
        rules = self.rules()
        if not rules:
            anywhere = held[None]
            run = 0
            while run < longest and any(keys[run] in counts for counts in anywhere):
                run += 1
            return run
        groups = []
        for index, scale, accept in rules:
            sets = held.get(index, [])
            groups.append((scale, accept, lambda at, sets=sets: any(keys[at] in s for s in sets)))
        return engine_hit(groups, longest)
