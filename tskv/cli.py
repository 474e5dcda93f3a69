"""The `tskv` command: each subcommand is a thin shell over the library."""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import sys
from collections.abc import Sequence

import attrs
import trio

import tskv
from tskv.config import KVEventsConfig
from tskv.demo import SimOptions
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
    listen.add_argument(
        "--replay-endpoint",
        "--replay",
        dest="replay",
        type=_endpoint,
        help="the publisher's replay endpoint (--replay is the older spelling)",
    )
    listen.add_argument("--topic", default="", help="only batches whose topic starts with this")
    listen.add_argument(
        "--from-seq", type=_non_negative, help="fetch batches from this seq on from replay first"
    )
    listen.add_argument("--json", action="store_true", help="one JSON object per line")
    listen.add_argument(
        "--curve-server-key", metavar="FILE", help="the publisher's public certificate (NAME.key)"
    )
    listen.add_argument(
        "--curve-secret-key",
        metavar="FILE",
        help="this listener's secret certificate (NAME.key_secret); without it, an ephemeral key",
    )

    demo = commands.add_parser(
        "demo",
        help="run simulated schedulers, publishers and subscribers in one process and check "
        "that nothing is lost",
        description="Simulated schedulers publish their KV events on loopback; subscribers "
        "rebuild each rank's cache from them; the run ends by checking the rebuilt caches "
        "equal the schedulers' own (exit status 1 if not).",
    )
    _sim_flags(demo)

    simulate = commands.add_parser(
        "simulate",
        help="publish a simulated scheduler's KV events for an external consumer",
        description="Run the simulated scheduler and publish its events until Ctrl-C or "
        "--rounds, for a router or indexer under test.",
    )
    simulate.add_argument(
        "--kv-events-config",
        metavar="JSON",
        help="the publisher's settings as the JSON engines take (every KVEventsConfig key); "
        "the flags below override it",
    )
    simulate.add_argument(
        "--endpoint", type=_endpoint, help="PUB endpoint (default from the config: tcp://*:5557)"
    )
    simulate.add_argument(
        "--replay-endpoint", "--replay", type=_endpoint, help="replay ROUTER endpoint"
    )
    simulate.add_argument(
        "--curve-secret-key",
        metavar="FILE",
        help="encrypt with CURVE: the publisher's secret certificate (NAME.key_secret)",
    )
    who = simulate.add_mutually_exclusive_group()
    who.add_argument(
        "--curve-clients", metavar="DIR", help="allow only subscribers whose NAME.key is in DIR"
    )
    who.add_argument(
        "--curve-allow-any-client",
        action="store_true",
        help="allow any subscriber that completes the CURVE handshake",
    )
    _sim_flags(simulate, rounds=None)

    commands.add_parser(
        "bench",
        help="measure tskv against the ZeroMQ ceiling and a threaded baseline",
        add_help=False,
    )

    keys = commands.add_parser("keys", help="manage CURVE key pairs")
    key_commands = keys.add_subparsers(dest="keys_command", metavar="ACTION", required=True)
    generate = key_commands.add_parser(
        "generate",
        help="write a key pair as ZeroMQ certificate files",
        description="Write DIR/NAME.key (public: give it to the other side) and "
        "DIR/NAME.key_secret (readable by its owner only).",
    )
    generate.add_argument("directory", metavar="DIR")
    generate.add_argument("--name", default="tskv", help="file name stem (tskv)")
    return parser


def _positive_float(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number") from None
    if not number > 0:
        raise argparse.ArgumentTypeError(f"{number} must be positive")
    return number


def _positive(value: str) -> int:
    number = _non_negative(value)
    if number == 0:
        raise argparse.ArgumentTypeError("0 is not allowed here; use at least 1")
    return number


def _sim_flags(parser: argparse.ArgumentParser, rounds: int | None = SimOptions().rounds) -> None:
    length = parser.add_mutually_exclusive_group()
    length.add_argument(
        "--rounds",
        type=_positive,
        default=rounds,
        help=f"scheduling rounds to run (default: {rounds or 'until Ctrl-C'})",
    )
    length.add_argument("--duration", type=_positive_float, help="seconds to run instead")
    defaults = SimOptions()  # one source for the defaults: the options the library takes
    parser.add_argument(
        "--requests-per-round",
        type=_non_negative,
        default=defaults.requests_per_round,
        help=f"new requests per round ({defaults.requests_per_round})",
    )
    parser.add_argument(
        "--block-size",
        type=_positive,
        default=defaults.block_size,
        help=f"tokens per block ({defaults.block_size})",
    )
    parser.add_argument(
        "--cache-blocks",
        type=_positive,
        default=defaults.cache_blocks,
        help=f"blocks the prefix cache holds ({defaults.cache_blocks})",
    )
    parser.add_argument(
        "--ranks",
        type=_positive,
        default=defaults.ranks,
        help="data-parallel ranks, one scheduler and publisher each, ports offset by rank "
        f"({defaults.ranks})",
    )
    parser.add_argument(
        "--seed",
        type=_non_negative,
        default=defaults.seed,
        help=f"workload seed: same seed, same stream ({defaults.seed})",
    )
    parser.add_argument(
        "--medium",
        metavar="TIER",
        help="name this storage tier (GPU, CPU...) in every event; sent on the vLLM wire",
    )
    parser.add_argument(
        "--wire-format",
        choices=["tokenspeed", "vllm"],
        help="the wire to publish: tokenspeed (the default) or vllm (carries --medium)",
    )
    parser.add_argument(
        "--round-interval",
        type=_positive_float,
        default=defaults.round_interval,
        help=f"seconds between scheduling rounds ({defaults.round_interval})",
    )


def _sim_options(args: argparse.Namespace) -> SimOptions:
    return SimOptions(
        rounds=None if args.duration is not None else args.rounds,
        duration=args.duration,
        requests_per_round=args.requests_per_round,
        block_size=args.block_size,
        cache_blocks=args.cache_blocks,
        ranks=args.ranks,
        seed=args.seed,
        round_interval=args.round_interval,
        medium=args.medium,
        wire_format=args.wire_format or "tokenspeed",
    )


def _run_demo(args: argparse.Namespace) -> int:
    from tskv.demo import demo

    try:
        ok = trio.run(demo, _sim_options(args))
    except KeyboardInterrupt:
        print("\ntskv demo: interrupted", file=sys.stderr)
        return 130
    return 0 if ok else 1


def simulate_config(args: argparse.Namespace) -> KVEventsConfig:
    """The publisher config `tskv simulate` runs with: --kv-events-config, then the flags."""
    base = (
        KVEventsConfig()
        if args.kv_events_config is None
        else (KVEventsConfig.from_json(args.kv_events_config))
    )
    flags = {
        "endpoint": args.endpoint,
        "replay_endpoint": args.replay_endpoint,
        "curve_secret_key": args.curve_secret_key,
        "curve_clients": args.curve_clients,
        "curve_allow_any_client": args.curve_allow_any_client or None,
        "wire_format": args.wire_format,
    }
    changes = {key: value for key, value in flags.items() if value is not None}
    if "curve_clients" in changes:
        changes["curve_allow_any_client"] = False
    if changes.get("curve_allow_any_client"):
        changes["curve_clients"] = None
    return attrs.evolve(base, **changes)


def _run_simulate(args: argparse.Namespace) -> int:
    from tskv.demo import simulate
    from tskv.security import server_security

    try:
        config = simulate_config(args)
        server_security(config)  # read the key files now, to report a bad one clearly
    except (ValueError, OSError) as exc:
        print(f"tskv simulate: {exc}", file=sys.stderr)
        return 2
    try:
        with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C ends a simulation cleanly
            trio.run(simulate, _sim_options(args), config)
    except (ValueError, OSError) as exc:  # an endpoint that cannot be bound, say
        print(f"tskv simulate: {exc}", file=sys.stderr)
        return 2
    return 0


def _run_keys(args: argparse.Namespace) -> int:
    from tskv.security import KeyFileError, generate_keys

    try:
        public, secret = generate_keys(args.directory, args.name)
    except (KeyFileError, OSError) as exc:
        print(f"tskv keys generate: {exc}", file=sys.stderr)
        return 2
    print(f"public key (give it to the other side): {public}")
    print(f"secret key (keep it here, owner-only):  {secret}")
    return 0


def _run_listen(args: argparse.Namespace) -> int:
    from tskv.listen import listen, summary
    from tskv.subscriber import unreachable_reason

    if args.from_seq is not None and args.replay is None:
        print("tskv listen: --from-seq needs --replay-endpoint ENDPOINT", file=sys.stderr)
        return 2
    if args.curve_secret_key is not None and args.curve_server_key is None:
        print("tskv listen: --curve-secret-key needs --curve-server-key FILE", file=sys.stderr)
        return 2
    for endpoint in (args.endpoint, args.replay):
        problem = endpoint and trio.run(unreachable_reason, endpoint)
        if problem:
            print(
                f"tskv listen: cannot reach {endpoint}: {problem}; check the address",
                file=sys.stderr,
            )
            return 2
    holder: list[tskv.Subscriber] = []
    try:
        with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C is how a listen ends
            trio.run(
                functools.partial(
                    listen,
                    args.endpoint,
                    args.replay,
                    args.topic,
                    args.from_seq,
                    args.json,
                    sys.stdout,
                    holder,
                    curve_server_key=args.curve_server_key,
                    curve_secret_key=args.curve_secret_key,
                )
            )
    except (ValueError, OSError) as exc:  # a bad key file, an ipc path that cannot be used
        print(f"tskv listen: {exc}", file=sys.stderr)
        return 2
    if holder:
        print(summary(holder[0]), file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        from tskv.bench import main as bench

        return bench(argv[1:])
    args = parser.parse_args(argv)
    # The library only logs; the command shows its warnings (losses, refusals) on stderr.
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(levelname)s: %(message)s")
    if args.command == "listen":
        return _run_listen(args)
    if args.command == "demo":
        return _run_demo(args)
    if args.command == "simulate":
        return _run_simulate(args)
    if args.command == "keys":
        return _run_keys(args)
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
