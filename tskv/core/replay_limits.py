"""Who may have a replay now: the publisher's defence against replay abuse, without I/O.

A replay costs the publisher up to `buffer_steps` sends. Three limits keep a misbehaving (or
malicious) client from turning that into a denial of service, with defaults an honest
subscriber's gap repair never reaches: replays served at once, batches per request, and a
request rate (token buckets).

Whom a rate counts against: with CURVE, the client's public key, which the ZAP handler vouched
for. Without it, clients can only be told apart by connection, and a connection is free to
open, so each connection has the per-client budget and all connections from one host share a
larger one (`HOST_SHARE` clients' worth). A noisy neighbour then costs an honest subscriber on
the same host nothing until it opens several connections and floods with all of them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import attrs

from tskv.core.config import KVEventsConfig

MAX_TRACKED = 10_000  # bucket memory is bounded too: the least recently seen are forgotten
HOST_SHARE = 8  # one host's connections together get this many clients' budget


@attrs.frozen
class Peer:
    """What the publisher knows of a request's sender."""

    identity: bytes  # the ROUTER's routing id: one per connection
    user: str | None = None  # the CURVE public key the ZAP handler accepted
    host: str | None = None  # the peer's IP address


class TokenBuckets:
    """A token bucket per key (`rate` tokens a second, at most `burst`)."""

    def __init__(self, rate: float, burst: float, clock: Callable[[], float]) -> None:
        self.rate = rate
        self.burst = burst
        self._clock = clock
        self._buckets: OrderedDict[object, tuple[float, float]] = OrderedDict()

    def take(self, key: object) -> bool:
        now = self._clock()
        tokens, last = self._buckets.pop(key, (self.burst, now))
        tokens = min(self.burst, tokens + (now - last) * self.rate)
        allowed = tokens >= 1.0
        self._buckets[key] = (tokens - 1.0 if allowed else tokens, now)
        while len(self._buckets) > MAX_TRACKED:
            self._buckets.popitem(last=False)
        return allowed


class RequestGate:
    """Admit or refuse replay requests; `clock` is injected so tests need no sleeps."""

    def __init__(self, config: KVEventsConfig, clock: Callable[[], float]) -> None:
        self.max_concurrent = config.replay_max_concurrent
        self.max_batches = config.replay_max_batches
        self._clients = TokenBuckets(config.replay_rate, config.replay_burst, clock)
        self._hosts = TokenBuckets(
            config.replay_rate * HOST_SHARE, config.replay_burst * HOST_SHARE, clock
        )

    def refusal(self, peer: Peer, active: int, client_active: bool) -> str | None:
        """Why this request is refused, or None to serve it.

        `active` replays are in progress; `client_active` says one of them is this client's
        (a new request replaces it, so it does not count against the concurrency limit).
        """
        if not self._clients.take(peer.user or peer.identity):
            return f"over the rate limit of {self._clients.rate:g} requests/s per client"
        if peer.user is None and peer.host is not None and not self._hosts.take(peer.host):
            return (
                f"over the rate limit of {self._hosts.rate:g} requests/s for host {peer.host} "
                "(all its connections together; CURVE gives each subscriber its own)"
            )
        if not client_active and active >= self.max_concurrent:
            return f"{active} replays already in progress (limit {self.max_concurrent})"
        return None

    def stop_seq(self, first_seq: int, next_seq: int) -> int:
        """Where a replay starting at `first_seq` ends: the newest batch, or the per-request cap."""
        if self.max_batches is None:
            return next_seq
        return min(next_seq, first_seq + self.max_batches)
