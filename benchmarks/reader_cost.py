"""A reader process's instructions a batch, counted by callgrind: the fleet's CPU figures move
by half between runs on a shared machine, a count of instructions does not, so a change to the
reader's path shows here when it is too small to show there.

One reader process (`open_watcher(processes=1)`) follows WORKERS publishers publishing small
rounds at RATE a second, under `valgrind --tool=callgrind`. Once every worker is current its
counters are zeroed, and after WINDOW seconds dumped; the batches the reader reported between
the two are what the count is divided by. The reader runs about 50 times slower under
valgrind, so the rate is low enough for it to keep up: at a fleet's rate a pass takes more
messages, and a batch costs fewer instructions than here. Needs valgrind (skipped without).
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import trio

import tskv.shells._reader_process as reader_process
from benchmarks.fleet import publish_workers, router_cpu
from benchmarks.helpers import child, median_of_runs, runs_said
from benchmarks.rounds import BLOCK
from tskv.core.prefix_index import PrefixIndex
from tskv.shells.watcher import open_watcher

WORKERS = 16
RATE = 10  # rounds a second
WINDOW = 20.0  # seconds counted
WARM = 3.0  # seconds after every worker is current, before the count begins
# where the instructions ran, by the object file callgrind names
PLACES = [
    ("interpreter", "libpython"),
    ("compiled core", "_compiled"),
    ("pyzmq", "zmq/backend"),
    ("libzmq", "libzmq"),
    ("libc", "libc.so"),
]


def reader_section(out: Callable[[str], None], reps: int) -> None:
    """Each path's figures the median of `reps` runs: callgrind counts instructions exactly,
    but a live stream's batches differ from run to run in how many events they carry."""
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        out("\n## A reader process's instructions a batch: skipped, valgrind is not installed")
        return
    out(
        f"\n## A reader process's instructions a batch (callgrind; {WORKERS} workers, "
        f"{RATE} small rounds/s, {WINDOW:.0f} s; {runs_said(reps)})\n"
    )
    out("| path | instructions a batch | " + " | ".join(name for name, _ in PLACES) + " |")
    out("|---|---|" + "---|" * len(PLACES))
    for path, pure in (("compiled", False), ("pure Python", True)):
        per_batch, shares = median_of_runs(reps, reader_instructions, pure)
        cells = " | ".join(f"{shares.get(name, 0.0):.0%}" for name, _ in PLACES)
        out(f"| {path} | {per_batch / 1000:.0f}k | {cells} |")


def reader_instructions(pure: bool) -> tuple[float, dict[str, float]]:
    """Instructions a batch in the reader process, and the share of each place in PLACES."""
    with tempfile.TemporaryDirectory() as folder, _under_callgrind(folder, pure):
        # with a cache (of one round) the publishers go on until told to stop
        with child(publish_workers, WORKERS, 1, RATE, 1, None) as publishers:
            endpoints = publishers.recv()
            batches = trio.run(_count, endpoints, publishers)
            publishers.send("stop")
            publishers.recv()  # what they published
            publishers.send("done")
        dumps = glob.glob(f"{folder}/callgrind.*.1")
        assert len(dumps) == 1, dumps
        total, shares = _split(dumps[0])
    return total / batches, shares


async def _count(endpoints: list[tuple[str, str]], publishers: Any) -> int:
    async with open_watcher(PrefixIndex(BLOCK), processes=1) as watcher:
        for rank, (endpoint, replay) in enumerate(endpoints):
            watcher.add(rank, endpoint, replay)
        publishers.send(1)  # one subscriber on each worker: the rounds begin once it is in
        for rank in range(len(endpoints)):
            await watcher.wait_for_seq(rank, 0)
        await trio.sleep(WARM)
        pid = watcher.readers[0].pid
        await trio.run_process(["callgrind_control", "--zero", str(pid)], capture_stdout=True)
        before = router_cpu(watcher, len(endpoints))[2]  # batches applied so far
        await trio.sleep(WINDOW)
        await trio.run_process(["callgrind_control", "--dump", str(pid)], capture_stdout=True)
        return router_cpu(watcher, len(endpoints))[2] - before


@contextmanager
def _under_callgrind(folder: str, pure: bool) -> Iterator[None]:
    """Reader processes started meanwhile run under callgrind (and the pure path if `pure`)."""
    made = reader_process.Reader.__init__

    def wrapped(self: reader_process.Reader, *args: Any, **kwargs: Any) -> None:
        made(self, *args, **kwargs)
        out = f"--callgrind-out-file={folder}/callgrind.%p"
        self._command = ["valgrind", "--tool=callgrind", "--dump-instr=no", out, *self._command]

    saved = os.environ.get("TSKV_PURE_PYTHON")
    reader_process.Reader.__init__ = wrapped  # type: ignore[method-assign]
    if pure:
        os.environ["TSKV_PURE_PYTHON"] = "1"  # the reader's environment is this one's
    try:
        yield
    finally:
        reader_process.Reader.__init__ = made  # type: ignore[method-assign]
        os.environ.pop("TSKV_PURE_PYTHON", None)
        if saved is not None:
            os.environ["TSKV_PURE_PYTHON"] = saved


def _split(dump: str) -> tuple[int, dict[str, float]]:
    """The dump's instructions, and each place's share of them (its functions' own)."""
    listed = subprocess.run(
        ["callgrind_annotate", "--auto=no", "--threshold=100", dump],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    totals = re.search(r"([\d,]+) \(100\.0%\)\s+PROGRAM TOTALS", listed)
    assert totals is not None, listed[:2000]
    total = int(totals[1].replace(",", ""))
    # A dump made while the process runs lists each frame then on the stack (main, the
    # interpreter's entry) with about the whole count as its own: those are left out.
    places: dict[str, int] = {}
    counted = 0
    for figure, where in re.findall(r"^\s*([\d,]+) \([\s\d.]+%\)\s+(\S.*)$", listed, re.M):
        count = int(figure.replace(",", ""))
        if count > total / 2:
            continue
        counted += count
        for name, part in PLACES:
            if part in where:
                places[name] = places.get(name, 0) + count
                break
    return total, {name: count / counted for name, count in places.items()}
