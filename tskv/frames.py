"""Every ZeroMQ frame tskv builds or parses: live messages, replay requests and replies.

I/O-free, so each rule of docs/wire.md is tested without sockets.
"""

from __future__ import annotations

import struct

import attrs

_SEQ = struct.Struct(">Q")
END_SEQ = 2**64 - 1
END_FRAME = b"\xff" * 8  # -1 as a signed 8-byte int marks the end of a replay


class FrameError(ValueError):
    """Frames that do not have the shape the protocol requires; says which shape was expected."""


def pack_seq(seq: int) -> bytes:
    return _SEQ.pack(seq)


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


def replay_request(start_seq: int) -> list[bytes]:
    """What a DEALER client sends: an empty delimiter, then the first seq it wants."""
    return [b"", _SEQ.pack(start_seq)]


def parse_replay_request(frames: list[bytes]) -> tuple[bytes, int]:
    """`[client, "", start_seq]` as a ROUTER sees it; returns (client, start_seq)."""
    if len(frames) != 3 or frames[1] != b"":
        shape = ", ".join(f"{len(frame)}B" for frame in frames[:6])
        raise FrameError(
            f"replay request must be [client, '', start_seq], got {len(frames)} frames ({shape})"
        )
    return bytes(frames[0]), unpack_seq(frames[2])


def replay_reply(client: bytes, seq: int, payload: bytes) -> list[bytes]:
    return [client, b"", _SEQ.pack(seq), payload]


def replay_end(client: bytes) -> list[bytes]:
    return [client, b"", END_FRAME, b""]


@attrs.frozen
class ReplayReply:
    """One reply as a DEALER receives it; `seq` is END_SEQ for the end marker."""

    seq: int
    payload: bytes

    @property
    def is_end(self) -> bool:
        return self.seq == END_SEQ


def parse_replay_reply(frames: list[bytes]) -> ReplayReply:
    """Read `["", seq, payload]` (TokenSpeed, tskv) or `["", topic, seq, payload]` (vLLM)."""
    if len(frames) == 3 and frames[0] == b"":
        seq_frame, payload = frames[1], frames[2]
    elif len(frames) == 4 and frames[0] == b"":
        seq_frame, payload = frames[2], frames[3]
    else:
        raise FrameError(
            f"replay reply must be ['', seq, payload] or ['', topic, seq, payload], "
            f"got {len(frames)} frames"
        )
    if len(seq_frame) != 8:
        raise FrameError(f"replay seq frame must be 8 bytes, got {len(seq_frame)}")
    return ReplayReply(_SEQ.unpack(seq_frame)[0], bytes(payload))
