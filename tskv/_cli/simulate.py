"""`tskv simulate`: simulated schedulers publishing for an external consumer until stopped."""

from __future__ import annotations

import argparse
import logging
import sys
from contextlib import AsyncExitStack
from typing import TextIO

import attrs
import trio

from tskv._cli.options import flags_given, sim_options
from tskv.core.config import KVEventsConfig
from tskv.core.errors import ConfigError
from tskv.curve.security import server_security
from tskv.shells.publisher import Publisher, open_publisher
from tskv.sim import SchedulerLoop, SimOptions, check_options
from tskv.sim.trace import read_trace
from tskv.sim.trace_routing import ProgressBar, TraceOptions, publish_trace

ENDS_WITH_CTRL_C = True  # it runs until stopped: Ctrl-C is its normal end

logger = logging.getLogger(__name__)


def simulate_config(args: argparse.Namespace) -> KVEventsConfig:
    """The publisher config `tskv simulate` runs with: --kv-events-config, then the flags."""
    base = KVEventsConfig()
    if args.kv_events_config is not None:
        base = KVEventsConfig.from_json(args.kv_events_config, logger.warning)
        if base.publisher not in (None, "zmq"):
            raise ConfigError(
                f"publisher = {base.publisher!r}: tskv simulate publishes over ZeroMQ; "
                'leave the key out or set it to "zmq"'
            )
    flags = {
        "endpoint": args.endpoint,
        "replay_endpoint": args.replay_endpoint,
        "curve_secret_key": args.curve_secret_key,
        "curve_clients": args.curve_clients,
        "curve_allow_any_client": args.curve_allow_any_client or None,
        "wire_format": args.wire_format,
        "bind": args.bind,
    }
    changes = {key: value for key, value in flags.items() if value is not None}
    if "curve_clients" in changes:
        changes["curve_allow_any_client"] = False
    if changes.get("curve_allow_any_client"):
        changes["curve_clients"] = None
    try:
        return attrs.evolve(base, **changes)
    except ConfigError as exc:  # name the flags the user typed, not the config keys
        text = str(exc).replace("curve_allow_any_client: true", "curve_allow_any_client")
        for key in flags:
            text = text.replace(key, f"--{key.replace('_', '-')}")
        raise ConfigError(text) from None


async def main(args: argparse.Namespace) -> int:
    config = simulate_config(args)
    server_security(config)  # read the key files now, to report a bad one before starting
    if args.trace is not None:
        await simulate_trace(args, config)
        return 0
    flags = flags_given(args, TRACE_ONLY)
    if flags:
        raise ValueError(f"{flags}: only with --trace FILE")
    await simulate(sim_options(args), config)
    return 0


def announce(publishers: list[Publisher], config: KVEventsConfig, out: TextIO) -> None:
    for rank, publisher in enumerate(publishers):
        replay = publisher.replay_endpoint
        how = "bound to" if config.binds(config.endpoint) else "connecting to"
        print(
            f"rank {rank}: publishing {how} {publisher.endpoint}"
            + (f", replay bound to {replay}" if replay else ""),
            file=out,
            flush=True,
        )


TRACE_ONLY = ("requests", "cache_tokens", "prefill_rate", "speed")


async def simulate_trace(args: argparse.Namespace, config: KVEventsConfig) -> None:
    """Publish a trace's KV events: its requests served round-robin by --ranks workers."""
    requests = read_trace(args.trace, args.requests)
    defaults = TraceOptions()
    options = TraceOptions(
        cache_tokens=args.cache_tokens or defaults.cache_tokens,
        block_size=args.block_size or defaults.block_size,
        prefill_rate=args.prefill_rate or defaults.prefill_rate,
        speed=args.speed,
    )
    async with AsyncExitStack() as stack:
        publishers = [
            await stack.enter_async_context(open_publisher(config, rank))
            for rank in range(args.ranks)
        ]
        announce(publishers, config, sys.stdout)
        await publish_trace(requests, publishers, options, ProgressBar(len(requests)))
        batches = sum(publisher.statistics().accepted for publisher in publishers)
    print(f"tskv simulate: {len(requests)} requests, {batches} batches published", flush=True)


@trio.lowlevel.enable_ki_protection  # Ctrl-C lands at a checkpoint, so the summary is printed
async def simulate(
    options: SimOptions,
    config: KVEventsConfig,
    out: TextIO = sys.stdout,
    *,
    task_status: trio.TaskStatus[list[Publisher]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Publish the simulated schedulers' events for an external consumer until done.

    With `await nursery.start(simulate, ...)`, the publishers are handed back once they are
    open, so a test or a tool can point consumers at them.
    """
    check_options(options)
    loop: SchedulerLoop | None = None
    try:
        async with AsyncExitStack() as stack:
            publishers = [
                await stack.enter_async_context(open_publisher(config, rank))
                for rank in range(options.ranks)
            ]
            loop = SchedulerLoop(options, publishers)
            announce(publishers, config, out)
            task_status.started(publishers)
            await loop.run()
    finally:
        if loop is not None:
            batches = sum(rank.batches for rank in loop.ranks)
            print(
                f"tskv simulate: {loop.rounds} rounds, {batches} batches published",
                file=out,
                flush=True,
            )
