"""The publisher's replay serving, without I/O: requests in, replies out, one at a time.

The Trio shell (`publisher.py`) reads requests off the ROUTER and hands them to `receive`; it
asks `next_send` for the next message, tries to send it, and says how that went (`sent`,
`blocked`, `gone`). Everything else is decided here: who is refused, where a replay starts
and stops, how replies to many clients interleave, when a client that takes nothing is given
up on. The clock is injected, so all of it is tested without sockets or sleeps.

A snapshot request is served the same way, its parts made one at a time by a
`SnapshotBuilder` as they are sent; it counts against the same limits as a replay. So does a
describe request, answered with one message.

Every client of vLLM's protocol (vLLM's, TokenSpeed's and Dynamo's) reads the end of a replay
by its empty payload, not by its seq: what tskv's own clients are told at the end (the epoch, a
refusal's reason) goes only to a request in tskv's form (`frames.RequestForm`).
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable

import attrs

from tskv.core import frames
from tskv.core.config import KVEventsConfig
from tskv.core.frames import RequestForm
from tskv.core.replay_buffer import ReplayBuffer
from tskv.core.replay_limits import Peer, RequestGate
from tskv.core.snapshot import SnapshotBuilder

SLICE = 64  # replies to one client before the next client's turn
RETRY_AFTER = 0.001  # a full pipe is tried again this much later (a ROUTER has no POLLOUT per peer)
MAX_ONE_OFFS = 256  # refusal markers waiting to go out; beyond this a flooder gets none


class Outcome(enum.Enum):
    """What became of a request."""

    SERVED = "served"
    REFUSED = "refused"
    INVALID = "invalid"


@attrs.frozen
class Received:
    """What the replay server made of a request: the outcome the shell counts and logs."""

    outcome: Outcome
    detail: str = ""  # the refusal's reason, or what was wrong with the request


@attrs.frozen
class Outgoing:
    """A message for the shell to send. `seq` is None for the end marker, and for a one-off (a
    refusal's end marker, a descriptor) whose loss, if the client's pipe is full, costs
    nothing: its client asks again."""

    client: bytes
    frames: list[bytes]
    seq: int | None  # for a snapshot part, its index


@attrs.frozen
class Abandoned:
    """A replay given up on: the client left, or took nothing for too long."""

    client: bytes
    next_seq: int
    why: str


@attrs.define
class _Job:
    """One replay under way: where it is, where it stops, and when it may go on (the rate limit)."""

    client: bytes
    next_seq: int
    stop_seq: int  # the newest seq when the request came (or the per-request cap): ends there
    last_progress: float
    tskv: bool  # asked in tskv's form: its end says the epoch
    retry_at: float = 0.0
    in_slice: int = 0
    snapshot: SnapshotBuilder | None = None
    part: Outgoing | None = None  # a snapshot part made but not yet sent


@attrs.define
class _Counts:
    """The counters the server keeps; `statistics()` hands out a frozen copy."""

    requests: int = 0
    completed: int = 0
    abandoned: int = 0
    refused: int = 0
    superseded: int = 0  # ended by the same client's next request (served or refused)
    batches: int = 0
    invalid: int = 0
    snapshots: int = 0  # snapshot requests among `requests`; ...
    snapshots_completed: int = 0  # ...of those, how many were sent whole (in `completed` too)
    snapshot_parts: int = 0
    descriptors: int = 0  # describe requests (in `requests`)


@attrs.frozen
class ReplayStatistics(_Counts):
    """What the replay endpoint has done so far. Every request ends one way: requests ==
    refused + completed + abandoned + superseded + running."""

    running: int = 0  # replays (and snapshots) under way


class ReplayServer:
    """Replay jobs for every client of one publisher, served round-robin a slice at a time."""

    def __init__(
        self,
        buffer: ReplayBuffer,
        config: KVEventsConfig,
        topic: bytes | None,
        clock: Callable[[], float],
        snapshots: Callable[[], SnapshotBuilder] | None = None,
        epoch: int | None = None,
        describe: Callable[[], bytes] | None = None,
    ) -> None:
        self._buffer = buffer
        self.epoch = epoch  # said at the end of a tskv client's replay; None: says none
        self._describe = describe  # the encoded descriptor; None: describe requests end at once
        self._snapshots = snapshots  # None: snapshot requests end at once, as a replay past the end
        self._topic = topic  # the topic frame of vLLM's reply layout; None: TokenSpeed's
        self._client_timeout = config.replay_client_timeout
        self._gate = RequestGate(config, clock)
        self._clock = clock
        self._jobs: dict[bytes, _Job] = {}
        self._turns: deque[bytes] = deque()  # clients with a job, in serving order
        self._one_offs: deque[Outgoing] = deque()
        self._counts = _Counts()

    def receive(self, message: list[bytes], peer: Peer) -> Received:
        """Take one request off the ROUTER."""
        try:
            request = frames.parse_replay_request(message)
        except frames.FrameError as exc:
            self._counts.invalid += 1
            return Received(Outcome.INVALID, str(exc))
        client, form = request.client, request.form
        self._counts.requests += 1
        self._counts.snapshots += form is RequestForm.SNAPSHOT
        self._counts.descriptors += form is RequestForm.DESCRIBE
        active = client in self._jobs
        refusal = self._gate.refusal(peer, len(self._jobs), active)
        if refusal is not None:
            self._counts.refused += 1
            self._counts.superseded += active
            self._end_job(client)
            # vLLM's clients would read a reason as a batch: they get an empty end
            note = b"" if form is RequestForm.PLAIN else frames.refusal_note(refusal)
            self._one_off(frames.replay_end(client, self._topic, note))
            return Received(Outcome.REFUSED, refusal)
        if form is RequestForm.DESCRIBE:  # one message, and no replay of the client's ended
            self._counts.completed += 1
            if self._describe is None:
                self._one_off(frames.replay_end(client, self._topic))
            else:
                self._one_off(frames.descriptor_reply(client, self._describe()))
            return Received(Outcome.SERVED)
        # A client asking again replaces its earlier replay: it wants this one now.
        if active:
            self._counts.superseded += 1
        else:
            self._turns.append(client)
        now, tskv = self._clock(), form is not RequestForm.PLAIN
        if form is RequestForm.SNAPSHOT and self._snapshots is not None:
            job = _Job(client, 0, 0, now, tskv, snapshot=self._snapshots())
        else:
            first = self._buffer.first_at_or_after(request.start_seq)
            stop = self._gate.stop_seq(first, self._buffer.next_seq)
            job = _Job(client, first, stop, now, tskv)
        self._jobs[client] = job
        return Received(Outcome.SERVED)

    def _one_off(self, message: list[bytes]) -> None:
        if len(self._one_offs) < MAX_ONE_OFFS:
            self._one_offs.append(Outgoing(message[0], message, None))

    def _end_job(self, client: bytes) -> None:
        if self._jobs.pop(client, None) is not None:
            self._turns.remove(client)

    def next_send(self) -> Outgoing | None:
        """The next message to send, or None when every job waits for a full pipe."""
        if self._one_offs:
            return self._one_offs[0]
        now = self._clock()
        for _ in range(len(self._turns)):
            job = self._jobs[self._turns[0]]
            if job.retry_at <= now:
                return self._reply(job)
            self._turns.rotate(-1)
        return None

    def _reply(self, job: _Job) -> Outgoing:
        if job.snapshot is not None:
            return self._snapshot_part(job, job.snapshot)
        # Batches evicted while the replay ran are skipped; the client sees the hole.
        job.next_seq = self._buffer.first_at_or_after(job.next_seq)
        payload = self._buffer.get(job.next_seq) if job.next_seq < job.stop_seq else None
        if payload is None:
            return self._end(job)
        reply = frames.replay_reply(job.client, job.next_seq, payload, self._topic)
        return Outgoing(job.client, reply, job.next_seq)

    def _snapshot_part(self, job: _Job, snapshot: SnapshotBuilder) -> Outgoing:
        if job.part is None:  # made once, then tried until it is sent
            index = snapshot.parts_made
            payload = snapshot.next_payload()
            if payload is None:
                return self._end(job)
            part = frames.snapshot_part(job.client, snapshot.next_seq, index, payload)
            job.part = Outgoing(job.client, part, index)
        return job.part

    def _end(self, job: _Job) -> Outgoing:
        note = frames.epoch_note(self.epoch) if job.tskv else b""
        return Outgoing(job.client, frames.replay_end(job.client, self._topic, note), None)

    def sent(self, out: Outgoing) -> None:
        if self._one_offs and out is self._one_offs[0]:
            self._one_offs.popleft()
            return
        job = self._jobs[out.client]
        job.last_progress = self._clock()
        if out.seq is None:  # the end marker: this replay is complete
            self._counts.completed += 1
            self._counts.snapshots_completed += job.snapshot is not None
            self._end_job(out.client)
            return
        if job.snapshot is not None:
            job.part = None
            self._counts.snapshot_parts += 1
        else:
            self._counts.batches += 1
            job.next_seq = out.seq + 1
        job.in_slice += 1
        if job.in_slice >= SLICE:  # the next client's turn
            job.in_slice = 0
            self._turns.rotate(-1)

    def blocked(self, out: Outgoing) -> Abandoned | None:
        """The client's pipe is full: try again shortly, or give up on a client that takes
        nothing for `replay_client_timeout` seconds."""
        if self._one_offs and out is self._one_offs[0]:
            self._one_offs.popleft()  # a refusal nobody reads: not worth waiting for
            return None
        job = self._jobs[out.client]
        now = self._clock()
        if now - job.last_progress > self._client_timeout:
            return self._abandon(job, f"took nothing for {self._client_timeout:g} s")
        job.retry_at = now + RETRY_AFTER
        self._turns.rotate(-1)
        return None

    def gone(self, out: Outgoing) -> Abandoned | None:
        """The client disconnected before its message could be sent."""
        if self._one_offs and out is self._one_offs[0]:
            self._one_offs.popleft()
            return None
        return self._abandon(self._jobs[out.client], "left before its replay ended")

    def _abandon(self, job: _Job, why: str) -> Abandoned:
        self._counts.abandoned += 1
        self._end_job(job.client)
        return Abandoned(job.client, job.next_seq, why)

    def wait_time(self) -> float | None:
        """How long the shell may wait for requests before there is work: None for as long as
        it likes (no jobs), 0 if there is work now."""
        if self._one_offs:
            return 0.0
        if not self._jobs:
            return None
        now = self._clock()
        return max(0.0, min(job.retry_at for job in self._jobs.values()) - now)

    @property
    def active(self) -> int:
        return len(self._jobs)

    def statistics(self) -> ReplayStatistics:
        return ReplayStatistics(**attrs.asdict(self._counts), running=len(self._jobs))
