"""`tskv serve` drops in for Dynamo's standalone indexer: one client, the same requests, the same
tskv publishers, both services; the answers agree wherever Dynamo's is exact.

Dynamo's indexer (`python -m dynamo.indexer`, ai-dynamo-runtime 1.6.1) runs where its wheels
install (Linux x86-64: `nox -s tests` installs it); elsewhere the comparison is skipped and the
tests of tskv's own service (tests/shells/test_service.py) still run.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

import tskv
from tests.interop.dynamo_indexer import Indexer
from tests.zmq_helpers import LOOPBACK
from tskv.core.events import BlockStored
from tskv.sim import Simulator, Workload, run_round

pytest.importorskip(
    "dynamo.llm", reason="Dynamo is not installed here (pip install ai-dynamo-runtime)"
)
pytest.importorskip(
    "hypercorn", reason="tskv serve's extra is not installed (pip install '.[serve]')"
)

from tskv.shells.service import ServiceSettings, serve

BLOCK_SIZE = 16


class Client:
    """A router's client of the indexer's HTTP API, as it would be written for Dynamo's."""

    def __init__(self, base: str) -> None:
        self.base = base

    def call(self, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.base + path, data, {"content-type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as reply:
                status, raw = reply.status, reply.read()
        except urllib.error.HTTPError as error:
            status, raw = error.code, error.read()
        try:
            return status, json.loads(raw) if raw else None
        except ValueError:
            return status, raw.decode()

    async def __call__(self, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
        return await trio.to_thread.run_sync(self.call, path, body)


@asynccontextmanager
async def dynamo(tmp_path: Path, *flags: str) -> AsyncIterator[Client]:
    async with Indexer(tmp_path / "dynamo.log", *flags) as indexer:
        yield Client(f"http://127.0.0.1:{indexer.port}")


@asynccontextmanager
async def tskv_service(**settings: Any) -> AsyncIterator[Client]:
    async with trio.open_nursery() as nursery:
        _, bound = await nursery.start(serve, "127.0.0.1", 0, ServiceSettings(**settings))
        yield Client(bound[0])
        nursery.cancel_scope.cancel()


async def test_one_client_gets_the_same_answers_from_both(tmp_path: Path) -> None:
    config = tskv.KVEventsConfig(endpoint=LOOPBACK, replay_endpoint=LOOPBACK, wire_format="vllm")
    prompts: list[list[int]] = []
    async with (
        tskv.open_publisher(config, 0) as first,
        tskv.open_publisher(config, 0) as second,
        dynamo(tmp_path) as theirs,
        tskv_service() as ours,
    ):
        for client in (theirs, ours):
            for instance, publisher in ((1, first), (2, second)):
                status, said = await client(
                    "/register",
                    {
                        "instance_id": instance,
                        "endpoint": publisher.endpoint,
                        "replay_endpoint": publisher.replay_endpoint,
                        "model_name": "m",
                        "block_size": BLOCK_SIZE,
                    },
                )
                assert (status, said) == (201, {"status": "ok"})
        for publisher in (first, second):
            with trio.fail_after(30):
                await publisher.wait_for_subscriber(2)  # each service's subscriber
        for seed, publisher in enumerate((first, second)):
            sim = Simulator(256, BLOCK_SIZE, medium="GPU")
            workload = Workload(seed, BLOCK_SIZE, prompts=prompts)
            for _ in range(60):
                events = run_round(sim, workload, 1)
                if events:
                    await publisher.publish(events)
        # Neither service has a "caught up" signal over HTTP: ask until they agree, or 30 s.
        with trio.move_on_after(30):
            while [await theirs("/query", q) for q in queries(prompts)] != [  # noqa: ASYNC110
                without_tskv(await ours("/query", q)) for q in queries(prompts)
            ]:
                await trio.sleep(0.2)
        agreed = 0
        asked = queries(prompts)
        for query in asked:
            dynamo_answer, tskv_answer = await theirs("/query", query), await ours("/query", query)
            assert dynamo_answer == without_tskv(tskv_answer), query["token_ids"][:8]
            agreed += bool(dynamo_answer[1]["scores"])
        assert agreed >= len(asked) // 2  # most prompts are held somewhere: the test can fail
        # the same refusals, with the same statuses
        for path, body in [
            (
                "/register",
                {
                    "instance_id": 1,
                    "endpoint": first.endpoint,
                    "model_name": "m",
                    "block_size": BLOCK_SIZE,
                },
            ),
            (
                "/register",
                {"instance_id": 9, "endpoint": first.endpoint, "model_name": "m", "block_size": 32},
            ),
            (
                "/register",
                {
                    "instance_id": "x",
                    "endpoint": first.endpoint,
                    "model_name": "m",
                    "block_size": 16,
                },
            ),
            ("/query", {"token_ids": [1, 2], "model_name": "nope"}),
            ("/query", {"token_ids": "abc", "model_name": "m"}),
            ("/query", {"token_ids": [-1], "model_name": "m"}),
            ("/unregister", {"instance_id": 77, "model_name": "m"}),
        ]:
            (dynamo_status, _), (tskv_status, tskv_said) = (
                await theirs(path, body),
                await ours(path, body),
            )
            assert dynamo_status == tskv_status, (path, body, tskv_said)
            assert isinstance(tskv_said, dict) and tskv_said["error"]
        # the workers listed alike, and gone alike
        (_, dynamo_workers), (_, tskv_workers) = await theirs("/workers"), await ours("/workers")
        assert [without_tskv(w) for w in tskv_workers] == sorted(
            dynamo_workers, key=lambda w: w["instance_id"]
        )
        for client in (theirs, ours):
            assert await client("/unregister", {"instance_id": 1, "model_name": "m"}) == (
                200,
                {"status": "ok"},
            )
        (_, dynamo_workers), (_, tskv_workers) = await theirs("/workers"), await ours("/workers")
        assert (
            [w["instance_id"] for w in tskv_workers]
            == [w["instance_id"] for w in dynamo_workers]
            == [2]
        )


def queries(prompts: list[list[int]]) -> list[dict[str, Any]]:
    return [{"token_ids": prompt, "model_name": "m"} for prompt in prompts[::3]]


def without_tskv(reply: Any) -> Any:
    """An answer as Dynamo's clients read it: what tskv adds, under `tskv`, left out."""
    if isinstance(reply, tuple):
        return reply[0], without_tskv(reply[1])
    if isinstance(reply, dict):
        return {key: value for key, value in reply.items() if key != "tskv"}
    return reply


TOKENS = list(range(1000, 1024))  # six blocks of 4


def stores(tiers: str, lora_name: str | None = None) -> list[BlockStored]:
    """One chain of TOKENS' blocks, a store each, in the tiers given (G: GPU, C: CPU).
    A block's engine hash is the same on every worker, as an engine that hashes its content
    deterministically makes it: Dynamo's tree names a block by the hash of the first worker
    that stored it, and loses the others' blocks where their hashes differ."""
    first = 500 if lora_name is None else 700
    media = {"G": "GPU", "C": "CPU"}
    return [
        BlockStored(
            block_hashes=[first + depth],
            parent_block_hash=None if depth == 0 else first + depth - 1,
            token_ids=TOKENS[depth * 4 : depth * 4 + 4],
            block_size=4,
            medium=media[tier],
            lora_name=lora_name,
        )
        for depth, tier in enumerate(tiers)
    ]


def signed(value: int) -> int:
    """A block hash as Dynamo's clients send it: an i64."""
    return value - (1 << 64) if value >= 1 << 63 else value


def dump_blocks(trees: dict[str, Any]) -> set[tuple[Any, ...]]:
    """Each block of a /dump: (worker, rank, tier, parent, engine hash, tokens hash)."""
    found = set()
    for tree in trees.values():
        for event in tree["events"]:
            stored, parent = event["event"]["data"]["stored"], None
            parent = stored["parent_hash"]
            for block in stored["blocks"]:
                found.add(
                    (
                        event["worker_id"],
                        event["event"]["dp_rank"],
                        event["storage_tier"],
                        parent,
                        block["block_hash"],
                        block["tokens_hash"],
                    )
                )
                parent = block["block_hash"]
    return found


async def test_tiers_and_dynamos_own_hashes_are_answered_as_dynamo_answers(tmp_path: Path) -> None:
    """/query's tiers, /query_by_hash (block hashes made by Dynamo's own function) and /dump,
    on workers whose chains run from the GPU into the CPU's memory."""
    compute_block_hash_for_seq = pytest.importorskip("dynamo._core").compute_block_hash_for_seq
    config = tskv.KVEventsConfig(endpoint=LOOPBACK, replay_endpoint=LOOPBACK, wire_format="vllm")
    chains = {1: "GGGGCC", 2: "GGC", 3: "CCCC"}  # on disk, Dynamo's cpu and tskv's differ
    async with (
        tskv.open_publisher(config, 0) as first,
        tskv.open_publisher(config, 0) as second,
        tskv.open_publisher(config, 0) as third,
        dynamo(tmp_path) as theirs,
        tskv_service(dynamo_hashes=True) as ours,
    ):
        publishers = {1: first, 2: second, 3: third}
        for client in (theirs, ours):
            for instance, publisher in publishers.items():
                body = {"instance_id": instance, "endpoint": publisher.endpoint, "model_name": "m"}
                assert (await client("/register", {**body, "block_size": 4}))[0] == 201
        for instance, publisher in publishers.items():
            with trio.fail_after(30):
                await publisher.wait_for_subscriber(2)
            await publisher.publish(stores(chains[instance]))
        await second.publish(stores("GGC", lora_name="adapter"))  # under a LoRA adapter too
        hashes = [signed(h) for h in compute_block_hash_for_seq(TOKENS, 4)]
        adapted = [signed(h) for h in compute_block_hash_for_seq(TOKENS, 4, lora_name="adapter")]
        asked = [("/query", {"token_ids": TOKENS[:n], "model_name": "m"}) for n in (4, 10, 24)]
        asked += [
            ("/query_by_hash", {"block_hashes": hashes[:n], "model_name": "m"}) for n in (1, 3, 6)
        ]
        asked += [("/query_by_hash", {"block_hashes": adapted, "model_name": "m"})]
        with trio.move_on_after(30):  # until both have every block
            while [await theirs(*q) for q in asked] != [  # noqa: ASYNC110 - no signal over HTTP
                without_tskv(await ours(*q)) for q in asked
            ]:
                await trio.sleep(0.2)
        for query in asked:
            assert await theirs(*query) == without_tskv(await ours(*query)), query
        assert (await ours(*asked[-1]))[1]["scores"] == {"2": {"0": 8}}  # the adapter's blocks
        _, whole = await ours("/query_by_hash", {"block_hashes": hashes, "model_name": "m"})
        assert whole["instances"]["1"] == {
            "longest_matched": 24,
            "gpu": 16,
            "dp": {"0": 16},
            "cpu": 24,
            "disk": 24,
        }  # the tiers are in the answer: the test can fail
        (_, dynamo_dump), (_, tskv_dump) = await theirs("/dump"), await ours("/dump")
        assert dump_blocks(tskv_dump) == dump_blocks(dynamo_dump)
        assert len(dump_blocks(tskv_dump)) == sum(map(len, chains.values())) + 3
        assert tskv_dump["m:default"]["tskv"] == {"left_out": 0}


async def test_dynamos_indexer_recovers_from_tskvs_dump(tmp_path: Path) -> None:
    """A Dynamo indexer started with tskv serve as its peer builds its tree from tskv's /dump,
    following no stream itself, and then answers as tskv does. (TokenSpeed's wire, which the
    compiled core reads without making events: the hashes are kept from it too.)"""
    config = tskv.KVEventsConfig(endpoint=LOOPBACK, replay_endpoint=LOOPBACK)
    prompts: list[list[int]] = []
    async with (
        tskv.open_publisher(config, 0) as publisher,
        tskv_service(dynamo_hashes=True) as ours,
    ):
        body = {"instance_id": 7, "endpoint": publisher.endpoint, "model_name": "m"}
        assert (await ours("/register", {**body, "block_size": BLOCK_SIZE}))[0] == 201
        with trio.fail_after(30):
            await publisher.wait_for_subscriber(1)
        sim, workload = (
            Simulator(256, BLOCK_SIZE, medium="GPU"),
            Workload(3, BLOCK_SIZE, prompts=prompts),
        )
        for _ in range(40):
            events = run_round(sim, workload, 1)
            if events:
                await publisher.publish(events)
        last = queries(prompts)[-1]
        with trio.move_on_after(30):  # until tskv has applied the last round
            while not (await ours("/query", last))[1]["scores"]:  # noqa: ASYNC110
                await trio.sleep(0.1)
        _, dumped = await ours("/dump")
        assert dump_blocks(dumped)
        async with dynamo(tmp_path, "--peers", ours.base) as theirs:
            held = 0
            for query in queries(prompts):
                answer = without_tskv(await ours("/query", query))
                assert await theirs("/query", query) == answer
                held += bool(answer[1]["scores"])
        assert held  # the answers are not all empty: the test can fail
