"""A KV-aware router: send each request to the worker that can start on it soonest.

The cost of a worker is the prompt tokens it must prefill (those not in its cache, as the
prefix index says) plus the work already queued on it (`tskv.LoadAwarePolicy`): longest prefix
first would send every request that shares a system prompt to whichever worker holds it.

Run: python router.py ENDPOINT REPLAY_ENDPOINT [ENDPOINT REPLAY_ENDPOINT ...]
(for example against `tskv simulate --ranks 2 --replay-endpoint tcp://127.0.0.1:5600`, with
the endpoints it prints). Ctrl-C stops it.
"""

import contextlib
import sys

import trio

import tskv
from tskv.sim import Workload


class Router:
    def __init__(self, watcher: tskv.Watcher, predicted_ttl: float = 5.0) -> None:
        self.watcher = watcher
        self.index = watcher.index
        self.policy = tskv.LoadAwarePolicy()  # weights: prefill_weight=1.0, load_weight=1.0
        self.predicted_ttl = predicted_ttl  # how long a routed request's blocks count unseen
        self.queued: dict[object, float] = {}  # tokens sent to each worker, not done yet

    def route(self, token_ids: list[int]) -> tskv.Choice:
        """The worker to send a request to, and how many of its tokens are cached there."""
        match = self.index.match(token_ids)  # every worker watched; the stale ones passed over
        choice = self.policy.choose(match, len(token_ids), self.queued)  # missing: idle
        to_prefill = len(token_ids) - choice.cached_tokens
        self.queued[choice.worker] = self.queued.get(choice.worker, 0.0) + to_prefill
        # Its blocks will be there soon: siblings arriving before the BlockStored follow it.
        self.index.predict(choice.worker, token_ids, self.predicted_ttl)
        return choice

    def done(self, choice: tskv.Choice, token_ids: list[int]) -> None:
        """The worker has prefilled the request: its work is no longer queued."""
        self.queued[choice.worker] -= len(token_ids) - choice.cached_tokens


def turned(worker: object, status: tskv.WorkerStatus) -> None:
    """A worker turned stale or current, went silent or came back: the policy already knows."""
    state = "silent" if status.silent else "stale" if status.stale else "current"
    print(f"{worker} is {state}", flush=True)


async def main(endpoints: list[str]) -> None:
    index = tskv.PrefixIndex(block_size=16)
    async with tskv.open_watcher(index, on_status=turned) as watcher:
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
                choice = router.route(prompt)
                print(f"{len(prompt)} tokens -> {choice.worker}, {choice.cached_tokens} cached")
                router.done(choice, prompt)  # here nothing runs them: done at once
            print("stale:", sorted(index.stale), flush=True)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C is how this example ends
        trio.run(main, sys.argv[1:])
