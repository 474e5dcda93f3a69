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
import json
import os
import platform
import sys
import time

import zmq

import tskv
from benchmarks.latency import latency_section, shutdown_section
from benchmarks.memory import memory_section
from benchmarks.report import child_figures, measure, report
from benchmarks.rounds import msgspec
from benchmarks.routing import routing_section
from benchmarks.snapshots import snapshots_section

SECTIONS = [
    "build",
    "decode",
    "subscriber",
    "capacity",
    "latency",
    "shutdown",
    "memory",
    "snapshots",
    "index",
    "fleet",
    "reader",
    "receive",
    "routing",
    "failures",
    "service",
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("--reps", type=int, default=3, help="repetitions per figure (3)")
    parser.add_argument("--only", choices=SECTIONS, action="append", help="only these sections")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # for the child
    args = parser.parse_args(argv)
    sections = args.only or SECTIONS
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
    measured = measure(sections, args.reps)
    comparable = [s for s in ("build", "decode", "capacity") if s in sections]
    plain = child_figures(comparable) if msgspec is not None and comparable else {}
    report(measured, plain, out)
    if "latency" in sections:
        latency_section(out)
    if "shutdown" in sections:
        shutdown_section(out)
    if "memory" in sections:
        memory_section(out)
    if "snapshots" in sections:
        snapshots_section(args.reps, out)
    if "routing" in sections:
        routing_section(out)
    if "index" in sections:
        from benchmarks.index import index_section

        index_section(out)
    if "fleet" in sections:
        from benchmarks.index import fleet_section

        fleet_section(out)
    if "reader" in sections:
        from benchmarks.reader_cost import reader_section

        reader_section(out)
    if "receive" in sections:
        from benchmarks.receive_cost import receive_section

        receive_section(out)
    if "failures" in sections:
        from benchmarks.failures import failures_section

        failures_section(out)
    if "service" in sections:
        from benchmarks.service import service_section

        service_section(out)
    out(f"\n(benchmark took {time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
