"""A subscriber's sockets, made from its settings: its SUB socket, subscribed, secured and
attached, with the monitor that watches its connections; and its replay client."""

from __future__ import annotations

import trio
import zmq

from tskv.core.config import SubscriberConfig
from tskv.curve.security import ClientSecurity
from tskv.shells._inbox import Inbound
from tskv.shells._monitor import SocketMonitor
from tskv.shells._replay_client import ReplayClient
from tskv.shells._trio_zmq import TrioSocket, attach

SERVER_HINT = (
    "check that curve_server_key is this publisher's public key and that the publisher "
    "allows this subscriber's key (or speaks clear text if you gave no key)"
)


def open_sub(
    context: zmq.Context[zmq.Socket[bytes]],
    endpoint: str,
    binds: bool,
    config: SubscriberConfig,
    security: ClientSecurity | None,
    inbox: trio.MemorySendChannel[Inbound],
) -> tuple[TrioSocket, SocketMonitor, str]:
    """The SUB socket, subscribed and attached, with its monitor and its real address."""
    sock = context.socket(zmq.SUB)
    try:
        sock.setsockopt(zmq.RCVHWM, config.hwm)
        sock.setsockopt(zmq.MAXMSGSIZE, config.max_message_bytes)
        sock.setsockopt(zmq.SUBSCRIBE, config.topic.encode())
        if security is not None:
            security.apply(sock)
        monitor = SocketMonitor(
            sock,
            f"subscriber {endpoint}",
            SERVER_HINT,
            reattach=None if binds else endpoint,  # a publisher that connects retries itself
            dropped_hint=f"a batch over max_message_bytes = {config.max_message_bytes} does "
            "this, or a peer that does not speak ZeroMQ",
            inbox=None if binds else inbox,  # a bound SUB's peers come and go on their own
        )
        address = attach(sock, endpoint, bind=binds)
    except BaseException:
        sock.close(linger=0)
        raise
    return TrioSocket(sock), monitor, address


def replay_client(
    context: zmq.Context[zmq.Socket[bytes]],
    endpoint: str,
    config: SubscriberConfig,
    inbox: trio.MemorySendChannel[Inbound],
    security: ClientSecurity | None,
) -> ReplayClient:
    timeout = config.replay_timeout
    probe_timeout = min(timeout, config.quiet_interval or timeout)  # a probe waits one interval
    return ReplayClient(
        context,
        endpoint,
        timeout,
        inbox,
        security,
        probe_timeout,
        config.topic.encode(),
        config.max_message_bytes,
    )
