"""Simulated schedulers, one per data-parallel rank, publishing every round through tskv.

`tskv demo` and `tskv simulate` both run these; what they do around them differs.
"""

from __future__ import annotations

import math
import time

import attrs
import trio

from tskv.core.wire_format import WireFormat
from tskv.shells.publisher import Publisher
from tskv.sim.simulator import Simulator, Workload, run_round


@attrs.frozen
class SimOptions:
    """How the simulated schedulers run; the CLI's flags map onto these one to one."""

    rounds: int | None = 300
    duration: float | None = None
    requests_per_round: int = 2
    block_size: int = 16
    cache_blocks: int = 512
    ranks: int = 1
    seed: int = 0
    round_interval: float = 0.01  # seconds between rounds: a decode step's order of magnitude
    medium: str | None = None  # the storage tier every event names (needs the vLLM wire)
    wire_format: WireFormat = "tokenspeed"


@attrs.define
class _Rank:
    """One simulated DP rank: its cache, its workload, its publisher and what it published."""

    sim: Simulator
    workload: Workload
    publisher: Publisher
    batches: int = 0
    events: int = 0


class SchedulerLoop:
    """Runs every rank's simulator round by round and publishes what each round emits."""

    def __init__(self, options: SimOptions, publishers: list[Publisher]) -> None:
        self.options = options
        self.rounds = 0
        self.round_done = trio.lowlevel.ParkingLot()  # unparked after every round
        self.ranks = [
            _Rank(
                Simulator(options.cache_blocks, options.block_size, medium=options.medium),
                Workload(options.seed + rank, options.block_size),
                publisher,
            )
            for rank, publisher in enumerate(publishers)
        ]

    def _done(self, started: float) -> bool:
        if self.options.rounds is not None and self.rounds >= self.options.rounds:
            return True
        return self.options.duration is not None and time.monotonic() - started >= (
            self.options.duration
        )

    async def run(self) -> None:
        started = time.monotonic()
        next_round = trio.current_time()
        while not self._done(started):
            for rank in self.ranks:
                events = run_round(rank.sim, rank.workload, self.options.requests_per_round)
                if events:
                    await rank.publisher.publish(events)
                    rank.batches += 1
                    rank.events += len(events)
            self.rounds += 1
            self.round_done.unpark_all()
            next_round += self.options.round_interval
            await trio.sleep_until(next_round)  # a steady pace, not drifting with the work

    @property
    def hit_rate(self) -> float:
        hits = sum(rank.sim.cache.hits for rank in self.ranks)
        total = hits + sum(rank.sim.cache.misses for rank in self.ranks)
        return hits / total if total else 0.0


def check_options(options: SimOptions) -> None:
    """Refuse options that cannot run, naming the flag."""
    problems = []
    if options.rounds is not None and options.rounds < 1:
        problems.append(f"--rounds {options.rounds}: must be at least 1")
    if options.duration is not None and not (
        math.isfinite(options.duration) and options.duration > 0
    ):
        problems.append(f"--duration {options.duration}: must be a positive number of seconds")
    for flag, value, lowest in [
        ("--requests-per-round", options.requests_per_round, 0),
        ("--block-size", options.block_size, 1),
        ("--cache-blocks", options.cache_blocks, 1),
        ("--ranks", options.ranks, 1),
    ]:
        if value < lowest:
            problems.append(f"{flag} {value}: must be at least {lowest}")
    if problems:
        raise ValueError("; ".join(problems))
