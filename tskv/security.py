"""CURVE encryption and client allow-listing for the event stream and replay.

A KV event stream carries token ids: anyone who can read it can read the prompts. CURVE
(ZeroMQ's built-in encryption and authentication) protects both sockets. Keys live in ZeroMQ
certificate files, the format `zmq.auth` reads and writes, never on a command line. Which
clients may connect is decided by a ZAP handler that runs as a Trio task next to the publisher.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import stat
from collections.abc import Iterable
from pathlib import Path

import attrs
import trio
import zmq
import zmq.auth

from tskv._ratelimit import LogLimiter
from tskv._trio_zmq import TrioSocket
from tskv.config import KVEventsConfig

logger = logging.getLogger("tskv")

ZAP_ENDPOINT = "inproc://zeromq.zap.01"


class KeyFileError(ValueError):
    """A key file that cannot be used; the message names the file and what is wrong."""


@attrs.frozen
class KeyPair:
    public: bytes  # Z85, 40 bytes
    secret: bytes = attrs.field(repr=lambda _: "<hidden>")  # never in logs or tracebacks


def _load(path: str | os.PathLike[str], need_secret: bool) -> tuple[bytes, bytes | None]:
    file = Path(path)
    if not file.is_file():
        raise KeyFileError(
            f"key file {str(file)!r} does not exist; create one with `tskv keys generate DIR`"
        )
    try:
        public, secret = zmq.auth.load_certificate(file)
    except (ValueError, OSError) as exc:
        raise KeyFileError(f"key file {str(file)!r} is not a ZeroMQ certificate ({exc})") from None
    if need_secret and not secret:
        raise KeyFileError(
            f"key file {str(file)!r} holds no secret key; give the .key_secret file, not the "
            ".key (public) one"
        )
    return public, secret


def _check_owner_only(path: str | os.PathLike[str]) -> None:
    """Refuse a secret key file others can read, as ssh does: the key is the whole secret."""
    if os.name != "posix":
        return
    mode = stat.S_IMODE(os.stat(path).st_mode)
    if mode & 0o077:
        raise KeyFileError(
            f"secret key file {str(path)!r} can be read by others (mode {mode:04o}); make it "
            f"readable by its owner only: chmod 600 {str(path)!r}"
        )


def load_key_pair(path: str | os.PathLike[str]) -> KeyPair:
    """A secret certificate file (NAME.key_secret): this side's public and secret keys."""
    public, secret = _load(path, need_secret=True)
    assert secret is not None
    _check_owner_only(path)
    return KeyPair(public, secret)


def load_public_key(path: str | os.PathLike[str]) -> bytes:
    """A public certificate file (NAME.key), or the public half of a secret one."""
    return _load(path, need_secret=False)[0]


def load_allowed_keys(directory: str | os.PathLike[str]) -> frozenset[bytes]:
    """The public keys of every certificate in `directory`: the clients allowed to connect."""
    folder = Path(directory)
    if not folder.is_dir():
        raise KeyFileError(f"client key directory {str(folder)!r} does not exist")
    keys = frozenset(load_public_key(file) for file in sorted(folder.glob("*.key")))
    if not keys:
        raise KeyFileError(
            f"client key directory {str(folder)!r} holds no public certificates (*.key); copy "
            "each allowed subscriber's NAME.key there"
        )
    return keys


def _write(path: Path, text: str, mode: int) -> None:
    # O_EXCL and the mode at creation: the secret is never readable by others, not even briefly.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "w", encoding="utf8") as file:
        file.write(text)


def generate_keys(directory: str | os.PathLike[str], name: str) -> tuple[Path, Path]:
    """Write NAME.key (public) and NAME.key_secret (owner-only) in `directory`."""
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    public_path, secret_path = folder / f"{name}.key", folder / f"{name}.key_secret"
    for path in (public_path, secret_path):
        if path.exists():
            raise KeyFileError(f"{str(path)!r} already exists; remove it or choose another name")
    public, secret = zmq.curve_keypair()
    header = f"#   tskv CURVE certificate for {name!r}, in ZeroMQ's certificate format\n"
    body = f'metadata\ncurve\n    public-key = "{public.decode()}"\n'
    _write(public_path, header + "#   public: give this file to the other side\n\n" + body, 0o644)
    _write(
        secret_path,
        header
        + "#   SECRET: keep this file to yourself, readable by its owner only\n\n"
        + body
        + f'    secret-key = "{secret.decode()}"\n',
        0o600,
    )
    return public_path, secret_path


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


class ZapHandler:
    """The ZAP endpoint of one ZeroMQ context, served by a Trio task over the shim."""

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]], security: ServerSecurity) -> None:
        sock = context.socket(zmq.REP)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.bind(ZAP_ENDPOINT)  # must happen before any CURVE socket of this context binds
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise RuntimeError(
                f"cannot serve ZAP in this ZeroMQ context ({exc.strerror}): a context has one "
                "ZAP handler; let tskv make a context for an encrypted publisher (pass none)"
            ) from None
        self._sock = TrioSocket(sock)
        self._security = security
        self._refusals = LogLimiter()
        self.refused = 0

    @trio.lowlevel.enable_ki_protection
    async def run(self) -> None:
        while True:
            request = await self._sock.receive()
            reply, ok = zap_reply(request, self._security.allowed)
            if not ok:
                self.refused += 1
                self._refusals.warning(
                    "refused a client: %s (%d refused so far)", reply[3].decode(), self.refused
                )
            await self._sock.send(reply)

    def close(self) -> None:
        self._sock.close()


def _loopback_host(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def exposed_addresses(addresses: Iterable[str]) -> list[str]:
    """The tcp addresses in `addresses` that other machines could reach."""
    exposed = []
    for address in addresses:
        if address.startswith("tcp://"):
            host = address[len("tcp://") :].rpartition(":")[0]
            if not _loopback_host(host):
                exposed.append(address)
    return exposed


def warn_if_exposed(addresses: Iterable[str], buffer_steps: int) -> bool:
    """Warn, once, when events go in clear text where other machines can reach them."""
    exposed = exposed_addresses(addresses)
    if not exposed:
        return False
    logger.warning(
        "KV events are published WITHOUT encryption on %s: anyone who can reach %s can read "
        "the token ids of every prompt and ask for a replay of the last %d batches. Turn CURVE "
        "on (curve_secret_key, and curve_clients or curve_allow_any_client; see "
        "docs/security.md), or bind to 127.0.0.1.",
        ", ".join(exposed),
        "it" if len(exposed) == 1 else "them",
        buffer_steps,
    )
    return True
