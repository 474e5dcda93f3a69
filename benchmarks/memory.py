"""What a publisher's memory does: the replay buffer as it fills, and idle replay clients."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

import trio
import trio.testing
import zmq

from benchmarks.helpers import fmt, in_fresh_process, rss
from benchmarks.rounds import round_makers
from tskv.core import frames
from tskv.core.codec import encode_round
from tskv.core.config import KVEventsConfig
from tskv.core.endpoints import LOOPBACK
from tskv.shells.publisher import open_publisher


def _buffer_growth(conn: Connection) -> None:
    """In a fresh process (so earlier runs' freed memory cannot hide the growth)."""
    make = round_makers("small")["tskv"]

    async def main() -> int:
        config = KVEventsConfig(endpoint=LOOPBACK, buffer_steps=10_000)
        async with open_publisher(config) as publisher:
            for _ in range(100):
                await publisher.publish(make())
            await trio.testing.wait_all_tasks_blocked()
            gc.collect()
            before = rss()
            for _ in range(10_000):
                await publisher.publish(make())
            await trio.testing.wait_all_tasks_blocked()
            gc.collect()
            return rss() - before

    conn.send(trio.run(main))


def _idle_replay_clients(clients: int, conn: Connection) -> None:
    """Publisher growth while `clients` replay clients each ask for the whole buffer and never
    read a reply (in a fresh process)."""
    make = round_makers("small")["tskv"]

    async def main() -> int:
        config = KVEventsConfig(endpoint=LOOPBACK, replay_endpoint=LOOPBACK, buffer_steps=10_000)
        async with open_publisher(config) as publisher:
            for _ in range(10_000):
                await publisher.publish(make())
            await trio.testing.wait_all_tasks_blocked()
            gc.collect()
            before = rss()
            assert publisher.replay_endpoint is not None
            sockets: list[zmq.Socket[bytes]] = []
            for _ in range(clients):
                dealer: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
                dealer.setsockopt(zmq.RCVHWM, 1)
                dealer.setsockopt(zmq.RCVBUF, 4096)
                dealer.connect(publisher.replay_endpoint)
                dealer.send_multipart(frames.replay_request(0))
                sockets.append(dealer)
            await trio.sleep(3)  # every replay has filled its pipe, then stalled
            grown = rss() - before
            for dealer in sockets:
                dealer.close(linger=0)
            return grown

    conn.send(trio.run(main))


CORE_ROUNDS = 100_000  # of ten calls into the compiled core each: a million operations


def _compiled_core_loop(conn: Connection) -> None:
    """Resident memory across a million calls into the compiled core, in steady state (what is
    stored is let go of again): every entry point, with ids in the slots and beside them (a
    tiered block's), a query answered, a plain batch read from its bytes and its run keyed. A
    leak of a few bytes a call would be megabytes here (in a fresh process)."""
    from tskv.core import compiled
    from tskv.core.block_keys import PLAIN_ROOT
    from tskv.core.events import BlockStored
    from tskv.core.prefix_index import Match

    core = compiled.core
    if core is None:
        conn.send(None)
        return
    table, blocks = core.KeyTable(), core.BlockMap()
    matcher = core.Matcher(table, 4)
    usual = Match({}, frozenset({"w"}), None, None, 4, ("w",))
    held = {hash((PLAIN_ROOT, (1, 2, 3, 4))): 1}
    table.update(held)
    roots = {(None, None): PLAIN_ROOT}

    def one_round(n: int) -> None:
        base = (n % 1_000) * 8
        tokens = list(range(base, base + 8))
        keys = core.chain(PLAIN_ROOT, [tuple(tokens[:4]), tuple(tokens[4:])])
        assert keys is not None
        table.add_new(keys, 2)
        matcher.set_answer(("w",), usual)
        matcher(PLAIN_ROOT, [1, 2, 3, 4, *tokens])
        core.walk(table, None, PLAIN_ROOT, tokens, 4, [])
        table.let_go(keys, 2)
        ids = [base, base + 1, ("CPU", None, base + 2)]
        blocks.add_new(ids[:2], keys)
        blocks[ids[2]] = None
        blocks.pop_many(ids, None)
        payload = encode_round(float(n), [BlockStored([base], None, tokens[:4], 4)], 0)
        read = core.read_plain(payload, 4)
        assert read is not None
        core.read_run(read[2], 4, blocks, PLAIN_ROOT)
        core.plain_run(
            [(BlockStored([base], None, tokens, 4), None)], 4, blocks, roots, BlockStored
        )
        core.pack_keys(keys)

    for n in range(CORE_ROUNDS // 10):  # warm: every list and dict at the size it keeps
        one_round(n)
    gc.collect()
    before = rss()
    for n in range(CORE_ROUNDS):
        one_round(n)
    gc.collect()
    conn.send((rss() - before, len(table) + len(blocks)))


def memory_section(out: Callable[[str], None], reps: int) -> None:
    """Each figure from `reps` fresh processes."""
    out("\n## Memory (resident growth, each measured in a fresh process)\n")
    samples = [in_fresh_process(_buffer_growth) for _ in range(reps)]
    payload = encode_round(time.time(), round_makers("small")["tskv"](), 0)
    assert payload is not None
    out(f"- per 10,000 buffered small batches: {fmt(samples, ' MiB', 2**-20, 1)}")
    size = len(payload)
    out(f"- the payloads themselves: {size * 10_000 / 2**20:.1f} MiB ({size} B each)")
    idle = [in_fresh_process(_idle_replay_clients, 50) for _ in range(reps)]
    grown = fmt(idle, " MiB", 2**-20, 1)
    out(f"- 50 replay clients asking for 10,000 batches, never reading: {grown}")
    core = [in_fresh_process(_compiled_core_loop) for _ in range(reps)]
    if None in core:
        out("- the compiled core over a million operations: not built here")
        return
    growth = fmt([grown for grown, _ in core], " MiB", 2**-20, 2)
    left = sorted({entries for _, entries in core})
    out(
        f"- the compiled core over a million calls (every entry point, steady state: "
        f"{left} entries left at the end): {growth}"
    )
