"""The compiled core (tskv/core/_compiled.c) gives the pure-Python reference's answers, and
refuses what it refuses, on any input: keys, walks, the holders table, errors. The rest of the
suite runs the index on whichever this process uses (the compiled one where it is built);
`nox -s tests` runs the index's, keys' and holdings' tests again with TSKV_PURE_PYTHON=1."""

from __future__ import annotations

import contextlib
import logging
import os
import random
import subprocess
import sys
from array import array
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tests.strategies import examples
from tskv.core import block_keys, compiled, filing
from tskv.core.events import BlockRemoved, BlockStored, KVEventBatch
from tskv.core.filing import run_keys
from tskv.core.holdings import ABSENT, Bits
from tskv.core.prefix_index import PLAIN_ROOT, Match, PrefixIndex, _walk, counts_of

_compiled = pytest.importorskip("tskv.core._compiled", reason="the compiled core is not built here")
HOME = Path(__file__).resolve().parents[2]

hashes = st.integers(-(2**63), 2**63 - 1)
held_keys = hashes.filter(lambda value: value != -1)  # what hash() gives: never -1
# ints of one digit the walk hashes itself, and those next to it that it asks Python to hash
edges = st.sampled_from([0, 1, -1, -2, 2**30 - 1, 2**30, 1 - 2**30, -(2**30), True, False])
tokens = st.one_of(st.integers(0, 200_000), st.integers(-(2**70), 2**70), edges)
contents = st.one_of(
    st.none(),
    st.tuples(tokens, tokens),
    st.lists(tokens, min_size=1, max_size=8).map(tuple),
    st.tuples(st.tuples(tokens), st.one_of(hashes, st.text(max_size=3))),
)


def outcome(call: Any, *args: Any) -> Any:
    """What a call gives, or the type of what it raises: the two paths must agree on both."""
    try:
        return call(*args)
    except Exception as exc:
        return type(exc)


def hashed_in_c(content: Any, depth: int = 0) -> bool:
    """Whether the compiled core hashes `content` itself: an exact int, or an exact tuple of
    such (nested at most 8 deep). Anything else may hash in Python code: it declines it."""
    if type(content) is tuple:
        return depth < 8 and all(hashed_in_c(item, depth + 1) for item in content)
    return type(content) is int


@given(st.one_of(st.none(), hashes), st.lists(contents, max_size=12))
def test_chain_gives_the_reference_keys_or_leaves_them_to_python(
    root: int | None, blocks: list[Any]
) -> None:
    reference = block_keys.chain(root, blocks)
    made = _compiled.chain(root, blocks)
    reachable = blocks[: next((n for n, key in enumerate(reference) if key is None), len(blocks))]
    if made is None:  # declined: only for a content it reaches and may not hash in C
        assert not all(hashed_in_c(content) for content in reachable)
    else:
        assert made == reference
    assert compiled.chain(root, blocks) == reference  # what the index calls: either way


@st.composite
def runs(draw: st.DrawFn) -> tuple[list[tuple[BlockStored, Any]], dict[Any, Any], int]:
    """A run of stored events as `Filing.apply` hands them to `store_run`, and the worker's
    blocks: parents that are none (a root), the event before's last block, a held block, a
    block earlier in the run, or unknown; now and then an event the compiled keying declines
    (a tier, an identity, a string token id, contents cut already)."""
    size = draw(st.integers(1, 4))
    held = draw(st.dictionaries(hashes, st.one_of(st.none(), hashes), max_size=4))
    run: list[tuple[BlockStored, Any]] = []
    seen: list[int] = []
    for _ in range(draw(st.integers(1, 5))):
        place = draw(st.sampled_from(["root", "last", "earlier", "held", "unknown"]))
        if place == "root" or (place in ("last", "earlier") and not seen):
            parent = None
        elif place == "last":
            parent = seen[-1]
        elif place == "earlier":
            parent = draw(st.sampled_from(seen))
        else:
            parent = draw(st.sampled_from(list(held)) if held and place == "held" else hashes)
        fresh = hashes.filter(lambda block: block not in seen and block not in held)
        block_hashes = draw(st.lists(fresh, min_size=1, max_size=4, unique=True))
        token_ids = draw(st.lists(tokens, min_size=size, max_size=4 * size + 2))
        unusual = draw(st.sampled_from([None] * 12 + ["medium", "extra", "string", "cut"]))
        if unusual == "string":
            token_ids.append("a string")
        event = BlockStored(
            block_hashes,
            parent,
            token_ids,
            draw(st.sampled_from([size, size, size + 1])),
            medium="GPU" if unusual == "medium" else None,
            lora_name=draw(st.sampled_from([None, "adapter"])),
            extra_keys=[None] if unusual == "extra" else None,
        )
        cut = unusual == "cut"
        found = block_keys.contents(token_ids, None, len(block_hashes), size)[0] if cut else None
        run.append((event, found))
        seen.extend(block_hashes)
    return run, held, size


@settings(max_examples=examples(400))
@given(runs())
def test_a_plain_run_is_keyed_as_filing_keys_it(
    case: tuple[list[tuple[BlockStored, Any]], dict[Any, Any], int],
) -> None:
    """The compiled keying of a run gives what `filing.run_keys`'s loop gives, or declines
    exactly when an event is not plain."""
    run, held, size = case
    blocks = _compiled.BlockMap()
    for block, key in held.items():
        blocks[block] = key
    roots = {(None, None): PLAIN_ROOT}
    straight = _compiled.plain_run(run, size, blocks, roots, BlockStored)
    with pytest.MonkeyPatch.context() as patched:
        patched.setattr(compiled, "core", None)
        ids, keys, mismatched, strings = run_keys(run, dict(held), size, {})
    plain = all(
        found is None
        and event.medium is None
        and event.extra_keys is None
        and all(type(token) is int for token in event.token_ids)
        and (event.parent_block_hash is not None or (event.lora_name, None) in roots)
        for event, found in run
    )
    assert straight == ((ids, keys, mismatched) if plain else None)
    assert strings == any("a string" in event.token_ids for event, _ in run)


@st.composite
def walks(draw: st.DrawFn) -> tuple[Any, ...]:
    """A request, and holders that hold some of its prefixes (and of others')."""
    size = draw(st.integers(1, 4))
    request = draw(st.lists(tokens, max_size=6 * size))
    root = draw(hashes)
    keys: list[int] = []
    key = root
    for start in range(0, len(request) - size + 1, size):
        key = hash((key, tuple(request[start : start + size])))
        keys.append(key)
    masks = st.integers(0, 2**70)  # past 64 workers too
    real = {k: draw(masks) for k in keys if draw(st.booleans())}
    real.update(draw(st.dictionaries(held_keys, masks, max_size=3)))
    predicted = draw(st.one_of(st.none(), st.dictionaries(st.sampled_from(keys or [0]), masks)))
    return real, predicted, root, request, size


@settings(max_examples=examples(300))
@given(walks(), st.booleans())
def test_walk_gives_the_reference_walk(case: tuple[Any, ...], keep_keys: bool) -> None:
    real, predicted, root, request, size = case
    compiled_keys: list[int] | None = [] if keep_keys else None
    python_keys: list[int] | None = [] if keep_keys else None
    walked = _compiled.walk(real, predicted, root, request, size, compiled_keys)
    reference = _walk((real, predicted), root, (request, None, None), size, 0, python_keys)
    table = _compiled.KeyTable()  # the table's own walk, where its masks fit 64 bits
    table.update(real)
    on_table = _compiled.walk(table, predicted, root, request, size, None)
    if walked is None:  # declined: only where it would hash a token id that is no exact int
        assert not ints_only(request[: len(request) // size * size])
        assert on_table is None
        return
    assert walked == reference and compiled_keys == python_keys
    assert on_table == walked


def ints_only(tokens: list[Any]) -> bool:
    return all(type(token) is int for token in tokens)


def matcher_over(
    real: dict[int, int],
    size: int,
    workers: int | tuple[Any, ...],
    stale: frozenset[Any] = frozenset(),
) -> tuple[Any, Bits, tuple[Any, ...]]:
    """A Matcher over a table of `real`, with `workers` workers (or these), told its usual
    answer as the index tells it (`PrefixIndex._answers_changed`)."""
    bits = Bits()
    known = workers if isinstance(workers, tuple) else tuple(f"w{n}" for n in range(workers))
    for worker in known:
        bits.take(worker)
    table = _compiled.KeyTable()
    table.update(real)
    matcher = _compiled.Matcher(table, size)
    matcher.set_answer(bits.by_position, Match({}, stale, None, None, size, known))
    return matcher, bits, known


@settings(max_examples=examples(300))
@given(walks(), st.integers(0, 70), st.sets(st.integers(0, 80), max_size=3))
def test_a_whole_query_gives_the_reference_answer(
    case: tuple[Any, ...], workers: int, stale_numbers: set[int]
) -> None:
    """The Matcher is `_leading_counts` over a table in one call: the same counts in the same
    order, the same error where a mask has a bit no worker has, a Match as the index makes
    it; None where a mask is past 64 bits or a token id is not an exact int (the general path
    walks then)."""
    real, _, root, request, size = case
    stale = {f"w{number}" for number in stale_numbers}
    matcher, bits, known = matcher_over(real, size, workers, frozenset(stale))
    answer = outcome(matcher, root, request)
    if any(mask >> 64 for mask in real.values()):
        assert answer is None
        return
    if answer is None:
        assert not ints_only(request[: len(request) // size * size])
        return
    walked = outcome(_walk, (real, None), root, (request, None, None), size, 0, None)
    if isinstance(walked, type):
        assert answer is walked
        return
    expected = outcome(counts_of, walked, bits)
    if isinstance(expected, type):
        assert answer is expected
        return
    assert type(answer) is Match
    assert (answer, list(answer)) == (expected, list(expected))
    made = Match(expected, frozenset(stale), None, None, size, known)
    for slot in Match.__slots__:
        assert getattr(answer, slot) == getattr(made, slot)


def test_a_whole_query_declines_what_it_cannot_read_in_c() -> None:
    """None, so that the index walks: token ids not a list, a token id the walk reaches that
    is not an exact int (a string, a bool, an int subclass, a float), a root key not an exact
    int, a worker whose hash may be Python code. Past where the walk stops, it reads nothing."""

    class Id(int):
        pass

    key = hash((PLAIN_ROOT, (1, 2)))
    matcher, _, _ = matcher_over({key: 1}, 2, 1)
    assert matcher(PLAIN_ROOT, [1, 2]) == {"w0": 1}
    assert matcher(PLAIN_ROOT, (1, 2)) is None
    assert matcher(Id(PLAIN_ROOT), [1, 2]) is None
    for other in ("<image>", True, Id(2), 2.0):
        assert matcher(PLAIN_ROOT, [1, other]) is None
        assert matcher(PLAIN_ROOT, [9, 9, 3, other]) == {}  # the walk stops before it
    for worker in (Seven(), ("w", Seven())):
        matcher, _, _ = matcher_over({key: 1}, 2, (worker,))
        assert matcher(PLAIN_ROOT, [1, 2]) is None
    plain = (("i", 0), b"w", 1.5, None, True)
    matcher, _, _ = matcher_over({key: 1}, 2, plain, frozenset({("i", 0)}))
    assert matcher(PLAIN_ROOT, [1, 2]) == {("i", 0): 1}


def test_each_answer_is_a_copy_of_the_usual_answer_its_constructor_made() -> None:
    """The fields are those `Match(...)` set, whatever they are: a slot the constructor adds
    reaches every answer with no change to the C. Each answer has dicts of its own; a change
    to the usual answer after it was given reaches no answer; a new one, every later answer."""

    class Costed(dict[Any, int]):  # Match with one more field, set by its constructor
        __slots__ = (*Match.__slots__, "cost")

        def __init__(self, stale: frozenset[Any], workers: tuple[Any, ...]) -> None:
            super().__init__()
            self.stale, self.workers, self.block_size = stale, workers, 2
            self.predicted, self.lower, self.cost = {}, {}, ("priced", 3)

    key = hash((PLAIN_ROOT, (1, 2)))
    matcher, bits, known = matcher_over({key: 0b11}, 2, 2)
    usual = Costed(frozenset({"w1"}), known)
    matcher.set_answer(bits.by_position, usual)
    first, second = matcher(PLAIN_ROOT, [1, 2]), matcher(PLAIN_ROOT, [1, 2])
    assert type(first) is Costed and first == {"w0": 1, "w1": 1}
    assert (first.stale, first.workers, first.cost) == (frozenset({"w1"}), known, ("priced", 3))
    assert first.predicted == {} and first.predicted is not second.predicted
    assert first.lower is not second.lower and first.lower is not usual.lower
    usual.cost = "changed after"
    usual.lower["w0"] = 1
    assert (matcher(PLAIN_ROOT, [1, 2]).cost, matcher(PLAIN_ROOT, [1, 2]).lower) == (
        ("priced", 3),
        {},
    )
    matcher.set_answer(bits.by_position, Match({}, frozenset(), None, None, 2, known))
    assert matcher(PLAIN_ROOT, [1, 2]).stale == frozenset() and first.stale == {"w1"}


class Emptying:
    """An item whose hash empties the list it is in (its items then move)."""

    items: list[Any]

    def __hash__(self) -> int:
        self.items.clear()
        self.items.extend(range(10_000))  # the list's items are made again elsewhere
        self.items.clear()
        return 5


class EmptyingInt(int):  # the same, an int: a block id a slot can hold
    items: list[Any]
    __hash__ = Emptying.__hash__


def emptying(items: list[Any], kind: type = Emptying) -> Any:
    item = kind()
    item.items = items
    return item


MOVED = "a list changed while it was read"


def test_token_ids_whose_hash_is_python_code_are_never_hashed_in_c() -> None:
    """A token id whose own __hash__ empties the list being walked: the compiled walks decline
    the request without calling it (nothing they read can change under them), and the index
    answers it through the pure path, as the pure-Python index does."""
    held = {hash((PLAIN_ROOT, (1, 2, 3, 4))): 1}  # the first block: the walk goes on
    table = _compiled.KeyTable()
    table.update(held)
    matcher = _compiled.Matcher(table, 4)
    matcher.set_answer(("w",), Match({}, frozenset(), None, None, 4, ("w",)))
    for kind in (Emptying, EmptyingInt):
        for walk in (
            lambda tokens: matcher(PLAIN_ROOT, tokens),
            lambda tokens: _compiled.walk(table, None, PLAIN_ROOT, tokens, 4, None),
            lambda tokens: _compiled.walk(held, None, PLAIN_ROOT, tokens, 4, None),
        ):
            tokens: list[Any] = [1, 2, 3, 4] * 64
            tokens[5] = emptying(tokens, kind)
            assert walk(tokens) is None
            assert len(tokens) == 256  # its hash never ran


def test_the_index_answers_hostile_token_ids_as_the_pure_index_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def answer(tokens: list[Any]) -> Any:
        index = PrefixIndex(4)
        index.apply("w", KVEventBatch(0.0, [BlockStored([1, 2], None, list(range(8)), 4)]))
        return outcome(lambda: dict(index.match(tokens)))

    def hostile() -> list[Any]:
        tokens: list[Any] = list(range(8)) * 4
        tokens[5] = emptying(tokens, EmptyingInt)
        return tokens

    compiled_answer = answer(hostile())
    monkeypatch.setattr(compiled, "core", None)
    assert compiled_answer == answer(hostile())


class RaisingInt(int):
    """A block id whose hash raises."""

    def __hash__(self) -> int:
        raise ValueError("this id has no hash")


@pytest.mark.parametrize("kind", ["emptying", "raising", "tuple"])
def test_the_index_files_hostile_block_ids_as_the_pure_index_does(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Block ids whose hash is Python code (one empties the event's token ids, one raises)
    in a run of stores and in a removal, through the public index: the compiled index gives
    the pure index's answers, or its error, and neither crashes."""

    def filed() -> Any:
        index = PrefixIndex(4)
        tokens = list(range(40))
        odd: Any = {"emptying": EmptyingInt(11), "raising": RaisingInt(11), "tuple": (1, 11)}[kind]
        if kind == "emptying":
            odd.items = tokens
        events = [
            BlockStored([1, 2, 3], None, tokens[:12], 4),
            BlockStored([odd, 12], 3, tokens[12:20], 4),
            BlockStored([13, 14], 12, tokens[20:28], 4),
        ]
        applied = outcome(lambda: index.apply("w", KVEventBatch(0.0, events)))
        asked = outcome(lambda: dict(index.match(list(range(28)))))
        removed = outcome(lambda: index.apply("w", KVEventBatch(1.0, [BlockRemoved([2, odd])])))
        return applied, asked, removed, dict(index.match(list(range(28)))), len(index)

    compiled_answer = filed()
    monkeypatch.setattr(compiled, "core", None)
    assert compiled_answer == filed()


def test_ids_whose_hash_is_python_code_are_never_hashed_in_a_loop() -> None:
    """Where the block ids a removal pops or a store adds are not plain (an int subclass, an
    object with its own hash), or the dict beside the slots holds such an id, the map's loops
    decline before hashing any: the list is as it was, and filing pops or stores them one call
    at a time. chain's contents, whose hashes may be Python code, it declines too."""
    blocks = _compiled.BlockMap()
    blocks[("cpu", 1)] = 3  # a tier's id: plain, kept beside the slots
    ids: list[Any] = list(range(100))
    ids[1] = emptying(ids)
    assert blocks.pop_many(ids, None) is None and len(ids) == 100
    ids = list(range(100))
    ids[1] = emptying(ids, EmptyingInt)
    assert blocks.add_new(ids, list(range(100))) is None and len(ids) == 100
    blocks[emptying([])] = 4  # a non-plain id beside the slots: every loop declines now
    assert blocks.pop_many([1, 2], None) is None and blocks.add_new([1], [2]) is None
    contents: list[Any] = [(1, 2)] * 100
    contents[1] = (emptying(contents),)  # a block's content whose hash empties the blocks
    assert _compiled.chain(0, contents) is None and len(contents) == 100  # never hashed here


class Seven:
    """A block id of hash 7, equal to any other Seven."""

    def __hash__(self) -> int:
        return 7

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Seven)


class Clearing:
    """A block id of the same hash whose equality empties the map that holds it, then makes a
    dict of its own: the map lets go of the dict beside its slots while a lookup in it is under
    way, and CPython gives that dict's memory to the new one. A lookup that did not hold the
    dict went on in the new one, and answered from it."""

    def __init__(self, blocks: Any) -> None:
        self.blocks = blocks
        self.kept: list[dict[Any, str]] = []

    def __hash__(self) -> int:
        return 7

    def __eq__(self, other: object) -> bool:
        self.blocks.clear()
        self.kept.append({Seven(): "another dict's"})
        return False


@pytest.mark.parametrize(
    ("call", "answer"),
    [
        (lambda blocks: blocks.get(Seven()), None),
        (lambda blocks: Seven() in blocks, False),
        (lambda blocks: blocks.pop(Seven(), None), None),
        (lambda blocks: blocks.setdefault(Seven(), 1), 1),
    ],
    ids=["get", "contains", "pop", "setdefault"],
)
def test_a_map_emptied_by_an_ids_equality_mid_lookup_answers_from_its_own_dict(
    call: Any, answer: Any
) -> None:
    """Every BlockMap call that looks an id up in the dict beside the slots holds that dict
    while it does: what it answers is that dict's (a dict's own answer when the lookup's
    equality empties it), never another dict's, and the map is left usable. Its loops
    (pop_many, add_new) decline such a map before looking anything up."""
    blocks = _compiled.BlockMap()
    blocks[Clearing(blocks)] = 3  # not an int: kept beside the slots
    blocks[5] = 6
    assert blocks.pop_many([Seven()], None) is None and blocks.add_new([7], [1]) is None
    assert 5 in blocks  # declined, nothing looked up: the equality never ran
    assert call(blocks) == answer
    blocks[8] = 9
    assert blocks.get(8) == 9 and 5 not in blocks  # the equality's clear() took the rest


class EmptyingParent:
    """A parent hash equal to any, whose equality empties an event's token ids."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def __eq__(self, other: object) -> bool:
        self.tokens.clear()
        self.tokens.extend(range(10_000))
        self.tokens.clear()
        return True

    __hash__ = None  # type: ignore[assignment]


def test_a_run_whose_fields_are_python_code_is_declined_unread() -> None:
    """A stored event whose parent's equality is Python code (here it empties the event's
    token ids), or an event of another class than BlockStored (its fields may be properties):
    the compiled keying declines the run before any of it runs, and filing keys it in Python."""
    first = BlockStored([1], None, [1, 2, 3, 4], 4)
    tokens = list(range(5, 205))
    second = BlockStored(list(range(2, 52)), EmptyingParent(tokens), tokens, 4)
    roots = {(None, None): PLAIN_ROOT}
    blocks = _compiled.BlockMap()
    assert (
        _compiled.plain_run([(first, None), (second, None)], 4, blocks, roots, BlockStored) is None
    )
    assert len(tokens) == 200

    class Stored(BlockStored):  # type: ignore[misc]
        pass

    other = Stored([1], None, [1, 2, 3, 4], 4)
    assert _compiled.plain_run([(other, None)], 4, blocks, roots, BlockStored) is None
    assert _compiled.plain_run([(first, None)], 4, blocks, roots, BlockStored) is not None
    assert _compiled.plain_run([(first, None)], 4, {}, roots, BlockStored) is None  # not a map


def test_a_whole_query_names_what_it_refuses() -> None:
    table = _compiled.KeyTable()
    with pytest.raises(TypeError, match="size at least 1"):
        _compiled.Matcher(table, 0)
    with pytest.raises(TypeError, match="no keyword arguments"):
        _compiled.Matcher(table, size=1)
    matcher = _compiled.Matcher(table, 1)
    assert matcher(PLAIN_ROOT, [1]) is None  # no usual answer yet: the pure path answers
    with pytest.raises(TypeError, match=r"takes \(key, tokens\)"):
        matcher(0)
    with pytest.raises(TypeError, match="set_answer"):
        matcher.set_answer([], Match({}, frozenset()))
    matcher.set_answer(("w",), Match({}, frozenset({"w"}), None, None, 1, ("w",)))

    class Unslotted(dict[Any, int]):
        pass

    class Made(dict[Any, int]):
        def __new__(cls) -> Made:
            return super().__new__(cls)

    class Derived(Match):
        __slots__ = ()

    class Open(dict[Any, int]):
        __slots__ = ("cost", "stale")

    for usual in ([], Unslotted(), Made(), Derived({}, frozenset()), Match({1: 1}, frozenset())):
        with pytest.raises(TypeError, match="an empty instance of a direct dict subclass"):
            matcher.set_answer((), usual)
    unset = Open()
    unset.stale = frozenset()
    with pytest.raises(TypeError, match="cost is unset"):
        matcher.set_answer((), unset)
    for shared in ([], {"w": 1}, {1}):
        unset.cost = shared
        with pytest.raises(TypeError, match=r"cost is .*, which answers would share"):
            matcher.set_answer((), unset)
    answer = matcher(PLAIN_ROOT, [1])  # every refusal left it as it was
    assert (answer, answer.stale, answer.workers) == ({}, {"w"}, ("w",))


junk = st.one_of(tokens, st.none(), st.text(max_size=2), st.floats(), st.lists(tokens, max_size=2))


@settings(max_examples=examples(300))
@given(
    st.one_of(junk, st.lists(junk, max_size=9), st.tuples(junk, junk)),
    st.one_of(hashes, junk),
    st.integers(-1, 3),
    st.one_of(st.none(), st.dictionaries(hashes, st.one_of(st.integers(0, 9), junk), max_size=2)),
)
def test_malformed_input_is_refused_alike(request: Any, root: Any, size: int, other: Any) -> None:
    """No crash, and the same answer or the same error, on what a caller may pass by mistake."""
    real: dict[Any, Any] = {} if other is None else other

    def python_walk(*args: Any) -> Any:
        if type(args[4]) is not int or args[4] < 1:  # the compiled walk checks its size first
            raise ValueError
        return _walk((args[0], args[1]), args[2], (args[3], None, None), args[4], 0, None)

    both = (real, None, root, request, size)
    walked = outcome(_compiled.walk, *both, None)
    assert walked is None or walked == outcome(python_walk, *both)  # None: the pure walk's
    blocks = request if isinstance(request, list) else [request]
    keys = outcome(_compiled.chain, root, blocks)
    assert keys is None or keys == outcome(block_keys.chain, root, blocks)
    assert outcome(compiled.chain, root, blocks) == outcome(block_keys.chain, root, blocks)


@given(st.lists(st.one_of(hashes, hashes, st.integers(-(2**70), 2**70), junk), max_size=12))
def test_packed_keys_are_arrays_bytes(keys: list[Any]) -> None:
    """A report's runs as the reader packs them: what array("q") makes, or refuses alike."""
    assert outcome(_compiled.pack_keys, keys) == outcome(lambda: array("q", keys).tobytes())


def test_the_walk_names_what_it_refuses() -> None:
    with pytest.raises(ValueError, match="size = 0 must be at least 1"):
        _compiled.walk({}, None, 0, [1, 2], 0, None)
    with pytest.raises(TypeError, match="predicted must be a dict or None"):
        _compiled.walk({}, [], 0, [1, 2], 1, None)
    with pytest.raises(TypeError, match="tokens must be a sequence"):
        _compiled.walk({}, None, 0, 5, 1, None)


def test_this_process_uses_it_unless_told_not_to() -> None:
    wanted = os.environ.get("TSKV_PURE_PYTHON") != "1"
    assert (compiled.core is _compiled) is wanted
    assert compiled.agrees(_compiled)


CHOSEN = "from tskv.core import compiled; print(compiled.core is not None)"


@pytest.mark.parametrize(("setting", "used"), [("1", "False"), ("0", "True"), ("", "True")])
def test_tskv_pure_python_chooses_the_walk(setting: str, used: str) -> None:
    env = {**os.environ, "TSKV_PURE_PYTHON": setting, "PYTHONPATH": str(HOME)}
    run = subprocess.run([sys.executable, "-c", CHOSEN], env=env, capture_output=True, text=True)
    assert (run.returncode, run.stdout.strip()) == (0, used)


def test_asking_for_it_where_it_is_not_built_says_so_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("TSKV_PURE_PYTHON", "0")
    monkeypatch.setitem(sys.modules, "tskv.core._compiled", None)  # an import of it now fails
    with caplog.at_level(logging.WARNING, logger="tskv"):
        assert compiled._load() is None
    (record,) = caplog.records
    assert "compiled core, but it is not built here" in record.getMessage()
    assert "pip install ." in record.getMessage()


def test_a_module_that_disagrees_with_python_is_not_used(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    class OtherKeys:  # what a CPython with another tuple hash would make of the C module
        walk = staticmethod(_compiled.walk)

        @staticmethod
        def chain(key: int | None, blocks: list[Any]) -> list[int | None]:
            return [None if key is None else key + 1 for _ in blocks]

    assert not compiled.agrees(OtherKeys)  # type: ignore[arg-type]
    monkeypatch.setenv("TSKV_PURE_PYTHON", "")
    monkeypatch.setattr(compiled, "agrees", lambda module: False)
    with caplog.at_level(logging.WARNING, logger="tskv"):
        assert compiled._load() is None
    (record,) = caplog.records
    assert "other keys than this Python's hash()" in record.getMessage()


keys = st.sampled_from([hash(("pool", n)) for n in range(40)] + [0, 1, -2, 2**63 - 1, -(2**63)])
bits = st.integers(0, 63).map(lambda n: 1 << n)
# one worker's (so letting go of its bit empties the key), any, and past 64 workers
masks = st.one_of(bits, st.integers(1, 2**64 - 1), st.integers(1, 2**80))


class KeyTableAsADict(RuleBasedStateMachine):
    """Every operation `Holdings` makes, on the table and on a dict side by side: few keys, so
    slots collide and removals move later keys back."""

    def __init__(self) -> None:
        super().__init__()
        self.table = _compiled.KeyTable()
        self.model: dict[int, int] = {}
        self.extra: dict[int, dict[int, int]] = {}  # bit -> its copies beyond the first

    @rule(key=keys, mask=masks)
    def store(self, key: int, mask: int) -> None:
        self.table[key] = mask
        self.model[key] = mask

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.model)))
        del self.table[key]
        del self.model[key]

    @rule(key=keys)
    def remove_missing_or_not(self, key: int) -> None:
        assert outcome(self.table.__delitem__, key) == outcome(self.model.__delitem__, key)

    @rule(new=st.dictionaries(keys, masks, max_size=5))
    def update(self, new: dict[int, int]) -> None:
        self.table.update(new)
        self.model.update(new)

    @rule(
        bit=bits,
        drawn=st.lists(
            st.lists(st.one_of(keys, st.sampled_from([None, -1])), max_size=20), max_size=4
        ),
        packed=st.sampled_from(["no", "a view", "bytes"]),
    )
    def mirror(self, bit: int, drawn: list[list[int | None]], packed: str) -> None:
        """A reader's runs, as `Holdings.hold` and `release` take them for a mirrored worker
        (a let-go run may name None or ABSENT, -1, for a block that held nothing), as lists or
        packed (a buffer of 8-byte keys, or the bytes a report carries, as the index's process
        keeps them): every copy, a key the worker holds already counted in its extra copies,
        its hold let go of with the last."""
        runs = [
            run if number % 2 else [key for key in run if key is not None and key != -1]
            for number, run in enumerate(drawn)
        ]
        given: list[Any] = list(runs)
        if packed != "no":  # a block that held nothing is -1 there
            arrays = [array("q", [-1 if k is None else k for k in run]) for run in runs]
            given = [memoryview(a) if packed == "a view" else a.tobytes() for a in arrays]
        extra = self.extra.setdefault(bit, {})
        expected, expected_extra, raised = dict(self.model), dict(extra), None
        try:
            for number, run in enumerate(runs):
                for key in run:
                    if key is None or key == -1:
                        continue
                    if number % 2 == 0 and expected.get(key, 0) & bit:
                        expected_extra[key] = expected_extra.get(key, 0) + 1
                    elif number % 2 == 0:
                        expected[key] = expected.get(key, 0) | bit
                    elif key in expected_extra:
                        expected_extra[key] -= 1
                        if not expected_extra[key]:
                            del expected_extra[key]
                    elif (mask := expected[key] & ~bit) != 0:
                        expected[key] = mask
                    else:
                        del expected[key]
        except KeyError:
            raised = KeyError
        assert outcome(self.table.mirror, bit, given, extra) in (None, raised)
        if raised is None:
            self.model = expected
            assert extra == expected_extra
        else:  # the table kept what it did before the missing key: carry on from the table
            self.model = dict(self.table.items())

    @rule(mask=masks, data=st.data())
    def add_new(self, mask: int, data: st.DataObject) -> None:
        """`Holdings.hold`'s usual case, content no worker held: every key stored, or none
        (one held already, or one twice); declined (None) for a mask past 64 bits. Longer than
        the keys fetched ahead, and often with a key twice: what was stored goes again."""
        held = st.sampled_from(sorted(self.model)) if self.model else keys
        drawn = st.one_of(keys, keys, held, st.sampled_from(["x", 2**70, -1]))
        new = data.draw(st.lists(drawn, max_size=24))
        got = outcome(self.table.add_new, new, mask)
        fresh = dict.fromkeys(new, mask)
        if mask >= 2**64:
            assert got is None
        elif not all(type(key) is int and key != -1 and -(2**63) <= key < 2**63 for key in new):
            assert got is TypeError  # as storing it is; nothing was stored
        elif len(fresh) == len(new) and self.model.keys().isdisjoint(fresh):
            assert got is True
            self.model.update(fresh)
        else:
            assert got is False

    @rule()
    def narrow(self) -> None:
        """Drop the masks past 64 workers, so that `let_go` has states it does not decline."""
        for key in [key for key, mask in self.model.items() if mask >= 2**64]:
            del self.table[key]
            del self.model[key]

    @rule(bit=st.one_of(bits, st.just(1 << 70)), data=st.data())
    def let_go(self, bit: int, data: st.DataObject) -> None:
        """`Holdings.release` for a worker with no other refs and no predictions: done in one
        call, or declined (None) where a mask is past 64 bits, and the Python loop does it."""
        held = st.sampled_from(sorted(self.model)) if self.model else keys
        drawn = st.one_of(held, held, keys, st.sampled_from([None, -1, "x", 2**70]))
        keys_let_go = data.draw(st.lists(drawn, max_size=6, unique_by=lambda key: key))
        expected, let_go, raised = dict(self.model), [], None
        try:
            for key in keys_let_go:
                if key is None or key == -1:
                    continue
                if mask := expected[key] & ~bit:
                    expected[key] = mask
                else:
                    del expected[key]
                let_go.append(key)
        except KeyError:
            raised = KeyError
        got = outcome(self.table.let_go, keys_let_go, bit)
        if bit >= 2**64 or any(mask >= 2**64 for mask in self.model.values()):
            assert got is None
        elif raised is None:
            assert got == len(let_go)
            self.model = expected
        else:  # the table let go of the keys before the missing one: carry on from the table
            assert got is raised
            self.model = dict(self.table.items())

    @rule(bits=st.integers(0, 2**64 - 1))
    def clear_bits(self, bits: int) -> None:
        """What `Holdings.clear` does when a reader's workers all let go at once."""
        self.table.clear_bits(bits)
        for key, mask in list(self.model.items()):
            if mask & ~bits:
                self.model[key] = mask & ~bits
            else:
                del self.model[key]

    @rule()
    def clear(self) -> None:
        self.table.clear()
        self.model.clear()

    @invariant()
    def reads_alike(self) -> None:
        assert len(self.table) == len(self.model)
        assert dict(self.table.items()) == self.model and sorted(self.table) == sorted(self.model)
        for key in (*self.model, hash(("absent",))):
            assert self.table.get(key, 0) == self.model.get(key, 0)
            assert (key in self.table) == (key in self.model)
        assert self.table.keys().isdisjoint([hash(("absent",))])


TestKeyTableAsADict = KeyTableAsADict.TestCase
TestKeyTableAsADict.settings = settings(max_examples=examples(150), stateful_step_count=40)


@pytest.mark.parametrize(
    ("key", "mask", "error"),
    [
        ("k", 1, TypeError),
        (-1, 1, TypeError),
        (2**64, 1, TypeError),
        (5, -1, ValueError),
        (5, "1", TypeError),
        (None, 1, TypeError),
    ],
)
def test_the_table_refuses_what_no_key_or_mask_is(key: Any, mask: Any, error: type) -> None:
    table = _compiled.KeyTable()
    with pytest.raises(error, match=r"KeyTable: a (key|mask)"):
        table[key] = mask
    assert len(table) == 0 and table.get(key, 7) == 7 and key not in table


@pytest.mark.parametrize("key", ["x", 2**70, 1.5, (1, 2)])
def test_letting_go_of_what_no_key_is_fails_as_the_holders_lookup_does(key: Any) -> None:
    """`Holdings.release`'s loop looks each key up (`holders[key]`): `let_go` raises alike."""
    table = _compiled.KeyTable()
    table.update({5: 1})
    assert outcome(table.let_go, [key], 1) is outcome(table.__getitem__, key) is KeyError
    assert dict(table.items()) == {5: 1}


def test_a_block_the_walk_never_reaches_is_never_read() -> None:
    """The table's walk makes keys ahead of its lookups: a block it cannot key in C (an
    unhashable token) past where the walk stops is not the walk's business, as in Python;
    reached, the walk declines it, and the pure walk raises as Python does."""
    first = hash((5, (1, 2)))
    table = _compiled.KeyTable()
    table.update({first: 1})
    stops_before = [1, 2, 3, 4, [9], 9]
    assert _compiled.walk(table, None, 5, stops_before, 2, None) == ([(0, 1), (1, 0)], 3)
    table[hash((first, (3, 4)))] = 1  # now the walk reaches the unhashable block
    assert _compiled.walk(table, None, 5, stops_before, 2, None) is None
    with pytest.raises(TypeError, match="unhashable"):
        _walk((dict(table.items()), None), 5, (stops_before, None, None), 2, 0, None)


def test_a_walk_over_the_table_is_the_walk_over_a_dict() -> None:
    holders = {hash((hash((1, (5, 6))), (7, 8))): 2**70 | 6}
    request = [5, 6, 7, 8, 9, 9]
    key = hash((1, (5, 6)))
    for masks in ({key: 7, **holders}, {key: 7}, {key: 2**63 | 1}):
        table = _compiled.KeyTable()
        table.update(masks)
        expected = _walk((masks, None), 1, (request, None, None), 2, 0, None)
        assert _compiled.walk(table, None, 1, request, 2, None) == expected
        assert _compiled.walk(table, {key: 8}, 1, request, 2, None) == _walk(
            (masks, {key: 8}), 1, (request, None, None), 2, 0, None
        )


@settings(max_examples=examples(300))
@given(
    st.one_of(bits, st.integers(-5, 2**70), junk),
    st.one_of(st.lists(st.lists(st.one_of(keys, junk), max_size=4), max_size=3), junk),
    st.dictionaries(keys, st.one_of(st.integers(-3, 3), st.integers(2**63), junk), max_size=3),
)
def test_malformed_runs_are_refused_without_harm(bit: Any, runs: Any, extra: Any) -> None:
    """What a broken reader frame could hand `mirror`, with a worker's copies counted wrong:
    an error (the frame is refused), never a crash, and the table still answers as a dict of
    what it holds."""
    table = _compiled.KeyTable()
    table.update({hash(("kept",)): 1})
    with contextlib.suppress(TypeError, KeyError, OverflowError, ValueError):
        table.mirror(bit, runs, extra)
    assert dict(table.items()) == {key: table[key] for key in table}
    assert len(table) == len(dict(table.items()))


block_ids = st.one_of(
    st.sampled_from([0, 1, 2**63, 2**64 - 2, 2**64 - 1, 2**64, -1, -(2**63)]),
    st.integers(0, 40),
    st.tuples(
        st.sampled_from(["GPU", "CPU", None]), st.sampled_from([0, 1, None]), st.integers(0, 9)
    ),
)
block_values = st.one_of(
    st.none(), keys, st.integers(-(2**63), 2**63 - 1), st.just(-1), st.just(2**70)
)


class BlockMapAsADict(RuleBasedStateMachine):
    """Every operation the index makes on a worker's blocks, on BlockMap and on a dict side by
    side: ids a slot holds and ids it cannot (tuples, negative, past 64 bits), keys and None."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = _compiled.BlockMap()
        self.model: dict[Any, Any] = {}

    @rule(block=block_ids, key=block_values)
    def store(self, block: Any, key: Any) -> None:
        self.blocks[block] = key
        self.model[block] = key

    @rule(block=block_ids, default=st.sampled_from([None, -1, "absent"]))
    def pop(self, block: Any, default: Any) -> None:
        assert self.blocks.pop(block, default) == self.model.pop(block, default)

    @rule(blocks=st.lists(block_ids, max_size=6), default=st.sampled_from([None, -1]))
    def pop_many(self, blocks: list[Any], default: Any) -> None:
        """A BlockRemoved's blocks, as `Filing.remove` pops them: in one call, unless the map
        declines (an id that is not plain, here or given), having popped nothing."""
        expected = [self.model.pop(block, default) for block in blocks]
        got = self.blocks.pop_many(blocks, default)
        if got is None:
            got = [self.blocks.pop(block, default) for block in blocks]
        assert got == expected

    @rule(block=block_ids)
    def delete(self, block: Any) -> None:
        assert outcome(self.blocks.__delitem__, block) == outcome(self.model.__delitem__, block)

    @rule(block=block_ids, key=block_values)
    def setdefault(self, block: Any, key: Any) -> None:
        assert self.blocks.setdefault(block, key) == self.model.setdefault(block, key)

    @rule(pairs=st.lists(st.tuples(block_ids, block_values), max_size=5))
    def update(self, pairs: list[tuple[Any, Any]]) -> None:
        for block, key in pairs:
            self.blocks[block] = key
        self.model.update(pairs)

    @rule(data=st.data())
    def add_new(self, data: st.DataObject) -> None:
        """A run of new blocks, as `filing.add_new` stores it: all of them, or none (one here
        already, or one twice). The map declines (None) what only its dict beside the slots
        holds, and the Python path stores those."""
        held = st.sampled_from(sorted(self.model, key=repr)) if self.model else block_ids
        usual = st.tuples(st.one_of(st.integers(0, 40), held), keys)  # mostly what slots hold
        drawn = st.one_of(usual, usual, usual, st.tuples(block_ids, block_values))
        pairs = data.draw(st.lists(drawn, max_size=24))
        ids, values = [block for block, _ in pairs], [key for _, key in pairs]
        expected = len(set(ids)) == len(ids) and self.model.keys().isdisjoint(ids)
        slots_hold = all(type(block) is int and 0 <= block < 2**64 - 1 for block in ids) and all(
            type(key) is int and key != -1 and -(2**63) <= key < 2**63 for key in values
        )
        got = self.blocks.add_new(ids, values)
        if slots_hold:
            assert got is expected
        else:  # declined, or refused at an id the dict beside holds before the one it declines
            assert got is None or (got is False and not expected)
        if got is None:  # what filing does then
            assert filing.add_new(self.blocks, ids, values) is expected
        assert filing.add_new(self.model, ids, values) is expected

    @rule()
    def clear(self) -> None:
        self.blocks.clear()
        self.model.clear()

    @invariant()
    def reads_alike(self) -> None:
        assert len(self.blocks) == len(self.model)
        assert dict(self.blocks.items()) == self.model
        assert sorted(map(repr, self.blocks)) == sorted(map(repr, self.model))
        assert sorted(map(repr, self.blocks.values())) == sorted(map(repr, self.model.values()))
        for block in (*self.model, 7, (None, None, 7), 2**64 + 5):
            assert self.blocks.get(block, -1) == self.model.get(block, -1)
            assert (block in self.blocks) == (block in self.model)
            assert outcome(self.blocks.__getitem__, block) == outcome(self.model.__getitem__, block)
        assert any(b in self.blocks for b in (7, 8)) != self.model.keys().isdisjoint([7, 8])


TestBlockMapAsADict = BlockMapAsADict.TestCase
TestBlockMapAsADict.settings = settings(max_examples=examples(150), stateful_step_count=40)


@pytest.mark.parametrize("kind", ["KeyTable", "BlockMap"])
def test_a_growing_table_with_removals_stays_a_dict(kind: str) -> None:
    """Tens of thousands of keys through the tables' growth (by half, to sizes that are not
    powers of two) with removals all along, so that runs of keys wrap past the last slot and
    removals move keys back across it: the state machines above keep few keys, and never see
    a table grow, nor one large enough for its own 2 MB pages (past 131,072 slots), nor a batch
    longer than the keys fetched ahead of a lookup."""
    rng = random.Random(kind)
    table = getattr(_compiled, kind)()
    model: dict[int, int] = {}
    held: list[int] = []  # the model's keys, to draw removals from
    for step in range(1, 150_001):
        key = rng.getrandbits(63)
        table[key] = model[key] = step
        held.append(key)
        if rng.random() < 0.45:
            at = rng.randrange(len(held))
            held[at], held[-1] = held[-1], held[at]
            gone = held.pop()
            del table[gone]
            del model[gone]
        if step % 10_000 == 0:
            assert len(table) == len(model)
            assert dict(table.items()) == model
            assert all(table.get(key, -7) == value for key, value in model.items())
        if step % 50_000 == 0:  # batches much longer than the keys fetched ahead
            absent = [rng.getrandbits(63) for _ in range(100)]
            if kind == "KeyTable":
                assert table.keys().isdisjoint(absent) == model.keys().isdisjoint(absent)
                assert not table.keys().isdisjoint([*absent, held[0]])
    assert table.__sizeof__() > 2 << 20
    if kind == "BlockMap":  # a batch of removals, past the fetches ahead
        batch = held[:60] + [rng.getrandbits(63) for _ in range(3)]
        assert table.pop_many(batch, -1) == [model.pop(each, -1) for each in batch]
    else:
        batch = held[:60]
        for each in batch:
            table[each] = model[each] = 1  # one worker's bit
        assert table.let_go([None, *batch, ABSENT], 1) == len(batch)  # the absent passed over
        for each in batch:
            del model[each]
    assert dict(table.items()) == model
    table.clear()  # the large table's pages go back, and a small one grows again
    assert len(table) == 0 and table.get(held[-1], -7) == -7
    table[5] = 6
    assert dict(table.items()) == {5: 6}


def test_a_large_table_is_counted_by_tracemalloc() -> None:
    """A table past 2 MB of slots has memory of its own (for huge pages): tracemalloc, which
    the bench's memory figures read, is told of it as of Python's own allocations."""
    import tracemalloc

    tracemalloc.start()
    try:
        table = _compiled.KeyTable()
        for key in range(1, 150_000):
            table[key * 7919] = 1
        size = table.__sizeof__()
        assert size > 2 << 20
        assert tracemalloc.get_traced_memory()[0] >= size
        del table
        assert tracemalloc.get_traced_memory()[0] < size / 4
    finally:
        tracemalloc.stop()


def _each_allocation_failing(change: Any, make: Any, before: Any, after: Any) -> int:
    """Run `change` on a fresh structure with its n-th allocation failing, for each n until
    it no longer fails; each time the structure must read as `before` or as `after`, whole.
    Returns how many of the runs failed."""
    testcapi = pytest.importorskip("_testcapi", reason="this Python has no _testcapi")
    failures = 0
    for failing in range(64):
        structure = make()
        testcapi.set_nomemory(failing, failing + 1)
        try:
            change(structure)
        except MemoryError:
            failures += 1
        else:
            if failing > 0:
                break  # past the allocations the change makes
        finally:
            testcapi.remove_mem_hooks()
        got = {key: structure[key] for key in list(structure)}
        assert got in (before, after), failing
    return failures


def test_a_failed_allocation_leaves_a_table_and_its_side_dict_as_they_were() -> None:
    """A store that grows the table (its 52nd key) with a mask past 64 workers (its high bits
    in the dict beside the slots): whichever allocation fails, the table is as it was."""

    def make() -> Any:
        table = _compiled.KeyTable()
        table.update({key: 1 for key in range(51)})
        return table

    big = (1 << 70) | 3
    before = {key: 1 for key in range(51)}
    failed = _each_allocation_failing(
        lambda table: table.__setitem__(1000, big), make, before, {**before, 1000: big}
    )
    assert failed  # the allocations were reached: the test can fail


def test_a_failed_allocation_leaves_a_blockmap_and_its_side_dict_as_they_were() -> None:
    """An orphan (a None key, kept beside the slots) given its key when the slots must grow:
    whichever allocation fails, the block is still there as it was."""

    def make() -> Any:
        blocks = _compiled.BlockMap()
        for block in range(10, 61):  # 51 in the slots
            blocks[block] = block
        blocks[5] = None  # beside them
        return blocks

    before = {**{block: block for block in range(10, 61)}, 5: None}
    failed = _each_allocation_failing(
        lambda blocks: blocks.__setitem__(5, 7), make, before, {**before, 5: 7}
    )
    assert failed


def test_the_matcher_serves_again_once_no_mask_reaches_past_64_workers() -> None:
    """A key held by a worker past the 64th keeps its high bits in a dict beside the slots,
    and the Matcher leaves such a table's queries to the Python path; once no key needs it,
    the dict goes and the Matcher answers again (it did not: the dict stayed, empty)."""
    table = _compiled.KeyTable()
    key = hash((PLAIN_ROOT, (1, 2, 3, 4)))
    table[key] = 1
    matcher = _compiled.Matcher(table, 4)
    matcher.set_answer(("w",), Match({}, frozenset(), None, None, 4, ("w",)))
    assert matcher(PLAIN_ROOT, [1, 2, 3, 4]) == {"w": 1}
    table[key] = (1 << 70) | 1  # a 71st worker holds it too
    assert matcher(PLAIN_ROOT, [1, 2, 3, 4]) is None  # the general path's to answer
    table[key] = 1  # that worker let go of it
    assert matcher(PLAIN_ROOT, [1, 2, 3, 4]) == {"w": 1}
    other = hash((PLAIN_ROOT, (5, 6, 7, 8)))
    table[other] = 1 << 65
    del table[other]
    assert matcher(PLAIN_ROOT, [1, 2, 3, 4]) == {"w": 1}


def test_each_copy_of_the_module_keeps_its_own_types_and_state() -> None:
    """Multi-phase init with module state: a second copy of the module (another interpreter's,
    or one imported again) makes types of its own, and each copy's functions check against
    its own types; nothing is shared through a global."""
    import importlib.util

    spec = importlib.util.find_spec("tskv.core._compiled")
    assert spec is not None and spec.loader is not None
    again = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(again)
    assert again.KeyTable is not _compiled.KeyTable and again.Matcher is not _compiled.Matcher
    theirs, ours = again.KeyTable(), _compiled.KeyTable()
    ours.update({hash((5, (1, 2))): 1})
    theirs.update({hash((5, (1, 2))): 1})
    assert again.walk(theirs, None, 5, [1, 2], 2, None) == _compiled.walk(
        ours, None, 5, [1, 2], 2, None
    )
    with pytest.raises(TypeError, match="real must be a dict or a KeyTable"):
        again.walk(ours, None, 5, [1, 2], 2, None)  # another module's table: not its type
    with pytest.raises(TypeError):
        again.Matcher(ours, 2)
    matcher = again.Matcher(theirs, 2)
    matcher.set_answer(("w",), Match({}, frozenset(), None, None, 2, ("w",)))
    assert matcher(5, [1, 2]) == {"w": 1}
    assert again.read_plain(b"\x93\xcb" + bytes(8) + b"\x90\xc0", 4) == (0.0, None, [])


@pytest.mark.parametrize("table", [False, True], ids=["dict", "KeyTable"])
def test_a_walk_that_declines_midway_leaves_the_keys_the_pure_walk_leaves(
    table: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The compiled walk reports each key as it walks; one that declines at a later block (a
    token id it may not hash) must not leave those keys for the pure walk to report again."""
    from tskv.core.prefix_index import _leading_counts

    class Id(int):
        pass

    first = hash((PLAIN_ROOT, (1, 2, 3, 4)))
    holders: Any = {first: 1}
    if table:
        holders = _compiled.KeyTable()
        holders.update({first: 1})
    bits = Bits()
    bits.take("w")
    tokens: list[Any] = [1, 2, 3, 4, 5, Id(6), 7, 8]

    def walked() -> tuple[dict[Any, int], list[int]]:
        keys: list[int] = []
        counts = _leading_counts((holders, None), tokens, None, None, None, None, 4, bits, 0, keys)
        return counts, keys

    compiled_walk = walked()
    monkeypatch.setattr(compiled, "core", None)
    assert compiled_walk == walked() and len(compiled_walk[1]) == 2
