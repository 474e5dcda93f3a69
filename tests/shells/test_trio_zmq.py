"""The Trio shim over pyzmq, on real inproc and loopback sockets."""

from __future__ import annotations

import trio
import trio.testing
import zmq

from tests.zmq_helpers import LOOPBACK, inproc_name, raw_socket


async def test_no_lost_wakeup_with_many_messages_already_queued() -> None:
    endpoint = inproc_name("queued")
    async with raw_socket(zmq.PULL, endpoint, bind=True) as pull:
        push = zmq.Context.instance().socket(zmq.PUSH)
        push.connect(endpoint)
        for index in range(500):  # queued before anyone waits: the fd edge has already fired
            push.send_multipart([b"m", str(index).encode()])
        push.close(linger=-1)
        received = []
        with trio.fail_after(10):
            for _ in range(500):
                received.append((await pull.receive())[1])
        assert received == [str(index).encode() for index in range(500)]


async def test_receive_wakes_for_a_message_sent_later_by_another_task() -> None:
    endpoint = inproc_name("later")
    async with (
        raw_socket(zmq.PAIR, endpoint, bind=True) as left,
        raw_socket(zmq.PAIR, endpoint) as right,
    ):
        async with trio.open_nursery() as nursery:
            got: list[list[bytes]] = []

            async def receiver() -> None:
                got.append(await left.receive())

            nursery.start_soon(receiver)
            await trio.testing.wait_all_tasks_blocked()
            await right.send([b"a", b"b", b"c"])
        assert got == [[b"a", b"b", b"c"]]


async def test_cancelled_receive_never_splits_or_loses_a_message() -> None:
    endpoint = inproc_name("cancel")
    async with (
        raw_socket(zmq.PAIR, endpoint, bind=True) as left,
        raw_socket(zmq.PAIR, endpoint) as right,
    ):
        for _ in range(20):
            with trio.CancelScope() as scope:
                scope.cancel()
                await left.receive()  # cancelled before taking anything
            await right.send([b"x", b"y"])
            with trio.CancelScope() as scope:
                scope.cancel()
                await left.receive()  # still cancelled: the message stays queued
        for _ in range(20):
            assert await left.receive() == [b"x", b"y"]


async def test_send_blocks_at_hwm_and_cancelling_it_sends_nothing() -> None:
    endpoint = inproc_name("hwm")
    async with raw_socket(zmq.PAIR, endpoint, bind=True) as left:
        left.sock.setsockopt(zmq.RCVHWM, 1)
        async with raw_socket(zmq.PAIR, endpoint) as right:
            right.sock.setsockopt(zmq.SNDHWM, 1)
            sent = 0
            while True:  # fill the pipe until a send would block
                try:
                    right.send_nowait([b"part1", str(sent).encode()])
                except trio.WouldBlock:
                    break
                sent += 1
            async with trio.open_nursery() as nursery:
                scope = trio.CancelScope()

                async def blocked_send() -> None:
                    with scope:
                        await right.send([b"part1", b"cancelled"])

                nursery.start_soon(blocked_send)
                await trio.testing.wait_all_tasks_blocked()
                scope.cancel()
            assert scope.cancelled_caught
            messages = [await left.receive() for _ in range(sent)]
            assert [int(message[1]) for message in messages] == list(range(sent))
            try:
                extra = left.receive_nowait()
            except trio.WouldBlock:
                extra = None
            assert extra is None, f"a cancelled send delivered {extra}"


async def test_closing_while_a_task_waits_wakes_it_with_a_clear_error() -> None:
    async with raw_socket(zmq.PULL, LOOPBACK, bind=True) as pull:
        errors: list[str] = []

        async def waiter() -> None:
            try:
                await pull.receive()
            except trio.ClosedResourceError as exc:
                errors.append(str(exc))

        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(waiter)
                await trio.testing.wait_all_tasks_blocked()
                pull.close()
        assert errors == ["this ZeroMQ socket was closed while a task was waiting on it"]
        try:
            await pull.receive()
        except trio.ClosedResourceError as exc:
            assert "was closed" in str(exc)
        else:
            raise AssertionError("receive on a closed socket must raise")


async def test_receive_waiting_takes_what_is_queued_up_to_its_limit_and_never_blocks() -> None:
    endpoint = inproc_name("waiting")
    async with (
        raw_socket(zmq.PAIR, endpoint, bind=True) as left,
        raw_socket(zmq.PAIR, endpoint) as right,
    ):
        assert left.receive_waiting(10) == []  # nothing queued: none, at once
        for index in range(5):
            await right.send([b"m", str(index).encode()])
        with trio.fail_after(10):
            await left.wait(zmq.POLLIN)
        first = left.receive_waiting(3)
        rest = left.receive_waiting(10)
        assert [message[1] for message in first + rest] == [b"0", b"1", b"2", b"3", b"4"]
        assert len(first) == 3  # whole multipart messages, in order, at most the limit
        assert left.receive_waiting(10) == []
