"""The `tskv` command: one module per subcommand, each a thin shell over the library.

Every subcommand is `async def main(args) -> int`, run by `run` under one Ctrl-C policy: Ctrl-C
stops any command, which says what it did on its way out; a command that runs until stopped
(listen, simulate) exits 0, one that was interrupted before its end (demo) exits 130. A problem
a command meets (a bad endpoint or key file, a config value) is one line naming it, exit 2.
"""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import NoReturn

import trio

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

import tskv
from tskv._cli import demo, keys, listen, serve, simulate
from tskv._cli.options import (
    endpoint,
    non_negative,
    positive,
    positive_float,
    sim_flags,
    start_point,
    trace_flags,
    weight,
)
from tskv.core.config import SubscriberConfig, did_you_mean
from tskv.sim.hybrid_cache import MODELS

COMMANDS: dict[str, ModuleType] = {
    "listen": listen,
    "demo": demo,
    "simulate": simulate,
    "keys": keys,
    "serve": serve,
}


class _Parser(argparse.ArgumentParser):
    """argparse, saying which flag was meant when one is misspelt."""

    def error(self, message: str) -> NoReturn:
        if message.startswith("unrecognized arguments: "):
            flags = {flag for flag in self._option_string_actions if flag.startswith("--")}
            wrong = message.removeprefix("unrecognized arguments: ").split()
            message += "".join(did_you_mean(word.split("=")[0], flags) for word in wrong[:1])
        super().error(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="tskv",
        description="Publish, tail and simulate LLM scheduler KV-cache event streams over ZeroMQ.",
    )
    parser.add_argument("--version", action="version", version=f"tskv {tskv.__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    listen = commands.add_parser(
        "listen",
        help="tail a KV event stream (tskv, TokenSpeed, vLLM, SGLang, TensorRT-LLM)",
        description="Print one line per batch, repair gaps from replay, show what is lost. "
        "Ctrl-C, SIGTERM, --count or --duration ends it with a summary.",
    )
    listen.add_argument("endpoint", type=endpoint, nargs="?", help="the publisher's PUB endpoint")
    listen.add_argument(
        "--describe",
        type=endpoint,
        metavar="REPLAY_ENDPOINT",
        help="print what the publisher on this replay endpoint says it is (a tskv publisher's "
        "version, epoch, wire, block size, hash, KV cache groups, buffer) and exit: 0 when it "
        "said, 1 when it does not describe itself (TokenSpeed's, vLLM's, ...)",
    )
    listen.add_argument(
        "--replay-endpoint",
        "--replay",
        dest="replay",
        type=endpoint,
        help="the publisher's replay endpoint (--replay is the older spelling)",
    )
    listen.add_argument("--topic", default="", help="only batches whose topic starts with this")
    start = listen.add_mutually_exclusive_group()
    start.add_argument(
        "--from",
        dest="start",
        type=start_point,
        metavar="snapshot|SEQ",
        help="start from the publisher's snapshot of its whole cache, or fetch batches from SEQ "
        "on from replay first",
    )
    start.add_argument(
        "--from-seq", dest="start", type=non_negative, metavar="SEQ", help="the same as --from SEQ"
    )
    listen.add_argument(
        "--max-snapshot-bytes",
        type=positive,
        default=SubscriberConfig().max_snapshot_bytes,
        metavar="N",
        help="give up a snapshot larger than this, reporting what it would restore as lost "
        "(default %(default)s: about 3.5M blocks of 16 tokens)",
    )
    listen.add_argument(
        "--max-message-bytes",
        type=positive,
        default=SubscriberConfig().max_message_bytes,
        metavar="N",
        help="the largest batch or replay reply taken: a larger one costs that batch, "
        "repaired or reported (default %(default)s)",
    )
    listen.add_argument("--json", action="store_true", help="one JSON object per line")
    listen.add_argument(
        "--count", type=positive, metavar="N", help="stop after N batches (with the summary)"
    )
    listen.add_argument(
        "--duration",
        type=positive_float,
        metavar="SECONDS",
        help="stop after this many seconds (with the summary)",
    )
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
    sim_flags(demo)
    demo.add_argument(
        "--route",
        type=positive,
        metavar="WORKERS",
        help="instead: route a shared-prefix workload across WORKERS simulated workers by the "
        "prefix index, round-robin and at random, and compare their prefix cache hit rates",
    )
    demo.add_argument(
        "--plot", metavar="PNG", help="with --route: also save a chart (needs matplotlib)"
    )
    demo.add_argument(
        "--model",
        choices=MODELS,
        default="full",
        help="with --route: the workers' model: full attention (full), or a hybrid of full "
        "attention and a sliding window (hybrid-swa) or Mamba (hybrid-mamba), whose events "
        "are published as vLLM 0.33 does and whose hits the index must equal",
    )
    trace = trace_flags(
        demo,
        "routing a request trace (with --route)",
        "routed by the load-aware kv policy, with and without speculative entries, "
        "round-robin and at random, and the hit rates compared",
    )
    trace.add_argument("--json", action="store_true", help="print one JSON object instead")
    trace.add_argument(
        "--load-weight",
        type=weight,
        metavar="W",
        help="the kv policy's weight of a queued token against a token to prefill (1.0)",
    )

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
        "--endpoint", type=endpoint, help="PUB endpoint (default from the config: tcp://*:5557)"
    )
    simulate.add_argument(
        "--replay-endpoint", "--replay", type=endpoint, help="replay ROUTER endpoint"
    )
    attach = simulate.add_mutually_exclusive_group()
    attach.add_argument(
        "--bind",
        dest="bind",
        action="store_const",
        const=True,
        help="bind the endpoint whatever it looks like (tcp://127.0.0.1:5557 binds that port)",
    )
    attach.add_argument(
        "--connect",
        dest="bind",
        action="store_const",
        const=False,
        help="connect to the endpoint (to a consumer that binds); by default only a wildcard, "
        "ipc or inproc endpoint binds, as TokenSpeed's rule has it",
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
    sim_flags(simulate, rounds=None)
    trace_flags(
        simulate,
        "publishing a request trace's events instead of the simulator's",
        "its requests served by simulated workers, whose KV events are published for your "
        "consumer (tests/traces/ has one)",
    )

    commands.add_parser(
        "bench",
        help="measure tskv against the ZeroMQ ceiling and its peers (from a clone)",
        add_help=False,
    )

    serve.add_parser(commands)

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


def _interrupted(exc: BaseException) -> bool:
    """Ctrl-C, alone or inside the exception group of the nursery it landed in (whatever it
    cancelled on its way is its consequence)."""
    if isinstance(exc, KeyboardInterrupt):
        return True
    return isinstance(exc, BaseExceptionGroup) and exc.subgroup(KeyboardInterrupt) is not None


def _problem(exc: BaseException) -> BaseException | None:
    """The one ValueError or OSError that stopped the command (inside a group too)."""
    if isinstance(exc, (ValueError, OSError)):
        return exc
    if isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        return _problem(exc.exceptions[0])
    return None


def run(name: str, args: argparse.Namespace) -> int:
    """Run one subcommand under the CLI's single Ctrl-C and error policy."""
    command = COMMANDS[name]
    try:
        # at a checkpoint only: a Ctrl-C that lands between making a task's coroutine and
        # starting it would leave that coroutine never awaited (and a warning on stderr)
        status: int = trio.run(command.main, args, restrict_keyboard_interrupt_to_checkpoints=True)
    except BaseException as exc:  # every way out is decided here, once
        if _interrupted(exc):
            if command.ENDS_WITH_CTRL_C:
                return 0
            after_echo = "\n" if sys.stderr.isatty() else ""  # past the terminal's ^C
            print(f"{after_echo}tskv {name}: interrupted", file=sys.stderr)
            return 130
        problem = _problem(exc)
        if problem is None:
            raise
        print(f"tskv {name}: {problem}", file=sys.stderr)
        return 2
    return status


def bench(argv: list[str]) -> int:
    """The benchmark is not in the package (it compares with peers a user need not install):
    run from a clone it runs there, anywhere else it says how to get one."""
    here = Path.cwd()
    if not (here / "benchmarks" / "__main__.py").is_file():
        print(
            "tskv bench: the benchmark is not installed with tskv; run it from a clone of "
            "tskv's repository: nox -s bench (or python -m benchmarks)",
            file=sys.stderr,
        )
        return 2
    return subprocess.run([sys.executable, "-m", "benchmarks", *argv], cwd=here).returncode


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        return bench(argv[1:])
    args, extras = parser.parse_known_args(argv)
    if extras:  # reported by the command's own parser, which knows the flags that were meant
        commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        command = commands.choices.get(args.command, parser) if args.command else parser
        command.error(f"unrecognized arguments: {' '.join(extras)}")
    if args.command is None:
        parser.print_help()
        return 0
    # The library only logs; the command shows its warnings (losses, refusals) on stderr.
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(levelname)s: %(message)s")
    return run(args.command, args)
