"""CURVE keys on disk: ZeroMQ certificate files, read and written, never on a command line.

Reading is done where sockets are opened (never in the config), so a config stays a value.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import attrs
import zmq
import zmq.auth

from tskv.core.errors import TskvError


class KeyFileError(TskvError, ValueError):
    """A key file that cannot be used; the message names the file and what is wrong."""


@attrs.frozen
class KeyPair:
    """A CURVE key pair as read from a file: the secret half is never shown in a repr."""

    public: bytes  # Z85, 40 bytes
    secret: bytes = attrs.field(repr=lambda _: "<hidden>")  # never in logs or tracebacks


def _load(path: str | os.PathLike[str], need_secret: bool) -> tuple[bytes, bytes | None]:
    file = Path(path)
    if file.is_dir():
        raise KeyFileError(
            f"key file {str(file)!r} is a directory; give the certificate file in it (NAME.key "
            "or NAME.key_secret, as `tskv keys generate DIR` writes them)"
        )
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
    if folder.exists() and not folder.is_dir():
        raise KeyFileError(
            f"{str(folder)!r} is a file, not a directory; give the directory to write "
            f"{name}.key and {name}.key_secret in"
        )
    folder.mkdir(parents=True, exist_ok=True)
    public_path, secret_path = folder / f"{name}.key", folder / f"{name}.key_secret"
    for path in (public_path, secret_path):
        if path.exists():
            raise KeyFileError(
                f"{str(path)!r} already exists; remove it, or choose another name with --name"
            )
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
