"""Dynamo's own consumer reads tskv's stream on both wires (runs only where Dynamo is installed).

`pip install ai-dynamo-runtime` (about 75 MB, Linux x86-64) brings `dynamo.llm.run_kv_indexer`,
Dynamo's standalone ZMQ indexer: it subscribes to a worker's endpoint, keeps a radix tree and
serves it over HTTP. The test publishes a simulated scheduler's rounds and compares the blocks
Dynamo holds with the scheduler's cache. `nox -s bench` installs Dynamo; `nox -s tests` does not.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import urllib.request
from typing import Any

import pytest
import trio

import tskv
from tests.zmq_helpers import LOOPBACK
from tskv.core.wire_format import WireFormat
from tskv.sim import CacheView, Simulator, Workload, run_round

pytest.importorskip("dynamo.llm", reason="Dynamo is not installed (pip install ai-dynamo-runtime)")

BLOCK_SIZE = 16
RUN_INDEXER = "import sys, dynamo.llm as d; d.run_kv_indexer(sys.argv[1:])"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def dump(port: int) -> list[dict[str, Any]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/dump", timeout=5) as reply:
            trees: dict[str, Any] = json.loads(reply.read())
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


@pytest.mark.parametrize(
    ("wire_format", "medium", "tier"),
    [("tokenspeed", None, "device"), ("vllm", "GPU", "device"), ("vllm", "CPU", "host_pinned")],
)
async def test_dynamo_indexer_rebuilds_the_cache(
    wire_format: WireFormat, medium: str | None, tier: str
) -> None:
    config = tskv.KVEventsConfig(endpoint=LOOPBACK, wire_format=wire_format)
    port = free_port()
    async with tskv.open_publisher(config) as publisher:
        before = publisher.statistics().subscriptions
        indexer = await trio.lowlevel.open_process(
            [
                *[sys.executable, "-c", RUN_INDEXER],
                *["--block-size", str(BLOCK_SIZE), "--port", str(port), "--threads", "1"],
                *["--workers", f"1={publisher.endpoint}"],
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            with trio.fail_after(30):
                await publisher.wait_for_subscriber(before + 1)
            sim = Simulator(512, BLOCK_SIZE, medium=medium)
            workload = Workload(3, BLOCK_SIZE)
            view = CacheView()
            for seq in range(400):
                events = run_round(sim, workload, 2)
                await publisher.publish(events)
                view.apply(seq, events)
            # Dynamo's HTTP view has no "caught up" signal: poll it until it matches or time out.
            with trio.move_on_after(30):
                while stored_hashes(held := await trio.to_thread.run_sync(dump, port)) != (  # noqa: ASYNC110
                    view.blocks
                ):
                    await trio.sleep(0.1)
            assert stored_hashes(held) == view.blocks == sim.cached_hashes()
            assert {event["storage_tier"] for event in held} == {tier}
        finally:
            indexer.terminate()
            await indexer.wait()
