"""Why a subscriber (or a publisher that connects out) hears nothing, when that can be told
without the other side: an ipc path that cannot exist, a host name that does not resolve, or no
answer at all after a while."""

from __future__ import annotations

import logging
import os

import trio

from tskv.core.endpoints import is_host_name, tcp_host
from tskv.shells._monitor import SocketMonitor

logger = logging.getLogger(__name__)


# Both sides connecting is the likely mistake: TokenSpeed's rule makes a publisher given an
# explicit address (tcp://127.0.0.1:5557) connect out, as a subscriber does.
NO_PUBLISHER_HINT = (
    "check the address, that the publisher is running, and that it binds there (a publisher "
    "binds only an endpoint with *, ::, ipc:// or inproc://, unless its config sets bind=True)"
)
NO_SUBSCRIBER_HINT = (
    "this publisher connects there (its endpoint has no *, ::, ipc:// or inproc://: "
    "TokenSpeed's rule), so a subscriber must bind it; set bind=True to bind it here instead"
)


@trio.lowlevel.enable_ki_protection
async def warn_if_unanswered(
    endpoint: str,
    monitor: SocketMonitor,
    after: float,
    peer: str = "publisher",
    hint: str = NO_PUBLISHER_HINT,
) -> None:
    """A peer that never answers (a wrong address, a host that does not resolve, a handshake
    that keeps failing, both sides connecting) would otherwise leave this side silent forever;
    `hint` is what to check when nothing more precise can be told."""
    if endpoint.startswith("inproc://"):
        return  # no handshake to watch (and no address or host to get wrong)
    with trio.move_on_after(after):
        await monitor.answered.wait()
        return
    if monitor.handshake_failures:
        return  # it does answer: each failed handshake was logged, saying what to check
    problem = await unreachable_reason(endpoint)
    logger.warning(
        "no %s has answered on %s for %g s (still trying): %s",
        peer,
        endpoint,
        after,
        problem or hint,
    )


IPC_PATH_LIMIT = 107  # bytes a Unix socket path may have (sun_path, less its final NUL)


def ipc_problem(endpoint: str) -> str | None:
    """Why an ipc endpoint's path can never be used: its folder is missing, or it is too long
    for a Unix socket. ZeroMQ would otherwise retry it forever without a word."""
    path = endpoint[len("ipc://") :]
    if path.startswith("@"):  # Linux's abstract namespace: no file, no folder
        return None
    if len(path.encode()) > IPC_PATH_LIMIT:
        return f"ipc path {path!r} is longer than {IPC_PATH_LIMIT} bytes; use a shorter path"
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        return f"folder {folder!r} of ipc path {path!r} does not exist; create it first"
    return None


async def unreachable_reason(endpoint: str) -> str | None:
    """Why `endpoint` cannot be reached, when that can be told without connecting: a tcp
    host name that does not resolve, an ipc path that cannot exist."""
    if endpoint.startswith("ipc://"):
        return ipc_problem(endpoint)
    host = tcp_host(endpoint)
    if host is None or not is_host_name(host):
        return None
    try:
        await trio.socket.getaddrinfo(host, None)
    except OSError as exc:
        return f"host {host!r} does not resolve ({exc.strerror or exc})"
    return None
