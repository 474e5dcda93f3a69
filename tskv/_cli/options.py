"""Flag parsing shared by the commands: one definition of each check and each default."""

from __future__ import annotations

import argparse

from tskv.core.endpoints import EndpointError, check_endpoint
from tskv.sim import SimOptions


def endpoint(value: str) -> str:
    try:
        return check_endpoint(value)
    except EndpointError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def non_negative(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number") from None
    if number < 0:
        raise argparse.ArgumentTypeError(f"{number} must not be negative")
    return number


def start_point(value: str) -> int | str:
    """Where `tskv listen` starts: "snapshot", or a seq to fetch from replay."""
    if value == "snapshot":
        return value
    try:
        return non_negative(value)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"{value!r}: use snapshot (the publisher's whole cache) or a seq (a whole number)"
        ) from None


def _number(value: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number") from None


def positive_float(value: str) -> float:
    number = _number(value)
    if not number > 0:
        raise argparse.ArgumentTypeError(f"{number} must be positive")
    return number


def weight(value: str) -> float:
    """A finite number, 0 or more."""
    number = _number(value)
    if not 0 <= number < float("inf"):
        raise argparse.ArgumentTypeError(f"{number} must be a finite number, 0 or more")
    return number


def flags_given(args: argparse.Namespace, names: tuple[str, ...]) -> str:
    """The flags among `names` the user gave (as typed: `--cache-tokens`), comma-separated; ""
    when none was. A flag given as 0 is given (0 == False, but it is no unset switch)."""
    values = {name: getattr(args, name) for name in names}
    given = [name for name, value in values.items() if value is not None and value is not False]
    return ", ".join(f"--{name.replace('_', '-')}" for name in given)


def positive(value: str) -> int:
    number = non_negative(value)
    if number == 0:
        raise argparse.ArgumentTypeError("0 is not allowed here; use at least 1")
    return number


def sim_flags(parser: argparse.ArgumentParser, rounds: int | None = SimOptions().rounds) -> None:
    length = parser.add_mutually_exclusive_group()
    length.add_argument(
        "--rounds",
        type=positive,
        default=rounds,
        help=f"scheduling rounds to run (default: {rounds or 'until Ctrl-C'})",
    )
    length.add_argument("--duration", type=positive_float, help="seconds to run instead")
    defaults = SimOptions()  # one source for the defaults: the options the library takes
    parser.add_argument(
        "--requests-per-round",
        type=non_negative,
        default=defaults.requests_per_round,
        help=f"new requests per round ({defaults.requests_per_round})",
    )
    parser.add_argument(
        "--block-size",
        type=positive,
        help=f"tokens per block ({defaults.block_size}; 64 with --trace)",
    )
    parser.add_argument(
        "--cache-blocks",
        type=positive,
        default=defaults.cache_blocks,
        help=f"blocks the prefix cache holds ({defaults.cache_blocks})",
    )
    parser.add_argument(
        "--ranks",
        type=positive,
        default=defaults.ranks,
        help="data-parallel ranks, one scheduler and publisher each, ports offset by rank "
        f"({defaults.ranks})",
    )
    parser.add_argument(
        "--seed",
        type=non_negative,
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
        type=positive_float,
        default=defaults.round_interval,
        help=f"seconds between scheduling rounds ({defaults.round_interval})",
    )


def trace_flags(parser: argparse.ArgumentParser, title: str, what: str) -> argparse._ArgumentGroup:
    """The flags that replay a request trace, for `demo --route` and `simulate`; `what` says
    what this command does with the trace."""
    trace = parser.add_argument_group(title)
    trace.add_argument(
        "--trace",
        metavar="FILE",
        help="a Mooncake-format trace (JSON lines: timestamp, input_length, output_length, "
        f"hash_ids): {what}",
    )
    trace.add_argument(
        "--requests", type=positive, metavar="K", help="only the trace's first K requests"
    )
    trace.add_argument(
        "--cache-tokens",
        type=positive,
        metavar="T",
        help="each worker's prefix cache, in tokens (3,000,000)",
    )
    trace.add_argument(
        "--prefill-rate",
        type=positive_float,
        metavar="TOKENS",
        help="prompt tokens each worker prefills a second, in trace time (5,000)",
    )
    trace.add_argument(
        "--speed",
        type=positive_float,
        metavar="X",
        help="replay the trace at X times real time (default: as fast as the router keeps up)",
    )
    return trace


def sim_options(args: argparse.Namespace) -> SimOptions:
    return SimOptions(
        rounds=None if args.duration is not None else args.rounds,
        duration=args.duration,
        requests_per_round=args.requests_per_round,
        block_size=args.block_size or SimOptions().block_size,
        cache_blocks=args.cache_blocks,
        ranks=args.ranks,
        seed=args.seed,
        round_interval=args.round_interval,
        medium=args.medium,
        wire_format=args.wire_format or "tokenspeed",
    )
