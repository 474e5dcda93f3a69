"""The publisher's replay decisions, without sockets: every rule with exact numbers, and a
property test over arbitrary interleavings of requests, sends, full pipes and evictions."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tskv import (
    AllBlocksCleared,
    BlockStored,
    KVEventBatch,
    KVEventsConfig,
    decode_batch,
    encode_batch,
)
from tskv.core.frames import (
    DESCRIBE_MARK,
    END_FRAME,
    DescriptorReply,
    ReplayReply,
    RequestForm,
    SnapshotPart,
    describe_request,
    parse_replay_reply,
    parse_replay_request,
    replay_request,
    snapshot_request,
    tskv_replay_request,
)
from tskv.core.replay_buffer import ReplayBuffer
from tskv.core.replay_limits import Peer
from tskv.core.replay_server import (
    MAX_ONE_OFFS,
    RETRY_AFTER,
    SLICE,
    Outcome,
    Outgoing,
    ReplayServer,
)
from tskv.core.snapshot import CacheState, SnapshotBuilder


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def server(
    batches: int = 0, capacity: int = 100, topic: bytes | None = None, **config: object
) -> tuple[ReplayServer, ReplayBuffer, Clock]:
    buffer = ReplayBuffer(capacity)
    for n in range(batches):
        buffer.append(f"p{n}".encode())
    clock = Clock()
    return ReplayServer(buffer, KVEventsConfig(**config), topic, clock), buffer, clock  # type: ignore[arg-type]


def ask(
    replay: ReplayServer, client: bytes, start: int, host: str | None = None, tskv: bool = False
) -> Outcome:
    """A request from a client of vLLM's protocol, or (`tskv`) in tskv's form."""
    request = tskv_replay_request(start) if tskv else replay_request(start)
    return replay.receive([client, *request], Peer(client, host=host)).outcome


def drain(replay: ReplayServer, limit: int = 100_000) -> list[Outgoing]:
    """Send everything the server has, every send succeeding."""
    sent = []
    for _ in range(limit):
        out = replay.next_send()
        if out is None:
            break
        replay.sent(out)
        sent.append(out)
    return sent


def seqs(sent: list[Outgoing], client: bytes) -> list[int | None]:
    return [out.seq for out in sent if out.client == client]


def test_a_request_gets_every_batch_from_its_start_then_the_end_marker() -> None:
    replay, _, _ = server(batches=10)
    assert ask(replay, b"a", 4) is Outcome.SERVED
    sent = drain(replay)
    assert seqs(sent, b"a") == [4, 5, 6, 7, 8, 9, None]
    assert sent[0].frames == [b"a", b"", (4).to_bytes(8, "big"), b"p4"]
    assert sent[-1].frames == [b"a", b"", END_FRAME, b""]
    stats = replay.statistics()
    assert (stats.requests, stats.completed, stats.batches) == (1, 1, 6)
    assert replay.wait_time() is None  # nothing left to do


def test_vllm_layout_carries_the_topic_frame() -> None:
    replay, _, _ = server(batches=1, topic=b"kv")
    ask(replay, b"a", 0)
    first, end = drain(replay)
    assert first.frames == [b"a", b"", b"kv", (0).to_bytes(8, "big"), b"p0"]
    assert end.frames == [b"a", b"", b"", END_FRAME, b""]


EPOCH = 0x0123_4567_89AB_CDEF


def epoch_server(**kwargs: object) -> ReplayServer:
    replay, _, _ = server(**kwargs)  # type: ignore[arg-type]
    replay.epoch = EPOCH
    return replay


@pytest.mark.parametrize("topic", [None, b"kv"])
@pytest.mark.parametrize(
    "start", [b"\x00\x00\x00\x02", (2).to_bytes(8, "big"), b"\x01" * 4 + (2).to_bytes(8, "big")]
)
def test_a_client_of_vllms_protocol_gets_what_vllms_publisher_sends_byte_for_byte(
    topic: bytes | None, start: bytes
) -> None:
    """vLLM's publisher (its wheel's `_service_replay`) answers `[client, "", start]` with
    `(client, "", topic, seq, payload)` per batch and `(client, "", "", END, "")`; TokenSpeed's
    without the topic frames. Its clients stop on the empty payload, so nothing of tskv's own
    (the epoch) may stand there, whatever length of start frame they send."""
    replay = epoch_server(batches=4, topic=topic)
    assert replay.receive([b"a", b"", start], Peer(b"a")).outcome is Outcome.SERVED
    got = [out.frames for out in drain(replay)]
    head = [b"a", b""] if topic is None else [b"a", b"", topic]
    tail = [b"a", b""] if topic is None else [b"a", b"", b""]
    assert got == [
        [*head, (2).to_bytes(8, "big"), b"p2"],
        [*head, (3).to_bytes(8, "big"), b"p3"],
        [*tail, END_FRAME, b""],
    ]


def test_a_tskv_client_is_told_the_epoch_at_the_end_of_the_same_replay() -> None:
    replay = epoch_server(batches=4)
    assert ask(replay, b"a", 2, tskv=True) is Outcome.SERVED
    *batches, end = drain(replay)
    assert [out.frames[2:] for out in batches] == [
        [(2).to_bytes(8, "big"), b"p2"],
        [(3).to_bytes(8, "big"), b"p3"],
    ]
    reply = parse_replay_reply(end.frames[1:])
    assert isinstance(reply, ReplayReply) and reply.is_end and reply.epoch == EPOCH


def test_a_tskv_request_reads_as_the_same_seq_to_every_other_publisher() -> None:
    """vLLM's, TokenSpeed's and SGLang's publishers read the start frame with
    `int.from_bytes(frame, "big")`: the tskv form's leading zeros leave the seq as it is."""
    for start in (0, 1, 2**40 + 3, 2**64 - 2):
        frame = tskv_replay_request(start)[1]
        assert len(frame) == 16 and int.from_bytes(frame, "big") == start
        request = parse_replay_request([b"a", *tskv_replay_request(start)])
        assert (request.form, request.start_seq) == (RequestForm.TSKV, start)
    assert parse_replay_request([b"a", *replay_request(5)]).form is RequestForm.PLAIN


def test_a_refusal_is_an_empty_end_to_vllms_clients_and_a_reason_to_tskvs() -> None:
    replay = epoch_server(batches=4, replay_max_concurrent=1)
    ask(replay, b"a", 0)  # under way: no room for another
    assert ask(replay, b"plain", 0) is Outcome.REFUSED
    assert ask(replay, b"tskv", 0, tskv=True) is Outcome.REFUSED
    plain, tskv, *_ = drain(replay)
    assert plain.frames == [b"plain", b"", END_FRAME, b""]
    reply = parse_replay_reply(tskv.frames[1:])
    assert isinstance(reply, ReplayReply) and reply.refusal and "in progress" in reply.refusal
    assert reply.epoch is None


def test_a_describe_request_gets_one_reply_and_leaves_the_clients_replay_running() -> None:
    buffer = ReplayBuffer(10)
    for n in range(3):
        buffer.append(b"p%d" % n)
    described = ReplayServer(
        buffer, KVEventsConfig(), None, Clock(), epoch=EPOCH, describe=lambda: b"who"
    )
    ask(described, b"a", 0)
    assert described.receive([b"d", *describe_request()], Peer(b"d")).outcome is Outcome.SERVED
    sent = drain(described)
    assert sent[0].frames == [b"d", b"", DESCRIBE_MARK, b"who"]  # a one-off goes first
    assert isinstance(parse_replay_reply(sent[0].frames[1:]), DescriptorReply)
    assert seqs(sent, b"a") == [0, 1, 2, None]
    stats = described.statistics()
    assert (stats.requests, stats.completed, stats.descriptors) == (2, 2, 1)
    # a publisher without descriptors (any but tskv's) ends the request at once
    replay = epoch_server(batches=3)
    replay.receive([b"d", *describe_request()], Peer(b"d"))
    assert [out.frames for out in drain(replay)] == [[b"d", b"", END_FRAME, b""]]
    assert int.from_bytes(describe_request()[1], "big") > 2**64  # past every seq, to theirs


def test_older_than_the_buffer_starts_at_the_oldest_and_beyond_gets_the_end_alone() -> None:
    replay, _, _ = server(batches=30, capacity=10)
    ask(replay, b"a", 0)
    ask(replay, b"b", 30)
    sent = drain(replay)
    assert seqs(sent, b"a") == [*range(20, 30), None]
    assert seqs(sent, b"b") == [None]


def test_a_replay_ends_at_the_newest_batch_when_asked_and_at_the_per_request_cap() -> None:
    replay, buffer, _ = server(batches=10, replay_max_batches=3)
    ask(replay, b"a", 2)
    buffer.append(b"later")  # published after the request: not part of it
    assert seqs(drain(replay), b"a") == [2, 3, 4, None]
    uncapped, buffer, _ = server(batches=10)
    ask(uncapped, b"a", 8)
    buffer.append(b"later")
    assert seqs(drain(uncapped), b"a") == [8, 9, None]


def test_clients_take_turns_a_slice_at_a_time() -> None:
    replay, _, _ = server(batches=3 * SLICE, capacity=3 * SLICE)
    ask(replay, b"a", 0)
    ask(replay, b"b", 0)
    order = [out.client for out in drain(replay)]
    assert order[:SLICE] == [b"a"] * SLICE
    assert order[SLICE : 2 * SLICE] == [b"b"] * SLICE
    assert order[2 * SLICE : 3 * SLICE] == [b"a"] * SLICE


def test_asking_again_replaces_the_running_replay() -> None:
    replay, _, _ = server(batches=100)
    ask(replay, b"a", 0)
    first = replay.next_send()
    assert first is not None
    replay.sent(first)
    ask(replay, b"a", 98)
    assert seqs(drain(replay), b"a") == [98, 99, None]
    assert replay.statistics().completed == 1


def test_evicted_while_replaying_is_skipped_so_the_client_sees_the_hole() -> None:
    replay, buffer, _ = server(batches=10, capacity=10)
    ask(replay, b"a", 0)
    out = replay.next_send()
    assert out is not None and out.seq == 0
    replay.sent(out)
    for n in range(5):  # seqs 10..14 evict 0..4
        buffer.append(f"x{n}".encode())
    assert seqs(drain(replay), b"a") == [5, 6, 7, 8, 9, None]


def test_a_full_pipe_is_retried_later_and_a_client_that_takes_nothing_is_abandoned() -> None:
    replay, _, clock = server(batches=5, replay_client_timeout=2.0)
    ask(replay, b"a", 0)
    out = replay.next_send()
    assert out is not None and replay.blocked(out) is None
    assert replay.next_send() is None  # waiting for the pipe
    assert replay.wait_time() == RETRY_AFTER
    clock.now += RETRY_AFTER
    again = replay.next_send()
    assert again is not None and again.seq == 0
    clock.now += 2.5  # nothing taken for longer than the client timeout
    abandoned = replay.blocked(again)
    assert abandoned is not None and abandoned.next_seq == 0 and "2 s" in abandoned.why
    assert replay.statistics().abandoned == 1 and replay.active == 0


def test_a_client_that_left_is_abandoned_at_once() -> None:
    replay, _, _ = server(batches=5)
    ask(replay, b"a", 0)
    out = replay.next_send()
    assert out is not None
    abandoned = replay.gone(out)
    assert abandoned is not None and "left" in abandoned.why
    assert replay.next_send() is None and replay.statistics().abandoned == 1


def test_invalid_requests_are_counted_and_answered_with_nothing() -> None:
    replay, _, _ = server(batches=5)
    received = replay.receive([b"a", b"no delimiter"], Peer(b"a"))
    assert received.outcome is Outcome.INVALID and "replay request must be" in received.detail
    assert replay.next_send() is None
    assert (replay.statistics().invalid, replay.statistics().requests) == (1, 0)


def test_the_rate_limit_refuses_with_a_reason_the_client_can_read() -> None:
    replay, _, clock = server(batches=5, replay_rate=2.0, replay_burst=3)
    outcomes = [ask(replay, b"a", 0, tskv=True) for _ in range(10)]
    assert outcomes == [Outcome.SERVED] * 3 + [Outcome.REFUSED] * 7
    refusal = replay.next_send()
    assert refusal is not None and refusal.seq is None
    reply = parse_replay_reply(refusal.frames[1:])
    assert reply.is_end and reply.refusal is not None and "2 requests/s" in reply.refusal
    clock.now += 1.0  # two tokens back
    assert [ask(replay, b"a", 0) for _ in range(3)] == [Outcome.SERVED] * 2 + [Outcome.REFUSED]
    assert (replay.statistics().requests, replay.statistics().refused) == (13, 8)


def test_concurrency_is_capped_and_refusal_markers_are_bounded() -> None:
    replay, _, _ = server(batches=5, replay_max_concurrent=2, replay_burst=10**6)
    clients = [f"c{n}".encode() for n in range(2 + 2 * MAX_ONE_OFFS)]
    outcomes = [ask(replay, client, 0, tskv=True) for client in clients]
    assert outcomes.count(Outcome.SERVED) == 2
    assert replay.statistics().refused == 2 * MAX_ONE_OFFS
    markers = [out for out in drain(replay) if out.seq is None and out.frames[-1]]
    assert len(markers) == MAX_ONE_OFFS  # a flood cannot queue unbounded refusals


def test_a_refusal_nobody_reads_is_dropped_not_waited_for() -> None:
    replay, _, _ = server(batches=5, replay_rate=1.0, replay_burst=1)
    ask(replay, b"a", 0)
    ask(replay, b"a", 0)  # refused, and its own earlier replay ends with it
    marker = replay.next_send()
    assert marker is not None and marker.seq is None
    assert replay.blocked(marker) is None
    assert replay.next_send() is None and replay.active == 0


@settings(max_examples=300, deadline=None)
@given(
    steps=st.lists(
        st.one_of(
            st.tuples(st.just("ask"), st.integers(0, 3), st.integers(0, 40)),
            st.tuples(st.just("send"), st.sampled_from(["ok", "ok", "ok", "full", "gone"])),
            st.tuples(st.just("append"), st.integers(1, 5)),
            st.tuples(st.just("tick"), st.floats(0, 3)),
        ),
        max_size=200,
    ),
    capacity=st.integers(1, 30),
    max_batches=st.none() | st.integers(1, 10),
)
def test_every_client_sees_increasing_buffered_seqs_and_every_job_ends_once(
    steps: list[tuple[object, ...]], capacity: int, max_batches: int | None
) -> None:
    replay, buffer, clock = server(
        batches=5,
        capacity=capacity,
        replay_max_batches=max_batches,
        replay_max_concurrent=2,
        replay_rate=5.0,
        replay_burst=4,
        replay_client_timeout=1.0,
    )
    received: dict[bytes, list[int]] = {}  # replies since the client's last request
    asked: dict[bytes, int] = {}
    live: set[bytes] = set()  # clients whose replay has neither ended nor been given up
    ended = replaced = cut_short = 0
    for step in steps:
        if step[0] == "ask":
            client = f"c{step[1]}".encode()
            had_job = client in live
            # tskv's form: a refusal's end says so, where a plain client's is only empty
            if ask(replay, client, int(step[2]), tskv=True) is Outcome.SERVED:
                received[client], asked[client] = [], int(step[2])
                replaced += had_job
                live.add(client)
            elif had_job:  # a refused request ends the client's running replay too
                cut_short += 1
                live.discard(client)
        elif step[0] == "append":
            for _ in range(int(step[1])):
                buffer.append(b"p")
        elif step[0] == "tick":
            clock.now += float(step[1])  # type: ignore[arg-type]
        else:
            out = replay.next_send()
            if out is None:
                continue
            if step[1] == "full":
                if replay.blocked(out) is not None:
                    live.discard(out.client)
            elif step[1] == "gone":
                if replay.gone(out) is not None:
                    live.discard(out.client)
            else:
                replay.sent(out)
                if out.seq is not None:
                    got = received[out.client]
                    assert not got or out.seq > got[-1]  # strictly increasing
                    assert out.seq >= asked[out.client]
                    assert buffer.get(out.seq) is not None  # only what the buffer holds
                    got.append(out.seq)
                    if max_batches is not None:
                        assert len(got) <= max_batches
                elif out.frames[-1] == b"":
                    ended += 1
                    live.discard(out.client)
        assert replay.active == len(live) <= 2
    stats = replay.statistics()
    assert stats.completed == ended
    assert stats.superseded == replaced + cut_short
    # Every request ends exactly one way, or is still going.
    ends = stats.refused + stats.completed + stats.abandoned + stats.superseded
    assert ends + stats.running == stats.requests


# -- snapshots --------------------------------------------------------------------------------


def snapshot_server(
    blocks: int, part_blocks: int = 4, **config: object
) -> tuple[ReplayServer, ReplayBuffer, CacheState]:
    buffer = ReplayBuffer(100)
    state = CacheState()
    clock = Clock()
    for n in range(blocks):  # one batch per block, each a child of the one before
        events = [BlockStored([n], n - 1 if n else None, [n, n], 2)]
        buffer.append(f"p{n}".encode())
        state.apply(encode_batch(KVEventBatch(1.0, events)), events)

    def make() -> SnapshotBuilder:
        return SnapshotBuilder(state.freeze(buffer.next_seq), 1.0, 0, "tokenspeed", part_blocks)

    cfg = KVEventsConfig(**config)  # type: ignore[arg-type]
    return ReplayServer(buffer, cfg, None, clock, make), buffer, state


def ask_snapshot(replay: ReplayServer, client: bytes) -> Outcome:
    return replay.receive([client, *snapshot_request()], Peer(client)).outcome


def test_a_snapshot_request_gets_its_parts_then_the_end_marker() -> None:
    replay, _, state = snapshot_server(blocks=10, part_blocks=4)
    assert ask_snapshot(replay, b"a") is Outcome.SERVED
    state.apply(b"", [AllBlocksCleared()])  # after the request: not in this snapshot
    sent = drain(replay)
    assert seqs(sent, b"a") == [0, 1, 2, None]  # parts 0..2 by index, then the end
    parts = [parse_replay_reply(out.frames[1:]) for out in sent[:-1]]
    assert all(isinstance(part, SnapshotPart) and part.next_seq == 10 for part in parts)
    events = [e for part in parts for e in decode_batch(part.payload).events]  # type: ignore[union-attr]
    assert events[0] == AllBlocksCleared()
    assert [h for e in events[1:] for h in e.block_hashes] == list(range(10))  # type: ignore[union-attr]
    assert sent[-1].frames == [b"a", b"", END_FRAME, b""]
    stats = replay.statistics()
    assert (stats.requests, stats.snapshots, stats.completed, stats.snapshots_completed) == (
        1,
        1,
        1,
        1,
    )
    assert (stats.snapshot_parts, stats.batches) == (3, 0)


def test_a_snapshot_part_that_could_not_go_out_is_sent_again_not_rebuilt() -> None:
    replay, _, _ = snapshot_server(blocks=10, part_blocks=4)
    ask_snapshot(replay, b"a")
    first = replay.next_send()
    assert first is not None and replay.blocked(first) is None
    replay._clock.now += RETRY_AFTER  # type: ignore[attr-defined]
    assert replay.next_send() is first  # the same part, not the next one
    replay.sent(first)
    assert seqs(drain(replay), b"a") == [1, 2, None]


def test_without_snapshots_a_snapshot_request_ends_at_once_as_a_replay_past_the_end() -> None:
    replay, _, _ = server(batches=10)  # no snapshot maker: a publisher with snapshots off
    assert ask_snapshot(replay, b"a") is Outcome.SERVED
    assert [out.frames for out in drain(replay)] == [[b"a", b"", END_FRAME, b""]]
    # ...which is what a publisher that knows nothing of them does: read the request's last 8
    # bytes (all ones) or all of it as a start seq past every batch.
    assert parse_replay_request([b"a", b"", snapshot_request()[1][-8:]]).start_seq == 2**64 - 1
    assert int.from_bytes(snapshot_request()[1], "big") > 2**64


def test_snapshot_requests_count_against_the_replay_limits() -> None:
    replay, _, _ = snapshot_server(blocks=3, replay_burst=2, replay_rate=0.001)
    outcomes = [ask_snapshot(replay, b"a") for _ in range(3)]
    assert outcomes == [Outcome.SERVED, Outcome.SERVED, Outcome.REFUSED]
    refusal = drain(replay)[0]
    assert parse_replay_reply(refusal.frames[1:]).refusal  # type: ignore[union-attr]
