"""The watcher keeps a PrefixIndex equal to every worker's cache, on real sockets, and says
which workers it cannot vouch for."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from typing import Any

import attrs
import pytest
import trio
import trio.testing
import zmq

import tskv
from tests.zmq_helpers import LOOPBACK, free_loopback_port, publish_parts
from tskv import AllBlocksCleared, BlockStored, LossReason
from tskv.core import compiled
from tskv.core.prefix_index import Worker
from tskv.core.read_batch import ReadBatch
from tskv.core.snapshot import PART_BLOCKS
from tskv.shells._following import Bootstraps, follow
from tskv.shells._snapshot_parts import SnapshotParts
from tskv.sim import Simulator, Workload, run_round
from tskv.testing import CORRUPT_PAYLOAD, ScriptedPublisher


@pytest.fixture(params=[0, 2], ids=["here", "in-readers"])
def processes(request: pytest.FixtureRequest) -> int:
    """Every test runs with the workers followed in this process and in reader processes."""
    value: int = request.param
    return value


CONFIG = tskv.KVEventsConfig(endpoint=LOOPBACK, replay_endpoint=LOOPBACK, buffer_steps=20)


async def test_the_index_equals_every_workers_cache_joined_early_or_late(processes: int) -> None:
    index = tskv.PrefixIndex(16)
    async with tskv.open_publisher(CONFIG, 0) as a, tskv.open_publisher(CONFIG, 1) as b:
        workers = {("a", 0): a, ("b", 1): b}
        sims = {name: (Simulator(64, 16), Workload(seed, 16)) for seed, name in enumerate(workers)}

        async def rounds(count: int) -> None:
            for _ in range(count):
                for name, publisher in workers.items():
                    sim, workload = sims[name]
                    events = run_round(sim, workload, 1)
                    if events:
                        await publisher.publish(events)

        await rounds(100)  # far past the 20-batch buffer before anyone watches
        async with tskv.open_watcher(index, processes=processes) as watcher:
            for name, publisher in workers.items():
                watcher.add(name, publisher.endpoint, publisher.replay_endpoint)
            assert index.stale == set(workers)  # nothing known yet
            await rounds(50)
            with trio.fail_after(20):
                for name, publisher in workers.items():
                    await publisher.wait_for_subscriber()
                    await watcher.wait_for_seq(name, publisher.statistics().accepted - 1)
            for name, (sim, _) in sims.items():
                held, cached = await watcher.engine_hashes(name), sim.cached_hashes()
                assert held == cached, (
                    name,
                    len(held - cached),
                    len(cached - held),
                    watcher.status(name),
                )
            assert not index.stale  # each started from a snapshot: whole
            watcher.remove(("a", 0))
            assert index.workers == [("b", 1)] and watcher.workers == [("b", 1)]


async def test_a_loss_marks_the_worker_stale_until_its_view_is_whole_again(
    processes: int,
    tskv_scripted: ScriptedPublisher,
) -> None:
    tskv_scripted.snapshots = False  # a publisher that cannot restore a lost view
    index = tskv.PrefixIndex(2)
    async with tskv.open_watcher(index, processes=processes) as watcher:
        watcher.add("w", tskv_scripted.endpoint, tskv_scripted.replay_endpoint)
        with trio.fail_after(10):
            await tskv_scripted.wait_for_subscriber()
        assert index.stale == {"w"}  # nothing known of it yet
        tskv_scripted.send([BlockStored([1], None, [1, 1], 2)])
        tskv_scripted.send([BlockStored([2], None, [2, 2], 2)])
        with trio.fail_after(10):
            await watcher.wait_for_seq("w", 1)
        # Followed from seq 0 (no snapshot here: the bootstrap fell back to replay): whole.
        assert index.match([2, 2]) == {"w": 1} and not index.match([2, 2]).stale
        tskv_scripted.skip(3)  # lost for good: this publisher has no snapshots
        tskv_scripted.send([BlockStored([3], None, [3, 3], 2)])
        with trio.fail_after(10):
            await watcher.wait_for_seq("w", 5)
        result = index.match([3, 3])
        assert result == {"w": 1} and result.stale == {"w"}  # known to be incomplete
        assert watcher.status("w").losses == 1
        tskv_scripted.send([AllBlocksCleared(), BlockStored([4], None, [4, 4], 2)])
        with trio.fail_after(10):
            await watcher.wait_for_seq("w", 6)
        assert await watcher.engine_hashes("w") == {4}
        assert index.match([4, 4]) == {"w": 1} and not index.stale  # whole again


async def a_hole_replay_cannot_fill(watcher: tskv.Watcher, scripted: ScriptedPublisher) -> None:
    """Worker "w" gets seq 0; seqs 1 and 2 are gone from the buffer (a snapshot has them); then
    seq 3 is followed."""
    watcher.add("w", scripted.endpoint, scripted.replay_endpoint)
    with trio.fail_after(10):
        await scripted.wait_for_subscriber()
    scripted.send([BlockStored([1], None, [1, 1], 2)])
    with trio.fail_after(10):
        await watcher.wait_for_seq("w", 0)
    scripted.skip(2)
    scripted.send([BlockStored([4], 1, [4, 4], 2)])
    with trio.fail_after(10):
        await watcher.wait_for_seq("w", 3)


async def test_a_hole_is_repaired_from_a_snapshot_and_the_worker_is_whole_again(
    processes: int,
    tskv_scripted: ScriptedPublisher,
) -> None:
    index = tskv.PrefixIndex(2)
    losses: list[tuple[object, tskv.Loss]] = []
    async with tskv.open_watcher(
        index, processes=processes, on_loss=lambda w, loss: losses.append((w, loss))
    ) as watcher:
        await a_hole_replay_cannot_fill(watcher, tskv_scripted)
    assert [(w, loss.reason) for w, loss in losses] == [("w", LossReason.SNAPSHOT)]
    assert index.match([1, 1, 4, 4]) == {"w": 2} and not index.stale


async def test_a_snapshot_over_the_limit_leaves_the_hole_reported_and_the_worker_stale(
    processes: int,
    tskv_scripted: ScriptedPublisher,
) -> None:
    """The limit holds in the reader processes too (there it is the reader that gathers): the
    bootstrap's snapshot is over it, so no snapshot is asked for again and the hole stays."""
    index = tskv.PrefixIndex(2)
    losses: list[tuple[object, tskv.Loss]] = []
    async with tskv.open_watcher(
        index,
        processes=processes,
        on_loss=lambda w, loss: losses.append((w, loss)),
        max_snapshot_bytes=10,
    ) as watcher:
        await a_hole_replay_cannot_fill(watcher, tskv_scripted)
    assert [(w, loss.reason) for w, loss in losses] == [("w", LossReason.EVICTED)]
    assert tskv_scripted.replay_requests[0] is None  # the bootstrap's snapshot, given up
    assert tskv_scripted.replay_requests.count(None) == 1 and index.stale == {"w"}


async def test_one_workers_failure_does_not_stop_the_others(
    processes: int, tmp_path: object
) -> None:
    index = tskv.PrefixIndex(2)
    async with (
        tskv.open_publisher(CONFIG) as good,
        tskv.open_watcher(index, processes=processes) as watcher,
    ):
        watcher.add("broken", good.endpoint, curve_server_key="/nonexistent/server.key")
        watcher.add("good", good.endpoint, good.replay_endpoint)
        with trio.fail_after(10):
            await good.wait_for_subscriber()
            await good.publish([BlockStored([1], None, [1, 1], 2)])
            await watcher.wait_for_seq("good", 0)
            await watcher.wait_for_failure("broken")
        assert index.match([1, 1]) == {"good": 1}
        assert watcher.status("broken").failures >= 1
        assert "nonexistent" in (watcher.status("broken").last_error or "")
        assert index.stale == {"broken"}
        watcher.remove("broken")
        assert index.stale == frozenset()


async def test_a_worker_whose_publisher_goes_silent_is_stale_until_it_answers(
    processes: int,
    tskv_scripted: ScriptedPublisher,
) -> None:
    """The publisher stops answering (replay silent, as a process that is gone): the worker
    is marked stale and best() passes it over; when it answers again with nothing lost, it is
    trusted again."""
    index = tskv.PrefixIndex(2)
    async with tskv.open_watcher(index, processes=processes, quiet_interval=0.2) as watcher:
        watcher.add("w", tskv_scripted.endpoint, tskv_scripted.replay_endpoint)
        watcher.add("other", tskv_scripted.endpoint)  # the same stream, never probed
        with trio.fail_after(10):
            await tskv_scripted.wait_for_subscriber(count=2)  # from seq 0, both
        tskv_scripted.send([AllBlocksCleared(), BlockStored([1], None, [1, 1], 2)])
        with trio.fail_after(10):
            await watcher.wait_for_seq("w", 0)
            await watcher.wait_for_seq("other", 0)
        assert not index.match([1, 1]).stale
        tskv_scripted.replay_mode = "never"
        with trio.fail_after(10):
            await watcher.wait_for_silence("w")
        result = index.match([1, 1])
        assert result.stale == {"w"} and result.best() == ("other", 1)
        assert watcher.status("w").losses == 0 and watcher.status("w").silent
        tskv_scripted.replay_mode = "answer"
        with trio.fail_after(10):
            await watcher.wait_for_silence("w", silent=False)
        assert not index.match([1, 1]).stale


async def test_a_worker_that_has_published_nothing_yet_is_current_once_its_snapshot_is_in(
    processes: int,
) -> None:
    """A fresh worker's cache is empty and known to be: a router that passes over stale
    workers must not pass over every idle one (it once sent a whole trace to the first worker
    that published)."""
    config = tskv.KVEventsConfig(endpoint=LOOPBACK, replay_endpoint=LOOPBACK)
    index = tskv.PrefixIndex(block_size=4)
    async with (
        tskv.open_publisher(config) as idle,
        tskv.open_watcher(index, processes=processes) as watcher,
    ):
        watcher.add("idle", idle.endpoint, idle.replay_endpoint)
        assert "idle" in index.stale
        with trio.fail_after(10):
            await watcher.wait_for_seq("idle", -1)  # the empty snapshot, the state before seq 0
        assert index.stale == frozenset() and index.workers == ["idle"]
        await idle.publish([BlockStored([1], None, [1, 2, 3, 4], 4)])
        with trio.fail_after(10):
            await watcher.wait_for_seq("idle", 0)
        assert index.match([1, 2, 3, 4]) == {"idle": 1} and watcher.status("idle").losses == 0


async def test_a_reader_process_that_dies_is_started_again_and_its_workers_bootstrap() -> None:
    config = tskv.KVEventsConfig(endpoint=LOOPBACK, replay_endpoint=LOOPBACK)
    index = tskv.PrefixIndex(block_size=2)
    async with (
        tskv.open_publisher(config) as publisher,
        tskv.open_watcher(index, processes=1) as watcher,
    ):
        watcher.add("w", publisher.endpoint, publisher.replay_endpoint)
        await publisher.publish([BlockStored([1], None, [1, 1], 2)])
        with trio.fail_after(20):
            await watcher.wait_for_seq("w", 0)
        (reader,) = watcher.readers
        assert reader.pid is not None and reader.cpu_seconds > 0
        os.kill(reader.pid, signal.SIGKILL)
        with trio.fail_after(20):
            await watcher.wait_for_failure("w")  # its reader went: stale, its holds forgotten
        assert index.stale == {"w"} and index.match([1, 1]) == {}
        await publisher.publish([BlockStored([2], 1, [2, 2], 2)])
        with trio.fail_after(30):
            await watcher.wait_for_seq("w", 1)  # from the new reader's snapshot
        assert index.match([1, 1, 2, 2]) == {"w": 2} and not index.stale
        assert await watcher.engine_hashes("w") == {1, 2}
        (reader,) = watcher.readers
        assert reader.restarts == 1 and watcher.status("w").batches >= 2


async def test_what_a_reader_process_cannot_do_is_refused_naming_the_fix() -> None:
    index = tskv.PrefixIndex()
    with pytest.raises(TypeError, match="context cannot be shared with reader processes"):
        async with tskv.open_watcher(index, processes=1, context=zmq.Context.instance()):
            pass  # pragma: no cover
    with pytest.raises(tskv.ConfigError, match="processes = -1"):
        async with tskv.open_watcher(index, processes=-1):
            pass  # pragma: no cover
    async with tskv.open_watcher(index, processes=1) as watcher:
        with pytest.raises(ValueError, match=r"use ipc:// or tcp://127\.0\.0\.1"):
            watcher.add("w", "inproc://here")
        assert watcher.workers == []
    with pytest.raises(LookupError, match=r"await watcher\.engine_hashes"):
        mirror = tskv.PrefixIndex()
        mirror.apply_changes("w", [[1]])
        mirror.engine_hashes("w")


async def test_a_wait_for_a_worker_removed_meanwhile_raises_instead_of_hanging() -> None:
    index = tskv.PrefixIndex()
    async with tskv.open_watcher(index) as watcher:
        watcher.add("w", "tcp://127.0.0.1:9")  # nothing publishes there

        async def remove_soon() -> None:
            await trio.testing.wait_all_tasks_blocked()
            watcher.remove("w")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(remove_soon)
            with pytest.raises(KeyError, match="was removed while waited for"):
                await watcher.wait_for_seq("w", 0)


async def test_snapshots_are_taken_a_few_at_a_time_and_one_that_never_comes_holds_no_one(
    processes: int,
) -> None:
    config = tskv.KVEventsConfig(endpoint=LOOPBACK, replay_endpoint=LOOPBACK)
    index = tskv.PrefixIndex(block_size=2)
    async with tskv.open_publisher(config, 0) as a, tskv.open_publisher(config, 1) as b:
        for rank, publisher in enumerate((a, b)):
            await publisher.publish([BlockStored([rank], None, [rank, rank], 2)])
        async with tskv.open_watcher(
            index, processes=processes, snapshots_at_once=1, replay_timeout=0.5
        ) as watcher:
            # First in line: a worker whose replay endpoint nothing answers.
            watcher.add(
                "gone",
                f"tcp://127.0.0.1:{free_loopback_port()}",
                f"tcp://127.0.0.1:{free_loopback_port()}",
            )
            watcher.add("a", a.endpoint, a.replay_endpoint)
            watcher.add("b", b.endpoint, b.replay_endpoint)
            with trio.fail_after(20):
                await watcher.wait_for_seq("a", 0)
                await watcher.wait_for_seq("b", 0)
            assert index.match([0, 0]) == {"a": 1} and index.match([1, 1]) == {"b": 1}
            assert index.stale == {"gone"}
    with pytest.raises(tskv.ConfigError, match="snapshots_at_once = 0"):
        async with tskv.open_watcher(index, snapshots_at_once=0):
            pass  # pragma: no cover


class _KeepingRecord:
    """A follow loop's record that keeps the last batch (or snapshot part) it was given, and
    nothing else."""

    def __init__(self) -> None:
        self.index = tskv.PrefixIndex(2)  # its block size: the follower reads batches for it
        self.batch: tskv.KVEventBatch | ReadBatch | None = None
        self.got = trio.Event()

    def watching(self, worker: Worker) -> bool:
        return True

    async def room(self) -> None:
        pass

    def has_room(self) -> bool:
        return True

    def applied(self, worker: Worker, seq: int, batch: tskv.KVEventBatch | ReadBatch) -> None:
        self.batch = batch
        self.got.set()

    async def restored(self, worker: Worker, seq: int, snapshot: SnapshotParts) -> None:
        async for part in snapshot:
            self.applied(worker, seq, part)

    def lost(self, worker: Worker, loss: tskv.Loss) -> None:
        pass

    def silence(self, worker: Worker, silent: bool) -> None:
        pass

    def failed(self, worker: Worker, error: str, retry_in: float) -> None:
        raise AssertionError(error)

    def resubscribed(self, worker: Worker) -> None:
        pass


async def test_a_quiet_workers_task_does_not_keep_the_snapshot_it_applied() -> None:
    """A snapshot's events are tens of MB: kept until the worker's next batch, a bootstrap of
    many quiet workers held many at once (a reader's memory grew 826-850 bytes a block
    where 257-259 stay)."""
    config = tskv.KVEventsConfig(endpoint=LOOPBACK, replay_endpoint=LOOPBACK)
    record = _KeepingRecord()
    async with tskv.open_publisher(config) as publisher:
        await publisher.publish([BlockStored([1, 2], None, [1, 1, 2, 2], 2)])
        subscriber = tskv.SubscriberConfig(start_seq="snapshot")
        endpoints = (publisher.endpoint, publisher.replay_endpoint)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(follow, record, "w", *endpoints, subscriber, None, Bootstraps(1))
            with trio.fail_after(10):
                await record.got.wait()
            await trio.testing.wait_all_tasks_blocked()  # it waits for the worker's next batch
            assert record.batch is not None and len(record.batch.events) == 2  # clear, store
            # The record's reference and the call's own, no other (CPython counts them; outside
            # the assert, whose rewriting keeps one more).
            references = sys.getrefcount(record.batch)
            assert references == 2
            nursery.cancel_scope.cancel()


async def test_the_index_process_lets_other_tasks_run_while_it_applies_a_readers_frame(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A reader sends many batches' news in one frame: applied in one go, a frame held the
    router's loop (its queries) for tens of ms. (The index's process yields every 4 reports
    here, not 64: a report carries up to 8 batches, and a frame of this burst a dozen.)"""
    from tskv.core.reader_messages import News, Report
    from tskv.shells import _reader_process
    from tskv.shells._background import Pacer
    from tskv.shells._reader_mirror import ReaderMirror
    from tskv.shells._reader_process import Reader

    ticks = 0
    frames = 0
    seen: list[tuple[int, int]] = []  # (frame, ticks) at each report applied
    take, mirrored = Reader._take, ReaderMirror.report

    async def counted_take(self: Reader, news: News, pacer: Any) -> None:
        nonlocal frames
        frames += 1
        await take(self, news, pacer)

    def counted_mirrored(self: ReaderMirror, worker: Worker, report: Report) -> None:
        seen.append((frames, ticks))
        mirrored(self, worker, report)

    monkeypatch.setattr(Reader, "_take", counted_take)
    monkeypatch.setattr(ReaderMirror, "report", counted_mirrored)
    monkeypatch.setattr(_reader_process, "Pacer", lambda: Pacer(every=4))
    index = tskv.PrefixIndex(16)
    async with (
        tskv.open_publisher(CONFIG) as publisher,
        tskv.open_watcher(index, processes=1) as watcher,
        trio.open_nursery() as nursery,
    ):

        async def tick() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await trio.lowlevel.checkpoint()

        nursery.start_soon(tick)
        watcher.add("w", publisher.endpoint, publisher.replay_endpoint)
        with trio.fail_after(20):
            await watcher.wait_for_seq("w", -1)
            for n in range(1_000):  # a burst: the reader's news of it comes in a few frames
                await publisher.publish([BlockStored([n], None, [n % 7] * 16, 16)])
            await watcher.wait_for_seq("w", 999)
        nursery.cancel_scope.cancel()
    by_frame: dict[int, set[int]] = {}
    for frame, at in seen:
        by_frame.setdefault(frame, set()).add(at)
    assert any(len(at) > 1 for at in by_frame.values()), "no frame let another task run"


class _NotingIndex(tskv.PrefixIndex):
    """An index that notes, as each batch is applied, its events and whether the worker was
    stale just before (what a query at that moment would have been told)."""

    def __init__(self) -> None:
        super().__init__(16)
        self.applied: list[tuple[int, bool]] = []
        self.read = 0  # batches the compiled core read (`read_batch`), not decoded

    def apply(
        self, worker: Worker, batch: tskv.KVEventBatch | ReadBatch | Iterable[tskv.KVEvent]
    ) -> None:
        assert isinstance(batch, (tskv.KVEventBatch, ReadBatch))
        self.read += isinstance(batch, ReadBatch)
        self.applied.append((len(batch.events), worker in self.stale))
        super().apply(worker, batch)


@asynccontextmanager
async def _watching_parts(
    index: tskv.PrefixIndex, parts: int, processes: int = 0
) -> AsyncIterator[tskv.Watcher]:
    """A publisher whose snapshot is `parts` parts, and a watcher following it as worker "w"."""
    config = tskv.KVEventsConfig(endpoint=LOOPBACK, replay_endpoint=LOOPBACK)
    async with (
        tskv.open_publisher(config) as publisher,
        tskv.open_watcher(index, processes=processes) as watcher,
    ):
        await publish_parts(publisher, parts)
        watcher.add("w", publisher.endpoint, publisher.replay_endpoint)
        yield watcher


async def test_a_snapshot_is_applied_a_part_at_a_time_and_is_stale_until_its_last() -> None:
    """Decoded whole before it was applied, a 50,000-block snapshot was about 35 MB of event
    objects at once, and indexing them ran out of the CPU's caches."""
    parts = 4
    index = _NotingIndex()
    async with _watching_parts(index, parts) as watcher:
        with trio.fail_after(20):
            await watcher.wait_for_seq("w", parts - 1)
        # The clear and the first part's store, then a store a part: stale before each.
        assert index.applied == [(2, True)] + [(1, True)] * (parts - 1)
        assert index.stale == set() and len(index) == parts * PART_BLOCKS
        assert watcher.status("w").batches == 1  # one delivery, however many parts
        assert index.read == (parts if compiled.core is not None else 0)


async def test_plain_live_batches_are_filed_as_the_compiled_core_reads_them() -> None:
    """A watcher's subscriber hands a plain batch to the compiled core, which keys its blocks
    from the payload's bytes; the index ends as the worker's cache all the same."""
    index = _NotingIndex()
    sim, workload = Simulator(64, 16), Workload(0, 16)
    async with tskv.open_publisher(CONFIG, 0) as publisher, tskv.open_watcher(index) as watcher:
        watcher.add("w", publisher.endpoint, publisher.replay_endpoint)
        with trio.fail_after(20):
            await publisher.wait_for_subscriber()
            for _ in range(30):
                events = run_round(sim, workload, 1)
                if events:
                    await publisher.publish(events)
            await watcher.wait_for_seq("w", publisher.statistics().accepted - 1)
        assert await watcher.engine_hashes("w") == sim.cached_hashes()
    live = len(index.applied)
    assert live >= 20 and index.read == (live if compiled.core is not None else 0)


async def test_a_snapshot_part_that_does_not_decode_leaves_the_worker_stale(
    tskv_scripted: ScriptedPublisher, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The parts before it are in the index by then: the worker must not look whole."""
    snapshot = ScriptedPublisher._snapshot

    def second_part_corrupt(self: ScriptedPublisher, *args: Any) -> list[list[bytes]]:
        replies = snapshot(self, *args)
        replies[1] = [*replies[1][:-1], CORRUPT_PAYLOAD]
        return replies

    monkeypatch.setattr(ScriptedPublisher, "_snapshot", second_part_corrupt)
    tskv_scripted.snapshot_part_blocks = 1
    parent = None
    for block in range(3):
        tskv_scripted.send([BlockStored([block], parent, [block] * 16, 16)])
        parent = block
    losses: list[tskv.Loss] = []
    index = _NotingIndex()
    on_loss = lambda worker, loss: losses.append(loss)  # noqa: E731
    async with tskv.open_watcher(index, on_loss=on_loss) as watcher:
        watcher.add("w", tskv_scripted.endpoint, tskv_scripted.replay_endpoint)
        with trio.fail_after(20):
            await watcher.wait_for_loss("w")
        assert losses == [tskv.Loss(0, 2, LossReason.UNDECODABLE)]
        assert index.applied == [(2, True)]  # the clear and block 0; then the bad part
        assert index.stale == {"w"} and index.match([0] * 16) == {"w": 1}
        assert watcher.status("w").last_seq is None  # nothing was delivered


async def test_a_reader_reports_a_snapshot_a_part_at_a_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Reported whole, a 50,000-block snapshot held the index process's loop, and the queries
    in it, for 25-50 ms."""
    from tskv.core.holdings import run_keys
    from tskv.shells._reader_mirror import ReaderMirror

    reports: list[tuple[int, bool]] = []  # each report that takes holds: how many, stale
    mirrored = ReaderMirror.report

    def noting(self: ReaderMirror, worker: Worker, report: Any) -> None:
        taken = sum(len(run_keys(run)) for run in report.changes[::2])
        if taken:
            reports.append((taken, report.figures.stale))
        mirrored(self, worker, report)

    monkeypatch.setattr(ReaderMirror, "report", noting)
    parts = 4
    index = tskv.PrefixIndex(16)
    async with _watching_parts(index, parts, processes=1) as watcher:
        with trio.fail_after(30):
            await watcher.wait_for_seq("w", parts - 1)
        assert reports == [(PART_BLOCKS, True)] * (parts - 1) + [(PART_BLOCKS, False)]
        assert index.stale == set() and len(index) == parts * PART_BLOCKS


async def test_a_worker_removed_while_its_snapshot_is_applied_stays_out_of_the_index() -> None:
    """Its follower is cancelled only at its next checkpoint; parts applied after `remove`
    would bring the worker back into the index, with no follower to keep it."""
    parts = 4
    first_part_in = trio.Event()

    class _Removing(_NotingIndex):
        def apply(self, worker: Worker, batch: Any) -> None:
            super().apply(worker, batch)
            first_part_in.set()

    index = _Removing()
    async with _watching_parts(index, parts) as watcher:
        with trio.fail_after(20):
            await first_part_in.wait()
        watcher.remove("w")
        await trio.testing.wait_all_tasks_blocked()
        assert "w" not in index.workers and len(index) == 0


async def test_a_worker_whose_block_size_or_hash_differs_is_named_once_with_both_values(
    processes: int, caplog: pytest.LogCaptureFixture
) -> None:
    """Asked at `add`, a tskv publisher says its block size and hash: a worker that cannot match
    the index is said so (one log line, its status), where before it matched nothing, silently."""
    index = tskv.PrefixIndex(16)
    said = {
        "same": attrs.evolve(CONFIG, block_size=16, hash_algorithm="sha256_cbor"),
        "other_size": attrs.evolve(CONFIG, block_size=32, hash_algorithm="sha256_cbor"),
        "other_hash": attrs.evolve(CONFIG, block_size=16, hash_algorithm="xxhash"),
    }
    async with (
        tskv.open_publisher(said["same"], 0) as same,
        tskv.open_publisher(said["other_size"], 1) as other_size,
        tskv.open_publisher(said["other_hash"], 2) as other_hash,
        tskv.open_watcher(index, processes=processes) as watcher,
    ):
        statuses = []
        for name, publisher in [
            ("same", same),
            ("other_size", other_size),
            ("other_hash", other_hash),
        ]:
            watcher.add(name, publisher.endpoint, publisher.replay_endpoint)
            with trio.fail_after(10):
                statuses.append(await watcher.described(name))
    assert [status.descriptor and status.descriptor.epoch for status in statuses] == [
        same.epoch,
        other_size.epoch,
        other_hash.epoch,
    ]
    assert [status.mismatch for status in statuses] == [
        None,
        "its block size is 32, the index's is 16",
        "its hash algorithm is xxhash, another worker's is sha256_cbor",
    ]
    lines = [
        record.getMessage() for record in caplog.records if "cannot be matched" in record.message
    ]
    assert len(lines) == 2 and "block size is 32, the index's is 16" in lines[0]


async def test_a_publisher_that_says_nothing_of_itself_is_followed_as_before(
    tskv_scripted: ScriptedPublisher,
) -> None:
    index = tskv.PrefixIndex(16)
    tskv_scripted.send([BlockStored([1], None, [0] * 16, 16)])
    async with tskv.open_watcher(index) as watcher:
        watcher.add("w", tskv_scripted.endpoint, tskv_scripted.replay_endpoint)
        with trio.fail_after(10):
            status = await watcher.described("w")
            await watcher.wait_for_seq("w", 0)
    assert (status.descriptor, status.mismatch) == (None, None)
    assert index.engine_hashes("w") == {1}


async def test_a_publisher_that_comes_up_after_its_worker_was_added_is_asked_again() -> None:
    """Added before its engine starts, the worker's first describe request goes unanswered;
    it is asked again, and its mismatch is said once the publisher is up."""
    live, replay = free_loopback_port(), free_loopback_port()
    config = tskv.KVEventsConfig(
        endpoint=f"tcp://127.0.0.1:{live}",
        replay_endpoint=f"tcp://127.0.0.1:{replay}",
        bind=True,
        block_size=8,
    )
    told = trio.Event()

    def on_status(worker: Worker, status: tskv.WorkerStatus) -> None:
        if status.mismatch is not None:
            told.set()

    index = tskv.PrefixIndex(4)
    async with tskv.open_watcher(index, on_status=on_status, replay_timeout=0.2) as watcher:
        watcher.add("late", config.endpoint, config.replay_endpoint)
        with trio.fail_after(10):
            first = await watcher.described("late")
        assert first.descriptor is None  # nothing listened yet
        async with tskv.open_publisher(config):
            with trio.fail_after(20):
                await told.wait()
        assert watcher.status("late").mismatch == "its block size is 8, the index's is 4"
