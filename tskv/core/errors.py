"""The base of every error tskv raises, so a caller can catch tskv's own in one clause.

Each error is also what it always was (a ValueError for a bad value, an OSError for a socket
that cannot bind, ...), so code that catches those keeps working.
"""

from __future__ import annotations


class TskvError(Exception):
    """An error raised by tskv; its message names the problem and the fix."""
