"""Simulated workers as real publishers, watched by a real router: what the routing demos set up."""

from __future__ import annotations

from contextlib import AsyncExitStack

from tskv.core.config import KVEventsConfig
from tskv.core.prefix_index import PrefixIndex
from tskv.shells.publisher import Publisher, open_publisher
from tskv.shells.watcher import Watcher, open_watcher


async def watched_publishers(
    stack: AsyncExitStack, config: KVEventsConfig, count: int, index: PrefixIndex
) -> tuple[list[Publisher], Watcher]:
    """`count` publishers (ranks 0..count-1 of `config`) and a watcher keeping `index` current
    from every one, each subscribed before this returns; all closed with `stack`."""
    publishers = [
        await stack.enter_async_context(open_publisher(config, rank)) for rank in range(count)
    ]
    watcher = await stack.enter_async_context(open_watcher(index))
    for rank, publisher in enumerate(publishers):
        watcher.add(rank, publisher.endpoint, publisher.replay_endpoint)
    for publisher in publishers:
        await publisher.wait_for_subscriber()
    return publishers, watcher
