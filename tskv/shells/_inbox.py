"""What the subscriber's tasks put in its inbox, for the consumer's task to hand to the
Sequencer: live messages, replay replies and snapshot parts (tagged with their request), a
request's failure, frames that were not a batch, the quiet stream's tick, and what the SUB
socket's monitor saw of the connection."""

from __future__ import annotations

import attrs

from tskv.core import frames
from tskv.core.actions import RequestReplay, RequestSnapshot
from tskv.core.losses import LossReason


@attrs.frozen
class Live:
    """Live messages as they came off the SUB socket, as many as were waiting at once."""

    messages: list[list[bytes]]


@attrs.frozen
class Replayed:
    """A replay reply, for the subscriber's sequencer, tagged with the request it answers."""

    request_id: int
    reply: frames.ReplayReply


@attrs.frozen
class SnapshotPart:
    """A snapshot's part, tagged with the request it answers."""

    request_id: int
    part: frames.SnapshotPart


@attrs.frozen
class ReplayFailed:
    """A replay or snapshot request that will not be answered, and why (for the loss report)."""

    request_id: int
    reason: LossReason


@attrs.frozen
class BadFrames:
    """A replay reply that could not be parsed: the sequencer treats the request as failed."""

    error: str


@attrs.frozen
class Quiet:
    """No live message for the quiet interval."""


@attrs.frozen
class Connection:
    """The SUB socket's connection to the publisher dropped (`up=False`) or was made again."""

    up: bool


@attrs.frozen
class HandshakeRefused:
    """The publisher refused the handshake for good (a key mismatch does not heal)."""

    message: str


Inbound = (
    Live
    | Replayed
    | SnapshotPart
    | ReplayFailed
    | BadFrames
    | Quiet
    | Connection
    | HandshakeRefused
)
Request = RequestReplay | RequestSnapshot
