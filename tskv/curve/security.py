"""CURVE on sockets: the settings a publisher or subscriber puts on its sockets, from the
config's key files. Policy is in `curve.py`, key files in `key_files.py`, the ZAP task in
`_zap.py`; `tskv keys generate` and docs/security.md say how to make keys.
"""

from __future__ import annotations

import os

import attrs
import zmq

from tskv.core.config import KVEventsConfig
from tskv.curve.key_files import KeyPair, load_allowed_keys, load_key_pair, load_public_key


@attrs.frozen
class ServerSecurity:
    """CURVE for a publisher: its key pair, and who may connect (None: any valid handshake)."""

    keys: KeyPair
    allowed: frozenset[bytes] | None

    def apply(self, sock: zmq.Socket[bytes]) -> None:
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.keys.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.keys.secret)


def server_security(config: KVEventsConfig) -> ServerSecurity | None:
    """The CURVE settings `config` asks for, with the key files read; None when it is off."""
    if config.curve_secret_key is None:
        return None
    keys = load_key_pair(config.curve_secret_key)
    allowed = None if config.curve_clients is None else load_allowed_keys(config.curve_clients)
    return ServerSecurity(keys, allowed)


@attrs.frozen
class ClientSecurity:
    """CURVE for a subscriber: the publisher's public key and this subscriber's key pair."""

    server_public: bytes
    keys: KeyPair

    @classmethod
    def from_files(
        cls, server_key: str | os.PathLike[str], secret_key: str | os.PathLike[str] | None
    ) -> ClientSecurity:
        """Without a secret key file, an ephemeral key pair: enough for "any client" servers."""
        if secret_key is not None:
            keys = load_key_pair(secret_key)
        else:
            public, secret = zmq.curve_keypair()
            keys = KeyPair(public, secret)
        return cls(load_public_key(server_key), keys)

    def apply(self, sock: zmq.Socket[bytes]) -> None:
        sock.setsockopt(zmq.CURVE_SERVERKEY, self.server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.keys.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.keys.secret)
