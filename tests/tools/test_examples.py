"""The examples in docs/ run, and a plain pyzmq SUB decodes what they publish."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.processes import killed_after

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"


def test_trio_scheduler_example_is_read_by_a_plain_pyzmq_sub() -> None:
    publisher = subprocess.Popen(
        [sys.executable, str(EXAMPLES / "trio_scheduler.py"), "tcp://127.0.0.1:*"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert publisher.stdout is not None
        with killed_after(30, publisher):
            endpoint = publisher.stdout.readline().split()[0]
        consumer = subprocess.run(
            [sys.executable, str(EXAMPLES / "plain_sub.py"), endpoint, "6"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert publisher.wait(timeout=60) == 0
    finally:
        publisher.kill()
        publisher.wait()
        if publisher.stdout is not None:
            publisher.stdout.close()
    lines = consumer.stdout.splitlines()
    assert lines == [f"{seq} 0 ['BlockStored']" for seq in range(5)] + [
        "5 0 ['BlockRemoved', 'AllBlocksCleared']"
    ], consumer.stderr


def test_the_testing_guide_example_passes_in_a_project_of_its_own(tmp_path: Path) -> None:
    # A scratch project: only the example file and a bare pytest config, tskv's plugin loaded
    # through its entry point as it is for any project that installs tskv.
    (tmp_path / "test_consumer_faults.py").write_text(
        (EXAMPLES / "test_consumer_faults.py").read_text()
    )
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "10 passed" in result.stdout


async def test_the_routing_guide_router_sends_a_request_to_the_worker_with_its_prefix() -> None:
    import importlib.util

    import trio

    import tskv
    from tests.zmq_helpers import LOOPBACK

    spec = importlib.util.spec_from_file_location("router_example", EXAMPLES / "router.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)

    config = tskv.KVEventsConfig(endpoint=LOOPBACK, replay_endpoint=LOOPBACK)
    prompt = list(range(100, 164))  # four blocks of 16
    index = tskv.PrefixIndex(16)
    async with tskv.open_publisher(config) as a, tskv.open_publisher(config, 1) as b:
        await a.publish([tskv.BlockStored([1, 2], None, prompt[:32], 16)])
        await b.publish([tskv.BlockStored([7, 8, 9], None, prompt[:48], 16)])
        async with tskv.open_watcher(index) as watcher:
            watcher.add("a", a.endpoint, a.replay_endpoint)
            watcher.add("b", b.endpoint, b.replay_endpoint)
            with trio.fail_after(10):
                await watcher.wait_for_seq("a", 0)
                await watcher.wait_for_seq("b", 0)
            router = example.Router(watcher)
            first = router.route(prompt)
            assert (first.worker, first.cached_tokens) == ("b", 48)
            assert router.queued == {"b": 16}  # what b must still prefill of it
            index.mark_stale("b")  # as the watcher does when b's stream reports a loss
            second = router.route(prompt)
            assert (second.worker, second.cached_tokens) == ("a", 32)
            assert index.match(prompt).predicted == {"a": 2, "b": 1}  # both will hold all four
            router.done(first, prompt)
            router.done(second, prompt)
            assert router.queued == {"a": 0, "b": 0}
            index.mark_current("b")
            busy = router.route(list(range(1000, 1064)))  # nobody holds it: the least loaded
            assert (busy.worker, busy.cached_tokens) == ("a", 0)
            assert router.route(list(range(2000, 2064))).worker == "b"  # a has 64 queued now


def test_the_routing_guide_shows_the_tested_example_as_it_is() -> None:
    source = (EXAMPLES / "router.py").read_text()
    guide = (EXAMPLES.parent / "routing.md").read_text()
    assert source[source.index("import contextlib") :] in guide
