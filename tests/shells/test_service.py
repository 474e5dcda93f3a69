"""`tskv serve`'s service over real HTTP on loopback: bad input is a 4xx with one line and the
service goes on, a token keeps out who lacks it, what tskv knows beyond Dynamo is in added
fields, and the metrics are Prometheus' text."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

import tskv
from tests.zmq_helpers import LOOPBACK

pytest.importorskip(
    "hypercorn", reason="tskv serve's extra is not installed (pip install '.[serve]')"
)

from tskv.core.indexer_api import OPENAPI
from tskv.shells.service import ServiceSettings, serve


def call(
    base: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None
) -> tuple[int, bytes]:
    request = urllib.request.Request(base + path, body, headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


async def ask(base: str, path: str, body: object = None, **headers: str) -> tuple[int, Any]:
    raw = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    status, said = await trio.to_thread.run_sync(call, base, path, raw, headers)
    try:
        return status, json.loads(said) if said else None
    except ValueError:
        return status, said


@asynccontextmanager
async def service(**settings: Any) -> AsyncIterator[str]:
    async with trio.open_nursery() as nursery:
        _, bound = await nursery.start(serve, "127.0.0.1", 0, ServiceSettings(**settings))
        yield bound[0]
        nursery.cancel_scope.cancel()


def registration(publisher: tskv.Publisher, instance: int = 1, **changes: Any) -> dict[str, Any]:
    body = {
        "instance_id": instance,
        "endpoint": publisher.endpoint,
        "replay_endpoint": publisher.replay_endpoint,
        "model_name": "m",
        "block_size": 4,
    }
    return {**body, **changes}


async def test_bad_input_is_a_4xx_naming_the_problem_and_the_service_goes_on() -> None:
    config = tskv.KVEventsConfig(endpoint=LOOPBACK, replay_endpoint=LOOPBACK)
    async with tskv.open_publisher(config) as publisher, service(max_body_bytes=4096) as base:
        assert await ask(base, "/register", registration(publisher)) == (201, {"status": "ok"})
        cases: list[tuple[str, object, int, str]] = [
            ("/query", b"{not json", 400, "not JSON"),
            ("/query", b"[1, 2]", 422, "must be a JSON object"),
            ("/query", {"model_name": "m"}, 422, "token_ids must be a list"),
            ("/query", {"token_ids": [1, 2**32], "model_name": "m"}, 422, "0 to 2**32-1"),
            ("/query", {"token_ids": [1, True], "model_name": "m"}, 422, "0 to 2**32-1"),
            ("/query", {"token_ids": [1], "model_name": "other"}, 404, "registered: m/default"),
            ("/query", {"token_ids": list(range(5000)), "model_name": "m"}, 413, "over 4096"),
            ("/register", registration(publisher, endpoint="localhost:1"), 422, "ZeroMQ"),
            ("/register", registration(publisher, instance=-1), 422, "instance_id"),
            ("/register", registration(publisher, block_size=0), 422, "block_size"),
            ("/register", registration(publisher, instance=2, block_size=8), 409, "existing=4"),
            ("/register", registration(publisher), 409, "already registered"),
            ("/unregister", {"instance_id": 5, "model_name": "m"}, 404, "instance 5"),
            ("/nowhere", None, 404, "no route"),
            (
                "/register",
                registration(publisher, 3, endpoint="tcp://nohost.invalid:1"),
                422,
                "resolve",
            ),
            (
                "/query_by_hash",
                {"block_hashes": [1], "model_name": "m"},
                501,
                "token ids to /query",
            ),
        ]
        for path, body, status, says in cases:
            got, said = await ask(base, path, body)
            assert (got, says in said["error"]) == (status, True), (path, body, said)
            assert "\n" not in said["error"]
        # a wrong method, and the service still answers a good query
        status, said = await trio.to_thread.run_sync(call, base, "/register", None, {})
        assert status == 405
        status, said = await ask(base, "/query", {"token_ids": [1, 2, 3, 4], "model_name": "m"})
        assert status == 200 and said["scores"] == {}


async def test_registrations_beyond_max_workers_are_refused_until_one_goes() -> None:
    config = tskv.KVEventsConfig(endpoint=LOOPBACK, replay_endpoint=LOOPBACK)
    async with tskv.open_publisher(config) as publisher, service(max_workers=1) as base:
        assert (await ask(base, "/register", registration(publisher, 1)))[0] == 201
        status, said = await ask(base, "/register", registration(publisher, 2))
        assert status == 422 and "at most 1 workers" in said["error"]
        assert (await ask(base, "/unregister", {"instance_id": 1, "model_name": "m"}))[0] == 200
        assert (await ask(base, "/register", registration(publisher, 2)))[0] == 201


async def test_a_service_with_a_token_answers_only_requests_that_carry_it() -> None:
    async with service(token="s3cret-s3cret-s3cret") as base:
        assert (await ask(base, "/workers"))[0] == 401
        assert await ask(base, "/workers", Authorization="Bearer wrong") == (
            401,
            {"error": "a bearer token is required: Authorization: Bearer <token>"},
        )
        assert await ask(base, "/workers", Authorization="Bearer s3cret-s3cret-s3cret") == (200, [])


async def test_what_tskv_knows_beyond_dynamo_is_in_added_fields() -> None:
    """A worker that says another block size is named in /workers; a worker not caught up is
    stale in /query's answer, and why."""
    ours = tskv.KVEventsConfig(endpoint=LOOPBACK, replay_endpoint=LOOPBACK, block_size=8)
    async with tskv.open_publisher(ours) as publisher, service() as base:
        assert (await ask(base, "/register", registration(publisher)))[0] == 201
        with trio.fail_after(10):
            while True:  # the descriptor is asked for beside following: no signal over HTTP
                _, [listed] = await ask(base, "/workers")
                if listed["tskv"]["0"]["descriptor"] is not None:
                    break
                await trio.sleep(0.05)
        figures = listed["tskv"]["0"]
        assert figures["mismatch"] == "its block size is 8, the index's is 4"
        assert figures["descriptor"]["epoch"] == publisher.epoch
        unreachable = {"instance_id": 3, "endpoint": "tcp://127.0.0.1:1", "model_name": "m"}
        assert (await ask(base, "/register", {**unreachable, "block_size": 4}))[0] == 201
        _, answered = await ask(base, "/query", {"token_ids": [1, 2, 3, 4], "model_name": "m"})
    assert answered["tskv"]["stale"]["3:0"] == "not caught up yet"
    assert answered["tskv"]["block_size"] == 4


async def test_metrics_are_prometheus_text_with_tskv_names() -> None:
    config = tskv.KVEventsConfig(endpoint=LOOPBACK, replay_endpoint=LOOPBACK)
    async with tskv.open_publisher(config) as publisher, service() as base:
        await ask(base, "/register", registration(publisher))
        await ask(base, "/query", {"token_ids": [1, 2, 3, 4], "model_name": "m"})
        await ask(base, "/query", {"token_ids": "x", "model_name": "m"})
        status, text = await trio.to_thread.run_sync(call, base, "/metrics", None, {})
    lines = text.decode().splitlines()
    assert status == 200
    assert 'tskv_http_requests_total{route="/query",status="200"} 1.0' in lines
    assert 'tskv_http_requests_total{route="/query",status="422"} 1.0' in lines
    assert "tskv_query_duration_seconds_count 1.0" in lines
    assert any(
        line.startswith('tskv_worker_stale{model="m",routing_group="default",worker="1:0"}')
        for line in lines
    )


def test_serve_refuses_to_listen_beyond_this_machine_without_a_token(tmp_path: Path) -> None:
    """Checked before anything is bound: the address is a documentation one, never reached."""
    args = [sys.executable, "-m", "tskv", "serve", "--host", "192.0.2.10", "--port", "0"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--token-file" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    short = tmp_path / "token"
    short.write_text("short")
    done = subprocess.run([*args, "--token-file", str(short)], capture_output=True, text=True)
    assert done.returncode == 2 and "16 characters" in done.stderr


async def test_serve_follows_the_workers_it_is_given_and_ends_on_ctrl_c() -> None:
    config = tskv.KVEventsConfig(endpoint=LOOPBACK, replay_endpoint=LOOPBACK)
    async with tskv.open_publisher(config) as publisher:
        process = await trio.lowlevel.open_process(
            [
                *[sys.executable, "-m", "tskv", "serve", "--port", "0", "--block-size", "4"],
                *["--workers", f"7={publisher.endpoint}", "--model-name", "m"],
            ],
            stderr=subprocess.PIPE,
        )
        assert process.stderr is not None
        with trio.fail_after(30):
            said = b""
            while b"listening on" not in said:
                said += await process.stderr.receive_some()
        base = said.decode().split("listening on ")[1].split()[0].rstrip(",")
        _, listed = await ask(base, "/workers")
        process.send_signal(signal.SIGINT)
        with trio.fail_after(30):
            await process.wait()
    assert [(w["instance_id"], w["model_name"], w["block_size"]) for w in listed] == [(7, "m", 4)]
    assert process.returncode == 0


async def caught_up(base: str, count: int) -> None:
    """Until `count` workers are current (a caught-up signal over HTTP is all a client has)."""
    with trio.fail_after(20):
        while True:
            _, listed = await ask(base, "/workers")
            current = [r for w in listed for r in w["tskv"].values() if r and not r["stale"]]
            if len(current) == count:
                return
            await trio.sleep(0.05)


async def test_select_chooses_as_the_load_aware_policy_does_and_says_why() -> None:
    config = tskv.KVEventsConfig(endpoint=LOOPBACK, replay_endpoint=LOOPBACK)
    prompt = list(range(16))
    async with (
        tskv.open_publisher(config) as holder,
        tskv.open_publisher(config) as idle,
        service() as base,
    ):
        await holder.publish([tskv.BlockStored([1, 2, 3], None, prompt[:12], 4)])
        for instance, publisher in ((1, holder), (2, idle)):
            assert (await ask(base, "/register", registration(publisher, instance)))[0] == 201
        await caught_up(base, 2)
        query = {"token_ids": prompt, "model_name": "m"}
        status, chosen = await ask(base, "/select", query)
        assert status == 200 and (chosen["instance_id"], chosen["cached_tokens"]) == (1, 12)
        assert chosen["cost"] == 4.0  # 16 prompt tokens, 12 held on the device
        by_instance = {c["instance_id"]: c for c in chosen["candidates"]}
        assert by_instance[2] == {
            "instance_id": 2,
            "dp_rank": 0,
            "cached_tokens": 0,
            "lower_tier_tokens": 0,
            "queued_tokens": 0.0,
            "cost": 16.0,
        }
        busy = {**query, "loads": [{"instance_id": 1, "queued_tokens": 100}]}
        status, chosen = await ask(base, "/select", busy)
        assert (status, chosen["instance_id"], chosen["cost"]) == (200, 2, 16.0)
        bad = {**query, "loads": [{"instance_id": 1, "queued_tokens": -1}]}
        assert (await ask(base, "/select", bad))[0] == 422


async def test_workers_registered_over_http_are_followed_again_after_a_kill(
    tmp_path: Path,
) -> None:
    """SIGKILL, then the same command: the workers registered over HTTP are listed and current
    again, from their snapshots, with nothing registered anew."""
    config = tskv.KVEventsConfig(endpoint=LOOPBACK, replay_endpoint=LOOPBACK)
    command = [sys.executable, "-m", "tskv", "serve", "--port", "0", "--state-dir", str(tmp_path)]
    async with tskv.open_publisher(config) as first, tskv.open_publisher(config) as second:
        await first.publish([tskv.BlockStored([1], None, [5, 6, 7, 8], 4)])
        async with running(command) as base:
            for instance, publisher in ((1, first), (2, second)):
                assert (await ask(base, "/register", registration(publisher, instance)))[0] == 201
            await caught_up(base, 2)
        async with running(command) as base:  # `running` ended the first with SIGKILL
            await caught_up(base, 2)
            _, listed = await ask(base, "/workers")
            _, answered = await ask(base, "/query", {"token_ids": [5, 6, 7, 8], "model_name": "m"})
    assert [w["instance_id"] for w in listed] == [1, 2]
    assert answered["scores"] == {"1": {"0": 4}}
    saved = json.loads((tmp_path / "registrations.json").read_text())
    assert [r["instance_id"] for r in saved["registrations"]] == [1, 2]


@asynccontextmanager
async def running(command: list[str]) -> AsyncIterator[str]:
    """`tskv serve` as a process, until the block ends: then killed with SIGKILL."""
    process = await trio.lowlevel.open_process(command, stderr=subprocess.PIPE)
    assert process.stderr is not None
    try:
        with trio.fail_after(30):
            said = b""
            while b"listening on" not in said:
                more = await process.stderr.receive_some()
                assert more, f"tskv serve exited: {said.decode()}"
                said += more
        yield said.decode().split("listening on ")[1].split()[0].rstrip(",")
    finally:
        process.kill()
        await process.wait()


def drawn(schema: dict[str, Any]) -> Any:
    """Values a (simple) JSON schema allows: the subset tskv serve's uses."""
    from hypothesis import strategies as st

    if "$ref" in schema:
        return drawn(OPENAPI["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]])
    if "const" in schema:
        return st.just(schema["const"])
    kind = schema.get("type")
    if kind == "integer":
        return st.integers(schema.get("minimum"), schema.get("maximum"))
    if kind == "number":
        return st.floats(schema.get("minimum"), allow_nan=False, allow_infinity=False)
    if kind == "string":
        return st.text(max_size=20)
    if kind == "array":
        return st.lists(drawn(schema["items"]), max_size=40)
    assert kind == "object", schema
    properties = schema["properties"]
    optional = [name for name in properties if name not in schema["required"]]
    return st.fixed_dictionaries(
        {name: drawn(properties[name]) for name in schema["required"]},
        optional={name: drawn(properties[name]) for name in optional},
    )


def from_schema(name: str) -> Any:
    """Bodies the OpenAPI schema allows for `name`, and bodies a hair off it."""
    from hypothesis import strategies as st

    schema = OPENAPI["components"]["schemas"][name]
    json_values = st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
        max_leaves=10,
    )
    off = st.dictionaries(st.sampled_from(list(schema["properties"])), json_values, max_size=6)
    return drawn(schema) | off | json_values


async def test_no_body_the_schema_allows_or_nearly_allows_gets_a_5xx_or_stops_the_service() -> None:
    """A fuzz run over the OpenAPI schema, as schemathesis would: every route, bodies drawn
    from its schema and from near it, sent over HTTP; each answer a 2xx or a 4xx with one line,
    and the service answers a good query after all of them."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    config = tskv.KVEventsConfig(endpoint=LOOPBACK, replay_endpoint=LOOPBACK)
    async with tskv.open_publisher(config) as publisher, service(dynamo_hashes=True) as base:
        assert (await ask(base, "/register", registration(publisher)))[0] == 201
        status, served = await ask(base, "/openapi.json")
        assert status == 200 and served == OPENAPI
        routes = {path: op for path, op in OPENAPI["paths"].items() if "post" in op}
        bodies = st.sampled_from(sorted(routes)).flatmap(
            lambda path: st.tuples(
                st.just(path),
                from_schema(
                    routes[path]["post"]["requestBody"]["content"]["application/json"]["schema"][
                        "$ref"
                    ].rsplit("/", 1)[1]
                ),
            )
        )
        answered: list[int] = []

        @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
        @given(bodies)
        def send(request: tuple[str, Any]) -> None:
            path, body = request
            if path in ("/register", "/unregister") and isinstance(body, dict):
                body = {**body, "model_name": "fuzz"}  # keep the real worker registered
                if path == "/register":
                    body["endpoint"] = "tcp://127.0.0.1:1"  # never anywhere but here
                    body.pop("replay_endpoint", None)
            elif isinstance(body, dict) and "model_name" in body:
                body["model_name"] = "m"  # reach the index: unknown models are tested above
            status, raw = call(base, path, json.dumps(body).encode(), {})
            assert status < 500, (path, body, raw)
            if status >= 400:
                error = json.loads(raw)["error"]
                assert isinstance(error, str) and "\n" not in error
            answered.append(status)

        await trio.to_thread.run_sync(send)
        assert {s // 100 for s in answered} == {2, 4}  # both kinds drawn: the run can fail
        status, said = await ask(base, "/query", {"token_ids": [1, 2, 3, 4], "model_name": "m"})
        assert status == 200 and "scores" in said
        status, said = await ask(base, "/dump")
        assert status == 200 and said["m:default"]["events"] == []


async def test_two_services_over_the_same_workers_answer_alike_once_current() -> None:
    """Replicas: each follows every worker on its own, and once both are current their answers
    are the same, so a load balancer may send a query to either."""
    config = tskv.KVEventsConfig(endpoint=LOOPBACK, replay_endpoint=LOOPBACK)
    prompts = [list(range(n, n + 12)) for n in (0, 100, 200)]
    async with (
        tskv.open_publisher(config) as first,
        tskv.open_publisher(config) as second,
        service() as one,
        service() as other,
    ):
        await first.publish([tskv.BlockStored([1, 2, 3], None, prompts[0], 4)])
        await second.publish([tskv.BlockStored([4, 5], None, prompts[1][:8], 4)])
        for base in (one, other):
            for instance, publisher in ((1, first), (2, second)):
                assert (await ask(base, "/register", registration(publisher, instance)))[0] == 201
            await caught_up(base, 2)
        await first.publish([tskv.BlockStored([6], 3, [7, 7, 7, 7], 4)])  # live, after both joined
        longer = {"token_ids": [*prompts[0], 7, 7, 7, 7], "model_name": "m"}
        with trio.fail_after(20):
            for base in (one, other):
                while (await ask(base, "/query", longer))[1]["scores"] != {"1": {"0": 16}}:  # noqa: ASYNC110
                    await trio.sleep(0.05)  # a batch applied has no signal over HTTP
        for prompt in [*prompts, [*prompts[0], 7, 7, 7, 7]]:
            query = {"token_ids": prompt, "model_name": "m"}
            assert await ask(one, "/query", query) == await ask(other, "/query", query)
        assert (await ask(one, "/query", {"token_ids": prompts[1], "model_name": "m"}))[1][
            "scores"
        ] == {"2": {"0": 8}}


def curve_publisher_config(tmp_path: Path) -> tuple[tskv.KVEventsConfig, Path, Path]:
    """An encrypted publisher that allows one client: the service's key."""
    from tskv.curve.key_files import generate_keys

    server_public, server_secret = generate_keys(tmp_path / "server", "server")
    client_public, client_secret = generate_keys(tmp_path / "client", "client")
    (tmp_path / "allowed").mkdir()
    (tmp_path / "allowed" / "client.key").write_bytes(client_public.read_bytes())
    config = tskv.KVEventsConfig(
        endpoint=LOOPBACK,
        replay_endpoint=LOOPBACK,
        curve_secret_key=str(server_secret),
        curve_clients=str(tmp_path / "allowed"),
    )
    return config, server_public, client_secret


async def test_encrypted_workers_are_followed_with_the_keys_given_and_not_without(
    tmp_path: Path,
) -> None:
    """The keys reach every worker's subscriber: from the flags for workers registered over
    HTTP, from a [[workers]] table for one with a key of its own. A service without them is
    refused by the publisher's handshake and never catches up."""
    config, server_public, client_secret = curve_publisher_config(tmp_path)
    async with tskv.open_publisher(config) as publisher:
        await publisher.publish([tskv.BlockStored([1], None, [1, 2, 3, 4], 4)])
        keys = ["--curve-server-key", str(server_public), "--curve-secret-key", str(client_secret)]
        async with running([*SERVE, *keys]) as base:
            assert (await ask(base, "/register", registration(publisher)))[0] == 201
            await caught_up(base, 1)
        (tmp_path / "serve.toml").write_text(
            f'port = 0\ncurve_secret_key = "{client_secret}"\n'
            f'[[workers]]\ninstance_id = 4\nendpoint = "{publisher.endpoint}"\n'
            f'replay_endpoint = "{publisher.replay_endpoint}"\nmodel_name = "m"\n'
            f'block_size = 4\ncurve_server_key = "{server_public}"\n'
        )
        async with running([*SERVE, "--config", str(tmp_path / "serve.toml")]) as base:
            await caught_up(base, 1)
            _, answered = await ask(base, "/query", {"token_ids": [1, 2, 3, 4], "model_name": "m"})
            assert answered["scores"] == {"4": {"0": 4}}
        async with running(SERVE) as base:  # no keys: the handshake is refused
            assert (await ask(base, "/register", registration(publisher)))[0] == 201
            with trio.move_on_after(1.0):  # a bounded look: nothing would signal it
                await caught_up(base, 1)
            _, [listed] = await ask(base, "/workers")
            assert listed["tskv"]["0"]["stale"] and listed["tskv"]["0"]["batches"] == 0


SERVE = [sys.executable, "-m", "tskv", "serve", "--port", "0"]


def test_a_bad_config_file_is_one_line_naming_it(tmp_path: Path) -> None:
    for text, says in [
        ("port = ", "is not TOML"),
        ("porty = 1", "unknown settings porty"),
        ("workers = 3", "[[workers]] tables"),
        (
            '[[workers]]\ninstance_id = "x"\nendpoint = "tcp://127.0.0.1:1"\nmodel_name = "m"',
            "instance_id must be an integer",
        ),
    ]:
        (tmp_path / "serve.toml").write_text(text)
        done = subprocess.run(
            [*SERVE, "--config", str(tmp_path / "serve.toml")],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 2 and says in done.stderr, (text, done.stderr)
        assert len(done.stderr.strip().splitlines()) == 1


async def test_workers_followed_in_a_reader_process_answer_as_in_the_service_s_own() -> None:
    config = tskv.KVEventsConfig(endpoint=LOOPBACK, replay_endpoint=LOOPBACK)
    async with tskv.open_publisher(config) as publisher:
        await publisher.publish([tskv.BlockStored([1, 2], None, list(range(8)), 4)])
        async with running([*SERVE, "--processes", "1"]) as base:
            assert (await ask(base, "/register", registration(publisher)))[0] == 201
            await caught_up(base, 1)
            _, answered = await ask(
                base, "/query", {"token_ids": list(range(8)), "model_name": "m"}
            )
    assert answered["scores"] == {"1": {"0": 8}}


async def test_dynamo_hashes_are_answered_alike_with_reader_processes() -> None:
    """`--dynamo-hashes` with `--processes 1`: the reader process keeps the hashes and answers
    /query_by_hash and /dump for its workers as the service's own process does."""
    pytest.importorskip("xxhash", reason="the serve extra is not installed")
    from tskv.core.dynamo_hashes import tokens_hash

    config = tskv.KVEventsConfig(endpoint=LOOPBACK, replay_endpoint=LOOPBACK)
    tokens = list(range(100, 112))
    async with (
        tskv.open_publisher(config) as publisher,
        service(dynamo_hashes=True) as here,
        service(dynamo_hashes=True, processes=1) as readers,
    ):
        await publisher.publish([tskv.BlockStored([1, 2, 3], None, tokens, 4)])
        for base in (here, readers):
            assert (await ask(base, "/register", registration(publisher)))[0] == 201
        hashes = [tokens_hash(tokens[n : n + 4]) for n in (0, 4, 8)]
        query = {"block_hashes": [h - (1 << 64) if h >= 1 << 63 else h for h in hashes]}
        asked = {**query, "model_name": "m"}
        with trio.fail_after(20):
            for base in (here, readers):
                while (await ask(base, "/query_by_hash", asked))[1]["scores"] != {"1": {"0": 12}}:  # noqa: ASYNC110
                    await trio.sleep(0.05)  # a batch applied has no signal over HTTP
        assert await ask(here, "/dump") == await ask(readers, "/dump")
        _, dumped = await ask(readers, "/dump")
        assert [
            e["event"]["data"]["stored"]["blocks"][0]["block_hash"]
            for e in dumped["m:default"]["events"]
        ] == [1, 2, 3]


def test_a_zero_given_on_the_command_line_is_kept(tmp_path: Path) -> None:
    """`--port 0` (any free port) and `--processes 0` are values given, not settings left
    out for the config file or the default to fill: 0 compared equal to False."""
    from tskv._cli import build_parser
    from tskv._cli.serve import settled

    config = tmp_path / "serve.toml"
    config.write_text("port = 9100\nprocesses = 2\n")
    args = build_parser().parse_args(
        ["serve", "--port", "0", "--processes", "0", "--config", str(config)]
    )
    settings, _ = settled(args)
    assert (settings.port, settings.processes) == (0, 0)
    left_out, _ = settled(build_parser().parse_args(["serve", "--config", str(config)]))
    assert (left_out.port, left_out.processes) == (9100, 2)


async def test_a_worker_the_watcher_let_go_of_is_left_out_of_a_hash_answer() -> None:
    """A worker unregistered while its Dynamo-hash answer is asked for (here: gone from the
    watcher, still in the registry) is left out of the answer, not a 500."""
    config = tskv.KVEventsConfig(endpoint=LOOPBACK, replay_endpoint=LOOPBACK)
    async with tskv.open_publisher(config) as publisher, trio.open_nursery() as nursery:
        settings = ServiceSettings(dynamo_hashes=True)
        service_, bound = await nursery.start(serve, "127.0.0.1", 0, settings)
        assert (await ask(bound[0], "/register", registration(publisher)))[0] == 201
        model = service_.registry.model(("m", "default"))
        service_._watchers[model.key].remove((1, 0))
        query = {"block_hashes": [1, 2], "model_name": "m"}
        assert await ask(bound[0], "/query_by_hash", query) == (
            200,
            {
                "scores": {},
                "frequencies": [],
                "instances": {},
                "tskv": {"block_size": 4, "stale": {}},
            },
        )
        status, dumped = await ask(bound[0], "/dump")
        assert status == 200 and dumped["m:default"]["events"] == []
        nursery.cancel_scope.cancel()
