"""How many workers one router keeps current: publisher processes with many workers each
publishing small rounds, and routers (each a watcher over every worker) in processes of their
own, every worker's last seq and losses compared at the end."""

from __future__ import annotations

import time
from contextlib import ExitStack
from multiprocessing.connection import Connection
from typing import Any

import trio
import trio.testing

from tskv._bench.processes import child
from tskv._bench.rounds import BLOCK, churn_maker
from tskv.core.config import KVEventsConfig
from tskv.core.endpoints import LOOPBACK
from tskv.core.prefix_index import PrefixIndex
from tskv.shells.publisher import open_publisher
from tskv.shells.watcher import open_watcher

WORKERS = 64


def _publish_workers(workers: int, seconds: float, conn: Connection) -> None:
    """`workers` publishers in this process, each a small round (10 events of 4 blocks, the
    oldest removed once 4,000 are cached) 200 times a second."""

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
