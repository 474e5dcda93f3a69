"""The replay client's policy for one request, without I/O: how long to wait for an answer,
when a refusal is asked again (`backoff.Backoff`), and when to give up.

A refusal means "busy now" (the publisher's rate or concurrency limit), not "nothing buffered",
so a repair asks again, later and later, until `timeout` has passed since the first refusal.
A probe (the stream went quiet) learns what it asked from a refusal (the publisher is there)
and ends at once; its silence is reported as the publisher's, not as a timed-out replay.
The shell (`tskv.shells.subscriber`) sends, waits and sleeps as this says; the clock's readings
and the random source are given to it, so every rule is tested without sockets or time.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import attrs

from tskv.core.backoff import Backoff
from tskv.core.losses import LossReason

REFUSAL_BACKOFF = (0.05, 1.0)  # first and longest wait before asking a refusing replay again


@attrs.frozen
class GiveUp:
    """The request failed: tell the sequencer `reason`; `warning` is for the log (None: the
    sequencer reports it, as a probe's silence); `new_socket`: a timed-out request's socket is
    replaced, so its late replies die with it."""

    reason: LossReason
    warning: str | None
    new_socket: bool = False


@attrs.frozen
class AskAgain:
    """Refused: wait `after` seconds, then send the request again, unless a newer request is
    queued by then: that one asks from where delivery stands, and supersedes this one."""

    after: float


@attrs.define
class ReplayAttempt:
    """One replay or snapshot request, from its first send to its end."""

    endpoint: str
    timeout: float  # how long a repair may go unanswered, or keep being refused
    probe: bool = False
    probe_timeout: float | None = None  # how long a probe waits (None: `timeout`)
    uniform: Callable[[float, float], float] = random.uniform
    _refused_since: float | None = None
    _backoff: Backoff = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._backoff = Backoff(*REFUSAL_BACKOFF, uniform=self.uniform)

    @property
    def wait(self) -> float:
        """How long to wait for the next message before giving up: only the endpoint's silence
        counts against it, not a slow consumer."""
        if self.probe and self.probe_timeout is not None:
            return self.probe_timeout
        return self.timeout

    def timed_out(self) -> GiveUp:
        warning = None if self.probe else f"replay endpoint {self.endpoint} sent nothing for"
        if warning is not None:
            warning += f" {self.wait:.1f} s"
        return GiveUp(LossReason.REPLAY_TIMEOUT, warning, new_socket=True)

    def refused(self, now: float, why: str) -> GiveUp | AskAgain:
        """A refusal arrived at `now` (the shell's clock)."""
        if self.probe:
            return GiveUp(LossReason.REFUSED, None)
        self._refused_since = now if self._refused_since is None else self._refused_since
        after = self._backoff.next()
        if now - self._refused_since + self._backoff.nominal > self.timeout:
            return GiveUp(
                LossReason.REFUSED,
                f"replay endpoint {self.endpoint} kept refusing for {self.timeout:.1f} s: {why}",
            )
        return AskAgain(after)
