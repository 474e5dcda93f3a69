"""Mooncake request traces: read strictly, served by simulated workers whose events rebuild
their caches exactly, routed over real ZeroMQ by `tskv demo --route N --trace`, and published
by `tskv simulate --trace`."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trio

import tskv
from tests.zmq_helpers import LOOPBACK
from tskv.sim.trace import TraceError, TraceRequest, max_hit_rate, read_trace
from tskv.sim.trace_fleet import TraceWorker, block_hashes
from tskv.sim.trace_routing import TraceOptions, publish_trace

HEAD = Path(__file__).resolve().parents[1] / "traces" / "mooncake_synthetic_head.jsonl"
LINES = [
    {"timestamp": 0, "input_length": 1024, "output_length": 5, "hash_ids": [1, 2]},
    {"timestamp": 10, "input_length": 1100, "output_length": 5, "hash_ids": [1, 2, 3]},
    {"timestamp": 20, "input_length": 600, "output_length": 5, "hash_ids": [1, 4]},
]


def write(path: Path, lines: list[object]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_a_trace_reads_in_time_order_and_its_ceiling_is_an_infinite_shared_cache(
    tmp_path: Path,
) -> None:
    trace = read_trace(write(tmp_path / "t.jsonl", list(reversed(LINES))))
    assert [r.timestamp_ms for r in trace] == [0, 10, 20]
    assert trace[1] == TraceRequest(10, 1100, 5, (1, 2, 3))
    assert len(trace[1].token_ids()) == 1100 and trace[1].token_ids()[512] == 2 * 512
    # blocks 1 and 2 again (1,024 tokens), then block 1 (512): of 2,724 prompt tokens
    assert max_hit_rate(trace, 64) == pytest.approx(1536 / 2724)
    assert len(read_trace(HEAD, limit=7)) == 7


def line(**changes: object) -> str:
    return json.dumps({**LINES[0], **changes})


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("{not json", ":2: not JSON"),
        ("[1, 2]", ":2: a request is a JSON object"),
        ('{"timestamp": 5, "input_length": 10}', ":2: the request has no output_length, hash_ids"),
        (line(timestamp=-1), ":2: timestamp = -1 must be a whole number"),
        (line(input_length="9"), ":2: input_length = '9' must be a whole number"),
        (line(hash_ids=["a", 2]), ":2: hash_ids must be a list of whole numbers"),
        (line(input_length=1025), ":2: 2 hash_ids for input_length 1025"),
    ],
)
def test_a_malformed_line_is_refused_with_its_number(tmp_path: Path, text: str, says: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(LINES[0]) + "\n" + text + "\n")
    with pytest.raises(TraceError, match=says) as raised:
        read_trace(path)
    assert str(path) in str(raised.value)


def test_a_missing_or_empty_trace_is_refused_naming_it(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot read the trace"):
        read_trace(tmp_path / "nowhere.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(TraceError, match="holds no requests"):
        read_trace(tmp_path / "empty.jsonl")


def test_a_worker_hits_its_cached_prefix_evicts_least_recently_used_and_says_so() -> None:
    trace = [TraceRequest(0, 1024, 5, (1, 2)), TraceRequest(10, 1100, 5, (1, 2, 3))]
    trace.append(TraceRequest(20, 600, 5, (1, 4)))
    worker = TraceWorker(cache_tokens=1100, block_size=64, prefill_rate=100.0)  # 17 blocks
    index = tskv.PrefixIndex(64)
    served = [worker.serve(request, request.timestamp_ms / 1000) for request in trace]
    assert [s.cached_tokens for s in served] == [0, 1024, 512]
    one, two = block_hashes(1, 64, 512), block_hashes(2, 64, 512)
    assert served[0].events == [  # the new blocks, one chain, one event
        tskv.BlockStored(one + two, None, list(range(512, 1536)), 64)
    ]
    assert served[1].events == [
        tskv.BlockStored(block_hashes(3, 64, 76), two[-1], list(range(1536, 1600)), 64)
    ]
    assert served[0].done_at == pytest.approx(1024 / 100.0)
    assert served[1].done_at == pytest.approx(1024 / 100.0 + 76 / 100.0)  # queued behind r1
    removed = [e for e in served[2].events if isinstance(e, tskv.BlockRemoved)]
    # trace block 3's block (the leaf, least recently used) goes; trace block 1, the request's
    # own, stays
    assert removed == [tskv.BlockRemoved(block_hashes(3, 64, 76))]
    for s in served:
        index.apply(0, s.events)
    assert index.engine_hashes(0) == worker.engine_hashes()
    assert worker.engine_hashes() == {*one, *two, *block_hashes(4, 64, 88)}


def test_a_worker_refuses_a_block_size_that_cuts_a_trace_block() -> None:
    with pytest.raises(ValueError, match="block size 48 does not divide a trace block"):
        TraceWorker(1000, 48, 1.0)


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tskv", *args], capture_output=True, text=True, timeout=300
    )


def test_the_trace_demo_routes_every_policy_and_the_index_stays_exact() -> None:
    done = run_cli("demo", "--route", "4", "--trace", str(HEAD), "--requests", "150", "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["requests"] == 150 and result["index_exact"] is True
    assert result["max_hit_rate"] == round(max_hit_rate(read_trace(HEAD, 150), 64), 4)
    policies = result["policies"]
    assert set(policies) == {
        "kv",
        "kv_without_predictions",
        "longest_prefix",
        "round_robin",
        "random",
    }
    for numbers in policies.values():
        assert set(numbers) == {"hit_rate", "prefill_tokens", "max_load_share"}
        assert 0 <= numbers["hit_rate"] <= result["max_hit_rate"]
        assert 1 / 4 <= numbers["max_load_share"] <= 1
    assert policies["kv"]["hit_rate"] > policies["round_robin"]["hit_rate"]
    assert policies["kv"]["prefill_tokens"] < policies["random"]["prefill_tokens"]


def test_the_trace_demo_refuses_what_it_cannot_use_in_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(LINES[0]) + "\n{oops\n")
    cases = [
        (["demo", "--route", "2", "--trace", str(bad)], f"{bad}:2: not JSON"),
        (["demo", "--trace", str(HEAD)], "--trace FILE goes with --route WORKERS"),
        (["demo", "--route", "2", "--json"], "--json: only with --route WORKERS --trace FILE"),
        (["demo", "--route", "2", "--trace", str(HEAD), "--block-size", "48"], "--block-size 48"),
        (["simulate", "--speed", "2"], "--speed: only with --trace FILE"),
    ]
    for args, says in cases:
        done = run_cli(*args)
        assert done.returncode == 2, (args, done.stderr)
        assert done.stderr.count("\n") == 1 and says in done.stderr, (args, done.stderr)


def test_the_trace_demo_plots_hit_rate_over_time_and_load_per_worker(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "trace.png"
    done = run_cli(
        "demo", "--route", "2", "--trace", str(HEAD), "--requests", "40", "--plot", str(png)
    )
    assert done.returncode == 0, done.stderr
    assert f"plot written to {png}" in done.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


async def test_a_traces_events_published_for_any_consumer_rebuild_every_workers_cache() -> None:
    """What `tskv simulate --trace` does, watched by a router: every worker's view exact."""
    requests = read_trace(HEAD, 120)
    config = tskv.KVEventsConfig(endpoint=LOOPBACK, replay_endpoint=LOOPBACK)
    index = tskv.PrefixIndex(64)
    async with (
        tskv.open_publisher(config, 0) as first,
        tskv.open_publisher(config, 1) as second,
        tskv.open_watcher(index) as watcher,
    ):
        for rank, publisher in enumerate((first, second)):
            watcher.add(rank, publisher.endpoint, publisher.replay_endpoint)
            await publisher.wait_for_subscriber()
        workers = await publish_trace(requests, [first, second], TraceOptions())
        with trio.fail_after(30):
            for rank, publisher in enumerate((first, second)):
                await watcher.wait_for_seq(rank, publisher.statistics().accepted - 1)
        for rank, worker in enumerate(workers):
            assert worker.engine_hashes() and index.engine_hashes(rank) == worker.engine_hashes()
            assert watcher.status(rank).losses == 0


def test_speed_paces_the_trace_at_that_many_times_real_time(tmp_path: Path) -> None:
    """Three requests 20 ms apart at a tenth of real time cannot take under 0.2 s."""
    trace = write(tmp_path / "t.jsonl", LINES)
    started = time.monotonic()
    done = run_cli("demo", "--route", "2", "--trace", str(trace), "--speed", "0.1", "--json")
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - started >= 4 * 0.2  # four policies, each paced
    assert json.loads(done.stdout)["index_exact"] is True


def test_simulate_publishes_a_trace_and_says_what_it_published() -> None:
    done = run_cli(
        "simulate", "--trace", str(HEAD), "--requests", "20",
        "--endpoint", LOOPBACK, "--replay-endpoint", LOOPBACK, "--ranks", "2",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("rank 0: publishing bound to tcp://127.0.0.1:")
    assert lines[1].startswith("rank 1: publishing bound to tcp://127.0.0.1:")
    assert lines[-1].startswith("tskv simulate: 20 requests, ") and "batches published" in lines[-1]


@pytest.mark.parametrize("model", ["hybrid-swa", "hybrid-mamba"])
def test_on_a_hybrid_model_the_index_says_what_every_engine_would_reuse(model: str) -> None:
    """Workers of a hybrid model publish as vLLM 0.33 does (the vLLM wire, two groups, the
    second's skipped blocks left out of its hashes); the index's answer for every worker is
    its engine's own hit, and a full-attention-only index is routed beside it."""
    done = run_cli(
        "demo",
        "--route",
        "4",
        "--trace",
        str(HEAD),
        "--requests",
        "150",
        "--model",
        model,
        "--json",
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["model"] == model and result["index_exact"] and result["answers_exact"]
    assert set(result["policies"]) == {"kv", "kv_group_blind", "round_robin", "random"}
