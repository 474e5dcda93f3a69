"""ZeroMQ endpoint rules shared with TokenSpeed and vLLM: bind or connect, and per-rank offsets."""

from __future__ import annotations

import ipaddress

from tskv.core.errors import TskvError, TskvTypeError

_TRANSPORTS = ("tcp://", "ipc://", "inproc://")
LOOPBACK = "tcp://127.0.0.1:*"  # binds loopback on a port the OS picks: tests, demos, tools


class EndpointError(TskvError, ValueError):
    """An endpoint tskv cannot use; the message says which and what would work."""


def check_endpoint(endpoint: str) -> str:
    """Return `endpoint` if it is a tcp, ipc or inproc ZeroMQ address, else raise EndpointError."""
    if not isinstance(endpoint, str):
        raise EndpointError(f"endpoint must be a string, got {endpoint!r}")
    if not endpoint.startswith(_TRANSPORTS):
        raise EndpointError(
            f"endpoint {endpoint!r} is not a ZeroMQ address; write tcp://HOST:PORT, "
            "ipc://PATH or inproc://NAME"
        )
    transport, _, rest = endpoint.partition("://")
    if not rest:
        raise EndpointError(f"endpoint {endpoint!r} names no address after {transport}://")
    if transport == "tcp":
        host, port = host_and_port(endpoint)
        if port is None or not host:
            raise EndpointError(
                f"endpoint {endpoint!r} has no host:port; write for example tcp://127.0.0.1:5557"
            )
        if port != "*" and not (port.isdigit() and int(port) <= 65535):
            raise EndpointError(
                f"endpoint {endpoint!r} has port {port!r}; use a number from 0 to 65535 "
                "(0 lets the OS choose)"
            )
    return endpoint


def host_and_port(endpoint: str) -> tuple[str, str | None]:
    """A tcp endpoint's host (as written, brackets kept) and port (None when there is no
    `:`): the one place a tcp address is taken apart."""
    host, sep, port = endpoint[len("tcp://") :].rpartition(":")
    return (host, port) if sep else (port, None)


def tcp_host(endpoint: str) -> str | None:
    """The host of a tcp endpoint, brackets removed (`[::1]` -> `::1`); None for ipc/inproc."""
    if not endpoint.startswith("tcp://"):
        return None
    return host_and_port(endpoint)[0].strip("[]")


def is_host_name(host: str) -> bool:
    """Whether `host` (brackets removed) is a name to resolve, not an address or a wildcard."""
    if host in ("*", ""):
        return False
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return True
    return False


def on_this_machine(endpoint: str) -> bool:
    """Whether `endpoint` is reachable only from this machine: ipc, inproc or loopback tcp."""
    host = tcp_host(endpoint)
    if host is None or host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name, or `*`: other machines may reach it
        return False


def should_bind(endpoint: str, *, subscriber: bool = False) -> bool:
    """Whether a publisher binds `endpoint` (a wildcard or a local transport, TokenSpeed's
    rule) or connects to it. A subscriber binds only a wildcard: a publisher that connects
    out (no `*` in its endpoint) needs a subscriber that binds, and any other address means
    "connect to the publisher"."""
    if subscriber:
        return "*" in endpoint
    return (
        "*" in endpoint
        or "::" in endpoint
        or endpoint.startswith("ipc://")
        or endpoint.startswith("inproc://")
    )


def offset_endpoint_port(endpoint: str | None, dp_rank: int) -> str | None:
    """The endpoint data-parallel rank `dp_rank` publishes on, so ranks never share a socket.

    Rank 0 and a missing endpoint are unchanged; inproc names get `_dp{rank}`; a tcp port gets
    the rank added, except port 0 (or ZeroMQ's `*`, which means the same), which stays as it is
    so the OS picks one per rank.
    """
    if isinstance(dp_rank, bool) or not isinstance(dp_rank, int):
        raise TskvTypeError(f"dp_rank must be an int, got {dp_rank!r}")
    if dp_rank < 0:
        raise EndpointError(f"dp_rank = {dp_rank} must not be negative")
    if endpoint is None or dp_rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{dp_rank}"
    if endpoint.startswith("ipc://"):
        raise EndpointError(
            f"cannot offset ipc endpoint {endpoint!r} for dp_rank {dp_rank}: give each rank "
            "its own ipc path, or use tcp:// so ranks take consecutive ports"
        )
    if not endpoint.startswith("tcp://"):
        raise EndpointError(
            f"cannot offset endpoint {endpoint!r} for dp_rank {dp_rank}: only tcp:// and "
            "inproc:// endpoints can be offset by rank"
        )
    host, port = host_and_port(endpoint)
    if host and port == "*":
        return endpoint
    if not host or port is None or not port.isdigit():
        raise EndpointError(
            f"cannot offset endpoint {endpoint!r} for dp_rank {dp_rank}: it has no numeric "
            "port; write tcp://HOST:PORT (0 lets the OS choose)"
        )
    base = int(port)
    if base == 0:
        return endpoint
    if base + dp_rank > 65535:
        raise EndpointError(
            f"endpoint {endpoint!r} with dp_rank {dp_rank} would use port {base + dp_rank}, "
            "past 65535; choose a lower base port"
        )
    return f"tcp://{host}:{base + dp_rank}"
