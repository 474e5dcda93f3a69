"""`tskv serve` beside Dynamo's standalone indexer: the same workers, the same queries.

Both services run as processes of their own (`tskv serve`; `python -m dynamo.indexer --threads
1`) and follow the same tskv publishers, which run here, each holding its share of 2,000-token
prompts (125 blocks of 16 tokens). A separate load process (`benchmarks.http_load`) asks
`/query` with those prompts over keep-alive connections: one client, then 16 at once, each
asking as soon as it has its answer. Then every worker publishes a small round 50 times a second
and each service's CPU is read from /proc. Nothing here passes or fails.
"""

from __future__ import annotations

import json
import logging
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import trio

import tskv
from benchmarks.helpers import median_of_runs, percentile, runs_said

BLOCK = 16
PROMPT_BLOCKS = 125  # a 2,000-token prompt
LOOPBACK = "tcp://127.0.0.1:*"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _post(base: str, path: str, body: dict[str, Any] | None = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(base + path, data, {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as reply:
        raw = reply.read()
    return json.loads(raw) if raw else None


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


class Service:
    def __init__(self, name: str, base: str, process: trio.Process) -> None:
        self.name, self.base, self.process = name, base, process

    async def ask(self, path: str, body: dict[str, Any] | None = None) -> Any:
        return await trio.to_thread.run_sync(_post, self.base, path, body)


@asynccontextmanager
async def _tskv_serve(state_dir: str) -> AsyncIterator[Service]:
    command = [sys.executable, "-m", "tskv", "serve", "--port", "0", "--state-dir", state_dir]
    process = await trio.lowlevel.open_process(command, stderr=subprocess.PIPE)
    assert process.stderr is not None
    try:
        said = b""
        with trio.fail_after(60):
            while b"listening on" not in said:
                said += await process.stderr.receive_some()
        base = said.decode().split("listening on ")[1].split()[0].rstrip(",")
        yield Service("tskv serve", base, process)
    finally:
        process.kill()
        await process.wait()


@asynccontextmanager
async def _started(name: str, command: list[str]) -> AsyncIterator[Service]:
    """A service process listening on a free loopback port (the command ends with it)."""
    port = _free_port()
    process = await trio.lowlevel.open_process(
        [*command, str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    service = Service(name, f"http://127.0.0.1:{port}", process)
    try:
        with trio.fail_after(60):
            while True:
                try:
                    await service.ask("/health")
                    break
                except OSError:
                    await trio.sleep(0.1)  # its port answering is its only "ready"
        yield service
    finally:
        process.kill()
        await process.wait()


def _empty_app() -> Any:
    command = [sys.executable, "-m", "benchmarks.empty_asgi"]
    return _started("hypercorn, an empty app (the ceiling)", command)


def _dynamo() -> Any:
    command = [sys.executable, "-m", "dynamo.indexer", "--threads", "1", "--port"]
    return _started("Dynamo indexer", command)


def _prompts(worker: int, count: int) -> list[list[int]]:
    rng = random.Random(worker)
    return [[rng.randrange(1, 100_000) for _ in range(PROMPT_BLOCKS * BLOCK)] for _ in range(count)]


async def _publish_prompts(publisher: tskv.Publisher, prompts: list[list[int]], base: int) -> None:
    for n, tokens in enumerate(prompts):
        hashes = list(range(base + n * PROMPT_BLOCKS, base + (n + 1) * PROMPT_BLOCKS))
        await publisher.publish([tskv.BlockStored(hashes, None, tokens, BLOCK)])


async def _caught_up(service: Service, probes: list[tuple[int, list[int]]]) -> float:
    """Seconds until every worker's last prompt is answered whole (no service says when it
    has caught up, so both are asked the same way)."""
    began = time.perf_counter()
    with trio.fail_after(600):
        for worker, tokens in probes:
            while True:
                said = await service.ask("/query", {"token_ids": tokens, "model_name": "bench"})
                if said["scores"].get(str(worker), {}).get("0") == len(tokens):
                    break
                await trio.sleep(0.1)
    return time.perf_counter() - began


async def _all_current(service: Service, workers: int) -> None:
    """Until tskv serve says every worker's view is whole (its /workers' added figures)."""
    with trio.fail_after(600):
        while True:
            listed = await service.ask("/workers")
            current = sum(
                1
                for entry in listed
                for rank in entry["tskv"].values()
                if rank and not rank["stale"]
            )
            if current == workers:
                return
            await trio.sleep(0.05)


async def _restarted(state_dir: str, workers: int) -> float:
    """Seconds from starting a killed tskv serve again until every worker is current: it
    registers them from --state-dir and bootstraps each from its snapshot."""
    began = time.perf_counter()
    async with _tskv_serve(state_dir) as service:
        await _all_current(service, workers)
        return time.perf_counter() - began


async def _load(
    service: Service, bodies: str, concurrency: int, seconds: float
) -> dict[str, float]:
    command = [sys.executable, "-m", "benchmarks.http_load", service.base, bodies]
    done = await trio.run_process([*command, str(concurrency), str(seconds)], capture_stdout=True)
    latencies: list[float] = json.loads(done.stdout)
    return {
        "p50_ms": percentile(latencies, 0.5) * 1e3,
        "p99_ms": percentile(latencies, 0.99) * 1e3,
        "qps": len(latencies) / seconds,
    }


async def _cpu_at_rounds(
    services: list[Service], publishers: list[tskv.Publisher], rate: float, seconds: float
) -> dict[str, float]:
    """Each service's CPU seconds a second while every worker publishes `rate` rounds a second
    (a one-block store and the removal of the one before)."""
    before = {s.name: _cpu_seconds(s.process.pid) for s in services}
    began = time.perf_counter()
    rounds = int(rate * seconds)
    for n in range(rounds):
        for w, publisher in enumerate(publishers):
            block = 10**12 + w * 10**6 + n
            await publisher.publish(
                [
                    tskv.BlockStored([block], None, [n % 1000] * BLOCK, BLOCK),
                    tskv.BlockRemoved([block - 1]),
                ]
            )
        await trio.sleep_until(began + (n + 1) / rate)
    took = time.perf_counter() - began
    return {s.name: (_cpu_seconds(s.process.pid) - before[s.name]) / took for s in services}


async def measure(workers: int, blocks: int, with_dynamo: bool) -> dict[str, dict[str, Any]]:
    per_worker = blocks // PROMPT_BLOCKS
    config = tskv.KVEventsConfig(endpoint=LOOPBACK, replay_endpoint=LOOPBACK, hwm=0)
    figures: dict[str, dict[str, Any]] = {}
    state = tempfile.TemporaryDirectory()
    async with AsyncExitStack() as stack:
        stack.callback(state.cleanup)
        ours = await stack.enter_async_context(_tskv_serve(state.name))
        services = [ours]
        if with_dynamo:
            services.append(await stack.enter_async_context(_dynamo()))
        publishers = [
            await stack.enter_async_context(tskv.open_publisher(config)) for _ in range(workers)
        ]
        for service in services:
            for instance, publisher in enumerate(publishers):
                await service.ask(
                    "/register",
                    {
                        "instance_id": instance,
                        "endpoint": publisher.endpoint,
                        "replay_endpoint": publisher.replay_endpoint,
                        "model_name": "bench",
                        "block_size": BLOCK,
                    },
                )
        for publisher in publishers:
            with trio.fail_after(60):
                await publisher.wait_for_subscriber(len(services))
        prompts = [_prompts(worker, per_worker) for worker in range(workers)]
        began = time.perf_counter()
        for worker, publisher in enumerate(publishers):
            await _publish_prompts(publisher, prompts[worker], worker * 10**9)
        published = time.perf_counter() - began
        probes = [(worker, prompts[worker][-1]) for worker in range(workers)]
        rng = random.Random(0)
        asked = [
            {"token_ids": rng.choice(prompts[rng.randrange(workers)]), "model_name": "bench"}
            for _ in range(200)
        ]
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as file:
            json.dump(asked, file)
        for service in services:
            row = figures.setdefault(service.name, {})
            row["caught_up_s"] = published + await _caught_up(service, probes)
            row["rss_mb"] = _rss_mb(service.process.pid)
            row["one"] = await _load(service, file.name, 1, 3.0)
            row["sixteen"] = await _load(service, file.name, 16, 3.0)
        cpu = await _cpu_at_rounds(services, publishers, 50.0, 5.0)
        for service in services:
            figures[service.name]["cpu_at_50"] = cpu[service.name]
        async with _empty_app() as empty:
            figures[empty.name] = {
                "one": await _load(empty, file.name, 1, 3.0),
                "sixteen": await _load(empty, file.name, 16, 3.0),
            }
        os.unlink(file.name)
        ours.process.kill()  # as SIGKILL leaves it: the state file, nothing else
        await ours.process.wait()
        figures[ours.name]["restart_s"] = await _restarted(state.name, workers)
    return figures


def service_section(
    out: Callable[[str], None], reps: int, fleets: tuple[int, ...] = (16, 64)
) -> None:
    """Each fleet's figures the median of `reps` runs (each its own services, publishers and
    thousands of queries; `--reps 1` for one)."""
    try:
        import dynamo.llm  # type: ignore[import-not-found, unused-ignore]  # noqa: F401

        with_dynamo = True
    except ImportError:
        with_dynamo = False
    logging.getLogger("tskv").setLevel(logging.ERROR)  # the kill's abandoned replays, expected
    out("\n## tskv serve beside Dynamo's standalone indexer (2,000-token prompts)\n")
    out(f"Each row: {runs_said(reps)}.\n")
    if not with_dynamo:
        out("Dynamo is not installed (pip install ai-dynamo-runtime): its rows are skipped.\n")
    out(
        "| workers × blocks | service | caught up (s) | RSS (MB) | 1 client p50 / p99 (ms) | "
        "1 client q/s | 16 clients p50 / p99 (ms) | 16 clients q/s | CPU at 50 rounds/s | "
        "current after a kill (s) |"
    )
    out("|---|---|---|---|---|---|---|---|---|---|")
    for workers in fleets:
        figures = median_of_runs(reps, trio.run, measure, workers, 50_000, with_dynamo)
        for name, row in figures.items():
            one, many = row["one"], row["sixteen"]
            out(
                f"| {workers} × 50,000 | {name} | {_seconds(row.get('caught_up_s'))} | "
                f"{_mb(row.get('rss_mb'))} | "
                f"{one['p50_ms']:.2f} / {one['p99_ms']:.2f} | {one['qps']:.0f} | "
                f"{many['p50_ms']:.2f} / {many['p99_ms']:.2f} | {many['qps']:.0f} | "
                f"{_cpu(row.get('cpu_at_50'))} | {_seconds(row.get('restart_s'))} |"
            )


def _seconds(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def _mb(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0f}"


def _cpu(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"
