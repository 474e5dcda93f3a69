"""Who may have a replay now: the publisher's defence against replay abuse, without I/O.

A replay costs the publisher up to `buffer_steps` sends. Three limits keep a misbehaving (or
malicious) client from turning that into a denial of service, with defaults an honest
subscriber's gap repair never reaches: replays served at once, batches per request, and a
per-client request rate (a token bucket).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import attrs

MAX_TRACKED_CLIENTS = 10_000  # bucket memory is bounded too: the least recent are forgotten


def _at_least(lowest: float) -> Callable[[object, Any, Any], None]:
    def check(_: object, attribute: Any, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < lowest:
            raise ValueError(f"{attribute.name} = {value!r} must be a number >= {lowest}")

    return check


@attrs.frozen
class ReplayLimits:
    max_concurrent: int = attrs.field(default=8, validator=_at_least(1))
    max_batches: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(_at_least(1))
    )  # None: the whole buffer
    rate: float = attrs.field(default=20.0, validator=_at_least(0.001))  # requests/s per client
    burst: int = attrs.field(default=40, validator=_at_least(1))


class RequestGate:
    """Admit or refuse replay requests; `clock` is injected so tests need no sleeps."""

    def __init__(self, limits: ReplayLimits, clock: Callable[[], float]) -> None:
        self.limits = limits
        self._clock = clock
        self._buckets: OrderedDict[bytes, tuple[float, float]] = OrderedDict()

    def _take_token(self, client: bytes) -> bool:
        now = self._clock()
        tokens, last = self._buckets.pop(client, (float(self.limits.burst), now))
        tokens = min(float(self.limits.burst), tokens + (now - last) * self.limits.rate)
        allowed = tokens >= 1.0
        self._buckets[client] = (tokens - 1.0 if allowed else tokens, now)
        while len(self._buckets) > MAX_TRACKED_CLIENTS:
            self._buckets.popitem(last=False)
        return allowed

    def refusal(self, client: bytes, active: int, client_active: bool) -> str | None:
        """Why this request is refused, or None to serve it.

        `active` replays are in progress; `client_active` says one of them is this client's
        (a new request replaces it, so it does not count against the concurrency limit).
        """
        if not self._take_token(client):
            return f"over the rate limit of {self.limits.rate:g} requests/s"
        if not client_active and active >= self.limits.max_concurrent:
            return f"{active} replays already in progress (limit {self.limits.max_concurrent})"
        return None

    def stop_seq(self, first_seq: int, next_seq: int) -> int:
        """Where a replay starting at `first_seq` ends: the newest batch, or the per-request cap."""
        if self.limits.max_batches is None:
            return next_seq
        return min(next_seq, first_seq + self.limits.max_batches)
