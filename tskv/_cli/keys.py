"""`tskv keys generate DIR`: a CURVE key pair as ZeroMQ certificate files."""

from __future__ import annotations

import argparse

from tskv.curve.key_files import generate_keys

ENDS_WITH_CTRL_C = False


async def main(args: argparse.Namespace) -> int:
    public, secret = generate_keys(args.directory, args.name)  # KeyFileError: one line, exit 2
    print(f"public key (give it to the other side): {public}")
    print(f"secret key (keep it here, owner-only):  {secret}")
    return 0
