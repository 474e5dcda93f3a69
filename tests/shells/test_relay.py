"""Many routers behind one ZeroMQ forwarder: each worker has one subscriber however many routers
watch it, and every router stays exact (replay and snapshots still come from the worker)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import trio
import zmq

import tskv
from tests.zmq_helpers import LOOPBACK, inproc_name
from tskv.sim import Simulator, Workload, run_round

CONFIG = tskv.KVEventsConfig(endpoint=LOOPBACK, replay_endpoint=LOOPBACK, buffer_steps=20)


@contextmanager
def forwarder(endpoint: str) -> Iterator[str]:
    """XSUB from the worker's live endpoint, XPUB on a loopback port, `zmq.proxy_steerable` in
    a thread (libzmq's own loop): the forwarder a fleet puts in front of its routers."""
    context = zmq.Context()
    upstream = context.socket(zmq.XSUB)
    upstream.connect(endpoint)
    downstream = context.socket(zmq.XPUB)
    port = downstream.bind_to_random_port("tcp://127.0.0.1")
    name = inproc_name("forwarder")
    control = context.socket(zmq.PAIR)
    control.bind(name)
    steer = context.socket(zmq.PAIR)
    steer.connect(name)

    def run() -> None:
        try:
            zmq.proxy_steerable(upstream, downstream, None, control)
        finally:
            for sock in (upstream, downstream, control):
                sock.close(linger=0)

    thread = threading.Thread(target=run, name="forwarder")
    thread.start()
    try:
        yield f"tcp://127.0.0.1:{port}"
    finally:
        steer.send(b"TERMINATE")
        thread.join(10)
        steer.close(linger=0)
        context.term()


async def test_three_routers_behind_a_forwarder_are_one_subscriber_and_each_stays_exact() -> None:
    sim, workload = Simulator(64, 16), Workload(0, 16)
    indexes = [tskv.PrefixIndex(16) for _ in range(3)]
    async with tskv.open_publisher(CONFIG) as publisher, trio.open_nursery() as nursery:
        with forwarder(publisher.endpoint) as relayed:
            watchers = []
            for index in indexes:
                watcher = await nursery.start(_watch, index, relayed, publisher.replay_endpoint)
                watchers.append(watcher)
            await publisher.wait_for_subscriber()
            for _ in range(200):
                events = run_round(sim, workload, 1)
                if events:
                    await publisher.publish(events)
            last = publisher.statistics().accepted - 1
            with trio.fail_after(20):
                for watcher in watchers:
                    await watcher.wait_for_seq(0, last)
            assert publisher.statistics().subscriptions == 1  # one, whatever the routers
            for index, watcher in zip(indexes, watchers, strict=True):
                assert await watcher.engine_hashes(0) == sim.cached_hashes()
                assert index.stale == frozenset()
        nursery.cancel_scope.cancel()


async def _watch(
    index: tskv.PrefixIndex,
    endpoint: str,
    replay_endpoint: str | None,
    task_status: trio.TaskStatus[tskv.Watcher],
) -> None:
    async with tskv.open_watcher(index) as watcher:
        watcher.add(0, endpoint, replay_endpoint)
        task_status.started(watcher)
        await trio.sleep_forever()
