"""The base of every error tskv raises, so a caller can catch tskv's own in one clause.

Each error is also what it always was (a ValueError for a bad value, an OSError for a socket
that cannot bind, ...), so code that catches those keeps working.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable


class TskvError(Exception):
    """An error raised by tskv; its message names the problem and the fix."""


class ConfigError(TskvError, ValueError):
    """A setting tskv cannot use; the message names the setting and the fix."""


class TskvTypeError(TskvError, TypeError):
    """A value of a type tskv does not take (an argument, an event's field)."""


class TskvValueError(TskvError, ValueError):
    """A value tskv does not take: out of range, or not one of the choices."""


class TskvLookupError(TskvError, KeyError):
    """A name tskv does not know (a worker never added, or removed); says which it knows."""

    def __str__(self) -> str:  # KeyError's own would show the message in quotes
        return str(self.args[0]) if self.args else ""


class HandshakeError(TskvError, ConnectionError):
    """The publisher refused this subscriber's handshake for good: its key is not allowed, the
    server key is wrong, or one side speaks clear text. Retrying cannot help; the message says
    what to check."""


class TskvRuntimeError(TskvError, RuntimeError):
    """Something tskv needs is not there at run time (a scheduler binding, a ZAP handler)."""


class TskvImportError(TskvError, ImportError):
    """The encoder asked for (TSKV_CODEC) cannot be loaded."""


class TskvWarning(UserWarning):
    """What a core function tells its caller without failing (fields a wire cannot carry,
    config keys it ignores), when the caller gave it no `warn` of its own: the core never logs,
    the shells pass their logger's `warning`."""


Warn = Callable[[str], object]


def python_warning(message: str) -> None:
    """The core's default `warn`: Python's warnings, shown once per place by default."""
    warnings.warn(message, TskvWarning, stacklevel=3)
