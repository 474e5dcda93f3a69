"""The subscriber's gap logic, without sockets: every seq is delivered once or reported lost."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tskv.core.actions import (
    Deliver,
    DeliverSnapshot,
    RequestReplay,
    RequestSnapshot,
    Silence,
    SnapshotTooLarge,
    Synced,
)
from tskv.core.losses import Loss, LossCounts, LossReason
from tskv.core.sequencer import Sequencer


def p(seq: int) -> bytes:
    return f"payload-{seq}".encode()


def delivered(actions: list) -> list[int]:  # type: ignore[type-arg]
    return [a.seq for a in actions if isinstance(a, Deliver)]


def test_in_order_stream_is_delivered_as_is() -> None:
    s = Sequencer(has_replay=True)
    actions = [a for seq in range(5, 10) for a in s.live(seq, p(seq))]
    assert delivered(actions) == [5, 6, 7, 8, 9]
    assert all(isinstance(a, Deliver) and not a.repaired for a in actions)


def test_gap_is_repaired_from_replay_before_later_live_batches() -> None:
    s = Sequencer(has_replay=True)
    s.live(0, p(0))
    [request] = s.live(3, p(3))
    assert request == RequestReplay(0, 1)  # from the last delivered batch, to compare it
    assert s.live(4, p(4)) == []  # held while the repair runs
    assert s.replayed(1, 0, p(0)) == []  # the same batch as delivered: the same stream
    actions = s.replayed(1, 1, p(1)) + s.replayed(1, 2, p(2))
    assert delivered(actions) == [1, 2, 3, 4]
    assert [a.repaired for a in actions if isinstance(a, Deliver)] == [True, True, False, False]
    assert s.replayed(1, 3, p(3)) == []  # already delivered live: no duplicate
    assert s.replay_ended(1) == []
    assert delivered(s.live(5, p(5))) == [5]


def test_evicted_batches_are_reported_then_delivery_continues() -> None:
    s = Sequencer(has_replay=True, snapshots=False)
    s.live(0, p(0))
    s.live(10, p(10))
    actions = s.replayed(1, 7, p(7)) + s.replayed(1, 8, p(8)) + s.replayed(1, 9, p(9))
    assert actions[0] == Loss(1, 6, LossReason.EVICTED)
    assert delivered(actions) == [7, 8, 9, 10]


def test_replay_with_nothing_for_the_hole_reports_it_at_the_end() -> None:
    s = Sequencer(has_replay=True, snapshots=False)
    s.live(0, p(0))
    s.live(5, p(5))
    actions = s.replay_ended(1)
    assert actions == [Loss(1, 4, LossReason.EVICTED), Deliver(5, p(5), False)]


def test_without_replay_a_gap_is_reported_at_once() -> None:
    s = Sequencer(has_replay=False)
    s.live(0, p(0))
    actions = s.live(4, p(4))
    assert actions == [Loss(1, 3, LossReason.NO_REPLAY), Deliver(4, p(4), False)]


def test_replay_timeout_reports_the_hole_and_releases_held_batches() -> None:
    s = Sequencer(has_replay=True)
    s.live(0, p(0))
    s.live(2, p(2))
    s.live(3, p(3))
    actions = s.replay_failed(1)
    assert actions == [
        Loss(1, 1, LossReason.REPLAY_TIMEOUT),
        Deliver(2, p(2), False),
        Deliver(3, p(3), False),
    ]
    assert s.replayed(1, 1, p(1)) == []  # a late reply to the abandoned request is ignored


def test_a_lower_seq_is_a_restart() -> None:
    s = Sequencer(has_replay=True)
    for seq in range(3):
        s.live(seq, p(seq))
    actions = s.live(0, b"new")
    assert actions == [
        Loss(3, None, LossReason.RESTART, new_seq=0),
        Deliver(0, b"new", False),
        RequestReplay(0, 2, probe=True),  # replay must hold the same seq 0 (a crash loop?)
    ]
    assert delivered(s.live(1, p(1))) == [1]


def test_restart_during_a_repair_flushes_the_old_sequence_first() -> None:
    s = Sequencer(has_replay=True)
    s.live(0, p(0))
    s.live(5, p(5))  # repair of 1..4 begins
    actions = s.live(0, b"new")
    assert actions == [
        Loss(1, 4, LossReason.INTERRUPTED),
        Deliver(5, p(5), False),
        Loss(6, None, LossReason.RESTART, new_seq=0),
        Deliver(0, b"new", False),
        RequestReplay(0, 3, probe=True),
    ]
    assert s.replayed(1, 1, p(1)) == []


def test_start_seq_bootstraps_from_replay_then_joins_live() -> None:
    s = Sequencer(has_replay=True, start_seq=0)
    assert s.start() == [RequestReplay(0, 1)]
    assert s.live(3, p(3)) == []  # held until the bootstrap is done
    actions = [a for seq in range(3) for a in s.replayed(1, seq, p(seq))]
    assert delivered(actions) == [0, 1, 2, 3]
    assert s.replay_ended(1) == []


def test_live_batches_before_the_requested_start_are_skipped() -> None:
    s = Sequencer(has_replay=True, start_seq=10)
    s.start()
    assert s.replay_ended(1) == []  # the publisher is not at 10 yet
    assert s.live(8, p(8)) == []
    assert s.live(9, p(9)) == []
    assert delivered(s.live(10, p(10))) == [10]


def test_replay_that_ends_before_later_batches_asks_again() -> None:
    s = Sequencer(has_replay=True)
    s.live(0, p(0))
    s.live(2, p(2))
    s.live(5, p(5))
    s.replayed(1, 1, p(1))  # delivers 1, 2
    assert s.replay_ended(1) == [RequestReplay(2, 2)]  # 3, 4 came after the first request


def test_start_seq_needs_replay() -> None:
    with pytest.raises(ValueError, match="start_seq = 4 needs a replay endpoint"):
        Sequencer(has_replay=False, start_seq=4).start()


def test_a_restart_first_heard_past_seq_0_is_fetched_from_its_start() -> None:
    s = Sequencer(has_replay=True)
    for seq in range(100):
        s.live(seq, p(seq))
    # The new publisher sent 0..64 before this subscriber's subscription reached it.
    actions = s.live(65, b"new-65")
    assert actions == [Loss(100, None, LossReason.RESTART, new_seq=0), RequestReplay(0, 2)]
    replies = [s.replayed(2, seq, f"new-{seq}".encode()) for seq in range(66)]
    delivered_seqs = [a.seq for batch in replies for a in batch if isinstance(a, Deliver)]
    assert delivered_seqs == list(range(66))
    assert s.replay_ended(2) == []


def test_a_restart_without_replay_reports_what_the_new_sequence_sent_unheard() -> None:
    s = Sequencer(has_replay=False)
    s.live(7, p(7))
    assert s.live(3, b"new-3") == [
        Loss(8, None, LossReason.RESTART, new_seq=0),
        Loss(0, 2, LossReason.NO_REPLAY),
        Deliver(3, b"new-3", False),
    ]


def test_a_new_sequence_already_past_ours_is_told_apart_by_replay() -> None:
    s = Sequencer(has_replay=True)
    for seq in range(20):
        s.live(seq, p(seq))
    # The publisher died after 19; its successor is at 211 when we next hear from it.
    assert s.live(211, b"new-211") == [RequestReplay(19, 1)]
    # Replay holds the new sequence: its batch 19 is not the one we delivered.
    assert s.replayed(1, 19, b"new-19") == [
        Loss(20, None, LossReason.RESTART, new_seq=0),
        RequestReplay(0, 2),
    ]
    assert s.replayed(1, 20, b"new-20") == []  # the rest of the old request is ignored
    actions = [a for seq in range(211) for a in s.replayed(2, seq, f"new-{seq}".encode())]
    assert [a.seq for a in actions if isinstance(a, Deliver)] == list(range(212))
    assert all(not isinstance(a, Loss) for a in actions)


def test_when_our_last_batch_is_evicted_the_gap_is_reported_not_spliced_silently() -> None:
    s = Sequencer(has_replay=True, snapshots=False)
    for seq in range(20):
        s.live(seq, p(seq))
    s.live(5000, p(5000))
    # Replay starts at 4000: the batch to compare with is gone, so this cannot be told apart
    # from a long gap in one stream; it is reported as lost (docs/consumer.md says so).
    actions = s.replayed(1, 4000, p(4000))
    assert actions[0] == Loss(20, 3999, LossReason.EVICTED)


def test_an_absurd_jump_is_a_discontinuity_not_a_loss_of_2_to_the_63() -> None:
    s = Sequencer(has_replay=True)
    for seq in range(10):
        s.live(seq, p(seq))
    actions = s.live(2**63, b"garbage")
    assert actions == [
        Loss(10, None, LossReason.RESTART, new_seq=2**63),
        Deliver(2**63, b"garbage", False),
    ]
    assert not s.order.pending
    # The real stream goes on: to this subscriber that is a seq going back, a restart.
    assert s.live(10, p(10)) == [
        Loss(2**63 + 1, None, LossReason.RESTART, new_seq=0),
        RequestReplay(0, 3),
    ]


def test_a_full_hold_gives_up_the_oldest_hole_and_keeps_the_newest_batches() -> None:
    s = Sequencer(has_replay=True, max_held=3)
    s.live(0, p(0))
    [ask] = s.live(2, p(2))
    assert s.live(3, p(3)) == [] and s.live(4, p(4)) == []  # held while the repair runs
    actions = s.live(5, p(5))  # one more than the hold keeps: the hole goes, not batch 5
    assert actions == [
        Loss(1, 1, LossReason.OVERRUN),
        *(Deliver(seq, p(seq), False) for seq in (2, 3, 4, 5)),
    ]
    assert s.replayed(ask.request_id, 0, p(0)) == [] and s.replay_ended(ask.request_id) == []
    assert delivered(s.live(6, p(6))) == [6]


def test_a_stalled_repair_never_costs_batches_that_arrived_and_delivery_reaches_the_head() -> None:
    """Seqs 0-4, then 10 (its repair never answered but by the end marker), then 11-1010,
    with room for 100 held: 1010 is delivered last, and only 5-9 are reported lost."""
    s = Sequencer(has_replay=True, max_held=100)
    out = [a for seq in range(5) for a in s.live(seq, p(seq))]
    [ask] = s.live(10, p(10))
    for seq in range(11, 1011):
        out.extend(s.live(seq, p(seq)))
    out.extend(s.replay_ended(ask.request_id))
    losses = [a for a in out if isinstance(a, Loss)]
    assert losses == [Loss(5, 9, LossReason.OVERRUN)]
    assert delivered(out) == [*range(5), *range(10, 1011)]
    assert len(s.order.pending) == 0


def test_a_replay_that_keeps_refusing_is_reported_as_refused() -> None:
    s = Sequencer(has_replay=True)
    s.live(0, p(0))
    s.live(3, p(3))
    assert s.replay_failed(1, LossReason.REFUSED) == [
        Loss(1, 2, LossReason.REFUSED),
        Deliver(3, p(3), False),
    ]


@settings(max_examples=500)
@given(
    total=st.integers(1, 60),
    dropped=st.sets(st.integers(1, 59)),
    buffer=st.integers(1, 60),
    lag=st.integers(0, 6),
    has_replay=st.booleans(),
    max_held=st.integers(1, 70),
)
def test_every_seq_is_delivered_once_or_reported_lost(
    total: int, dropped: set[int], buffer: int, lag: int, has_replay: bool, max_held: int
) -> None:
    """A simulated publisher: live seqs minus `dropped`, a replay buffer of the last `buffer`
    seqs, and replay requests answered only after `lag` more batches went out."""
    s = Sequencer(has_replay=has_replay, snapshots=False, max_held=max_held)
    out: list[Deliver | Loss] = []
    requests: list[tuple[int, RequestReplay]] = []  # (published when it may be served, request)
    let_go: set[int] = set()  # live batches the full hold did not keep
    published = 0

    def run(actions: list) -> None:  # type: ignore[type-arg]
        for action in actions:
            if isinstance(action, RequestReplay):
                requests.append((published + lag, action))
            else:
                out.append(action)

    def serve(due: int) -> None:
        while requests and requests[0][0] <= due:
            _, request = requests.pop(0)
            for seq in range(max(request.start_seq, published - buffer), published):
                run(s.replayed(request.request_id, seq, p(seq)))
            run(s.replay_ended(request.request_id))

    for seq in range(total):
        published = seq + 1
        if seq not in dropped:
            actions = s.live(seq, p(seq))
            run(actions)
            taken = any(isinstance(a, Deliver) and a.seq == seq for a in actions)
            if not taken and seq not in s.order.pending:
                let_go.add(seq)
        serve(published)
    while requests:
        serve(requests[0][0])
    run(s.quiet())  # the stream goes quiet: what it lost at its end is asked for
    while requests:
        serve(requests[0][0])
    assert len(s.order.pending) <= max_held
    seen: list[int] = []
    for item in out:
        if isinstance(item, Deliver):
            assert item.payload == p(item.seq)
            seen.append(item.seq)
        else:
            assert item.last_seq is not None
            lost = range(item.first_seq, item.last_seq + 1)
            seen.extend(lost)
            held = [seq for seq in lost if seq not in dropped and seq not in let_go]
            assert held == [], f"batches that arrived live were reported lost: {held}"
            assert has_replay or item.reason is LossReason.NO_REPLAY
    delivered_only = [item.seq for item in out if isinstance(item, Deliver)]
    assert delivered_only == sorted(set(delivered_only))  # strictly increasing
    last_live = max(seq for seq in range(total) if seq not in dropped)
    assert seen == list(range(len(seen)))  # nothing missing, nothing twice
    # with replay, even a loss at the very end is repaired or reported once the stream is quiet
    assert len(seen) == total if has_replay else len(seen) > last_live


@settings(max_examples=400)
@given(
    old=st.integers(1, 30),
    new=st.integers(1, 60),
    first_heard=st.integers(0, 59),
    dropped=st.sets(st.integers(0, 59)),
)
def test_a_restart_is_detected_and_the_new_sequence_delivered_from_its_start(
    old: int, new: int, first_heard: int, dropped: set[int]
) -> None:
    """The old publisher sends 0..old-1; its successor sends 0..new-1, of which this
    subscriber hears nothing before `first_heard` and loses `dropped` on the way. Replay holds
    the successor's whole sequence. Unless the successor is first heard exactly where the old
    sequence would have gone on (which no subscriber can tell apart), the consumer sees the old
    sequence, one RESTART, then every batch of the new one from 0, each once, none of the old."""
    first_heard = min(first_heard, new - 1)
    if first_heard == old:
        return  # indistinguishable from a continuation: documented in docs/consumer.md
    s = Sequencer(has_replay=True)
    out: list[Deliver | Loss] = []
    pending: list[RequestReplay] = []

    def run(actions: list) -> None:  # type: ignore[type-arg]
        for action in actions:
            (pending if isinstance(action, RequestReplay) else out).append(action)

    for seq in range(old):
        run(s.live(seq, f"old-{seq}".encode()))

    def serve(published: int) -> None:
        while pending:  # replay answers at once from the successor's buffer
            request = pending.pop(0)
            for replayed in range(request.start_seq, published):
                run(s.replayed(request.request_id, replayed, f"new-{replayed}".encode()))
            run(s.replay_ended(request.request_id))

    for seq in range(first_heard, new):
        if seq not in dropped or seq == first_heard:
            run(s.live(seq, f"new-{seq}".encode()))
        serve(seq + 1)
    run(s.quiet())  # what the new sequence lost at its end is asked for once it is quiet
    serve(new)
    restarts = [i for i, item in enumerate(out) if isinstance(item, Loss)]
    assert [out[i].reason for i in restarts] == [LossReason.RESTART]  # type: ignore[union-attr]
    before, after = out[: restarts[0]], out[restarts[0] + 1 :]
    assert all(isinstance(i, Deliver) and i.payload.startswith(b"old-") for i in before)
    assert all(isinstance(i, Deliver) and i.payload.startswith(b"new-") for i in after)
    assert [i.seq for i in after] == list(range(new))  # type: ignore[union-attr]


@pytest.mark.parametrize("reason", list(LossReason))
def test_every_kind_of_loss_is_described_readably_and_counted(reason: LossReason) -> None:
    restart = reason is LossReason.RESTART
    loss = Loss(9, None, reason, new_seq=0) if restart else Loss(3, 5, reason)
    shown = loss.describe()
    counts = LossCounts()
    counts.add(loss)
    counts.add(loss)
    assert counts.losses == 2
    if reason is LossReason.RESTART:
        assert shown == "publisher restarted: expected seq 9, now at seq 0"
        assert (counts.restarts, counts.lost, counts.replaced) == (2, 0, 0)
    elif reason is LossReason.SNAPSHOT:
        assert "3..5 (snapshot)" in shown and "restored" in shown
        assert (counts.restarts, counts.lost, counts.replaced) == (0, 0, 6)
    else:
        assert shown == f"lost seq 3..5 ({reason.value})"
        assert (counts.restarts, counts.lost, counts.replaced) == (0, 6, 0)


# -- snapshots --------------------------------------------------------------------------------


def test_a_snapshot_bootstrap_holds_live_batches_then_goes_on_from_the_snapshot() -> None:
    s = Sequencer(has_replay=True, start_seq="snapshot")
    assert s.start() == [RequestSnapshot(1)]
    assert s.live(5, p(5)) == [] and s.live(7, p(7)) == [] and s.live(8, p(8)) == []
    assert s.snapshot_part(1, 7, 0, b"part0") == [] and s.snapshot_part(1, 7, 1, b"part1") == []
    actions = s.replay_ended(1)
    assert actions[0] == DeliverSnapshot(6, [b"part0", b"part1"], None)  # asked for: no loss
    assert delivered(actions) == [7, 8]  # 5 is inside the snapshot: not delivered again
    assert not s.order.pending and not s.asking.busy


def test_a_snapshot_bootstrap_from_a_publisher_without_them_falls_back_to_replay() -> None:
    s = Sequencer(has_replay=True, start_seq="snapshot")
    s.start()
    s.live(3, p(3))
    assert s.replay_ended(1) == [RequestReplay(0, 2)]  # the end, and no part: no snapshots
    actions = s.replayed(2, 2, p(2))  # the buffer starts at 2
    assert actions == [
        Loss(0, 1, LossReason.EVICTED),
        Deliver(2, p(2), False),  # a bootstrap's: no hole filled
        Deliver(3, p(3), False),
    ]


def repair_until_evicted(s: Sequencer) -> None:
    """Deliver 0, then see 10 live; replay starts at 5: 1..4 are gone."""
    s.live(0, p(0))
    assert s.live(10, p(10)) == [RequestReplay(0, 1)]
    assert s.replayed(1, 0, p(0)) == []
    assert s.replayed(1, 5, p(5)) == [RequestSnapshot(2)]
    assert s.replayed(1, 6, p(6)) == [] and s.replay_ended(1) == []  # the rest: ignored


def test_what_replay_lost_is_restored_from_a_snapshot_and_reported_as_replaced() -> None:
    s = Sequencer(has_replay=True)
    repair_until_evicted(s)
    s.snapshot_part(2, 9, 0, b"snap")
    actions = s.replay_ended(2)
    assert actions == [DeliverSnapshot(8, [b"snap"], 1), RequestReplay(9, 3)]  # 9 is missing
    assert delivered(s.replayed(3, 9, p(9))) == [9, 10]


def test_a_publisher_without_snapshots_leaves_the_hole_reported_and_is_not_asked_again() -> None:
    s = Sequencer(has_replay=True)
    repair_until_evicted(s)
    actions = s.replay_ended(2)  # no part: this publisher serves no snapshots
    assert actions == [Loss(1, 4, LossReason.EVICTED), RequestReplay(5, 3)]
    assert delivered(s.replayed(3, 5, p(5))) == [5]
    assert s.snapshots is False


def test_a_replay_that_ends_without_progress_asks_for_a_snapshot() -> None:
    s = Sequencer(has_replay=True)
    s.live(0, p(0))
    s.live(10, p(10))
    assert s.replay_ended(1) == [RequestSnapshot(2)]  # nothing at all came back


@pytest.mark.parametrize("reason", [LossReason.REPLAY_TIMEOUT, LossReason.REFUSED])
def test_a_snapshot_that_fails_leaves_the_hole_reported_with_the_reason(reason: LossReason) -> None:
    s = Sequencer(has_replay=True)
    repair_until_evicted(s)
    s.snapshot_part(2, 9, 0, b"half")  # a part arrived, then the endpoint went silent
    assert s.replay_failed(2, reason) == [Loss(1, 4, reason), RequestReplay(5, 3)]


def test_a_snapshot_older_than_our_position_is_a_new_sequence() -> None:
    s = Sequencer(has_replay=True)
    for seq in range(20):
        s.live(seq, p(seq))
    s.live(30, p(30))
    s.replayed(1, 19, p(19))
    assert s.replayed(1, 25, p(25)) == [RequestSnapshot(2)]
    s.snapshot_part(2, 4, 0, b"new")  # a restarted publisher's state after its seq 3
    actions = s.replay_ended(2)
    assert actions[:2] == [
        Loss(20, None, LossReason.RESTART, new_seq=4),
        DeliverSnapshot(3, [b"new"], None),
    ]


def test_a_snapshot_with_a_part_missing_is_not_delivered_and_the_hole_is_reported() -> None:
    s = Sequencer(has_replay=True)
    repair_until_evicted(s)
    s.snapshot_part(2, 9, 0, b"part0")
    s.snapshot_part(2, 9, 2, b"part2")  # part 1 never came
    assert s.replay_ended(2) == [Loss(1, 4, LossReason.UNDECODABLE), RequestReplay(5, 3)]


def test_a_snapshot_over_the_limit_is_given_up_at_the_part_that_passes_it() -> None:
    """Kept, the parts of a publisher that never ends its snapshot would grow without bound:
    the part that passes the limit ends it, the hole is reported, and the rest is ignored."""
    s = Sequencer(has_replay=True, max_snapshot_bytes=10)
    repair_until_evicted(s)
    assert s.snapshot_part(2, 9, 0, b"12345") == []
    assert s.snapshot_part(2, 9, 1, b"12345") == []  # 10 bytes: at the limit, not over it
    actions = s.snapshot_part(2, 9, 2, b"1")
    assert actions == [SnapshotTooLarge(11), Loss(1, 4, LossReason.TOO_LARGE), RequestReplay(5, 3)]
    assert s.snapshot_part(2, 9, 3, b"more") == [] and s.replay_ended(2) == []
    assert delivered(s.replayed(3, 5, p(5))) == [5]
    assert s.replay_ended(3) == [RequestReplay(5, 4)]  # 6..9 missing: progress, so again
    # nothing for them now; the next snapshot would be as large, so none is asked for
    actions = s.replay_ended(4)
    assert actions == [Loss(6, 9, LossReason.EVICTED), Deliver(10, p(10), False)]


def test_a_snapshot_bootstrap_over_the_limit_falls_back_to_replay() -> None:
    s = Sequencer(has_replay=True, start_seq="snapshot", max_snapshot_bytes=3)
    s.start()
    s.live(3, p(3))
    assert s.snapshot_part(1, 3, 0, b"big!") == [SnapshotTooLarge(4), RequestReplay(0, 2)]
    actions = s.replayed(2, 2, p(2))  # the buffer starts at 2, and no snapshot restores 0..1
    assert actions == [
        Loss(0, 1, LossReason.EVICTED),
        Deliver(2, p(2), False),  # a bootstrap's: no hole filled
        Deliver(3, p(3), False),
    ]


def test_quiet_with_nothing_delivered_or_no_replay_asks_nothing() -> None:
    assert Sequencer(has_replay=True).quiet() == []
    s = Sequencer(has_replay=False)
    s.live(0, p(0))
    assert s.quiet() == []


def test_a_quiet_stream_gets_back_what_it_lost_at_its_end() -> None:
    s = Sequencer(has_replay=True)
    for seq in range(4):
        s.live(seq, p(seq))
    # from the first batch delivered from live that replay has not shown: to compare them all
    assert s.quiet() == [RequestReplay(0, 1, probe=True)]
    assert s.quiet() == []  # one probe at a time
    assert [s.replayed(1, seq, p(seq)) for seq in range(4)] == [[]] * 4  # the same stream
    assert delivered(s.replayed(1, 4, p(4)) + s.replayed(1, 5, p(5))) == [4, 5]
    assert s.replay_ended(1) == []


def test_a_publisher_restarted_and_quiet_behind_our_seq_is_a_restart() -> None:
    s = Sequencer(has_replay=True)
    for seq in range(100):
        s.live(seq, p(seq))
    [probe] = s.quiet()
    assert s.replay_ended(probe.request_id) == [  # nothing at or after seq 99: a new sequence
        Loss(100, None, LossReason.RESTART, new_seq=0),
        RequestReplay(0, probe.request_id + 1),
    ]
    out = [a for seq in range(5) for a in s.replayed(probe.request_id + 1, seq, b"new")]
    assert delivered(out) == [0, 1, 2, 3, 4]
    assert s.replay_ended(probe.request_id + 1) == []  # the old sequence's length is forgotten
    assert delivered(s.live(5, b"new")) == [5]


def test_a_publisher_restarted_and_quiet_past_our_seq_is_a_restart() -> None:
    s = Sequencer(has_replay=True)
    for seq in range(4):
        s.live(seq, p(seq))
    [probe] = s.quiet()
    assert s.replayed(probe.request_id, 3, b"another stream's 3") == [
        Loss(4, None, LossReason.RESTART, new_seq=0),
        RequestReplay(0, probe.request_id + 1),
    ]


def test_after_a_snapshot_a_probe_checks_the_publisher_still_holds_its_seq() -> None:
    s = Sequencer(has_replay=True, start_seq="snapshot")
    [ask] = s.start()
    s.snapshot_part(ask.request_id, 10, 0, b"part")
    assert isinstance(s.replay_ended(ask.request_id)[0], DeliverSnapshot)
    [probe] = s.quiet()
    assert probe == RequestReplay(9, ask.request_id + 1, probe=True)
    assert s.replayed(probe.request_id, 9, b"whatever it was") == []  # held: the same stream
    assert s.replay_ended(probe.request_id) == []


def test_a_probe_unanswered_means_silence_until_the_publisher_is_heard() -> None:
    s = Sequencer(has_replay=True)
    for seq in range(4):
        s.live(seq, p(seq))
    [probe] = s.quiet()
    assert s.replay_failed(probe.request_id) == [Silence(True, 3)]
    assert s.silent
    [probe] = s.quiet()
    assert s.replay_failed(probe.request_id) == []  # said once
    assert s.live(4, p(4)) == [Deliver(4, p(4), False), Silence(False, 4)]  # its news first
    assert not s.silent


def test_a_silent_publisher_heard_again_on_replay_answers() -> None:
    s = Sequencer(has_replay=True)
    s.live(0, p(0))
    s.replay_failed(s.quiet()[0].request_id)
    [probe] = s.quiet()
    assert s.replayed(probe.request_id, 0, p(0)) == []  # the end marker says who answered
    assert s.replay_ended(probe.request_id) == [Silence(False, 0)]


def test_a_live_batch_while_a_probe_is_out_does_not_end_the_silence_its_answer_does() -> None:
    """A restarted publisher's next batch could pass for ours: the probe decides."""
    s = Sequencer(has_replay=True)
    s.live(0, p(0))
    s.disconnected()
    [probe] = s.reconnected()
    assert s.live(1, b"new-1") == [Deliver(1, b"new-1", False)]
    assert s.silent
    assert s.replayed(probe.request_id, 0, b"new-0")[0] == Loss(
        2, None, LossReason.RESTART, new_seq=0
    )


def test_a_refused_probe_proves_the_publisher_there() -> None:
    s = Sequencer(has_replay=True)
    s.live(0, p(0))
    [probe] = s.quiet()
    assert s.replay_failed(probe.request_id, LossReason.REFUSED) == []
    assert not s.silent and s.quiet() != []


def test_a_bootstrap_whose_hold_fills_lets_the_oldest_go_for_the_snapshot_or_replay() -> None:
    s = Sequencer(has_replay=True, start_seq="snapshot", max_held=2)
    [ask] = s.start()
    for seq in (5, 6, 7):  # 5 goes: the snapshot's state covers it, or replay fetches it
        assert s.live(seq, p(seq)) == []
    assert sorted(s.order.pending) == [6, 7]
    s.snapshot_part(ask.request_id, 5, 0, b"state")
    actions = s.replay_ended(ask.request_id)
    assert actions[0] == DeliverSnapshot(4, [b"state"], None)
    assert actions[1:] == [RequestReplay(5, ask.request_id + 1)]  # 5 again, from replay


def test_a_bootstrap_from_a_publisher_that_has_published_nothing_delivers_the_empty_cache() -> None:
    """The state before seq 0 is news: the consumer knows it holds the whole (empty) cache."""
    s = Sequencer(has_replay=True, start_seq="snapshot")
    [ask] = s.start()
    s.snapshot_part(ask.request_id, 0, 0, b"cleared")
    assert s.replay_ended(ask.request_id) == [DeliverSnapshot(-1, [b"cleared"], None)]
    assert delivered(s.live(0, p(0))) == [0]


# -- a restart the seqs do not show, a view with a hole, the live connection ------------------


def test_a_replay_from_the_start_of_an_empty_sequence_says_the_cache_is_known_empty() -> None:
    s = Sequencer(has_replay=True, start_seq=0)
    [ask] = s.start()
    assert s.replay_ended(ask.request_id) == [Synced()]


def test_a_restart_whose_start_replay_no_longer_holds_is_restored_from_a_snapshot() -> None:
    s = Sequencer(has_replay=True)
    for seq in range(5):
        s.live(seq, p(seq))
    assert s.live(2, b"new-2") == [
        Loss(5, None, LossReason.RESTART, new_seq=0),
        RequestReplay(0, 2),
    ]
    assert s.replayed(2, 1, b"new-1") == [RequestSnapshot(3)]  # its 0 is gone from its buffer
    s.snapshot_part(3, 3, 0, b"state")  # the state after its seq 2
    assert s.replay_ended(3) == [DeliverSnapshot(2, [b"state"], 0)]


def test_a_restarted_publisher_that_has_published_nothing_is_synced() -> None:
    """After a restart the probe finds nothing, and a replay from 0 finds nothing either:
    the new engine's cache is empty, and known to be."""
    s = Sequencer(has_replay=True)
    for seq in range(5):
        s.live(seq, p(seq))
    [probe] = s.reconnected()
    assert probe == RequestReplay(0, 1, probe=True)  # every batch live gave, compared
    assert s.replay_ended(1) == [Loss(5, None, LossReason.RESTART, new_seq=0), RequestReplay(0, 2)]
    assert s.replay_ended(2) == [Synced()]
    assert delivered(s.live(0, b"new-0")) == [0]


def test_a_restart_whose_seqs_meet_ours_is_found_by_the_batch_replay_holds_at_our_last() -> None:
    """The crafted sequence: 0-4 delivered, the publisher restarts and its first batch heard is
    5, exactly the seq expected next."""
    s = Sequencer(has_replay=True)
    for seq in range(5):
        s.live(seq, p(seq))
    assert delivered(s.live(5, b"new-5")) == [5]  # nothing on the live side tells it apart
    [probe] = s.reconnected()
    assert probe == RequestReplay(0, 1, probe=True)
    assert s.replayed(1, 5, b"new-5") == []  # the batch delivered is the one replay holds...
    s2 = Sequencer(has_replay=True)
    for seq in range(5):
        s2.live(seq, p(seq))
    [probe] = s2.reconnected()  # ...but found before the new 5: the new 4 is not ours
    assert s2.replayed(probe.request_id, 4, b"new-4") == [
        Loss(5, None, LossReason.RESTART, new_seq=0),
        RequestReplay(0, 2),
    ]


def test_another_epoch_is_a_restart_even_when_every_batch_compares_equal() -> None:
    s = Sequencer(has_replay=True, start_seq=0)
    [ask] = s.start()
    for seq in range(5):
        s.replayed(ask.request_id, seq, p(seq))
    assert s.replay_ended(ask.request_id, epoch=7) == []
    [probe] = s.reconnected()
    assert s.replayed(probe.request_id, 4, p(4)) == []  # the same bytes: a continuation?
    assert s.replay_ended(probe.request_id, epoch=8) == [
        Loss(5, None, LossReason.RESTART, new_seq=0),
        RequestReplay(0, probe.request_id + 1),
    ]
    assert s.epoch == 8


def test_the_same_epoch_and_no_epoch_change_nothing() -> None:
    s = Sequencer(has_replay=True)
    s.live(0, p(0))
    [probe] = s.quiet()
    s.replayed(probe.request_id, 0, p(0))
    assert s.replay_ended(probe.request_id, epoch=7) == []
    [probe] = s.quiet()
    s.replayed(probe.request_id, 0, p(0))
    assert s.replay_ended(probe.request_id) == []  # a publisher that says none: no news
    [probe] = s.quiet()
    s.replayed(probe.request_id, 0, p(0))
    assert s.replay_ended(probe.request_id, epoch=7) == []


def test_a_dropped_connection_is_a_silence_until_the_publisher_answers_again() -> None:
    s = Sequencer(has_replay=True)
    s.live(0, p(0))
    assert s.disconnected() == [Silence(True, 0, disconnected=True)]
    assert s.disconnected() == []  # once
    [probe] = s.reconnected()
    assert s.replayed(probe.request_id, 0, p(0)) == []
    assert s.replay_ended(probe.request_id, epoch=3) == [Silence(False, 0)]


def test_without_replay_a_reconnect_ends_the_silence_and_the_first_batch_decides() -> None:
    s = Sequencer(has_replay=False)
    s.live(0, p(0))
    s.live(1, p(1))
    assert s.disconnected() == [Silence(True, 1, disconnected=True)]
    assert s.reconnected() == [Silence(False, 1)]
    assert s.live(0, b"new-0") == [
        Loss(2, None, LossReason.RESTART, new_seq=0),
        Deliver(0, b"new-0", False),
    ]


def test_a_repair_that_timed_out_asks_for_a_snapshot_when_the_publisher_answers() -> None:
    s = Sequencer(has_replay=True)
    s.live(0, p(0))
    [ask] = s.live(3, p(3))
    assert s.replay_failed(ask.request_id) == [
        Loss(1, 2, LossReason.REPLAY_TIMEOUT),
        Deliver(3, p(3), False),
    ]
    assert s.resync
    [probe] = s.quiet()  # while it may not answer, a probe of one batch is all that is sent
    assert isinstance(probe, RequestReplay) and probe.probe
    assert s.replay_failed(probe.request_id) == [Silence(True, 3)]  # still not answering
    [probe] = s.quiet()
    s.replayed(probe.request_id, 3, p(3))
    snapshot, back = s.replay_ended(probe.request_id)  # it answers: the snapshot, at once
    assert isinstance(snapshot, RequestSnapshot) and back == Silence(False, 3)
    assert s.replay_failed(snapshot.request_id) == []  # it stalls again: asked at the next sign
    [probe] = s.quiet()
    s.replayed(probe.request_id, 3, p(3))
    [again] = s.replay_ended(probe.request_id)
    s.snapshot_part(again.request_id, 4, 0, b"state")  # the state after 3: ours, made whole
    assert s.replay_ended(again.request_id) == [DeliverSnapshot(3, [b"state"], None)]
    assert not s.resync
    [probe] = s.quiet()
    s.replayed(probe.request_id, 3, p(3))
    assert s.replay_ended(probe.request_id) == []  # made whole: back to probing


def test_a_resync_is_asked_at_the_next_live_batch_after_the_one_delivered() -> None:
    s = Sequencer(has_replay=True)
    s.live(0, p(0))
    [ask] = s.live(2, p(2))
    s.replay_failed(ask.request_id)
    actions = s.live(3, p(3))
    assert actions[0] == Deliver(3, p(3), False) and isinstance(actions[1], RequestSnapshot)


def test_no_resync_from_a_publisher_without_snapshots() -> None:
    s = Sequencer(has_replay=True, snapshots=False)
    s.live(0, p(0))
    [ask] = s.live(2, p(2))
    s.replay_failed(ask.request_id)
    [probe] = s.quiet()
    assert isinstance(probe, RequestReplay) and probe.probe


def test_on_reconnect_the_batch_before_the_drop_is_compared_even_after_one_came_since() -> None:
    """The restarted publisher's 5 came live first and passed for ours; its 4 is not ours."""
    s = Sequencer(has_replay=True)
    for seq in range(5):
        s.live(seq, p(seq))
    s.disconnected()
    assert delivered(s.live(5, b"new-5")) == [5]
    [probe] = s.reconnected()
    assert probe == RequestReplay(0, probe.request_id, probe=True)
    assert s.replayed(probe.request_id, 4, b"new-4") == [
        Loss(6, None, LossReason.RESTART, new_seq=0),
        RequestReplay(0, probe.request_id + 1),
    ]


def test_a_new_epoch_restarts_only_what_came_before_the_request() -> None:
    """Nothing of the old incarnation was delivered before this replay from 0: the batch it
    delivered is the new one's, and no restart is reported."""
    s = Sequencer(has_replay=True, start_seq=0)
    [ask] = s.start()
    assert s.replay_ended(ask.request_id, epoch=1) == [Synced()]
    s.disconnected()
    [probe] = s.reconnected()
    assert probe == RequestReplay(0, probe.request_id, probe=True)
    assert delivered(s.replayed(probe.request_id, 0, b"new-0")) == [0]
    assert s.replay_ended(probe.request_id, epoch=2) == [Silence(False, 0)]


def test_a_reconnect_replaces_a_replay_asked_of_whoever_was_there_before() -> None:
    s = Sequencer(has_replay=True)
    s.live(0, p(0))
    [repair] = s.live(3, p(3))
    s.disconnected()
    [probe] = s.reconnected()
    assert probe == RequestReplay(0, repair.request_id + 1, probe=True)
    assert s.replayed(repair.request_id, 1, p(1)) == []  # the old one's reply: ignored
    s.replayed(probe.request_id, 0, p(0))
    assert delivered(s.replayed(probe.request_id, 1, p(1))) == [1]
    assert delivered(s.replayed(probe.request_id, 2, p(2))) == [2, 3]


def test_only_batches_that_fill_a_hole_count_as_repaired() -> None:
    """`tskv listen --from 0` reported its bootstrap's batches as repaired, with no gap."""
    s = Sequencer(has_replay=True, start_seq=0)
    [ask] = s.start()
    boot = [a for seq in range(3) for a in s.replayed(ask.request_id, seq, p(seq))]
    assert [a.repaired for a in boot if isinstance(a, Deliver)] == [False, False, False]
    s.replay_ended(ask.request_id)
    [repair] = s.live(5, p(5))
    s.replayed(repair.request_id, 2, p(2))
    fill = [a for seq in (3, 4) for a in s.replayed(repair.request_id, seq, p(seq))]
    assert [(a.seq, a.repaired) for a in fill if isinstance(a, Deliver)] == [
        (3, True),
        (4, True),
        (5, False),
    ]
