"""The prefix index's benchmark section (`python -m tskv.bench --only index`).

Beside Dynamo's `RadixTree` (Rust, through its Python bindings, `pip install ai-dynamo-runtime`)
in the same run, as a Python router sees both: the router holds decoded `BlockStored` events;
for Dynamo it must also hash each block's tokens (`compute_block_hash_for_seq`, Rust) and hand
over Dynamo's JSON event, and a query hashes the request's tokens before `find_matches`. Both
sides get the same events and the same queries; what each side must do to them is timed.

Also: how many workers, each publishing small rounds at 200 a second, one process keeps current
with the index applied and nothing lost; and several routers watching the same workers.
"""

from __future__ import annotations

import gc
import json
import random
import time
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from multiprocessing.connection import Connection
from typing import Any

import trio

from tskv.config import KVEventsConfig
from tskv.endpoints import LOOPBACK
from tskv.events import BlockRemoved, BlockStored, KVEvent
from tskv.prefix_index import PrefixIndex
from tskv.publisher import open_publisher
from tskv.watcher import open_watcher

WORKERS = 64
BLOCK = 16
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
    latencies.sort()
    return {
        "events_per_s": len(events) / applied,
        "blocks_per_s": 4 * len(events) / applied,
        "p50_us": latencies[len(latencies) // 2] * 1e6,
        "p99_us": latencies[int(0.99 * len(latencies))] * 1e6,
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


# -- the watcher's sustained scale -------------------------------------------------------------


def _publish_workers(workers: int, seconds: float, conn: Connection) -> None:
    """`workers` publishers in this process, each a small round (10 events of 4 blocks, the
    oldest removed once 4,000 are cached) 200 times a second."""
    from tskv.bench import churn_maker

    async def main() -> None:
        config = KVEventsConfig(endpoint=LOOPBACK, replay_endpoint=LOOPBACK)
        async with trio.open_nursery() as nursery:
            publishers = []
            for rank in range(workers):
                publishers.append(await nursery.start(_one_worker, config, rank))
            conn.send([(p.endpoint, p.replay_endpoint) for p in publishers])
            conn.recv()  # the routers are subscribed
            makers = [churn_maker("small") for _ in publishers]
            next_round = trio.current_time()
            late = 0
            for _ in range(int(seconds * 200)):
                for publisher, make in zip(publishers, makers, strict=True):
                    await publisher.publish(make())
                next_round += 1 / 200
                if trio.current_time() > next_round:
                    late += 1
                await trio.sleep_until(next_round)
            conn.send(([p.statistics().accepted for p in publishers], late))
            for publisher, make in zip(publishers, makers, strict=True):
                await publisher.publish(make())  # so a gap at the very end is noticed
            conn.recv()
            nursery.cancel_scope.cancel()

    trio.run(main)


async def _one_worker(config: KVEventsConfig, rank: int, task_status: Any) -> None:
    async with open_publisher(config, rank) as publisher:
        task_status.started(publisher)
        await trio.sleep_forever()


def _router(endpoints: list[tuple[str, str]], conn: Connection) -> None:
    """One router: a watcher over every worker; reports each worker's last seq and losses."""

    async def main() -> None:
        index = PrefixIndex(BLOCK)
        async with open_watcher(index) as watcher:
            for rank, (endpoint, replay) in enumerate(endpoints):
                watcher.add(rank, endpoint, replay)
            conn.send("ready")
            cpu = time.process_time()
            wanted = await trio.to_thread.run_sync(conn.recv)
            with trio.move_on_after(20):
                for rank, last in enumerate(wanted):
                    await watcher.wait_for_seq(rank, last - 1)
            cpu = time.process_time() - cpu
            statuses = [watcher.status(rank) for rank in range(len(endpoints))]
            applied = sum(status.batches for status in statuses)
            conn.send(([(s.last_seq, s.losses) for s in statuses], cpu / max(applied, 1)))

    trio.run(main)


def watch_scale(workers: int, routers: int, seconds: float = 5.0) -> dict[str, Any]:
    from tskv.bench import child

    with child(_publish_workers, workers, seconds) as publishers:
        endpoints = publishers.recv()
        with ExitStack() as stack:
            conns = [stack.enter_context(child(_router, endpoints)) for _ in range(routers)]
            for conn in conns:
                assert conn.recv() == "ready"
            time.sleep(1.0)  # the watchers' snapshot bootstraps and subscriptions settle
            publishers.send("go")
            accepted, late = publishers.recv()
            for conn in conns:
                conn.send(accepted)
            answers = [conn.recv() for conn in conns]
        publishers.send("done")
    reports = [report for report, _ in answers]
    cpu_per_batch = max(cpu for _, cpu in answers)
    behind = sum(
        1
        for report in reports
        for (last, _), want in zip(report, accepted, strict=True)
        if last is None or last < want - 1
    )
    # The bootstrap's snapshot of an empty stream reports nothing; any loss is a real one.
    losses = sum(lost for report in reports for _, lost in report)
    return {
        "behind": behind,
        "losses": losses,
        "late_rounds": late,
        "rounds": int(seconds * 200),
        "cpu_us": cpu_per_batch * 1e6,
    }


def index_section(out: Callable[[str], None]) -> None:
    from tskv.bench import in_fresh_process

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
