"""`tskv listen`: tail a KV event stream, one line per batch, losses shown where they fall."""

from __future__ import annotations

import argparse
import json
import math
import signal
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from typing import Any, Literal, TextIO

import trio

from tskv.core.codec import mm_key_fields
from tskv.core.config import MAX_MESSAGE_BYTES
from tskv.core.delivery import MAX_SNAPSHOT_BYTES
from tskv.core.descriptor import Descriptor
from tskv.core.errors import HandshakeError
from tskv.core.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    MMKey,
    UnknownEvent,
    event_fields,
)
from tskv.core.losses import Loss
from tskv.shells._reachability import unreachable_reason
from tskv.shells.describe import describe_publisher
from tskv.shells.subscriber import Subscriber, open_subscriber


def short_hash(value: int) -> str:
    """The last 8 hex digits of a hash as u64: enough to follow a chain by eye."""
    return f"{value & 0xFFFF_FFFF:08x}"


def _hash_range(hashes: Sequence[int]) -> str:
    if not hashes:
        return "[]"
    if len(hashes) == 1:
        return f"[{short_hash(hashes[0])}]"
    return f"[{short_hash(hashes[0])}..{short_hash(hashes[-1])}]"


def _describe(event: KVEvent) -> str:
    if isinstance(event, BlockStored):
        parent = "-" if event.parent_block_hash is None else short_hash(event.parent_block_hash)
        text = f"+{len(event.block_hashes)}{_hash_range(event.block_hashes)}<{parent}"
    elif isinstance(event, BlockRemoved):
        text = f"-{len(event.block_hashes)}{_hash_range(event.block_hashes)}"
    elif isinstance(event, UnknownEvent):
        return f"?{event.type}{{{','.join(event.fields)}}}"
    else:
        text = "clear"
    return text + _annotations(event)


def _annotations(event: BlockStored | BlockRemoved | AllBlocksCleared) -> str:
    """The optional fields that are set, short: `@CPU` (tier), `g1` (group), `~LOCAL`,
    `lora=NAME` (or the id), `sw=4096/KIND`, `+keys`, `mm=N` (multimodal items),
    `salt=S`, `session=S`, and `+NAME` for each unknown field."""
    marks = []
    if isinstance(event, AllBlocksCleared):
        return "".join(f" +{name}" for name in event.unknown_fields)
    if event.medium is not None:
        marks.append(f"@{event.medium}")
    if event.group_idx is not None:
        marks.append(f"g{event.group_idx}")
    if event.locality is not None:
        marks.append(f"~{event.locality}")
    if isinstance(event, BlockStored):
        if event.lora_name is not None or event.lora_id is not None:
            marks.append(
                f"lora={event.lora_name if event.lora_name is not None else event.lora_id}"
            )
        if event.kv_cache_spec_kind is not None or event.kv_cache_spec_sliding_window is not None:
            window = event.kv_cache_spec_sliding_window
            marks.append(
                f"spec={event.kv_cache_spec_kind or ''}{'' if window is None else f'/{window}'}"
            )
        if event.extra_keys is not None:
            marks.append("+keys")
        if event.mm_keys is not None:
            marks.append(f"mm={sum(len(keys) for keys in event.mm_keys)}")
        if event.cache_salt is not None:
            marks.append(f"salt={event.cache_salt}")
        if event.session_id is not None:
            marks.append(f"session={event.session_id}")
    marks.extend(f"+{name}" for name in event.unknown_fields)
    return "".join(f" {mark}" for mark in marks)


def format_batch(seq: int, batch: KVEventBatch, max_events: int = 4) -> str:
    """`seq rank time counts: first events` — readable at a glance, greppable by seq."""
    counts = Counter(type(event).__name__ for event in batch.events)
    unknown = f" unknown={counts['UnknownEvent']}" if counts["UnknownEvent"] else ""
    clock = time.strftime("%H:%M:%S", time.localtime(batch.ts)) + f".{int(batch.ts % 1 * 1000):03d}"
    rank = "-" if batch.attn_dp_rank is None else str(batch.attn_dp_rank)
    shown = " ".join(_describe(event) for event in batch.events[:max_events])
    more = len(batch.events) - max_events
    if more > 0:
        shown += f" (+{more} more)"
    return (
        f"seq={seq} rank={rank} {clock} stored={counts['BlockStored']} "
        f"removed={counts['BlockRemoved']} cleared={counts['AllBlocksCleared']}{unknown}  {shown}"
    )


def _event_json(event: KVEvent) -> dict[str, Any]:
    if isinstance(event, UnknownEvent):
        return {"type": event.type, "unknown_event": True, "fields": dict(event.fields)}
    fields = event_fields(event)
    if "mm_keys" in fields:
        fields["mm_keys"] = [[mm_key_fields(key) for key in keys] for keys in fields["mm_keys"]]
    return {"type": type(event).__name__, **fields}


def batch_json(seq: int, batch: KVEventBatch) -> str:
    return json.dumps(
        {
            "seq": seq,
            "ts": batch.ts,
            "attn_dp_rank": batch.attn_dp_rank,
            "events": [_event_json(event) for event in batch.events],
        },
        default=_json_value,
    )


def _json_value(value: object) -> object:
    """What JSON has no type for, as an engine may send it: bytes as hex, the rest as repr."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).hex()
    if isinstance(value, MMKey):
        return mm_key_fields(value)
    return repr(value)


def format_loss(loss: Loss) -> str:
    return f"!! {loss.describe()}"


def loss_json(loss: Loss) -> str:
    return json.dumps(
        {
            "loss": {
                "first_seq": loss.first_seq,
                "last_seq": loss.last_seq,
                "reason": loss.reason.value,
                "new_seq": loss.new_seq,
            }
        }
    )


def summary(sub: Subscriber) -> str:
    s = sub.statistics()
    line = (
        f"tskv listen: {s.delivered} batches ({s.repaired} repaired from replay), "
        f"{s.lost} lost, {s.restarts} restarts, {s.undecodable} undecodable"
    )
    if s.snapshots:
        line += f", {s.snapshots} snapshots (standing in for {s.replaced} batches)"
    return line


def snapshot_header(seq: int, batch: KVEventBatch) -> str:
    blocks = sum(len(e.block_hashes) for e in batch.events if isinstance(e, BlockStored))
    return f"== snapshot: the publisher's whole cache after seq {seq}, {blocks} blocks"


async def listen(
    endpoint: str,
    replay_endpoint: str | None,
    topic: str,
    start_seq: int | Literal["snapshot"] | None,
    as_json: bool,
    out: TextIO = sys.stdout,
    limit: int | None = None,
    *,
    curve_server_key: str | None = None,
    curve_secret_key: str | None = None,
    summary_to: TextIO | None = None,
    max_snapshot_bytes: int = MAX_SNAPSHOT_BYTES,
    max_message_bytes: int = MAX_MESSAGE_BYTES,
) -> None:
    """Print every batch until cancelled (or `limit` batches); the summary goes to `summary_to`
    however it ends. A listener that binds (a `*` in its endpoint) says where, there too."""

    def on_loss(loss: Loss) -> None:
        print(loss_json(loss) if as_json else format_loss(loss), file=out, flush=True)

    async with open_subscriber(
        endpoint,
        replay_endpoint,
        topic,
        start_seq,
        on_loss=on_loss,
        curve_server_key=curve_server_key,
        curve_secret_key=curve_secret_key,
        max_snapshot_bytes=max_snapshot_bytes,
        max_message_bytes=max_message_bytes,
    ) as sub:
        if summary_to is not None and sub.endpoint != endpoint:
            print(f"tskv listen: bound to {sub.endpoint}", file=summary_to, flush=True)
        refused = False
        try:
            count = snapshots = 0
            async for seq, batch in sub:
                if sub.statistics().snapshots > snapshots:  # this batch is the snapshot
                    snapshots += 1
                    if not as_json:
                        print(snapshot_header(seq, batch), file=out)
                print(batch_json(seq, batch) if as_json else format_batch(seq, batch), file=out)
                out.flush()
                count += 1
                if limit is not None and count >= limit:
                    return
        except HandshakeError:
            refused = True  # its one line says it all: no summary of nothing
            raise
        finally:
            if summary_to is not None and not refused:
                print(summary(sub), file=summary_to, flush=True)


ENDS_WITH_CTRL_C = True  # it runs until stopped: Ctrl-C is its normal end


DESCRIBE_TIMEOUT = 5.0  # seconds a publisher has to answer --describe


def format_descriptor(endpoint: str, said: Descriptor) -> str:
    """A descriptor for a person: one line of who, then what a router needs to know."""
    epoch = "-" if said.epoch is None else f"{said.epoch:016x}"
    buffer = "empty" if said.oldest_seq is None else f"seq {said.oldest_seq}..{said.newest_seq}"
    lines = [
        f"publisher on {endpoint}: tskv {said.tskv_version}, epoch {epoch}",
        f"  wire_format={said.wire_format} topic={said.topic!r} dp_rank={said.dp_rank}",
        f"  block_size={_said(said.block_size)} hash_algorithm={_said(said.hash_algorithm)}",
        f"  replay buffer: {buffer}; snapshots {'served' if said.snapshots else 'not served'}",
    ]
    for group in said.groups:
        window = "" if group.sliding_window is None else f" window={group.sliding_window}"
        kind = group.kind or "unknown"
        lines.append(f"  group {group.index}: {kind} block_size={group.block_size}{window}")
    lines.extend(f"  {name}={value!r}" for name, value in said.unknown_fields.items())
    return "\n".join(lines)


def _said(value: object) -> str:
    return "unsaid" if value is None else str(value)


async def describe(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    """`--describe`: the descriptor, or a line saying there is none (exit status 1)."""
    with trio.move_on_after(DESCRIBE_TIMEOUT):
        said = await describe_publisher(
            args.describe,
            curve_server_key=args.curve_server_key,
            curve_secret_key=args.curve_secret_key,
        )
        if said is None:
            print(
                f"tskv listen: the publisher on {args.describe} does not describe itself (it "
                "is not tskv's): its stream is read all the same",
                file=sys.stderr,
            )
            return 1
        text = json.dumps(said.summary()) if args.json else format_descriptor(args.describe, said)
        print(text, file=out, flush=True)
        return 0
    raise TimeoutError(
        f"{args.describe} did not answer in {DESCRIBE_TIMEOUT:g} s: give the publisher's replay "
        "endpoint (not its PUB endpoint), and check it is running"
    )


async def main(args: argparse.Namespace) -> int:
    if args.describe is not None:
        if args.endpoint is not None:
            raise ValueError("--describe takes the replay endpoint alone: drop ENDPOINT")
        return await describe(args)
    if args.endpoint is None:
        raise ValueError(
            "listen needs ENDPOINT (the publisher's PUB endpoint), or --describe REPLAY_ENDPOINT"
        )
    if args.start is not None and args.replay is None:
        raise ValueError(f"--from {args.start} needs --replay-endpoint ENDPOINT")
    if args.curve_secret_key is not None and args.curve_server_key is None:
        raise ValueError("--curve-secret-key needs --curve-server-key FILE")
    for endpoint in (args.endpoint, args.replay):
        problem = endpoint and await unreachable_reason(endpoint)
        if problem:
            raise ValueError(f"cannot reach {endpoint}: {problem}; check the address")
    with trio.open_signal_receiver(signal.SIGTERM) as terminated:
        async with trio.open_nursery() as nursery:
            # SIGTERM ends it as Ctrl-C does: with the summary, exit status 0
            nursery.start_soon(_cancel_on_signal, terminated, nursery.cancel_scope)
            with trio.move_on_after(math.inf if args.duration is None else args.duration):
                await listen(
                    args.endpoint,
                    args.replay,
                    args.topic,
                    args.start,
                    args.json,
                    limit=args.count,
                    curve_server_key=args.curve_server_key,
                    curve_secret_key=args.curve_secret_key,
                    summary_to=sys.stderr,
                    max_snapshot_bytes=args.max_snapshot_bytes,
                    max_message_bytes=args.max_message_bytes,
                )
            nursery.cancel_scope.cancel()
    return 0


async def _cancel_on_signal(signals: AsyncIterator[int], scope: trio.CancelScope) -> None:
    async for _ in signals:
        scope.cancel()
        return
