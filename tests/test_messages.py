"""Every message a user misled by before now names the problem and the fix."""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import tskv
import tskv.testing
from tests.zmq_helpers import LOOPBACK
from tskv import AllBlocksCleared, BlockRemoved, KVEventBatch, KVEventsConfig
from tskv.curve.key_files import generate_keys, load_key_pair


def test_an_unknown_wire_format_names_the_choices() -> None:
    with pytest.raises(ValueError, match="wire_format = 'vlm': use 'tokenspeed' or 'vllm'"):
        tskv.encode_batch(KVEventBatch(1.0, [BlockRemoved([1])]), "vlm")  # type: ignore[arg-type]


async def test_a_misspelt_start_seq_names_snapshot() -> None:
    with pytest.raises(ValueError, match="start_seq = 'snap': use \"snapshot\""):
        async with tskv.open_subscriber(LOOPBACK, LOOPBACK, start_seq="snap"):  # type: ignore[arg-type]
            pass


async def test_a_mapping_for_a_config_says_how_to_build_one() -> None:
    with pytest.raises(TypeError, match=r"config must be a tskv\.KVEventsConfig, got dict"):
        async with tskv.open_publisher({"endpoint": LOOPBACK}):  # type: ignore[arg-type]
            pass


async def test_one_event_where_a_round_belongs_says_pass_a_list() -> None:
    async with tskv.open_publisher(KVEventsConfig(endpoint=LOOPBACK)) as publisher:
        with pytest.raises(TypeError, match=r"single event AllBlocksCleared\(\).*pass \[event\]"):
            await publisher.publish(AllBlocksCleared())  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="a list of KV events, got 42"):
            await publisher.publish(42)  # type: ignore[arg-type]


def test_a_directory_given_as_a_key_file_says_it_is_one(tmp_path: Path) -> None:
    generate_keys(tmp_path, "node")
    with pytest.raises(tskv.KeyFileError, match="is a directory; give the certificate file"):
        load_key_pair(tmp_path)


def test_a_missing_key_file_is_refused_when_the_config_is_made(tmp_path: Path) -> None:
    with pytest.raises(tskv.ConfigError, match=r"curve_secret_key = .* does not exist; create"):
        KVEventsConfig(curve_secret_key=str(tmp_path / "nope"), curve_allow_any_client=True)


def test_a_misspelt_config_key_is_warned_about_with_what_was_meant(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="tskv"):
        tskv.EventPublisherFactory.create('{"replay_endpiont": "tcp://127.0.0.1:*"}').shutdown()
    assert "replay_endpiont (did you mean 'replay_endpoint'?)" in caplog.text
    with pytest.raises(tskv.ConfigError, match="buffer_step \\(did you mean 'buffer_steps'\\?\\)"):
        tskv.ZmqEventPublisher(0, endpoint=LOOPBACK, buffer_step=5)


async def test_a_typo_on_the_scripted_publisher_is_refused_as_its_sync_twin_does(
    tskv_scripted: tskv.testing.ScriptedPublisher,
) -> None:
    with pytest.raises(
        AttributeError, match="no setting 'replay_mdoe' \\(did you mean 'replay_mode'"
    ):
        tskv_scripted.replay_mdoe = "never"  # type: ignore[attr-defined]
    tskv_scripted.replay_mode = "never"  # a real setting still takes
    assert tskv_scripted.replay_mode == "never"


def test_every_error_tskv_raises_is_a_tskv_error_and_still_what_it_was() -> None:
    import zmq

    from tskv.core.frames import FrameError
    from tskv.shells._trio_thread import LoopFailedError
    from tskv.shells._trio_zmq import AttachError
    from tskv.sim.sampling import SamplingSeedError

    values = [tskv.WireError, tskv.ConfigError, tskv.EndpointError, tskv.KeyFileError]
    for error in [*values, FrameError, SamplingSeedError]:
        assert issubclass(error, tskv.TskvError) and issubclass(error, ValueError), error
    assert issubclass(tskv.PublisherClosedError, tskv.TskvError)
    assert issubclass(tskv.PublisherFailedError, RuntimeError)
    assert issubclass(LoopFailedError, tskv.TskvError) and issubclass(LoopFailedError, RuntimeError)
    assert issubclass(AttachError, tskv.TskvError) and issubclass(AttachError, OSError)
    assert issubclass(AttachError, zmq.ZMQError)


@pytest.mark.parametrize(
    ("cls", "opener"),
    [
        (tskv.Publisher, "open_publisher"),
        (tskv.Subscriber, "open_subscriber"),
        (tskv.Watcher, "open_watcher"),
    ],
)
def test_a_class_only_its_opener_makes_names_that_opener(cls: type, opener: str) -> None:
    with pytest.raises(
        TypeError,
        match=rf"tskv\.{cls.__name__} has no public constructor; use `async with tskv\.{opener}",
    ):
        cls()


def test_a_secret_key_without_an_allow_list_says_what_is_missing_not_both(tmp_path: Path) -> None:
    _, secret = generate_keys(tmp_path, "publisher")
    with pytest.raises(tskv.ConfigError, match="say who may connect") as neither:
        KVEventsConfig(curve_secret_key=str(secret))
    assert "not both" not in str(neither.value)
    with pytest.raises(tskv.ConfigError, match="both say who may connect; keep one"):
        KVEventsConfig(
            curve_secret_key=str(secret), curve_clients=str(tmp_path), curve_allow_any_client=True
        )


def test_simulate_given_only_a_secret_key_names_the_flags_to_add(tmp_path: Path) -> None:
    _, secret = generate_keys(tmp_path, "publisher")
    done = subprocess.run(
        [sys.executable, "-m", "tskv", "simulate", "--endpoint", LOOPBACK,
         "--curve-secret-key", str(secret)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    [line] = done.stderr.splitlines()
    assert "--curve-clients" in line and "--curve-allow-any-client" in line
    assert "not both" not in line


async def test_a_port_in_use_says_another_process_holds_it_and_how_to_pick_a_free_one() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = KVEventsConfig(endpoint=f"tcp://127.0.0.1:{port}", bind=True)
        with pytest.raises(OSError, match="holds that port: stop it, or use another port"):
            async with tskv.open_publisher(config):
                pass


def test_the_trace_flag_says_what_each_command_does_with_the_trace() -> None:
    from tskv._cli import build_parser

    parser = build_parser()
    helps = {}
    for command in ("demo", "simulate"):
        sub = parser._subparsers._group_actions[0].choices[command]  # type: ignore[union-attr]
        [trace] = [a for a in sub._actions if "--trace" in a.option_strings]
        helps[command] = trace.help
    assert "routed" in helps["demo"] and "published" in helps["simulate"]
    assert "demo" not in helps["simulate"]


def test_a_misspelt_stream_marker_keyword_fails_naming_the_one_meant(
    pytester: pytest.Pytester,
) -> None:
    pytester.makeini("[pytest]\ntrio_mode = true\n")
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.tskv_stream(seeds=3)
        async def test_it(tskv_stream):
            pass
        """
    )
    result = pytester.runpytest_subprocess()  # tskv's plugin comes in by its entry point
    result.assert_outcomes(failed=1)  # the fixture's pytest.fail, before the test runs
    result.stdout.fnmatch_lines(["*tskv_stream has no 'seeds' (did you mean 'seed'?)*"])
    assert "TypeError" not in result.stdout.str()
