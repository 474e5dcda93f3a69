"""A closed-loop HTTP load: `concurrency` clients, each with one keep-alive connection, asking
`/query` with prompts in turn for `seconds`; prints each request's latency as JSON.

Run as its own process (`python -m benchmarks.http_load URL PROMPTS CONCURRENCY SECONDS`), so
the load's CPU is the same whichever service it is pointed at, and never in their processes.
"""

from __future__ import annotations

import http.client
import json
import sys
import threading
import time
import urllib.parse


def load(url: str, bodies: list[bytes], concurrency: int, seconds: float) -> list[float]:
    parsed = urllib.parse.urlsplit(url)
    latencies: list[list[float]] = [[] for _ in range(concurrency)]
    failures: list[str] = []
    start = threading.Barrier(concurrency)

    def client(n: int) -> None:
        connection = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=30)
        headers = {"content-type": "application/json"}
        start.wait()
        ends = time.perf_counter() + seconds
        i = n
        while (now := time.perf_counter()) < ends:
            connection.request("POST", "/query", bodies[i % len(bodies)], headers)
            reply = connection.getresponse()
            reply.read()
            if reply.status != 200:
                failures.append(f"status {reply.status}")
                return
            latencies[n].append(time.perf_counter() - now)
            i += concurrency

    threads = [threading.Thread(target=client, args=(n,)) for n in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        raise RuntimeError(f"{len(failures)} clients failed: {failures[0]}")
    return [latency for each in latencies for latency in each]


def main() -> None:
    url, prompts, concurrency, seconds = sys.argv[1:5]
    with open(prompts) as file:
        bodies = [json.dumps(body).encode() for body in json.load(file)]
    print(json.dumps(load(url, bodies, int(concurrency), float(seconds))))


if __name__ == "__main__":
    main()
