"""`python -m benchmarks` (`nox -s bench`, `tskv bench`): what a scheduler and a router
really pay.

Every figure is set beside references measured in the same run, on the loop users really run:
a scheduler builds new event objects every round (from the block hashes and token lists its
cache already holds) and a router decodes every batch it receives. The references:

- TokenSpeed's way: msgspec Structs, array-like and tagged as TokenSpeed's events are, built
  every round, and msgspec's encoder; on the consumer side, msgspec's typed decoder into Structs.
- the ceiling: a plain pyzmq PUB sending pre-encoded payloads (no encoding, no queue, no Trio).
- the baseline: the conventional threaded publisher TokenSpeed and vLLM ship (queue.Queue, a
  thread, msgspec, blocking pyzmq), building its Structs every round.

Machines here are shared and noisy: each figure is the median of several alternating
repetitions, with the spread. The figures without msgspec come from a child process started with
TSKV_CODEC=msgpack, so they are what a machine without msgspec runs. This is not a test: nothing
here passes or fails.
"""

from __future__ import annotations

import argparse
import compileall
import importlib
import json
import os
import platform
import sys
import time
from collections.abc import Callable

import zmq

import tskv
from benchmarks.latency import latency_section, shutdown_section
from benchmarks.memory import memory_section
from benchmarks.report import child_figures, measure, report
from benchmarks.rounds import msgspec
from benchmarks.routing import routing_section
from benchmarks.snapshots import snapshots_section

Out = Callable[[str], None]
Section = Callable[[Out, int], None]  # prints its tables; `reps`: repetitions per figure


def _measured(name: str) -> Section:
    """A section with a twin measured without msgspec, in a child that never imports it."""

    def section(out: Out, reps: int) -> None:
        twin = msgspec is not None and name in ("build", "decode", "capacity")
        report(measure([name], reps), child_figures([name], reps) if twin else {}, out)

    return section


def _later(module: str, name: str) -> Section:
    """A section imported only when it runs: its module brings peers (Dynamo, valgrind's
    tools) that the others do not need."""

    def section(out: Out, reps: int) -> None:
        run: Section = getattr(importlib.import_module(module), name)
        run(out, reps)

    return section


SECTIONS: dict[str, Section] = {
    "build": _measured("build"),
    "decode": _measured("decode"),
    "instructions": _later("benchmarks.codec_costs", "instructions_section"),
    "subscriber": _measured("subscriber"),
    "capacity": _measured("capacity"),
    "latency": latency_section,
    "shutdown": shutdown_section,
    "memory": memory_section,
    "snapshots": snapshots_section,
    "index": _later("benchmarks.index", "index_section"),
    "fleet": _later("benchmarks.index", "fleet_section"),
    "reader": _later("benchmarks.reader_cost", "reader_section"),
    "receive": _later("benchmarks.receive_cost", "receive_section"),
    "routing": routing_section,
    "failures": _later("benchmarks.failures", "failures_section"),
    "service": _later("benchmarks.service", "service_section"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("--reps", type=int, default=3, help="repetitions per figure (3)")
    parser.add_argument("--only", choices=list(SECTIONS), action="append", help="only these")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # for the child
    args = parser.parse_args(argv)
    sections = args.only or list(SECTIONS)
    if args.json:  # the no-msgspec child: its parent compiled tskv already
        print(json.dumps(measure(sections, args.reps)))
        return 0
    # Reader processes and children import tskv afresh: with PYTHONDONTWRITEBYTECODE set and
    # an editable install, each compiled its modules at start (0.25 s of CPU here, counted in
    # the fleet's bootstrap), which a pip-installed package, byte-compiled on install, never does.
    compileall.compile_dir(os.path.dirname(tskv.__file__), quiet=1)

    def out(line: str) -> None:
        print(line, flush=True)

    encoders = "msgspec and msgpack" if msgspec is not None else "msgpack only"
    out(f"# tskv {tskv.__version__} benchmark, {time.strftime('%Y-%m-%d %H:%M')}")
    out(
        f"\n{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"pyzmq {zmq.pyzmq_version()} (libzmq {zmq.zmq_version()}), encoders: {encoders}"
    )
    started = time.monotonic()
    for name in SECTIONS:  # in the table's order, whatever order --only named them in
        if name in sections:
            SECTIONS[name](out, args.reps)
    out(f"\n(benchmark took {time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
