"""The subscriber's gap logic, without sockets: every seq is delivered once or reported lost."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tskv.sequencer import Deliver, Loss, LossReason, RequestReplay, Sequencer


def p(seq: int) -> bytes:
    return f"payload-{seq}".encode()


def delivered(actions: list) -> list[int]:  # type: ignore[type-arg]
    return [a.seq for a in actions if isinstance(a, Deliver)]


def test_in_order_stream_is_delivered_as_is() -> None:
    s = Sequencer(has_replay=True)
    actions = [a for seq in range(5, 10) for a in s.live(seq, p(seq))]
    assert delivered(actions) == [5, 6, 7, 8, 9]
    assert all(isinstance(a, Deliver) and not a.from_replay for a in actions)


def test_gap_is_repaired_from_replay_before_later_live_batches() -> None:
    s = Sequencer(has_replay=True)
    s.live(0, p(0))
    [request] = s.live(3, p(3))
    assert request == RequestReplay(1, 1)
    assert s.live(4, p(4)) == []  # held while the repair runs
    actions = s.replayed(1, 1, p(1)) + s.replayed(1, 2, p(2))
    assert delivered(actions) == [1, 2, 3, 4]
    assert [a.from_replay for a in actions if isinstance(a, Deliver)] == [True, True, False, False]
    assert s.replayed(1, 3, p(3)) == []  # already delivered live: no duplicate
    assert s.replay_ended(1) == []
    assert delivered(s.live(5, p(5))) == [5]


def test_evicted_batches_are_reported_then_delivery_continues() -> None:
    s = Sequencer(has_replay=True)
    s.live(0, p(0))
    s.live(10, p(10))
    actions = s.replayed(1, 7, p(7)) + s.replayed(1, 8, p(8)) + s.replayed(1, 9, p(9))
    assert actions[0] == Loss(1, 6, LossReason.EVICTED)
    assert delivered(actions) == [7, 8, 9, 10]


def test_replay_with_nothing_for_the_hole_reports_it_at_the_end() -> None:
    s = Sequencer(has_replay=True)
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
    assert actions == [Loss(3, None, LossReason.RESTART, new_seq=0), Deliver(0, b"new", False)]
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
    assert s.replay_ended(1) == [RequestReplay(3, 2)]  # 3, 4 came after the first request


def test_start_seq_needs_replay() -> None:
    with pytest.raises(ValueError, match="start_seq = 4 needs a replay endpoint"):
        Sequencer(has_replay=False, start_seq=4).start()


@settings(max_examples=500)
@given(
    total=st.integers(1, 60),
    dropped=st.sets(st.integers(1, 59)),
    buffer=st.integers(1, 60),
    lag=st.integers(0, 6),
    has_replay=st.booleans(),
)
def test_every_seq_is_delivered_once_or_reported_lost(
    total: int, dropped: set[int], buffer: int, lag: int, has_replay: bool
) -> None:
    """A simulated publisher: live seqs minus `dropped`, a replay buffer of the last `buffer`
    seqs, and replay requests answered only after `lag` more batches went out."""
    s = Sequencer(has_replay=has_replay)
    out: list[Deliver | Loss] = []
    requests: list[tuple[int, RequestReplay]] = []  # (published when it may be served, request)
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
            run(s.live(seq, p(seq)))
        serve(published)
    while requests:
        serve(requests[0][0])
    seen: list[int] = []
    for item in out:
        if isinstance(item, Deliver):
            assert item.payload == p(item.seq)
            seen.append(item.seq)
        else:
            assert item.last_seq is not None
            lost = range(item.first_seq, item.last_seq + 1)
            seen.extend(lost)
            held = [seq for seq in lost if seq not in dropped]
            assert held == [], f"batches that arrived live were reported lost: {held}"
            assert has_replay or item.reason is LossReason.NO_REPLAY
    delivered_only = [item.seq for item in out if isinstance(item, Deliver)]
    assert delivered_only == sorted(set(delivered_only))  # strictly increasing
    last_live = max(seq for seq in range(total) if seq not in dropped)
    assert seen == list(range(len(seen)))  # nothing missing, nothing twice
    assert len(seen) > last_live  # replay may also deliver dropped batches after the last live


@pytest.mark.parametrize("reason", list(LossReason))
def test_every_kind_of_loss_is_logged_and_shown_readably(
    reason: LossReason, caplog: pytest.LogCaptureFixture
) -> None:
    from tskv.listen import format_loss
    from tskv.subscriber import _log_loss

    restart = reason is LossReason.RESTART
    loss = Loss(9, None, reason, new_seq=0) if restart else Loss(3, 5, reason)
    with caplog.at_level("WARNING", logger="tskv"):
        _log_loss(loss)
    [record] = caplog.records
    message = record.getMessage()  # raises if the format and the arguments disagree
    shown = format_loss(loss)
    if reason is LossReason.RESTART:
        assert "expected seq 9, got seq 0" in message and "now at seq 0" in shown
    else:
        assert f"3..5 ({reason.value})" in message and f"3..5 ({reason.value})" in shown
