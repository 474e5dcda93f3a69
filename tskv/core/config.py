"""`--kv-events-config`: the JSON TokenSpeed and vLLM users already write, checked by key.

It checks values, and that the key files it names are there (a missing one is found when the
config is made, not when a socket opens); the files are read where sockets are opened.
"""

from __future__ import annotations

import difflib
import json
import os
from typing import Any, Literal

import attrs

from tskv.core._checks import at_least, int_at_least, number_at_least
from tskv.core.delivery import MAX_SNAPSHOT_BYTES
from tskv.core.endpoints import check_endpoint, should_bind
from tskv.core.errors import ConfigError, TskvTypeError, Warn, python_warning
from tskv.core.wire_format import WIRE_FORMATS, Layout, WireFormat, layout

Validator = Any  # attrs' validator protocol, too loose to spell usefully


def _check_publisher(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    # which names exist is the factory's registry (EventPublisherFactory), which refuses an
    # unknown one where it builds: the config keeps no copy of that process-wide list
    if value is not None and (not isinstance(value, str) or not value):
        raise ConfigError(
            f'publisher = {value!r}: use a publisher\'s name ("zmq", "null", or one '
            "registered with EventPublisherFactory), or null for the default"
        )


def _check_bind(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None and not isinstance(value, bool):
        raise ConfigError(
            f"bind = {value!r}: use true (bind the endpoint), false (connect to it), or null "
            "(bind only a wildcard, ipc or inproc endpoint, as TokenSpeed does)"
        )


def _check_endpoint(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is None and attribute.name == "replay_endpoint":
        return
    if not isinstance(value, str):
        raise ConfigError(f"{attribute.name} = {value!r}: must be a string endpoint")
    try:
        check_endpoint(value)
    except ValueError as exc:
        raise ConfigError(f"{attribute.name}: {exc}") from None


def _integer(lowest: int, optional: bool = False) -> Validator:
    def check(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if not (optional and value is None):
            int_at_least(attribute.name, value, lowest, ConfigError)

    return check


def _number(lowest: float, above: bool = False) -> Validator:
    return at_least(lowest, above, ConfigError)


def _check_wire_format(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value not in WIRE_FORMATS:
        choices = " or ".join(f'"{name}"' for name in WIRE_FORMATS)
        raise ConfigError(f"wire_format = {value!r}: use {choices}")


def _optional_path(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is None:
        return
    if not isinstance(value, str):
        raise ConfigError(f"{attribute.name} = {value!r}: must be a file path (a string) or null")
    if not os.path.exists(value):
        fix = (
            "make a directory holding the allowed subscribers' public keys (NAME.key)"
            if attribute.name == "curve_clients"
            else "create one with `tskv keys generate DIR`"
        )
        raise ConfigError(f"{attribute.name} = {value!r} does not exist; {fix}")


def _check_hash_algorithm(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None and (not isinstance(value, str) or not value.strip()):
        raise ConfigError(
            f"hash_algorithm = {value!r}: name the block hash the engine uses (vLLM's: sha256, "
            "sha256_cbor, xxhash, xxhash_cbor; or your own name), or null to say nothing"
        )


def _of_type(kind: type, optional: bool = False) -> Validator:
    def check(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if not isinstance(value, kind) and not (optional and value is None):
            raise ConfigError(f"{attribute.name} = {value!r}: must be a {kind.__name__}")

    return check


@attrs.frozen
class KVEventsConfig:
    """Where and how to publish; defaults match TokenSpeed's and vLLM's.

    Every path that builds a publisher (open_publisher, ZmqEventPublisher, the factory, the
    CLI, tskv.testing) takes one of these, so every key means the same everywhere.
    """

    publisher: str | None = attrs.field(default=None, validator=_check_publisher)
    endpoint: str = attrs.field(default="tcp://*:5557", validator=_check_endpoint)
    replay_endpoint: str | None = attrs.field(default=None, validator=_check_endpoint)
    buffer_steps: int = attrs.field(default=10_000, validator=_integer(1))
    hwm: int = attrs.field(default=100_000, validator=_integer(0))
    max_queue_size: int = attrs.field(default=100_000, validator=_integer(1))
    topic: str = attrs.field(default="", validator=_of_type(str))
    enable_kv_cache_events: bool = attrs.field(default=False, validator=_of_type(bool))
    # tskv's own keys (other engines ignore them): the wire, checks, encryption, replay limits,
    # timeouts.
    wire_format: WireFormat = attrs.field(default="tokenspeed", validator=_check_wire_format)
    strict: bool = attrs.field(default=False, validator=_of_type(bool))
    curve_secret_key: str | None = attrs.field(default=None, validator=_optional_path)
    curve_clients: str | None = attrs.field(default=None, validator=_optional_path)
    curve_allow_any_client: bool = attrs.field(default=False, validator=_of_type(bool))
    replay_max_concurrent: int = attrs.field(default=8, validator=_integer(1))
    replay_max_batches: int | None = attrs.field(default=None, validator=_integer(1, True))
    replay_rate: float = attrs.field(default=20.0, validator=_number(0, above=True))
    replay_burst: int = attrs.field(default=40, validator=_integer(1))
    replay_client_timeout: float = attrs.field(default=5.0, validator=_number(0, above=True))
    shutdown_timeout: float = attrs.field(default=1.0, validator=_number(0))
    snapshots: bool = attrs.field(default=True, validator=_of_type(bool))  # served on replay
    # None: TokenSpeed's rule (bind a wildcard, ipc or inproc endpoint, connect otherwise), so
    # `tcp://127.0.0.1:5557` connects; true binds it, false connects whatever it looks like.
    bind: bool | None = attrs.field(default=None, validator=_check_bind)
    # What the publisher's descriptor says of the engine, for routers to check (null: unsaid).
    block_size: int | None = attrs.field(default=None, validator=_integer(1, True))
    hash_algorithm: str | None = attrs.field(default=None, validator=_check_hash_algorithm)

    def __attrs_post_init__(self) -> None:
        if self.curve_secret_key is None:
            if self.curve_clients is not None or self.curve_allow_any_client:
                raise ConfigError(
                    "curve_clients and curve_allow_any_client need curve_secret_key (the "
                    "publisher's own secret certificate file)"
                )
        elif self.curve_clients is None and not self.curve_allow_any_client:
            raise ConfigError(
                "with curve_secret_key, say who may connect: curve_clients (a directory of "
                "allowed public certificates) or curve_allow_any_client: true"
            )
        elif self.curve_clients is not None and self.curve_allow_any_client:
            raise ConfigError(
                "curve_clients and curve_allow_any_client: true both say who may connect; "
                "keep one (the allow list, or any client that knows the server key)"
            )

    @property
    def encrypted(self) -> bool:
        return self.curve_secret_key is not None

    @property
    def enabled(self) -> bool:
        """Whether an engine should publish: as TokenSpeed decides, the flag must be on and the
        publisher not "null" (unset means "zmq")."""
        return self.enable_kv_cache_events and self.publisher != "null"

    def binds(self, endpoint: str) -> bool:
        """Whether the publisher binds `endpoint` (its own, or its replay endpoint's rule is
        always to bind): `bind` when set, else TokenSpeed's rule."""
        return should_bind(endpoint) if self.bind is None else self.bind

    def serves_snapshots(self, replay_endpoint: str | None) -> bool:
        """Snapshots are served on the replay socket: without one, no state is kept for them."""
        return self.snapshots and replay_endpoint is not None

    @property
    def layout(self) -> Layout:
        """What this config's wire sends besides payloads (`wire_format.layout`)."""
        return layout(self.wire_format, self.topic)

    @classmethod
    def from_cli(cls, cli_value: str, warn: Warn = python_warning) -> KVEventsConfig:
        """TokenSpeed's name for `from_json`: parse the `--kv-events-config` value."""
        return cls.from_json(cli_value, warn)

    @classmethod
    def from_json(cls, text: str, warn: Warn = python_warning) -> KVEventsConfig:
        """Parse a `--kv-events-config` string. Unknown keys are kept out, and named to
        `warn` (the shells pass their logger's warning; by default, Python's warnings)."""
        try:
            data = json.loads(text)
        except (TypeError, json.JSONDecodeError) as exc:
            raise ConfigError(f"kv events config is not valid JSON ({exc}): {text!r}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"kv events config must be a JSON object, got {text!r}")
        return cls.from_mapping(data, warn)

    @classmethod
    def from_mapping(cls, data: dict[str, Any], warn: Warn = python_warning) -> KVEventsConfig:
        """Build from keys and values; keys tskv does not use are left out, named to `warn`."""
        known = field_names()
        unknown = sorted(set(data) - known)
        if unknown:  # TokenSpeed's config ignores unknown keys too: warn, and say what was meant
            names = ", ".join(f"{key}{did_you_mean(key, known)}" for key in unknown)
            warn(f"kv events config: ignoring keys tskv does not use: {names}")
        return cls(**{key: value for key, value in data.items() if key in known})

    def to_mapping(self) -> dict[str, Any]:
        return attrs.asdict(self)


def field_names() -> frozenset[str]:
    return frozenset(field.name for field in attrs.fields(KVEventsConfig))


def did_you_mean(name: str, choices: frozenset[str] | set[str]) -> str:
    """` (did you mean 'x'?)` for the closest of `choices`, or "" when none is close."""
    close = difflib.get_close_matches(name, sorted(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


MAX_MESSAGE_BYTES = 64 << 20  # a batch or replay reply; a 1M-token prompt's batch is ~5 MB


def _check_start_seq(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is None or value == "snapshot":
        return
    if isinstance(value, str):
        raise ConfigError(
            f'start_seq = {value!r}: use "snapshot" (start from the publisher\'s whole '
            "cache), a seq (an int, 0 or more, fetched from replay first), or None (live only)"
        )
    int_at_least("start_seq", value, 0, ConfigError)


def _check_quiet_interval(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None:
        number_at_least(attribute.name, value, 0, above=True, error=ConfigError)


def _check_curve_pair(
    config: SubscriberConfig, attribute: attrs.Attribute[Any], value: object
) -> None:
    if value is not None and config.curve_server_key is None:
        raise ConfigError("curve_secret_key needs curve_server_key (the publisher's public key)")


@attrs.frozen
class SubscriberConfig:
    """How to subscribe, whatever the endpoints: what `open_subscriber`'s keywords make, and
    what `open_watcher` gives every worker's subscriber (each `Watcher.add` may change some).
    Checked when made, so a bad value is refused where it is written."""

    topic: str = attrs.field(default="", validator=_of_type(str))
    start_seq: int | Literal["snapshot"] | None = attrs.field(
        default=None, validator=_check_start_seq
    )
    snapshots: bool = attrs.field(default=True, validator=_of_type(bool))
    replay_timeout: float = attrs.field(default=5.0, validator=_number(0, above=True))
    hwm: int = attrs.field(default=100_000, validator=_integer(0))
    max_held: int = attrs.field(default=10_000, validator=_integer(1))
    max_snapshot_bytes: int = attrs.field(default=MAX_SNAPSHOT_BYTES, validator=_integer(1))
    max_message_bytes: int = attrs.field(default=MAX_MESSAGE_BYTES, validator=_integer(1))
    quiet_interval: float | None = attrs.field(default=2.0, validator=_check_quiet_interval)
    warn_unanswered_after: float = attrs.field(default=5.0, validator=_number(0, above=True))
    # the key files are read, and their errors raised, when the subscriber opens
    curve_server_key: str | None = attrs.field(default=None, validator=_of_type(str, optional=True))
    curve_secret_key: str | None = attrs.field(
        default=None, validator=[_of_type(str, optional=True), _check_curve_pair]
    )

    def but(self, **changes: Any) -> SubscriberConfig:
        """This config with `changes`; a name that is no setting is refused, naming the
        closest one."""
        unknown = sorted(set(changes) - subscriber_field_names())
        if unknown:
            known = subscriber_field_names()
            raise TskvTypeError(
                "not a subscriber setting: "
                + ", ".join(f"{name}{did_you_mean(name, known)}" for name in unknown)
            )
        return attrs.evolve(self, **changes)


def subscriber_field_names() -> frozenset[str]:
    return frozenset(field.name for field in attrs.fields(SubscriberConfig))
