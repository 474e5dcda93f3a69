"""`--kv-events-config`: the JSON TokenSpeed and vLLM users already write, checked by key."""

from __future__ import annotations

import json
import logging
from typing import Any

import attrs

from tskv.endpoints import check_endpoint

logger = logging.getLogger("tskv")


class ConfigError(ValueError):
    """A config value tskv cannot use; the message names the key."""


def _check_publisher(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value not in (None, "null", "zmq"):
        raise ConfigError(f'publisher = {value!r}: use "zmq", "null" or null')


def _check_endpoint(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is None and attribute.name == "replay_endpoint":
        return
    if not isinstance(value, str):
        raise ConfigError(f"{attribute.name} = {value!r}: must be a string endpoint")
    try:
        check_endpoint(value)
    except ValueError as exc:
        raise ConfigError(f"{attribute.name}: {exc}") from None


def _minimum(lowest: int) -> Any:
    def check(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{attribute.name} = {value!r}: must be an integer")
        if value < lowest:
            raise ConfigError(f"{attribute.name} = {value}: must be at least {lowest}")

    return check


def _check_type(kind: type) -> Any:
    def check(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if not isinstance(value, kind):
            raise ConfigError(f"{attribute.name} = {value!r}: must be a {kind.__name__}")

    return check


@attrs.frozen
class KVEventsConfig:
    """Where and how to publish; defaults match TokenSpeed's and vLLM's."""

    publisher: str | None = attrs.field(default=None, validator=_check_publisher)
    endpoint: str = attrs.field(default="tcp://*:5557", validator=_check_endpoint)
    replay_endpoint: str | None = attrs.field(default=None, validator=_check_endpoint)
    buffer_steps: int = attrs.field(default=10_000, validator=_minimum(1))
    hwm: int = attrs.field(default=100_000, validator=_minimum(0))
    max_queue_size: int = attrs.field(default=100_000, validator=_minimum(1))
    topic: str = attrs.field(default="", validator=_check_type(str))
    enable_kv_cache_events: bool = attrs.field(default=False, validator=_check_type(bool))

    @property
    def enabled(self) -> bool:
        """Whether an engine should publish: as TokenSpeed decides, the flag must be on and the
        publisher not "null" (unset means "zmq")."""
        return self.enable_kv_cache_events and self.publisher != "null"

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        """Parse a `--kv-events-config` string. Unknown keys are kept out but logged."""
        try:
            data = json.loads(text)
        except (TypeError, json.JSONDecodeError) as exc:
            raise ConfigError(f"kv events config is not valid JSON ({exc}): {text!r}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"kv events config must be a JSON object, got {text!r}")
        known = {field.name for field in attrs.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            logger.warning(
                "kv events config: ignoring keys tskv does not use: %s", ", ".join(unknown)
            )
        return cls(**{key: value for key, value in data.items() if key in known})
