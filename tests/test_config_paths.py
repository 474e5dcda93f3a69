"""Every KVEventsConfig key reaches the publisher on every path that builds one: open_publisher,
ZmqEventPublisher (keywords and from_config), the factory's JSON, `tskv simulate`, and
tskv.testing. A key that one path dropped is how CURVE was once silently off."""

from __future__ import annotations

import io
import json
import shutil
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import zmq

import tskv
from tests.zmq_helpers import LOOPBACK, free_loopback_port
from tskv import EventPublisherFactory, KVEventsConfig, ZmqEventPublisher
from tskv._cli import build_parser
from tskv._cli.simulate import simulate, simulate_config
from tskv.curve.key_files import generate_keys
from tskv.sim import SimOptions
from tskv.testing import kept_on_this_machine, open_simulated_stream


def every_key_changed(tmp_path: Path) -> KVEventsConfig:
    """A config in which every key differs from its default. A new key must be added here."""
    _, secret = generate_keys(tmp_path / "server", "server")
    generate_keys(tmp_path / "client", "client")
    (tmp_path / "allowed").mkdir()
    shutil.copy(tmp_path / "client" / "client.key", tmp_path / "allowed")
    values: dict[str, Any] = {
        "publisher": "zmq",
        "endpoint": LOOPBACK,
        "replay_endpoint": LOOPBACK,
        "buffer_steps": 77,
        "hwm": 55,
        "max_queue_size": 66,
        "topic": "kv-paths",
        "enable_kv_cache_events": True,
        "wire_format": "vllm",
        "strict": True,
        "curve_secret_key": str(secret),
        "curve_clients": str(tmp_path / "allowed"),
        "curve_allow_any_client": False,  # the other way of saying who may connect
        "replay_max_concurrent": 3,
        "replay_max_batches": 9,
        "replay_rate": 4.5,
        "replay_burst": 6,
        "replay_client_timeout": 2.5,
        "shutdown_timeout": 0.75,
        "snapshots": False,
        "bind": True,  # LOOPBACK has a wildcard port: it binds either way
        "block_size": 32,
        "hash_algorithm": "xxhash_cbor",
    }
    missing = sorted(tskv.core.config.field_names() - set(values))
    assert not missing, f"give these new keys a non-default value here: {missing}"
    config = KVEventsConfig(**values)
    default = KVEventsConfig()
    unchanged = [
        field.name
        for field in attrs.fields(KVEventsConfig)
        if getattr(config, field.name) == getattr(default, field.name)
        and field.name != "curve_allow_any_client"
    ]
    assert not unchanged, f"these keys kept their defaults: {unchanged}"
    return config


@attrs.frozen
class Built:
    """A publisher as one path built it: its config, where it bound, and a way to publish."""

    config: KVEventsConfig
    endpoint: str
    publish: Callable[[list[tskv.KVEvent]], Awaitable[None]]


def trio_built(publisher: tskv.Publisher) -> Built:
    return Built(publisher.config, publisher.endpoint, publisher.publish)


@asynccontextmanager
async def trio_path(config: KVEventsConfig) -> AsyncIterator[Built]:
    async with tskv.open_publisher(config) as publisher:
        yield trio_built(publisher)


@asynccontextmanager
async def threaded(build: Callable[[], ZmqEventPublisher]) -> AsyncIterator[Built]:
    publisher = await trio.to_thread.run_sync(build)

    async def publish(events: list[tskv.KVEvent]) -> None:
        batch = tskv.KVEventBatch(1.0, events)
        await trio.to_thread.run_sync(publisher.publish, batch)

    try:
        yield Built(publisher.config, publisher.endpoint, publish)
    finally:
        await trio.to_thread.run_sync(publisher.shutdown)


@asynccontextmanager
async def keywords_path(config: KVEventsConfig) -> AsyncIterator[Built]:
    async with threaded(lambda: ZmqEventPublisher(0, **config.to_mapping())) as built:
        yield built


@asynccontextmanager
async def from_config_path(config: KVEventsConfig) -> AsyncIterator[Built]:
    async with threaded(lambda: ZmqEventPublisher.from_config(config)) as built:
        yield built


@asynccontextmanager
async def factory_path(config: KVEventsConfig) -> AsyncIterator[Built]:
    text = json.dumps(config.to_mapping())

    def build() -> ZmqEventPublisher:
        made = EventPublisherFactory.create(text, 0)
        assert isinstance(made, ZmqEventPublisher)
        return made

    async with threaded(build) as built:
        yield built


@asynccontextmanager
async def cli_path(config: KVEventsConfig) -> AsyncIterator[Built]:
    args = build_parser().parse_args(
        ["simulate", "--kv-events-config", json.dumps(config.to_mapping())]
    )
    async with trio.open_nursery() as nursery:
        options = SimOptions(rounds=None, duration=30, round_interval=0.01)
        with trio.fail_after(10):
            opened = await nursery.start(simulate, options, simulate_config(args), io.StringIO())
        yield trio_built(opened[0])
        nursery.cancel_scope.cancel()


@asynccontextmanager
async def tskv_testing_path(config: KVEventsConfig) -> AsyncIterator[Built]:
    async with open_simulated_stream(rounds=2, config=config) as stream:
        yield trio_built(stream.publisher)


PATHS = [trio_path, keywords_path, from_config_path, factory_path, cli_path, tskv_testing_path]


@pytest.mark.parametrize("path", PATHS, ids=lambda path: path.__name__)
async def test_every_key_reaches_the_publisher(tmp_path: Path, path: Any) -> None:
    config = every_key_changed(tmp_path)
    async with path(config) as built:
        assert built.config == config


async def rounds_a_plain_subscriber_saw(built: Built, rounds: int) -> int:
    """Publish up to `rounds` rounds, looking briefly after each for anything a clear-text SUB
    receives; how many rounds went out before it first did (`rounds` if it never did)."""
    plain = zmq.Context.instance().socket(zmq.SUB)
    plain.setsockopt(zmq.SUBSCRIBE, b"")
    try:
        plain.connect(built.endpoint)
        for n in range(rounds):
            await built.publish([tskv.BlockRemoved([n])])
            if plain.poll(20):  # a bounded look
                return n
        return rounds
    finally:
        plain.close(linger=0)


@pytest.mark.parametrize("path", PATHS, ids=lambda path: path.__name__)
async def test_curve_asked_for_on_any_path_keeps_a_plain_subscriber_out(
    tmp_path: Path, path: Any
) -> None:
    async with path(every_key_changed(tmp_path)) as built:
        assert await rounds_a_plain_subscriber_saw(built, 20) == 20  # nothing in clear text


async def test_the_clear_text_control_does_receive_so_the_look_above_can_fail(
    tmp_path: Path,
) -> None:
    config = attrs.evolve(every_key_changed(tmp_path), curve_secret_key=None, curve_clients=None)
    async with trio_path(config) as built:
        assert await rounds_a_plain_subscriber_saw(built, 500) < 500


@pytest.mark.parametrize("path", PATHS, ids=lambda path: path.__name__)
async def test_bind_true_binds_a_fixed_loopback_port_on_every_path(path: Any) -> None:
    """TokenSpeed's rule connects `tcp://127.0.0.1:PORT`; `bind: true` binds it, on every
    path, so a subscriber connecting there receives."""
    endpoint = f"tcp://127.0.0.1:{free_loopback_port()}"
    config = KVEventsConfig(
        publisher="zmq", enable_kv_cache_events=True, endpoint=endpoint, bind=True
    )
    async with path(config) as built:
        assert built.endpoint == endpoint
        assert await rounds_a_plain_subscriber_saw(built, 500) < 500


async def test_without_bind_a_fixed_loopback_endpoint_connects_as_tokenspeeds_rule_says() -> None:
    sub = zmq.Context.instance().socket(zmq.SUB)
    try:
        port = sub.bind_to_random_port("tcp://127.0.0.1")
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        config = KVEventsConfig(endpoint=f"tcp://127.0.0.1:{port}")
        assert config.bind is None and not config.binds(config.endpoint)
        async with trio_path(config) as built:
            for n in range(500):
                await built.publish([tskv.BlockRemoved([n])])
                if sub.poll(20):
                    break
            assert sub.poll(0)  # the publisher connected out to the SUB that bound
    finally:
        sub.close(linger=0)


def test_bind_must_be_true_false_or_null() -> None:
    with pytest.raises(tskv.ConfigError, match="bind = 'yes': use true"):
        KVEventsConfig(bind="yes")  # type: ignore[arg-type]
    assert KVEventsConfig.from_json('{"bind": false}').bind is False


def test_the_testing_stream_stays_on_this_machine_whatever_config_says() -> None:
    """Checked on the config the stream would open (so a regression binds nothing here): the
    default endpoint, every interface's wildcard, is moved to loopback, as a replay endpoint
    there would be; loopback, ipc and no replay stay as given."""
    wildcard = KVEventsConfig().endpoint
    moved = kept_on_this_machine(KVEventsConfig(replay_endpoint=wildcard))
    assert (moved.endpoint, moved.replay_endpoint) == (LOOPBACK, LOOPBACK)
    local = KVEventsConfig(endpoint="tcp://127.0.0.1:5557", replay_endpoint="ipc:///tmp/r")
    assert kept_on_this_machine(local) == local
    assert kept_on_this_machine(KVEventsConfig()).replay_endpoint is None


# -- the subscriber's settings ------------------------------------------------------------------


def every_subscriber_setting_changed(tmp_path: Path) -> dict[str, Any]:
    """SubscriberConfig values that each differ from the default. A new setting must be added."""
    server_public, _ = generate_keys(tmp_path / "server", "server")
    _, client_secret = generate_keys(tmp_path / "client", "client")
    values: dict[str, Any] = {
        "topic": "kv-paths",
        "start_seq": 3,
        "snapshots": False,
        "replay_timeout": 1.5,
        "hwm": 77,
        "max_held": 9,
        "max_snapshot_bytes": 4096,
        "max_message_bytes": 2048,
        "quiet_interval": 0.5,
        "warn_unanswered_after": 2.5,
        "curve_server_key": str(server_public),
        "curve_secret_key": str(client_secret),
    }
    missing = sorted(tskv.core.config.subscriber_field_names() - set(values))
    assert not missing, f"give these new settings a non-default value here: {missing}"
    default = tskv.SubscriberConfig()
    assert all(getattr(default, name) != value for name, value in values.items())
    return values


async def test_every_setting_reaches_the_subscriber_through_open_subscriber(
    tmp_path: Path,
) -> None:
    values = every_subscriber_setting_changed(tmp_path)
    port = free_loopback_port()
    replay = f"tcp://127.0.0.1:{free_loopback_port()}"
    async with tskv.open_subscriber(f"tcp://127.0.0.1:{port}", replay, **values) as sub:
        assert sub.config == tskv.SubscriberConfig(**values)


async def test_every_setting_reaches_each_workers_subscriber_through_the_watcher(
    tmp_path: Path,
) -> None:
    values = every_subscriber_setting_changed(tmp_path)
    del values["start_seq"]  # the watcher's own: each worker starts from its snapshot
    replay = f"tcp://127.0.0.1:{free_loopback_port()}"
    endpoint = f"tcp://127.0.0.1:{free_loopback_port()}"
    index = tskv.PrefixIndex()
    async with tskv.open_watcher(index, **values) as watcher:
        watcher.add("from-open", endpoint, replay)
        watcher.add("from-add", endpoint, replay, hwm=5, topic="other")
        expected = tskv.SubscriberConfig(**values, start_seq="snapshot")
        assert watcher.status("from-open").config == expected
        assert watcher.status("from-add").config == attrs.evolve(expected, hwm=5, topic="other")
        watcher.add("live-only", endpoint)  # no replay: live only, whatever else is set
        assert watcher.status("live-only").config.start_seq is None
        with pytest.raises(TypeError, match=r"max_hold \(did you mean 'max_held'\?\)"):
            watcher.add("typo", endpoint, max_hold=3)
        with pytest.raises(TypeError, match="the watcher sets start_seq itself"):
            watcher.add("own", endpoint, start_seq=0)
        watcher.remove("from-open")
        watcher.remove("from-add")
        watcher.remove("live-only")


async def test_a_bad_watcher_setting_is_refused_before_anything_runs() -> None:
    with pytest.raises(tskv.ConfigError, match="replay_timeout = 0"):
        async with tskv.open_watcher(tskv.PrefixIndex(), replay_timeout=0):
            pass  # pragma: no cover
    with pytest.raises(TypeError, match="not a subscriber setting: curve_key"):
        async with tskv.open_watcher(tskv.PrefixIndex(), curve_key="x"):
            pass  # pragma: no cover
