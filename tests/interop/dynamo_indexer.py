"""Dynamo's standalone indexer (`python -m dynamo.indexer`, ai-dynamo-runtime) as a process the
interop tests start on a loopback port, and ask over HTTP."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import trio

from tests.zmq_helpers import free_loopback_port


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
        self.port = free_loopback_port()
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
