"""The two wires tskv speaks, and what each means beyond the payload: the reply layout of the
replay socket and whether the cache state keeps storage tiers. Kept apart from the codec so the
config can name the wires without loading an encoder."""

from __future__ import annotations

from typing import Literal

import attrs

from tskv.core.errors import ConfigError

WireFormat = Literal["tokenspeed", "vllm"]
WIRE_FORMATS: tuple[WireFormat, ...] = ("tokenspeed", "vllm")


def unknown_wire(wire_format: object) -> ConfigError:
    return ConfigError(f"wire_format = {wire_format!r}: use {' or '.join(map(repr, WIRE_FORMATS))}")


@attrs.frozen
class Layout:
    """What a publisher on this wire sends besides its payloads."""

    reply_topic: bytes | None  # the topic frame in replay replies (vLLM's layout); None: none
    tiered_state: bool  # the events carry a storage tier (`medium`), so snapshots keep it


def layout(wire_format: WireFormat, topic: str) -> Layout:
    """vLLM's replies carry the topic frame and its events a medium; TokenSpeed's do neither."""
    vllm = wire_format == "vllm"
    return Layout(topic.encode() if vllm else None, vllm)
