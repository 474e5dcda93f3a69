"""A KV-aware router: send each request to the worker that holds the longest prefix of it.

Run: python router.py ENDPOINT REPLAY_ENDPOINT [ENDPOINT REPLAY_ENDPOINT ...]
(for example against `tskv simulate --ranks 2 --replay-endpoint tcp://127.0.0.1:5600`, with
the endpoints it prints). Ctrl-C stops it.
"""

import contextlib
import itertools
import sys

import trio

import tskv
from tskv.sim import Workload


class Router:
    def __init__(self, watcher: tskv.Watcher) -> None:
        self.index = watcher.index
        self.fallback = itertools.cycle(watcher.workers)  # when no trusted worker has a prefix

    def route(self, token_ids: list[int]) -> tuple[object, int]:
        """The worker to send a request to, and how many leading blocks it already holds."""
        match = self.index.match(token_ids)
        worker, blocks = match.best(trusted_only=True)  # skip workers whose view is stale
        if worker is None:
            worker = next(self.fallback)
        return worker, blocks


async def main(endpoints: list[str]) -> None:
    index = tskv.PrefixIndex(block_size=16)
    async with tskv.open_watcher(index) as watcher:
        pairs = zip(endpoints[::2], endpoints[1::2], strict=True)
        for rank, (endpoint, replay) in enumerate(pairs):
            watcher.add(("worker", rank), endpoint, replay)
        router = Router(watcher)
        # Requests whose prefix the workers cache: `tskv simulate` gives rank r a workload
        # seeded r (with --seed 0), and every request it makes starts with a system prompt.
        prompts = [p for r in range(rank + 1) for p in Workload(r, 16).system_prompts]
        while True:
            await trio.sleep(1)
            for prompt in prompts:
                worker, blocks = router.route(prompt)
                print(f"{len(prompt)} tokens -> {worker}, {blocks} blocks cached there")
            print("stale:", sorted(index.stale), flush=True)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C is how this example ends
        trio.run(main, sys.argv[1:])
