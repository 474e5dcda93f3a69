"""`tskv listen`: the lines it prints, the gap it repairs, and how it ends."""

from __future__ import annotations

import io
import json
import logging
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trio
import trio.testing
import zmq

import tskv
from tests.processes import killed_after
from tests.zmq_helpers import (
    LOOPBACK,
    inproc_name,
    next_subscription,
    raw_socket,
    refusing_endpoint,
)
from tskv import BlockRemoved, BlockStored, KVEventBatch, KVEventsConfig, ZmqEventPublisher
from tskv._cli.listen import format_batch, listen
from tskv.core.frames import live_message
from tskv.testing import ScriptedPublisher, open_scripted_publisher


def payload(seq: int) -> bytes:
    events = [BlockStored([0xDEADBEEF00000000 + seq], None, [1, 2], 2), BlockRemoved([seq])]
    return tskv.encode_batch(KVEventBatch(1_700_000_000.5, events, 2))


def test_format_batch_is_one_readable_line() -> None:
    batch = tskv.decode_batch(payload(7))
    line = format_batch(7, batch)
    assert line.startswith("seq=7 rank=2 ")
    assert "stored=1 removed=1 cleared=0" in line
    assert "+1[00000007]<-" in line and "-1[00000007]" in line


async def test_listen_repairs_a_gap_made_on_purpose_and_shows_it(
    tskv_scripted: ScriptedPublisher,
) -> None:
    out = io.StringIO()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            listen,
            tskv_scripted.endpoint,
            tskv_scripted.replay_endpoint,
            "",
            None,
            True,
            out,
            5,
        )
        with trio.fail_after(10):
            await tskv_scripted.wait_for_subscriber()
        tskv_scripted.rank = 2
        tskv_scripted.send([BlockRemoved([0])])
        for n in (1, 2):  # lost on the way on purpose; the replay buffer has them
            tskv_scripted.drop([BlockRemoved([n])])
        for n in (3, 4):
            tskv_scripted.send([BlockRemoved([n])])
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [line["seq"] for line in lines] == [0, 1, 2, 3, 4]
    assert lines[1]["events"] == [{"type": "BlockRemoved", "block_hashes": [1]}]
    assert lines[1]["attn_dp_rank"] == 2
    assert tskv_scripted.replay_requests == [0]  # from the last batch delivered, to compare


class WatchedOutput(io.StringIO):
    """What listen printed, with a way to wait for a line."""

    def __init__(self) -> None:
        super().__init__()
        self._written = trio.Event()

    def write(self, text: str) -> int:
        self._written.set()
        return super().write(text)

    async def wait_for(self, text: str) -> None:
        while text not in self.getvalue():
            self._written = trio.Event()
            await self._written.wait()


async def test_listen_from_snapshot_shows_the_whole_cache_then_goes_on_live() -> None:
    config = KVEventsConfig(endpoint=LOOPBACK, replay_endpoint=LOOPBACK, buffer_steps=5)
    out = WatchedOutput()
    async with tskv.open_publisher(config) as publisher:
        for n in range(20):  # blocks 0..19, then 0..9 removed: 10 cached, 15 batches evicted
            events = [BlockStored([n], None, [n] * 4, 4)]
            await publisher.publish(events + ([BlockRemoved([n - 10])] if n >= 10 else []))
        await trio.testing.wait_all_tasks_blocked()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                listen, publisher.endpoint, publisher.replay_endpoint, "", "snapshot", False, out, 2
            )
            with trio.fail_after(10):
                await publisher.wait_for_subscriber()
                # the snapshot first: published before its request is served, the next batch
                # would be in it (the snapshot as of seq 20), and no third line would come
                await out.wait_for("seq=19 ")
            await publisher.publish([BlockRemoved([19])])
    header, snapshot, live = out.getvalue().splitlines()
    assert header == "== snapshot: the publisher's whole cache after seq 19, 10 blocks"
    assert snapshot.startswith("seq=19 ") and "stored=10 removed=0 cleared=1" in snapshot
    assert live.startswith("seq=20 ") and "removed=1" in live


async def test_listen_shows_a_loss_where_it_falls() -> None:
    out = io.StringIO()
    async with raw_socket(zmq.XPUB, LOOPBACK, bind=True) as pub, trio.open_nursery() as nursery:
        endpoint = pub.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        nursery.start_soon(listen, endpoint, None, "", None, False, out, 2)
        with trio.fail_after(10):
            await pub.receive()
        for seq in (0, 5):
            pub.send_nowait(live_message(b"", seq, payload(seq)))
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("seq=0 ")
    assert lines[1] == "!! lost seq 1..4 (no-replay)"
    assert lines[2].startswith("seq=5 ")


def test_ctrl_c_ends_cleanly_with_a_summary() -> None:
    publisher = ZmqEventPublisher(0, endpoint=LOOPBACK)
    try:
        listener = subprocess.Popen(
            [sys.executable, "-m", "tskv", "listen", publisher.endpoint],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 20
        while publisher.statistics().subscriptions < 1:  # sync test: poll the counter
            assert time.monotonic() < deadline and listener.poll() is None
            time.sleep(0.01)
        for n in range(3):
            publisher.publish(KVEventBatch(float(n), [BlockRemoved([n])]))
        assert listener.stdout is not None
        with killed_after(30, listener):
            first = [listener.stdout.readline() for _ in range(3)]
        listener.send_signal(signal.SIGINT)
        _, err = listener.communicate(timeout=20)
    finally:
        publisher.shutdown()
    assert [line.split()[0] for line in first] == ["seq=0", "seq=1", "seq=2"]
    assert listener.returncode == 0
    assert "tskv listen: 3 batches (0 repaired from replay), 0 lost" in err
    assert "Traceback" not in err


def test_a_snapshot_over_max_snapshot_bytes_is_given_up_for_replay_and_says_why() -> None:
    publisher = ZmqEventPublisher(0, endpoint=LOOPBACK, replay_endpoint=LOOPBACK, buffer_steps=5)
    try:
        for n in range(20):
            publisher.publish(KVEventBatch(float(n), [BlockStored([n], None, [n] * 4, 4)]))
        deadline = time.monotonic() + 20
        while publisher.statistics().published < 20:  # sync test: poll the counter
            assert time.monotonic() < deadline
            time.sleep(0.01)
        args = ["--replay", str(publisher.replay_endpoint), "--from", "snapshot", "--count", "5"]
        done = run_listen(publisher.endpoint, *args, "--max-snapshot-bytes", "60")
    finally:
        publisher.shutdown()
    lines = done.stdout.splitlines()
    assert lines[0] == "!! lost seq 0..14 (evicted)"  # what replay no longer has
    assert [line.split()[0] for line in lines[1:]] == [f"seq={n}" for n in range(15, 20)]
    assert "over max_snapshot_bytes = 60" in done.stderr and done.returncode == 0
    refused = run_listen("tcp://127.0.0.1:1", "--max-snapshot-bytes", "0")
    assert refused.returncode == 2 and "--max-snapshot-bytes" in refused.stderr


async def test_a_batch_over_max_message_bytes_costs_that_batch_and_says_why() -> None:
    async def run(endpoint: str) -> None:
        args = [sys.executable, "-m", "tskv", "listen", endpoint, "--count", "2"]
        done.append(
            await trio.run_process(
                [*args, "--max-message-bytes", "2048"], capture_stdout=True, capture_stderr=True
            )
        )

    done: list[subprocess.CompletedProcess[bytes]] = []
    async with raw_socket(zmq.XPUB, LOOPBACK, bind=True) as pub, trio.open_nursery() as nursery:
        pub.sock.setsockopt(zmq.XPUB_VERBOSE, 1)
        nursery.start_soon(run, pub.sock.last_endpoint.decode())
        await next_subscription(pub)
        pub.send_nowait(live_message(b"", 0, payload(0)))
        pub.send_nowait(live_message(b"", 1, b"\x90" * 4096))
        await next_subscription(pub)  # it connected again
        pub.send_nowait(live_message(b"", 2, payload(2)))
    lines = done[0].stdout.decode().splitlines()
    assert [line.split()[0] for line in lines] == ["seq=0", "!!", "seq=2"]
    assert "a batch over max_message_bytes = 2048" in done[0].stderr.decode()


def test_bad_endpoint_exits_2_with_a_clear_message() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "tskv", "listen", "localhost:5557"], capture_output=True, text=True
    )
    assert result.returncode == 2
    assert "is not a ZeroMQ address" in result.stderr
    result = subprocess.run(
        [sys.executable, "-m", "tskv", "listen", "tcp://127.0.0.1:1", "--from-seq", "3"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2 and "--from 3 needs --replay-endpoint" in result.stderr


def run_listen(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tskv", "listen", *args], capture_output=True, text=True, timeout=60
    )


def test_listen_problems_are_one_line_naming_the_fix_with_status_2(tmp_path: Path) -> None:
    junk = tmp_path / "junk.key"
    junk.write_text("not a certificate")
    long_ipc = "ipc://" + "/tmp/" + "x" * 200  # longer than a unix socket path may be
    cases = [
        (["tcp://nohost.invalid:1"], "does not resolve"),
        (
            ["tcp://127.0.0.1:1", "--curve-server-key", str(tmp_path / "missing.key")],
            "does not exist",
        ),
        (["tcp://127.0.0.1:1", "--curve-server-key", str(junk)], "is not a ZeroMQ certificate"),
        ([long_ipc], "is longer than 107 bytes"),
        (["tcp://127.0.0.1:1", "--replay-endpoint", "tcp://nohost.invalid:2"], "does not resolve"),
    ]
    for args, says in cases:
        done = run_listen(*args)
        assert done.returncode == 2, (args, done.stderr)
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("tskv listen: "), (args, done.stderr)
        assert says in lines[0] and "Traceback" not in done.stderr


async def test_a_publisher_that_never_answers_is_reported(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Every connection is refused there: the subscriber retries silently, as ZeroMQ does.
    with refusing_endpoint() as free, caplog.at_level(logging.WARNING, logger="tskv"):
        async with tskv.open_subscriber(free, warn_unanswered_after=0.2):
            with trio.fail_after(10):
                while "no publisher has answered" not in caplog.text:  # noqa: ASYNC110
                    await trio.sleep(0.05)  # a log line is all there is to wait for
    assert f"no publisher has answered on {free} for 0.2 s" in caplog.text


def test_json_shows_unknown_fields_of_any_msgpack_type() -> None:
    from tskv._cli.listen import batch_json

    odd = {"digest": b"\x01\x02", "nested": {"keys": [1, "a"]}}
    batch = KVEventBatch(1.0, [BlockRemoved([1], unknown_fields=odd)], 0)
    [event] = json.loads(batch_json(3, batch))["events"]
    assert event["unknown_fields"] == {"digest": "0102", "nested": {"keys": [1, "a"]}}


async def test_an_inproc_publisher_that_answers_is_not_reported_as_silent(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """inproc has no handshake to watch: the warning must not fire for a publisher that is
    there and publishing (it once did, after every run of the trace demo longer than 5 s)."""
    name = inproc_name("quiet-warning")
    config = tskv.KVEventsConfig(endpoint=name)
    with caplog.at_level(logging.WARNING, logger="tskv"):
        async with (
            tskv.open_publisher(config) as publisher,
            tskv.open_subscriber(name, warn_unanswered_after=0.1) as sub,
        ):
            await publisher.wait_for_subscriber()
            await publisher.publish([BlockRemoved([1])])
            with trio.fail_after(10):
                assert (await sub.__anext__())[0] == 0
            await trio.sleep(0.4)  # the time the warning had to come: it must not
    assert "no publisher has answered" not in caplog.text


async def test_a_refused_handshake_ends_listen_with_one_line_naming_the_key_to_check(
    tmp_path: Path,
) -> None:
    """A wrong server key never heals: listen says so once and exits 2, not after a
    misleading "no publisher has answered" and never."""
    from tskv.curve.key_files import generate_keys

    _, server_secret = generate_keys(tmp_path / "server", "publisher")
    wrong_public, _ = generate_keys(tmp_path / "wrong", "wrong")
    config = KVEventsConfig(
        endpoint=LOOPBACK, curve_secret_key=str(server_secret), curve_allow_any_client=True
    )
    async with tskv.open_publisher(config) as publisher:
        args = (publisher.endpoint, "--curve-server-key", str(wrong_public))
        done = await trio.to_thread.run_sync(lambda: run_listen(*args))
    assert done.returncode == 2, done.stderr
    [line] = done.stderr.splitlines()
    assert (
        line.startswith("tskv listen: ")
        and "handshake" in line
        and "failed" in line
        and "curve_server_key" in line
    )
    assert "no publisher has answered" not in done.stderr and "Traceback" not in done.stderr


async def test_a_bootstrap_from_seq_0_is_not_counted_as_repaired() -> None:
    """`listen --from 0 --count 3` once said "3 repaired from replay" with no gap at all."""
    config = KVEventsConfig(endpoint=LOOPBACK, replay_endpoint=LOOPBACK)
    async with tskv.open_publisher(config) as publisher:
        for n in range(3):
            await publisher.publish([BlockRemoved([n])])
        out, summary = io.StringIO(), io.StringIO()
        with trio.fail_after(20):
            await listen(
                publisher.endpoint, publisher.replay_endpoint, "", 0, False, out, 3,
                summary_to=summary,
            )  # fmt: skip
    assert len(out.getvalue().splitlines()) == 3
    assert "3 batches (0 repaired from replay), 0 lost" in summary.getvalue()


async def test_describe_prints_what_a_publisher_says_it_is_and_says_when_it_says_nothing() -> None:
    config = tskv.KVEventsConfig(
        endpoint=LOOPBACK,
        replay_endpoint=LOOPBACK,
        wire_format="vllm",
        block_size=16,
        hash_algorithm="xxhash",
    )
    async with tskv.open_publisher(config) as publisher:
        await publisher.publish(
            [tskv.BlockStored([1], None, [0] * 16, 16, group_idx=1, kv_cache_spec_kind="mamba")]
        )
        assert publisher.replay_endpoint is not None
        args = [sys.executable, "-m", "tskv", "listen", "--describe", publisher.replay_endpoint]
        text = await trio.run_process(args, capture_stdout=True, capture_stderr=True)
        as_json = await trio.run_process([*args, "--json"], capture_stdout=True)
    lines = text.stdout.decode().splitlines()
    assert lines[0] == (
        f"publisher on {publisher.replay_endpoint}: tskv {tskv.__version__}, "
        f"epoch {publisher.epoch:016x}"
    )
    assert "block_size=16 hash_algorithm=xxhash" in lines[2]
    assert lines[-1] == "  group 1: mamba block_size=16"
    said = json.loads(as_json.stdout)
    assert (said["epoch"], said["block_size"], said["wire_format"]) == (
        publisher.epoch,
        16,
        "vllm",
    )
    async with open_scripted_publisher() as scripted:
        assert scripted.replay_endpoint is not None
        args[-1] = scripted.replay_endpoint
        done = await trio.run_process(args, capture_stderr=True, check=False)
    assert done.returncode == 1 and "does not describe itself" in done.stderr.decode()
    done = await trio.run_process([*args, "tcp://127.0.0.1:1"], capture_stderr=True, check=False)
    assert done.returncode == 2 and "drop ENDPOINT" in done.stderr.decode()
