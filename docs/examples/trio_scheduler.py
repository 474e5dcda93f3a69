"""A Trio scheduler loop that publishes its KV-cache events with tskv.

Run it, then tail the stream from another terminal with any ZeroMQ SUB (or `tskv listen`).
"""

import sys

import trio

import tskv


async def main(endpoint: str) -> None:
    # bind=True: bind this loopback port (TokenSpeed's rule would connect an explicit host)
    config = tskv.KVEventsConfig(endpoint=endpoint, replay_endpoint="tcp://127.0.0.1:*", bind=True)
    async with tskv.open_publisher(config) as publisher:
        print(publisher.endpoint, publisher.replay_endpoint, flush=True)
        await publisher.wait_for_subscriber()  # instead of a sleep for the slow joiner
        parent = None
        for step in range(5):  # five scheduling rounds, each caching one block of 16 tokens
            block = 1000 + step
            await publisher.publish([tskv.BlockStored([block], parent, list(range(16)), 16)])
            parent = block
            await trio.sleep(0.01)  # the rest of the scheduler's round
        await publisher.publish([tskv.BlockRemoved([1000]), tskv.AllBlocksCleared()])
    # leaving the block sent everything still queued (within one second), then closed


if __name__ == "__main__":
    trio.run(main, sys.argv[1] if len(sys.argv) > 1 else "tcp://127.0.0.1:5557")
