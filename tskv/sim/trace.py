"""Request traces in Mooncake's format (kvcache-ai/Mooncake, `FAST25-release/traces/`).

One JSON object a line: `timestamp` (ms since the trace began), `input_length` and
`output_length` (tokens), and `hash_ids`: one id per 512-token block of the prompt, equal ids
meaning an equal prefix up to and including that block. A trace block becomes `512 / block_size`
whole tskv blocks, each with token ids and an engine hash of its own, so the KV events a worker
publishes for it are what an engine with that block size would publish.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs

from tskv.core.errors import TskvError

TRACE_BLOCK = 512  # tokens per hash id in Mooncake's traces
FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


class TraceError(TskvError, ValueError):
    """A trace line tskv cannot read; the message names the file, the line and the fix."""


@attrs.frozen
class TraceRequest:
    """One request of a Mooncake-format trace: when it came, its lengths, its blocks' hashes."""

    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def block_tokens(self, position: int) -> int:
        """Prompt tokens in its trace block `position` (the last one may be short)."""
        return min(TRACE_BLOCK, self.input_length - position * TRACE_BLOCK)

    def token_ids(self) -> list[int]:
        """Its prompt's token ids: trace block h's tokens are h * 512 + 0.., so equal ids give
        equal tokens, and different ids different ones."""
        tokens: list[int] = []
        for position, block in enumerate(self.hash_ids):
            start = block * TRACE_BLOCK
            tokens.extend(range(start, start + self.block_tokens(position)))
        return tokens


def read_trace(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """The first `limit` requests of the trace at `path` (all without one), in time order.
    Raises TraceError naming the line of the first one that is not a Mooncake request."""
    requests: list[TraceRequest] = []
    for number, line in _lines(path):
        if limit is not None and len(requests) >= limit:
            break
        requests.append(_request(f"{path}:{number}", line))
    if not requests:
        raise TraceError(f"{path} holds no requests; give a Mooncake trace (one JSON a line)")
    return sorted(requests, key=lambda request: request.timestamp_ms)


def _lines(path: str | Path) -> Iterator[tuple[int, str]]:
    try:
        with open(path, encoding="utf-8") as trace:
            for number, line in enumerate(trace, 1):
                if line.strip():
                    yield number, line
    except OSError as exc:
        raise TraceError(f"cannot read the trace {str(path)!r}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise TraceError(f"{path} is not text; give a Mooncake trace (JSON lines)") from None


def _request(where: str, line: str) -> TraceRequest:
    try:
        value: Any = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where}: not JSON ({exc.msg}); each line is one request") from None
    if not isinstance(value, dict):
        raise TraceError(f"{where}: a request is a JSON object with {', '.join(FIELDS)}")
    missing = [name for name in FIELDS if name not in value]
    if missing:
        raise TraceError(f"{where}: the request has no {', '.join(missing)}")
    for name in FIELDS[:3]:
        number = value[name]
        if isinstance(number, bool) or not isinstance(number, int) or number < 0:
            raise TraceError(f"{where}: {name} = {number!r} must be a whole number, 0 or more")
    ids = value["hash_ids"]
    if not isinstance(ids, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids
    ):
        raise TraceError(f"{where}: hash_ids must be a list of whole numbers, 0 or more")
    if len(ids) != math.ceil(value["input_length"] / TRACE_BLOCK):
        raise TraceError(
            f"{where}: {len(ids)} hash_ids for input_length {value['input_length']}: Mooncake's "
            f"traces give one per {TRACE_BLOCK} prompt tokens"
        )
    return TraceRequest(
        value["timestamp"], value["input_length"], value["output_length"], tuple(ids)
    )


def max_hit_rate(requests: list[TraceRequest], block_size: int) -> float:
    """The share of prompt tokens an infinite cache shared by every worker would hold, in whole
    blocks of `block_size` tokens as an engine reuses them: the ceiling any routing policy is
    measured against."""
    seen: dict[int, int] = {}  # trace block -> its longest prefix seen, in whole blocks
    hit = total = 0
    for request in requests:
        for position, block in enumerate(request.hash_ids):
            whole = request.block_tokens(position) // block_size
            hit += min(whole, seen.get(block, 0)) * block_size
            seen[block] = max(whole, seen.get(block, 0))
        total += request.input_length
    return hit / total if total else 0.0
