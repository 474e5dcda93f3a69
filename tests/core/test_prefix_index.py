"""The prefix index, without sockets: its answers against a brute-force oracle, and each rule."""

from __future__ import annotations

import random
from array import array
from collections.abc import Callable
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.strategies import examples
from tskv import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, KVEventBatch, MMKey
from tskv.core.journal_index import JournalIndex
from tskv.core.prefix_index import PrefixIndex

BS = 2  # tokens a block: small, so random streams share prefixes often
Path = tuple[object, ...]


def items_of(mm_keys: list[list[MMKey]] | None, index: int) -> object:
    """A block's multimodal items as the oracle tells them apart: content hash and offset."""
    if mm_keys is None or index >= len(mm_keys) or not mm_keys[index]:
        return None
    return tuple((key.hash, key.start_offset) for key in mm_keys[index])


class Oracle:
    """Per worker: engine hash -> the whole identity of the prefix the block ends, written
    out (the salt, then each block's tokens and multimodal items); None: parent unknown."""

    def __init__(self) -> None:
        self.held: dict[str, dict[int, Path | None]] = {}

    def apply(self, worker: str, events: list) -> None:  # type: ignore[type-arg]
        held = self.held.setdefault(worker, {})
        for event in events:
            if isinstance(event, BlockStored):
                path: Path | None = (
                    (("salt", event.cache_salt),)
                    if event.parent_block_hash is None
                    else held.get(event.parent_block_hash)
                )
                for i, block in enumerate(event.block_hashes):
                    chunk = tuple(event.token_ids[i * BS : (i + 1) * BS])
                    if path is None or len(chunk) != BS:
                        path = None
                    else:
                        path = (*path, (chunk, items_of(event.mm_keys, i)))
                    held[block] = path
            elif isinstance(event, BlockRemoved):
                for block in event.block_hashes:
                    held.pop(block, None)
            else:
                held.clear()

    def match(self, query: Query) -> dict[str, int]:
        tokens, salt, mm_keys = query
        result = {}
        for worker, held in self.held.items():
            paths = set(held.values())
            path: Path = (("salt", salt),)
            depth = 0
            while depth < len(tokens) // BS:
                chunk = tuple(tokens[depth * BS : (depth + 1) * BS])
                path = (*path, (chunk, items_of(mm_keys, depth)))
                if path not in paths:
                    break
                depth += 1
            if depth:
                result[worker] = depth
        return result


# A tiny vocabulary, so many shared prefixes; a string now and then (TensorRT-LLM's
# placeholder), which only the index's own process can hash.
tokens = st.sampled_from([0, 1, 2, 0, 1, 2, "<image>"])
workers = st.sampled_from(["a", "b", "c", "d"])
salts = st.sampled_from([None, None, "tenant-1", "tenant-2"])
# per block: no item, or one of two images at one of two offsets
block_items = st.lists(st.builds(MMKey, st.sampled_from(["img-a", "img-b"]), st.integers(0, 1)))
mm_keys = st.none() | st.lists(block_items, max_size=3)
Query = tuple[list[int], str | None, list[list[MMKey]] | None]
queries = st.tuples(st.lists(tokens, max_size=10), salts, mm_keys)


def events(draw: st.DrawFn) -> list[KVEvent]:
    """One to three events: often several BlockStored in one batch, stored as one run, whose
    parents may be blocks stored just before them in it."""
    out: list[KVEvent] = []
    last: list[int] = []  # the batch's last stored block, as a scheduler chains its events
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["store", "store", "store", "remove", "clear"]))
        if kind == "store":
            count = draw(st.integers(1, 3))
            hashes = draw(st.lists(st.integers(0, 40), min_size=count, max_size=count, unique=True))
            size = draw(st.sampled_from([count * BS, count * BS, count * BS - 1]))
            body = draw(st.lists(tokens, min_size=size, max_size=size))
            parent = draw(st.none() | st.integers(0, 40) | st.sampled_from(last or [None]))
            stored = BlockStored(
                hashes, parent, body, BS, cache_salt=draw(salts), mm_keys=draw(mm_keys)
            )
            out.append(stored)
            last = hashes[-1:]
        elif kind == "remove":
            out.append(BlockRemoved(draw(st.lists(st.integers(0, 40), max_size=4))))
        else:
            out.append(AllBlocksCleared())
    return out


@st.composite
def streams(draw: st.DrawFn) -> list[tuple[str, list]]:  # type: ignore[type-arg]
    """Batches from four workers, each storing chains under parents it has stored (or not);
    None: the worker is removed (its slot then goes to the next new worker)."""
    out = []
    for _ in range(draw(st.integers(0, 30))):
        worker = draw(workers)
        out.append((worker, None if draw(st.integers(0, 5)) == 0 else events(draw)))
    return out


def packed(runs: list[list[int]]) -> list[bytes]:
    """Runs as a reader's report carries them: each run's keys, 8 bytes each, in bytes."""
    return [array("q", run).tobytes() for run in runs]


@settings(max_examples=examples(400))
@given(
    streams(),
    st.lists(queries, min_size=1, max_size=5),
    st.sampled_from(["applied", "mirrored", "packed"]),
)
def test_every_answer_equals_the_brute_force_oracle(
    stream: list[tuple[str, list]],  # type: ignore[type-arg]
    asked: list[Query],
    how: str,
) -> None:
    """The index that applies the events answers, or one that mirrors its changes as a
    watcher's reader process sends them (msgpack, and back; "packed": each run's keys in
    bytes, as the index's process keeps them from a report)."""
    mirrored = how != "applied"
    source: Any = JournalIndex(BS) if mirrored else PrefixIndex(BS)
    oracle = Oracle()
    index = PrefixIndex(BS) if mirrored else source
    for worker, events in stream:
        if events is None:
            source.remove_worker(worker)
            index.remove_worker(worker)
            oracle.held.pop(worker, None)
        else:
            source.apply(worker, KVEventBatch(0.0, events))
            if mirrored:
                runs, ops = msgpack.unpackb(msgpack.packb(source.take_changes(worker)))
                if how == "packed":
                    runs = packed(runs)
                index.apply_changes(worker, runs, ops, strings=source.seen_strings)
            oracle.apply(worker, events)
        for query in asked:
            tokens, salt, mm = query
            answer = index.match(tokens, cache_salt=salt, mm_keys=mm)
            assert dict(answer) == oracle.match(query)
            assert (answer.workers, answer.stale) == (tuple(index.workers), index.stale)
            assert answer.block_size == BS and answer.predicted == answer.lower == {}
    for worker, held in oracle.held.items():
        assert source.engine_hashes(worker) == set(held)
        for path in held.values():  # every prefix a worker holds, asked for
            if path is not None:
                query = query_for(path)
                tokens, salt, mm = query
                assert dict(index.match(tokens, cache_salt=salt, mm_keys=mm)) == oracle.match(query)


def query_for(path: Path) -> Query:
    """The request whose blocks are the oracle's `path`."""
    (_, salt), *blocks = path
    tokens = [token for chunk, _ in blocks for token in chunk]  # type: ignore[attr-defined]
    mm = [[MMKey(h, at) for h, at in items or ()] for _, items in blocks]  # type: ignore[attr-defined]
    return tokens, salt, mm  # type: ignore[return-value]


def chain(tokens: list[int], hashes: list[int]) -> BlockStored:
    return BlockStored(hashes, None, tokens, BS)


def test_engine_hashing_does_not_matter_only_the_tokens() -> None:
    index = PrefixIndex(BS)
    index.apply("fnv", [chain([1, 2, 3, 4, 5, 6], [11, 12, 13])])
    index.apply("sha", [chain([1, 2, 3, 4], [2**63 + 7, -5])])  # other hashes, shorter
    index.apply("other", [chain([1, 2, 9, 9], [11, 12])])  # the same hashes, other tokens
    assert index.match([1, 2, 3, 4, 5, 6, 7]) == {"fnv": 3, "sha": 2, "other": 1}
    index.apply("fnv", [BlockRemoved([12])])  # by the engine's hash: 13 is cut off too
    assert index.match([1, 2, 3, 4, 5, 6]) == {"fnv": 1, "sha": 2, "other": 1}


def test_lora_and_extra_keys_separate_prefixes() -> None:
    index = PrefixIndex(BS)
    index.apply("base", [BlockStored([1], None, [5, 5], BS)])
    index.apply("lora", [BlockStored([1], None, [5, 5], BS, lora_name="sql")])
    index.apply("image", [BlockStored([1], None, [5, 5], BS, extra_keys=[["img-hash"]])])
    assert index.match([5, 5]) == {"base": 1}
    assert index.match([5, 5], lora_name="sql") == {"lora": 1}
    assert index.match([5, 5], extra_keys=[("img-hash",)]) == {"image": 1}


def test_a_tenants_salted_blocks_never_answer_another_tenants_query() -> None:
    index = PrefixIndex(BS)
    index.apply("a", [BlockStored([1, 2], None, [5, 5, 6, 6], BS, cache_salt="tenant-a")])
    index.apply("b", [BlockStored([1, 2], None, [5, 5, 6, 6], BS, cache_salt="tenant-b")])
    index.apply("plain", [BlockStored([1, 2], None, [5, 5, 6, 6], BS)])
    assert index.match([5, 5, 6, 6], cache_salt="tenant-a") == {"a": 2}
    assert index.match([5, 5, 6, 6], cache_salt="tenant-b") == {"b": 2}
    assert index.match([5, 5, 6, 6]) == {"plain": 2}


def test_multimodal_items_and_string_tokens_are_part_of_a_blocks_identity() -> None:
    image = [[MMKey("9f2c", 1, "img-0")], []]
    index = PrefixIndex(BS)
    index.apply("w", [BlockStored([1, 2], None, [1, "<image>", 3, 4], BS, mm_keys=image)])
    assert index.match([1, "<image>", 3, 4], mm_keys=image) == {"w": 2}
    relabelled = [[MMKey("9f2c", 1, "another-uuid")], []]  # the uuid names, it does not identify
    assert index.match([1, "<image>", 3, 4], mm_keys=relabelled) == {"w": 2}
    assert index.match([1, "<image>", 3, 4], mm_keys=[[MMKey("other", 1)], []]) == {}
    assert index.match([1, "<image>", 3, 4]) == {}  # the same placeholder, no image: no hit


def test_what_is_not_an_event_or_a_token_list_is_refused_naming_it() -> None:
    index = PrefixIndex(BS)
    with pytest.raises(TypeError, match="42 is not a tskv BlockStored"):
        index.apply("w", [42])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="token_ids = None must be a sequence"):
        index.match(None)  # type: ignore[arg-type]


def test_a_block_cached_in_two_tiers_stays_until_both_are_removed() -> None:
    index = PrefixIndex(BS)
    index.apply("w", [chain([1, 1], [9]), BlockStored([9], None, [1, 1], BS, medium="CPU")])
    index.apply("w", [BlockRemoved([9])])  # evicted from the GPU, still on the CPU
    assert index.match([1, 1]) == {"w": 1}
    index.apply("w", [BlockRemoved([9], medium="CPU")])
    assert index.match([1, 1]) == {} and len(index) == 0


def test_a_removal_in_one_kv_cache_group_leaves_the_other_groups_copies() -> None:
    """vLLM 0.33 names the group of every store and removal: a sliding-window group letting go
    of blocks outside its window leaves the full-attention group's copies held."""
    index = PrefixIndex(BS)
    tokens = [11, 11, 12, 12, 13, 13, 14, 14]
    for group in (0, 1):
        index.apply("w", [BlockStored([11, 12, 13, 14], None, tokens, BS, group_idx=group)])
    index.apply("w", [BlockRemoved([11, 12], group_idx=1)])
    assert index.match(tokens) == {"w": 4}
    index.apply("w", [BlockRemoved([11, 12, 13, 14], group_idx=0)])
    assert index.match(tokens) == {} and index.engine_hashes("w") == {13, 14}


def test_stale_workers_are_named_until_a_clear_or_mark_current() -> None:
    index = PrefixIndex(BS)
    index.apply("a", [chain([1, 1], [1])])
    index.apply("b", [chain([1, 1], [1])])
    index.mark_stale("a")
    result = index.match([1, 1])
    assert result == {"a": 1, "b": 1} and result.stale == {"a"}
    assert result.best() == ("b", 1) and result.best(trusted_only=False)[1] == 1
    index.apply("a", [AllBlocksCleared(), chain([1, 1], [1])])  # a snapshot starts so
    assert index.match([1, 1]).stale == frozenset()
    index.mark_stale("b")
    assert index.match([1, 1]).stale == {"b"}
    index.mark_current("b")
    assert not index.stale and index.match([1, 1]).stale == frozenset()
    index.mark_stale("a")
    index.remove_worker("a")
    answer = index.match([1, 1])
    assert (answer, answer.stale, answer.workers) == ({"b": 1}, frozenset(), ("b",))


def test_removed_workers_free_their_slot_and_blocks() -> None:
    index = PrefixIndex(BS)
    for n in range(200):  # more workers than a machine word: masks are Python ints
        index.apply(("w", n), [chain([n % 3, 0], [n])])
    assert len(index.match([0, 0])) == 67
    for n in range(0, 200, 2):
        index.remove_worker(("w", n))
    index.apply("new", [chain([0, 0], [5])])  # reuses a freed slot
    assert set(index.match([0, 0])) == {("w", n) for n in range(3, 200, 6)} | {"new"}
    assert len(index.workers) == 101


def test_orphans_and_short_blocks_cannot_be_matched_but_are_removed_by_hash() -> None:
    index = PrefixIndex(BS)
    index.apply("w", [BlockStored([7], 999, [1, 1], BS), BlockStored([8], None, [1], BS)])
    assert index.match([1, 1]) == {} and index.statistics().orphans == 2
    index.apply("w", [BlockRemoved([7, 8])])
    assert index.engine_hashes("w") == set()


def test_a_bad_block_size_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match="block_size = 0"):
        PrefixIndex(0)


def test_the_simulators_stream_leaves_the_index_equal_to_its_cache() -> None:
    from tskv.sim import Simulator, Workload, run_round

    index = PrefixIndex(16)
    sims = {name: (Simulator(64, 16), Workload(seed, 16)) for seed, name in enumerate("xyz")}
    rng = random.Random(0)
    for _ in range(300):
        name = rng.choice("xyz")
        sim, workload = sims[name]
        index.apply(name, run_round(sim, workload, 1))
    for name, (sim, _) in sims.items():
        assert index.engine_hashes(name) == sim.cached_hashes()


def test_statistics_are_a_frozen_value_counting_what_the_index_could_not_use() -> None:
    index = PrefixIndex(block_size=16)
    index.apply("a", [BlockStored([1], None, list(range(32)), 32)])  # cut differently: unused
    index.apply("b", [BlockStored([2], None, list(range(16)), 16)])
    index.apply("b", [BlockStored([4], 3, list(range(16, 32)), 16)])  # its parent never seen
    index.mark_stale("b")
    stats = index.statistics()
    assert (stats.workers, stats.stale, stats.blocks) == (2, 1, 1)
    assert (stats.orphans, stats.mismatched) == (1, 1)
    index.remove_worker("b")
    assert stats.workers == 2 and index.statistics().workers == 1  # a value, not a view


def applied_or_mirrored(
    mirrored: bool | str,
) -> tuple[PrefixIndex, Callable[[str, list[KVEvent]], None]]:
    """An index, and how to give it a worker's events: applied, or (`mirrored`) applied by an
    index that records its changes, which this one mirrors as a reader's frames carry them
    ("packed": each run's keys packed in bytes, as the index's process keeps them)."""
    source: Any = JournalIndex(BS) if mirrored else PrefixIndex(BS)
    index = PrefixIndex(BS) if mirrored else source

    def apply(worker: str, events: list[KVEvent]) -> None:
        source.apply(worker, events)
        if mirrored:
            runs, ops = msgpack.unpackb(msgpack.packb(source.take_changes(worker)))
            if mirrored == "packed":
                runs = packed(runs)
            index.apply_changes(worker, runs, ops)

    return index, apply


@pytest.mark.parametrize("mirrored", [False, True, "packed"])
@pytest.mark.parametrize("ending", ["removed", "cleared", "turned hybrid"])
def test_one_content_under_two_hashes_is_held_until_both_blocks_go(
    mirrored: bool, ending: str
) -> None:
    """Two engine hashes of one content (an engine that hashes in what tskv does not key) are
    one key held twice: it stays until both blocks are removed, however the worker's view
    changes meanwhile, and a reset lets go of every copy."""
    index, apply = applied_or_mirrored(mirrored)
    apply("w", [BlockStored([1], None, [5, 5], BS), BlockStored([2], None, [5, 5], BS)])
    apply("v", [BlockStored([1], None, [5, 5], BS), BlockStored([2], None, [7, 7], BS)])
    if ending == "cleared":
        apply("w", [AllBlocksCleared(), BlockStored([4], None, [5, 5], BS)])
        assert index.match([5, 5]) == {"w": 1, "v": 1}
        apply("w", [BlockRemoved([4])])
    else:
        if ending == "turned hybrid":  # its tiers count its copies from here
            apply("w", [BlockStored([3], None, [6, 6], BS, medium="CPU")])
        apply("w", [BlockRemoved([1])])
        assert index.match([5, 5]) == {"w": 1, "v": 1}
        apply("w", [BlockRemoved([2])])
    assert index.match([5, 5]) == {"v": 1}
    apply("v", [BlockRemoved([1])])
    assert index.match([5, 5]) == {}
    assert len(index) == (2 if ending == "turned hybrid" else 1)  # and no hold left behind


def test_a_run_of_packed_keys_that_is_not_whole_keys_is_refused() -> None:
    index = PrefixIndex(BS)
    with pytest.raises(TypeError, match="8 bytes a key, not 12 bytes"):
        index.apply_changes("w", [bytes(12)])
    assert len(index) == 0


def test_a_reader_processes_index_keeps_no_holders_and_answers_no_query() -> None:
    """A JournalIndex keeps its workers' blocks and journals their holds for the index that
    mirrors them; it has no holders, so it has no query to answer from them."""
    source = JournalIndex(BS)
    source.apply("w", [BlockStored([1], None, [5, 5], BS)])
    assert len(source) == 0 and source.engine_hashes("w") == {1}
    assert not hasattr(source, "match") and not hasattr(source, "predict")
    runs, ops = source.take_changes("w")
    mirror = PrefixIndex(BS)
    mirror.apply_changes("w", runs, ops)
    assert dict(mirror.match([5, 5])) == {"w": 1}


def test_blocks_are_counted_by_the_medium_their_events_name() -> None:
    index = PrefixIndex(4)
    index.apply("w", KVEventBatch(0.0, [BlockStored([1, 2], None, list(range(8)), 4)]))
    assert index.blocks_by_medium("w") == {None: 2}
    index.apply("w", KVEventBatch(0.0, [BlockStored([1], None, list(range(4)), 4, medium="CPU")]))
    assert index.blocks_by_medium("w") == {None: 2, "CPU": 1}  # one block, in two media
    index.apply("w", KVEventBatch(0.0, [BlockRemoved([1, 2])]))
    assert index.blocks_by_medium("w") == {"CPU": 1}
    assert index.blocks_by_medium("nobody") == {}
