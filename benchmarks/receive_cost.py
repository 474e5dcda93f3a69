"""What taking a live message off a SUB socket costs the receiving thread, with pyzmq's ways
beside the one tskv uses (`TrioSocket.receive_waiting`: a zmq.Frame a part, then EVENTS).

At a fleet's rate a reader takes about one message a socket a pass, and pays the receive and
an EVENTS read (a `poll` system call inside libzmq) for each: a reader's cost a message that no
change to filing or reporting touches. Back to back, many messages wait on one socket; in the
pump's shape, SOCKETS sockets each get one message a pass, passes GATHER apart, as a reader
under load sees them. Loopback TCP, three frames (topic, seq, a PAYLOAD-byte payload) a
message; CPU of the receiving thread (`time.thread_time`), the median of `--reps` runs of
each way, alternated, with the spread.
"""

from __future__ import annotations

import select
import threading
import time
from collections.abc import Callable
from typing import cast

import zmq

from benchmarks.helpers import fmt
from tskv.shells._trio_zmq import TrioSocket

MESSAGES = 10_000  # back to back
SOCKETS = 64
ROUNDS = 50  # the pump's shape: a message a socket a round
SPACING = 0.0003  # seconds between messages (about 3,300 a second, 64 workers at 50 rounds/s)
GATHER = 0.01  # a reader's passes
PAYLOAD = 2_500
EVENTS, POLLIN, NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)


def receive_section(out: Callable[[str], None], reps: int) -> None:
    """`reps` runs of each way, alternated: the median, with the spread."""
    out("\n## Taking a live message off a SUB socket (pyzmq, loopback TCP, 3 frames)\n")
    out("| way | back to back, a message | in the pump's shape, a message |")
    out("|---|---|---|")
    ways: list[tuple[str, Callable[[zmq.Socket[bytes]], int]]] = [
        ("tskv: a zmq.Frame a part, then EVENTS", _tskv_way),
        ("`recv_multipart`, then EVENTS", _multipart_way),
        ("`recv` and RCVMORE a part, then EVENTS", _rcvmore_way),
    ]
    with zmq.Context() as context:
        runs: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name, _ in ways}
        for _ in range(reps):
            for name, drain in ways:
                runs[name][0].append(_back_to_back(context, drain))
                runs[name][1].append(_pump_shape(context, drain))
        for name, (apart, shaped) in runs.items():
            out(f"| {name} | {fmt(apart, ' µs', 1e6, 1)} | {fmt(shaped, ' µs', 1e6, 1)} |")
        alone = [_events_alone(context) for _ in range(reps)]
        out(f"| an EVENTS read alone | {fmt(alone, ' µs', 1e6, 1)} | |")


def _tskv_way(sock: zmq.Socket[bytes]) -> int:
    """Every message waiting, as the live pump takes them (its socket just signalled)."""
    return len(TrioSocket(sock).receive_waiting(MESSAGES, signalled=True))


def _multipart_way(sock: zmq.Socket[bytes]) -> int:
    taken = 0
    while cast(int, sock.getsockopt(EVENTS)) & POLLIN:
        sock.recv_multipart(NOBLOCK)
        taken += 1
    return taken


def _rcvmore_way(sock: zmq.Socket[bytes]) -> int:
    taken = 0
    while cast(int, sock.getsockopt(EVENTS)) & POLLIN:
        parts = [sock.recv(NOBLOCK)]
        while sock.getsockopt(zmq.RCVMORE):
            parts.append(sock.recv(NOBLOCK))
        taken += 1
    return taken


def _pair(context: zmq.Context[zmq.Socket[bytes]]) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes]]:
    """A PUB and a SUB connected to it, unbounded, the subscription through."""
    pub, sub = context.socket(zmq.PUB), context.socket(zmq.SUB)
    pub.setsockopt(zmq.SNDHWM, 0)
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{pub.bind_to_random_port('tcp://127.0.0.1')}")
    while True:  # a PUB drops what it sends before the subscription arrives
        pub.send_multipart([b"kv", b"probe"])
        if sub.poll(10):
            sub.recv_multipart()
            while sub.poll(0):
                sub.recv_multipart()
            return pub, sub


def _message(seq: int) -> list[bytes]:
    return [b"kv", seq.to_bytes(8, "big"), bytes(PAYLOAD)]


def _back_to_back(
    context: zmq.Context[zmq.Socket[bytes]], drain: Callable[[zmq.Socket[bytes]], int]
) -> float:
    pub, sub = _pair(context)
    for seq in range(MESSAGES):
        pub.send_multipart(_message(seq))
    sub.poll(1000)
    time.sleep(0.5)  # ZeroMQ's I/O thread moves them all into the SUB's pipe meanwhile
    taken, spent = 0, 0.0
    while taken < MESSAGES:  # in one go, unless some were still on their way
        began = time.thread_time()
        taken += drain(sub)
        spent += time.thread_time() - began
        sub.poll(1000)
    pub.close(0)
    sub.close(0)
    return spent / taken


def _pump_shape(
    context: zmq.Context[zmq.Socket[bytes]], drain: Callable[[zmq.Socket[bytes]], int]
) -> float:
    pairs = [_pair(context) for _ in range(SOCKETS)]
    by_fd = {sub.getsockopt(zmq.FD): sub for _, sub in pairs}
    poller = select.epoll()
    for fd in by_fd:
        poller.register(fd, select.EPOLLIN)

    def publish() -> None:
        for seq in range(ROUNDS):
            for pub, _ in pairs:
                pub.send_multipart(_message(seq))
                time.sleep(SPACING)

    publisher = threading.Thread(target=publish)
    publisher.start()
    taken, spent = 0, 0.0
    while taken < SOCKETS * ROUNDS:
        ready = poller.poll(1.0)
        began = time.thread_time()
        for fd, _ in ready:
            taken += drain(by_fd[fd])
        spent += time.thread_time() - began
        time.sleep(GATHER)
    publisher.join()
    poller.close()
    for pub, sub in pairs:
        pub.close(0)
        sub.close(0)
    return spent / taken


def _events_alone(context: zmq.Context[zmq.Socket[bytes]]) -> float:
    pub, sub = _pair(context)
    began = time.thread_time()
    for _ in range(MESSAGES):
        sub.getsockopt(EVENTS)
    spent = time.thread_time() - began
    pub.close(0)
    sub.close(0)
    return spent / MESSAGES
