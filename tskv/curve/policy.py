"""CURVE policy, without I/O: who may connect (ZAP's decision) and which addresses are exposed.

A KV event stream carries token ids: anyone who can read it can read the prompts. CURVE
(ZeroMQ's built-in encryption and authentication) protects both sockets; the decisions about it
live here, the key files in `key_files.py`, the socket options in `security.py` and the ZAP task
in `_zap.py`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import zmq.utils.z85

from tskv.core.endpoints import on_this_machine

logger = logging.getLogger(__name__)


def zap_reply(request: list[bytes], allowed: frozenset[bytes] | None) -> tuple[list[bytes], bool]:
    """Decide one ZAP request (RFC 27); returns the reply frames and whether it was accepted.

    Only CURVE is accepted (a plain-text client against a CURVE socket never gets here: the
    handshake fails first). With an allow list, the client's public key must be on it.
    """
    if len(request) < 6 or request[0] != b"1.0":
        request_id = request[1] if len(request) > 1 else b""
        return [b"1.0", request_id, b"400", b"malformed ZAP request", b"", b""], False
    request_id, mechanism, credentials = request[1], request[5], request[6:]
    if mechanism != b"CURVE" or len(credentials) != 1 or len(credentials[0]) != 32:
        return [b"1.0", request_id, b"400", b"CURVE required", b"", b""], False
    client = zmq.utils.z85.encode(credentials[0])
    if allowed is not None and client not in allowed:
        return [b"1.0", request_id, b"400", b"client key not allowed", b"", b""], False
    return [b"1.0", request_id, b"200", b"OK", client, b""], True


def exposed_addresses(addresses: Iterable[str]) -> list[str]:
    """The tcp addresses in `addresses` that other machines could reach."""
    return [address for address in addresses if not on_this_machine(address)]


def warn_if_exposed(addresses: Iterable[str], buffer_steps: int) -> bool:
    """Warn, once, when events go in clear text where other machines can reach them."""
    exposed = exposed_addresses(addresses)
    if not exposed:
        return False
    logger.warning(
        "KV events are published WITHOUT encryption on %s: anyone who can reach %s can read "
        "the token ids of every prompt and ask for a replay of the last %d batches. Turn CURVE "
        "on (curve_secret_key, and curve_clients or curve_allow_any_client; see "
        "docs/security.md), or publish on loopback only: endpoint tcp://127.0.0.1:PORT with "
        "bind: true (or tcp://127.0.0.1:* for a port the OS picks).",
        ", ".join(exposed),
        "it" if len(exposed) == 1 else "them",
        buffer_steps,
    )
    return True
