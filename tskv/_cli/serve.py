"""`tskv serve`: the prefix index as an HTTP service, a drop-in for Dynamo's standalone indexer.

Its flags are Dynamo's (`--port`, `--block-size`, `--workers`, `--model-name`,
`--routing-group`) plus where it listens and who may ask. It binds 127.0.0.1 unless told
otherwise; another address needs a bearer token (`--token-file`) or `--insecure`, since the
answers say which prompts each worker has cached.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from tskv.core.indexer_api import DEFAULT_GROUP, ApiError

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
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    serve.add_argument("--port", type=int, default=8090, help="HTTP port (8090; 0: any free)")
    serve.add_argument(
        "--block-size", type=int, help="block size of the workers given with --workers"
    )
    serve.add_argument(
        "--workers",
        default="",
        metavar="ID[:RANK]=ENDPOINT,...",
        help='workers to follow from the start, as Dynamo takes them ("1=tcp://127.0.0.1:5557")',
    )
    serve.add_argument("--model-name", default="default", help="model of the --workers")
    serve.add_argument(
        "--routing-group", default=DEFAULT_GROUP, help="routing group of the --workers"
    )
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
        "--max-body-bytes",
        type=int,
        default=16 << 20,
        help="refuse larger request bodies with 413 (16 MiB)",
    )


def initial_workers(args: argparse.Namespace) -> list[dict[str, object]]:
    """The registrations --workers stands for, checked as /register checks them."""
    registrations: list[dict[str, object]] = []
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
    return registrations


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


def _kept(service: IndexerService, given: dict[str, object]) -> bool:
    """Whether the service already follows this --workers registration, as it was given."""
    model = service.registry.indexes.get((str(given["model_name"]), str(given["routing_group"])))
    key = (given["instance_id"], given["dp_rank"])
    registered = None if model is None else model.workers.get(key)  # type: ignore[arg-type]
    return registered is not None and registered.endpoint == given["endpoint"]


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
    token = _token(args)
    workers = initial_workers(args)
    if args.state_dir is not None and not args.state_dir.is_dir():
        raise ValueError(f"--state-dir {args.state_dir} is not a directory: create it first")
    settings = ServiceSettings(
        max_body_bytes=args.max_body_bytes, token=token, state_dir=args.state_dir
    )
    async with trio.open_nursery() as nursery:
        service, bound = await nursery.start(serve, args.host, args.port, settings)
        for registration in workers:
            try:
                await service.register(registration)
            except ApiError as exc:
                if not _kept(service, registration):  # else restored from --state-dir already
                    raise ValueError(f"--workers: {exc}") from None
        print(f"tskv serve: listening on {', '.join(bound)}", file=sys.stderr, flush=True)
    return 0
