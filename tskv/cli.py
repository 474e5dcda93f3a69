"""The `tskv` command: each subcommand is a thin shell over the library."""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Sequence

import trio

import tskv
from tskv.endpoints import EndpointError, check_endpoint


def _endpoint(value: str) -> str:
    try:
        return check_endpoint(value)
    except EndpointError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _non_negative(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number") from None
    if number < 0:
        raise argparse.ArgumentTypeError(f"{number} must not be negative")
    return number


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tskv",
        description="Publish, tail and simulate LLM scheduler KV-cache event streams over ZeroMQ.",
    )
    parser.add_argument("--version", action="version", version=f"tskv {tskv.__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    listen = commands.add_parser(
        "listen",
        help="tail a KV event stream (tskv, TokenSpeed, vLLM, SGLang)",
        description="Print one line per batch, repair gaps from replay, show what is lost. "
        "Ctrl-C ends it with a summary.",
    )
    listen.add_argument("endpoint", type=_endpoint, help="the publisher's PUB endpoint")
    listen.add_argument("--replay", type=_endpoint, help="the publisher's replay endpoint")
    listen.add_argument("--topic", default="", help="only batches whose topic starts with this")
    listen.add_argument(
        "--from-seq", type=_non_negative, help="fetch batches from this seq on from replay first"
    )
    listen.add_argument("--json", action="store_true", help="one JSON object per line")
    return parser


def _run_listen(args: argparse.Namespace) -> int:
    from tskv.listen import listen, summary

    if args.from_seq is not None and args.replay is None:
        print("tskv listen: --from-seq needs --replay ENDPOINT", file=sys.stderr)
        return 2
    holder: list[tskv.Subscriber] = []
    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C is how a listen ends
        trio.run(
            listen,
            args.endpoint,
            args.replay,
            args.topic,
            args.from_seq,
            args.json,
            sys.stdout,
            holder,
        )
    if holder:
        print(summary(holder[0]), file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "listen":
        return _run_listen(args)
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
