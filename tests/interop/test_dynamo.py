"""Dynamo's own consumers read tskv's stream on both wires (where Dynamo installs: Linux x86-64).

`ai-dynamo-runtime` (1.6.1, about 75 MB) brings `python -m dynamo.indexer`, Dynamo's standalone
ZMQ indexer (it subscribes to a worker's endpoint, replays from its replay endpoint, keeps a
radix tree and serves it over HTTP), and the `RadixTree` bindings its router uses. `nox -s
tests` installs it where it can; elsewhere every test here is skipped with one line saying why.

What is checked: the indexer's tree equals the simulated scheduler's cache when it joins before
the first batch, and when it is registered late (over HTTP, as an operator does), so that it
must replay everything from seq 0 through tskv's replay endpoint and read the end marker as
every client of vLLM's protocol does (an empty payload); and a `RadixTree` fed tskv's decoded
stream answers every prompt as tskv's own `PrefixIndex` does.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

import tskv
from tests.interop.dynamo_indexer import Indexer, dump, http
from tests.zmq_helpers import LOOPBACK
from tskv import BlockStored
from tskv.core.wire_format import WireFormat
from tskv.sim import CacheView, Simulator, Workload, run_round
from tskv.sim.dynamo_events import dynamo_event

llm = pytest.importorskip(
    "dynamo.llm", reason="Dynamo is not installed here (pip install ai-dynamo-runtime)"
)

BLOCK_SIZE = 16
WIRES = [("tokenspeed", None, "device"), ("vllm", "GPU", "device"), ("vllm", "CPU", "host_pinned")]


async def publish_rounds(
    publisher: tskv.Publisher, sim: Simulator, workload: Workload, view: CacheView, rounds: int
) -> None:
    for _ in range(rounds):
        events = run_round(sim, workload, 2)
        if events:
            view.apply(publisher.statistics().accepted, events)
            await publisher.publish(events)


@pytest.mark.parametrize(("wire_format", "medium", "tier"), WIRES)
async def test_dynamo_indexer_rebuilds_the_cache(
    wire_format: WireFormat, medium: str | None, tier: str, tmp_path: Path
) -> None:
    config = tskv.KVEventsConfig(endpoint=LOOPBACK, wire_format=wire_format)
    async with tskv.open_publisher(config) as publisher:
        before = publisher.statistics().subscriptions
        workers = ["--block-size", str(BLOCK_SIZE), "--workers", f"1={publisher.endpoint}"]
        async with Indexer(tmp_path / "indexer.log", *workers) as indexer:
            with trio.fail_after(30):
                await publisher.wait_for_subscriber(before + 1)
            sim, workload, view = (
                Simulator(512, BLOCK_SIZE, medium=medium),
                Workload(3, BLOCK_SIZE),
                CacheView(),
            )
            await publish_rounds(publisher, sim, workload, view, 400)
            held = await indexer.holds(view.blocks)
            assert held == view.blocks == sim.cached_hashes()
            assert {event["storage_tier"] for event in dump(indexer.port)} == {tier}


@pytest.mark.parametrize(("wire_format", "medium", "tier"), WIRES[:2])
async def test_dynamo_indexer_registered_late_replays_from_seq_0_and_holds_the_cache(
    wire_format: WireFormat, medium: str | None, tier: str, tmp_path: Path
) -> None:
    """Registered after 300 rounds, the indexer sees seq 300 live and asks replay for 0..299;
    it must read tskv's end marker as the end (an empty payload) and decode every batch."""
    config = tskv.KVEventsConfig(
        endpoint=LOOPBACK, replay_endpoint=LOOPBACK, wire_format=wire_format
    )
    async with tskv.open_publisher(config) as publisher:
        sim, workload, view = (
            Simulator(512, BLOCK_SIZE, medium=medium),
            Workload(5, BLOCK_SIZE),
            CacheView(),
        )
        await publish_rounds(publisher, sim, workload, view, 300)
        async with Indexer(tmp_path / "indexer.log") as indexer:
            before = publisher.statistics().subscriptions
            registration = {
                "instance_id": 7,
                "endpoint": publisher.endpoint,
                "replay_endpoint": publisher.replay_endpoint,
                "block_size": BLOCK_SIZE,
                "model_name": "late",
            }
            await trio.to_thread.run_sync(http, indexer.port, "/register", registration)
            with trio.fail_after(30):
                await publisher.wait_for_subscriber(before + 1)
            await publish_rounds(publisher, sim, workload, view, 20)
            held = await indexer.holds(view.blocks)
            log = indexer.log.read_text(errors="replace")
    assert "Failed to decode replayed batch" not in log
    assert "Replay complete" in log, log[-2000:]
    assert held == view.blocks == sim.cached_hashes()


@pytest.mark.parametrize("wire_format", ["tokenspeed", "vllm"])
async def test_dynamos_radix_tree_fed_tskvs_stream_answers_as_the_prefix_index_does(
    wire_format: WireFormat,
) -> None:
    config = tskv.KVEventsConfig(
        endpoint=LOOPBACK, replay_endpoint=LOOPBACK, wire_format=wire_format
    )
    tree, index = llm.RadixTree(), tskv.PrefixIndex(BLOCK_SIZE)
    prompts: list[list[int]] = []
    event_ids = iter(range(1, 10**9))
    async with trio.open_nursery() as nursery:
        publishers = [await nursery.start(_worker, config, worker, prompts) for worker in (1, 2)]
        for worker, (publisher, done) in enumerate(publishers, start=1):
            async with tskv.open_subscriber(
                publisher.endpoint, publisher.replay_endpoint, start_seq=0
            ) as sub:
                async for _, batch in sub:
                    for event in batch.events:
                        local = (
                            llm.compute_block_hash_for_seq(list(event.token_ids), event.block_size)
                            if isinstance(event, BlockStored)
                            else ()
                        )
                        tree.apply_event(worker, dynamo_event(next(event_ids), event, local))
                    index.apply(worker, batch)
                    if sub.statistics().delivered == publisher.statistics().accepted:
                        break
            done.set()
    agreed = 0
    for prompt in prompts:
        theirs = {
            worker: blocks
            for (worker, _), blocks in tree.find_matches(
                llm.compute_block_hash_for_seq(prompt, BLOCK_SIZE)
            ).scores.items()
        }
        ours = dict(index.match(prompt))
        assert theirs == ours, prompt[:8]
        agreed += bool(ours)
    assert agreed > len(prompts) // 4  # the prompts share prefixes: most match somewhere


async def _worker(
    config: tskv.KVEventsConfig,
    seed: int,
    prompts: list[list[int]],
    task_status: trio.TaskStatus[tuple[tskv.Publisher, trio.Event]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """A simulated worker that publishes 150 rounds, then stays up until its stream was read."""
    async with tskv.open_publisher(config) as publisher:
        sim, workload = Simulator(256, BLOCK_SIZE), Workload(seed, BLOCK_SIZE, prompts=prompts)
        for _ in range(150):
            events = run_round(sim, workload, 1)
            if events:
                await publisher.publish(events)
        done = trio.Event()
        task_status.started((publisher, done))
        await done.wait()
