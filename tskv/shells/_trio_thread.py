"""A Trio loop on a thread of its own, serving an async context manager to sync code.

The threaded publisher and the sync test helpers are the same thing underneath: open an async
context manager in a Trio loop on another thread, hand its value to the calling thread, let
that thread call into the loop, and close it all from outside.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager, suppress
from typing import Any, Generic, TypeVar

import trio

from tskv.core.errors import TskvError

logger = logging.getLogger(__name__)

T = TypeVar("T")
V = TypeVar("V")


class LoopFailedError(TskvError, RuntimeError):
    """The background Trio loop stopped on an error; `__cause__` is that error."""


class TrioThread(Generic[V]):
    """Runs `opener()` in a Trio loop on its own thread until `close()`.

    The constructor returns once the context is open (`value` is what it yielded), or raises
    what opening it raised. If the loop later dies on its own, `failure` holds why, and
    `on_failure` (if given) is called from the loop's thread so callers blocked elsewhere can
    be woken.
    """

    def __init__(
        self,
        opener: Callable[[], AbstractAsyncContextManager[V]],
        name: str,
        on_failure: Callable[[BaseException], object] | None = None,
    ) -> None:
        self.name = name
        self._opener = opener
        self._on_failure = on_failure
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.failure: BaseException | None = None
        self.token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self.value: V
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            self._thread.join()
            raise self._error

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:  # the loop died after it was ready: keep it, say so
            self.failure = exc
            logger.error("tskv background loop %s stopped: %r", self.name, exc, exc_info=exc)
            if self._on_failure is not None:
                self._on_failure(exc)

    async def _main(self) -> None:
        try:
            async with self._opener() as value:
                self.value = value
                self.token = trio.lowlevel.current_trio_token()
                self._stop = trio.Event()
                self._ready.set()
                await self._stop.wait()
        except BaseException as exc:
            if self._ready.is_set():
                raise
            self._error = exc
            self._ready.set()

    def check(self) -> None:
        """Raise LoopFailedError (caused by the loop's own error) if the loop has died."""
        if self.failure is not None:
            raise LoopFailedError(
                f"{self.name}'s background Trio loop stopped: {self.failure!r}"
            ) from self.failure

    def run(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run an async function in the loop's thread and wait for its result."""
        self.check()
        return trio.from_thread.run(fn, *args, trio_token=self.token)

    def run_sync(self, fn: Callable[..., T], *args: Any) -> T:
        self.check()
        return trio.from_thread.run_sync(fn, *args, trio_token=self.token)

    def run_sync_soon(self, fn: Callable[[], object]) -> None:
        """Queue `fn` for the loop's thread without waiting (callbacks run in order); raises
        trio.RunFinishedError if the loop has ended."""
        assert self.token is not None
        self.token.run_sync_soon(fn)

    def close(self, timeout: float = 10.0) -> bool:
        """Leave the context (in the loop's thread) and join the thread; False if it lingers."""
        if self._stop is not None and self._thread.is_alive():
            with suppress(trio.RunFinishedError):  # the loop already ended by itself
                trio.from_thread.run_sync(self._stop.set, trio_token=self.token)
        self._thread.join(timeout)
        return not self._thread.is_alive()
