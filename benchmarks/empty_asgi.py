"""The ceiling for `tskv serve`'s HTTP side: an ASGI app that answers every request with `{}` at
once, under hypercorn's Trio worker as tskv serve runs (`python -m benchmarks.empty_asgi PORT`).
What a query costs beyond it is tskv's own."""

from __future__ import annotations

import sys
from typing import Any

import trio
from hypercorn.config import Config
from hypercorn.trio import serve


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            await send({"type": message["type"] + ".complete"})
            if message["type"] == "lifespan.shutdown":
                return
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]}
    )
    await send({"type": "http.response.body", "body": b"{}"})


if __name__ == "__main__":
    config = Config()
    config.bind = [f"127.0.0.1:{sys.argv[1]}"]
    config.accesslog = None
    trio.run(serve, app, config)  # type: ignore[arg-type]
