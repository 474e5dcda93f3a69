"""What the `Sequencer` tells its subscriber to do: deliver a batch or a snapshot, report a
loss or a silence, send a request. Values only; the subscriber carries them out in order."""

from __future__ import annotations

from typing import NamedTuple

import attrs

from tskv.core.losses import Loss


class Deliver(NamedTuple):
    """A batch for the consumer, in order: one per batch, so a tuple, the cheapest value to make."""

    seq: int
    payload: bytes
    repaired: bool  # fetched from replay to fill a hole (a start_seq bootstrap's batches are not)


class DeliverSnapshot(NamedTuple):
    """A snapshot's parts, to deliver as one batch under `seq` (the state after that seq).
    `replaced` is the first seq it stands in for (None for a bootstrap the consumer asked
    for): the subscriber reports `replaced..seq` once the parts decode."""

    seq: int
    payloads: list[bytes]
    replaced: int | None


@attrs.frozen
class RequestReplay:
    """Ask the replay endpoint for what came from `start_seq` on: a hole to fill, or a probe."""

    start_seq: int
    request_id: int
    probe: bool = False  # asked because the stream went quiet: a refusal proves it alive


@attrs.frozen
class RequestSnapshot:
    """Ask the replay endpoint for the publisher's state: the gap is past its buffer."""

    request_id: int


@attrs.frozen
class Silence:
    """The publisher stopped answering (`silent`: its replay endpoint did not answer a probe of
    a quiet stream), or answers again. Nothing is known lost; what it holds is unknown."""

    silent: bool
    last_seq: int | None  # the last seq delivered before (or after) the silence
    disconnected: bool = False  # found out by the live connection dropping, not by a probe


@attrs.frozen
class SnapshotTooLarge:
    """A snapshot's parts passed `max_snapshot_bytes` (at `size` bytes): it was given up, and
    no more are asked for (the next would be as large). What it would restore is lost."""

    size: int


@attrs.frozen
class Synced:
    """The publisher's sequence, followed from its start, has published nothing yet: its cache
    is empty, and a consumer that has forgotten the old one holds all of it (a restarted
    engine that publishes nothing is no longer to be doubted)."""


Action = (
    Deliver
    | DeliverSnapshot
    | Loss
    | RequestReplay
    | RequestSnapshot
    | Silence
    | SnapshotTooLarge
    | Synced
)
