"""`tskv serve`'s shell: an ASGI app that parses, calls the watchers and the indexes, and encodes.

What a request means is `tskv.core.indexer_api`'s to decide; this module moves bytes: it reads
a body (at most `max_body_bytes`), decodes its JSON with msgspec, hands the values to the
`Registry`, keeps one `open_watcher` per (model, routing group) index running in its nursery,
and encodes the answer. It runs under hypercorn's Trio worker (`serve`), so the watchers, the
subscribers and the HTTP connections share one Trio loop. Needs the `serve` extra.
"""

from __future__ import annotations

import hmac
import logging
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import attrs
import msgspec
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve

from tskv.core.descriptor import Descriptor
from tskv.core.errors import ConfigError, TskvError
from tskv.core.indexer_api import (
    MAX_WORKERS,
    OPENAPI,
    ApiError,
    HashQuery,
    ModelIndex,
    Query,
    Registration,
    Registry,
    Selection,
    Unregistration,
    WorkerKey,
    answer,
    dumped,
    listing,
    selected,
)
from tskv.core.prefix_index import Match, Worker
from tskv.core.routing import LoadAwarePolicy
from tskv.shells._reachability import unreachable_reason
from tskv.shells.service_metrics import ServiceMetrics
from tskv.shells.watcher import Watcher, open_watcher

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 16 << 20  # a 1M-token prompt is ~8 MB of JSON
Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
Reply = tuple[int, Any]  # status, and what to encode as JSON (None: an empty body)


@attrs.frozen
class ServiceSettings:
    """What `tskv serve` takes besides where it listens."""

    max_body_bytes: int = MAX_BODY_BYTES
    token: str | None = None  # a bearer token every request must carry; None: none needed
    subscriber_settings: dict[str, Any] = attrs.Factory(dict)  # for every worker's subscriber
    policy: LoadAwarePolicy = attrs.Factory(LoadAwarePolicy)  # how /select chooses
    state_dir: Path | None = None  # where the registrations are kept across restarts
    # CURVE: the publishers' public key file (each worker's own by its endpoint, else the
    # one for all), and this service's secret key file; None: clear text
    curve_server_key: str | None = None
    server_keys: dict[str, str] = attrs.Factory(dict)
    curve_secret_key: str | None = None
    processes: int = 0  # reader processes each index's watcher follows its workers in
    max_workers: int = MAX_WORKERS  # registrations the service takes, at most
    dynamo_hashes: bool = False  # keep Dynamo's block hashes: /query_by_hash and /dump answer


class IndexerService:
    """The registry and a running watcher for each of its indexes."""

    def __init__(self, nursery: trio.Nursery, settings: ServiceSettings) -> None:
        self.registry = Registry(settings.max_workers, settings.dynamo_hashes)
        self.settings = settings
        self.metrics = ServiceMetrics(self.watchers)
        self._nursery = nursery
        self._watchers: dict[tuple[str, str], Watcher] = {}
        self._changing = trio.Lock()  # one registration at a time: an index's watcher starts once

    async def restore(self) -> int:
        """Register again what the state directory holds (a restart); returns how many."""
        path = self._state_path()
        if path is None or not path.exists():
            return 0
        text = await trio.to_thread.run_sync(path.read_bytes)
        try:
            saved = Registry.saved(msgspec.json.decode(text))
        except (msgspec.DecodeError, ApiError) as exc:
            raise ConfigError(f"{path} is not a state tskv serve wrote ({exc}): move it") from None
        for registration in saved:
            await self._add(registration, save=False)
        return len(saved)

    async def register(self, body: object) -> Reply:
        registration = Registration.parse(body)
        for endpoint in filter(None, (registration.endpoint, registration.replay_endpoint)):
            problem = await unreachable_reason(endpoint)
            if problem is not None:
                raise ApiError(422, f"cannot reach {endpoint}: {problem}")
        await self._add(registration, save=True)
        return 201, {"status": "ok"}

    async def _add(self, registration: Registration, save: bool) -> None:
        async with self._changing:
            model, new = self.registry.register(registration)
            try:
                watcher = self._watchers.get(model.key)
                if watcher is None:
                    watcher = await self._nursery.start(self._watch, model)
                    self._watchers[model.key] = watcher
                watcher.add(
                    registration.worker,
                    registration.endpoint,
                    registration.replay_endpoint,
                    **self._keys(registration.endpoint),
                )
            except ConfigError as exc:
                del model.workers[registration.worker]
                if new and not model.workers:
                    del self.registry.indexes[model.key]
                raise ApiError(422, str(exc)) from None
            if save:
                await self._save()
        logger.info("registered %s in %s/%s", registration.worker, *model.key)

    async def unregister(self, body: object) -> Reply:
        request = Unregistration.parse(body)
        async with self._changing:
            model, gone = self.registry.unregister(request)
            watcher = self._watchers[model.key]
            for worker in gone:
                watcher.remove(worker)
            await self._save()
        return 200, {"status": "ok"}

    def _keys(self, endpoint: str) -> dict[str, str]:
        settings = self.settings
        server_key = settings.server_keys.get(endpoint, settings.curve_server_key)
        if server_key is None:
            return {}
        keys = {"curve_server_key": server_key}
        if settings.curve_secret_key is not None:
            keys["curve_secret_key"] = settings.curve_secret_key
        return keys

    def _state_path(self) -> Path | None:
        folder = self.settings.state_dir
        return None if folder is None else folder / "registrations.json"

    async def _save(self) -> None:
        """Write the registrations atomically: a crash leaves the old file or the new one."""
        path = self._state_path()
        if path is not None:
            state = msgspec.json.encode(self.registry.state())
            try:
                await trio.to_thread.run_sync(_replace, path, state)
            except OSError as exc:  # the disk's fault, not the client's: said as such
                logger.error("cannot keep the registrations in %s: %s", path, exc)
                raise ApiError(
                    500, f"done, but not kept in {path} ({exc.strerror}): a restart forgets it"
                ) from None

    def query(self, body: object) -> Reply:
        query = Query.parse(body)
        model = self.registry.model(query.index)
        began = time.perf_counter()
        match = model.index.match(query.token_ids)
        self.metrics.queried(time.perf_counter() - began)
        return 200, answer(match, model.block_size, self.stale_reasons(model))

    async def query_by_hash(self, body: object) -> Reply:
        query = HashQuery.parse(body)
        model = self.registry.model(query.index)
        model.require_dynamo_hashes()
        began = time.perf_counter()
        found = await self._dynamo_answers(model, query.block_hashes)
        held: dict[Worker, int] = {w: said[0] for w, said in found.items() if said[0]}
        lower: dict[Worker, int] = {w: said[1] for w, said in found.items() if said[1]}
        match = Match(held, model.index.stale, lower=lower, block_size=model.block_size)
        self.metrics.queried(time.perf_counter() - began)
        return 200, answer(match, model.block_size, self.stale_reasons(model))

    async def dump(self) -> Reply:
        models = list(self.registry.indexes.values())
        for model in models:
            model.require_dynamo_hashes()  # before any worker is asked
        return 200, dumped([(model, await self._dynamo_answers(model, None)) for model in models])

    async def _dynamo_answers(
        self, model: ModelIndex, hashes: list[int] | None
    ) -> dict[WorkerKey, list[Any]]:
        """Each worker's `Watcher.dynamo_hashes` answer, asked of them all at once (a reader
        process's answer comes with its next frame). A worker unregistered meanwhile, or whose
        reader process ended before it answered (it is stale until followed again), is left
        out of the answer, as a worker holding nothing is."""
        watcher, found = self._watchers[model.key], {}

        async def ask(worker: WorkerKey) -> None:
            try:
                found[worker] = await watcher.dynamo_hashes(worker, hashes)
            except TskvError as exc:
                logger.info("%s left out of a Dynamo-hash answer: %s", worker, exc)

        async with trio.open_nursery() as nursery:
            for worker in list(model.workers):
                nursery.start_soon(ask, worker)
        return {worker: said for worker, said in found.items() if said}

    def select(self, body: object) -> Reply:
        selection = Selection.parse(body)
        model = self.registry.model(selection.query.index)
        match = model.index.match(selection.query.token_ids)
        return 200, selected(match, model, self.settings.policy, selection)

    def workers(self) -> Reply:
        extra = {
            worker: self.worker_figures(model, worker)
            for model in self.registry.indexes.values()
            for worker in model.workers
        }
        return 200, listing(self.registry.indexes.values(), extra)

    def stale_reasons(self, model: ModelIndex) -> dict[WorkerKey, str]:
        watcher = self._watchers.get(model.key)
        if watcher is None:
            return {}
        reasons = {}
        for worker in model.index.stale:
            if worker in model.workers:
                status = watcher.status(worker)
                if status.mismatch is not None:
                    reasons[worker] = status.mismatch
                elif status.silent:
                    reasons[worker] = "its publisher is silent"
                elif status.batches == 0:
                    reasons[worker] = "not caught up yet"
        return reasons

    def worker_figures(self, model: ModelIndex, worker: WorkerKey) -> dict[str, Any]:
        watcher = self._watchers.get(model.key)
        if watcher is None or worker not in model.workers:
            return {}
        status = watcher.status(worker)
        said: Descriptor | None = status.descriptor
        return {
            "stale": status.stale,
            "silent": status.silent,
            "batches": status.batches,
            "losses": status.losses,
            "last_seq": status.last_seq,
            "mismatch": status.mismatch,
            "descriptor": None if said is None else said.summary(),
        }

    def watchers(self) -> list[tuple[ModelIndex, Watcher]]:
        return [(self.registry.indexes[key], w) for key, w in self._watchers.items()]

    async def _watch(
        self, model: ModelIndex, task_status: trio.TaskStatus[Watcher] = trio.TASK_STATUS_IGNORED
    ) -> None:
        settings = self.settings
        async with open_watcher(
            model.index,
            processes=settings.processes,
            on_loss=self.metrics.losses.on_loss,
            **settings.subscriber_settings,
        ) as watcher:
            task_status.started(watcher)
            await trio.sleep_forever()


class IndexerApp:
    """The ASGI application: Dynamo's indexer routes, `/metrics` and `/health`."""

    def __init__(self, service: IndexerService) -> None:
        self.service = service
        self._routes: dict[str, tuple[str, Callable[[object], Awaitable[Reply]]]] = {
            "/register": ("POST", service.register),
            "/unregister": ("POST", service.unregister),
            "/query": ("POST", self._sync(service.query)),
            "/select": ("POST", self._sync(service.select)),
            "/workers": ("GET", self._sync(lambda _: service.workers())),
            "/health": ("GET", self._sync(lambda _: (200, None))),
            "/openapi.json": ("GET", self._sync(lambda _: (200, OPENAPI))),
            "/query_by_hash": ("POST", service.query_by_hash),
            "/dump": ("GET", lambda _: service.dump()),
        }

    @staticmethod
    def _sync(handler: Callable[[object], Reply]) -> Callable[[object], Awaitable[Reply]]:
        async def run(body: object) -> Reply:
            return handler(body)

        return run

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        try:
            self._authorize(scope)
            if path == "/metrics" and method == "GET":
                body, kind = self.service.metrics.exposition()
                await _respond(send, 200, body, kind)
                return
            route = self._routes.get(path)
            if route is None:
                raise ApiError(404, f"no route {path}; see /openapi.json")
            if method != route[0]:
                raise ApiError(405, f"{path} takes {route[0]}, not {method}")
            data = await _json_body(receive, self.service.settings.max_body_bytes)
            status, payload = await route[1](data)
        except ApiError as exc:
            status, payload = exc.status, {"error": str(exc)}
        known = path in self._routes or path == "/metrics"  # a label per unknown path would grow
        self.service.metrics.served(path if known else "other", status)
        body = b"" if payload is None else msgspec.json.encode(payload)
        await _respond(send, status, body, b"application/json")

    def _authorize(self, scope: Scope) -> None:
        token = self.service.settings.token
        if token is None:
            return
        for name, value in scope["headers"]:
            if name == b"authorization" and hmac.compare_digest(value, f"Bearer {token}".encode()):
                return
        raise ApiError(401, "a bearer token is required: Authorization: Bearer <token>")


def _replace(path: Path, content: bytes) -> None:
    temporary = path.with_name(path.name + ".tmp")
    with temporary.open("wb") as file:
        file.write(content)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path)


async def _json_body(receive: Receive, limit: int) -> object:
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ApiError(400, "the client left before its request was whole")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"the body is over {limit} bytes (--max-body-bytes)")
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    body = b"".join(chunks)
    if not body:
        return None
    try:
        return msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"the body is not JSON: {exc}") from None


async def _respond(send: Send, status: int, body: bytes, kind: bytes) -> None:
    headers = [(b"content-length", str(len(body)).encode())]
    if body:
        headers.append((b"content-type", kind))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def serve(
    host: str,
    port: int,
    settings: ServiceSettings,
    *,
    task_status: trio.TaskStatus[tuple[IndexerService, list[str]]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the service on `host:port` until cancelled; `task_status` gets the service and the
    addresses it listens on (port 0: the one the OS picked)."""
    config = HypercornConfig()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.accesslog = None
    config.errorlog = logger
    async with trio.open_nursery() as nursery:
        service = IndexerService(nursery, settings)
        restored = await service.restore()
        if restored:
            logger.info("following again the %d workers registered before a restart", restored)
        app = IndexerApp(service)
        bound: list[str] = await nursery.start(_serve_app, app, config)
        task_status.started((service, bound))


async def _serve_app(
    app: IndexerApp,
    config: HypercornConfig,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    await hypercorn_serve(app, config, task_status=task_status, mode="asgi")  # type: ignore[arg-type]
