"""Building and encoding a round, and decoding a batch: tskv beside TokenSpeed's Structs."""

from __future__ import annotations

import gc
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import tskv
from benchmarks.helpers import median_of_runs
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


# -- instructions, which no other tenant of the machine moves ---------------------------------

CONTENDERS = ("TokenSpeed build", "tskv build", "msgspec typed decode", "tskv decode")
LOOPS = {"small": 200, "large": 20, "huge": 20}  # a run's rounds; a second run does three times


def repeat(shape: str, contender: str, n: int) -> None:
    """`n` rounds of one contender's work, for callgrind to count: what `build_encode_costs`
    and `decode_costs` time, new events built every round."""
    makers = round_makers(shape)
    gc.disable()
    if contender == "TokenSpeed build":
        assert msgspec is not None
        encode = msgspec.msgpack.Encoder().encode
        make = next(m for name, m in makers.items() if name.startswith("TokenSpeed"))
        for _ in range(n):
            encode(make())
    elif contender == "tskv build":
        for _ in range(n):
            encode_round(time.time(), makers["tskv"](), 0, strict=False)
    else:
        payload = encode_round(time.time(), makers["tskv"](), 0)
        assert payload is not None
        decode = tskv.decode_batch if contender == "tskv decode" else tokenspeed_types()[2].decode
        for _ in range(n):
            decode(payload)


def _instructions(shape: str, contender: str, n: int) -> int:
    """What a run of `n` rounds costs, start-up included (callgrind's total)."""
    code = f"from benchmarks.codec_costs import repeat; repeat({shape!r}, {contender!r}, {n})"
    done = subprocess.run(
        ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null",
         sys.executable, "-c", code],
        capture_output=True, text=True, check=True, env={**os.environ, "PYTHONHASHSEED": "0"},
    )  # fmt: skip
    found = re.search(r"Collected : (\d+)", done.stderr)
    assert found is not None, done.stderr[-500:]
    return int(found.group(1))


def _per_round(shape: str, who: str) -> float:
    n = LOOPS[shape]
    return (_instructions(shape, who, 3 * n) - _instructions(shape, who, n)) / (2 * n)


def instructions_section(out: Callable[[str], None], reps: int) -> None:
    """Instructions a round (callgrind): two runs of different lengths differenced, so
    start-up cancels out; the median of `reps` such pairs (the counts repeat within a few
    instructions: the hash seed is fixed and the collector off)."""
    if shutil.which("valgrind") is None or msgspec is None:
        out("\n## Instructions a round: skipped, valgrind or msgspec is not installed")
        return
    out("\n## Instructions a round (callgrind), tskv ÷ TokenSpeed's msgspec Structs\n")
    out("| shape | build + encode, TokenSpeed / tskv | ratio | decode, msgspec / tskv | ratio |")
    out("|---|---|---|---|---|")
    for shape in SHAPES:
        count = {who: median_of_runs(reps, _per_round, shape, who) for who in CONTENDERS}
        theirs_b, ours_b, theirs_d, ours_d = (count[who] for who in CONTENDERS)
        out(
            f"| {shape} | {theirs_b:,.0f} / {ours_b:,.0f} | {ours_b / theirs_b:.2f} | "
            f"{theirs_d:,.0f} / {ours_d:,.0f} | {ours_d / theirs_d:.2f} |"
        )
