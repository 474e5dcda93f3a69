"""The watcher's trust rules, without sockets: what each report does to a worker's view."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from tskv.core.losses import Loss, LossReason
from tskv.core.worker_view import ViewChange, WorkerView

CLEAR, STALE, CURRENT = ViewChange.CLEAR, ViewChange.STALE, ViewChange.CURRENT


def test_a_stream_followed_from_seq_0_is_current_and_only_the_first_batch_decides() -> None:
    view = WorkerView()
    assert view.delivered(0) == (CURRENT,)
    assert view.delivered(1) == ()
    late = WorkerView()
    assert late.delivered(7) == ()  # joined late: stale until a snapshot or a reset says more
    assert late.delivered(0) == ()  # only the first delivery after a (re)start counts


def test_a_restart_clears_and_stales_and_the_new_stream_from_0_is_current_again() -> None:
    view = WorkerView()
    view.delivered(0)
    assert view.lost(Loss(5, None, LossReason.RESTART, new_seq=0)) == (CLEAR, STALE)
    assert view.delivered(0) == (CURRENT,)


def test_any_other_loss_only_stales() -> None:
    view = WorkerView()
    view.delivered(0)
    assert view.lost(Loss(3, 4, LossReason.EVICTED)) == (STALE,)
    assert view.delivered(5) == ()


def test_silence_stales_a_current_view_and_an_answer_with_nothing_lost_restores_it() -> None:
    view = WorkerView()
    assert view.silence(True, stale=False) == (STALE,)
    assert view.silence(False, stale=True) == (CURRENT,)
    assert view.silence(False, stale=False) == ()


def test_a_loss_while_silent_means_the_answer_does_not_restore_the_view() -> None:
    view = WorkerView()
    view.silence(True, stale=False)
    view.lost(Loss(3, 3, LossReason.REPLAY_TIMEOUT))
    assert view.silence(False, stale=True) == ()


def test_silence_of_a_view_already_stale_changes_nothing_when_it_ends() -> None:
    view = WorkerView()
    assert view.silence(True, stale=True) == ()
    assert view.silence(False, stale=True) == ()  # stale for another reason: still stale


def test_a_subscriber_started_again_stales_and_may_be_current_from_seq_0() -> None:
    view = WorkerView()
    view.delivered(3)
    assert view.resubscribed() == (STALE,)
    assert view.delivered(0) == (CURRENT,)


REPORTS = st.one_of(
    st.tuples(st.just("delivered"), st.integers(0, 3)),
    st.tuples(st.just("lost"), st.sampled_from(list(LossReason))),
    st.tuples(st.just("silence"), st.booleans()),
    st.tuples(st.just("resubscribed"), st.none()),
)


@given(st.lists(REPORTS, max_size=40))
def test_current_only_after_seq_0_first_or_an_answer_to_a_silence_with_nothing_lost(
    reports: list[tuple[str, object]],
) -> None:
    """Applied to a model of the index's stale flag, the view is never current unless the last
    thing that made it so was a first delivery of seq 0, or a silence that ended with nothing
    reported lost since it began."""
    view, stale = WorkerView(), True
    silent_since_current = False
    for kind, value in reports:
        if kind == "delivered":
            first = view.from_start
            changes = view.delivered(value)  # type: ignore[arg-type]
            assert (CURRENT in changes) == (first and value == 0)
        elif kind == "lost":
            reason = value
            loss = Loss(0, None, reason, 0) if reason is LossReason.RESTART else Loss(0, 0, reason)  # type: ignore[arg-type]
            changes = view.lost(loss)
            assert STALE in changes and (CLEAR in changes) == (reason is LossReason.RESTART)
            silent_since_current = False
        elif kind == "silence":
            was_stale = stale
            changes = view.silence(value, stale)  # type: ignore[arg-type]
            if value and not was_stale:
                silent_since_current = True
            if CURRENT in changes:
                assert silent_since_current and not value
                silent_since_current = False
        else:
            changes = view.resubscribed()
            assert changes == (STALE,)
            silent_since_current = False
        for change in changes:
            stale = change is not CURRENT if change is not CLEAR else stale
