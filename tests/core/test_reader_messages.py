"""What a watcher's index process and its reader processes say to each other, without a pipe:
every message survives its frame, in chunks of any size, and anything else is refused."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tskv.core.applied import BOUNDS, AppliedFigures
from tskv.core.errors import TskvError
from tskv.core.losses import Loss, LossReason
from tskv.core.reader_messages import (
    AskHashes,
    Follow,
    FrameReader,
    Hashes,
    LogLine,
    News,
    ReaderMessageError,
    Report,
    Unfollow,
    commands,
    frame,
    news,
)
from tskv.core.worker_view import WorkerFigures

seqs = st.integers(0, 2**64 - 1)
names = st.text(max_size=12)
figures = st.builds(
    WorkerFigures,
    st.integers(0, 10**6),
    st.integers(0, 10**6),
    st.integers(0, 10**6),
    st.none() | names,
    st.none() | st.integers(-1, 2**64 - 1),
    st.booleans(),
    st.booleans(),
)
losses = st.builds(
    Loss, seqs, st.none() | seqs, st.sampled_from(list(LossReason)), st.none() | seqs
)
keys = st.lists(st.lists(st.integers(-(2**63), 2**63 - 1), max_size=5), max_size=4)
tier_ops = st.lists(
    st.tuples(st.none() | names, st.none() | st.integers(0, 3), st.sampled_from([1, -1]), keys)
    | st.just(("clear",)),
    max_size=3,
)
reports = st.builds(
    Report,
    st.integers(0, 10**6),
    figures,
    keys,
    st.booleans(),
    st.lists(losses, max_size=3),
    st.none() | st.tuples(names, st.floats(0, 100)),
    tier_ops,
    st.integers(0, 64),
    st.dictionaries(st.none() | names, st.integers(0, 10**6), max_size=3),
)
items = st.one_of(
    reports,
    st.builds(LogLine, names, st.integers(0, 50), names),
    st.builds(Hashes, st.integers(0, 10**6), st.lists(st.integers(0, 2**64 - 1), max_size=5)),
)
counts = st.integers(0, 10**6)
applied = st.builds(
    AppliedFigures,
    st.tuples(*[counts] * len(BOUNDS)),
    counts,
    st.floats(0, 1e6),
    st.dictionaries(names, counts, max_size=3),
)
all_news = st.builds(
    News,
    st.floats(0, 1e6),
    st.lists(items, max_size=5),
    st.integers(0, 99),
    st.integers(0, 99),
    applied,
)
settings = st.dictionaries(
    names, st.none() | st.integers(0, 2**63) | names | st.booleans(), max_size=3
)
all_commands = st.one_of(
    st.builds(Follow, st.integers(0, 10**6), names, st.none() | names, settings),
    st.builds(Unfollow, st.integers(0, 10**6)),
    st.builds(AskHashes, st.integers(0, 10**6), st.integers(0, 10**6)),
)


@given(st.lists(all_commands | all_news, max_size=6), st.integers(1, 64))
def test_every_message_comes_out_as_it_went_in_whatever_the_chunks(
    messages: list[object], chunk: int
) -> None:
    wire = b"".join(frame(message) for message in messages)  # type: ignore[arg-type]
    reader = FrameReader()
    out: list[object] = []
    for start in range(0, len(wire), chunk):
        out.extend(reader.feed(wire[start : start + chunk]))
    assert out == messages


def test_each_end_reads_only_what_the_other_sends() -> None:
    reader = FrameReader()
    both = reader.feed(frame(Unfollow(1)) + frame(News(1.0, [])))
    with pytest.raises(ReaderMessageError, match="news"):
        news(both)
    with pytest.raises(ReaderMessageError, match="a command"):
        commands(both)
    assert commands(both[:1]) == [Unfollow(1)] and news(both[1:]) == [News(1.0, [])]


def report_with(**fields: object) -> list[object]:
    """A report as the pipe carries it, with some fields changed."""
    plain: dict[str, object] = {
        "slot": 1,
        "figures": [0, 0, 0, None, None, False, False],
        "changes": [],
        "strings": False,
        "losses": [],
        "failure": None,
        "ops": [],
        "lookahead": 0,
        "blocks": [],
    }
    return ["report", *{**plain, **fields}.values()]


APPLIED = [[0] * len(BOUNDS), 0, 0.0, []]


def news_of(*items: object, applied: object = APPLIED) -> list[object]:
    """A frame's news as the pipe carries it."""
    return ["news", 1.0, list(items), 0, 0, applied]


def raw_frame(value: object) -> bytes:
    packed = msgpack.packb(value)
    return len(packed).to_bytes(4, "little") + packed


@pytest.mark.parametrize(
    ("value", "says"),
    [
        (["report", 1], "a known message of its length"),
        (["unknown", 1, 2], "a known message"),
        ("not an array", "a tagged array"),
        (["unfollow", "one"], "unfollow's slot"),
        (news_of(report_with(figures=[0] * 6)), "figures of 7"),
        (news_of(report_with(figures=[0, 0, 0, None, None, 1, 0])), "silent and"),
        (
            news_of(report_with(figures=[True, 0, 0, None, None, False, False])),
            "counts",
        ),
        (
            news_of(report_with(figures=[0, -1, 0, None, None, False, False])),
            "counts",
        ),
        (
            news_of(report_with(figures=[0, 0, 0, 5, None, False, False])),
            "last_error",
        ),
        (
            news_of(report_with(figures=[0, 0, 0, None, 1.5, False, False])),
            "last_seq",
        ),
        (news_of(report_with(slot=True)), "report's slot"),
        (news_of(report_with(lookahead=-1)), "lookahead"),
        (news_of(report_with(losses={})), "losses"),
        (news_of(report_with(changes=[[1], 2])), "changes as runs of 8-byte keys"),
        (news_of(report_with(changes=[bytes(7)])), "changes as runs of 8-byte keys"),
        (news_of(report_with(ops=[1])), "ops"),
        (news_of(report_with(losses=[[0, 0, "gone", None]])), "no loss reason"),
        (news_of(["unfollow", 1]), "news items"),
        (news_of(report_with(blocks=[["GPU", -1]])), "report's blocks by medium"),
        (news_of(report_with(blocks=[[7, 1]])), "report's blocks by medium"),
        (news_of(applied=[[0] * 3, 0, 0.0, []]), "applied figures"),
        (news_of(applied=[[0] * len(BOUNDS), 0, 0.0, [["BlockStored", "1"]]]), "applied figures"),
    ],
)
def test_a_message_that_is_not_one_of_these_is_refused_naming_what(
    value: object, says: str
) -> None:
    with pytest.raises(ReaderMessageError, match=says) as raised:
        FrameReader().feed(raw_frame(value))
    assert isinstance(raised.value, TskvError) and isinstance(raised.value, ValueError)


def test_bytes_that_are_not_msgpack_are_refused() -> None:
    with pytest.raises(ReaderMessageError, match="not msgpack"):
        FrameReader().feed(b"\x01\x00\x00\x00\xc1")
    assert FrameReader().feed(b"\x05\x00\x00") == []  # not yet a whole frame
