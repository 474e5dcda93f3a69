"""How many workers one router keeps current: publisher processes with many workers, each
publishing small rounds, and routers (each a watcher over every worker, its workers followed in
the router's process or in reader processes) in processes of their own. Every worker's last seq
and losses are compared at the end; with a prefilled cache, every worker's blocks too. Bare
subscribers, which only receive, show what a subscriber costs the publishers themselves."""

from __future__ import annotations

import os
import resource
import socket
import struct
import tempfile
import time
from contextlib import ExitStack
from multiprocessing.connection import Connection
from typing import Any, NamedTuple

import trio
import zmq

from benchmarks.helpers import child, kernel_seconds, percentile, rss, zmq_io_seconds
from benchmarks.rounds import BLOCK, HASH_MASK, SCRAMBLE, blocks_per_round, churn_maker
from tskv.core.config import KVEventsConfig
from tskv.core.endpoints import LOOPBACK
from tskv.core.prefix_index import PrefixIndex
from tskv.shells.publisher import Publisher, open_publisher
from tskv.shells.watcher import Watcher, open_watcher

PROMPT = 2_000  # tokens of the prompt matched while the index applies the stream
STEADY = 10.0  # seconds a router with a cache measures its CPU per batch, once current


class _Published(NamedTuple):
    """What the publishers' process reports at the end of a run."""

    accepted: list[int]  # batches each worker published
    late: int  # rounds that began after their time
    rounds: int
    cpu: float  # seconds a batch, the process's
    io: float  # of `cpu`: ZeroMQ's I/O thread
    bootstrap_cpu: float | None  # with a cache: seconds until every router was current


def publish_workers(
    workers: int, seconds: float, rate: int, cached: int, ipc: str | None, conn: Connection
) -> None:
    """`workers` publishers in this process, each caching `cached` blocks first (as fast as it
    can), then a small round (10 events of 4 blocks, as many of the oldest removed) `rate`
    times a second for `seconds` (with a cache, and on until told to stop: the routers measure
    once they are current); reports what each published and its CPU per batch."""

    async def main() -> None:
        config = KVEventsConfig(endpoint=LOOPBACK, replay_endpoint=LOOPBACK)
        async with trio.open_nursery() as nursery:
            publishers: list[Publisher] = []
            for rank in range(workers):
                if ipc is not None:  # each worker its own socket files: no rank offset
                    config = KVEventsConfig(
                        endpoint=f"ipc://{ipc}/{rank}.pub",
                        replay_endpoint=f"ipc://{ipc}/{rank}.rep",
                    )
                publishers.append(
                    await nursery.start(_one_worker, config, 0 if ipc is not None else rank)
                )
            makers = [churn_maker("small", cached, rank) for rank in range(workers)]
            for _ in range(-(-cached // blocks_per_round("small"))):
                for publisher, make in zip(publishers, makers, strict=True):
                    await publisher.publish(make())
            conn.send([(p.endpoint, p.replay_endpoint) for p in publishers])
            subscribers = await trio.to_thread.run_sync(conn.recv)  # the routers are ready
            with trio.fail_after(30):  # a subscriber that never came fails the run
                for publisher in publishers:  # bare subscribers: their subscriptions are in
                    await publisher.wait_for_subscriber(subscribers)
            next_round, late, rounds = trio.current_time(), 0, 0
            cpu, io = time.process_time(), zmq_io_seconds()
            bootstrap_cpu, stop = None, not cached  # with a cache, on until told to stop
            while rounds < seconds * rate or not stop:
                for publisher, make in zip(publishers, makers, strict=True):
                    await publisher.publish(make())
                rounds += 1
                next_round += 1 / rate
                late += trio.current_time() > next_round
                await trio.sleep_until(next_round)
                if cached and conn.poll(0):  # every router is "current", then "stop"
                    stop = conn.recv() == "stop"
                    if not stop:  # the snapshots served, and the rounds published meanwhile
                        bootstrap_cpu = time.process_time() - cpu
            batches = rounds * workers
            cpu, io = (time.process_time() - cpu) / batches, (zmq_io_seconds() - io) / batches
            for publisher, make in zip(publishers, makers, strict=True):
                await publisher.publish(make())  # so a gap at the very end is noticed
            accepted = [p.accepted for p in publishers]
            conn.send(_Published(accepted, late, rounds, cpu, io, bootstrap_cpu))
            await trio.to_thread.run_sync(conn.recv)
            nursery.cancel_scope.cancel()

    trio.run(main)


async def _one_worker(config: KVEventsConfig, rank: int, task_status: Any) -> None:
    async with open_publisher(config, rank) as publisher:
        task_status.started(publisher)
        await trio.sleep_forever()


def _cached_hashes(published: int, cached: int) -> set[int]:
    """The engine hashes a worker caches after `published` churning rounds."""
    per_round = blocks_per_round("small")
    window = -(-cached // per_round) * per_round
    last = published * per_round
    return {block * SCRAMBLE & HASH_MASK for block in range(max(last - window, 0), last)}


def _router(
    endpoints: list[tuple[str, str]], processes: int, cached: int, nice: int, conn: Connection
) -> None:
    """One router: a watcher over every worker. With a prefilled cache it measures the
    bootstrap, then queries while the stream is applied; it reports each worker's last seq and
    losses, and CPU per batch of its own process and with its readers' (which inherit `nice`):
    with a cache, over `STEADY` seconds once every worker is current, less the queries' own."""
    os.nice(nice)

    async def main() -> None:
        index = PrefixIndex(BLOCK)
        memory = rss()
        opened, opened_cpu = trio.current_time(), time.process_time()
        async with open_watcher(index, processes=processes) as watcher:  # the defaults
            readers_memory = [rss(reader.pid) for reader in watcher.readers]
            starting = trio.current_time() - opened  # the reader processes
            conn.send("ready")
            await trio.to_thread.run_sync(conn.recv)  # the publishers begin their rounds
            began = trio.current_time()
            for rank, (endpoint, replay) in enumerate(endpoints):
                watcher.add(rank, endpoint, replay)
            for rank in range(len(endpoints)):
                await watcher.wait_for_seq(rank, -1)  # its snapshot is in: current from here
            bootstrap = starting + trio.current_time() - began
            conn.send("current")
            result: dict[str, Any] = {"bootstrap_s": bootstrap if cached else None}
            result.update(_bootstrapped(index, watcher, opened_cpu, len(endpoints) * cached))
            if cached:
                result["index_bytes"] = (rss() - memory) / len(index)
                now = [rss(reader.pid) for reader in watcher.readers]
                grown = sum(now) - sum(readers_memory)
                result["reader_bytes"] = grown / len(index) if watcher.readers else None
            # the nursery inside: its tasks are done before the requests' socket is closed
            async with _Requests(cached) as requests, trio.open_nursery() as nursery:
                queries = _Queries()
                if cached:  # first the stream alone: what waking for the queries adds shows
                    alone = router_cpu(watcher, len(endpoints))
                    await trio.sleep(STEADY / 2)
                    applied = _per_batch(watcher, len(endpoints), alone, 0.0)
                    result["alone_cpu_us"] = applied["cpu_us"]
                    result["alone_total_cpu_us"] = applied["total_cpu_us"]
                    await requests.accept()
                before = router_cpu(watcher, len(endpoints))
                if cached:
                    nursery.start_soon(_answer, index, watcher, queries, requests)
                    await trio.sleep(STEADY)
                    result.update(_per_batch(watcher, len(endpoints), before, queries.cpu))
                    conn.send("measured")
                    added = (result["cpu_us"] - result["alone_cpu_us"]) * result["batches"]
                    result["request_us"] = added / max(len(queries.waits), 1)
                wanted = await trio.to_thread.run_sync(conn.recv)
                with trio.move_on_after(30):
                    for rank, last in enumerate(wanted):
                        await watcher.wait_for_seq(rank, last - 1)
                nursery.cancel_scope.cancel()
            if not cached:  # measured over the whole run: the publishers began with all current
                result.update(_per_batch(watcher, len(endpoints), before, 0.0))
            else:
                for blocks, times in queries.latencies.items():
                    result[f"match_{blocks}"] = [
                        percentile(kind, share) for kind in times for share in (0.5, 0.99)
                    ]
                    result[f"match_{blocks}_clock"] = [
                        queries.switched[blocks] / max(len(times[1]), 1),
                        percentile(queries.clock[blocks], 0.99),
                    ]
                result["query_wait"] = [percentile(queries.waits, share) for share in (0.5, 0.99)]
                result["indexed_at_end"] = len(index) / (len(endpoints) * cached)
                result["wrong_views"] = await _wrong_views(watcher, wanted, cached)
            statuses = [watcher.status(rank) for rank in range(len(endpoints))]
            result["report"] = [(s.last_seq, s.losses) for s in statuses]
            conn.send(result)

    trio.run(main)


def _bootstrapped(
    index: PrefixIndex, watcher: Watcher, opened_cpu: float, blocks: int
) -> dict[str, Any]:
    """What the bootstrap cost the router in every process (its wall time is also bound by the
    publishers' process, where every engine's snapshot is made on one core), and its result."""
    index_cpu = time.process_time() - opened_cpu
    readers_cpu = sum(reader.cpu_seconds for reader in watcher.readers)
    return {
        "bootstrap_cpu_s": index_cpu + readers_cpu,
        "bootstrap_index_cpu_s": index_cpu,
        "stale_after_bootstrap": len(index.stale),
        "indexed_after_bootstrap": len(index) / max(blocks, 1),
    }


async def _wrong_views(watcher: Watcher, published: list[int], cached: int) -> int:
    """Workers whose blocks, as the watcher holds them, are not what their publisher caches."""
    wrong = 0
    for rank, last in enumerate(published):
        wrong += await watcher.engine_hashes(rank) != _cached_hashes(last, cached)
    return wrong


CPU = tuple[float, float, int, float, float]  # what `router_cpu` gives


def _per_batch(watcher: Watcher, workers: int, before: CPU, queries: float) -> dict[str, float]:
    """CPU per batch applied since `before`: the index's process, less `queries` (the CPU
    seconds of the bench's own queries in it), and with the readers; of the readers', their
    ZeroMQ I/O threads' and the kernel's; and how many batches."""
    cpu, readers, batches, readers_io, readers_kernel = router_cpu(watcher, workers)
    applied = max(batches - before[2], 1)
    index = cpu - before[0] - queries
    return {
        "cpu_us": index / applied * 1e6,
        "total_cpu_us": (index + readers - before[1]) / applied * 1e6,
        "queries_cpu_us": queries / applied * 1e6,
        "readers_io_us": (readers_io - before[3]) / applied * 1e6,
        "readers_kernel_us": (readers_kernel - before[4]) / applied * 1e6,
        "batches": applied,
    }


def router_cpu(watcher: Watcher, workers: int) -> CPU:
    """This process's CPU seconds, its readers' (as they last reported), batches applied, and
    the readers' seconds in their ZeroMQ I/O threads and in the kernel (from /proc, now)."""
    readers = sum(reader.cpu_seconds for reader in watcher.readers)
    batches = sum(watcher.status(w).batches for w in range(workers))
    io = kernel = 0.0
    for reader in watcher.readers:
        try:
            io += zmq_io_seconds(reader.pid or 0)
            kernel += kernel_seconds(reader.pid or 0)
        except (FileNotFoundError, ProcessLookupError):
            pass  # ended as it was read (it is started again): its share is lost, not the run
    return time.process_time(), readers, batches, io, kernel


class _Queries:
    """What the bench's queries measured, and the CPU they took making their prompts and
    matching them (the bench's, not the index's: a router's requests come with their tokens).

    A match's CPU is the lesser of two clocks read around it, each at least what the match
    took: the thread's CPU clock (`thread_time`), which leaves out the time the OS ran another
    process instead, and the wall clock read inside that clock's window. Reading the CPU
    clock is a system call, which here sometimes runs tens of µs of the kernel's work charged
    to that window: 1.2-1.6% of the matches with 40 blocks held took over 3 µs more CPU than
    wall time, which no match can."""

    def __init__(self) -> None:
        # blocks held -> (wall, CPU) µs of each match
        self.latencies: dict[int, tuple[list[float], list[float]]] = {40: ([], []), 4: ([], [])}
        # blocks held -> the thread's CPU clock alone, µs, around each match
        self.clock: dict[int, list[float]] = {40: [], 4: []}
        # blocks held -> matches the OS switched out while they ran: one pays the switch and
        # comes back to caches another process has used
        self.switched: dict[int, int] = {40: 0, 4: 0}
        self.waits: list[float] = []  # µs each request waited for the router's loop
        self.cpu = 0.0  # s


_REQUEST = struct.Struct("d")  # a request: the time.monotonic() it was sent at (one clock
# for every process of the machine)


def _requester(path: str, conn: Connection) -> None:
    """A router's clients: a request every millisecond on the Unix socket at `path` (late ones
    are not made up for), from when told "go" until told "stop" or the router closes its end."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(path)
        conn.send("connected")
        if conn.recv() != "go":
            return
        due = time.monotonic()
        while not conn.poll(0):
            due = max(due + 0.001, time.monotonic())
            time.sleep(max(due - time.monotonic(), 0))
            try:
                sock.sendall(_REQUEST.pack(time.monotonic()))
            except (BrokenPipeError, ConnectionResetError):
                return  # the router is done


class _Requests:
    """With a cache, a `_requester` process and the router's end of its socket."""

    def __init__(self, cached: int) -> None:
        self._cached = cached
        self._stack = ExitStack()
        self.sock: trio.socket.SocketType | None = None

    async def __aenter__(self) -> _Requests:
        if self._cached:
            folder = self._stack.enter_context(tempfile.TemporaryDirectory())
            self._listener = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            await self._listener.bind(f"{folder}/requests")
            self._listener.listen(1)
            self._conn = self._stack.enter_context(child(_requester, f"{folder}/requests"))
        return self

    async def accept(self) -> None:
        """The requester connected; it sends from now on."""
        with trio.fail_after(30):  # a requester that never came fails the run
            self.sock, _ = await self._listener.accept()
        await trio.to_thread.run_sync(self._conn.recv)
        self._conn.send("go")

    async def __aexit__(self, *exc: object) -> None:
        if self._cached:
            self._conn.send("stop")
            self._listener.close()
            if self.sock is not None:
                self.sock.close()
        self._stack.close()


async def _answer(
    index: PrefixIndex, watcher: Watcher, queries: _Queries, requests: _Requests
) -> None:
    """Answer each request by matching a 2,000-token prompt, by turns one whose first 40
    blocks a worker holds (a recent round's chain of worker 0: its 10 events share their 64
    token ids) and one whose first 4 are held, then tokens no one holds; every request waiting
    is answered in one wakeup, as a router should. Wall time, and this thread's CPU time (the
    match's own cost, without the moments the OS ran another process instead) and whether the
    OS switched it out meanwhile (RUSAGE_THREAD's involuntary switches); and how long each
    request waited for the router's loop (the OS's other processes included)."""
    assert requests.sock is not None
    latencies, turn, pending = queries.latencies, 0, b""
    while data := await requests.sock.recv(1 << 16):
        pending += data
        whole = len(pending) - len(pending) % _REQUEST.size
        for (sent,) in _REQUEST.iter_unpack(pending[:whole]):
            queries.waits.append((time.monotonic() - sent) * 1e6)
            cached = (40, 4)[turn % 2]
            turn += 1
            made = time.thread_time()
            recent = max((watcher.status(0).last_seq or 0) - 10, 0) * blocks_per_round("small")
            chain = (list(range(1000 + recent, 1000 + recent + 64)) * 10)[: cached * BLOCK]
            prompt = chain + list(range(900_000_000, 900_000_000 + PROMPT - len(chain)))
            switched = resource.getrusage(resource.RUSAGE_THREAD).ru_nivcsw
            cpu = time.thread_time()
            began = time.perf_counter()  # the wall clock's window inside the CPU clock's
            index.match(prompt)
            wall = (time.perf_counter() - began) * 1e6
            clock = (time.thread_time() - cpu) * 1e6
            latencies[cached][0].append(wall)
            latencies[cached][1].append(min(wall, clock))
            queries.clock[cached].append(clock)
            queries.switched[cached] += (
                resource.getrusage(resource.RUSAGE_THREAD).ru_nivcsw != switched
            )
            queries.cpu += time.thread_time() - made
        pending = pending[whole:]


def _bare_subscriber(endpoints: list[tuple[str, str]], conn: Connection) -> None:
    """A SUB socket per worker that only counts what arrives: no decoding, no index. What an
    extra subscriber costs the publishers themselves, apart from the busier machine a router
    on it makes (this one needs a few percent of a core)."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    poller = zmq.Poller()
    for endpoint, _ in endpoints:
        sub = context.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(endpoint)
        poller.register(sub, zmq.POLLIN)
    conn.send("ready")
    received, expected, deadline = 0, None, None
    while expected is None or received < expected:
        for sub, _ in poller.poll(100):
            while sub.poll(0):
                sub.recv_multipart()
                received += 1
        if expected is None and conn.poll(0):  # the publishers are done: this many were sent
            expected, deadline = conn.recv(), time.monotonic() + 5
        elif deadline is not None and time.monotonic() > deadline:
            break  # the rest is lost
    conn.send(received)
    context.destroy(linger=0)


def subscriber_cost(
    subscribers: int, ipc: bool, rate: int = 10, seconds: float = 5.0
) -> dict[str, Any]:
    """64 workers' publishers and `subscribers` bare subscribers (`_bare_subscriber`): the
    publishers' CPU and ZeroMQ I/O time per batch, and what each subscriber missed."""
    with ExitStack() as stack:
        folder = stack.enter_context(tempfile.TemporaryDirectory()) if ipc else None
        publishers = stack.enter_context(child(publish_workers, 64, seconds, rate, 0, folder))
        endpoints = publishers.recv()
        conns = [
            stack.enter_context(child(_bare_subscriber, endpoints)) for _ in range(subscribers)
        ]
        for conn in conns:
            assert conn.recv() == "ready"
        publishers.send(subscribers)
        published: _Published = publishers.recv()
        for conn in conns:
            conn.send(sum(published.accepted))
        received = [conn.recv() for conn in conns]
        publishers.send("done")
    return {
        "publisher_cpu_us": published.cpu * 1e6,
        "publisher_io_us": published.io * 1e6,
        "missed": sum(sum(published.accepted) - got for got in received),
    }


def watch_scale(
    workers: int,
    routers: int = 1,
    processes: int = 0,
    rate: int = 50,
    seconds: float = 5.0,
    cached: int = 0,
    ipc: bool = False,
    nice: int = 0,
) -> dict[str, Any]:
    """One run: the publishers, `routers` routers, and what each measured. `ipc`: the workers
    publish on ipc endpoints (Unix sockets) instead of loopback TCP. `nice`: the routers' and
    their readers' niceness, so that on a machine with fewer cores than processes they do not
    take the publishers' process off its core (a fleet's routers run on other machines)."""
    with ExitStack() as files:
        folder = files.enter_context(tempfile.TemporaryDirectory()) if ipc else None
        return _watch_scale(workers, routers, processes, rate, seconds, cached, folder, nice)


def _watch_scale(
    workers: int,
    routers: int,
    processes: int,
    rate: int,
    seconds: float,
    cached: int,
    ipc: str | None,
    nice: int,
) -> dict[str, Any]:
    with child(publish_workers, workers, seconds, rate, cached, ipc) as publishers:
        endpoints = publishers.recv()
        with ExitStack() as stack:
            conns = [
                stack.enter_context(child(_router, endpoints, processes, cached, nice))
                for _ in range(routers)
            ]
            for conn in conns:
                assert conn.recv() == "ready"
            if cached:  # the bootstrap is measured while the workers publish
                publishers.send(0)  # routers subscribe once they are told the workers
            for conn in conns:
                conn.send("go")
            for conn in conns:
                assert conn.recv() == "current"
            if cached:  # each router measures its steady state, then the rounds stop
                publishers.send("current")
                for conn in conns:
                    assert conn.recv() == "measured"
                publishers.send("stop")
            else:  # the publishers' CPU a batch is measured with every router current:
                publishers.send(routers)  # connecting and bootstrapping cost them once, not a batch
            published: _Published = publishers.recv()
            for conn in conns:
                conn.send(published.accepted)
            answers = [conn.recv() for conn in conns]
        publishers.send("done")

    def worst(name: str) -> Any:
        return max(answer[name] for answer in answers)

    behind = sum(
        1
        for answer in answers
        for (last, _), want in zip(answer["report"], published.accepted, strict=True)
        if last is None or last < want - 1
    )
    return {
        **answers[0],
        "cpu_us": worst("cpu_us"),
        "total_cpu_us": worst("total_cpu_us"),
        "behind": behind,
        "losses": sum(lost for answer in answers for _, lost in answer["report"]),
        "late_rounds": published.late,
        "rounds": published.rounds,
        "publisher_cpu_us": published.cpu * 1e6,
        "publisher_io_us": published.io * 1e6,  # of publisher_cpu_us: ZeroMQ's I/O thread
        "publisher_bootstrap_cpu_s": published.bootstrap_cpu,
    }
