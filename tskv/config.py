"""`--kv-events-config`: the JSON TokenSpeed and vLLM users already write, checked by key."""

from __future__ import annotations

import json
import logging
from typing import Any

import attrs

from tskv.endpoints import check_endpoint
from tskv.replay_limits import ReplayLimits
from tskv.security import ServerSecurity, load_allowed_keys, load_key_pair

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


def _optional_str(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None and not isinstance(value, str):
        raise ConfigError(f"{attribute.name} = {value!r}: must be a file path (a string) or null")


def _optional_minimum(lowest: int) -> Any:
    check = _minimum(lowest)

    def optional(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if value is not None:
            check(instance, attribute, value)

    return optional


def _positive_number(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"{attribute.name} = {value!r}: must be a positive number")


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
    # tskv's own keys (other engines ignore them): encryption and replay limits.
    curve_secret_key: str | None = attrs.field(default=None, validator=_optional_str)
    curve_clients: str | None = attrs.field(default=None, validator=_optional_str)
    curve_allow_any_client: bool = attrs.field(default=False, validator=_check_type(bool))
    replay_max_concurrent: int = attrs.field(default=8, validator=_minimum(1))
    replay_max_batches: int | None = attrs.field(default=None, validator=_optional_minimum(1))
    replay_rate: float = attrs.field(default=20.0, validator=_positive_number)
    replay_burst: int = attrs.field(default=40, validator=_minimum(1))

    def __attrs_post_init__(self) -> None:
        if self.curve_secret_key is None:
            if self.curve_clients is not None or self.curve_allow_any_client:
                raise ConfigError(
                    "curve_clients and curve_allow_any_client need curve_secret_key (the "
                    "publisher's own secret certificate file)"
                )
        elif (self.curve_clients is None) == (not self.curve_allow_any_client):
            raise ConfigError(
                "with curve_secret_key, say who may connect: curve_clients (a directory of "
                "allowed public certificates) or curve_allow_any_client: true, not both"
            )

    def server_security(self) -> ServerSecurity | None:
        """The CURVE settings, with the key files read; None when encryption is off."""
        if self.curve_secret_key is None:
            return None
        keys = load_key_pair(self.curve_secret_key)
        allowed = None if self.curve_clients is None else load_allowed_keys(self.curve_clients)
        return ServerSecurity(keys, allowed)

    def replay_limits(self) -> ReplayLimits:
        return ReplayLimits(
            self.replay_max_concurrent, self.replay_max_batches, self.replay_rate, self.replay_burst
        )

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
