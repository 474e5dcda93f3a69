"""Background tasks for the length of a caller's `async with` block, errors as raised."""

from __future__ import annotations

import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager

import trio

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup


def only(error: BaseException, *kinds: type[BaseException]) -> bool:
    """Whether `error` (or every error in its group) is one of `kinds`."""
    if isinstance(error, BaseExceptionGroup):
        return all(only(inner, *kinds) for inner in error.exceptions)
    return isinstance(error, kinds)


@contextmanager
def unwrap_single_exception() -> Iterator[None]:
    """Re-raise a lone exception out of Trio's exception group.

    Our context managers run a nursery around the caller's block; without this, an error in
    the caller's own code would reach the caller wrapped in a group it never asked for.
    """
    try:
        yield
    except BaseExceptionGroup as group:
        if len(group.exceptions) != 1 or isinstance(group.exceptions[0], BaseExceptionGroup):
            raise
        error = group.exceptions[0]
        # Raising it here would chain it to the group; keep the chain it was raised with
        # (`raise X from Y` stays X caused by Y).
        cause, context, suppress = error.__cause__, error.__context__, error.__suppress_context__
        try:
            raise error
        finally:
            error.__cause__, error.__context__ = cause, context
            error.__suppress_context__ = suppress


@asynccontextmanager
async def background_tasks() -> AsyncIterator[trio.Nursery]:
    """A nursery whose tasks are cancelled when the block ends, however it ends.

    The shape of open_publisher, open_subscriber and the test helpers: tasks serve the
    caller's block and live exactly as long as it.
    """
    with unwrap_single_exception():
        async with trio.open_nursery() as nursery:
            try:
                yield nursery
            finally:
                nursery.cancel_scope.cancel()


class Pacer:
    """When a call that seldom has to wait should still let other tasks run.

    Yielding on every publish() or every received batch costs more than the work itself, and a
    caller doing one per scheduling round yields elsewhere anyway; so such calls are always a
    cancellation point, and a schedule point at least every `every` calls or `after` seconds.
    """

    def __init__(self, every: int = 64, after: float = 0.0005) -> None:
        self.every = every
        self.after = after
        self._calls = 0
        self._since = time.perf_counter()

    def due(self) -> bool:
        """Count one call; True when it is time to let other tasks run."""
        self._calls += 1
        return self._calls >= self.every or time.perf_counter() - self._since > self.after

    async def yield_now(self) -> None:
        await trio.lowlevel.cancel_shielded_checkpoint()
        self.waited()

    def waited(self) -> None:
        """Other tasks just ran (the call had to wait): start counting again."""
        self._calls = 0
        self._since = time.perf_counter()
