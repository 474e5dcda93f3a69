"""What every section shares: child processes (each figure on a fresh interpreter where it
matters), their CPU and memory, a subscriber process that counts batches, percentiles and number
formatting, repeated runs merged. Sections import their helpers from here and nowhere else."""

from __future__ import annotations

import math
import multiprocessing
import os
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection
from typing import Any

import zmq


@contextmanager
def child(target: Callable[..., None], *args: Any) -> Iterator[Connection]:
    context = multiprocessing.get_context("spawn")
    parent, end = context.Pipe()
    process = context.Process(target=target, args=(*args, end))
    process.start()
    end.close()  # the child's end is the child's alone: if it dies, a recv here fails at once
    try:
        yield parent
    finally:
        process.join(60)
        if process.is_alive():
            process.kill()


def in_fresh_process(target: Callable[..., None], *args: Any) -> Any:
    with child(target, *args) as conn:
        return conn.recv()


def rss(pid: int | None = None) -> int:
    """Resident bytes of this process, or of process `pid`."""
    with open(f"/proc/{pid or 'self'}/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def zmq_io_seconds(pid: int | str = "self") -> float:
    """CPU seconds a process's ZeroMQ I/O threads have used (Linux: they are named so): what
    a PUB's subscribers cost beyond the send itself is spent there, and a SUB's receiving."""
    total = 0
    for thread in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{thread}/comm") as comm:
            if not comm.read().startswith("ZMQbg/IO"):
                continue
        user, kernel = _cpu_ticks(f"/proc/{pid}/task/{thread}/stat")
        total += user + kernel
    return total / os.sysconf("SC_CLK_TCK")


def kernel_seconds(pid: int | str = "self") -> float:
    """CPU seconds a process (all its threads) has spent in the kernel."""
    return _cpu_ticks(f"/proc/{pid}/stat")[1] / os.sysconf("SC_CLK_TCK")


def _cpu_ticks(stat_path: str) -> tuple[int, int]:
    """utime and stime, in clock ticks, from a /proc stat file."""
    with open(stat_path) as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return int(fields[11]), int(fields[12])


def fmt(values: list[float], unit: str = "", scale: float = 1.0, digits: int = 0) -> str:
    if any(math.isnan(value) for value in values):
        return "n/a (needs msgspec)"
    scaled = [v * scale for v in values]
    mid = statistics.median(scaled)
    return f"{mid:,.{digits}f}{unit} ({min(scaled):,.{digits}f}..{max(scaled):,.{digits}f})"


# Counts of what went wrong in a run: over repeated runs, the worst is reported, since a median
# would hide the one run that lost something
WORST_OF_RUNS = frozenset(
    {"losses", "wrong_views", "behind", "late_rounds", "stale_after_bootstrap", "missed"}
)


def median_of_runs(reps: int, run: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`run(*args, **kwargs)` repeated `reps` times (at least once), its figures merged: each
    number the median of the runs (a tuple's, a list's and a dict's element by element), the
    counts in WORST_OF_RUNS the worst run's; what is not a number in every run is the first
    run's."""
    runs = [run(*args, **kwargs) for _ in range(max(1, reps))]
    return _merged(runs, None)


def runs_said(reps: int) -> str:
    """How a table names what `median_of_runs` gave it."""
    return "one run" if reps <= 1 else f"the median of {reps} runs"


def _merged(values: list[Any], name: str | None) -> Any:
    first = values[0]
    if isinstance(first, dict):
        return {key: _merged([value.get(key) for value in values], key) for key in first}
    if isinstance(first, (tuple, list)) and all(len(value) == len(first) for value in values):
        return type(first)(_merged(list(column), name) for column in zip(*values, strict=True))
    numbers = [value for value in values if isinstance(value, (int, float))]
    if isinstance(first, bool) or len(numbers) < len(values):
        return first
    if name in WORST_OF_RUNS:
        return max(numbers)
    if all(isinstance(number, int) for number in numbers):
        return statistics.median_low(numbers)  # a count stays a whole number
    return statistics.median(numbers)


def last_endpoint(sock: zmq.Socket[bytes]) -> str:
    """The address a bound socket really uses (port 0 resolved)."""
    value = sock.getsockopt(zmq.LAST_ENDPOINT)
    return value.decode() if isinstance(value, bytes) else str(value)


def percentile(values: list[float], share: float) -> float:
    """The value `share` of the way up the sorted values (0.5: the median, 0.99: p99); NaN
    when there are none."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def counting_subscriber(endpoint: str, count: int, conn: Connection) -> None:
    """Receive `count` batches (frames only) and report when the first and last arrived."""
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.setsockopt(zmq.RCVTIMEO, 20_000)
    sock.connect(endpoint)
    conn.send("connected")
    received, first, last = 0, 0.0, 0.0
    try:
        while received < count:
            sock.recv_multipart()
            if received == 0:
                first = time.monotonic()
            received += 1
    except zmq.Again:
        pass
    last = time.monotonic()
    conn.send((received, first, last))
    sock.close(linger=0)
