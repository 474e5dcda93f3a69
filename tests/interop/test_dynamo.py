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

import json
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import trio

import tskv
from tests.zmq_helpers import LOOPBACK
from tskv import BlockRemoved, BlockStored, KVEvent
from tskv.core.wire_format import WireFormat
from tskv.sim import CacheView, Simulator, Workload, run_round

llm = pytest.importorskip(
    "dynamo.llm", reason="Dynamo is not installed here (pip install ai-dynamo-runtime)"
)

BLOCK_SIZE = 16
WIRES = [("tokenspeed", None, "device"), ("vllm", "GPU", "device"), ("vllm", "CPU", "host_pinned")]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def http(port: int, path: str, body: dict[str, Any] | None = None) -> bytes:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data, {"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=5) as reply:
        answer: bytes = reply.read()
        return answer


def dump(port: int) -> list[dict[str, Any]]:
    try:
        trees: dict[str, Any] = json.loads(http(port, "/dump"))
    except OSError:  # its HTTP server is not up yet
        return []
    return [event for tree in trees.values() for event in tree["events"]]


def stored_hashes(events: list[dict[str, Any]]) -> set[int]:
    return {
        block["block_hash"]
        for event in events
        if "stored" in (data := event["event"]["data"])
        for block in data["stored"]["blocks"]
    }


class Indexer:
    """`python -m dynamo.indexer` on a loopback port, its log kept to read."""

    def __init__(self, log: Path, *flags: str) -> None:
        self.port = free_port()
        self.log = log
        self._flags = ["--port", str(self.port), "--threads", "1", *flags]
        self.process: trio.Process | None = None

    async def __aenter__(self) -> Indexer:
        with self.log.open("wb") as log:
            self.process = await trio.lowlevel.open_process(
                [sys.executable, "-m", "dynamo.indexer", *self._flags],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        with trio.fail_after(30):  # up when its health check answers
            while not await trio.to_thread.run_sync(self._healthy):  # noqa: ASYNC110
                await trio.sleep(0.1)
        return self

    def _healthy(self) -> bool:
        try:
            http(self.port, "/health")
        except OSError:
            return False
        return True

    async def __aexit__(self, *_: object) -> None:
        assert self.process is not None
        self.process.terminate()
        await self.process.wait()

    async def holds(self, blocks: set[int]) -> set[int]:
        """What its tree holds once it equals `blocks`, or after 30 s: its HTTP view has no
        "caught up" signal, so it is polled."""
        with trio.move_on_after(30):
            while stored_hashes(held := await trio.to_thread.run_sync(dump, self.port)) != blocks:  # noqa: ASYNC110
                await trio.sleep(0.1)
        return stored_hashes(held)


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


def dynamo_event(event_id: int, event: KVEvent) -> bytes:
    """A tskv event as Dynamo's router applies it: its blocks' local hashes from their tokens."""
    if isinstance(event, BlockStored):
        local = llm.compute_block_hash_for_seq(list(event.token_ids), event.block_size)
        blocks = [
            {"block_hash": block, "tokens_hash": tokens}
            for block, tokens in zip(event.block_hashes, local, strict=True)
        ]
        data: dict[str, Any] = {
            "stored": {"parent_hash": event.parent_block_hash, "blocks": blocks}
        }
    elif isinstance(event, BlockRemoved):
        data = {"removed": {"block_hashes": list(event.block_hashes)}}
    else:
        data = {"cleared": None}
    return json.dumps({"event_id": event_id, "data": data}).encode()


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
                        tree.apply_event(worker, dynamo_event(next(event_ids), event))
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
        sim, workload = Simulator(256, BLOCK_SIZE), Workload(seed, BLOCK_SIZE)
        asked = workload.next_request

        def next_request() -> Any:
            request, conversation = asked()
            prompts.append(list(request.prompt_ids))
            return request, conversation

        workload.next_request = next_request  # type: ignore[method-assign]
        for _ in range(150):
            events = run_round(sim, workload, 1)
            if events:
                await publisher.publish(events)
        done = trio.Event()
        task_status.started((publisher, done))
        await done.wait()
