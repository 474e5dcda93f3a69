"""The tools as a new user meets them: every way a command ends, and degenerate arguments
refused up front with the fix named."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import trio
import zmq

import tskv
from tests.processes import killed_after
from tests.zmq_helpers import LOOPBACK, raw_socket
from tskv import BlockRemoved, KVEventBatch, ZmqEventPublisher
from tskv._cli import main
from tskv.core.frames import live_message, parse_replay_request, replay_end, replay_reply


def tskv_process(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tskv", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["demo", "--requests-per-round", "0"], "--requests-per-round 0: the demo would publish"),
        (["demo", "--cache-blocks", "1"], "--cache-blocks 1: too small to cache one request"),
        (["listen", "ipc:///nonexistent-tskv-dir/sock"], "folder '/nonexistent-tskv-dir'"),
        (
            ["simulate", "--kv-events-config", '{"publisher": "kafka"}'],
            "publisher = 'kafka': tskv simulate publishes over ZeroMQ",
        ),
    ],
)
def test_what_cannot_work_is_one_line_naming_the_fix_exit_2(
    args: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(args) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert says in line and line.startswith(f"tskv {args[0]}: ")


def test_bench_outside_a_clone_says_where_the_benchmark_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)  # an installed tskv, run anywhere: no benchmarks/ here
    assert main(["bench", "--only", "index"]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("tskv bench: ") and "nox -s bench" in line


def test_demo_interrupted_exits_130_with_one_line() -> None:
    demo = tskv_process("demo", "--rounds", "1000000")
    assert demo.stdout is not None
    with killed_after(60, demo):
        demo.stdout.readline()  # it is running
        demo.send_signal(signal.SIGINT)
        _, err = demo.communicate(timeout=30)
    assert demo.returncode == 130
    assert err.splitlines() == ["tskv demo: interrupted"]


def test_listen_stops_after_count_with_a_summary_and_says_where_it_bound() -> None:
    listener = tskv_process("listen", LOOPBACK, "--count", "2")
    assert listener.stderr is not None
    with killed_after(60, listener):
        bound = listener.stderr.readline()
        assert bound.startswith("tskv listen: bound to tcp://127.0.0.1:")
        endpoint = bound.split()[-1]
        publisher = ZmqEventPublisher(0, endpoint=endpoint)  # connects out to the listener
        try:
            assert publisher.wait_for_subscriber(20)
            for n in range(5):
                publisher.publish(KVEventBatch(float(n), [BlockRemoved([n])]))
            out, err = listener.communicate(timeout=30)
        finally:
            publisher.shutdown()
    assert listener.returncode == 0
    assert [line.split()[0] for line in out.splitlines()] == ["seq=0", "seq=1"]
    assert err.startswith("tskv listen: 2 batches")


@pytest.mark.parametrize("how", ["sigterm", "duration"])
def test_listen_ends_on_sigterm_or_duration_with_its_summary(how: str) -> None:
    publisher = ZmqEventPublisher(0, endpoint=LOOPBACK)
    try:
        extra = ["--duration", "1"] if how == "duration" else []
        listener = tskv_process("listen", publisher.endpoint, *extra)
        with killed_after(60, listener):
            assert publisher.wait_for_subscriber(20)
            publisher.publish(KVEventBatch(1.0, [BlockRemoved([1])]))
            assert listener.stdout is not None
            assert listener.stdout.readline().startswith("seq=0 ")
            if how == "sigterm":
                listener.send_signal(signal.SIGTERM)
            _, err = listener.communicate(timeout=30)
    finally:
        publisher.shutdown()
    assert listener.returncode == 0
    assert err.splitlines() == [
        "tskv listen: 1 batches (0 repaired from replay), 0 lost, 0 restarts, 0 undecodable"
    ]


async def test_replayed_batches_on_another_topic_are_filtered_as_live_ones_are() -> None:
    """vLLM's replay layout carries the topic: what is not subscribed to is not delivered."""
    async with (
        raw_socket(zmq.XPUB, LOOPBACK, bind=True) as pub,
        raw_socket(zmq.ROUTER, LOOPBACK, bind=True) as router,
    ):
        endpoint = pub.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        replay = router.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        ours = tskv.encode_batch(KVEventBatch(2.0, [BlockRemoved([2])], 0))
        theirs = tskv.encode_batch(KVEventBatch(1.0, [BlockRemoved([1])], 0))
        async with tskv.open_subscriber(endpoint, replay, "kv-b", start_seq=0) as sub:
            with trio.fail_after(10):
                await pub.receive()  # subscribed
                request = parse_replay_request(await router.receive())
                client = request.client
                assert request.start_seq == 0
                for seq in range(3):
                    await router.send(replay_reply(client, seq, theirs, b"kv-a"))
                await pub.send(live_message(b"kv-b", 0, ours))
                await router.send(replay_end(client, b""))
                seq, batch = await sub.__anext__()
    assert (seq, batch.events) == (0, [BlockRemoved([2])])


def test_keys_generate_onto_an_existing_pair_says_so(tmp_path: Path) -> None:
    assert main(["keys", "generate", str(tmp_path), "--name", "a"]) == 0
    result = subprocess.run(
        [sys.executable, "-m", "tskv", "keys", "generate", str(tmp_path), "--name", "a"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    [line] = result.stderr.splitlines()
    assert "already exists" in line and "--name" in line


def test_keys_generate_onto_a_file_says_it_wants_a_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "taken").write_text("not a directory")
    assert main(["keys", "generate", str(tmp_path / "taken")]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert "is a file, not a directory" in line


def test_a_misspelt_flag_is_refused_naming_the_one_meant(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as ended:
        main(["listen", "tcp://127.0.0.1:5557", "--cout", "3"])
    assert ended.value.code == 2
    assert "unrecognized arguments: --cout 3 (did you mean '--count'?)" in capsys.readouterr().err
