"""Every ZeroMQ frame tskv builds or parses: live messages, subscriptions, replay requests and
replies.

I/O-free, so each rule of docs/wire.md is tested without sockets.
"""

from __future__ import annotations

import enum
import struct

import attrs

from tskv.core.errors import TskvError

_SEQ = struct.Struct(">Q")
END_SEQ = 2**64 - 1
END_FRAME = b"\xff" * 8  # -1 as a signed 8-byte int marks the end of a replay
MAX_REQUEST_BYTES = 1024  # no replay request frame needs more; larger ones disconnect the peer
# tskv's own requests are start_seq frames no other client sends, shaped so that a publisher
# that knows none of them (vLLM's, TokenSpeed's, TensorRT-LLM's: `int.from_bytes(frame, "big")`)
# still answers sensibly:
# - a replay whose end says the publisher's epoch, or why it was refused: 8 zero bytes, then
#   the seq. Read as one big-endian integer, that is the same seq: the same batches come back.
TSKV_REPLAY_PREFIX = bytes(8)
# - a snapshot, or the publisher's descriptor: a mark, then ff..ff. Read as a seq, a start past
#   every seq there is: the replay ends at once, and the client knows it got no answer.
SNAPSHOT_MARK = b"tskv-snapshot"  # snapshot parts carry it as their first frame
SNAPSHOT_REQUEST = SNAPSHOT_MARK + END_FRAME
DESCRIBE_MARK = b"tskv-describe"  # the descriptor's reply carries it as its first frame
DESCRIBE_REQUEST = DESCRIBE_MARK + END_FRAME
# What a tskv publisher puts in the end marker's payload for a tskv client; a refusal's
# reason is text, which never starts with a zero byte, so the two cannot be confused.
EPOCH_MARK = b"\x00tskv-epoch"


class RequestForm(enum.Enum):
    """Which kind of client sent a replay request, and so what its answer may hold."""

    PLAIN = "plain"  # vLLM's protocol (vLLM, TokenSpeed, Dynamo): answered as vLLM's publisher
    TSKV = "tskv"  # the same replay; its end marker says the epoch, or a refusal's reason
    SNAPSHOT = "snapshot"
    DESCRIBE = "describe"


class FrameError(TskvError, ValueError):
    """Frames that do not have the shape the protocol requires; says which shape was expected."""


def unpack_seq(frame: bytes) -> int:
    """Read a seq frame: shorter ones as if left-padded with zeros, longer by their last 8 bytes."""
    return int.from_bytes(frame[-8:], "big")


def live_message(topic: bytes, seq: int, payload: bytes) -> list[bytes]:
    return [topic, _SEQ.pack(seq), payload]


def parse_live_message(frames: list[bytes]) -> tuple[bytes, int, bytes]:
    """Split `[topic, seq, payload]`; the seq frame must be exactly 8 bytes."""
    if len(frames) != 3:
        raise FrameError(f"live message must be [topic, seq, payload], got {len(frames)} frames")
    topic, seq, payload = frames
    if len(seq) != 8:
        raise FrameError(f"live seq frame must be 8 bytes, got {len(seq)}")
    return bytes(topic), _SEQ.unpack(seq)[0], bytes(payload)


def parse_subscription(frame: bytes, topic: bytes) -> int:
    """What an XPUB's incoming frame means for a publisher of `topic`: +1 a matching
    subscription, -1 a matching unsubscription, 0 anything else."""
    if frame[:1] not in (b"\x00", b"\x01") or not topic.startswith(frame[1:]):
        return 0
    return 1 if frame[0] == 1 else -1


def replay_request(start_seq: int) -> list[bytes]:
    """What a DEALER client of vLLM's protocol sends: an empty delimiter, then the first seq
    it wants (a REQ socket adds the delimiter itself)."""
    return [b"", _SEQ.pack(start_seq)]


def tskv_replay_request(start_seq: int) -> list[bytes]:
    """The same replay, asked so that a tskv publisher's end marker says its epoch (or why it
    refused); every other publisher reads the same seq and answers as it always does."""
    return [b"", TSKV_REPLAY_PREFIX + _SEQ.pack(start_seq)]


def snapshot_request() -> list[bytes]:
    return [b"", SNAPSHOT_REQUEST]


def describe_request() -> list[bytes]:
    return [b"", DESCRIBE_REQUEST]


@attrs.frozen
class ReplayRequest:
    """A replay endpoint's request as parsed: who asked, in which form (which decides how it is
    answered), and from which seq."""

    client: bytes
    form: RequestForm
    start_seq: int  # END_SEQ for a snapshot or a descriptor


def parse_replay_request(frames: list[bytes]) -> ReplayRequest:
    """`[client, "", start_seq]` as a ROUTER sees it, whichever client sent it."""
    if len(frames) != 3 or frames[1] != b"":
        shape = ", ".join(f"{len(frame)}B" for frame in frames[:6])
        raise FrameError(
            f"replay request must be [client, '', start_seq], got {len(frames)} frames ({shape})"
        )
    client, start = bytes(frames[0]), frames[2]
    if start == SNAPSHOT_REQUEST:
        return ReplayRequest(client, RequestForm.SNAPSHOT, END_SEQ)
    if start == DESCRIBE_REQUEST:
        return ReplayRequest(client, RequestForm.DESCRIBE, END_SEQ)
    if len(start) == 16 and start[:8] == TSKV_REPLAY_PREFIX:
        return ReplayRequest(client, RequestForm.TSKV, unpack_seq(start))
    return ReplayRequest(client, RequestForm.PLAIN, unpack_seq(start))


def replay_reply(client: bytes, seq: int, payload: bytes, topic: bytes | None) -> list[bytes]:
    """One replayed batch; with a `topic` (vLLM's layout) the topic frame comes before the seq."""
    if topic is None:
        return [client, b"", _SEQ.pack(seq), payload]
    return [client, b"", topic, _SEQ.pack(seq), payload]


def snapshot_part(client: bytes, next_seq: int, index: int, payload: bytes) -> list[bytes]:
    """Part `index` of a snapshot of the state before `next_seq`; the usual end marker follows
    the last part. Five frames after the client's: no replay reply has that many."""
    return [client, b"", SNAPSHOT_MARK, _SEQ.pack(next_seq), _SEQ.pack(index), payload]


def descriptor_reply(client: bytes, payload: bytes) -> list[bytes]:
    """A publisher's descriptor (`tskv.core.descriptor`), the one reply to a describe request."""
    return [client, b"", DESCRIBE_MARK, payload]


def replay_end(client: bytes, topic: bytes | None, payload: bytes = b"") -> list[bytes]:
    """The end of a replay, as vLLM's publisher sends it (an empty `payload`) to every client
    but tskv's, whose end says `epoch_note` or `refusal_note`."""
    if topic is None:
        return [client, b"", END_FRAME, payload]
    return [client, b"", b"", END_FRAME, payload]  # vLLM's end marker has an empty topic


def epoch_note(epoch: int | None) -> bytes:
    return b"" if epoch is None else EPOCH_MARK + _SEQ.pack(epoch)


def refusal_note(reason: str) -> bytes:
    """A refusal's reason, for a tskv client: it asks again later, where an empty end would
    read as "nothing buffered"."""
    return reason.encode() or b"refused"


@attrs.frozen
class ReplayReply:
    """One reply as a DEALER receives it; `seq` is END_SEQ for the end marker."""

    seq: int
    payload: bytes
    topic: bytes | None = None  # vLLM's layout carries the publisher's topic; TokenSpeed's not

    @property
    def is_end(self) -> bool:
        return self.seq == END_SEQ

    @property
    def refusal(self) -> str | None:
        """Why the publisher refused the request, for an end marker that carries a reason."""
        if not self.is_end or not self.payload or self.payload.startswith(b"\x00"):
            return None
        return self.payload.decode("utf-8", "replace")

    @property
    def epoch(self) -> int | None:
        """The publisher's incarnation, for an end marker from a publisher that says it."""
        payload = self.payload
        if not self.is_end or len(payload) != len(EPOCH_MARK) + 8:
            return None
        if not payload.startswith(EPOCH_MARK):
            return None
        epoch: int = _SEQ.unpack(payload[len(EPOCH_MARK) :])[0]
        return epoch


@attrs.frozen
class SnapshotPart:
    """One part of a snapshot: batches that rebuild the state before `next_seq`."""

    next_seq: int
    index: int
    payload: bytes


@attrs.frozen
class DescriptorReply:
    """A publisher's descriptor, still encoded (`tskv.core.descriptor.Descriptor.decode`)."""

    payload: bytes


def parse_replay_reply(frames: list[bytes]) -> ReplayReply | SnapshotPart | DescriptorReply:
    """Read `["", seq, payload]` (TokenSpeed, tskv), `["", topic, seq, payload]` (vLLM), a
    snapshot part `["", "tskv-snapshot", next_seq, index, payload]`, or a descriptor
    `["", "tskv-describe", payload]`."""
    if len(frames) == 3 and frames[0] == b"" and frames[1] == DESCRIBE_MARK:
        return DescriptorReply(bytes(frames[2]))
    if len(frames) == 5 and frames[0] == b"" and frames[1] == SNAPSHOT_MARK:
        if len(frames[2]) != 8 or len(frames[3]) != 8:
            raise FrameError("snapshot part's next_seq and index frames must be 8 bytes")
        return SnapshotPart(_SEQ.unpack(frames[2])[0], _SEQ.unpack(frames[3])[0], bytes(frames[4]))
    topic: bytes | None = None
    if len(frames) == 3 and frames[0] == b"":
        seq_frame, payload = frames[1], frames[2]
    elif len(frames) == 4 and frames[0] == b"":
        topic, seq_frame, payload = bytes(frames[1]), frames[2], frames[3]
    else:
        raise FrameError(
            f"replay reply must be ['', seq, payload], ['', topic, seq, payload] or a "
            f"snapshot part, got {len(frames)} frames"
        )
    if len(seq_frame) != 8:
        raise FrameError(f"replay seq frame must be 8 bytes, got {len(seq_frame)}")
    return ReplayReply(_SEQ.unpack(seq_frame)[0], bytes(payload), topic)
