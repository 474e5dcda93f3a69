"""What a watcher's index process and its reader processes say to each other, as values, and
their bytes on the pipe between them: no I/O (`frames.py` is the same for ZeroMQ's frames).

The index's process tells a reader which workers to follow (`Follow`, `Unfollow`) and asks
for a worker's engine hashes (`AskHashes`). A reader answers with `News` frames: each worker's
`Report` (its figures, the holds its index took and let go of, the losses to hand `on_loss`),
its log records (`LogLine`), the answers (`Hashes`), and what it had to drop to stay bounded.
Each message goes as a msgpack array tagged with its kind; a frame is its length (4 bytes,
little-endian) and the packed message. A report's keys go as 8-byte integers in this
machine's order, packed in bytes, and the index's process keeps them so
(`PrefixIndex.apply_changes` takes a run as packed bytes: the compiled table reads them in
place) instead of making an int object of each, or a view of each run for the collector to
count. Only the two ends of one pipe ever
speak on it, so a message that does not parse is a bug on the other end:
`ReaderMessageError` says which.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Sequence
from typing import Any

import attrs
import msgpack

from tskv.core import compiled
from tskv.core._msgspec import msgspec
from tskv.core.applied import BOUNDS, AppliedFigures
from tskv.core.errors import TskvError
from tskv.core.holdings import run_keys
from tskv.core.hybrid import Op
from tskv.core.losses import Loss, LossReason
from tskv.core.worker_view import WorkerFigures

_LENGTH = struct.Struct("<I")

if msgspec is not None:
    _pack, _unpack = msgspec.msgpack.Encoder().encode, msgspec.msgpack.Decoder().decode
else:
    _pack = msgpack.Packer().pack

    def _unpack(data: bytes) -> Any:
        return msgpack.unpackb(data, strict_map_key=False)  # a hybrid's groups are by index


class ReaderMessageError(TskvError, ValueError):
    """A message on a reader's pipe that is not one of these: a bug at its other end."""


@attrs.frozen
class Follow:
    """Follow a worker, named `slot` on this pipe, with these subscriber settings."""

    slot: int
    endpoint: str
    replay_endpoint: str | None
    settings: dict[str, Any]


@attrs.frozen
class Unfollow:
    """Stop following the worker of `slot` (it was removed from the watcher)."""

    slot: int


@attrs.frozen
class AskHashes:
    """What the reader's index holds for `slot` by hash; answered by `Hashes`: its engine
    hashes, or (`dynamo`) what it keeps by Dynamo's block hashes, as `dynamo_hashes.answer`
    gives it for `block_hashes` (None: the worker's stores)."""

    question: int
    slot: int
    dynamo: bool = False
    block_hashes: list[int] | None = None


@attrs.define
class Report:
    """A worker's state after some news: its figures, the holds its index took and let go of
    since the last report and a hybrid worker's changes by tier (`PrefixIndex.take_changes`),
    whether that index has seen string token ids, the tokens after a block its engine's hashes
    cover, the losses for `on_loss`, and a failure to log (error, retry in seconds). Not
    frozen: the index's process makes one a batch, and a frozen attrs class costs several
    times as much to make."""

    slot: int
    figures: WorkerFigures
    # runs of keys: lists where made, the packed keys' bytes where parsed
    changes: Sequence[Sequence[int]] = attrs.field(
        eq=lambda runs: [list(run_keys(run)) for run in runs]
    )
    strings: bool = False
    losses: list[Loss] = attrs.Factory(list)
    failure: tuple[str, float] | None = None
    ops: list[Op] = attrs.Factory(list)
    lookahead: int = 0
    blocks: dict[str | None, int] = attrs.Factory(dict)  # held by storage medium, as it is now


@attrs.frozen
class LogLine:
    """A log record of the reader's, for the index's process to log under the same name."""

    name: str
    level: int
    text: str


@attrs.frozen
class Hashes:
    """The answer to `AskHashes`: the engine hashes the reader's index holds for that slot, or
    what it keeps of it by Dynamo's block hashes."""

    question: int
    hashes: list[Any]


@attrs.frozen
class News:
    """One frame from a reader: everything it had to say since the last one, in order; its CPU
    time so far; and how many loss reports and log records it dropped to stay bounded (their
    effect on the figures and the index is never dropped, only the callback or the line)."""

    cpu_seconds: float
    items: list[Report | LogLine | Hashes]
    dropped_losses: int = 0
    dropped_logs: int = 0
    applied: AppliedFigures = attrs.Factory(AppliedFigures)  # since the reader started


Command = Follow | Unfollow | AskHashes

# -- values to plain tuples and back ---------------------------------------------------------


def _figures_out(figures: WorkerFigures) -> tuple[Any, ...]:
    """Written out, as `_figures_in` reads them: attrs.astuple's generic walk costs an order of
    magnitude more, and this runs for every report."""
    f = figures
    return (f.batches, f.losses, f.failures, f.last_error, f.last_seq, f.silent, f.stale)


def _loss_out(loss: Loss) -> tuple[Any, ...]:
    return (loss.first_seq, loss.last_seq, loss.reason.value, loss.new_seq)


def _plain(message: Command | News | Report | LogLine | Hashes) -> tuple[Any, ...]:
    if isinstance(message, Follow):
        return ("follow", message.slot, message.endpoint, message.replay_endpoint, message.settings)
    if isinstance(message, Unfollow):
        return ("unfollow", message.slot)
    if isinstance(message, AskHashes):
        return ("ask_hashes", message.question, message.slot, message.dynamo, message.block_hashes)
    if isinstance(message, Report):
        losses = [_loss_out(loss) for loss in message.losses]
        return (
            "report",
            message.slot,
            _figures_out(message.figures),
            [_pack_keys(run) for run in message.changes],
            message.strings,
            losses,
            message.failure,
            message.ops,
            message.lookahead,
            list(message.blocks.items()),
        )
    if isinstance(message, LogLine):
        return ("log", message.name, message.level, message.text)
    if isinstance(message, Hashes):
        return ("hashes", message.question, message.hashes)
    items = [_plain(item) for item in message.items]
    applied = message.applied
    events = list(applied.events.items())
    figures = (list(applied.counts), applied.over, applied.total, events)
    dropped = message.dropped_losses, message.dropped_logs
    return ("news", message.cpu_seconds, items, *dropped, figures)


def _pack_keys(keys: Sequence[int]) -> bytes:
    """A run of keys as 8-byte integers in this machine's order (packed already: as it is)."""
    if type(keys) is bytes:
        return keys
    if compiled.core is not None:
        packed: bytes = compiled.core.pack_keys(keys)
        return packed
    return array("q", keys).tobytes()


def _check(condition: bool, what: str, value: object) -> None:
    if not condition:
        raise _refused(what, value)


def _refused(what: str, value: object) -> ReaderMessageError:
    return ReaderMessageError(f"reader pipe: {what}, got {value!r:.200}")


def _int(value: object) -> bool:
    return type(value) is int  # msgpack makes exact ints; a bool is not one


# The checks of a report are written out, not looped nor called: the index's process parses
# one for every batch its readers file, and calls, generators and the objects they made were
# most of what a report cost it.


def _figures_in(value: Any) -> WorkerFigures:
    if type(value) not in (list, tuple) or len(value) != 7:
        raise _refused("figures of 7 fields", value)
    batches, losses, failures, last_error, last_seq, silent, stale = value
    if not (
        type(batches) is int
        and type(losses) is int
        and type(failures) is int
        and batches >= 0
        and losses >= 0
        and failures >= 0
        and (last_error is None or type(last_error) is str)
        and (last_seq is None or type(last_seq) is int)
        and type(silent) is bool
        and type(stale) is bool
    ):
        what = "figures: counts of 0 or more, last_error, last_seq, silent and stale"
        raise _refused(what, value)
    return WorkerFigures(batches, losses, failures, last_error, last_seq, silent, stale)


def _loss_in(value: Any) -> Loss:
    _check(isinstance(value, (list, tuple)) and len(value) == 4, "a loss of 4 fields", value)
    first, last, reason, new_seq = value
    _check(_int(first) and (last is None or _int(last)), "a loss's seqs", value)
    _check(new_seq is None or _int(new_seq), "a loss's new seq", value)
    try:
        return Loss(first, last, LossReason(reason), new_seq)
    except ValueError:
        raise ReaderMessageError(f"reader pipe: no loss reason {reason!r}") from None


def _changes_in(value: Any) -> list[bytes]:
    """The runs as they came, packed (`holdings.run_keys` reads them)."""
    if type(value) is not list:
        raise _refused("changes as runs of 8-byte keys", value)
    for run in value:
        if type(run) is not bytes or len(run) % 8:
            raise _refused("changes as runs of 8-byte keys", value)
    return value


_SHAPES = {
    "follow": 5,
    "unfollow": 2,
    "ask_hashes": 5,
    "report": 10,
    "log": 4,
    "hashes": 3,
    "news": 6,
}
_REPORT_FIELDS = _SHAPES["report"]


def _report_in(value: Any) -> Report:
    _, slot, figures, changes, strings, losses, failure, ops, lookahead, blocks = value
    if not (
        type(slot) is int
        and type(strings) is bool
        and type(losses) is list
        and type(lookahead) is int
        and lookahead >= 0
    ):
        raise _refused("report's slot, strings, losses and lookahead", value)
    if type(ops) is not list:
        raise _refused("ops", ops)
    if ops:  # else the decoded empty lists are the report's own: no new ones made
        _check(all([type(op) is list for op in ops]), "ops", ops)
        ops = [tuple(op) for op in ops]
    if losses:
        losses = [_loss_in(loss) for loss in losses]
    if failure is not None:
        _check(
            isinstance(failure, (list, tuple))
            and len(failure) == 2
            and isinstance(failure[0], str)
            and isinstance(failure[1], (int, float)),
            "report's failure (error, retry in)",
            failure,
        )
        failure = (failure[0], float(failure[1]))
    return Report(
        slot,
        _figures_in(figures),
        _changes_in(changes),
        strings,
        losses,
        failure,
        ops,
        lookahead,
        _counts_in(blocks, "report's blocks by medium", str),
    )


def _counts_in(value: Any, what: str, name: type) -> dict[Any, int]:
    """[[name, count], ...] as a dict: each name of type `name` (or None), each count an int
    of 0 or more."""
    _check(type(value) is list, what, value)
    counts = {}
    for pair in value:
        _check(
            type(pair) is list
            and len(pair) == 2
            and (pair[0] is None or isinstance(pair[0], name))
            and _int(pair[1])
            and pair[1] >= 0,
            what,
            value,
        )
        counts[pair[0]] = pair[1]
    return counts


def _applied_in(value: Any) -> AppliedFigures:
    what = "applied figures: counts by bound, over, total seconds, events by kind"
    _check(type(value) is list and len(value) == 4, what, value)
    counts, over, total, events = value
    _check(
        type(counts) is list
        and len(counts) == len(BOUNDS)
        and all([_int(count) and count >= 0 for count in counts])
        and _int(over)
        and over >= 0
        and isinstance(total, (int, float)),
        what,
        value,
    )
    return AppliedFigures(tuple(counts), over, float(total), _counts_in(events, what, str))


def _parsed(value: Any) -> Command | News | Report | LogLine | Hashes:
    _check(isinstance(value, (list, tuple)) and len(value) >= 1, "a tagged array", value)
    kind = value[0]
    _check(_SHAPES.get(kind) == len(value), f"a known message of its length ({kind!r})", value)
    if kind == "report":  # first: the one that comes for every batch
        return _report_in(value)
    if kind == "follow":
        _, slot, endpoint, replay, settings = value
        _check(_int(slot) and isinstance(endpoint, str), "follow's slot and endpoint", value)
        _check(replay is None or isinstance(replay, str), "follow's replay endpoint", value)
        _check(isinstance(settings, dict), "follow's settings", value)
        return Follow(slot, endpoint, replay, settings)
    if kind == "unfollow":
        _check(_int(value[1]), "unfollow's slot", value)
        return Unfollow(value[1])
    if kind == "ask_hashes":
        _, question, slot, dynamo, hashes = value
        _check(_int(question) and _int(slot), "ask_hashes' numbers", value)
        _check(isinstance(dynamo, bool), "ask_hashes' dynamo flag", value)
        _check(hashes is None or (type(hashes) is list and all(map(_int, hashes))), "hashes", value)
        return AskHashes(question, slot, dynamo, hashes)
    if kind == "log":
        _, name, level, text = value
        _check(isinstance(name, str) and _int(level) and isinstance(text, str), "a log", value)
        return LogLine(name, level, text)
    if kind == "hashes":
        _check(_int(value[1]) and isinstance(value[2], list), "hashes' answer", value)
        return Hashes(value[1], value[2])
    _, cpu, items, dropped_losses, dropped_logs, applied = value
    _check(isinstance(cpu, (int, float)) and isinstance(items, list), "news", value)
    _check(_int(dropped_losses) and _int(dropped_logs), "news' dropped counts", value)
    parsed: list[Report | LogLine | Hashes] = []
    for item in items:
        if type(item) is list and len(item) == _REPORT_FIELDS and item[0] == "report":  # most
            parsed.append(_report_in(item))
            continue
        message = _parsed(item)
        if not isinstance(message, (Report, LogLine, Hashes)):
            raise _refused("news items", items)
        parsed.append(message)
    return News(float(cpu), parsed, dropped_losses, dropped_logs, _applied_in(applied))


# -- frames on the pipe ------------------------------------------------------------------------


def frame(message: Command | News) -> bytes:
    """The bytes that carry `message` on the pipe."""
    packed: bytes = _pack(_plain(message))
    return _LENGTH.pack(len(packed)) + packed


class FrameReader:
    """Messages out of the pipe's bytes, as they arrive in chunks of any size."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, chunk: bytes | bytearray) -> list[Command | News]:
        """The messages `chunk` completes, in order."""
        buffer = self._buffer
        buffer += chunk
        found: list[Command | News] = []
        start = 0
        while len(buffer) - start >= _LENGTH.size:
            (length,) = _LENGTH.unpack_from(buffer, start)
            end = start + _LENGTH.size + length
            if end > len(buffer):
                break
            try:
                value = _unpack(bytes(memoryview(buffer)[start + _LENGTH.size : end]))
            except Exception as exc:  # every decoder's failure, whatever its class
                raise ReaderMessageError(f"reader pipe: a frame is not msgpack ({exc})") from None
            message = _parsed(value)
            _check(isinstance(message, (Follow, Unfollow, AskHashes, News)), "a frame", value)
            found.append(message)  # type: ignore[arg-type]
            start = end
        del buffer[:start]
        return found


def commands(messages: Sequence[Command | News]) -> list[Command]:
    """The commands among `messages` (a reader reads only those); anything else is a bug."""
    for message in messages:
        _check(not isinstance(message, News), "a command", message)
    return list(messages)  # type: ignore[arg-type]


def news(messages: Sequence[Command | News]) -> list[News]:
    """The news among `messages` (the index's process reads only those)."""
    for message in messages:
        _check(isinstance(message, News), "news", message)
    return list(messages)  # type: ignore[arg-type]
