"""The core and the shells keep no state of their own at module level: what one publisher,
subscriber, decode or index did never shows in what another does. Their module-level tables
are read, never written, so a whole stream followed, decoded and indexed leaves every one of
them as it was."""

from __future__ import annotations

import collections
import importlib
import itertools
import pkgutil
from types import ModuleType

import trio

import tskv
import tskv.core
import tskv.shells
from tests.zmq_helpers import LOOPBACK
from tskv.sim import Simulator, Workload, run_round

MUTABLE = (dict, list, set, bytearray, collections.deque, itertools.count)
# A memo of which optional fields an engine's event class carries, looked at once per class:
# a function of the class alone, so no call's answer depends on what came before it.
MEMOS = {("tskv.core.scheduler", "_CARRIES")}


def modules() -> list[ModuleType]:
    found = []
    for package in (tskv.core, tskv.shells):
        for info in pkgutil.iter_modules(package.__path__, package.__name__ + "."):
            if not info.name.split(".")[-1].startswith("_compiled"):  # C: state per module
                found.append(importlib.import_module(info.name))
    return found


def module_containers() -> dict[tuple[str, str], str]:
    """Every mutable container a module of the core or the shells holds, as it reads now."""
    return {
        (module.__name__, name): repr(value)
        for module in modules()
        for name, value in vars(module).items()
        if isinstance(value, MUTABLE) and (module.__name__, name) not in MEMOS
    }


async def follow_a_stream() -> None:
    """Two publishers, a watcher following both into an index, queries, and the stream's
    statistics: the subscriber, sequencer, codec, filing, compiled core and monitors at work."""
    index = tskv.PrefixIndex(16)
    config = tskv.KVEventsConfig(endpoint=LOOPBACK, replay_endpoint=LOOPBACK, buffer_steps=50)
    async with tskv.open_publisher(config, 0) as a, tskv.open_publisher(config, 1) as b:
        workers = {"a": (a, Simulator(64, 16), Workload(0, 16))}
        workers["b"] = (b, Simulator(64, 16), Workload(1, 16))
        async with tskv.open_watcher(index) as watcher:
            for name, (publisher, _, _) in workers.items():
                watcher.add(name, publisher.endpoint, publisher.replay_endpoint)
            for _ in range(30):
                for publisher, sim, workload in workers.values():
                    events = run_round(sim, workload, 1)
                    if events:
                        await publisher.publish(events)
            with trio.fail_after(20):
                for name, (publisher, _, _) in workers.items():
                    await publisher.wait_for_subscriber()
                    await watcher.wait_for_seq(name, publisher.statistics().accepted - 1)
            assert index.match(list(range(64)), lora_name=None) is not None
            assert all(watcher.status(name).descriptor is not None for name in workers)


async def test_following_a_stream_changes_no_module_level_container() -> None:
    before = module_containers()
    assert before, "no module-level table found: the scan itself is broken"
    await follow_a_stream()
    after = module_containers()
    changed = sorted(
        key for key in before.keys() | after.keys() if before.get(key) != after.get(key)
    )
    assert not changed, f"module-level state written: {changed}"


def test_no_module_counts_with_a_shared_counter() -> None:
    counters = [
        (module.__name__, name)
        for module in modules()
        for name, value in vars(module).items()
        if isinstance(value, itertools.count)
    ]
    assert not counters
