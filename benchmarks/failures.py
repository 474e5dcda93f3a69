"""What a router sees when a worker fails, and when: a watcher (default settings) following
publishers in child processes that are killed, restarted on the same ports (with an empty cache
or with the blocks they kept), stopped (a hang: the process is there, nothing answers) and let
go on; and what the quiet stream's probe costs, per probe, on both sides.

Times are from the moment the failure is made (a restart: the moment the new publisher has
bound its ports and published what it kept) to the moment `on_status` says so; wall-clock
figures on a shared machine, the median of the repetitions with their range.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import statistics
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import trio

import tskv
from benchmarks.helpers import fmt
from tskv.shells.watcher import QUIET_INTERVAL

CACHED_BLOCKS = 1_000  # what a worker that kept its cache publishes again when it starts
IDLE_WORKERS = 32  # for the probe's cost
IDLE_SECONDS = 10.0


def _endpoint_pairs(count: int) -> list[tuple[str, str]]:
    """`count` live and replay endpoints on distinct loopback ports nothing listens on (all
    picked before any is let go: the OS would hand a port just closed out again)."""
    probes = [socket.socket() for _ in range(2 * count)]
    try:
        for probe in probes:
            probe.bind(("127.0.0.1", 0))
        ports = [probe.getsockname()[1] for probe in probes]
    finally:
        for probe in probes:
            probe.close()
    urls = [f"tcp://127.0.0.1:{port}" for port in ports]
    return list(zip(urls[::2], urls[1::2], strict=True))


def _cache(blocks: int) -> list[tskv.KVEvent]:
    if not blocks:
        return []
    tokens = [n % 50_000 for n in range(blocks * 16)]
    return [tskv.AllBlocksCleared(), tskv.BlockStored(list(range(blocks)), None, tokens, 16)]


def _publishers(endpoints: list[tuple[str, str]], blocks: int, conn: Connection) -> None:
    """A child: publishers on these endpoints, each publishing its cache (if any) at once,
    until told to stop; on request, its CPU seconds so far."""

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            for live, replay in endpoints:
                config = tskv.KVEventsConfig(endpoint=live, replay_endpoint=replay, bind=True)
                await nursery.start(_one, config)
            conn.send("up")  # every publisher bound, its cache published
            while True:
                await trio.to_thread.run_sync(conn.poll, None)
                if conn.recv() == "stop":
                    nursery.cancel_scope.cancel()
                    return
                conn.send(time.process_time())

    async def _one(config: tskv.KVEventsConfig, task_status: Any) -> None:
        async with tskv.open_publisher(config) as publisher:
            events = _cache(blocks)
            if events:
                await publisher.publish(events)
            task_status.started()
            await trio.sleep_forever()

    trio.run(main)


class _Child:
    def __init__(self, endpoints: list[tuple[str, str]], blocks: int) -> None:
        context = multiprocessing.get_context("spawn")
        self.conn, end = context.Pipe()
        self.process = context.Process(target=_publishers, args=(endpoints, blocks, end))
        self.process.start()
        end.close()

    async def up(self) -> None:
        await trio.to_thread.run_sync(self.conn.recv)

    async def cpu(self) -> float:
        self.conn.send("cpu")
        seconds: float = await trio.to_thread.run_sync(self.conn.recv)
        return seconds

    def signal(self, number: int) -> None:
        assert self.process.pid is not None
        os.kill(self.process.pid, number)

    def end(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(10)


class _Turns:
    """`on_status`, kept, with a way to wait for a worker's next state."""

    def __init__(self) -> None:
        self.states: dict[Any, tuple[bool, bool]] = {}
        self.changed = trio.Event()

    def __call__(self, worker: Any, status: tskv.WorkerStatus) -> None:
        self.states[worker] = (status.stale, status.silent)
        self.changed.set()

    async def until(self, worker: Any, stale: bool, silent: bool) -> float:
        with trio.fail_after(30):
            while self.states.get(worker) != (stale, silent):
                self.changed = trio.Event()
                await self.changed.wait()
        return time.monotonic()


async def _failure_times() -> dict[str, float]:
    [(live, replay)] = _endpoint_pairs(1)
    index, turns = tskv.PrefixIndex(16), _Turns()
    times: dict[str, float] = {}
    async with tskv.open_watcher(index, on_status=turns) as watcher:
        worker = _Child([(live, replay)], CACHED_BLOCKS)
        await worker.up()
        watcher.add("a", live, replay)
        await turns.until("a", stale=False, silent=False)

        async def timed(name: str, make: Callable[[], object], stale: bool, silent: bool) -> None:
            started = time.monotonic()
            make()
            times[name] = await turns.until("a", stale, silent) - started

        try:
            await timed("crash", lambda: worker.signal(signal.SIGKILL), True, True)
            worker.end()
            worker = _Child([(live, replay)], 0)
            await worker.up()  # bound: from here the router can know it
            started = time.monotonic()
            times["restart, empty cache"] = await turns.until("a", False, False) - started
            await timed("crash", lambda: worker.signal(signal.SIGKILL), True, True)
            worker.end()
            worker = _Child([(live, replay)], CACHED_BLOCKS)
            await worker.up()
            started = time.monotonic()
            while index.statistics().blocks < CACHED_BLOCKS or "a" in index.stale:  # noqa: ASYNC110
                await trio.sleep(0.001)  # its blocks and its trust, both
            times["restart, cache kept"] = time.monotonic() - started
            await timed("hang (SIGSTOP)", lambda: worker.signal(signal.SIGSTOP), True, True)
            await timed("back (SIGCONT)", lambda: worker.signal(signal.SIGCONT), False, False)
        finally:
            worker.end()
    return times


async def _probe_cpu(quiet_interval: float | None) -> tuple[float, float]:
    """CPU seconds per second, in the watcher's process and in the publishers', while every
    worker is idle."""
    endpoints = _endpoint_pairs(IDLE_WORKERS)
    workers = _Child(endpoints, 1)
    try:
        await workers.up()
        index, turns = tskv.PrefixIndex(16), _Turns()
        settings = {"quiet_interval": quiet_interval}
        async with tskv.open_watcher(index, on_status=turns, **settings) as watcher:
            for n, (live, replay) in enumerate(endpoints):
                watcher.add(n, live, replay)
            for n in range(IDLE_WORKERS):
                await turns.until(n, False, False)
            await trio.sleep(1.0)
            ours, theirs = time.process_time(), await workers.cpu()
            await trio.sleep(IDLE_SECONDS)
            ours, theirs = time.process_time() - ours, await workers.cpu() - theirs
    finally:
        workers.conn.send("stop")
        workers.end()
    return ours / IDLE_SECONDS, theirs / IDLE_SECONDS


def failures_section(out: Callable[[str], None], reps: int) -> None:
    out("\n## When a worker fails: what on_status says, and when (open_watcher's defaults)")
    runs = [trio.run(_failure_times) for _ in range(reps)]
    out(f"\n{reps} runs, a worker of {CACHED_BLOCKS:,} blocks in a child process, tcp loopback:\n")
    out("| what happened | reported after (ms) |")
    out("|---|---|")
    for name in runs[0]:
        out(f"| {name} | {fmt([run[name] for run in runs], scale=1000)} |")
    quiet = QUIET_INTERVAL
    on = [trio.run(_probe_cpu, quiet) for _ in range(reps)]
    off = [trio.run(_probe_cpu, None) for _ in range(reps)]
    probes = IDLE_WORKERS / quiet  # per second
    out(f"\nThe quiet stream's probe, {IDLE_WORKERS} idle workers probed every {quiet:g} s:\n")
    out("| side | CPU per probe (µs) |")
    out("|---|---|")
    for side, index in (("the router's (watcher)", 0), ("the publisher's", 1)):
        costs = [(a[index] - b[index]) / probes for a, b in zip(on, off, strict=True)]
        out(f"| {side} | {fmt(costs, scale=1e6)} |")
    spread = statistics.median([a[0] for a in on]) * 100
    out(f"\n(the watcher's process used {spread:.1f}% of a core in all, probes included)")
