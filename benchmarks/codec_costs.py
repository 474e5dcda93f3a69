"""Building and encoding a round, and decoding a batch: tskv beside TokenSpeed's Structs."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import tskv
from benchmarks.rounds import SHAPES, msgspec, round_makers, tokenspeed_types
from tskv.core.codec import encode_round
from tskv.core.events import KVEvent


def per_call(fn: Callable[[], object], n: int, reps: int = 5) -> float:
    samples = []
    for _ in range(reps):
        gc.collect()
        started = time.perf_counter()
        for _ in range(n):
            fn()
        samples.append((time.perf_counter() - started) / n * 1e6)
    return statistics.median(samples)


def _encode_with(encode: Callable[[Any], bytes], make: Callable[[], Any]) -> bytes:
    return encode(make())


def _publish_round(make: Callable[[], list[KVEvent]], strict: bool) -> bytes | None:
    return encode_round(time.time(), make(), 0, strict=strict)


def build_encode_costs() -> dict[str, dict[str, float]]:
    """µs per round to build new events and encode them, per shape and contender."""
    encode = None if msgspec is None else msgspec.msgpack.Encoder().encode
    results: dict[str, dict[str, float]] = {}
    for shape in SHAPES:
        makers = round_makers(shape)
        n = {"small": 3000, "large": 200, "huge": 60}[shape]
        row = {}
        for name, make in makers.items():
            if name.startswith("TokenSpeed"):
                assert encode is not None
                row[name] = per_call(partial(_encode_with, encode, make), n)
            else:
                row[name] = per_call(partial(_publish_round, make, False), n)
        row["tskv, strict"] = per_call(partial(_publish_round, makers["tskv"], True), n)
        results[shape] = row
    return results


def decode_costs() -> dict[str, dict[str, float]]:
    """µs per batch for a router to decode what it receives."""
    results: dict[str, dict[str, float]] = {}
    for shape in SHAPES:
        payload = encode_round(time.time(), round_makers(shape)["tskv"](), 0)
        assert payload is not None
        n = {"small": 3000, "large": 200, "huge": 40}[shape]
        row = {"tskv": per_call(partial(tskv.decode_batch, payload), n)}
        if msgspec is not None:
            row["msgspec typed"] = per_call(partial(tokenspeed_types()[2].decode, payload), n)
        results[shape] = row
    return results
