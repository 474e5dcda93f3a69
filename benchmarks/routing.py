"""The router's decision per request on a Mooncake trace: the index's match, then the
load-aware policy (and the speculative entry it records), at 8 and 64 workers.

The workers' caches are filled the way the trace demo fills them (each request served where
the policy sends it, its events applied to the index as they come), so the index holds what a
router in front of that fleet holds. The timed loop is the router's own work per request: the
match on the request's token ids, the queued-work map it hands the policy, the choice, and the
prediction; the token ids themselves come from the tokenizer, before the router.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.helpers import percentile
from tskv.core.prefix_index import PrefixIndex, Worker
from tskv.core.routing import LoadAwarePolicy
from tskv.sim.trace import TraceRequest, read_trace
from tskv.sim.trace_fleet import TraceWorker

TRACE = Path("tests/traces/mooncake_synthetic_trace.jsonl")  # the whole trace, in the clone
BLOCK = 64
CACHE_TOKENS = 3_000_000
PREFILL_RATE = 5_000.0


def _decisions(requests: list[TraceRequest], workers: int, predict: bool) -> dict[str, list[float]]:
    now = 0.0
    index = PrefixIndex(BLOCK, clock=lambda: now)
    policy = LoadAwarePolicy()
    fleet = [TraceWorker(CACHE_TOKENS, BLOCK, PREFILL_RATE) for _ in range(workers)]
    matches: list[float] = []
    decisions: list[float] = []
    for request in requests:
        now = request.timestamp_ms / 1000
        tokens = request.token_ids()
        started = time.perf_counter()
        match = index.match(tokens)
        matched = time.perf_counter()
        queued: dict[Worker, float] = {rank: w.queued(now) for rank, w in enumerate(fleet)}
        worker = policy.choose(match, len(tokens), queued, workers=queued).worker
        if predict:
            index.predict(worker, tokens, 10.0)
        decided = time.perf_counter()
        matches.append(matched - started)
        decisions.append(decided - started)
        assert isinstance(worker, int)
        index.apply(worker, fleet[worker].serve(request, now).events)  # not the router's cost
    return {"match": matches, "decision": decisions}


def routing_section(out: Callable[[str], None], reps: int) -> None:
    """The trace replayed `reps` times a row, its requests' times pooled for the percentiles."""
    out("\n## The router's decision per request (match + LoadAwarePolicy), Mooncake trace\n")
    trace = TRACE
    requests = read_trace(trace)
    out(f"{len(requests):,} requests of {trace}, block size {BLOCK}, µs per request\n")
    out(
        "| workers | predictions | match p50 / p99 | decision p50 / p99 | "
        "decision mean | decision ÷ match (p50) |"
    )
    out("|---|---|---|---|---|---|")
    for workers in (8, 64):
        for predict in (False, True):
            runs = [_decisions(requests, workers, predict) for _ in range(reps)]
            match = [each for times in runs for each in times["match"]]
            decision = [each for times in runs for each in times["decision"]]
            p50m, p99m = percentile(match, 0.5) * 1e6, percentile(match, 0.99) * 1e6
            p50d, p99d = percentile(decision, 0.5) * 1e6, percentile(decision, 0.99) * 1e6
            out(
                f"| {workers} | {'yes' if predict else 'no'} | {p50m:.0f} / {p99m:.0f} | "
                f"{p50d:.0f} / {p99d:.0f} | {statistics.mean(decision) * 1e6:.0f} | "
                f"{p50d / p50m:.2f} |"
            )
