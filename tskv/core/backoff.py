"""How long to wait before trying again, for every retry tskv makes: exponential backoff with
jitter, no I/O.

A replay request the publisher refused, a worker whose subscriber failed, a reader process that
ended: each waits `first` seconds before its first retry, twice as long before each next one, at
most `longest`, and each wait is drawn between half and all of that, so many clients that failed
together do not all come back at the same moment. The random source is given, so every rule is
tested without time.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import attrs


@attrs.define
class Backoff:
    """Waits between retries that grow to `longest` with jitter, so that many clients retrying
    one publisher do not come back in step."""

    first: float
    longest: float
    uniform: Callable[[float, float], float] = random.uniform
    _nominal: float | None = None  # the last wait before jitter; None: no retry yet

    def next(self) -> float:
        """The wait before the next retry."""
        nominal = self.first if self._nominal is None else min(self._nominal * 2, self.longest)
        self._nominal = nominal
        return nominal * self.uniform(0.5, 1.0)

    @property
    def nominal(self) -> float:
        """The wait the last `next` drew from (before any retry: `first`)."""
        return self.first if self._nominal is None else self._nominal

    def reset(self) -> None:
        """It went well for a while: the next failure starts from `first` again."""
        self._nominal = None
