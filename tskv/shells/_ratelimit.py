"""Rate-limited logging, so a misbehaving peer cannot flood the log (or the disk)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)


class LogLimiter:
    """Log at most one message per `interval` seconds, saying how many were held back."""

    def __init__(self, interval: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval = interval
        self._clock = clock
        self._next = float("-inf")
        self.suppressed = 0

    def warning(self, message: str, *args: object) -> bool:
        now = self._clock()
        if now < self._next:
            self.suppressed += 1
            return False
        if self.suppressed:
            message += " (%d similar messages suppressed)"
            args = (*args, self.suppressed)
        logger.warning(message, *args)
        self.suppressed = 0
        self._next = now + self.interval
        return True
