"""The decisions of `tskv serve`, without I/O: what a request means, which index it goes to,
and what an answer holds.

The contract is Dynamo's standalone KV indexer (`python -m dynamo.indexer`, ai-dynamo-runtime
1.6.1, after Mooncake's KV Indexer RFC): the same routes, the same request fields and the same
answers, checked by driving both with one client (tests/interop/test_service_dropin.py). One
index per (model_name, routing_group), as Dynamo keeps them; the first registration sets its
block size. What tskv knows beyond Dynamo goes in added fields (`tskv` in an answer), never in
changed ones. The HTTP shell decodes the JSON and hands the values here; every problem is an
`ApiError` carrying its status and one line naming it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from tskv.core.dynamo_hashes import stored_event
from tskv.core.endpoints import check_endpoint
from tskv.core.errors import TskvError
from tskv.core.prefix_index import MAX_BLOCK_SIZE, Match, PrefixIndex
from tskv.core.routing import LoadAwarePolicy

DEFAULT_GROUP = "default"  # Dynamo's routing group when a request names none
MAX_U64 = 2**64 - 1
MIN_I64, MAX_I64 = -(2**63), 2**63 - 1  # Dynamo's clients send block hashes as i64
MAX_TOKEN = 2**32 - 1  # Dynamo reads token ids as u32
MAX_QUERY_TOKENS = 1 << 20  # a longer prompt is refused (413): no model takes one
MAX_WORKERS = 10_000  # registrations, each a subscriber with its sockets: a bound on memory
WorkerKey = tuple[int, int]  # (instance_id, dp_rank): a worker in the index
IndexKey = tuple[str, str]  # (model_name, routing_group)


class ApiError(TskvError, ValueError):
    """A request the service refuses: `status` is the HTTP status, the message one line."""

    def __init__(self, status: int, message: str) -> None:
        # one line whatever a client put in the names it quotes back
        super().__init__("".join(c if c.isprintable() else repr(c)[1:-1] for c in message))
        self.status = status


def _field(
    data: Mapping[str, Any],
    name: str,
    kind: type,
    default: Any = ...,
    *,
    low: int = 0,
    high: int = MAX_U64,
) -> Any:
    """`data[name]` of `kind` (an int from `low` to `high`), or `default` when absent or null."""
    value = data.get(name)
    if value is None:
        if default is ...:
            raise ApiError(422, f"missing field {name!r}")
        return default
    if kind is int:
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
            raise ApiError(
                422, f"{name} must be an integer from {low} to {high}, got {value!r:.40}"
            )
    elif not isinstance(value, kind):
        raise ApiError(422, f"{name} must be a {kind.__name__}, got {value!r:.40}")
    return value


def _object(data: object) -> Mapping[str, Any]:
    if not isinstance(data, dict):
        raise ApiError(422, f"the body must be a JSON object, got {type(data).__name__}")
    return data


def _endpoint(data: Mapping[str, Any], name: str, optional: bool) -> str | None:
    value = _field(data, name, str, None if optional else ...)
    if value is not None:
        try:
            check_endpoint(value)
        except ValueError as exc:
            raise ApiError(422, f"{name}: {exc}") from None
    return value  # type: ignore[no-any-return]


class _OfOneIndex:
    """A request about one model's index, named by its model and routing group."""

    __slots__ = ()
    model_name: str
    routing_group: str

    @property
    def index(self) -> IndexKey:
        return self.model_name, self.routing_group


@attrs.frozen
class Registration(_OfOneIndex):
    """`POST /register`: follow this worker's stream (and replay) in its model's index."""

    instance_id: int
    dp_rank: int
    endpoint: str
    replay_endpoint: str | None
    model_name: str
    routing_group: str
    block_size: int
    tenant_id: str | None  # accepted as Dynamo accepts it; it does not divide indexes there either

    @property
    def worker(self) -> WorkerKey:
        return self.instance_id, self.dp_rank

    @classmethod
    def parse(cls, body: object) -> Registration:
        data = _object(body)
        endpoint = _endpoint(data, "endpoint", optional=False)
        assert endpoint is not None
        return cls(
            instance_id=_field(data, "instance_id", int),
            dp_rank=_field(data, "dp_rank", int, 0),
            endpoint=endpoint,
            replay_endpoint=_endpoint(data, "replay_endpoint", optional=True),
            model_name=_field(data, "model_name", str),
            routing_group=_field(data, "routing_group", str, DEFAULT_GROUP),
            block_size=_field(data, "block_size", int, low=1, high=MAX_BLOCK_SIZE),
            tenant_id=_field(data, "tenant_id", str, None),
        )


@attrs.frozen
class Unregistration(_OfOneIndex):
    """`POST /unregister`: one rank of an instance, or all of them (no `dp_rank`)."""

    instance_id: int
    model_name: str
    routing_group: str
    dp_rank: int | None

    @classmethod
    def parse(cls, body: object) -> Unregistration:
        data = _object(body)
        return cls(
            instance_id=_field(data, "instance_id", int),
            model_name=_field(data, "model_name", str),
            routing_group=_field(data, "routing_group", str, DEFAULT_GROUP),
            dp_rank=_field(data, "dp_rank", int, None),
        )


def _ints(data: Mapping[str, Any], name: str, bounds: tuple[int, int], said: str) -> list[int]:
    """`name`'s list of integers within `bounds` (`said` in words); else the 4xx saying why."""
    values = data.get(name)
    if not isinstance(values, list):
        raise ApiError(422, f"{name} must be a list of integers, got {values!r:.40}")
    if len(values) > MAX_QUERY_TOKENS:
        raise ApiError(413, f"{len(values)} {name}: at most {MAX_QUERY_TOKENS} a query")
    low, high = bounds
    for value in values:
        if type(value) is not int or not low <= value <= high:
            raise ApiError(422, f"{name} must be integers from {said}, got {value!r:.40}")
    return values


@attrs.frozen
class Query(_OfOneIndex):
    """`POST /query`: which workers hold how much of this prompt's prefix."""

    token_ids: list[int]
    model_name: str
    routing_group: str
    lora_name: str | None

    @classmethod
    def parse(cls, body: object) -> Query:
        data = _object(body)
        return cls(
            _ints(data, "token_ids", (0, MAX_TOKEN), "0 to 2**32-1"),
            _field(data, "model_name", str),
            _field(data, "routing_group", str, DEFAULT_GROUP),
            _field(data, "lora_name", str, None),
        )


@attrs.frozen
class HashQuery(_OfOneIndex):
    """`POST /query_by_hash`: a prefix named by Dynamo's block hashes (`DynamoHashes`)."""

    block_hashes: list[int]
    model_name: str
    routing_group: str

    @classmethod
    def parse(cls, body: object) -> HashQuery:
        data = _object(body)
        return cls(
            _ints(data, "block_hashes", (MIN_I64, MAX_I64), "-2**63 to 2**63-1"),
            _field(data, "model_name", str),
            _field(data, "routing_group", str, DEFAULT_GROUP),
        )


@attrs.frozen
class Selection:
    """`POST /select`: a query, and the caller's view of each worker's load (tokens queued);
    a worker left out is idle."""

    query: Query
    loads: dict[WorkerKey, float]

    @classmethod
    def parse(cls, body: object) -> Selection:
        query = Query.parse(body)
        given = _object(body).get("loads") or []
        if not isinstance(given, list):
            raise ApiError(422, f"loads must be a list of worker loads, got {given!r:.40}")
        loads: dict[WorkerKey, float] = {}
        for load in given:
            entry = _object(load)
            queued = entry.get("queued_tokens")
            if isinstance(queued, bool) or not isinstance(queued, (int, float)) or queued < 0:
                raise ApiError(422, f"queued_tokens must be a number >= 0, got {queued!r:.40}")
            worker = (_field(entry, "instance_id", int), _field(entry, "dp_rank", int, 0))
            loads[worker] = float(queued)
        return cls(query, loads)


@attrs.define
class ModelIndex:
    """One (model, routing group): its index, its block size, and the workers registered."""

    key: IndexKey
    index: PrefixIndex
    workers: dict[WorkerKey, Registration] = attrs.Factory(dict)

    def require_dynamo_hashes(self) -> None:
        """Refuse (501) a route that needs Dynamo's block hashes where the index keeps none."""
        if self.index.dynamo is None:
            raise ApiError(
                501,
                "this route takes Dynamo's block hashes, which this service does not keep: "
                "start it with --dynamo-hashes, or send the token ids to /query",
            )

    @property
    def block_size(self) -> int:
        return self.index.block_size


STATE_VERSION = 1  # of the registrations file a service keeps across restarts


class Registry:
    """Every index the service keeps and who is registered in each: what a registration,
    an unregistration or a query means, decided here; following the streams is the shell's."""

    def __init__(self, max_workers: int = MAX_WORKERS, dynamo_hashes: bool = False) -> None:
        self.indexes: dict[IndexKey, ModelIndex] = {}
        self.max_workers = max_workers  # what a client may make the service follow, at most
        self.dynamo_hashes = dynamo_hashes  # each index keeps Dynamo's block hashes too

    def state(self) -> dict[str, Any]:
        """What a restarted service needs to follow the same workers: every registration."""
        registrations = [
            attrs.asdict(registration)
            for model in self.indexes.values()
            for registration in model.workers.values()
        ]
        return {"version": STATE_VERSION, "registrations": registrations}

    @staticmethod
    def saved(state: object) -> list[Registration]:
        """The registrations a state holds, each checked as `/register` checks it."""
        data = _object(state)
        if data.get("version") != STATE_VERSION or not isinstance(data.get("registrations"), list):
            raise ApiError(422, f"not a tskv serve state of version {STATE_VERSION}")
        return [Registration.parse(entry) for entry in data["registrations"]]

    def register(self, registration: Registration) -> tuple[ModelIndex, bool]:
        """The index the worker goes in, and whether it is new (its watcher starts). Refused
        (409) for a worker already registered there, or a block size other than the index's."""
        known = self.indexes.get(registration.index)
        if sum(len(model.workers) for model in self.indexes.values()) >= self.max_workers:
            raise ApiError(
                422,
                f"the service follows at most {self.max_workers} workers (--max-workers): "
                "unregister one first",
            )
        if known is None:
            model = ModelIndex(
                registration.index,
                PrefixIndex(registration.block_size, dynamo_hashes=self.dynamo_hashes),
            )
        else:
            model = known
            if registration.block_size != model.block_size:
                raise ApiError(
                    409,
                    f"block_size mismatch for model={registration.model_name} routing_group="
                    f"{registration.routing_group}: existing={model.block_size}, requested="
                    f"{registration.block_size}",
                )
            if registration.worker in model.workers:
                raise ApiError(
                    409,
                    f"instance {registration.instance_id} dp_rank {registration.dp_rank} already "
                    "registered",
                )
        model.workers[registration.worker] = registration
        self.indexes[registration.index] = model
        return model, known is None

    def unregister(self, request: Unregistration) -> tuple[ModelIndex, list[WorkerKey]]:
        """The workers to stop following (404 when none is registered)."""
        model = self.indexes.get(request.index)
        gone = [
            worker
            for worker in ([] if model is None else model.workers)
            if worker[0] == request.instance_id
            and (request.dp_rank is None or worker[1] == request.dp_rank)
        ]
        if model is None or not gone:
            raise ApiError(404, f"instance {request.instance_id} not found")
        for worker in gone:
            del model.workers[worker]
        return model, gone

    def model(self, key: IndexKey) -> ModelIndex:
        known = self.indexes.get(key)
        if known is None:
            names = ", ".join(f"{m}/{g}" for m, g in sorted(self.indexes)) or "none yet"
            raise ApiError(
                404,
                f"no indexer for model={key[0]} routing_group={key[1]} (registered: {names})",
            )
        return known


def _key(worker: object) -> WorkerKey:
    """A worker of the service's indexes: each one it registers is an (instance, rank)."""
    assert isinstance(worker, tuple) and len(worker) == 2
    return worker[0], worker[1]


def answer(match: Match, block_size: int, stale_reasons: Mapping[WorkerKey, str]) -> dict[str, Any]:
    """`/query`'s answer: Dynamo's `scores` (tokens matched on the device, by instance, then
    dp rank: what its router's cost counts as reused without a load) and `instances` (`gpu`
    the device's; `longest_matched`, `cpu` and `disk` counting the lower tiers too, as Dynamo's
    do), and in `tskv` what Dynamo cannot say: which workers' views are stale, and why."""
    scores: dict[str, dict[str, int]] = {}
    instances: dict[str, dict[str, Any]] = {}
    for worker, blocks in match.items():
        instance, rank = _key(worker)
        tokens = blocks * block_size
        device = match.on_device(worker) * block_size
        if device:  # Dynamo's scores name no worker that holds none of it on the device
            scores.setdefault(str(instance), {})[str(rank)] = device
        held = instances.setdefault(
            str(instance), {"longest_matched": 0, "gpu": 0, "dp": {}, "cpu": 0, "disk": 0}
        )
        held["dp"][str(rank)] = device
        held["longest_matched"] = max(held["longest_matched"], tokens)
        held["gpu"] = max(held["gpu"], device)
        held["cpu"] = held["disk"] = held["longest_matched"]
    stale = {}
    for worker in match.stale:
        instance, rank = _key(worker)
        stale[f"{instance}:{rank}"] = stale_reasons.get((instance, rank), "its view is incomplete")
    return {
        "scores": scores,
        "frequencies": [],
        "instances": instances,
        "tskv": {"block_size": block_size, "stale": stale},
    }


def dumped(trees: Iterable[tuple[ModelIndex, Mapping[WorkerKey, list[Any]]]]) -> dict[str, Any]:
    """`GET /dump`: each index's workers' blocks as the stores that would build Dynamo's tree
    again (its peers recover from a dump), each worker's as `dynamo_hashes.answer` gives them
    ([left out, stores]); under `tskv`, how many blocks were left out because their Dynamo hash
    is not known."""
    found: dict[str, Any] = {}
    for model, answers in trees:
        events = [
            stored_event(*worker, number, store)
            for worker, (_, stores) in answers.items()
            for number, store in enumerate(stores)
        ]
        left_out = sum(left for left, _ in answers.values())
        tree = {"block_size": model.block_size, "events": events, "tskv": {"left_out": left_out}}
        found["{}:{}".format(*model.key)] = tree
    return found


def listing(
    models: Iterable[ModelIndex], extra: Mapping[WorkerKey, dict[str, Any]]
) -> list[dict[str, Any]]:
    """`/workers`: one entry per instance and index, as Dynamo lists them, with `tskv`'s
    per-rank figures (stale, why, the publisher's descriptor) added."""
    listed: list[dict[str, Any]] = []
    for model in models:
        by_instance: dict[int, dict[str, Any]] = {}
        for (instance, rank), registration in model.workers.items():
            entry = by_instance.setdefault(
                instance,
                {
                    "instance_id": instance,
                    "source": "zmq",
                    "status": "active",
                    "model_name": model.key[0],
                    "routing_group": model.key[1],
                    "block_size": model.block_size,
                    "endpoints": {},
                    "listeners": {},
                    "tskv": {},
                },
            )
            entry["endpoints"][str(rank)] = registration.endpoint
            entry["listeners"][str(rank)] = {"endpoint": registration.endpoint, "status": "active"}
            entry["tskv"][str(rank)] = extra.get((instance, rank), {})
        listed.extend(by_instance.values())
    return listed


def selected(
    match: Match, model: ModelIndex, policy: LoadAwarePolicy, selection: Selection
) -> dict[str, Any]:
    """`/select`'s answer: the worker `policy` picks among those registered (the trusted ones,
    if any is), and each candidate's reasons: tokens held (and of those, in a lower tier only),
    tokens queued, cost."""
    prompt = len(selection.query.token_ids)
    if not model.workers:
        raise ApiError(404, f"no worker registered for model={model.key[0]}")
    loads: dict[Any, float] = dict(selection.loads)
    costs = policy.costs(match, prompt, loads, list(model.workers))
    choice = policy.choose(match, prompt, loads, list(model.workers))
    instance, rank = _key(choice.worker)
    reasons = []
    for cost in costs:
        worker = _key(cost.worker)
        reasons.append(
            {
                "instance_id": worker[0],
                "dp_rank": worker[1],
                "cached_tokens": cost.cached,
                "lower_tier_tokens": cost.lower,
                "queued_tokens": cost.queued,
                "cost": cost.cost,
            }
        )
    return {
        "instance_id": instance,
        "dp_rank": rank,
        "cached_tokens": choice.cached_tokens,
        "cost": choice.cost,
        "candidates": reasons,
        "stale": ["{}:{}".format(*_key(worker)) for worker in sorted(match.stale, key=str)],
    }


def _object_schema(required: list[str], **properties: Any) -> dict[str, Any]:
    return {"type": "object", "required": required, "properties": properties}


Schema = dict[str, Any]
_U64: Schema = {"type": "integer", "minimum": 0, "maximum": MAX_U64}
_NAME: Schema = {"type": "string"}
_ENDPOINT: Schema = {
    "type": "string",
    "description": "a ZeroMQ endpoint: tcp://, ipc://, inproc://",
}
_QUERY: dict[str, Schema] = {
    "token_ids": {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": MAX_TOKEN},
    },
    "model_name": _NAME,
    "routing_group": _NAME,
    "lora_name": _NAME,
}
_JSON = "application/json"


def _route(summary: str, request: str | None, answer: dict[str, Any]) -> dict[str, Any]:
    operation: dict[str, Any] = {
        "summary": summary,
        "responses": {
            "200": {"description": "answered", "content": {_JSON: {"schema": answer}}},
            "4XX": {
                "description": "refused, one line saying why",
                "content": {_JSON: {"schema": {"$ref": "#/components/schemas/Error"}}},
            },
        },
    }
    if request is not None:
        schema = {"$ref": f"#/components/schemas/{request}"}
        operation["requestBody"] = {"required": True, "content": {_JSON: {"schema": schema}}}
    return operation


OK = {"$ref": "#/components/schemas/Status"}
ANY_OBJECT = {"type": "object"}
OPENAPI: dict[str, Any] = {
    "openapi": "3.1.0",
    "info": {
        "title": "tskv serve",
        "description": "The prefix index of KV-cache events as a service: Dynamo's standalone "
        "indexer's API (ai-dynamo-runtime 1.6.1), with tskv's additions under `tskv`.",
        "version": "1",
    },
    "paths": {
        "/register": {"post": _route("follow a worker's stream", "Registration", OK)},
        "/unregister": {"post": _route("stop following a worker", "Unregistration", OK)},
        "/query": {
            "post": _route("matched tokens by worker and tier", "Query", {"type": "object"})
        },
        "/select": {
            "post": _route("the worker to send to, and why", "Selection", {"type": "object"})
        },
        "/query_by_hash": {
            "post": _route(
                "/query for a prefix named by Dynamo's block hashes (--dynamo-hashes)",
                "HashQuery",
                {"type": "object"},
            )
        },
        "/dump": {
            "get": _route(
                "every block, as stores Dynamo's tree applies (--dynamo-hashes)",
                None,
                {"type": "object"},
            )
        },
        "/workers": {"get": _route("the registered workers", None, {"type": "array"})},
        "/health": {"get": _route("the service answers", None, {})},
        "/metrics": {"get": _route("Prometheus' text format", None, {})},
    },
    "components": {
        "schemas": {
            "Registration": _object_schema(
                ["instance_id", "endpoint", "model_name", "block_size"],
                instance_id=_U64,
                dp_rank=_U64,
                endpoint=_ENDPOINT,
                replay_endpoint=_ENDPOINT,
                model_name=_NAME,
                routing_group=_NAME,
                block_size={"type": "integer", "minimum": 1, "maximum": MAX_BLOCK_SIZE},
                tenant_id=_NAME,
            ),
            "Unregistration": _object_schema(
                ["instance_id", "model_name"],
                instance_id=_U64,
                model_name=_NAME,
                routing_group=_NAME,
                dp_rank=_U64,
            ),
            "Query": _object_schema(["token_ids", "model_name"], **_QUERY),
            "HashQuery": _object_schema(
                ["block_hashes", "model_name"],
                block_hashes={
                    "type": "array",
                    "items": {"type": "integer", "minimum": MIN_I64, "maximum": MAX_I64},
                },
                model_name=_NAME,
                routing_group=_NAME,
            ),
            "Selection": _object_schema(
                ["token_ids", "model_name"],
                **_QUERY,
                loads={
                    "type": "array",
                    "items": _object_schema(
                        ["instance_id", "queued_tokens"],
                        instance_id=_U64,
                        dp_rank=_U64,
                        queued_tokens={"type": "number", "minimum": 0},
                    ),
                },
            ),
            "Status": _object_schema(["status"], status={"const": "ok"}),
            "Error": _object_schema(["error"], error={"type": "string"}),
        }
    },
}
