"""A watchdog for tests that read from child processes: a stuck child fails the test, not CI."""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def killed_after(seconds: float, *processes: subprocess.Popen[str]) -> Iterator[None]:
    """Kill `processes` if the block has not finished within `seconds` (a readline that would
    otherwise wait forever then sees end of file)."""
    timer = threading.Timer(seconds, lambda: [p.kill() for p in processes if p.poll() is None])
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
