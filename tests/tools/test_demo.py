"""`tskv demo` closes the loop; `tskv simulate` feeds an external consumer."""

from __future__ import annotations

import io
import signal
import subprocess
import sys

import pytest
import trio

import tskv
from tests.processes import killed_after
from tskv._cli.demo import demo
from tskv._cli.simulate import simulate
from tskv.sim import SimOptions

LOCAL = "tcp://127.0.0.1:*"


async def test_demo_with_two_ranks_rebuilds_both_caches_exactly() -> None:
    out = io.StringIO()
    options = SimOptions(rounds=60, ranks=2, cache_blocks=64, block_size=4, round_interval=0.002)
    assert await demo(options, out, live=False)
    text = out.getvalue()
    assert text.count(": EQUAL") == 4  # each rank's subscriber and its late joiner
    assert text.count("late joiner: joined after seq") == 2
    assert "nothing was lost" in text
    assert "rank 1: " in text


async def test_demo_refuses_options_that_cannot_run() -> None:
    with pytest.raises(ValueError, match="--ranks 0: must be at least 1"):
        await demo(SimOptions(ranks=0), io.StringIO())


async def test_simulate_feeds_a_consumer_that_joins_from_seq_0() -> None:
    out = io.StringIO()
    options = SimOptions(rounds=None, duration=30, round_interval=0.005, seed=4)
    async with trio.open_nursery() as nursery:
        config = tskv.KVEventsConfig(endpoint=LOCAL, replay_endpoint=LOCAL)
        with trio.fail_after(10):
            [publisher] = await nursery.start(simulate, options, config, out)
        async with tskv.open_subscriber(
            publisher.endpoint, publisher.replay_endpoint, start_seq=0
        ) as sub:
            seqs = []
            with trio.fail_after(20):
                async for seq, batch in sub:
                    assert batch.attn_dp_rank == 0 and batch.events
                    seqs.append(seq)
                    if len(seqs) == 30:
                        break
        nursery.cancel_scope.cancel()
    assert seqs == list(range(30))
    assert "rank 0: publishing bound to tcp://127.0.0.1:" in out.getvalue()


def test_simulate_ends_cleanly_on_ctrl_c() -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "tskv", "simulate", "--endpoint", LOCAL],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    with killed_after(30, process):
        assert process.stdout.readline().startswith("rank 0: publishing bound to tcp://127.0.0.1:")
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=20)
    assert process.returncode == 0, err
    assert "tskv simulate:" in out and "batches published" in out
    assert "Traceback" not in err


def test_demo_cli_exits_zero_and_help_explains_the_options() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "tskv", "demo", "--rounds", "30", "--round-interval", "0.002"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert "nothing was lost" in run.stdout
    helptext = subprocess.run(
        [sys.executable, "-m", "tskv", "demo", "--help"], capture_output=True, text=True
    ).stdout
    for flag in ("--rounds", "--duration", "--requests-per-round", "--block-size"):
        assert flag in helptext
    for flag in ("--cache-blocks", "--ranks", "--seed"):
        assert flag in helptext
    bad = subprocess.run(
        [sys.executable, "-m", "tskv", "demo", "--ranks", "0"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "use at least 1" in bad.stderr


def test_simulate_and_listen_spell_the_replay_endpoint_alike_and_keep_the_old_spelling() -> None:
    from tskv._cli import build_parser

    parser = build_parser()
    replay = "tcp://127.0.0.1:5558"
    for command in (["simulate"], ["listen", "tcp://127.0.0.1:5557"]):
        new = parser.parse_args([*command, "--replay-endpoint", replay])
        old = parser.parse_args([*command, "--replay", replay])
        assert vars(new) == vars(old)
        assert replay in vars(new).values()


async def test_the_demo_carries_the_storage_tier_on_the_vllm_wire() -> None:
    out = io.StringIO()
    options = SimOptions(
        rounds=30, cache_blocks=64, block_size=4, round_interval=0.002, medium="GPU",
        wire_format="vllm",
    )  # fmt: skip
    assert await demo(options, out, live=False)
    assert "nothing was lost" in out.getvalue()


async def test_simulate_on_the_vllm_wire_sends_the_medium_it_is_given() -> None:
    options = SimOptions(rounds=None, duration=30, round_interval=0.005, medium="CPU")
    config = tskv.KVEventsConfig(endpoint=LOCAL, replay_endpoint=LOCAL, wire_format="vllm")
    async with trio.open_nursery() as nursery:
        with trio.fail_after(10):
            [publisher] = await nursery.start(simulate, options, config, io.StringIO())
        async with tskv.open_subscriber(
            publisher.endpoint, publisher.replay_endpoint, start_seq=0
        ) as sub:
            with trio.fail_after(20):
                _, batch = await sub.__anext__()
        nursery.cancel_scope.cancel()
    assert batch.events and all(
        event.medium == "CPU"
        for event in batch.events
        if not isinstance(event, tskv.AllBlocksCleared)
    )
    assert publisher.statistics().events_with_dropped_fields == 0


async def test_routing_by_the_index_beats_round_robin_and_random_and_equals_the_caches() -> None:
    from tskv.sim.routing import RoutingOptions, compare

    lines: list[str] = []
    results = await compare(RoutingOptions(workers=3, rounds=120, cache_blocks=128), lines.append)
    indexed, longest, round_robin, randomly = results
    assert [r.policy for r in results] == ["kv", "longest_prefix", "round_robin", "random"]
    assert longest.max_load_share > indexed.max_load_share  # the cache alone piles work up
    assert indexed.index_equal  # the index equalled every worker's real cache at the end
    assert indexed.hit_rate > max(round_robin.hit_rate, randomly.hit_rate)
    assert indexed.prefilled_tokens < min(round_robin.prefilled_tokens, randomly.prefilled_tokens)
    assert any(line.strip().startswith("kv |") for line in lines)  # the chart
    assert "the index equals every worker's cache: yes" in lines[-1]


@pytest.mark.parametrize("model", ["hybrid-swa", "hybrid-mamba"])
async def test_on_a_hybrid_model_every_answer_is_the_engines_own_hit(model: str) -> None:
    from tskv.sim.routing import RoutingOptions, compare

    lines: list[str] = []
    options = RoutingOptions(workers=3, rounds=80, cache_blocks=128, model=model)
    results = await compare(options, lines.append)
    assert [r.policy for r in results] == ["kv", "kv_group_blind", "round_robin", "random"]
    assert all(r.index_equal and r.answers == r.exact_answers > 0 for r in results)
    # counting full attention alone promises blocks the engine cannot serve
    assert sum(r.blind_over for r in results) > 0
    assert "promised more than the engine would reuse" in lines[-1]
