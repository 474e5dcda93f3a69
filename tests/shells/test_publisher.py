"""The Trio publisher on real sockets: seqs, replay, topics, ranks, backpressure, shutdown."""

from __future__ import annotations

import logging
import time

import pytest
import trio
import trio.testing
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tskv
from tests.zmq_helpers import (
    LOOPBACK,
    inproc_name,
    raw_socket,
    receive_batch,
    refusing_endpoint,
    request_replay,
    subscribed,
)
from tskv import BlockRemoved, BlockStored, KVEventsConfig, PublisherClosedError
from tskv.core.frames import EPOCH_MARK
from tskv.shells._trio_zmq import TrioSocket


def events(n: int) -> list[tskv.KVEvent]:
    return [BlockRemoved([n])]


def config(**changes: object) -> KVEventsConfig:
    values: dict[str, object] = {"endpoint": LOOPBACK, "replay_endpoint": LOOPBACK}
    values.update(changes)
    return KVEventsConfig(**values)  # type: ignore[arg-type]


async def test_first_batch_has_seq_0_and_the_events_sent() -> None:
    sent = [BlockStored([1, 2], None, [5, 6, 7, 8], 2), BlockRemoved([9])]
    async with tskv.open_publisher(config()) as publisher, subscribed(publisher) as sub:
        before = time.time()
        await publisher.publish(sent)
        after = time.time()
        topic, seq, batch = await receive_batch(sub)
    assert (topic, seq) == (b"", 0)
    assert list(batch.events) == sent
    assert batch.attn_dp_rank == 0
    assert before <= batch.ts <= after  # the round's time is taken when publish() is called


async def test_an_idle_publisher_counts_a_subscription_when_asked_for_its_statistics() -> None:
    async with tskv.open_publisher(config()) as publisher:
        await trio.testing.wait_all_tasks_blocked()  # idle: its task waits on the queue alone
        async with raw_socket(zmq.SUB, publisher.endpoint) as sub:
            sub.sock.setsockopt(zmq.SUBSCRIBE, b"")
            with trio.fail_after(10):
                # polled on purpose: a monitor reading the statistics is all that asks
                while publisher.statistics().subscriptions < 1:  # noqa: ASYNC110
                    await trio.sleep(0.01)
            assert publisher.statistics().subscriptions == 1


async def test_a_wait_for_a_subscriber_begun_while_idle_sees_it_arrive() -> None:
    async with tskv.open_publisher(config()) as publisher, trio.open_nursery() as nursery:
        await trio.testing.wait_all_tasks_blocked()  # idle on the queue, watching no socket
        arrived = trio.Event()

        async def wait() -> None:
            await publisher.wait_for_subscriber()
            arrived.set()

        nursery.start_soon(wait)
        await trio.testing.wait_all_tasks_blocked()  # the waiter is parked before the SUB comes
        async with raw_socket(zmq.SUB, publisher.endpoint) as sub:
            sub.sock.setsockopt(zmq.SUBSCRIBE, b"")
            with trio.fail_after(10):
                await arrived.wait()
            # Asked while the SUB is open: once it closes, its unsubscription may be counted.
            assert publisher.statistics().subscriptions == 1


async def test_endpoints_report_the_ports_really_bound() -> None:
    async with tskv.open_publisher(config()) as publisher:
        assert publisher.endpoint.startswith("tcp://127.0.0.1:")
        assert publisher.replay_endpoint is not None
        ports = {publisher.endpoint.rsplit(":", 1)[1], publisher.replay_endpoint.rsplit(":", 1)[1]}
        assert "*" not in ports and "0" not in ports and len(ports) == 2


async def test_ten_batches_arrive_as_seqs_0_to_9() -> None:
    async with tskv.open_publisher(config()) as publisher, subscribed(publisher) as sub:
        for n in range(10):
            await publisher.publish(events(n))
        received = [await receive_batch(sub) for _ in range(10)]
    assert [seq for _, seq, _ in received] == list(range(10))
    assert [batch.events for _, _, batch in received] == [events(n) for n in range(10)]


async def test_empty_round_publishes_nothing() -> None:
    async with tskv.open_publisher(config()) as publisher, subscribed(publisher) as sub:
        await publisher.publish([])
        publisher.publish_nowait([])
        await publisher.publish(events(1))
        _, seq, batch = await receive_batch(sub)
    assert seq == 0 and batch.events == [BlockRemoved([1])]
    assert publisher.statistics().published == 1


async def test_replay_from_10_after_19_batches_returns_10_to_18_then_end() -> None:
    async with tskv.open_publisher(config()) as publisher, subscribed(publisher) as sub:
        for n in range(19):
            await publisher.publish(events(n))
        for _ in range(19):
            await receive_batch(sub)  # all sent, so all buffered
        assert publisher.replay_endpoint is not None
        async with raw_socket(zmq.DEALER, publisher.replay_endpoint) as dealer:
            replies = await request_replay(dealer, 10)
        stats = publisher.statistics()
    assert [seq for seq, _ in replies] == list(range(10, 19))
    assert [tskv.decode_batch(payload).events for _, payload in replies] == [
        events(n) for n in range(10, 19)
    ]
    assert (stats.replay.requests, stats.replay.completed, stats.replay.batches) == (1, 1, 9)


async def test_replay_reads_short_and_long_start_seq_frames() -> None:
    async with tskv.open_publisher(config()) as publisher, subscribed(publisher) as sub:
        for n in range(5):
            await publisher.publish(events(n))
        for _ in range(5):
            await receive_batch(sub)
        assert publisher.replay_endpoint is not None
        async with raw_socket(zmq.DEALER, publisher.replay_endpoint) as dealer:
            said = EPOCH_MARK + publisher.epoch.to_bytes(8, "big")
            for start, expected, end in [
                (b"\x03", [3, 4], b""),
                (b"\xaa" * 4 + b"\x00" * 7 + b"\x02", [2, 3, 4], b""),
                (b"", list(range(5)), b""),
                (bytes(8) + (1).to_bytes(8, "big"), [1, 2, 3, 4], said),  # tskv's form
            ]:
                await dealer.send([b"", start])
                seqs = []
                while True:
                    frames = await dealer.receive()
                    if frames[1] == b"\xff" * 8:
                        # the end marker: empty as vLLM's, but for tskv's own clients, whom
                        # it tells this incarnation's epoch
                        assert frames == [b"", b"\xff" * 8, end]
                        break
                    seqs.append(int.from_bytes(frames[1], "big"))
                assert seqs == expected, start


async def test_replay_beyond_the_buffer_returns_only_what_it_holds() -> None:
    async with (
        tskv.open_publisher(config(buffer_steps=5)) as publisher,
        subscribed(publisher) as sub,
    ):
        for n in range(12):
            await publisher.publish(events(n))
        for _ in range(12):
            await receive_batch(sub)
        assert publisher.replay_endpoint is not None
        async with raw_socket(zmq.DEALER, publisher.replay_endpoint) as dealer:
            assert [seq for seq, _ in await request_replay(dealer, 0)] == [7, 8, 9, 10, 11]
            assert await request_replay(dealer, 12) == []  # nothing at or after: end alone
        stats = publisher.statistics()
    assert (stats.oldest_seq, stats.next_seq) == (7, 12)


async def test_a_topic_filter_sees_only_its_topic() -> None:
    async with (
        tskv.open_publisher(config(topic="kv-a", replay_endpoint=None)) as publisher,
        subscribed(publisher, b"kv-a") as wanted,
        subscribed(publisher, b"") as other,
    ):
        # `other` proves its connection by subscribing to everything first, then switches to a
        # topic this publisher never sends; the unsubscribe arrives after the new subscription.
        other.sock.setsockopt(zmq.SUBSCRIBE, b"kv-b")
        other.sock.setsockopt(zmq.UNSUBSCRIBE, b"")
        with trio.fail_after(10):
            # no event marks an unsubscribe; the statistics are what can be observed
            while publisher.statistics().subscriptions != 1:  # noqa: ASYNC110
                await trio.sleep(0.005)
        for n in range(3):
            await publisher.publish(events(n))
        received = [await receive_batch(wanted) for _ in range(3)]
        with trio.move_on_after(0.2):  # a bounded look for what must not come
            extra = await other.receive()
            raise AssertionError(f"topic filter let through {extra}")
    assert [(topic, seq) for topic, seq, _ in received] == [(b"kv-a", n) for n in range(3)]


async def test_rank_1_publishes_on_port_plus_1_with_rank_in_payload() -> None:
    # The test's SUB binds; an endpoint without * makes the publisher connect to it.
    async with raw_socket(zmq.SUB, LOOPBACK, bind=True) as sub:
        sub.sock.setsockopt(zmq.SUBSCRIBE, b"")
        port = int(sub.sock.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1])
        base = KVEventsConfig(endpoint=f"tcp://127.0.0.1:{port - 1}")
        async with tskv.open_publisher(base, dp_rank=1) as publisher:
            assert publisher.endpoint == f"tcp://127.0.0.1:{port}"
            async with trio.open_nursery() as nursery:
                # A bound SUB sends its subscription only while it is being read: receive first.
                received: list[tuple[bytes, int, tskv.KVEventBatch]] = []

                async def receive_one() -> None:
                    received.append(await receive_batch(sub))

                nursery.start_soon(receive_one)
                with trio.fail_after(10):
                    await publisher.wait_for_subscriber()
                await publisher.publish(events(7))
    [(_, seq, batch)] = received
    assert (seq, batch.attn_dp_rank) == (0, 1)


async def test_inproc_rank_gets_its_own_name() -> None:
    name = inproc_name("rank")
    async with tskv.open_publisher(KVEventsConfig(endpoint=name), dp_rank=2) as publisher:
        assert publisher.endpoint == f"{name}_dp2"


async def test_ten_thousand_batches_of_100_events_arrive_in_order() -> None:
    payload_events = [BlockStored([n, n + 1], n, list(range(32)), 16) for n in range(100)]
    count = 10_000
    cfg = config(hwm=count + 10, replay_endpoint=None)
    async with (
        tskv.open_publisher(cfg) as publisher,
        subscribed(publisher) as sub,
        trio.open_nursery() as nursery,
    ):

        async def produce() -> None:
            for _ in range(count):
                await publisher.publish(payload_events)

        nursery.start_soon(produce)
        seqs = []
        with trio.fail_after(120):
            for _ in range(count):
                frames = await sub.receive()
                seqs.append(int.from_bytes(frames[1], "big"))
        last = tskv.decode_batch(frames[2])
    assert seqs == list(range(count))
    assert len(last.events) == 100


async def test_publish_nowait_raises_when_full_and_publish_waits_then_resumes() -> None:
    cfg = config(max_queue_size=3, replay_endpoint=None)
    async with tskv.open_publisher(cfg) as publisher, subscribed(publisher) as sub:
        accepted = 0
        with pytest.raises(trio.WouldBlock):
            for n in range(10):  # no checkpoint here, so the publish task cannot drain
                publisher.publish_nowait(events(n))
                accepted += 1
        assert 3 <= accepted <= 4  # 3 queued, plus one handed straight to the waiting task
        assert publisher.statistics().queued == 3
        await publisher.publish(events(accepted))  # waits for room, then queues
        received = [await receive_batch(sub) for _ in range(accepted + 1)]
    assert [batch.events[0] for _, _, batch in received] == [
        BlockRemoved([n]) for n in range(accepted + 1)
    ]
    assert [seq for _, seq, _ in received] == list(range(accepted + 1))


async def test_publishing_after_close_raises_a_clear_error() -> None:
    async with tskv.open_publisher(config()) as publisher:
        pass
    with pytest.raises(PublisherClosedError, match="publish inside the `async with"):
        await publisher.publish(events(1))
    with pytest.raises(PublisherClosedError):
        publisher.publish_nowait(events(1))


replay_requests = st.lists(st.binary(max_size=12), min_size=0, max_size=5)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(requests=st.lists(replay_requests, min_size=1, max_size=8))
async def test_arbitrary_replay_requests_never_stop_the_publisher(
    requests: list[list[bytes]],
) -> None:
    async with tskv.open_publisher(config()) as publisher, subscribed(publisher) as sub:
        assert publisher.replay_endpoint is not None
        async with raw_socket(zmq.DEALER, publisher.replay_endpoint) as dealer:
            for n, request in enumerate(requests):
                if request:
                    await dealer.send(request)
                await publisher.publish(events(n))
                assert (await receive_batch(sub))[1] == n
        # the replay socket still answers a well-formed request after all that (from a fresh
        # client, so answers to the requests above cannot be mistaken for this one's)
        async with raw_socket(zmq.DEALER, publisher.replay_endpoint) as fresh:
            ok = [seq for seq, _ in await request_replay(fresh, 0)]
        stats = publisher.statistics()
    assert ok[-1] == len(requests) - 1
    assert stats.published == len(requests)


async def test_invalid_requests_are_counted_and_logged_with_a_rate_limit(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="tskv"):
        async with tskv.open_publisher(config()) as publisher, subscribed(publisher) as sub:
            assert publisher.replay_endpoint is not None
            async with raw_socket(zmq.DEALER, publisher.replay_endpoint) as dealer:
                for _ in range(50):
                    await dealer.send([b"no delimiter"])
                await publisher.publish(events(1))
                await receive_batch(sub)
                assert await request_replay(dealer, 0) != []  # the requests above came first
            stats = publisher.statistics()
    assert stats.replay.invalid == 50
    warnings = [r for r in caplog.records if "invalid replay request" in r.getMessage()]
    assert 1 <= len(warnings) < 5


async def test_replay_to_a_slow_client_is_not_truncated_at_the_hwm() -> None:
    cfg = config(hwm=10, buffer_steps=2000)
    async with tskv.open_publisher(cfg) as publisher:
        for n in range(2000):  # nobody subscribed: only the replay buffer keeps these
            await publisher.publish(events(n))
        await trio.testing.wait_all_tasks_blocked()
        assert publisher.statistics().published == 2000
        assert publisher.replay_endpoint is not None
        async with (
            subscribed(publisher) as sub,
            raw_socket(zmq.DEALER, publisher.replay_endpoint) as dealer,
        ):
            dealer.sock.setsockopt(zmq.RCVHWM, 5)
            await dealer.send([b"", (0).to_bytes(8, "big")])
            await trio.testing.wait_all_tasks_blocked()  # let the pipes fill up
            seqs = []
            with trio.fail_after(30):
                while True:
                    frames = await dealer.receive()
                    if frames[1] == b"\xff" * 8:
                        break
                    seqs.append(int.from_bytes(frames[1], "big"))
                    if len(seqs) % 100 == 0:  # live batches keep flowing during the replay
                        await publisher.publish(events(len(seqs)))
                        _, _, live = await receive_batch(sub)
                        assert live.events == events(len(seqs))
    assert seqs == list(range(2000))


async def test_a_replay_client_that_leaves_is_abandoned_cleanly() -> None:
    # inproc: no kernel buffers, so 500 replies cannot all be in flight before it leaves
    cfg = config(
        endpoint=inproc_name("leaves-live"),
        replay_endpoint=inproc_name("leaves-replay"),
        hwm=10,
        buffer_steps=500,
        replay_client_timeout=0.2,
    )
    async with (
        tskv.open_publisher(cfg) as publisher,
        subscribed(publisher) as sub,
    ):
        for n in range(500):
            await publisher.publish(events(n))
        await trio.testing.wait_all_tasks_blocked()
        assert publisher.statistics().published == 500
        assert publisher.replay_endpoint is not None
        dealer = TrioSocket(zmq.Context.instance().socket(zmq.DEALER))
        dealer.sock.setsockopt(zmq.RCVHWM, 5)
        dealer.sock.connect(publisher.replay_endpoint)
        await dealer.send([b"", (0).to_bytes(8, "big")])
        await dealer.receive()
        dealer.close()
        # the client is gone mid-replay; live publishing goes on
        with trio.fail_after(10):
            # an abandoned replay is visible only in the statistics
            while publisher.statistics().replay.abandoned == 0:  # noqa: ASYNC110
                await trio.sleep(0.01)
        await publisher.publish(events(1000))
        while True:  # the PUB's small HWM may have dropped some of the 500 live ones
            _, seq, _ = await receive_batch(sub)
            if seq == 500:
                break
    assert publisher.statistics().replay.completed == 0


async def test_publishing_a_foreign_object_names_the_fix() -> None:
    async with tskv.open_publisher(config()) as publisher:
        with pytest.raises(TypeError, match="scheduler_kv_event_to_wire_event"):
            await publisher.publish([BlockRemoved([1]), object()])  # type: ignore[list-item]
        assert publisher.statistics().published == 0


async def test_a_replay_request_flood_does_not_hold_up_live_batches() -> None:
    import threading

    async with tskv.open_publisher(config()) as publisher, subscribed(publisher) as sub:
        assert publisher.replay_endpoint is not None
        stop = threading.Event()
        flooded = [0]

        def flood(endpoint: str) -> None:  # one client, as many requests as the socket takes
            dealer = zmq.Context.instance().socket(zmq.DEALER)
            dealer.connect(endpoint)
            request = [b"", (0).to_bytes(8, "big")]
            while not stop.is_set():
                try:
                    dealer.send_multipart(request, zmq.NOBLOCK)
                    flooded[0] += 1
                except zmq.Again:
                    stop.wait(0.0001)
            dealer.close(linger=0)

        thread = threading.Thread(target=flood, args=(publisher.replay_endpoint,))
        thread.start()
        try:
            with trio.fail_after(10):
                while publisher.statistics().replay.requests < 1000:  # noqa: ASYNC110
                    await trio.sleep(0.001)  # the flood is under way
            # The flood goes on for as long as this test runs; live batches must not wait
            # for it to end (they once waited 5 s behind 100,000 requests).
            with trio.fail_after(10):
                for n in range(200):
                    await publisher.publish(events(n))
                    assert (await receive_batch(sub))[1] == n
        finally:
            stop.set()
            await trio.to_thread.run_sync(thread.join)
        stats = publisher.statistics()
    assert stats.replay.refused > 0 and stats.replay.requests <= flooded[0]


async def test_a_replay_client_that_never_reads_holds_a_bounded_pipe_whatever_the_hwm() -> None:
    from tskv.shells.publisher import REPLAY_PIPE

    endpoint = inproc_name("idle-replay")
    cfg = KVEventsConfig(
        endpoint=inproc_name("idle-live"),
        replay_endpoint=endpoint,
        hwm=100_000,
        buffer_steps=5000,
        replay_client_timeout=0.3,
    )
    async with tskv.open_publisher(cfg) as publisher:
        for n in range(5000):
            await publisher.publish(events(n))
        await trio.testing.wait_all_tasks_blocked()
        idle = zmq.Context.instance().socket(zmq.DEALER)
        try:
            idle.setsockopt(zmq.RCVHWM, 1)
            idle.connect(endpoint)
            idle.send_multipart([b"", (0).to_bytes(8, "big")])
            with trio.fail_after(10):
                while publisher.statistics().replay.abandoned == 0:  # noqa: ASYNC110
                    await trio.sleep(0.01)  # visible only in the statistics
            stats = publisher.statistics()
        finally:
            idle.close(linger=0)
    # ZeroMQ holds at most REPLAY_PIPE replies for it here (plus its own queue of 1), so an
    # idle client costs the same bounded memory whether hwm is 10 or 100,000.
    assert stats.replay.batches <= REPLAY_PIPE + 1, stats
    assert stats.replay.abandoned == 1


async def test_an_oversized_replay_request_disconnects_its_sender_unread() -> None:
    from zmq.utils.monitor import parse_monitor_message

    async with tskv.open_publisher(config()) as publisher:
        await publisher.publish(events(0))
        assert publisher.replay_endpoint is not None
        async with raw_socket(zmq.DEALER, publisher.replay_endpoint) as big:
            monitor = big.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            try:
                await big.send([b"", b"\x00" * 1_000_000])  # a valid shape, 1 MB long
                with trio.fail_after(10):
                    while not monitor.poll(0):  # noqa: ASYNC110
                        await trio.sleep(0.01)  # the publisher hangs up on it
                assert parse_monitor_message(monitor.recv_multipart())["event"] == (
                    zmq.EVENT_DISCONNECTED
                )
            finally:
                big.sock.disable_monitor()
                monitor.close(linger=0)
        async with raw_socket(zmq.DEALER, publisher.replay_endpoint) as fine:
            assert [seq for seq, _ in await request_replay(fine, 0)] == [0]
        stats = publisher.statistics()
    assert (stats.replay.requests, stats.replay.invalid) == (1, 0)


async def test_an_error_from_the_body_keeps_the_cause_it_was_raised_with() -> None:
    with pytest.raises(KeyError) as raised:
        async with tskv.open_publisher(config()):
            try:
                raise ValueError("the real reason")
            except ValueError as exc:
                raise KeyError("what the caller sees") from exc
    assert isinstance(raised.value.__cause__, ValueError)
    assert str(raised.value.__cause__) == "the real reason"


async def test_any_replay_rate_the_config_accepts_the_publisher_opens_with() -> None:
    async with tskv.open_publisher(config(replay_rate=0.0001)) as publisher:
        assert publisher.config.replay_rate == 0.0001
    with pytest.raises(tskv.ConfigError, match="replay_rate = 0: must be a finite number"):
        config(replay_rate=0)
    with pytest.raises(tskv.ConfigError, match="replay_rate = inf"):
        config(replay_rate=float("inf"))


async def test_every_socket_monitor_is_stopped_before_its_socket_closes() -> None:
    """Closed first, a socket can no longer stop its monitor, and what its teardown reports
    goes to a monitor nobody reads: libzmq's I/O thread blocks on it, and every socket of the
    context with it (a subscriber opened next never connected)."""
    config = KVEventsConfig(endpoint=LOOPBACK, replay_endpoint=LOOPBACK)
    async with (
        tskv.open_publisher(config) as publisher,
        tskv.open_subscriber(publisher.endpoint, publisher.replay_endpoint) as sub,
    ):
        with trio.fail_after(10):
            await publisher.wait_for_subscriber()
        monitors = [*publisher._security.monitors, *sub._stream._monitors]
        assert len(monitors) == 3 and not any(monitor.stopped for monitor in monitors)
    assert all(monitor.stopped for monitor in monitors)


async def test_a_publisher_that_connects_out_says_so_when_no_subscriber_binds(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An explicit address makes a publisher connect (TokenSpeed's rule), as a subscriber
    does: with both sides connecting, each would otherwise wait without a word."""
    from tskv.shells import publisher as publisher_module

    monkeypatch.setattr(publisher_module, "UNANSWERED_AFTER", 0.2)
    with refusing_endpoint() as free, caplog.at_level(logging.INFO, logger="tskv"):
        async with tskv.open_publisher(KVEventsConfig(endpoint=free)):
            with trio.fail_after(10):
                while "no subscriber has answered" not in caplog.text:  # noqa: ASYNC110
                    await trio.sleep(0.05)  # a log line is all there is to wait for
    assert f"publishing KV events on {free} (connecting out" in caplog.text
    assert f"no subscriber has answered on {free} for 0.2 s" in caplog.text
    assert "set bind=True to bind it here instead" in caplog.text


async def test_a_publisher_that_connects_out_to_a_binding_subscriber_is_not_reported(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tskv.shells import publisher as publisher_module

    monkeypatch.setattr(publisher_module, "UNANSWERED_AFTER", 0.2)
    with caplog.at_level(logging.WARNING, logger="tskv"):
        async with tskv.open_subscriber("tcp://127.0.0.1:*") as sub:
            assert "*" not in sub.endpoint  # as really bound
            async with tskv.open_publisher(KVEventsConfig(endpoint=sub.endpoint)) as publisher:
                await publisher.wait_for_subscriber()
                await publisher.publish(events(0))
                with trio.fail_after(10):
                    assert (await sub.__anext__())[0] == 0
                await trio.sleep(0.4)  # the time the warning had to come: it must not
    assert "has answered" not in caplog.text
