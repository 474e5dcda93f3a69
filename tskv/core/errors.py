"""The base of every error tskv raises, so a caller can catch tskv's own in one clause.

Each error is also what it always was (a ValueError for a bad value, an OSError for a socket
that cannot bind, ...), so code that catches those keeps working.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable


class TskvError(Exception):
    """An error raised by tskv; its message names the problem and the fix."""


class TskvWarning(UserWarning):
    """What a core function tells its caller without failing (fields a wire cannot carry,
    config keys it ignores), when the caller gave it no `warn` of its own: the core never logs,
    the shells pass their logger's `warning`."""


Warn = Callable[[str], object]


def python_warning(message: str) -> None:
    """The core's default `warn`: Python's warnings, shown once per place by default."""
    warnings.warn(message, TskvWarning, stacklevel=3)
