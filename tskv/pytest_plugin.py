"""The pytest plugin tskv registers (entry point `pytest11`): fixtures, nothing else.

A project that uses none of these fixtures sees no change. Trio tests (pytest-trio) use
`tskv_publisher`, `tskv_scripted`, `tskv_stream`; synchronous tests use the `_sync` twins,
whose Trio loop runs on a thread. Configure the stream with `@pytest.mark.tskv_stream(...)`.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from tskv.core.config import KVEventsConfig, did_you_mean
from tskv.core.endpoints import LOOPBACK
from tskv.shells.publisher import Publisher, open_publisher
from tskv.shells.threaded import ZmqEventPublisher
from tskv.testing import (
    ScriptedPublisher,
    ScriptedPublisherThread,
    SimulatedStream,
    SimulatedStreamThread,
    open_scripted_publisher,
    open_simulated_stream,
)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "tskv_stream(seed=0, rounds=100, requests_per_round=2, block_size=16, cache_blocks=256, "
        "topic='', config=None): configure tskv's simulated stream fixtures",
    )


STREAM_OPTIONS = frozenset(inspect.signature(open_simulated_stream).parameters)


def _stream_options(request: pytest.FixtureRequest) -> dict[str, Any]:
    """The marker's keywords, each one the stream takes: a misspelt one fails the test with
    one line naming the keyword meant, not a TypeError deep in a fixture's traceback."""
    marker = request.node.get_closest_marker("tskv_stream")
    if marker is None:
        return {}
    if marker.args:
        pytest.fail(
            f"@pytest.mark.tskv_stream takes keywords only ({', '.join(sorted(STREAM_OPTIONS))}),"
            f" not {marker.args!r}",
            pytrace=False,
        )
    for name in marker.kwargs:
        if name not in STREAM_OPTIONS:
            meant = did_you_mean(name, set(STREAM_OPTIONS))
            pytest.fail(
                f"@pytest.mark.tskv_stream has no {name!r}{meant}; it takes "
                f"{', '.join(sorted(STREAM_OPTIONS))}",
                pytrace=False,
            )
    return dict(marker.kwargs)


@pytest.fixture
async def tskv_publisher() -> AsyncIterator[Publisher]:
    """A tskv publisher on loopback, with replay, ports chosen by the OS (Trio tests)."""
    config = KVEventsConfig(endpoint=LOOPBACK, replay_endpoint=LOOPBACK, strict=True)
    async with open_publisher(config) as publisher:
        yield publisher


@pytest.fixture
def tskv_publisher_sync() -> Iterator[ZmqEventPublisher]:
    """The threaded tskv publisher on loopback, with replay (sync tests)."""
    publisher = ZmqEventPublisher(0, endpoint=LOOPBACK, replay_endpoint=LOOPBACK, strict=True)
    try:
        yield publisher
    finally:
        publisher.shutdown()


@pytest.fixture
async def tskv_scripted() -> AsyncIterator[ScriptedPublisher]:
    """A scripted publisher with replay (Trio tests)."""
    async with open_scripted_publisher() as scripted:
        yield scripted


@pytest.fixture
def tskv_scripted_sync() -> Iterator[ScriptedPublisherThread]:
    """A scripted publisher with replay, driven from sync code."""
    with ScriptedPublisherThread() as scripted:
        yield scripted


@pytest.fixture
async def tskv_stream(request: pytest.FixtureRequest) -> AsyncIterator[SimulatedStream]:
    """The simulated scheduler's stream (configure with @pytest.mark.tskv_stream) for Trio tests."""
    async with open_simulated_stream(**_stream_options(request)) as stream:
        yield stream


@pytest.fixture
def tskv_stream_sync(request: pytest.FixtureRequest) -> Iterator[SimulatedStreamThread]:
    """The simulated scheduler's stream for sync tests."""
    with SimulatedStreamThread(**_stream_options(request)) as stream:
        yield stream
