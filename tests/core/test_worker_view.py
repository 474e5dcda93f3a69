"""Every trust rule, without sockets: what each report does to a worker's view."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from tskv.core.losses import Loss, LossReason
from tskv.core.worker_view import ViewChange, WorkerView

CLEAR, STALE, CURRENT = ViewChange.CLEAR, ViewChange.STALE, ViewChange.CURRENT


def watched() -> WorkerView:
    view = WorkerView()
    assert view.watched() == (STALE,) and view.stale
    return view


def test_a_worker_known_only_by_its_events_is_trusted_and_one_watched_is_not_yet() -> None:
    assert not WorkerView().stale
    assert watched().stale


def test_a_stream_followed_from_seq_0_is_current_and_only_the_first_batch_decides() -> None:
    view = watched()
    assert view.delivered(0) == (CURRENT,) and not view.stale
    assert view.delivered(1) == ()
    late = watched()
    assert late.delivered(7) == ()  # joined late: stale until a snapshot or a reset says more
    assert late.delivered(0) == () and late.stale  # only the first delivery after a (re)start


def test_a_cache_reset_makes_the_view_whole() -> None:
    view = watched()
    assert view.reset_applied() == (CURRENT,) and not view.stale
    assert view.reset_applied() == ()  # already whole


def test_a_snapshot_is_stale_until_its_last_part_and_whole_if_it_cleared_first() -> None:
    view = watched()
    view.delivered(0)
    assert view.snapshot_begins() == (STALE,)
    assert view.reset_applied() == ()  # the first part's clear: the last part decides
    assert view.stale
    assert view.snapshot_ends(complete=True) == (CURRENT,) and not view.stale


def test_a_snapshot_that_broke_off_or_never_cleared_leaves_the_view_stale() -> None:
    view = watched()
    view.snapshot_begins()
    view.reset_applied()
    assert view.snapshot_ends(complete=False) == () and view.stale
    view.snapshot_begins()
    assert view.snapshot_ends(complete=True) == () and view.stale  # it cleared nothing
    assert view.reset_applied() == (CURRENT,)  # a reset after the snapshot counts again


def test_a_restart_clears_and_stales_and_the_new_stream_from_0_is_current_again() -> None:
    view = watched()
    view.delivered(0)
    assert view.lost(Loss(5, None, LossReason.RESTART, new_seq=0)) == (CLEAR, STALE)
    assert view.delivered(0) == (CURRENT,)


def test_any_other_loss_only_stales() -> None:
    view = watched()
    view.delivered(0)
    assert view.lost(Loss(3, 4, LossReason.EVICTED)) == (STALE,)
    assert view.delivered(5) == () and view.stale


def test_silence_stales_a_current_view_and_an_answer_with_nothing_lost_restores_it() -> None:
    view = watched()
    view.delivered(0)
    assert view.silence(True) == (STALE,)
    assert view.silence(False) == (CURRENT,)
    assert view.silence(False) == ()


def test_a_loss_while_silent_means_the_answer_does_not_restore_the_view() -> None:
    view = watched()
    view.delivered(0)
    view.silence(True)
    view.lost(Loss(3, 3, LossReason.REPLAY_TIMEOUT))
    assert view.silence(False) == () and view.stale


def test_silence_of_a_view_already_stale_changes_nothing_when_it_ends() -> None:
    view = watched()
    assert view.silence(True) == ()
    assert view.silence(False) == ()  # stale for another reason: still stale


def test_a_subscriber_started_again_stales_and_may_be_current_from_seq_0() -> None:
    view = watched()
    view.delivered(0)
    assert view.resubscribed() == (STALE,)
    assert view.delivered(0) == (CURRENT,)


def test_the_users_own_mark_is_carried_out_and_ends_a_silence() -> None:
    view = watched()
    assert view.marked(False) == (CURRENT,)
    view.silence(True)
    assert view.marked(True) == () and view.stale  # stale already, and now for the user
    assert view.silence(False) == ()  # the user's mark, not the silence, keeps it stale


REPORTS = st.one_of(
    st.tuples(st.just("delivered"), st.integers(0, 3)),
    st.tuples(st.just("lost"), st.sampled_from(list(LossReason))),
    st.tuples(st.just("silence"), st.booleans()),
    st.tuples(st.just("resubscribed"), st.none()),
    st.tuples(st.just("reset"), st.none()),
    st.tuples(st.just("snapshot"), st.booleans()),
)


@given(st.lists(REPORTS, max_size=40))
def test_current_only_after_seq_0_a_reset_a_whole_snapshot_or_a_silence_that_ended_well(
    reports: list[tuple[str, object]],
) -> None:
    """Carried out on a model of the index's stale flag, the changes always agree with the
    view's own `stale`, and the view is current only when the last thing that made it so was a
    first delivery of seq 0, a cache reset outside a snapshot, a snapshot whose parts all went
    in after a reset, or a silence that ended with nothing reported lost since it began."""
    view = watched()
    stale = True
    silent_since_current = False
    for kind, value in reports:
        if kind == "delivered":
            first = view.from_start
            changes = view.delivered(value)  # type: ignore[arg-type]
            assert (CURRENT in changes) == (first and value == 0 and stale)
        elif kind == "lost":
            reason = value
            loss = Loss(0, None, reason, 0) if reason is LossReason.RESTART else Loss(0, 0, reason)  # type: ignore[arg-type]
            changes = view.lost(loss)
            assert view.stale and (CLEAR in changes) == (reason is LossReason.RESTART)
            silent_since_current = False
        elif kind == "silence":
            was_stale = stale
            changes = view.silence(value)  # type: ignore[arg-type]
            if value and not was_stale:
                silent_since_current = True
            if CURRENT in changes:
                assert silent_since_current and not value
            silent_since_current = silent_since_current and bool(value)
        elif kind == "reset":
            changes = view.reset_applied()
            assert changes == ((CURRENT,) if stale else ())
            silent_since_current = False
        elif kind == "snapshot":
            changes = view.snapshot_begins()
            assert changes == (() if stale else (STALE,))
            cleared = bool(value)
            if cleared:
                assert view.reset_applied() == ()
            ended = view.snapshot_ends(complete=True)
            assert (CURRENT in ended) == cleared
            changes += ended
            silent_since_current = False
        else:
            changes = view.resubscribed()
            assert changes == (() if stale else (STALE,))
            silent_since_current = False
        for change in changes:
            if change is not CLEAR:
                stale = change is STALE
        assert stale == view.stale
