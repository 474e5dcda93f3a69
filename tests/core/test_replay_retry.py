"""The replay client's retry policy, without sockets or time: the clock's readings and the
random source are given to it."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from tskv.core.losses import LossReason
from tskv.core.replay_retry import REFUSAL_BACKOFF, AskAgain, GiveUp, ReplayAttempt


def lowest(low: float, high: float) -> float:
    return low


def test_a_timeout_gives_up_replaces_the_socket_and_is_logged_for_a_repair_only() -> None:
    repair = ReplayAttempt("tcp://127.0.0.1:1", timeout=5.0)
    assert repair.wait == 5.0
    assert repair.timed_out() == GiveUp(
        LossReason.REPLAY_TIMEOUT, "replay endpoint tcp://127.0.0.1:1 sent nothing for 5.0 s", True
    )
    probe = ReplayAttempt("tcp://127.0.0.1:1", timeout=5.0, probe=True, probe_timeout=2.0)
    assert probe.wait == 2.0  # a quiet stream's probe waits one quiet interval
    assert probe.timed_out() == GiveUp(LossReason.REPLAY_TIMEOUT, None, new_socket=True)


def test_a_refused_probe_ends_at_once_as_refused() -> None:
    probe = ReplayAttempt("e", timeout=5.0, probe=True, probe_timeout=2.0)
    assert probe.refused(0.0, "busy") == GiveUp(LossReason.REFUSED, None)


def test_refusals_back_off_doubling_with_jitter_up_to_the_longest_wait() -> None:
    attempt = ReplayAttempt("e", timeout=100.0, uniform=lowest)
    waits = []
    now = 0.0
    for _ in range(8):
        decision = attempt.refused(now, "busy")
        assert isinstance(decision, AskAgain)
        waits.append(decision.after)
        now += decision.after
    first, longest = REFUSAL_BACKOFF
    assert waits[:3] == [first * 0.5, first, first * 2]
    assert max(waits) == longest * 0.5  # the lowest jitter on the longest wait


def test_refusals_give_up_once_the_timeout_has_passed_since_the_first() -> None:
    attempt = ReplayAttempt("tcp://127.0.0.1:1", timeout=1.0, uniform=lowest)
    assert isinstance(attempt.refused(10.0, "rate limit"), AskAgain)
    assert isinstance(attempt.refused(10.5, "rate limit"), AskAgain)
    decision = attempt.refused(11.0, "rate limit")
    assert decision == GiveUp(
        LossReason.REFUSED,
        "replay endpoint tcp://127.0.0.1:1 kept refusing for 1.0 s: rate limit",
    )


@given(
    timeout=st.floats(0.01, 30.0),
    gaps=st.lists(st.floats(0.0, 5.0), min_size=1, max_size=60),
    jitter=st.floats(0.5, 1.0),
)
def test_asking_again_never_outlasts_the_timeout(
    timeout: float, gaps: list[float], jitter: float
) -> None:
    """Whatever the clock does between refusals, a repair asks again only while the next wait
    still ends within `timeout` of the first refusal, and every wait is within the bounds."""
    attempt = ReplayAttempt("e", timeout=timeout, uniform=lambda low, high: jitter)
    now = first = 0.0
    backoff = REFUSAL_BACKOFF[0]
    for gap in gaps:
        decision = attempt.refused(now, "busy")
        if isinstance(decision, GiveUp):
            assert decision.reason is LossReason.REFUSED and now - first + backoff > timeout
            return
        assert decision.after == backoff * jitter <= REFUSAL_BACKOFF[1]
        assert now - first + backoff <= timeout
        backoff = min(backoff * 2, REFUSAL_BACKOFF[1])
        now += decision.after + gap
