"""The `tskv` command: each subcommand is a thin shell over the library."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import tskv


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tskv",
        description="Publish, tail and simulate LLM scheduler KV-cache event streams over ZeroMQ.",
    )
    parser.add_argument("--version", action="version", version=f"tskv {tskv.__version__}")
    parser.add_subparsers(dest="command", metavar="COMMAND")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
