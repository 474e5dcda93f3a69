"""Test helpers: a real KV event stream, and the faults consumers must survive.

Every helper exists twice: an async context manager for Trio tests, and a blocking twin for
plain synchronous tests, whose Trio loop runs on a thread of its own (so consumers written with
threads or asyncio are testable). `tskv.pytest_plugin` turns them into fixtures.

- `open_scripted_publisher()` / `ScriptedPublisherThread`: the test says, batch by batch, what
  goes out live, what only the replay buffer holds, which seqs are skipped, when the sequence
  restarts, which payload is corrupt, whether replay answers, late or never, in TokenSpeed's
  or vLLM's layout, and whether it serves snapshots (as tskv's publisher does) or not (as
  TokenSpeed's and vLLM's do).
- `open_simulated_stream()` / `SimulatedStreamThread`: the simulated scheduler's deterministic
  stream for a workload seed, with the batches and final cache a consumer should end up with.
"""

from __future__ import annotations

import errno
import logging
import secrets
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from typing import Any, Literal

import attrs
import trio
import zmq

from tskv.core import frames
from tskv.core.codec import DroppedFields, encode_batch
from tskv.core.config import KVEventsConfig, did_you_mean
from tskv.core.endpoints import LOOPBACK, on_this_machine
from tskv.core.events import KVEvent, KVEventBatch
from tskv.core.frames import RequestForm
from tskv.core.snapshot import CacheState, SnapshotBuilder
from tskv.core.wire_format import WireFormat
from tskv.shells._background import background_tasks
from tskv.shells._trio_thread import TrioThread
from tskv.shells._trio_zmq import TrioSocket, open_socket
from tskv.shells.publisher import Publisher, open_publisher
from tskv.sim import Simulator, Workload, run_round

CORRUPT_PAYLOAD = b"\xc1 this is not msgpack"
ReplayLayout = WireFormat
ReplayMode = Literal["answer", "never", "refuse"]

logger = logging.getLogger(__name__)


class ScriptedPublisher:
    """A publisher that does exactly what the test says, on real loopback sockets.

    Settings (change them at any time): `wire_format` ("tokenspeed" or "vllm": how payloads
    are encoded and replies laid out), `replay_mode` ("answer", "never", or "refuse": end every
    request at once with a refusal, as a publisher over its replay limits does; read as each
    request arrives), `replay_delay`
    (seconds before each answer starts), `replay_layout` (None: as `wire_format`; or
    "tokenspeed": `["", seq, payload]`, "vllm": `["", topic, seq, payload]`, to mix the two),
    `rank` (put in each batch), `snapshots` (True: serve snapshot requests from the state the
    sent and dropped batches describe, `snapshot_part_blocks` blocks a part; False: end them at
    once, as a publisher without snapshots does), `epoch` (None: says none, as TokenSpeed's and
    vLLM's publishers; a number: said at the end of a tskv client's replay, and drawn anew by
    `restart()`). `replay_requests` lists the start seqs asked for, None for a snapshot;
    `describe_requests` counts the requests for a descriptor, each answered as a publisher
    without descriptors does: at once. Every event is checked in full when it is encoded
    (strict mode).
    """

    SETTINGS = (
        "wire_format",
        "replay_mode",
        "replay_delay",
        "replay_layout",
        "rank",
        "snapshots",
        "snapshot_part_blocks",
        "epoch",
    )

    def __init__(self, pub: TrioSocket, endpoint: str, topic: str, rank: int) -> None:
        self.endpoint = endpoint
        self.replay_endpoint: str | None = None  # set when the replay socket is open
        self.topic = topic
        self.rank = rank
        self.next_seq = 0
        self.buffer: dict[int, bytes] = {}  # what replay can give back, by seq
        self.replay_mode: ReplayMode = "answer"
        self.replay_delay = 0.0
        self.wire_format: WireFormat = "tokenspeed"
        self.replay_layout: ReplayLayout | None = None
        self.snapshots = True
        self.snapshot_part_blocks = 1024
        self.epoch: int | None = None
        self.state = CacheState()  # what the batches sent and dropped so far describe
        self.replay_requests: list[int | None] = []
        self.describe_requests = 0
        self._pub = pub
        self._subscriptions = 0
        self._dropped = DroppedFields(logger.warning)
        self._made = True  # from here on, a name that is no setting is a typo

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in self.SETTINGS and "_made" in vars(self) and name not in vars(self):
            raise AttributeError(
                f"ScriptedPublisher has no setting {name!r}{did_you_mean(name, set(self.SETTINGS))}"
                f"; its settings are {', '.join(self.SETTINGS)}"
            )
        object.__setattr__(self, name, value)

    def payload(self, events: Iterable[KVEvent], ts: float = 1.0) -> bytes:
        batch = KVEventBatch(ts, list(events), self.rank)
        return encode_batch(batch, self.wire_format, strict=True, dropped=self._dropped)

    async def wait_for_subscriber(self, count: int = 1) -> None:
        """Wait until `count` subscriptions for this topic have arrived (the slow-joiner
        problem), each subscriber's counted."""
        while self._subscriptions < count:
            message = await self._pub.receive()
            self._subscriptions += frames.parse_subscription(message[0], self.topic.encode())

    def _take(self, seq: int | None) -> int:
        if seq is None:
            seq = self.next_seq
        self.next_seq = seq + 1
        return seq

    def _send_live(self, seq: int, payload: bytes) -> None:
        self._pub.send_nowait(frames.live_message(self.topic.encode(), seq, payload))

    def send(
        self, events: Iterable[KVEvent], *, seq: int | None = None, payload: bytes | None = None
    ) -> int:
        """Publish a batch live and keep it for replay; returns its seq."""
        seq = self._take(seq)
        events = list(events)
        body = payload if payload is not None else self.payload(events)
        self.state.apply(body, events)
        self.buffer[seq] = body
        self._send_live(seq, body)
        return seq

    def send_stale(self, seq: int, events: Iterable[KVEvent], ts: float = 0.5) -> None:
        """A batch of a publisher since gone, read off its connection after this one came up
        (a SUB reads its connections' queues in turn): live at `seq`, in no replay buffer."""
        self._send_live(seq, self.payload(events, ts))

    def drop(self, events: Iterable[KVEvent]) -> int:
        """A batch lost on the way: only the replay buffer has it (a gap replay can repair)."""
        seq = self._take(None)
        events = list(events)
        self.buffer[seq] = self.payload(events)
        self.state.apply(self.buffer[seq], events)
        return seq

    def skip(self, count: int = 1) -> range:
        """Seqs neither sent nor kept: evicted from the buffer before anyone asked."""
        start = self.next_seq
        self.next_seq += count
        return range(start, self.next_seq)

    def evict(self, below: int) -> None:
        """Forget buffered batches older than `below`, as a full replay buffer does."""
        for seq in [seq for seq in self.buffer if seq < below]:
            del self.buffer[seq]

    def send_corrupt(self, payload: bytes = CORRUPT_PAYLOAD) -> int:
        """A batch whose payload does not decode, live and in the buffer."""
        return self.send((), payload=payload)

    def restart(self) -> None:
        """A new publisher on the same endpoints: seqs start again at 0, the buffer is empty."""
        self.next_seq = 0
        self.buffer.clear()
        self.state = CacheState()
        if self.epoch is not None:
            self.epoch = secrets.randbits(64)

    async def _serve_replay(self, router: TrioSocket) -> None:
        while True:
            message = await router.receive()
            try:
                request = frames.parse_replay_request(message)
            except frames.FrameError:
                continue
            client, form = request.client, request.form
            # Decided as the request is counted: a test that sees the count and then changes
            # the mode changes how the next request is answered, never this one.
            mode = self.replay_mode
            asks_state = form in (RequestForm.SNAPSHOT, RequestForm.DESCRIBE)
            if form is RequestForm.DESCRIBE:
                self.describe_requests += 1
            else:
                self.replay_requests.append(None if asks_state else request.start_seq)
            if mode == "never":
                continue
            await trio.sleep(self.replay_delay)
            layout = self.replay_layout or self.wire_format
            topic = self.topic.encode() if layout == "vllm" else None
            tskv = form is not RequestForm.PLAIN
            said = frames.epoch_note(self.epoch) if tskv else b""
            if mode == "refuse":
                note = frames.refusal_note("refused by the test's script") if tskv else b""
                replies = [frames.replay_end(client, topic, note)]
            elif form is RequestForm.SNAPSHOT and self.snapshots:
                replies = self._snapshot(client, topic, said)
            elif asks_state:  # as a publisher without them: a start past every seq
                replies = [frames.replay_end(client, topic, said)]
            else:
                start = request.start_seq
                replies = [
                    frames.replay_reply(client, seq, self.buffer[seq], topic)
                    for seq in sorted(seq for seq in self.buffer if seq >= start)
                ]
                replies.append(frames.replay_end(client, topic, said))
            try:
                for reply in replies:
                    await router.send(reply)
            except zmq.ZMQError as exc:
                if exc.errno != errno.EHOSTUNREACH:
                    raise
                # The client left before its replay was over: serve the next one.

    def _snapshot(self, client: bytes, topic: bytes | None, said: bytes) -> list[list[bytes]]:
        frozen = self.state.freeze(self.next_seq)
        builder = SnapshotBuilder(
            frozen, 1.0, self.rank, self.wire_format, self.snapshot_part_blocks
        )
        replies = []
        while (payload := builder.next_payload()) is not None:
            index = builder.parts_made - 1
            replies.append(frames.snapshot_part(client, frozen.next_seq, index, payload))
        replies.append(frames.replay_end(client, topic, said))
        return replies


def _socket(kind: int) -> tuple[TrioSocket, str]:
    return open_socket(zmq.Context.instance(), kind, LOOPBACK, bind=True, hwm=0)


@asynccontextmanager
async def open_scripted_publisher(
    topic: str = "", rank: int = 0, replay: bool = True
) -> AsyncIterator[ScriptedPublisher]:
    """A `ScriptedPublisher` on loopback ports the OS picks, with a replay endpoint unless
    `replay=False`."""
    pub, endpoint = _socket(zmq.XPUB)
    pub.sock.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscriber's subscription, counted
    router: TrioSocket | None = None
    try:
        scripted = ScriptedPublisher(pub, endpoint, topic, rank)
        async with background_tasks() as nursery:
            if replay:
                router, scripted.replay_endpoint = _socket(zmq.ROUTER)
                nursery.start_soon(scripted._serve_replay, router)
            yield scripted
    finally:
        pub.close()
        if router is not None:
            router.close()


@attrs.define
class SimulatedStream:
    """The simulated scheduler's stream for one workload seed, and what a consumer should see.

    `batches[seq]` are the events of batch `seq` (rounds with no events publish nothing), and
    `final_blocks` is the scheduler's cache at the end: a consumer that applied every batch
    holds exactly these blocks.
    """

    publisher: Publisher
    batches: list[list[KVEvent]]
    final_blocks: frozenset[int]

    @property
    def endpoint(self) -> str:
        return self.publisher.endpoint

    @property
    def replay_endpoint(self) -> str | None:
        return self.publisher.replay_endpoint

    async def play(self, wait_for_subscriber: bool = True) -> None:
        """Publish every batch, after a subscriber has joined unless told not to wait."""
        if wait_for_subscriber:
            await self.publisher.wait_for_subscriber()
        for events in self.batches:
            await self.publisher.publish(events)


def simulated_batches(
    seed: int,
    rounds: int,
    requests_per_round: int = 2,
    block_size: int = 16,
    cache_blocks: int = 256,
) -> tuple[list[list[KVEvent]], frozenset[int]]:
    """The batches a seeded simulated scheduler emits in `rounds` rounds, and its final cache."""
    sim = Simulator(cache_blocks, block_size)
    workload = Workload(seed, block_size)
    batches = [run_round(sim, workload, requests_per_round) for _ in range(rounds)]
    return [events for events in batches if events], sim.cached_hashes()


def kept_on_this_machine(config: KVEventsConfig) -> KVEventsConfig:
    """`config` with each endpoint other machines could reach moved to loopback (a port the
    OS picks); loopback, ipc and inproc endpoints, and no replay endpoint, stay as they are."""
    if not on_this_machine(config.endpoint):
        config = attrs.evolve(config, endpoint=LOOPBACK)
    if config.replay_endpoint is not None and not on_this_machine(config.replay_endpoint):
        config = attrs.evolve(config, replay_endpoint=LOOPBACK)
    return config


@asynccontextmanager
async def open_simulated_stream(
    seed: int = 0,
    rounds: int = 100,
    requests_per_round: int = 2,
    block_size: int = 16,
    cache_blocks: int = 256,
    topic: str = "",
    config: KVEventsConfig | None = None,
) -> AsyncIterator[SimulatedStream]:
    """A real publisher ready to play the seed's stream: on loopback with replay and a buffer
    that holds the whole stream, or with the settings of `config` if given (then `topic` is
    ignored: the config has its own). The stream stays on this machine whatever `config`
    says: an endpoint on any other address (the default `tcp://*:5557`, `0.0.0.0`, a host's
    address) is replaced by loopback on a port the OS picks."""
    batches, final = simulated_batches(seed, rounds, requests_per_round, block_size, cache_blocks)
    if config is not None:
        config = kept_on_this_machine(config)
    else:
        config = KVEventsConfig(
            endpoint=LOOPBACK,
            replay_endpoint=LOOPBACK,
            topic=topic,
            buffer_steps=max(len(batches), 1),
            strict=True,
        )
    async with open_publisher(config) as publisher:
        yield SimulatedStream(publisher, batches, final)


class ScriptedPublisherThread:
    """`ScriptedPublisher` for synchronous tests: the same methods, blocking."""

    def __init__(self, topic: str = "", rank: int = 0, replay: bool = True) -> None:
        self._loop = TrioThread(
            lambda: open_scripted_publisher(topic, rank, replay), "tskv-scripted-publisher"
        )
        self.scripted: ScriptedPublisher = self._loop.value

    def __enter__(self) -> ScriptedPublisherThread:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        self._loop.close()

    def __getattr__(self, name: str) -> Any:
        # Settings and read-only state (endpoints, replay_requests, next_seq) pass through.
        return getattr(self.scripted, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ScriptedPublisher.SETTINGS:
            self._loop.run_sync(setattr, self.scripted, name, value)
        elif name in ("_loop", "scripted"):
            object.__setattr__(self, name, value)
        else:
            raise AttributeError(
                f"{name!r} is not a setting of the scripted publisher; its settings are "
                f"{', '.join(ScriptedPublisher.SETTINGS)}"
            )

    def wait_for_subscriber(self, timeout: float = 10.0) -> None:
        async def wait() -> None:
            with trio.fail_after(timeout):
                await self.scripted.wait_for_subscriber()

        self._loop.run(wait)

    def send(
        self, events: Iterable[KVEvent], *, seq: int | None = None, payload: bytes | None = None
    ) -> int:
        return self._loop.run_sync(lambda: self.scripted.send(events, seq=seq, payload=payload))

    def send_stale(self, seq: int, events: Iterable[KVEvent], ts: float = 0.5) -> None:
        """A batch of a publisher since gone, read off its connection after this one came up
        (a SUB reads its connections' queues in turn): live at `seq`, in no replay buffer."""
        self._send_live(seq, self.payload(events, ts))

    def drop(self, events: Iterable[KVEvent]) -> int:
        return self._loop.run_sync(self.scripted.drop, events)

    def skip(self, count: int = 1) -> range:
        return self._loop.run_sync(self.scripted.skip, count)

    def evict(self, below: int) -> None:
        self._loop.run_sync(self.scripted.evict, below)

    def send_corrupt(self, payload: bytes = CORRUPT_PAYLOAD) -> int:
        return self._loop.run_sync(self.scripted.send_corrupt, payload)

    def restart(self) -> None:
        self._loop.run_sync(self.scripted.restart)


class SimulatedStreamThread:
    """`SimulatedStream` for synchronous tests; `play()` blocks until every batch is queued."""

    def __init__(self, **options: Any) -> None:
        self._loop = TrioThread(lambda: open_simulated_stream(**options), "tskv-simulated-stream")
        self.stream: SimulatedStream = self._loop.value
        self.batches = self.stream.batches
        self.final_blocks = self.stream.final_blocks
        self.endpoint = self.stream.endpoint
        self.replay_endpoint = self.stream.replay_endpoint

    def __enter__(self) -> SimulatedStreamThread:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def play(self, wait_for_subscriber: bool = True, timeout: float = 30.0) -> None:
        async def play() -> None:
            with trio.fail_after(timeout):
                await self.stream.play(wait_for_subscriber)

        self._loop.run(play)

    def close(self) -> None:
        self._loop.close()
