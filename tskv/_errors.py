"""Exceptions out of our nurseries, as the caller raised them."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup


@contextmanager
def unwrap_single_exception() -> Iterator[None]:
    """Re-raise a lone exception out of Trio's exception group.

    Our context managers run a nursery around the caller's block; without this, an error in
    the caller's own code would reach the caller wrapped in a group it never asked for.
    """
    try:
        yield
    except BaseExceptionGroup as group:
        if len(group.exceptions) == 1 and not isinstance(group.exceptions[0], BaseExceptionGroup):
            raise group.exceptions[0] from None
        raise
