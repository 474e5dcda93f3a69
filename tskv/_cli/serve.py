"""`tskv serve`: the prefix index as an HTTP service, a drop-in for Dynamo's standalone indexer.

Its flags are Dynamo's (`--port`, `--block-size`, `--workers`, `--model-name`,
`--routing-group`) plus where it listens, who may ask, CURVE keys and reader processes; a TOML
file (`--config`) holds the same settings and workers each with its own key, the flags
overriding it. It binds 127.0.0.1 unless told otherwise; another address needs a bearer token
(`--token-file`) or `--insecure`, since the answers say which prompts each worker has cached.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # the serve extra brings it
    import tomli as tomllib

import trio

from tskv.core.indexer_api import DEFAULT_GROUP, ApiError, Registration

if TYPE_CHECKING:
    from tskv.shells.service import IndexerService

ENDS_WITH_CTRL_C = True  # it runs until stopped: Ctrl-C is its normal end
logger = logging.getLogger(__name__)
INSECURE_WARNING = (
    "tskv serve: listening on %s without a token: anyone who can reach it can register workers "
    "and read which prompts they hold; give --token-file FILE"
)


def add_parser(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    serve = commands.add_parser(
        "serve",
        help="serve the prefix index over HTTP (Dynamo's standalone indexer's API)",
        description="Follow workers' KV event streams and answer /query, /register, "
        "/unregister, /workers, /health and /metrics, as Dynamo's standalone indexer does "
        "(pip install 'tskv-trio[serve]').",
    )
    serve.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help="a TOML file of these settings (by their names, with _ for -) and [[workers]] "
        "tables, each a registration with its own curve_server_key if it has one",
    )
    serve.add_argument("--host", help="address to listen on (127.0.0.1)")
    serve.add_argument("--port", type=int, help="HTTP port (8090; 0: any free)")
    serve.add_argument(
        "--block-size", type=int, help="block size of the workers given with --workers"
    )
    serve.add_argument(
        "--workers",
        default="",
        metavar="ID[:RANK]=ENDPOINT,...",
        help='workers to follow from the start, as Dynamo takes them ("1=tcp://127.0.0.1:5557")',
    )
    serve.add_argument("--model-name", help="model of the --workers (default)")
    serve.add_argument("--routing-group", help=f"routing group of the --workers ({DEFAULT_GROUP})")
    serve.add_argument(
        "--token-file", type=Path, help="a file holding the bearer token every request must carry"
    )
    serve.add_argument(
        "--insecure",
        action="store_true",
        help="listen on a non-loopback address without a token (not advised)",
    )
    serve.add_argument(
        "--state-dir",
        type=Path,
        help="keep the workers registered over HTTP here, to follow them again after a restart",
    )
    serve.add_argument(
        "--max-body-bytes", type=int, help="refuse larger request bodies with 413 (16 MiB)"
    )
    _keys_and_limits(serve)


def _keys_and_limits(serve: argparse.ArgumentParser) -> None:
    serve.add_argument(
        "--curve-server-key",
        metavar="FILE",
        help="the workers' publishers' public certificate, for encrypted streams",
    )
    serve.add_argument(
        "--curve-secret-key",
        metavar="FILE",
        help="this service's secret certificate (the publishers allow its public key)",
    )
    serve.add_argument(
        "--max-workers", type=int, help="refuse registrations beyond this many workers (10000)"
    )
    serve.add_argument(
        "--processes",
        type=int,
        help="follow the workers in this many reader processes (0: in the service's own)",
    )
    serve.add_argument(
        "--dynamo-hashes",
        action="store_true",
        help="keep Dynamo's block hashes too, so /query_by_hash and /dump answer (more memory)",
    )


DEFAULTS: dict[str, Any] = {
    "host": "127.0.0.1",
    "port": 8090,
    "block_size": None,
    "workers": "",
    "model_name": "default",
    "routing_group": DEFAULT_GROUP,
    "token_file": None,
    "insecure": False,
    "state_dir": None,
    "max_body_bytes": 16 << 20,
    "curve_server_key": None,
    "curve_secret_key": None,
    "processes": 0,
    "max_workers": 10_000,
    "dynamo_hashes": False,
}
PATHS = {"token_file", "state_dir"}


def settled(args: argparse.Namespace) -> tuple[argparse.Namespace, list[dict[str, Any]]]:
    """The settings: the flags given, else the --config file's, else the defaults; and the
    file's [[workers]] tables."""
    file: dict[str, Any] = {}
    if args.config is not None:
        try:
            file = tomllib.loads(args.config.read_text())
        except OSError as exc:
            raise ValueError(f"--config {args.config}: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"--config {args.config} is not TOML: {exc}") from None
    tables = file.pop("workers", [])
    unknown = sorted(set(file) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"--config {args.config}: unknown settings {', '.join(unknown)}")
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
        raise ValueError(f"--config {args.config}: workers must be [[workers]] tables")
    for name, default in DEFAULTS.items():
        given = getattr(args, name)  # not given: None, an unset switch, an empty --workers
        if given is None or given is False or given == "":  # 0 (--port 0) is a value given
            value = file.get(name, default)
            setattr(args, name, Path(value) if name in PATHS and value is not None else value)
    return args, tables


def initial_workers(
    args: argparse.Namespace, tables: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """The registrations --workers and the [[workers]] tables stand for (checked later as
    /register checks them), and each table's own CURVE key by its endpoint."""
    registrations: list[dict[str, Any]] = []
    keys: dict[str, str] = {}
    for table in tables:
        key = table.pop("curve_server_key", None)
        if key is not None:
            keys[str(table.get("endpoint"))] = str(key)
        registrations.append(table)
    for item in filter(None, (part.strip() for part in args.workers.split(","))):
        name, sep, endpoint = item.partition("=")
        instance, _, rank = name.partition(":")
        if not sep or not instance.isdigit() or (rank and not rank.isdigit()):
            raise ValueError(f"--workers: {item!r} is not ID[:RANK]=ENDPOINT")
        if args.block_size is None:
            raise ValueError("--workers needs --block-size N (the workers' tokens a block)")
        registrations.append(
            {
                "instance_id": int(instance),
                "dp_rank": int(rank or 0),
                "endpoint": endpoint,
                "model_name": args.model_name,
                "routing_group": args.routing_group,
                "block_size": args.block_size,
            }
        )
    return registrations, keys


def _token(args: argparse.Namespace) -> str | None:
    if args.token_file is None:
        loopback = args.host == "localhost" or _is_loopback(args.host)
        if not loopback and not args.insecure:
            raise ValueError(
                f"--host {args.host} is reachable from other machines: give --token-file FILE "
                "(a bearer token every request must carry), or --insecure"
            )
        if not loopback:
            logger.warning(INSECURE_WARNING, args.host)
        return None
    try:
        token: str = args.token_file.read_text().strip()
    except OSError as exc:
        raise ValueError(f"--token-file {args.token_file}: {exc.strerror}") from None
    if len(token) < 16:
        raise ValueError(f"--token-file {args.token_file}: the token must be 16 characters or more")
    return token


def _kept(service: IndexerService, given: Registration) -> bool:
    """Whether the service already follows this registration (restored from --state-dir)."""
    model = service.registry.indexes.get(given.index)
    registered = None if model is None else model.workers.get(given.worker)
    return registered is not None and registered.endpoint == given.endpoint


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


async def main(args: argparse.Namespace) -> int:
    try:
        from tskv.shells.service import ServiceSettings, serve
    except ImportError as exc:
        raise ValueError(
            f"tskv serve needs the serve extra ({exc.name} is missing): "
            "pip install 'tskv-trio[serve]'"
        ) from None
    args, tables = settled(args)
    token = _token(args)
    workers, server_keys = initial_workers(args, tables)
    if args.state_dir is not None and not args.state_dir.is_dir():
        raise ValueError(f"--state-dir {args.state_dir} is not a directory: create it first")
    if args.curve_secret_key is not None and args.curve_server_key is None and not server_keys:
        raise ValueError(
            "--curve-secret-key needs the publishers' public key: --curve-server-key FILE, or "
            "curve_server_key in a [[workers]] table"
        )
    settings = ServiceSettings(
        max_body_bytes=args.max_body_bytes,
        token=token,
        state_dir=args.state_dir,
        curve_server_key=args.curve_server_key,
        server_keys=server_keys,
        curve_secret_key=args.curve_secret_key,
        processes=args.processes,
        max_workers=args.max_workers,
        dynamo_hashes=args.dynamo_hashes,
    )
    async with trio.open_nursery() as nursery:
        service, bound = await nursery.start(serve, args.host, args.port, settings)
        for body in workers:
            try:
                registration = Registration.parse(body)
                if not _kept(service, registration):  # else restored from --state-dir already
                    await service.register(body)
            except ApiError as exc:
                raise ValueError(f"a worker to follow at start: {exc}") from None
        print(f"tskv serve: listening on {', '.join(bound)}", file=sys.stderr, flush=True)
    return 0
