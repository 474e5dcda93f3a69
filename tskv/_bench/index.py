"""TODO"""

from __future__ import annotations

import gc
import json
import random
import time
import tracemalloc
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any

from tskv._bench.fleet import watch_scale
from tskv._bench.processes import in_fresh_process, percentile
from tskv._bench.rounds import BLOCK
from tskv.core.events import BlockRemoved, BlockStored, KVEvent
from tskv.core.prefix_index import PrefixIndex

WORKERS = 64


PREFIXES = 256  # shared prompt prefixes (system prompts): what makes routing worth it


def dynamo() -> Any | None:
    try:
        import dynamo.llm as llm  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        return None
    return llm


def _prefixes() -> list[list[int]]:
    """The shared prompt prefixes' token ids: the same for the events and the queries."""
    rng = random.Random(0)
    return [[rng.randrange(1000, 150_000) for _ in range(4 * BLOCK)] for _ in range(PREFIXES)]


def stored_events(blocks: int, seed: int = 0) -> Iterator[tuple[int, BlockStored]]:
    """(worker, event) pairs that cache `blocks` blocks across WORKERS workers: chains of 4
    blocks each, every chain under one of PREFIXES shared 4-block prefixes, with fresh token
    lists (ids above 256, as real ones are). The engine's hashes follow the content, as vLLM's
    and TokenSpeed's do: a shared prefix has the same hashes on every worker."""
    rng = random.Random(seed + 1)
    prefixes = _prefixes()
    made = 0
    hash_counter = 1
    stored_prefix: set[tuple[int, int]] = set()
    while made < blocks:
        worker = rng.randrange(WORKERS)
        prefix = rng.randrange(PREFIXES)
        if (worker, prefix) not in stored_prefix:
            stored_prefix.add((worker, prefix))
            hashes = [prefix * 4 + i for i in range(4)]
            yield worker, BlockStored(hashes, None, list(prefixes[prefix]), BLOCK)
            parent = hashes[-1]
        else:
            parent = prefix * 4 + 3
        tokens = [rng.randrange(1000, 150_000) for _ in range(4 * BLOCK)]
        hashes = [(1 << 62) + hash_counter + i for i in range(4)]
        hash_counter += 4
        yield worker, BlockStored(hashes, parent, tokens, BLOCK)
        made += 8


def queries(count: int, seed: int = 1) -> list[list[int]]:
    """Requests: a shared prefix (often cached) then new tokens, 8 to 32 blocks long."""
    prefixes = _prefixes()
    ask = random.Random(seed)
    return [
        prefixes[ask.randrange(PREFIXES)]
        + [ask.randrange(1000, 150_000) for _ in range(ask.randrange(4, 28) * BLOCK)]
        for _ in range(count)
    ]


class TskvSide:
    name = "tskv PrefixIndex"

    def __init__(self) -> None:
        self.index = PrefixIndex(BLOCK)

    def apply(self, worker: int, event: KVEvent) -> None:
        self.index.apply(worker, (event,))

    def match(self, tokens: list[int]) -> Any:
        return self.index.match(tokens)


class DynamoSide:
    name = "Dynamo RadixTree"

    def __init__(self, llm: Any) -> None:
        self.tree = llm.RadixTree()
        self.hash_tokens = llm.compute_block_hash_for_seq
        self.event_id = 0

    def apply(self, worker: int, event: KVEvent) -> None:
        self.event_id += 1
        if isinstance(event, BlockStored):
            local = self.hash_tokens(event.token_ids, BLOCK)
            blocks = [
                {"block_hash": h, "tokens_hash": t}
                for h, t in zip(event.block_hashes, local, strict=True)
            ]
            data: dict[str, Any] = {
                "stored": {"parent_hash": event.parent_block_hash, "blocks": blocks}
            }
        elif isinstance(event, BlockRemoved):
            data = {"removed": {"block_hashes": list(event.block_hashes)}}
        else:
            data = {"cleared": None}
        self.tree.apply_event(
            worker, json.dumps({"event_id": self.event_id, "data": data}).encode()
        )

    def match(self, tokens: list[int]) -> Any:
        return self.tree.find_matches(self.hash_tokens(tokens, BLOCK))


def _measure_side(make: Callable[[], Any], blocks: int) -> dict[str, float]:
    side = make()
    events = list(stored_events(blocks))
    gc.collect()
    started = time.perf_counter()
    for worker, event in events:
        side.apply(worker, event)
    applied = time.perf_counter() - started
    asks = queries(1000)
    latencies = []
    matched = 0
    for tokens in asks:
        began = time.perf_counter()
        result = side.match(tokens)
        latencies.append(time.perf_counter() - began)
        matched += bool(len(result.scores) if hasattr(result, "scores") else len(result))
    return {
        "events_per_s": len(events) / applied,
        "blocks_per_s": 4 * len(events) / applied,
        "p50_us": percentile(latencies, 0.5) * 1e6,
        "p99_us": percentile(latencies, 0.99) * 1e6,
        "matched": matched,
    }


def _index_memory(blocks: int, conn: Connection) -> None:
    events = list(stored_events(blocks))
    tracemalloc.start()
    index = PrefixIndex(BLOCK)
    before = tracemalloc.get_traced_memory()[0]
    for worker, event in events:
        index.apply(worker, (event,))
    gc.collect()
    conn.send((tracemalloc.get_traced_memory()[0] - before) / blocks)


def index_section(out: Callable[[str], None]) -> None:
    llm = dynamo()
    out(
        "\n## The prefix index beside Dynamo's RadixTree "
        "(64 workers, as a Python caller sees them)\n"
    )
    if llm is None:
        out("Dynamo is not installed (pip install ai-dynamo-runtime): its columns are skipped.\n")
    out(
        "| cached blocks | tskv events/s | Dynamo events/s | × Dynamo | tskv query p50 / p99 | "
        "Dynamo query p50 / p99 | × Dynamo (p50) |"
    )
    out("|---|---|---|---|---|---|---|")
    for blocks in (1_000, 100_000, 1_000_000):
        ours = _measure_side(TskvSide, blocks)
        theirs = _measure_side(lambda: DynamoSide(llm), blocks) if llm is not None else None
        gc.collect()
        if theirs is None:
            out(
                f"| {blocks:,} | {ours['events_per_s']:,.0f} | n/a | n/a | "
                f"{ours['p50_us']:.1f} / {ours['p99_us']:.1f} µs | n/a | n/a |"
            )
            continue
        out(
            f"| {blocks:,} | {ours['events_per_s']:,.0f} | {theirs['events_per_s']:,.0f} | "
            f"{ours['events_per_s'] / theirs['events_per_s']:.2f} | "
            f"{ours['p50_us']:.1f} / {ours['p99_us']:.1f} µs | "
            f"{theirs['p50_us']:.1f} / {theirs['p99_us']:.1f} µs | "
            f"{ours['p50_us'] / theirs['p50_us']:.2f} |"
        )
    per_block = in_fresh_process(_index_memory, 100_000)
    out(f"\nIndex memory (tracemalloc, 100,000 blocks, 64 workers): {per_block:,.0f} B per block")
    out("\n## One watcher process keeping the index current (small rounds, 200/s per worker)\n")
    out(
        "| workers | routers | workers behind at the end | losses | publisher rounds late | "
        "router CPU per batch | workers one core keeps at 200 rounds/s |"
    )
    out("|---|---|---|---|---|---|---|")
    for workers, routers in ((16, 1), (32, 1), (64, 1), (16, 3)):
        result = watch_scale(workers, routers)
        capacity = 1e6 / result["cpu_us"] / 200
        out(
            f"| {workers} | {routers} | {result['behind']} | {result['losses']} | "
            f"{result['late_rounds']} of {result['rounds']} | {result['cpu_us']:.0f} µs | "
            f"{capacity:.0f} |"
        )
