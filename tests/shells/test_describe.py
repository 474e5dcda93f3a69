"""A publisher says what it is on request, over real sockets; one that cannot say (every
publisher but tskv's) is told apart from one that will not answer."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import trio
import trio.testing

import tskv
from tests.zmq_helpers import LOOPBACK
from tskv import BlockStored, GroupInfo, describe_publisher
from tskv.curve.key_files import generate_keys
from tskv.testing import open_scripted_publisher


def stored(group: int, kind: str, window: int | None = None) -> BlockStored:
    return BlockStored(
        [100 + group], None, [1] * 16, 16,
        group_idx=group, kv_cache_spec_kind=kind, kv_cache_spec_sliding_window=window,
    )  # fmt: skip


@pytest.mark.parametrize("snapshots", [True, False])
async def test_a_publisher_says_its_configuration_groups_and_buffer(snapshots: bool) -> None:
    config = tskv.KVEventsConfig(
        endpoint=LOOPBACK,
        replay_endpoint=LOOPBACK,
        wire_format="vllm",
        topic="kv",
        block_size=16,
        hash_algorithm="sha256_cbor",
        snapshots=snapshots,
        buffer_steps=3,
    )
    async with tskv.open_publisher(config, dp_rank=0) as publisher:
        assert publisher.replay_endpoint is not None
        with trio.fail_after(10):
            empty = await describe_publisher(publisher.replay_endpoint)
        assert empty is not None
        assert (empty.oldest_seq, empty.newest_seq, empty.groups) == (None, None, ())
        for _ in range(2):
            await publisher.publish([stored(0, "full_attention")])
            await publisher.publish([stored(1, "sliding_window", 128)])
        await trio.testing.wait_all_tasks_blocked()  # the publish task has sent them all
        assert publisher.statistics().published == 4
        with trio.fail_after(10):
            said = await describe_publisher(publisher.replay_endpoint)
    assert said is not None
    assert said.tskv_version == tskv.__version__ and said.epoch == publisher.epoch
    assert (said.wire_format, said.topic, said.dp_rank) == ("vllm", "kv", 0)
    assert (said.block_size, said.hash_algorithm) == (16, "sha256_cbor")
    assert said.groups == (
        GroupInfo(0, "full_attention", 16, None),
        GroupInfo(1, "sliding_window", 16, 128),
    )
    assert (said.oldest_seq, said.newest_seq, said.snapshots) == (1, 3, snapshots)


async def test_on_tokenspeeds_wire_no_group_is_named_as_none_is_sent() -> None:
    config = tskv.KVEventsConfig(endpoint=LOOPBACK, replay_endpoint=LOOPBACK)
    async with tskv.open_publisher(config) as publisher:
        await publisher.publish([stored(1, "sliding_window", 128)])
        await trio.testing.wait_all_tasks_blocked()
        assert publisher.replay_endpoint is not None
        with trio.fail_after(10):
            said = await describe_publisher(publisher.replay_endpoint)
    assert said is not None and said.groups == () and said.block_size is None


async def test_a_publisher_that_knows_no_descriptors_answers_none() -> None:
    """It reads the request as a replay past its newest seq: the end marker alone."""
    async with open_scripted_publisher() as scripted:
        scripted.send([stored(0, "full_attention")])
        assert scripted.replay_endpoint is not None
        with trio.fail_after(10):
            assert await describe_publisher(scripted.replay_endpoint) is None


async def test_a_refusal_is_an_error_that_says_to_ask_later() -> None:
    async with open_scripted_publisher() as scripted:
        scripted.replay_mode = "refuse"
        assert scripted.replay_endpoint is not None
        with trio.fail_after(10), pytest.raises(tskv.TskvError, match="ask again later"):
            await describe_publisher(scripted.replay_endpoint)


async def test_an_encrypted_publisher_describes_itself_only_to_a_client_with_its_key(
    tmp_path: Path,
) -> None:
    server_public, server_secret = generate_keys(tmp_path / "server", "server")
    client_public, client_secret = generate_keys(tmp_path / "client", "client")
    (tmp_path / "allowed").mkdir()
    shutil.copy(client_public, tmp_path / "allowed")
    config = tskv.KVEventsConfig(
        endpoint=LOOPBACK,
        replay_endpoint=LOOPBACK,
        curve_secret_key=str(server_secret),
        curve_clients=str(tmp_path / "allowed"),
        block_size=64,
    )
    async with tskv.open_publisher(config) as publisher:
        assert publisher.replay_endpoint is not None
        with trio.fail_after(10):
            said = await describe_publisher(
                publisher.replay_endpoint,
                curve_server_key=str(server_public),
                curve_secret_key=str(client_secret),
            )
        assert said is not None and said.block_size == 64
        with trio.move_on_after(0.5) as waited:  # clear text: the handshake never completes
            await describe_publisher(publisher.replay_endpoint)
        assert waited.cancelled_caught
