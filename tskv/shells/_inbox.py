"""What the subscriber's tasks put in its inbox, for the consumer's task to hand to the
Sequencer: live messages, replay replies and snapshot parts (tagged with their request), a
request's failure, frames that were not a batch, and the quiet stream's tick."""

from __future__ import annotations

import attrs

from tskv.core import frames
from tskv.core.losses import LossReason
from tskv.core.sequencer import RequestReplay, RequestSnapshot


@attrs.frozen
class Live:
    """Live messages as they came off the SUB socket, as many as were waiting at once."""

    messages: list[list[bytes]]


@attrs.frozen
class Replayed:
    request_id: int
    reply: frames.ReplayReply


@attrs.frozen
class SnapshotPart:
    request_id: int
    part: frames.SnapshotPart


@attrs.frozen
class ReplayFailed:
    request_id: int
    reason: LossReason


@attrs.frozen
class BadFrames:
    error: str


@attrs.frozen
class Quiet:
    """No live message for the quiet interval."""


Inbound = Live | Replayed | SnapshotPart | ReplayFailed | BadFrames | Quiet
Request = RequestReplay | RequestSnapshot
